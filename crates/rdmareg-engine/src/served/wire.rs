//! The UCX engine's wire formats of a single served read or write: the
//! request a consumer sends and the reply header an owner replies with.
//!
//! The one implementation of these bytes: `rdmareg_ucx::read_protocol`
//! and `rdmareg_ucx::read_list` wrap it in the UCX engine's public types,
//! and an owner driven by [`Owner`](super::owner::Owner) replies with it.
//! The libfabric engine's request carries the
//! consumer's address and its refusals travel in the tag, so it decodes
//! its own bytes into a [`Read`] and feeds [`Owner::handle_read`]
//! directly: the state machine takes decoded requests, and this module is
//! one decode step among possible others.
//!
//! # Formats
//!
//! Little-endian; a version byte first, and a version this build does not
//! know is refused, never guessed at.
//!
//! **Request** (consumer → owner): `version = 1`, three zero bytes,
//! `request_id: u64`, `region_id: u64`, `capability: [u8; 16]`,
//! `address: u64`, `length: u64` — [`REQUEST_LEN`] bytes.
//!
//! **Reply** (owner → consumer; the bytes follow as payload when served):
//! `version = 1`, `status: u8`, two zero bytes, `request_id: u64`,
//! `length: u64` — [`REPLY_LEN`] bytes. Status `0` is served; the refusal
//! codes are `1` region unknown, `2` capability mismatch, `3` out of
//! range, `4` deregistering, `5` malformed request, `6` busy, `7` lease
//! expired, `8` access denied (the registration does not allow the
//! operation), `9` receive failed (a write's bytes could not be received;
//! only ever a reply to a write). Codes are only ever added; a refusal
//! carries `length = 0`.
//!
//! **Write request** (consumer → owner, on its own active-message id, so
//! that it cannot be taken for a read): the request's layout, field for
//! field ([`encode_write_request`]), followed by the `length` bytes to
//! write as the message's payload. Its request id has
//! [`WRITE_REQUEST_ID_BIT`] set, so a consumer that reads and writes
//! through one reply handler tells their replies apart by the id alone.
//!
//! **Write reply** (owner → consumer): a reply header as above, with no
//! payload: status `0` with `length` = the bytes written, once they are in
//! the registration; a refusal with `length = 0`. A write reply that
//! claims payload bytes is refused by the consumer.
//!
//! **List request** (consumer → owner, a batched list): `version = 1`,
//! three zero bytes, `count: u16` (1 to [`MAX_LIST_ENTRIES`]), two zero
//! bytes, then `count` entries of `request_id: u64`, `region_id: u64`,
//! `capability: [u8; 16]`, `address: u64`, `length: u64` (48 bytes each).
//!
//! **List reply** (owner → consumer; the payload is the served entries'
//! bytes back to back): `version = 1`, three zero bytes, `count: u16`, two
//! zero bytes, then `count` entries of `request_id: u64`, `status: u8`,
//! seven zero bytes, `length: u64` (24 bytes each; `length` is 0 for a
//! refused entry; a refused entry that claims bytes is refused). Statuses
//! are those of single replies.
//!
//! **Write list request** (consumer → owner, on its own active-message
//! id): a list request's layout, one entry per write, each id with
//! [`WRITE_REQUEST_ID_BIT`] set ([`encode_write_list_request`]), followed
//! by the writes' bytes back to back, in entry order, as the payload.
//!
//! **Write list reply** (owner → consumer, on its own active-message id):
//! a list reply header, one entry per write of the list in its order,
//! with no payload: status `0` with `length` = the bytes written, or a
//! refusal with `length = 0`.
//!
//! Decoding never panics and refuses missing or trailing bytes: these come
//! from peers.
//!
//! [`Owner::handle_read`]: super::owner::Owner::handle_read

use std::fmt;

use super::owner::{ListEntryReply, Read, Refusal, Write};

/// Length of an encoded request.
pub const REQUEST_LEN: usize = 52;
/// Length of an encoded reply header.
pub const REPLY_LEN: usize = 20;

const VERSION: u8 = 1;

/// Most entries one list request or reply carries.
pub const MAX_LIST_ENTRIES: usize = 64;
/// Length of one list-request entry.
pub const LIST_REQUEST_ENTRY_LEN: usize = 48;
/// Length of one list-reply entry.
pub const LIST_REPLY_ENTRY_LEN: usize = 24;
const LIST_FIXED_LEN: usize = 8;

/// What is wrong with bytes that were meant to be a request or a reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProtocolError {
    /// The bytes are not as long as the format.
    Length {
        /// The format's length.
        expected: usize,
        /// What arrived.
        actual: usize,
    },
    /// A version this build does not know.
    Version(u8),
    /// A reserved byte is not zero.
    Reserved,
    /// A refusal whose header claims a payload (refusals carry none).
    RefusalWithPayload {
        /// The refusal's status code.
        status: u8,
        /// The length it claims.
        length: u64,
    },
}

impl fmt::Display for ProtocolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProtocolError::Length { expected, actual } => {
                write!(f, "expected {expected} bytes, got {actual}")
            }
            ProtocolError::Version(version) => write!(f, "unknown version {version}"),
            ProtocolError::Reserved => f.write_str("reserved bytes are not zero"),
            ProtocolError::RefusalWithPayload { status, length } => write!(
                f,
                "a refusal (status {status}) claims a {length}-byte payload"
            ),
        }
    }
}

impl std::error::Error for ProtocolError {}

/// The request's encoding.
pub fn encode_request(read: &Read) -> [u8; REQUEST_LEN] {
    let mut out = [0u8; REQUEST_LEN];
    out[0] = VERSION;
    out[4..12].copy_from_slice(&read.request_id.to_le_bytes());
    out[12..20].copy_from_slice(&read.region.to_le_bytes());
    out[20..36].copy_from_slice(&read.capability);
    out[36..44].copy_from_slice(&read.address.to_le_bytes());
    out[44..52].copy_from_slice(&read.length.to_le_bytes());
    out
}

/// The bit every write's request id has set, and no read's: the
/// consumers' counters ([`Consumer`](super::consumer::Consumer) and
/// [`Writer`](super::writer::Writer)) keep to their half.
pub const WRITE_REQUEST_ID_BIT: u64 = 1 << 63;

/// Whether `request_id` names a write ([`WRITE_REQUEST_ID_BIT`]).
pub const fn is_write_request_id(request_id: u64) -> bool {
    request_id & WRITE_REQUEST_ID_BIT != 0
}

/// A write request's header: the layout of a read request.
pub fn encode_write_request(write: &Write) -> [u8; REQUEST_LEN] {
    encode_request(&write.as_read())
}

/// Decodes an untrusted write request header (the payload is apart).
///
/// # Errors
/// As [`decode_request`].
pub fn decode_write_request(bytes: &[u8]) -> Result<Write, ProtocolError> {
    decode_request(bytes).map(Write::from_read)
}

/// A write list's header: the layout of a list request, one entry per
/// write; the writes' bytes go back to back as the message's payload.
/// `None` for an empty list or one longer than [`MAX_LIST_ENTRIES`].
pub fn encode_write_list_request(entries: &[Write]) -> Option<Vec<u8>> {
    encode_list_request_of(entries.iter().map(Write::as_read))
}

/// Decodes an untrusted write list header (the payload is apart).
///
/// # Errors
/// As [`decode_list_request`].
pub fn decode_write_list_request(bytes: &[u8]) -> Result<Vec<Write>, ProtocolError> {
    decode_list_request(bytes).map(|entries| entries.into_iter().map(Write::from_read).collect())
}

/// Decodes an untrusted request.
///
/// # Errors
/// A wrong length, an unknown version or a non-zero reserved byte.
pub fn decode_request(bytes: &[u8]) -> Result<Read, ProtocolError> {
    let bytes: &[u8; REQUEST_LEN] = bytes.try_into().map_err(|_| ProtocolError::Length {
        expected: REQUEST_LEN,
        actual: bytes.len(),
    })?;
    if bytes[0] != VERSION {
        return Err(ProtocolError::Version(bytes[0]));
    }
    if bytes[1..4] != [0, 0, 0] {
        return Err(ProtocolError::Reserved);
    }
    let mut capability = [0u8; 16];
    capability.copy_from_slice(&bytes[20..36]);
    Ok(Read {
        request_id: u64_at(bytes, 4),
        region: u64_at(bytes, 12),
        capability,
        address: u64_at(bytes, 36),
        length: u64_at(bytes, 44),
    })
}

/// The request id a consumer most likely meant, read from bytes that did
/// not decode as a request: a malformed request is refused under the id it
/// seems to carry, so its consumer can fail the right read (`0` when the
/// bytes are too short to carry one).
pub fn request_id_of_malformed(bytes: &[u8]) -> u64 {
    bytes
        .get(4..12)
        .and_then(|b| b.try_into().ok())
        .map(u64::from_le_bytes)
        .unwrap_or(0)
}

/// A reply header: `Ok(length)` for `length` served bytes that follow, or
/// the refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reply {
    /// The request's id.
    pub request_id: u64,
    /// The served length, or why the read was refused.
    pub outcome: Result<u64, Refusal>,
}

impl Reply {
    /// The header's encoding.
    pub fn encode(&self) -> [u8; REPLY_LEN] {
        let (status, length) = match self.outcome {
            Ok(length) => (0, length),
            Err(refusal) => (refusal_code(refusal), 0),
        };
        encode_reply_fields(self.request_id, status, length)
    }

    /// Decodes an untrusted reply header. A status code this build does
    /// not know decodes as [`Refusal::Unrecognized`].
    ///
    /// # Errors
    /// A wrong length or version, a non-zero reserved byte, or a refusal
    /// that claims a payload.
    pub fn decode(bytes: &[u8]) -> Result<Reply, ProtocolError> {
        let bytes: &[u8; REPLY_LEN] = bytes.try_into().map_err(|_| ProtocolError::Length {
            expected: REPLY_LEN,
            actual: bytes.len(),
        })?;
        if bytes[0] != VERSION {
            return Err(ProtocolError::Version(bytes[0]));
        }
        if bytes[2..4] != [0, 0] {
            return Err(ProtocolError::Reserved);
        }
        let length = u64_at(bytes, 12);
        let outcome = match bytes[1] {
            0 => Ok(length),
            status if length != 0 => {
                return Err(ProtocolError::RefusalWithPayload { status, length });
            }
            status => Err(refusal_of_code(status)),
        };
        Ok(Reply {
            request_id: u64_at(bytes, 4),
            outcome,
        })
    }
}

/// A reply header of any status code and length, as it goes on the wire
/// (a refusal that claims a payload included: a hostile owner's bytes,
/// which [`Reply::decode`] refuses).
pub fn encode_reply_fields(request_id: u64, status: u8, length: u64) -> [u8; REPLY_LEN] {
    let mut out = [0u8; REPLY_LEN];
    out[0] = VERSION;
    out[1] = status;
    out[4..12].copy_from_slice(&request_id.to_le_bytes());
    out[12..20].copy_from_slice(&length.to_le_bytes());
    out
}

/// The status code of a refusal this build assigns. A hand-made
/// [`Refusal::Unrecognized`] of an assigned code (or of `0`) encodes as
/// malformed, so it cannot pass for a served reply or another refusal; so
/// do the refusals this format has no code for (those a libfabric driver
/// decides), which a UCX owner never sends.
pub fn refusal_code(refusal: Refusal) -> u8 {
    match refusal {
        Refusal::RegionUnknown => 1,
        Refusal::CapabilityMismatch => 2,
        Refusal::OutOfRange => 3,
        Refusal::Deregistering => 4,
        Refusal::Malformed => MALFORMED,
        Refusal::Busy => 6,
        Refusal::LeaseExpired => 7,
        Refusal::AccessDenied => 8,
        Refusal::ReceiveFailed => 9,
        Refusal::Unrecognized(code) if code > LAST_ASSIGNED => code,
        Refusal::Unrecognized(_) | Refusal::Unverified | Refusal::NotTheRequester => MALFORMED,
    }
}

const MALFORMED: u8 = 5;
const LAST_ASSIGNED: u8 = 9;

/// The refusal a non-zero status code names; a code this build does not
/// know is [`Refusal::Unrecognized`].
pub fn refusal_of_code(code: u8) -> Refusal {
    match code {
        1 => Refusal::RegionUnknown,
        2 => Refusal::CapabilityMismatch,
        3 => Refusal::OutOfRange,
        4 => Refusal::Deregistering,
        MALFORMED => Refusal::Malformed,
        6 => Refusal::Busy,
        7 => Refusal::LeaseExpired,
        8 => Refusal::AccessDenied,
        9 => Refusal::ReceiveFailed,
        other => Refusal::Unrecognized(other),
    }
}

/// A list request's encoding, or `None` for an empty list or one longer
/// than [`MAX_LIST_ENTRIES`].
pub fn encode_list_request(entries: &[Read]) -> Option<Vec<u8>> {
    encode_list_request_of(entries.iter().copied())
}

/// [`encode_list_request`] of reads a caller holds in another shape.
pub fn encode_list_request_of(entries: impl ExactSizeIterator<Item = Read>) -> Option<Vec<u8>> {
    let mut out = list_fixed(entries.len(), LIST_REQUEST_ENTRY_LEN)?;
    for read in entries {
        out.extend_from_slice(&read.request_id.to_le_bytes());
        out.extend_from_slice(&read.region.to_le_bytes());
        out.extend_from_slice(&read.capability);
        out.extend_from_slice(&read.address.to_le_bytes());
        out.extend_from_slice(&read.length.to_le_bytes());
    }
    Some(out)
}

/// Decodes an untrusted list request.
///
/// # Errors
/// A wrong length, version or count, or a non-zero reserved byte.
pub fn decode_list_request(bytes: &[u8]) -> Result<Vec<Read>, ProtocolError> {
    list_count(bytes, LIST_REQUEST_ENTRY_LEN)?;
    Ok(bytes[LIST_FIXED_LEN..]
        .chunks_exact(LIST_REQUEST_ENTRY_LEN)
        .map(|entry| {
            let entry: &[u8; LIST_REQUEST_ENTRY_LEN] =
                entry.try_into().unwrap_or(&[0; LIST_REQUEST_ENTRY_LEN]);
            let mut capability = [0u8; 16];
            capability.copy_from_slice(&entry[16..32]);
            Read {
                request_id: u64_at(entry, 0),
                region: u64_at(entry, 8),
                capability,
                address: u64_at(entry, 32),
                length: u64_at(entry, 40),
            }
        })
        .collect())
}

/// A list reply header's encoding, or `None` for no entries or more than
/// [`MAX_LIST_ENTRIES`].
pub fn encode_list_reply(entry_replies: &[ListEntryReply]) -> Option<Vec<u8>> {
    encode_list_reply_fields(entry_replies.iter().map(|entry| match entry.outcome {
        Ok(payload) => (entry.request_id, 0, payload.length),
        Err(refusal) => (entry.request_id, refusal_code(refusal), 0),
    }))
}

/// A list reply header of `(request_id, status code, length)` entries as
/// they go on the wire, or `None` for none or more than
/// [`MAX_LIST_ENTRIES`].
pub fn encode_list_reply_fields(
    entries: impl ExactSizeIterator<Item = (u64, u8, u64)>,
) -> Option<Vec<u8>> {
    let mut out = list_fixed(entries.len(), LIST_REPLY_ENTRY_LEN)?;
    for (request_id, status, length) in entries {
        out.extend_from_slice(&request_id.to_le_bytes());
        out.push(status);
        out.extend_from_slice(&[0u8; 7]);
        out.extend_from_slice(&length.to_le_bytes());
    }
    Some(out)
}

/// Decodes an untrusted list reply header: one [`Reply`] per entry, in
/// order (a status code this build does not know is a refusal of that
/// entry).
///
/// # Errors
/// A wrong length, version or count, a non-zero reserved byte, and a
/// refused entry that claims bytes.
pub fn decode_list_reply(bytes: &[u8]) -> Result<Vec<Reply>, ProtocolError> {
    let count = list_count(bytes, LIST_REPLY_ENTRY_LEN)?;
    let mut replies = Vec::with_capacity(count);
    for entry in bytes[LIST_FIXED_LEN..].chunks_exact(LIST_REPLY_ENTRY_LEN) {
        let entry: &[u8; LIST_REPLY_ENTRY_LEN] =
            entry.try_into().unwrap_or(&[0; LIST_REPLY_ENTRY_LEN]);
        if entry[9..16].iter().any(|&b| b != 0) {
            return Err(ProtocolError::Reserved);
        }
        let length = u64_at(entry, 16);
        let outcome = match entry[8] {
            0 => Ok(length),
            _ if length != 0 => return Err(ProtocolError::Reserved),
            code => Err(refusal_of_code(code)),
        };
        replies.push(Reply {
            request_id: u64_at(entry, 0),
            outcome,
        });
    }
    Ok(replies)
}

/// Checks a list's fixed part and its total length; returns the count.
fn list_count(bytes: &[u8], entry_len: usize) -> Result<usize, ProtocolError> {
    let Some(fixed) = bytes.get(..LIST_FIXED_LEN) else {
        return Err(ProtocolError::Length {
            expected: LIST_FIXED_LEN + entry_len,
            actual: bytes.len(),
        });
    };
    if fixed[0] != VERSION {
        return Err(ProtocolError::Version(fixed[0]));
    }
    if fixed[1..4] != [0, 0, 0] || fixed[6..8] != [0, 0] {
        return Err(ProtocolError::Reserved);
    }
    let count = usize::from(u16::from_le_bytes([fixed[4], fixed[5]]));
    if count == 0 || count > MAX_LIST_ENTRIES || bytes.len() != LIST_FIXED_LEN + count * entry_len {
        return Err(ProtocolError::Length {
            expected: LIST_FIXED_LEN + count.clamp(1, MAX_LIST_ENTRIES) * entry_len,
            actual: bytes.len(),
        });
    }
    Ok(count)
}

fn list_fixed(count: usize, entry_len: usize) -> Option<Vec<u8>> {
    if count == 0 || count > MAX_LIST_ENTRIES {
        return None;
    }
    let mut out = Vec::with_capacity(LIST_FIXED_LEN + count * entry_len);
    out.extend_from_slice(&[VERSION, 0, 0, 0]);
    out.extend_from_slice(&(count as u16).to_le_bytes());
    out.extend_from_slice(&[0, 0]);
    Some(out)
}

fn u64_at<const N: usize>(bytes: &[u8; N], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(word)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rdmareg_core::RdmaError;

    #[test]
    fn every_refusal_survives_the_wire() {
        for refusal in [
            Refusal::RegionUnknown,
            Refusal::CapabilityMismatch,
            Refusal::OutOfRange,
            Refusal::Deregistering,
            Refusal::Malformed,
            Refusal::Busy,
            Refusal::LeaseExpired,
            Refusal::AccessDenied,
            Refusal::ReceiveFailed,
            Refusal::Unrecognized(LAST_ASSIGNED + 1),
        ] {
            let reply = Reply {
                request_id: 9,
                outcome: Err(refusal),
            };
            assert_eq!(Reply::decode(&reply.encode()), Ok(reply));
        }
    }

    #[test]
    fn the_reply_bytes_match_the_ucx_engines() {
        // Status 6 is busy, as `rdmareg_ucx::read_protocol` assigns it.
        let busy = Reply {
            request_id: 0x0102,
            outcome: Err(Refusal::Busy),
        }
        .encode();
        assert_eq!(busy[..4], [1, 6, 0, 0]);
        assert_eq!(busy[4..12], 0x0102u64.to_le_bytes());
        let served = Reply {
            request_id: 3,
            outcome: Ok(4096),
        }
        .encode();
        assert_eq!(served[1], 0);
        assert_eq!(served[12..20], 4096u64.to_le_bytes());
    }

    /// The UCX engine's status codes as the bytes peers of every release
    /// send, and the caller's error for each of the 255 a peer can send:
    /// pinned as bytes, since a round trip through this build's own
    /// encoder and decoder passes even if both were renumbered together.
    #[test]
    fn every_status_code_keeps_its_byte_and_kind_of_error() {
        for (refusal, code) in [
            (Refusal::RegionUnknown, 1),
            (Refusal::CapabilityMismatch, 2),
            (Refusal::OutOfRange, 3),
            (Refusal::Deregistering, 4),
            (Refusal::Malformed, 5),
            (Refusal::Busy, 6),
            (Refusal::LeaseExpired, 7),
            (Refusal::AccessDenied, 8),
            (Refusal::ReceiveFailed, 9),
        ] {
            let reply = Reply {
                request_id: 9,
                outcome: Err(refusal),
            };
            assert_eq!(reply.encode()[1], code, "{refusal}");
        }
        for code in 1..=u8::MAX {
            let mut bytes = Reply {
                request_id: 9,
                outcome: Ok(0),
            }
            .encode();
            bytes[1] = code;
            let refusal = Reply::decode(&bytes)
                .expect("a refusal")
                .outcome
                .expect_err("refused");
            let err = RdmaError::from(refusal);
            let kind = match &err {
                RdmaError::OutOfRange => "OutOfRange",
                RdmaError::RegionNotFound => "RegionNotFound",
                RdmaError::InvalidKey => "InvalidKey",
                RdmaError::LeaseExpired => "LeaseExpired",
                RdmaError::AccessDenied { operation: "read" } => "AccessDenied",
                RdmaError::Backend(_) if err.is_transient() => "transient Backend",
                _ => "something else",
            };
            let expected = match code {
                3 => "OutOfRange",
                1 | 2 | 4 => "RegionNotFound",
                5 => "InvalidKey",
                7 => "LeaseExpired",
                8 => "AccessDenied",
                _ => "transient Backend",
            };
            assert_eq!(kind, expected, "code {code}: {err}");
        }
    }

    #[test]
    fn a_hand_made_unrecognized_refusal_encodes_as_malformed() {
        for code in 0..=LAST_ASSIGNED {
            let reply = Reply {
                request_id: 1,
                outcome: Err(Refusal::Unrecognized(code)),
            };
            assert_eq!(reply.encode()[1], MALFORMED, "code {code}");
        }
    }

    #[test]
    fn a_refusal_that_claims_a_payload_is_malformed() {
        let mut bytes = Reply {
            request_id: 4,
            outcome: Ok(4096),
        }
        .encode();
        bytes[1] = 3;
        assert_eq!(
            Reply::decode(&bytes),
            Err(ProtocolError::RefusalWithPayload {
                status: 3,
                length: 4096
            })
        );
    }

    #[test]
    fn a_malformed_request_is_refused_under_the_id_it_seems_to_carry() {
        let mut bytes = encode_request(&Read {
            request_id: 77,
            region: 1,
            capability: [0; 16],
            address: 0,
            length: 1,
        });
        bytes[0] = 9;
        assert_eq!(decode_request(&bytes), Err(ProtocolError::Version(9)));
        assert_eq!(request_id_of_malformed(&bytes), 77);
        assert_eq!(request_id_of_malformed(&bytes[..7]), 0);
    }

    /// A write request is a read request's bytes, field for field, and
    /// its id keeps the write bit through the wire.
    #[test]
    fn a_write_request_has_the_read_requests_layout() {
        let write = Write {
            request_id: WRITE_REQUEST_ID_BIT | 5,
            region: 2,
            capability: [3; 16],
            address: 0x1000,
            length: 64,
        };
        let bytes = encode_write_request(&write);
        assert_eq!(bytes, encode_request(&write.as_read()));
        assert_eq!(decode_write_request(&bytes), Ok(write));
        assert!(is_write_request_id(write.request_id));
        assert!(!is_write_request_id(5));
        assert!(decode_write_request(&bytes[..REQUEST_LEN - 1]).is_err());
    }

    fn entry(request_id: u64) -> Read {
        Read {
            request_id,
            region: request_id + 100,
            capability: [request_id as u8; 16],
            address: 0x1000 * request_id,
            length: request_id * 8,
        }
    }

    #[test]
    fn a_list_request_round_trips_in_order() {
        let entries: Vec<Read> = (1..=MAX_LIST_ENTRIES as u64).map(entry).collect();
        let bytes = encode_list_request(&entries).unwrap();
        assert_eq!(bytes.len(), 8 + MAX_LIST_ENTRIES * LIST_REQUEST_ENTRY_LEN);
        assert_eq!(decode_list_request(&bytes), Ok(entries));
    }

    #[test]
    fn empty_overlong_cut_and_padded_lists_are_refused() {
        assert_eq!(encode_list_request(&[]), None);
        let overlong: Vec<Read> = (0..=MAX_LIST_ENTRIES as u64).map(entry).collect();
        assert_eq!(encode_list_request(&overlong), None);
        let bytes = encode_list_request(&[entry(1), entry(2)]).unwrap();
        for cut in 0..bytes.len() {
            assert!(decode_list_request(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut padded = bytes.clone();
        padded.push(0);
        assert!(decode_list_request(&padded).is_err());
        let mut zero = bytes.clone();
        zero[4..6].copy_from_slice(&0u16.to_le_bytes());
        assert!(decode_list_request(&zero).is_err());
        for at in [1, 2, 3, 6, 7] {
            let mut reserved = bytes.clone();
            reserved[at] = 1;
            assert_eq!(decode_list_request(&reserved), Err(ProtocolError::Reserved));
        }
    }

    #[test]
    fn a_list_reply_header_has_the_ucx_layout() {
        let entry_replies = [
            ListEntryReply {
                request_id: 5,
                outcome: Ok(super::super::owner::Payload {
                    region: 1,
                    address: 0x10,
                    length: 32,
                }),
            },
            ListEntryReply {
                request_id: 6,
                outcome: Err(Refusal::Busy),
            },
        ];
        let header = encode_list_reply(&entry_replies).unwrap();
        assert_eq!(header.len(), 8 + 2 * LIST_REPLY_ENTRY_LEN);
        assert_eq!(header[..8], [1, 0, 0, 0, 2, 0, 0, 0]);
        assert_eq!(header[8..16], 5u64.to_le_bytes());
        assert_eq!(header[16], 0);
        assert_eq!(header[24..32], 32u64.to_le_bytes());
        assert_eq!(header[32..40], 6u64.to_le_bytes());
        assert_eq!(header[40], 6, "busy");
        assert_eq!(header[48..56], 0u64.to_le_bytes());
        assert_eq!(encode_list_reply(&[]), None);
    }

    #[test]
    fn a_list_reply_decodes_each_entry_and_refuses_refusals_with_bytes() {
        let header =
            encode_list_reply_fields([(5, 0, 32), (6, 6, 0), (7, 99, 0)].into_iter()).unwrap();
        assert_eq!(
            decode_list_reply(&header),
            Ok(vec![
                Reply {
                    request_id: 5,
                    outcome: Ok(32)
                },
                Reply {
                    request_id: 6,
                    outcome: Err(Refusal::Busy)
                },
                Reply {
                    request_id: 7,
                    outcome: Err(Refusal::Unrecognized(99))
                },
            ])
        );
        let claims = encode_list_reply_fields([(6, 6, 1)].into_iter()).unwrap();
        assert_eq!(decode_list_reply(&claims), Err(ProtocolError::Reserved));
        let mut reserved = header.clone();
        reserved[8 + 9] = 1;
        assert_eq!(decode_list_reply(&reserved), Err(ProtocolError::Reserved));
        for cut in 0..header.len() {
            assert!(decode_list_reply(&header[..cut]).is_err(), "cut at {cut}");
        }
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic_the_list_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode_list_request(&bytes);
            let _ = decode_list_reply(&bytes);
            let mut framed = vec![1, 0, 0, 0, 1, 0, 0, 0];
            framed.extend_from_slice(&bytes);
            let _ = decode_list_request(&framed);
            let _ = decode_list_reply(&framed);
        }

        #[test]
        fn requests_round_trip(request_id: u64, region: u64, capability: [u8; 16], address: u64, length: u64) {
            let read = Read { request_id, region, capability, address, length };
            prop_assert_eq!(decode_request(&encode_request(&read)), Ok(read));
        }

        #[test]
        fn arbitrary_bytes_never_panic_a_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            let _ = decode_request(&bytes);
            let _ = Reply::decode(&bytes);
            let _ = request_id_of_malformed(&bytes);
        }

        #[test]
        fn every_truncation_of_a_request_is_refused(cut in 0usize..REQUEST_LEN) {
            let read = Read { request_id: 1, region: 2, capability: [3; 16], address: 4, length: 5 };
            let is_length_error = matches!(
                decode_request(&encode_request(&read)[..cut]),
                Err(ProtocolError::Length { .. })
            );
            prop_assert!(is_length_error);
        }
    }
}
