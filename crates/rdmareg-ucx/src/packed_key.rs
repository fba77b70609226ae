//! Structural validation of UCX packed remote keys received from peers.
//!
//! # Contract
//!
//! [`validate_packed_key`] accepts a key only if every byte that UCX's
//! `ucp_ep_rkey_unpack` will read while parsing it lies inside the key, and the
//! key is exactly what the packer of the UCX version named by its
//! [`PackedKeyFormat`] could have produced: no section missing, nothing after
//! the last section. Anything else is a typed [`PackedKeyError`]; the function
//! never panics and allocates nothing.
//!
//! # Why
//!
//! `ucp_ep_rkey_unpack` takes a pointer and no length, and a release build of
//! UCX checks nothing while it walks the buffer: a malformed key from the wire
//! is an out-of-bounds read inside UCX. The layout differs between UCX
//! versions, so a key is checked against the layout of the UCX actually
//! loaded, and a version whose layout is not described here has no
//! [`PackedKeyFormat`] at all ([`PackedKeyFormat::for_ucx_version`] answers
//! `None`): its keys are refused, never passed through on trust.
//!
//! # The UCX 1.22 layout
//!
//! Established from `src/ucp/core/ucp_rkey.c` of UCX 1.22.0 — the packer
//! `ucp_rkey_pack_memh` (reached from `ucp_rkey_pack` through
//! `ucp_memh_pack_internal` and `ucp_memh_do_pack`), the parser
//! `ucp_ep_rkey_unpack_internal` (reached from `ucp_ep_rkey_unpack` through
//! `ucp_ep_rkey_unpack_reachable`), `ucp_rkey_proto_resolve` with its helper
//! `ucp_rkey_extract_sys_dev`, and `ucp_rkey_unpack_lanes_distance` — as
//! compiled into the 1.22.0 `libucp.so` (read through its line tables), and
//! checked against real keys (`tests/fixtures/gen_keys.c`). Multi-byte fields
//! are in host byte order, i.e. little-endian on every supported target.
//!
//! | bytes | field |
//! |---|---|
//! | 8 | `md_map`: one bit per memory domain of the *owner* that packed a transport key |
//! | 1 | `mem_type`: a `ucs_memory_type_t`, below the version's memory-type count (10 in 1.22) |
//!
//! When `md_map` is zero the key ends here: 9 bytes, which is what tcp and
//! shared-memory transports produce for registered host memory. Otherwise:
//!
//! | bytes | field |
//! |---|---|
//! | per set bit of `md_map`, lowest first: 1 + `len` | `len` (u8), then that memory domain's transport key |
//! | 1 | `sys_dev`: bit 7 is a "flush needed" flag, the low bits name the system device; `0xFF` means unknown |
//!
//! When `sys_dev` is `0xFF` the key ends here (host memory). Otherwise a list
//! of 3-byte distance records follows — device index, latency and bandwidth
//! as one-byte floats — one per device of a 64-bit device map, so with
//! strictly ascending device indices below 64, closed by a single `0xFF`.
//!
//! How the parser reads it, and why each rule here exists:
//!
//! * `ucp_ep_rkey_unpack` passes a length of zero to the internal parser, so
//!   the buffer end plays no part: the walk is driven by `md_map` and the
//!   bytes themselves. Each entry's length byte is trusted as given.
//! * The `sys_dev` byte is read when at least one of the key's memory domains
//!   is reachable from the endpoint and the endpoint's peer version
//!   (`dst_version`) is 20 or more, i.e. UCX 1.20 or newer. If that byte (flag
//!   bit removed) is not `0xFF`, the parser's end pointer becomes the top of
//!   the address space and it consumes 3-byte records until a byte `0xFF` is
//!   found where a record would start: a missing terminator walks off the end
//!   of the key (a forged key ending at a page boundary faults inside UCX).
//!   Whether the walk runs also depends on a per-worker cache, so the
//!   validator assumes it always does.
//! * A record's device index is a bit position in a 64-bit map and an index
//!   into a per-device table; the packer only writes indices below 64, in
//!   ascending order. Anything else is refused.
//! * The packer writes these sections and nothing else, and the parser never
//!   looks past them. Trailing bytes are therefore never
//!   read, but they are not part of any key this version packs: they mean a
//!   corrupt frame or a different layout, so they are refused rather than
//!   ignored. (One corner is refused with them: a device index of 127 with the
//!   flush flag set is written as `0xFF` followed by records, which the parser
//!   itself would not read.)
//!
//! # What this does not cover
//!
//! Each memory domain's entry is handed to that transport's own
//! `uct_rkey_unpack`, which reads its own fixed structure (and, for the posix
//! transport, a path string) from the entry's start, whatever length byte
//! precedes it. Which transport a remote memory-domain index maps to is known
//! only to the endpoint, so the entry's content cannot be checked here. No
//! transport's key exceeds 255 bytes (the length is a `u8`), so placing the
//! key in front of [`UNPACK_PADDING`] zero bytes — [`copy_for_unpack`] does
//! both steps — keeps such reads inside the buffer handed to UCX.
//!
//! The key is checked against the layout of the *local* UCX, which is what
//! parses it; a peer is expected to run the same version. A peer whose packer
//! lays keys out differently has its keys refused, not misread.

use rdmareg_core::{MAX_PACKED_KEY_LEN, RdmaError};

/// `sys_dev` value meaning "unknown device"; also the distance-list terminator.
const UNKNOWN_DEVICE: u8 = 0xFF;
/// Device index, latency, bandwidth.
const DISTANCE_RECORD_LEN: usize = 3;
/// Distance records describe devices of a 64-bit map.
const DISTANCE_DEVICE_LIMIT: u8 = 64;

/// Zero bytes [`copy_for_unpack`] appends after a validated key, so that a
/// transport reading its fixed-size key structure from an entry whose length
/// byte understates it still reads inside the buffer given to UCX.
pub const UNPACK_PADDING: usize = 256;

/// UCX versions whose layout this module describes, with the number of
/// memory types (`UCS_MEMORY_TYPE_LAST`) of each.
const KNOWN_LAYOUTS: &[(u32, u32, u8)] = &[(1, 22, 10)];

/// Which packed-key layout to validate against, derived from the running
/// UCX's version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackedKeyFormat {
    major: u32,
    minor: u32,
    memory_type_count: u8,
}

impl PackedKeyFormat {
    /// The layout for UCX `major.minor`, or `None` when this validator does not
    /// know that version's layout; the caller must then refuse every key, with
    /// an error naming the version and [`supported_versions`](Self::supported_versions).
    ///
    /// Also `None` on big-endian targets: UCX writes `md_map` in host order
    /// and only the little-endian encoding has been checked.
    pub fn for_ucx_version(major: u32, minor: u32) -> Option<Self> {
        if cfg!(target_endian = "big") {
            return None;
        }
        KNOWN_LAYOUTS
            .iter()
            .find(|&&(known_major, known_minor, _)| (known_major, known_minor) == (major, minor))
            .map(|&(major, minor, memory_type_count)| Self {
                major,
                minor,
                memory_type_count,
            })
    }

    /// The UCX `(major, minor)` versions [`for_ucx_version`](Self::for_ucx_version)
    /// recognises.
    pub fn supported_versions() -> impl Iterator<Item = (u32, u32)> {
        KNOWN_LAYOUTS
            .iter()
            .map(|&(major, minor, _)| (major, minor))
    }

    /// The UCX `(major, minor)` version this layout belongs to.
    pub fn ucx_version(&self) -> (u32, u32) {
        (self.major, self.minor)
    }

    /// How many memory types that version defines; a key's `mem_type` must be
    /// below it.
    pub fn memory_type_count(&self) -> u8 {
        self.memory_type_count
    }
}

/// The fixed-size field a truncated key ends before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyField {
    /// The 8-byte memory-domain map.
    MdMap,
    /// The memory-type byte.
    MemoryType,
    /// The length byte of the entry for one memory domain.
    EntryLength {
        /// Bit of `md_map` the entry belongs to.
        md_index: u32,
    },
    /// The system-device byte that follows the entries.
    SystemDevice,
}

impl std::fmt::Display for KeyField {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyField::MdMap => f.write_str("memory-domain map"),
            KeyField::MemoryType => f.write_str("memory type"),
            KeyField::EntryLength { md_index } => {
                write!(f, "entry length of memory domain {md_index}")
            }
            KeyField::SystemDevice => f.write_str("system device"),
        }
    }
}

/// Why a packed remote key was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PackedKeyError {
    /// The key has no bytes.
    #[error("packed key is empty")]
    Empty,

    /// The key is longer than [`MAX_PACKED_KEY_LEN`].
    #[error("packed key is {len} bytes, more than the {MAX_PACKED_KEY_LEN}-byte limit")]
    Oversized {
        /// Length of the refused key.
        len: usize,
    },

    /// The key ends before a fixed-size field.
    #[error("packed key ends at byte {at}, before its {field}")]
    Truncated {
        /// Offset of the first missing byte (the key's length).
        at: usize,
        /// The field that is cut short.
        field: KeyField,
    },

    /// The memory-type byte names no memory type of this UCX version.
    #[error("packed key memory type {0} is not defined by this UCX version")]
    BadMemoryType(u8),

    /// A memory domain's entry declares more bytes than the key has left.
    #[error(
        "entry of memory domain {md_index} at byte {at} declares {declared} bytes, but only {available} remain"
    )]
    EntryOverrun {
        /// Bit of `md_map` the entry belongs to.
        md_index: u32,
        /// Offset of the entry's first byte (after its length byte).
        at: usize,
        /// The entry length the key declares.
        declared: usize,
        /// Bytes left in the key from `at`.
        available: usize,
    },

    /// The system-device byte names a device, but the key ends before the
    /// `0xFF` that closes the distance list: UCX would read past the key.
    #[error("distance list starting at byte {start} has no 0xFF terminator inside the key")]
    UnboundedDistanceList {
        /// Offset of the first distance record.
        start: usize,
    },

    /// A distance record names a device index outside the 64-bit device map.
    #[error("distance record at byte {at} names device {device}, beyond the 64-device map")]
    BadDistanceDevice {
        /// Offset of the record.
        at: usize,
        /// The device index it names.
        device: u8,
    },

    /// Distance records are not in strictly ascending device order, which
    /// UCX's packer always produces.
    #[error("distance record at byte {at} is out of ascending device order")]
    DistanceDevicesOutOfOrder {
        /// Offset of the record that breaks the order.
        at: usize,
    },

    /// Bytes follow the last section of the key.
    #[error("packed key has {extra} bytes after its last section, which ends at byte {at}")]
    TrailingBytes {
        /// Offset where the key should have ended.
        at: usize,
        /// How many bytes follow.
        extra: usize,
    },
}

impl From<PackedKeyError> for RdmaError {
    fn from(err: PackedKeyError) -> Self {
        tracing::debug!(error = %err, "refusing packed remote key");
        RdmaError::InvalidKey
    }
}

/// Checks that `key` is a well-formed packed remote key of `format`, so that
/// UCX's unpacker reads only inside `key[..]` while parsing it.
///
/// See the [module documentation](self) for the layout and what is
/// deliberately left to [`copy_for_unpack`].
pub fn validate_packed_key(format: &PackedKeyFormat, key: &[u8]) -> Result<(), PackedKeyError> {
    if key.is_empty() {
        return Err(PackedKeyError::Empty);
    }
    if key.len() > MAX_PACKED_KEY_LEN {
        return Err(PackedKeyError::Oversized { len: key.len() });
    }

    let mut cursor = Cursor { key, at: 0 };
    let md_map = cursor.md_map()?;
    let mem_type = cursor.byte(KeyField::MemoryType)?;
    if mem_type >= format.memory_type_count {
        return Err(PackedKeyError::BadMemoryType(mem_type));
    }
    if md_map != 0 {
        cursor.entries(md_map)?;
        let device = cursor.byte(KeyField::SystemDevice)?;
        if device != UNKNOWN_DEVICE {
            cursor.distance_list()?;
        }
    }
    cursor.finish()
}

/// Validates `key` and returns a copy of it followed by [`UNPACK_PADDING`]
/// zero bytes: the buffer to hand to `ucp_ep_rkey_unpack`.
pub fn copy_for_unpack(format: &PackedKeyFormat, key: &[u8]) -> Result<Vec<u8>, PackedKeyError> {
    validate_packed_key(format, key)?;
    let mut buffer = Vec::with_capacity(key.len() + UNPACK_PADDING);
    buffer.extend_from_slice(key);
    buffer.resize(key.len() + UNPACK_PADDING, 0);
    Ok(buffer)
}

/// A read position in a key; every step checks the bytes it consumes exist.
struct Cursor<'a> {
    key: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn remaining(&self) -> usize {
        self.key.len() - self.at
    }

    fn byte(&mut self, field: KeyField) -> Result<u8, PackedKeyError> {
        let value = *self.key.get(self.at).ok_or(PackedKeyError::Truncated {
            at: self.key.len(),
            field,
        })?;
        self.at += 1;
        Ok(value)
    }

    fn md_map(&mut self) -> Result<u64, PackedKeyError> {
        let bytes: [u8; 8] = self
            .key
            .get(self.at..self.at + 8)
            .and_then(|slice| slice.try_into().ok())
            .ok_or(PackedKeyError::Truncated {
                at: self.key.len(),
                field: KeyField::MdMap,
            })?;
        self.at += 8;
        Ok(u64::from_le_bytes(bytes))
    }

    /// One length-prefixed entry per set bit of `md_map`, lowest bit first.
    fn entries(&mut self, md_map: u64) -> Result<(), PackedKeyError> {
        let mut pending = md_map;
        while pending != 0 {
            let md_index = pending.trailing_zeros();
            pending &= pending - 1;
            let declared = usize::from(self.byte(KeyField::EntryLength { md_index })?);
            if declared > self.remaining() {
                return Err(PackedKeyError::EntryOverrun {
                    md_index,
                    at: self.at,
                    declared,
                    available: self.remaining(),
                });
            }
            self.at += declared;
        }
        Ok(())
    }

    /// Whole 3-byte records up to a `0xFF` where a record would start.
    fn distance_list(&mut self) -> Result<(), PackedKeyError> {
        let start = self.at;
        let unbounded = PackedKeyError::UnboundedDistanceList { start };
        let mut previous_device = None;
        loop {
            let device = *self.key.get(self.at).ok_or(unbounded.clone())?;
            if device == UNKNOWN_DEVICE {
                self.at += 1;
                return Ok(());
            }
            if self.remaining() < DISTANCE_RECORD_LEN {
                return Err(unbounded);
            }
            if device >= DISTANCE_DEVICE_LIMIT {
                return Err(PackedKeyError::BadDistanceDevice {
                    at: self.at,
                    device,
                });
            }
            if previous_device.is_some_and(|previous| device <= previous) {
                return Err(PackedKeyError::DistanceDevicesOutOfOrder { at: self.at });
            }
            previous_device = Some(device);
            self.at += DISTANCE_RECORD_LEN;
        }
    }

    fn finish(&self) -> Result<(), PackedKeyError> {
        match self.remaining() {
            0 => Ok(()),
            extra => Err(PackedKeyError::TrailingBytes { at: self.at, extra }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes of `md_map` plus `mem_type`: the whole key when `md_map` is zero.
    const HEADER_LEN: usize = 9;

    fn format() -> PackedKeyFormat {
        PackedKeyFormat::for_ucx_version(1, 22).expect("1.22 is a known layout")
    }

    #[test]
    fn only_ucx_1_22_has_a_known_layout() {
        assert_eq!(format().ucx_version(), (1, 22));
        assert_eq!(format().memory_type_count(), 10);
        for (major, minor) in [(1, 21), (1, 23), (1, 0), (2, 22), (0, 22)] {
            assert_eq!(PackedKeyFormat::for_ucx_version(major, minor), None);
        }
        assert_eq!(
            PackedKeyFormat::supported_versions().collect::<Vec<_>>(),
            vec![(1, 22)]
        );
    }

    #[test]
    fn header_only_key_is_the_nine_byte_host_key() {
        assert_eq!(validate_packed_key(&format(), &[0; HEADER_LEN]), Ok(()));
    }

    #[test]
    fn truncation_reports_the_field_and_the_key_length() {
        assert_eq!(
            validate_packed_key(&format(), &[0; 5]),
            Err(PackedKeyError::Truncated {
                at: 5,
                field: KeyField::MdMap
            })
        );
        let mut key = vec![0b100, 0, 0, 0, 0, 0, 0, 0, 0];
        assert_eq!(
            validate_packed_key(&format(), &key),
            Err(PackedKeyError::Truncated {
                at: 9,
                field: KeyField::EntryLength { md_index: 2 }
            })
        );
        key.push(0);
        assert_eq!(
            validate_packed_key(&format(), &key),
            Err(PackedKeyError::Truncated {
                at: 10,
                field: KeyField::SystemDevice
            })
        );
    }

    #[test]
    fn refusal_converts_to_invalid_key() {
        let err = validate_packed_key(&format(), &[]).unwrap_err();
        assert!(matches!(RdmaError::from(err), RdmaError::InvalidKey));
    }

    #[test]
    fn copy_for_unpack_pads_only_valid_keys() {
        let buffer = copy_for_unpack(&format(), &[0; HEADER_LEN]).expect("valid key");
        assert_eq!(buffer.len(), HEADER_LEN + UNPACK_PADDING);
        assert!(buffer.iter().all(|&b| b == 0));
        assert_eq!(
            copy_for_unpack(&format(), &[0; HEADER_LEN + 1]),
            Err(PackedKeyError::TrailingBytes { at: 9, extra: 1 })
        );
    }
}
