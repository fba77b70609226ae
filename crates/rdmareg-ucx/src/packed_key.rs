//! Structural validation of UCX packed remote keys received from peers.
//!
//! # Contract
//!
//! [`validate_packed_key`] accepts a key only if every byte UCX's
//! `ucp_ep_rkey_unpack` reads lies inside it and the key is exactly what the
//! packer of the [`PackedKeyFormat`]'s UCX version could have produced: no
//! section missing, nothing after the last. Anything else is a typed
//! [`PackedKeyError`]; the function never panics and allocates nothing.
//!
//! # Why
//!
//! `ucp_ep_rkey_unpack` takes no length and a release UCX checks nothing
//! while it walks the buffer, so a malformed key from the wire is an
//! out-of-bounds read inside UCX. A UCX version whose layout is not
//! described here has no format ([`PackedKeyFormat::for_ucx_version`]
//! returns `None`), and its keys are refused.
//!
//! # The UCX 1.22 layout
//!
//! From `src/ucp/core/ucp_rkey.c` of UCX 1.22.0 (`ucp_rkey_pack_memh`,
//! `ucp_ep_rkey_unpack_internal`, `ucp_rkey_proto_resolve`), checked against
//! real keys (`tests/fixtures/gen_keys.c`). Multi-byte fields are
//! little-endian.
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
//! Rules beyond the section bounds:
//!
//! * The parser is given no length: `md_map` and the bytes drive the walk,
//!   and each entry's length byte is trusted.
//! * UCX 1.20 and newer peers read `sys_dev`; if it (flag removed) is not
//!   `0xFF`, the parser consumes 3-byte records with no end bound until a
//!   `0xFF` starts one, so a missing terminator walks off the key. A
//!   per-worker cache decides whether the walk runs, so the validator
//!   assumes it always does.
//! * Device indices must be below 64 and strictly ascending, as packed.
//! * Trailing bytes are never read but no key this version packs has them,
//!   so they are refused (and with them the one corner where device 127
//!   with the flush flag is written as `0xFF` followed by records).
//!
//! # What this does not cover
//!
//! Each memory domain's entry goes to that transport's `uct_rkey_unpack`,
//! which reads its own fixed structure whatever the length byte says; only
//! the endpoint knows which transport that is, so the content cannot be
//! checked here. No entry exceeds 255 bytes, so the [`UNPACK_PADDING`] zero
//! bytes [`copy_for_unpack`] appends keep such reads inside the buffer. The
//! layout checked is the local UCX's; a peer laying keys out differently is
//! refused, not misread.

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
