//! The packed remote key of this backend, validated in full before use.
//!
//! # Layout, version 2 (all integers little-endian)
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 1 | version, `2` |
//! | 1 | 1 | flags: bit 0 = [`FLAG_VIRT_ADDR`], bit 1 = [`FLAG_OWNER_SERVED`], bit 2 = [`FLAG_LEASE`] (only as `FLAG_OWNER_SERVED | FLAG_LEASE`). Other bits must be zero |
//! | 2 | 8 | `region_id`: the owner engine's id of the registration, never reused by that engine (non-zero) |
//! | 10 | 16 | `capability`: 16 random bytes drawn for this registration (for a lease key, for the lease) |
//! | 26 | 8 | `mr_key`: the memory region's key (`fi_mr_key`); zero on an owner-served key |
//! | 34 | 8 | `base`: the address the owner registered |
//! | 42 | 8 | `len`: the length it registered (non-zero, `base + len` does not overflow) |
//! | 50 | 2 | `addr_len`: length of the owner's fabric address, 1 to [`MAX_FABRIC_ADDRESS`] |
//! | 52 | `addr_len` | the owner's fabric address, as `fi_getname` gave it |
//!
//! The key is exactly `52 + addr_len` bytes; a version-1 key of earlier
//! builds is malformed.
//!
//! An **owner-served** key (flag bit 1) is read by asking the owner's
//! engine, which checks it before it sends a byte (`protocol`); a
//! **one-sided** key is read with `fi_read` using `mr_key`. `base` and `len`
//! let the consumer refuse a read outside the registration before anything
//! is sent, and a key is used only against the peer whose fabric address it
//! carries.
//!
//! # Lease keys
//!
//! A **lease key** (flags exactly `FLAG_OWNER_SERVED | FLAG_LEASE`, so no
//! memory key and offsets rather than virtual addresses) is what
//! `RdmaBackend::lease` issues: the registration's `region_id`, `base`,
//! `len` and owner address with the *lease's* capability. It is always
//! owner-served, whatever read path the owner's engine uses for the
//! region's own key, because only the owner can refuse a read once the
//! lease ended (a one-sided `fi_read` would go on reading). The flag lets a
//! reader's release refuse a key that is no lease
//! ([`PackedKey::decode_lease`]), and keeps a lease key out of
//! [`PackedKey::decode`], which takes registration keys only, so what
//! `decode` accepts stays canonical.
//!
//! The layout version stays 2: every version-2 decoder before lease keys
//! refused a flag bit other than bits 0 and 1, so an earlier build refuses
//! a lease key as [`RdmaError::InvalidKey`] rather than read it as a
//! registration's key.

use bytes::{BufMut, Bytes, BytesMut};
use rdmareg_core::RdmaError;

/// The layout version this build writes and reads.
pub const KEY_VERSION: u8 = 2;
/// Flag bit: remote addresses are virtual addresses (one-sided keys).
pub const FLAG_VIRT_ADDR: u8 = 1;
/// Flag bit: the owner serves reads of this key itself.
pub const FLAG_OWNER_SERVED: u8 = 2;
/// Flag bit: a lease key (module docs, "Lease keys"); set only together
/// with [`FLAG_OWNER_SERVED`].
pub const FLAG_LEASE: u8 = 4;
/// Bytes before the fabric address.
pub const HEADER_LEN: usize = 52;
/// Bytes of a registration's capability.
pub const CAPABILITY_LEN: usize = 16;
/// The longest fabric address accepted (a provider's string address, such as
/// shm's, is well below this; sockaddr formats are 16 or 28 bytes).
pub const MAX_FABRIC_ADDRESS: usize = 256;

/// Whose capability a key carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyKind {
    /// The registration's own key.
    Registration,
    /// A descriptor lease's key (module docs, "Lease keys").
    Lease,
}

/// A decoded, validated key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedKey {
    /// The owner serves reads itself (else they are one-sided `fi_read`s).
    pub owner_served: bool,
    /// Remote addresses are virtual addresses (else offsets from `base`);
    /// meaningful for one-sided keys.
    pub virt_addr: bool,
    /// The owner engine's registration id (non-zero, never reused).
    pub region_id: u64,
    /// The registration's random capability.
    pub capability: [u8; CAPABILITY_LEN],
    /// The memory region's key (one-sided keys).
    pub mr_key: u64,
    /// The registered address.
    pub base: u64,
    /// The registered length.
    pub len: u64,
    /// The owner's fabric address.
    pub owner: Bytes,
}

impl PackedKey {
    /// The wire form of this registration key.
    pub fn encode(&self) -> Bytes {
        let mut flags = 0;
        if self.virt_addr {
            flags |= FLAG_VIRT_ADDR;
        }
        if self.owner_served {
            flags |= FLAG_OWNER_SERVED;
        }
        self.encode_with(flags)
    }

    /// The wire form of the lease key with this key's region, range, owner
    /// and capability (the lease's). A lease key is owner-served with no
    /// memory key and offset addresses, whatever `owner_served`, `mr_key`
    /// and `virt_addr` say; [`PackedKey::decode_lease`] gives it back with
    /// those set so.
    pub fn encode_lease(&self) -> Bytes {
        PackedKey {
            owner_served: true,
            virt_addr: false,
            mr_key: 0,
            ..self.clone()
        }
        .encode_with(FLAG_OWNER_SERVED | FLAG_LEASE)
    }

    fn encode_with(&self, flags: u8) -> Bytes {
        let mut out = BytesMut::with_capacity(HEADER_LEN + self.owner.len());
        out.put_u8(KEY_VERSION);
        out.put_u8(flags);
        out.put_u64_le(self.region_id);
        out.put_slice(&self.capability);
        out.put_u64_le(self.mr_key);
        out.put_u64_le(self.base);
        out.put_u64_le(self.len);
        out.put_u16_le(self.owner.len() as u16);
        out.put_slice(&self.owner);
        out.freeze()
    }

    /// Validates untrusted bytes that must be a registration's key.
    ///
    /// # Errors
    /// [`RdmaError::InvalidKey`] for anything but a well-formed version-2
    /// registration key (a lease key included).
    pub fn decode(bytes: &Bytes) -> Result<PackedKey, RdmaError> {
        match PackedKey::decode_any(bytes)? {
            (key, KeyKind::Registration) => Ok(key),
            (_, KeyKind::Lease) => Err(RdmaError::InvalidKey),
        }
    }

    /// Validates untrusted bytes that must be a lease key.
    ///
    /// # Errors
    /// [`RdmaError::InvalidKey`] for anything but a well-formed version-2
    /// lease key (a registration's key included).
    pub fn decode_lease(bytes: &Bytes) -> Result<PackedKey, RdmaError> {
        match PackedKey::decode_any(bytes)? {
            (key, KeyKind::Lease) => Ok(key),
            (_, KeyKind::Registration) => Err(RdmaError::InvalidKey),
        }
    }

    /// Validates untrusted bytes that may be either kind of key: what a
    /// read accepts. The key re-encodes to exactly `bytes` with
    /// [`PackedKey::encode`] or [`PackedKey::encode_lease`], as its kind
    /// says.
    ///
    /// # Errors
    /// [`RdmaError::InvalidKey`] for anything but a well-formed version-2
    /// key of either kind.
    pub fn decode_any(bytes: &Bytes) -> Result<(PackedKey, KeyKind), RdmaError> {
        if bytes.len() < HEADER_LEN || bytes.len() > HEADER_LEN + MAX_FABRIC_ADDRESS {
            return Err(RdmaError::InvalidKey);
        }
        let flags = bytes[1];
        if bytes[0] != KEY_VERSION
            || flags & !(FLAG_VIRT_ADDR | FLAG_OWNER_SERVED | FLAG_LEASE) != 0
        {
            return Err(RdmaError::InvalidKey);
        }
        let kind = if flags & FLAG_LEASE == 0 {
            KeyKind::Registration
        } else if flags == FLAG_OWNER_SERVED | FLAG_LEASE {
            KeyKind::Lease
        } else {
            // A lease key is owner-served and names offsets.
            return Err(RdmaError::InvalidKey);
        };
        let u64_at = |at: usize| {
            let mut raw = [0u8; 8];
            raw.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(raw)
        };
        let region_id = u64_at(2);
        let mut capability = [0u8; CAPABILITY_LEN];
        capability.copy_from_slice(&bytes[10..26]);
        let mr_key = u64_at(26);
        let base = u64_at(34);
        let len = u64_at(42);
        let addr_len = usize::from(u16::from_le_bytes([bytes[50], bytes[51]]));
        if addr_len == 0 || addr_len > MAX_FABRIC_ADDRESS || bytes.len() != HEADER_LEN + addr_len {
            return Err(RdmaError::InvalidKey);
        }
        if region_id == 0 || base == 0 || len == 0 || base.checked_add(len).is_none() {
            return Err(RdmaError::InvalidKey);
        }
        let owner_served = flags & FLAG_OWNER_SERVED != 0;
        if owner_served && mr_key != 0 {
            return Err(RdmaError::InvalidKey);
        }
        let key = PackedKey {
            owner_served,
            virt_addr: flags & FLAG_VIRT_ADDR != 0,
            region_id,
            capability,
            mr_key,
            base,
            len,
            owner: bytes.slice(HEADER_LEN..),
        };
        Ok((key, kind))
    }

    /// Whether `len` bytes at `remote_addr` lie inside the registration.
    ///
    /// # Errors
    /// [`RdmaError::OutOfRange`] when they do not (or the range overflows).
    pub fn check_range(&self, remote_addr: u64, len: u64) -> Result<(), RdmaError> {
        let end = remote_addr.checked_add(len).ok_or(RdmaError::OutOfRange)?;
        if len == 0 || remote_addr < self.base || end > self.base + self.len {
            return Err(RdmaError::OutOfRange);
        }
        Ok(())
    }

    /// The address to hand `fi_read` for `len` bytes at `remote_addr`, if
    /// that range lies inside the registration.
    ///
    /// # Errors
    /// [`RdmaError::OutOfRange`] when it does not (or overflows).
    pub fn target(&self, remote_addr: u64, len: u64) -> Result<u64, RdmaError> {
        self.check_range(remote_addr, len)?;
        Ok(if self.virt_addr {
            remote_addr
        } else {
            remote_addr - self.base
        })
    }
}

/// The address formats whose bytes this backend can check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddressFormat {
    /// `struct sockaddr_in`, 16 bytes, family `AF_INET`.
    SockaddrIn,
    /// `struct sockaddr_in6`, 28 bytes, family `AF_INET6`.
    SockaddrIn6,
    /// A provider string (`FI_ADDR_STR`): printable ASCII, NUL-padded.
    Str,
    /// Another format: only its length is checked, against this engine's
    /// own address.
    Opaque(usize),
}

/// Checks untrusted fabric-address bytes before they reach `fi_av_insert`.
///
/// # Errors
/// [`RdmaError::InvalidWorkerAddress`] naming what is wrong.
pub fn validate_address(format: AddressFormat, address: &[u8]) -> Result<(), RdmaError> {
    let bad = |why: &str| Err(RdmaError::InvalidWorkerAddress(format!("ofi: {why}")));
    if address.is_empty() || address.len() > MAX_FABRIC_ADDRESS {
        return bad("fabric address is empty or longer than 256 bytes");
    }
    let family = |bytes: &[u8]| u16::from_ne_bytes([bytes[0], bytes[1]]);
    match format {
        AddressFormat::SockaddrIn => {
            if address.len() != 16 || family(address) != libc::AF_INET as u16 {
                return bad("not a 16-byte AF_INET socket address");
            }
        }
        AddressFormat::SockaddrIn6 => {
            if address.len() != 28 || family(address) != libc::AF_INET6 as u16 {
                return bad("not a 28-byte AF_INET6 socket address");
            }
        }
        AddressFormat::Str => {
            let text_len = address
                .iter()
                .position(|&b| b == 0)
                .unwrap_or(address.len());
            if text_len == 0
                || !address[..text_len].iter().all(|b| b.is_ascii_graphic())
                || address[text_len..].iter().any(|&b| b != 0)
            {
                return bad("not a printable provider string address");
            }
        }
        AddressFormat::Opaque(len) => {
            if address.len() != len {
                return bad("length differs from this provider's addresses");
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> PackedKey {
        PackedKey {
            owner_served: false,
            virt_addr: false,
            region_id: 3,
            capability: [9; CAPABILITY_LEN],
            mr_key: 7,
            base: 0x1000,
            len: 4096,
            owner: Bytes::from_static(b"fi_shm://1234\0"),
        }
    }

    #[test]
    fn a_key_round_trips_through_its_wire_form() {
        let key = sample();
        assert_eq!(PackedKey::decode(&key.encode()), Ok(key));
    }

    #[test]
    fn an_owner_served_key_with_a_memory_region_key_is_refused() {
        let served = PackedKey {
            owner_served: true,
            mr_key: 0,
            ..sample()
        };
        assert_eq!(PackedKey::decode(&served.encode()), Ok(served.clone()));
        let forged = PackedKey {
            mr_key: 1,
            ..served
        };
        assert_eq!(
            PackedKey::decode(&forged.encode()),
            Err(RdmaError::InvalidKey)
        );
    }

    /// A lease key carries flag bit 2 beside the owner-served bit: only
    /// the lease decoders take it, it round-trips, and a registration's
    /// key is no lease.
    #[test]
    fn a_lease_key_is_told_apart_from_the_registrations_key_by_its_flag() {
        let one_sided = sample();
        let lease = one_sided.encode_lease();
        assert_eq!(lease[1], FLAG_OWNER_SERVED | FLAG_LEASE);
        let expected = PackedKey {
            owner_served: true,
            virt_addr: false,
            mr_key: 0,
            ..sample()
        };
        assert_eq!(PackedKey::decode_lease(&lease), Ok(expected.clone()));
        assert_eq!(
            PackedKey::decode_any(&lease),
            Ok((expected.clone(), KeyKind::Lease))
        );
        assert_eq!(expected.encode_lease(), lease, "canonical");
        assert_eq!(PackedKey::decode(&lease), Err(RdmaError::InvalidKey));
        let registration = expected.encode();
        assert_eq!(
            PackedKey::decode_lease(&registration),
            Err(RdmaError::InvalidKey)
        );
        assert_eq!(
            PackedKey::decode_any(&registration),
            Ok((expected, KeyKind::Registration))
        );
    }

    /// The lease flag alone, or with the virtual-address flag, or a lease
    /// naming a memory key, is no key at all.
    #[test]
    fn a_lease_flag_without_the_owner_served_layout_is_refused() {
        let lease = sample().encode_lease().to_vec();
        for flags in [FLAG_LEASE, FLAG_LEASE | FLAG_VIRT_ADDR, 7] {
            let mut bad = lease.clone();
            bad[1] = flags;
            let bad = Bytes::from(bad);
            assert_eq!(PackedKey::decode_any(&bad), Err(RdmaError::InvalidKey));
        }
        let mut with_mr_key = lease;
        with_mr_key[26] = 1;
        assert_eq!(
            PackedKey::decode_lease(&Bytes::from(with_mr_key)),
            Err(RdmaError::InvalidKey)
        );
    }

    #[test]
    fn a_key_naming_region_zero_is_refused() {
        let zero = PackedKey {
            region_id: 0,
            ..sample()
        };
        assert_eq!(
            PackedKey::decode(&zero.encode()),
            Err(RdmaError::InvalidKey)
        );
    }

    #[test]
    fn offset_mode_targets_are_offsets_from_the_registered_base() {
        let key = sample();
        assert_eq!(key.target(0x1000 + 100, 8), Ok(100));
        assert_eq!(key.target(0x1000 + 4090, 8), Err(RdmaError::OutOfRange));
        assert_eq!(key.target(0xFFF, 8), Err(RdmaError::OutOfRange));
        let virt = PackedKey {
            virt_addr: true,
            ..sample()
        };
        assert_eq!(virt.target(0x1000 + 100, 8), Ok(0x1000 + 100));
    }

    #[test]
    fn a_string_address_with_garbage_after_its_nul_is_refused() {
        assert!(validate_address(AddressFormat::Str, b"fi_shm://12\0\0").is_ok());
        assert!(validate_address(AddressFormat::Str, b"fi_shm://12\0x").is_err());
        assert!(validate_address(AddressFormat::Str, b"\0").is_err());
    }
}
