//! The wire [`Descriptor`]: what an owner hands a consumer to GET a range.
//!
//! # Encoding (integers little-endian)
//! | bytes | field |
//! |---|---|
//! | 2 | magic `b"RD"` |
//! | 1 | version, `1` or `2` |
//! | 1 | version 2 only: the [`Access`] granted, as [`Access::to_bits`] (1, 2 or 3) |
//! | 1 | backend key length `k`, 1..=[`MAX_BACKEND_KEY_LEN`] |
//! | k | backend key, printable ASCII (`"ucx"`, `"loopback"`) |
//! | 8 | address |
//! | 8 | length, non-zero, `address + length` must not overflow |
//! | 8 | generation |
//! | 2 | packed key length `p`, 1..=[`MAX_PACKED_KEY_LEN`] |
//! | p | packed key |
//!
//! A descriptor granting [`Access::Read`] is written as version 1, the
//! encoding of every build before access rights, so readers of any build
//! decode it; version 1 decodes as [`Access::Read`]. A descriptor granting
//! a write needs version 2, which an older build refuses as an unknown
//! version rather than misreading it.
//!
//! Self-delimiting: [`Descriptor::decode_prefix`] reads one from the front
//! of a buffer, [`Descriptor::decode`] insists on exactly one. Decoding
//! never reads outside the slice, panics or allocates past the key caps;
//! the packed key's format is the backend's to validate.

use bytes::{BufMut, Bytes, BytesMut};

use crate::{Access, RdmaError};

/// Largest packed remote key a descriptor may carry, in bytes.
pub const MAX_PACKED_KEY_LEN: usize = 1024;
/// Largest backend key (the backend's wire name), in bytes.
pub const MAX_BACKEND_KEY_LEN: usize = 32;

const MAGIC: [u8; 2] = *b"RD";
/// The encoding of a read-only descriptor.
const VERSION_READ: u8 = 1;
/// The encoding that carries an access byte.
const VERSION_ACCESS: u8 = 2;
/// Bytes of a version 1 descriptor that are not the two variable-length keys.
const FIXED_LEN: usize = 2 + 1 + 1 + 8 + 8 + 8 + 2;

/// A description of `len` registered bytes at `addr` in the owner's address
/// space, which a peer holding `packed_key` may read, write or both, as
/// [`access`](Descriptor::access) says.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Descriptor {
    backend_key: String,
    addr: u64,
    len: u64,
    generation: u64,
    packed_key: Bytes,
    access: Access,
}

/// Why a [`Descriptor`] could not be decoded or built.
#[derive(thiserror::Error, Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DescriptorError {
    /// The input ended before the descriptor did.
    #[error("descriptor truncated: needed {needed} more bytes")]
    Truncated {
        /// How many more bytes the next field needed.
        needed: usize,
    },
    /// The input does not start with the descriptor magic.
    #[error("not an rdmareg descriptor (bad magic)")]
    BadMagic,
    /// The version byte names an encoding this build does not know.
    #[error("unsupported descriptor version {0}")]
    UnsupportedVersion(u8),
    /// The backend key is empty, too long, or not printable ASCII.
    #[error("invalid backend key in descriptor")]
    InvalidBackendKey,
    /// The packed key is empty or longer than [`MAX_PACKED_KEY_LEN`].
    #[error("packed key length {0} outside 1..={MAX_PACKED_KEY_LEN}")]
    InvalidPackedKeyLen(usize),
    /// The length is zero.
    #[error("descriptor describes zero bytes")]
    ZeroLength,
    /// The address is null.
    #[error("descriptor describes a null address")]
    NullAddress,
    /// `address + length` overflows.
    #[error("descriptor range overflows the address space")]
    LengthOverflow,
    /// A version 2 access byte that names no [`Access`].
    #[error("descriptor grants an unknown access {0:#04x}")]
    InvalidAccess(u8),
    /// Bytes remain after the descriptor where exactly one was expected.
    #[error("{0} trailing bytes after descriptor")]
    TrailingBytes(usize),
    /// [`Descriptor::slice`] was asked for an empty or outside range.
    #[error(
        "slice [{offset}, {offset} + {len}) is empty or leaves the {parent_len}-byte descriptor it is cut from"
    )]
    SliceOutOfRange {
        /// Requested offset into the parent.
        offset: u64,
        /// Requested length.
        len: u64,
        /// Length of the parent descriptor.
        parent_len: u64,
    },
}

/// A slice outside its parent is [`RdmaError::OutOfRange`]; every other
/// descriptor error is [`RdmaError::InvalidDescriptor`].
impl From<DescriptorError> for RdmaError {
    fn from(e: DescriptorError) -> Self {
        match e {
            DescriptorError::SliceOutOfRange { .. } => RdmaError::OutOfRange,
            other => RdmaError::InvalidDescriptor(other),
        }
    }
}

impl Descriptor {
    /// Build a descriptor granting [`Access::Read`], checking the same
    /// rules decoding enforces; [`granting`](Self::granting) changes the
    /// access.
    pub fn new(
        backend_key: &str,
        addr: u64,
        len: u64,
        generation: u64,
        packed_key: Bytes,
    ) -> Result<Self, DescriptorError> {
        check_backend_key(backend_key.as_bytes())?;
        check_range(addr, len)?;
        if packed_key.is_empty() || packed_key.len() > MAX_PACKED_KEY_LEN {
            return Err(DescriptorError::InvalidPackedKeyLen(packed_key.len()));
        }
        Ok(Self {
            backend_key: backend_key.to_owned(),
            addr,
            len,
            generation,
            packed_key,
            access: Access::Read,
        })
    }

    /// This descriptor granting `access` instead. The owner's backend
    /// decides what a key may do: a descriptor that claims more than its
    /// registration allows is refused by the owner with
    /// [`RdmaError::AccessDenied`].
    pub fn granting(mut self, access: Access) -> Descriptor {
        self.access = access;
        self
    }

    /// What the descriptor's holder may do with the range.
    pub fn access(&self) -> Access {
        self.access
    }

    /// The backend's wire name (`"ucx"`, `"loopback"`).
    pub fn backend_key(&self) -> &str {
        &self.backend_key
    }
    /// First described byte, in the owner's address space.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Number of described bytes; never zero.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Always `false`: a descriptor never describes zero bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Distinguishes registrations of the same address over time.
    pub fn generation(&self) -> u64 {
        self.generation
    }
    /// The owner's packed remote key. Untrusted bytes on the consumer side.
    pub fn packed_key(&self) -> &Bytes {
        &self.packed_key
    }

    /// A descriptor for `[offset, offset + len)` of this one, with the same
    /// key and generation.
    ///
    /// # Errors
    /// [`DescriptorError::SliceOutOfRange`] for an empty range or one that
    /// leaves the parent (`?` makes it [`RdmaError::OutOfRange`]).
    pub fn slice(&self, offset: u64, len: u64) -> Result<Descriptor, DescriptorError> {
        let refused = DescriptorError::SliceOutOfRange {
            offset,
            len,
            parent_len: self.len,
        };
        let end = offset.checked_add(len).ok_or(refused)?;
        if len == 0 || end > self.len {
            return Err(refused);
        }
        Ok(Descriptor {
            backend_key: self.backend_key.clone(),
            addr: self.addr + offset,
            len,
            generation: self.generation,
            packed_key: self.packed_key.clone(),
            access: self.access,
        })
    }

    /// Size of [`encode`](Self::encode)'s output.
    pub fn encoded_len(&self) -> usize {
        let access_byte = usize::from(self.access != Access::Read);
        FIXED_LEN + access_byte + self.backend_key.len() + self.packed_key.len()
    }

    /// Append the encoding to `out`.
    pub fn encode_into(&self, out: &mut BytesMut) {
        out.reserve(self.encoded_len());
        out.put_slice(&MAGIC);
        if self.access == Access::Read {
            out.put_u8(VERSION_READ);
        } else {
            out.put_u8(VERSION_ACCESS);
            out.put_u8(self.access.to_bits());
        }
        // Lengths were checked at construction: both fit their fields.
        out.put_u8(self.backend_key.len() as u8);
        out.put_slice(self.backend_key.as_bytes());
        out.put_u64_le(self.addr);
        out.put_u64_le(self.len);
        out.put_u64_le(self.generation);
        out.put_u16_le(self.packed_key.len() as u16);
        out.put_slice(&self.packed_key);
    }

    /// The encoding as one buffer.
    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(self.encoded_len());
        self.encode_into(&mut out);
        out.freeze()
    }

    /// Decode exactly one descriptor; trailing bytes are an error.
    pub fn decode(input: &[u8]) -> Result<Descriptor, DescriptorError> {
        let (descriptor, used) = Self::decode_prefix(input)?;
        if used != input.len() {
            return Err(DescriptorError::TrailingBytes(input.len() - used));
        }
        Ok(descriptor)
    }

    /// Decode one descriptor from the front of `input`, and its length.
    pub fn decode_prefix(input: &[u8]) -> Result<(Descriptor, usize), DescriptorError> {
        let mut reader = Reader { input, pos: 0 };
        if reader.take(2)? != MAGIC {
            return Err(DescriptorError::BadMagic);
        }
        let access = match reader.u8()? {
            VERSION_READ => Access::Read,
            VERSION_ACCESS => {
                let bits = reader.u8()?;
                // Read alone is always version 1: one encoding per descriptor.
                Access::from_bits(bits)
                    .filter(|access| *access != Access::Read)
                    .ok_or(DescriptorError::InvalidAccess(bits))?
            }
            version => return Err(DescriptorError::UnsupportedVersion(version)),
        };
        let key_len = reader.u8()? as usize;
        let backend_key = reader.take(key_len)?;
        check_backend_key(backend_key)?;
        let addr = reader.u64()?;
        let len = reader.u64()?;
        let generation = reader.u64()?;
        check_range(addr, len)?;
        let packed_len = reader.u16()? as usize;
        if packed_len == 0 || packed_len > MAX_PACKED_KEY_LEN {
            return Err(DescriptorError::InvalidPackedKeyLen(packed_len));
        }
        let packed_key = Bytes::copy_from_slice(reader.take(packed_len)?);
        let backend_key = String::from_utf8(backend_key.to_vec())
            .map_err(|_| DescriptorError::InvalidBackendKey)?;
        Ok((
            Descriptor {
                backend_key,
                addr,
                len,
                generation,
                packed_key,
                access,
            },
            reader.pos,
        ))
    }
}

fn check_backend_key(key: &[u8]) -> Result<(), DescriptorError> {
    if key.is_empty()
        || key.len() > MAX_BACKEND_KEY_LEN
        || !key.iter().all(|b| b.is_ascii_graphic())
    {
        return Err(DescriptorError::InvalidBackendKey);
    }
    Ok(())
}

fn check_range(addr: u64, len: u64) -> Result<(), DescriptorError> {
    if len == 0 {
        return Err(DescriptorError::ZeroLength);
    }
    if addr == 0 {
        return Err(DescriptorError::NullAddress);
    }
    addr.checked_add(len)
        .ok_or(DescriptorError::LengthOverflow)?;
    Ok(())
}

/// Bounds-checked cursor over untrusted bytes.
struct Reader<'a> {
    input: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DescriptorError> {
        let rest = &self.input[self.pos..];
        if rest.len() < n {
            return Err(DescriptorError::Truncated {
                needed: n - rest.len(),
            });
        }
        self.pos += n;
        Ok(&rest[..n])
    }
    fn u8(&mut self) -> Result<u8, DescriptorError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, DescriptorError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u64(&mut self) -> Result<u64, DescriptorError> {
        let mut raw = [0u8; 8];
        raw.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(raw))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> Descriptor {
        Descriptor::new(
            "ucx",
            0x7f00_0000_1000,
            65536,
            7,
            Bytes::from_static(&[1, 2, 3, 4, 5, 6, 7, 8, 9]),
        )
        .unwrap()
    }

    #[test]
    fn round_trip_preserves_every_field() {
        let d = sample();
        let wire = d.encode();
        assert_eq!(wire.len(), d.encoded_len());
        assert_eq!(Descriptor::decode(&wire).unwrap(), d);
    }

    #[test]
    fn truncated_input_is_refused_at_every_length() {
        let wire = sample().encode();
        for cut in 0..wire.len() {
            assert!(
                matches!(
                    Descriptor::decode(&wire[..cut]),
                    Err(DescriptorError::Truncated { .. })
                ),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn wrong_version_is_refused() {
        let mut wire = sample().encode().to_vec();
        wire[2] = 3;
        assert_eq!(
            Descriptor::decode(&wire),
            Err(DescriptorError::UnsupportedVersion(3))
        );
    }

    /// A read-only descriptor keeps the version 1 bytes older readers
    /// decode; one granting a write is version 2 and says so.
    #[test]
    fn only_a_descriptor_granting_writes_needs_version_two() {
        let read = sample();
        let wire = read.encode();
        assert_eq!((wire[2], wire.len()), (1, read.encoded_len()));
        for access in [Access::Write, Access::ReadWrite] {
            let d = sample().granting(access);
            let wire = d.encode();
            assert_eq!((wire[2], wire[3]), (2, access.to_bits()));
            assert_eq!(wire.len(), d.encoded_len());
            assert_eq!(wire.len(), read.encoded_len() + 1);
            let back = Descriptor::decode(&wire).unwrap();
            assert_eq!((back.access(), &back), (access, &d));
            assert_eq!(back.slice(1, 2).unwrap().access(), access);
        }
    }

    #[test]
    fn an_unknown_access_byte_is_refused() {
        let mut wire = sample().granting(Access::Write).encode().to_vec();
        for bits in [0u8, 1, 4, 0xff] {
            wire[3] = bits;
            assert_eq!(
                Descriptor::decode(&wire),
                Err(DescriptorError::InvalidAccess(bits))
            );
        }
    }

    #[test]
    fn bad_magic_is_refused() {
        let mut wire = sample().encode().to_vec();
        wire[0] = b'X';
        assert_eq!(Descriptor::decode(&wire), Err(DescriptorError::BadMagic));
    }

    #[test]
    fn oversized_packed_key_is_refused_without_reading_it() {
        let mut wire = sample().encode().to_vec();
        let at = wire.len() - 9 - 2;
        wire[at..at + 2].copy_from_slice(&(MAX_PACKED_KEY_LEN as u16 + 1).to_le_bytes());
        assert_eq!(
            Descriptor::decode(&wire),
            Err(DescriptorError::InvalidPackedKeyLen(MAX_PACKED_KEY_LEN + 1))
        );
        assert!(
            Descriptor::new("ucx", 1, 1, 0, Bytes::from(vec![0; MAX_PACKED_KEY_LEN + 1])).is_err()
        );
        assert!(Descriptor::new("ucx", 1, 1, 0, Bytes::new()).is_err());
    }

    #[test]
    fn length_overflow_is_refused() {
        assert_eq!(
            Descriptor::new("ucx", u64::MAX - 1, 2, 0, Bytes::from_static(b"k")),
            Err(DescriptorError::LengthOverflow)
        );
        let mut wire = sample().encode().to_vec();
        // address field starts after magic, version, key length and "ucx".
        wire[7..15].copy_from_slice(&(u64::MAX - 10).to_le_bytes());
        assert_eq!(
            Descriptor::decode(&wire),
            Err(DescriptorError::LengthOverflow)
        );
    }

    #[test]
    fn zero_length_and_null_address_are_refused() {
        assert_eq!(
            Descriptor::new("ucx", 4096, 0, 0, Bytes::from_static(b"k")),
            Err(DescriptorError::ZeroLength)
        );
        assert_eq!(
            Descriptor::new("ucx", 0, 10, 0, Bytes::from_static(b"k")),
            Err(DescriptorError::NullAddress)
        );
    }

    #[test]
    fn trailing_garbage_is_refused_but_prefix_decoding_reports_the_split() {
        let d = sample();
        let mut wire = d.encode().to_vec();
        let used = wire.len();
        wire.extend_from_slice(b"xyz");
        assert_eq!(
            Descriptor::decode(&wire),
            Err(DescriptorError::TrailingBytes(3))
        );
        assert_eq!(Descriptor::decode_prefix(&wire).unwrap(), (d, used));
    }

    #[test]
    fn concatenated_descriptors_decode_one_after_another() {
        let a = sample();
        let b = a.slice(100, 200).unwrap();
        let mut wire = BytesMut::new();
        a.encode_into(&mut wire);
        b.encode_into(&mut wire);
        let (first, used) = Descriptor::decode_prefix(&wire).unwrap();
        let second = Descriptor::decode(&wire[used..]).unwrap();
        assert_eq!((first, second), (a, b));
    }

    #[test]
    fn invalid_backend_key_is_refused() {
        assert_eq!(
            Descriptor::new("", 1, 1, 0, Bytes::from_static(b"k")),
            Err(DescriptorError::InvalidBackendKey)
        );
        assert_eq!(
            Descriptor::new("u x", 1, 1, 0, Bytes::from_static(b"k")),
            Err(DescriptorError::InvalidBackendKey)
        );
        let long = "x".repeat(MAX_BACKEND_KEY_LEN + 1);
        assert_eq!(
            Descriptor::new(&long, 1, 1, 0, Bytes::from_static(b"k")),
            Err(DescriptorError::InvalidBackendKey)
        );
    }

    #[test]
    fn slice_inside_the_parent_shifts_the_address() {
        let d = sample();
        let s = d.slice(10, 20).unwrap();
        assert_eq!((s.addr(), s.len(), s.generation()), (d.addr() + 10, 20, 7));
        assert_eq!(d.slice(0, d.len()).unwrap(), d);
    }

    #[test]
    fn slice_outside_the_parent_is_a_descriptor_error_that_converts_to_out_of_range() {
        let d = sample();
        for (offset, len) in [(0, 0), (d.len(), 1), (1, d.len()), (u64::MAX, 2)] {
            let refused = d.slice(offset, len);
            assert_eq!(
                refused,
                Err(DescriptorError::SliceOutOfRange {
                    offset,
                    len,
                    parent_len: d.len()
                })
            );
            assert_eq!(refused.map_err(RdmaError::from), Err(RdmaError::OutOfRange));
        }
    }

    #[test]
    fn other_descriptor_errors_convert_to_invalid_descriptor() {
        assert_eq!(
            RdmaError::from(DescriptorError::BadMagic),
            RdmaError::InvalidDescriptor(DescriptorError::BadMagic)
        );
    }

    fn arb_descriptor() -> impl Strategy<Value = Descriptor> {
        (
            "[a-z]{1,32}",
            1u64..u64::MAX / 2,
            1u64..u64::MAX / 2,
            any::<u64>(),
            prop::collection::vec(any::<u8>(), 1..=MAX_PACKED_KEY_LEN),
            prop::sample::select(vec![Access::Read, Access::Write, Access::ReadWrite]),
        )
            .prop_map(|(k, a, l, g, p, access)| {
                Descriptor::new(&k, a, l, g, Bytes::from(p))
                    .unwrap()
                    .granting(access)
            })
    }

    proptest! {
        #[test]
        fn encode_then_decode_is_identity(d in arb_descriptor()) {
            prop_assert_eq!(Descriptor::decode(&d.encode()).unwrap(), d);
        }

        #[test]
        fn decoding_random_bytes_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
            let _ = Descriptor::decode(&bytes);
            let _ = Descriptor::decode_prefix(&bytes);
        }

        #[test]
        fn decoding_mutated_descriptors_never_panics_and_stays_in_bounds(
            d in arb_descriptor(),
            flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
            cut in any::<prop::sample::Index>(),
        ) {
            let mut wire = d.encode().to_vec();
            for (at, byte) in flips {
                let i = at.index(wire.len());
                wire[i] = byte;
            }
            let cut = cut.index(wire.len() + 1);
            if let Ok((decoded, used)) = Descriptor::decode_prefix(&wire[..cut]) {
                prop_assert!(used <= cut);
                prop_assert!(decoded.packed_key().len() <= MAX_PACKED_KEY_LEN);
                prop_assert!(decoded.addr().checked_add(decoded.len()).is_some());
            }
        }
    }
}
