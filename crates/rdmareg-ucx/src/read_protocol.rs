//! The served read protocol: what a consumer's key says, what it asks an
//! owner for, and what the owner replies.
//!
//! UCX's emulated GET serves any raw address a peer names, so this engine's
//! context has no `UCP_FEATURE_RMA` and a read is a request the owner's
//! engine checks against its live registrations (`progress::serve`; the
//! crate docs and `docs/safety.md` say why).
//!
//! # Formats
//!
//! All integers are little-endian. Every format starts with a version byte
//! so a later release can change it; a version this build does not know is
//! refused, never guessed at.
//!
//! **Key** ([`ServedKey`], the `packed_key` of a `BackendRegion`, carried in
//! descriptors): `magic "RQ"`, `version = 1`, `lane = 0` (owner-served),
//! `region_id: u64`, `capability: [u8; 16]` — 28 bytes. The region id is
//! never reused by an engine, so a descriptor of an earlier registration
//! names nothing; the capability is 16 random bytes per registration, so a
//! peer cannot name a registration it was not given a descriptor for.
//!
//! **Same-host key** ([`SameHostKey`], lane 2: what an owner with the
//! same-host direct-read lane issues instead): the 28 bytes above with
//! `lane = 2`, then `region_addr: u64`, `region_len: u64` (the mapped
//! range), `release_slot: u32` (the registration's slot in the owner's
//! release table, see `release_table`), `ucx_key_len: u16` (at least 1)
//! and that many bytes of the owner's packed UCX remote key for its
//! direct-read context. A consumer that cannot reach the owner's direct
//! lane or its release table reads through the owner with the served
//! part; one that can copies one-sided, and counts the copy only if the
//! release slot held the key's release tag before and after it; only the
//! consumer checks the range against `region_addr`/`region_len`.
//! [`ReadKey`] decodes either lane.
//!
//! **Writable same-host key** (lane 4, issued instead of lane 2 for a
//! registration peers may write): the lane-2 layout with one more byte
//! after `release_slot`, the access the registration grants (`1` read,
//! `2` write, `3` both; `rdmareg_core::Access`). A consumer copies into
//! it one-sided only under the release slot's lock (`release_table`,
//! "Writers"), and reads it one-sided only if the byte grants reads;
//! everything else goes through the owner, which checks the access
//! itself. A registration peers may only read keeps lane 2, which
//! earlier builds read; a writable one's descriptor is one they refuse
//! anyway (its version carries the access).
//!
//! **Lease key** (lane 3, what `RdmaBackend::lease` issues): the 28 bytes
//! of a served key with `lane = 3` and the lease's own capability in place
//! of the registration's. It is read through the owner on every lane,
//! since only the owner can refuse a read once the lease ended; the lane
//! byte lets a reader's release refuse a key that is no lease.
//!
//! **Lane 1** is the same-host key of earlier releases: the lane-2 layout
//! without `release_slot`. Nothing tells its reader when the registration
//! is gone, so it decodes as the served key it starts with and is read
//! through the owner.
//!
//! **Request** ([`ReadRequest`], consumer → owner, the active-message
//! header) and **reply** ([`ReadReply`], owner → consumer; the bytes follow
//! as its payload when the status is [`ReplyStatus::Served`]): the engine
//! kit's formats (`rdmareg_engine::served::wire`, which encodes and decodes
//! them for these types), 52 and 20 bytes.
//!
//! **Reply status codes.** `0` is served; every other code is a refusal
//! and carries `length = 0`. Codes are only ever added, never reassigned;
//! an unknown code is a refusal ([`Refusal::Unrecognized`]), so an older
//! consumer does not wait out its deadline.
//!
//! Decoding never panics and refuses trailing or missing bytes: these come
//! from peers.

use rdmareg_core::Access;
use rdmareg_engine::served::Read;
use rdmareg_engine::served::wire;
use thiserror::Error;

/// The text of the error a read refused as [`Refusal::Busy`] gets.
pub use rdmareg_engine::served::BUSY_TEXT;
/// Why an owner refused a read; the engine kit's, which also turns it into
/// the caller's error (`From<Refusal> for RdmaError`). Refusals this format
/// has no code for (a libfabric driver's) are sent as
/// [`Refusal::Malformed`].
pub use rdmareg_engine::served::Refusal;

/// Active-message id of a read request (consumer → owner).
pub const READ_REQUEST_AM_ID: u32 = 0x5251;
/// Active-message id of a read reply (owner → consumer).
pub const READ_REPLY_AM_ID: u32 = 0x5252;
/// Active-message id of a notice (reader → owner); the message is the
/// engine kit's notice format (`rdmareg_engine::notices::wire`), sent as
/// the payload, eager only.
pub const NOTICE_AM_ID: u32 = 0x5255;
/// Active-message id of a write request (writer → owner): the engine
/// kit's write request as the header (`rdmareg_engine::served::wire`), the
/// bytes to write as the payload. Its reply is a read reply
/// ([`READ_REPLY_AM_ID`]) with no payload, its request id's top bit set.
pub const WRITE_REQUEST_AM_ID: u32 = 0x5256;
/// Active-message id of a write list (writer → owner): the engine kit's
/// write list header (`rdmareg_engine::served::wire`), the writes' bytes
/// back to back as the payload, eager only.
pub const WRITE_LIST_REQUEST_AM_ID: u32 = 0x5257;
/// Active-message id of a write list's reply (owner → writer): a list
/// reply header with one entry per write of the list, no payload.
pub const WRITE_LIST_REPLY_AM_ID: u32 = 0x5258;

const KEY_MAGIC: [u8; 2] = *b"RQ";
const VERSION: u8 = 1;
const LANE_OWNER_SERVED: u8 = 0;
/// Same-host keys of earlier releases, without a release slot.
const LANE_SAME_HOST_UNCHECKED: u8 = 1;
const LANE_SAME_HOST: u8 = 2;
const LANE_LEASE: u8 = 3;
const LANE_SAME_HOST_WRITABLE: u8 = 4;
/// Bytes of a lane-2 [`SameHostKey`] before its UCX key.
const SAME_HOST_FIXED_LEN: usize = KEY_LEN + 8 + 8 + 4 + 2;
/// Bytes of a lane-4 [`SameHostKey`] before its UCX key: one more, the
/// access.
const WRITABLE_FIXED_LEN: usize = SAME_HOST_FIXED_LEN + 1;
/// Bytes of a lane-1 key before its UCX key.
const UNCHECKED_FIXED_LEN: usize = KEY_LEN + 8 + 8 + 2;

/// Length of an encoded [`ServedKey`].
pub const KEY_LEN: usize = 28;
/// Length of an encoded [`ReadRequest`].
pub const REQUEST_LEN: usize = wire::REQUEST_LEN;
/// Length of an encoded [`ReadReply`].
pub const REPLY_LEN: usize = wire::REPLY_LEN;

/// What is wrong with bytes that were meant to be one of this module's
/// formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// The bytes are not as long as the format.
    #[error("expected {expected} bytes, got {actual}")]
    Length {
        /// The format's length.
        expected: usize,
        /// What arrived.
        actual: usize,
    },
    /// The key does not start with this engine's magic: it was packed by
    /// another backend or another UCX integration.
    #[error("not an owner-served key (wrong magic)")]
    Magic,
    /// A version this build does not know.
    #[error("unknown version {0}")]
    Version(u8),
    /// A key naming a lane this build does not serve.
    #[error("unknown lane {0}")]
    Lane(u8),
    /// A reserved byte is not zero.
    #[error("reserved bytes are not zero")]
    Reserved,
    /// A same-host key's access byte names no access this build knows.
    #[error("unknown access bits {0:#04x}")]
    Access(u8),
    /// A reply status this build does not know. Version-1 replies never
    /// produce it (every non-zero status is a refusal, known or not); kept
    /// for formats that may reserve codes.
    #[error("unknown reply status {0}")]
    Status(u8),
    /// A refusal whose header claims a payload (refusals carry none).
    #[error("a refusal (status {status}) claims a {length}-byte payload")]
    RefusalWithPayload {
        /// The refusal's status code.
        status: u8,
        /// The length it claims.
        length: u64,
    },
}

impl From<wire::ProtocolError> for ProtocolError {
    fn from(err: wire::ProtocolError) -> ProtocolError {
        match err {
            wire::ProtocolError::Length { expected, actual } => {
                ProtocolError::Length { expected, actual }
            }
            wire::ProtocolError::Version(version) => ProtocolError::Version(version),
            wire::ProtocolError::RefusalWithPayload { status, length } => {
                ProtocolError::RefusalWithPayload { status, length }
            }
            _ => ProtocolError::Reserved,
        }
    }
}

/// A registration's identity as a consumer presents it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServedKey {
    /// The owner's region id (never reused by the owner's engine).
    pub region_id: u64,
    /// The registration's random capability.
    pub capability: [u8; 16],
}

impl ServedKey {
    /// What the owner's release table holds for this registration while it
    /// is live: the first 8 bytes of its random capability, never 0 (0 is
    /// an empty slot). Region ids and slots restart with every engine, so
    /// only a value drawn per registration tells a stale key from a later
    /// registration of another engine of the same process.
    pub fn release_tag(&self) -> u64 {
        let mut first = [0u8; 8];
        first.copy_from_slice(&self.capability[..8]);
        u64::from_le_bytes(first).max(1)
    }

    /// The 28-byte encoding.
    pub fn encode(&self) -> [u8; KEY_LEN] {
        let mut out = [0u8; KEY_LEN];
        out[0..2].copy_from_slice(&KEY_MAGIC);
        out[2] = VERSION;
        out[3] = LANE_OWNER_SERVED;
        out[4..12].copy_from_slice(&self.region_id.to_le_bytes());
        out[12..28].copy_from_slice(&self.capability);
        out
    }

    /// The 28-byte encoding of a lease key (lane 3): this key's region with
    /// the lease's capability in `capability`.
    pub fn encode_lease(&self) -> [u8; KEY_LEN] {
        let mut out = self.encode();
        out[3] = LANE_LEASE;
        out
    }

    /// Decodes untrusted bytes that must be a lease key.
    pub fn decode_lease(bytes: &[u8]) -> Result<ServedKey, ProtocolError> {
        let bytes = exact::<KEY_LEN>(bytes)?;
        if bytes[3] != LANE_LEASE {
            return Err(ProtocolError::Lane(bytes[3]));
        }
        let mut served = *bytes;
        served[3] = LANE_OWNER_SERVED;
        ServedKey::decode(&served)
    }

    /// Decodes untrusted key bytes.
    pub fn decode(bytes: &[u8]) -> Result<ServedKey, ProtocolError> {
        let bytes = exact::<KEY_LEN>(bytes)?;
        if bytes[0..2] != KEY_MAGIC {
            return Err(ProtocolError::Magic);
        }
        if bytes[2] != VERSION {
            return Err(ProtocolError::Version(bytes[2]));
        }
        if bytes[3] != LANE_OWNER_SERVED {
            return Err(ProtocolError::Lane(bytes[3]));
        }
        Ok(ServedKey {
            region_id: u64_at(bytes, 4),
            capability: capability_at(bytes, 12),
        })
    }
}

/// A same-host key (lane 2, or lane 4 when the registration may be
/// written): the served key, the mapped range, the registration's release
/// slot, what it grants, and the owner's packed UCX key for its direct
/// lane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SameHostKey {
    /// What a consumer presents when it reads through the owner.
    pub served: ServedKey,
    /// First mapped byte, as an address in the owner's process.
    pub region_addr: u64,
    /// Mapped length.
    pub region_len: u64,
    /// The registration's slot in the owner's release table: it holds
    /// [`SameHostKey::release_tag`] while the registration is live.
    pub release_slot: u32,
    /// What the registration grants: lane 2 keys grant reads alone.
    pub access: Access,
    /// The owner's packed UCX remote key (direct-read context).
    pub ucx_key: Vec<u8>,
}

impl SameHostKey {
    /// The encoding (lane 2 for a read-only registration, else lane 4);
    /// `None` if the UCX key is empty or longer than 65535 bytes (UCX
    /// packs neither).
    pub fn encode(&self) -> Option<Vec<u8>> {
        let ucx_len = u16::try_from(self.ucx_key.len()).ok().filter(|&n| n > 0)?;
        let mut out = Vec::with_capacity(WRITABLE_FIXED_LEN + self.ucx_key.len());
        out.extend_from_slice(&self.served.encode());
        out[3] = if self.access == Access::Read {
            LANE_SAME_HOST
        } else {
            LANE_SAME_HOST_WRITABLE
        };
        out.extend_from_slice(&self.region_addr.to_le_bytes());
        out.extend_from_slice(&self.region_len.to_le_bytes());
        out.extend_from_slice(&self.release_slot.to_le_bytes());
        if self.access != Access::Read {
            out.push(self.access.to_bits());
        }
        out.extend_from_slice(&ucx_len.to_le_bytes());
        out.extend_from_slice(&self.ucx_key);
        Some(out)
    }

    /// What the owner's release table holds for this key's registration
    /// while it is live. A lane-2 key's is its served part's
    /// ([`ServedKey::release_tag`]), as earlier builds read it. A writable
    /// key's is a one-way hash of that, the mapped range and the access,
    /// so that a key whose range or access was altered names no live
    /// registration and is never written one-sided, even one altered on
    /// purpose: whoever holds a key knows every input, so only a hash
    /// nobody can solve for a chosen range keeps the binding.
    pub fn release_tag(&self) -> u64 {
        Self::tag_for(&self.served, self.region_addr, self.region_len, self.access)
    }

    /// [`SameHostKey::release_tag`] of the key these fields make.
    pub fn tag_for(served: &ServedKey, region_addr: u64, region_len: u64, access: Access) -> u64 {
        let base = served.release_tag();
        if access == Access::Read {
            return base;
        }
        use sha2::Digest as _;
        let mut hash = sha2::Sha256::new();
        hash.update(WRITABLE_TAG_DOMAIN);
        for word in [base, region_addr, region_len, u64::from(access.to_bits())] {
            hash.update(word.to_le_bytes());
        }
        let digest = hash.finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        u64::from_le_bytes(first).max(1)
    }

    /// Whether `[address, address + length)` lies inside the mapped range.
    pub fn covers(&self, address: u64, length: u64) -> bool {
        let region_end = self.region_addr.checked_add(self.region_len);
        let end = address.checked_add(length);
        matches!((region_end, end), (Some(region_end), Some(end))
            if address >= self.region_addr && end <= region_end)
    }
}

/// Prefixes what a writable key's release tag hashes. The hash is one-way
/// because whoever holds a key knows every field it covers: with a mix
/// that can be undone, a holder could solve for a range that keeps the
/// tag. Finding other fields under a 64-bit SHA-256 prefix takes about
/// 2^64 hashes.
const WRITABLE_TAG_DOMAIN: &[u8] = b"rdmareg writable same-host key tag v1";

/// A key of either lane.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReadKey {
    /// Lane 0: read through the owner.
    Served(ServedKey),
    /// Lanes 2 and 4: read (if the key grants it) or written (lane 4,
    /// if it grants that) one-sided where the owner's direct lane and
    /// release table are reachable, else through the owner.
    SameHost(SameHostKey),
}

impl ReadKey {
    /// Decodes untrusted key bytes of either lane. The UCX key inside a
    /// lane-1 key is only delimited here; its layout is validated before
    /// UCX sees it.
    pub fn decode(bytes: &[u8]) -> Result<ReadKey, ProtocolError> {
        let fixed_len = match bytes.get(3) {
            Some(&LANE_SAME_HOST) => SAME_HOST_FIXED_LEN,
            Some(&LANE_SAME_HOST_WRITABLE) => WRITABLE_FIXED_LEN,
            Some(&LANE_SAME_HOST_UNCHECKED) => UNCHECKED_FIXED_LEN,
            Some(&LANE_LEASE) => return ServedKey::decode_lease(bytes).map(ReadKey::Served),
            _ => return ServedKey::decode(bytes).map(ReadKey::Served),
        };
        if bytes.len() < fixed_len {
            return Err(ProtocolError::Length {
                expected: fixed_len,
                actual: bytes.len(),
            });
        }
        let mut served = [0u8; KEY_LEN];
        served.copy_from_slice(&bytes[..KEY_LEN]);
        served[3] = LANE_OWNER_SERVED;
        let served = ServedKey::decode(&served)?;
        let ucx_len = usize::from(u16::from_le_bytes([
            bytes[fixed_len - 2],
            bytes[fixed_len - 1],
        ]));
        let ucx_key = &bytes[fixed_len..];
        if ucx_len == 0 || ucx_key.len() != ucx_len {
            return Err(ProtocolError::Length {
                expected: fixed_len + ucx_len.max(1),
                actual: bytes.len(),
            });
        }
        if fixed_len == UNCHECKED_FIXED_LEN {
            // No release slot: read through the owner (module docs).
            return Ok(ReadKey::Served(served));
        }
        let access = if fixed_len == WRITABLE_FIXED_LEN {
            // A lane-4 key always grants a write: one that grants reads
            // alone is lane 2, so the encoding stays one per key.
            let bits = bytes[SAME_HOST_FIXED_LEN - 2];
            Access::from_bits(bits)
                .filter(|access| access.allows_write())
                .ok_or(ProtocolError::Access(bits))?
        } else {
            Access::Read
        };
        Ok(ReadKey::SameHost(SameHostKey {
            served,
            region_addr: u64::from_le_bytes(array_at(bytes, 28)),
            region_len: u64::from_le_bytes(array_at(bytes, 36)),
            release_slot: u32::from_le_bytes(array_at(bytes, 44)),
            access,
            ucx_key: ucx_key.to_vec(),
        }))
    }

    /// The part a consumer presents to the owner.
    pub fn served(&self) -> ServedKey {
        match self {
            ReadKey::Served(key) => *key,
            ReadKey::SameHost(key) => key.served,
        }
    }
}

/// A consumer's request to read `length` bytes at `address` of a
/// registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadRequest {
    /// Chosen by the consumer; echoed in the reply.
    pub request_id: u64,
    /// Which registration, and the proof of having been given it.
    pub key: ServedKey,
    /// First byte to read, as an address in the owner's process.
    pub address: u64,
    /// How many bytes.
    pub length: u64,
}

impl ReadRequest {
    /// The 52-byte encoding.
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        wire::encode_request(&self.to_read())
    }

    /// Decodes an untrusted request.
    pub fn decode(bytes: &[u8]) -> Result<ReadRequest, ProtocolError> {
        Ok(ReadRequest::from_read(wire::decode_request(bytes)?))
    }

    /// The request the engine kit's formats decoded as `read`.
    pub(crate) fn from_read(read: Read) -> ReadRequest {
        ReadRequest {
            request_id: read.request_id,
            key: ServedKey {
                region_id: read.region,
                capability: read.capability,
            },
            address: read.address,
            length: read.length,
        }
    }

    /// The request as the engine kit's formats take it.
    pub(crate) fn to_read(self) -> Read {
        Read {
            request_id: self.request_id,
            region: self.key.region_id,
            capability: self.key.capability,
            address: self.address,
            length: self.length,
        }
    }
}

/// How an owner replied to a read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyStatus {
    /// The bytes follow as the payload.
    Served,
    /// Refused, and why.
    Refused(Refusal),
}

impl ReplyStatus {
    /// The status code (`rdmareg_engine::served::wire` assigns them).
    pub(crate) fn code(self) -> u8 {
        match self {
            ReplyStatus::Served => 0,
            ReplyStatus::Refused(refusal) => wire::refusal_code(refusal),
        }
    }

    /// The status and length of a decoded result.
    pub(crate) fn of(result: Result<u64, Refusal>) -> (ReplyStatus, u64) {
        match result {
            Ok(length) => (ReplyStatus::Served, length),
            Err(refusal) => (ReplyStatus::Refused(refusal), 0),
        }
    }
}

/// An owner's reply to one [`ReadRequest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadReply {
    /// The request's id.
    pub request_id: u64,
    /// Served or refused.
    pub status: ReplyStatus,
    /// Payload length that follows (zero when refused).
    pub length: u64,
}

impl ReadReply {
    /// The 20-byte encoding.
    pub fn encode(&self) -> [u8; REPLY_LEN] {
        wire::encode_reply_fields(self.request_id, self.status.code(), self.length)
    }

    /// Decodes an untrusted reply. A refusal code this build does not know
    /// decodes as [`Refusal::Unrecognized`]; a refusal that claims a
    /// payload is refused.
    pub fn decode(bytes: &[u8]) -> Result<ReadReply, ProtocolError> {
        let reply = wire::Reply::decode(bytes)?;
        let (status, length) = ReplyStatus::of(reply.outcome);
        Ok(ReadReply {
            request_id: reply.request_id,
            status,
            length,
        })
    }
}

fn exact<const N: usize>(bytes: &[u8]) -> Result<&[u8; N], ProtocolError> {
    bytes.try_into().map_err(|_| ProtocolError::Length {
        expected: N,
        actual: bytes.len(),
    })
}

fn u64_at<const N: usize>(bytes: &[u8; N], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(word)
}

/// The `N` bytes at `at`; the caller checked that they are there.
fn array_at<const N: usize>(bytes: &[u8], at: usize) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&bytes[at..at + N]);
    out
}

fn capability_at<const N: usize>(bytes: &[u8; N], at: usize) -> [u8; 16] {
    let mut capability = [0u8; 16];
    capability.copy_from_slice(&bytes[at..at + 16]);
    capability
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Highest reply status code this build assigns.
    const LAST_ASSIGNED_STATUS: u8 = 9;
    /// The status code of [`Refusal::Malformed`].
    const MALFORMED_STATUS: u8 = 5;

    fn same_host_key() -> SameHostKey {
        SameHostKey {
            served: key(),
            region_addr: 0x1000,
            region_len: 0x2000,
            release_slot: 0x0102_0304,
            access: Access::Read,
            ucx_key: vec![0, 1, 2, 3, 4, 5, 6, 7, 8],
        }
    }

    /// A writable registration's key is lane 4 with its access; a lane-4
    /// key granting reads alone or nothing known is refused, so each key
    /// has one encoding.
    #[test]
    fn a_writable_same_host_key_carries_its_access() {
        for access in [Access::Write, Access::ReadWrite] {
            let writable = SameHostKey {
                access,
                ..same_host_key()
            };
            let bytes = writable.encode().unwrap();
            assert_eq!(bytes[3], LANE_SAME_HOST_WRITABLE);
            assert_eq!(bytes.len(), WRITABLE_FIXED_LEN + 9);
            assert_eq!(ReadKey::decode(&bytes), Ok(ReadKey::SameHost(writable)));
            assert!(ReadKey::decode(&bytes[..bytes.len() - 1]).is_err());
        }
        let mut bytes = SameHostKey {
            access: Access::Write,
            ..same_host_key()
        }
        .encode()
        .unwrap();
        for bits in [0, Access::Read.to_bits(), 4, 0xFF] {
            bytes[SAME_HOST_FIXED_LEN - 2] = bits;
            assert_eq!(ReadKey::decode(&bytes), Err(ProtocolError::Access(bits)));
        }
        // A read-only key stays lane 2, which earlier builds read.
        assert_eq!(same_host_key().encode().unwrap()[3], LANE_SAME_HOST);
    }

    /// A writable key's release tag binds its range and access: a key
    /// altered in either never matches the live registration's slot.
    #[test]
    fn a_writable_key_tag_changes_with_its_range_or_access() {
        let read_only = same_host_key();
        assert_eq!(read_only.release_tag(), read_only.served.release_tag());
        let writable = SameHostKey {
            access: Access::Write,
            ..same_host_key()
        };
        let tag = writable.release_tag();
        assert_ne!(tag, writable.served.release_tag());
        let altered = [
            SameHostKey {
                region_addr: writable.region_addr - 0x1000,
                ..writable.clone()
            },
            SameHostKey {
                region_len: writable.region_len + 1,
                ..writable.clone()
            },
            SameHostKey {
                access: Access::ReadWrite,
                ..writable.clone()
            },
        ];
        for key in altered {
            assert_ne!(key.release_tag(), tag, "{key:?}");
        }
    }

    #[test]
    fn a_lane_one_key_of_an_earlier_release_is_read_through_its_owner() {
        // The lane-2 layout without the release slot.
        let mut bytes = same_host_key().encode().unwrap();
        bytes.drain(44..48);
        bytes[3] = LANE_SAME_HOST_UNCHECKED;
        assert_eq!(ReadKey::decode(&bytes), Ok(ReadKey::Served(key())));
        assert!(ReadKey::decode(&bytes[..bytes.len() - 1]).is_err());
        assert!(ReadKey::decode(&bytes[..UNCHECKED_FIXED_LEN]).is_err());
    }

    /// A lease key reads through the owner, and only a lease key is one a
    /// release accepts.
    #[test]
    fn a_lease_key_reads_through_the_owner_and_is_told_apart() {
        let lease = key().encode_lease();
        assert_eq!(lease[3], LANE_LEASE);
        assert_eq!(ReadKey::decode(&lease), Ok(ReadKey::Served(key())));
        assert_eq!(ServedKey::decode_lease(&lease), Ok(key()));
        assert_eq!(
            ServedKey::decode_lease(&key().encode()),
            Err(ProtocolError::Lane(LANE_OWNER_SERVED))
        );
        assert!(ServedKey::decode_lease(&lease[..KEY_LEN - 1]).is_err());
        assert_eq!(
            ServedKey::decode(&lease),
            Err(ProtocolError::Lane(LANE_LEASE))
        );
    }

    #[test]
    fn keys_of_both_lanes_round_trip() {
        assert_eq!(ReadKey::decode(&key().encode()), Ok(ReadKey::Served(key())));
        let same_host = same_host_key();
        let bytes = same_host.encode().unwrap();
        assert_eq!(bytes.len(), SAME_HOST_FIXED_LEN + 9);
        assert_eq!(
            ReadKey::decode(&bytes),
            Ok(ReadKey::SameHost(same_host.clone()))
        );
        assert_eq!(ReadKey::decode(&bytes).unwrap().served(), key());
    }

    #[test]
    fn a_same_host_key_refuses_cut_padded_or_empty_ucx_keys() {
        let bytes = same_host_key().encode().unwrap();
        assert!(ReadKey::decode(&bytes[..bytes.len() - 1]).is_err());
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(ReadKey::decode(&longer).is_err());
        assert!(ReadKey::decode(&bytes[..SAME_HOST_FIXED_LEN]).is_err());
        assert!(ReadKey::decode(&bytes[..20]).is_err());
        let empty = SameHostKey {
            ucx_key: Vec::new(),
            ..same_host_key()
        };
        assert_eq!(empty.encode(), None);
        // A served key with lane 2 but nothing after it.
        let mut lane_two = key().encode();
        lane_two[3] = LANE_SAME_HOST;
        assert!(ReadKey::decode(&lane_two).is_err());
        // ServedKey alone still refuses lane 2.
        assert_eq!(
            ServedKey::decode(&lane_two),
            Err(ProtocolError::Lane(LANE_SAME_HOST))
        );
    }

    #[test]
    fn a_same_host_key_covers_only_its_mapped_range() {
        let k = same_host_key();
        assert!(k.covers(0x1000, 0x2000));
        assert!(k.covers(0x2fff, 1));
        assert!(!k.covers(0xfff, 1));
        assert!(!k.covers(0x2fff, 2));
        assert!(!k.covers(u64::MAX, 2));
        let wrapping = SameHostKey {
            region_addr: u64::MAX - 1,
            region_len: 4,
            ..k
        };
        assert!(!wrapping.covers(u64::MAX - 1, 1));
    }

    fn key() -> ServedKey {
        ServedKey {
            region_id: 7,
            capability: [0xA5; 16],
        }
    }

    #[test]
    fn a_key_round_trips_and_is_28_bytes() {
        let bytes = key().encode();
        assert_eq!(bytes.len(), 28);
        assert_eq!(ServedKey::decode(&bytes), Ok(key()));
    }

    #[test]
    fn a_ucx_packed_key_is_not_taken_for_a_served_key() {
        // A 9-byte UCX key of a tcp registration: md_map 0, host memory.
        let ucx_key = [0u8; 9];
        assert!(matches!(
            ServedKey::decode(&ucx_key),
            Err(ProtocolError::Length { .. })
        ));
        let mut wrong_magic = key().encode();
        wrong_magic[0] = b'X';
        assert_eq!(ServedKey::decode(&wrong_magic), Err(ProtocolError::Magic));
    }

    #[test]
    fn unknown_versions_and_lanes_are_refused() {
        let mut bytes = key().encode();
        bytes[2] = 2;
        assert_eq!(ServedKey::decode(&bytes), Err(ProtocolError::Version(2)));
        let mut bytes = key().encode();
        bytes[3] = 1;
        assert_eq!(ServedKey::decode(&bytes), Err(ProtocolError::Lane(1)));
        let mut reply = ReadReply {
            request_id: 1,
            status: ReplyStatus::Served,
            length: 0,
        }
        .encode();
        reply[0] = 2;
        assert_eq!(ReadReply::decode(&reply), Err(ProtocolError::Version(2)));
    }

    #[test]
    fn a_refusal_code_from_a_later_release_decodes_to_a_typed_refusal() {
        for code in [10u8, 99, 200, 255] {
            let mut reply = ReadReply {
                request_id: 4,
                status: ReplyStatus::Served,
                length: 0,
            }
            .encode();
            reply[1] = code;
            let decoded = ReadReply::decode(&reply).unwrap();
            assert_eq!(
                decoded.status,
                ReplyStatus::Refused(Refusal::Unrecognized(code))
            );
            assert_eq!(decoded.request_id, 4);
            // It survives a re-encode as the same code.
            assert_eq!(decoded.encode()[1], code);
        }
    }

    #[test]
    fn a_refusal_that_claims_a_payload_is_malformed() {
        for code in [1u8, 6, 99] {
            let mut reply = ReadReply {
                request_id: 4,
                status: ReplyStatus::Served,
                length: 4096,
            }
            .encode();
            reply[1] = code;
            assert_eq!(
                ReadReply::decode(&reply),
                Err(ProtocolError::RefusalWithPayload {
                    status: code,
                    length: 4096
                })
            );
        }
    }

    #[test]
    fn a_hand_made_unrecognized_refusal_never_encodes_as_an_assigned_code() {
        for code in 0..=LAST_ASSIGNED_STATUS {
            let reply = ReadReply {
                request_id: 1,
                status: ReplyStatus::Refused(Refusal::Unrecognized(code)),
                length: 0,
            };
            assert_eq!(reply.encode()[1], MALFORMED_STATUS, "code {code}");
        }
    }

    #[test]
    fn a_busy_refusal_is_code_six() {
        let reply = ReadReply {
            request_id: 3,
            status: ReplyStatus::Refused(Refusal::Busy),
            length: 0,
        };
        assert_eq!(reply.encode()[1], 6);
    }

    /// Every refusal code, assigned or from a later release, comes back
    /// through `ReadReply` as the same bytes.
    #[test]
    fn every_refusal_code_survives_the_reply_type() {
        for code in 1..=LAST_ASSIGNED_STATUS + 1 {
            let mut bytes = ReadReply {
                request_id: 9,
                status: ReplyStatus::Served,
                length: 0,
            }
            .encode();
            bytes[1] = code;
            let reply = ReadReply::decode(&bytes).unwrap();
            assert!(
                matches!(reply.status, ReplyStatus::Refused(_)),
                "code {code}"
            );
            assert_eq!(reply.encode(), bytes, "code {code}");
        }
    }

    proptest! {
        #[test]
        fn requests_round_trip(request_id: u64, region_id: u64, capability: [u8; 16], address: u64, length: u64) {
            let request = ReadRequest { request_id, key: ServedKey { region_id, capability }, address, length };
            prop_assert_eq!(ReadRequest::decode(&request.encode()), Ok(request));
        }

        #[test]
        fn arbitrary_bytes_never_panic_any_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            let _ = ServedKey::decode(&bytes);
            let _ = ReadKey::decode(&bytes);
            let mut lane_one = b"RQ\x01\x01".to_vec();
            lane_one.extend_from_slice(&bytes);
            let _ = ReadKey::decode(&lane_one);
            let _ = ReadRequest::decode(&bytes);
            let _ = ReadReply::decode(&bytes);
        }

        #[test]
        fn every_accepted_reply_re_encodes_to_itself(status: u8, request_id: u64, length in prop_oneof![Just(0u64), any::<u64>()]) {
            let mut bytes = [0u8; REPLY_LEN];
            bytes[0] = VERSION;
            bytes[1] = status;
            bytes[4..12].copy_from_slice(&request_id.to_le_bytes());
            bytes[12..20].copy_from_slice(&length.to_le_bytes());
            match ReadReply::decode(&bytes) {
                Ok(reply) => prop_assert_eq!(reply.encode(), bytes),
                Err(err) => prop_assert_eq!(
                    err,
                    ProtocolError::RefusalWithPayload { status, length }
                ),
            }
        }

        #[test]
        fn every_truncation_of_a_request_is_refused(cut in 0usize..REQUEST_LEN) {
            let request = ReadRequest { request_id: 1, key: key(), address: 2, length: 3 };
            let is_length_error = matches!(
                ReadRequest::decode(&request.encode()[..cut]),
                Err(ProtocolError::Length { .. })
            );
            prop_assert!(is_length_error);
        }
    }
}
