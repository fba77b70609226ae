//! The loopback packed key: which instance and region a key names, plus a
//! per-registration nonce.
//!
//! # Format (28 bytes, integers little-endian)
//!
//! | bytes | field |
//! |---|---|
//! | 4 | magic and version, `b"LBK1"` |
//! | 8 | instance: fabric-unique number of the instance that registered |
//! | 8 | region id on that instance |
//! | 8 | nonce drawn at registration |
//!
//! The instance number (not the peer id) is what a key names, so a key stays
//! stale after its peer id is given to a new instance. The nonce makes a key
//! that merely guesses a live region id fail, and region ids are never reused,
//! so a key outlives its registration only as a detectably stale key. Anything
//! that is not exactly this layout is [`RdmaError::InvalidKey`].

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::{BufMut, Bytes, BytesMut};
use rdmareg_core::RdmaError;

const MAGIC: [u8; 4] = *b"LBK1";
/// Exact length of a loopback packed key.
pub(crate) const PACKED_KEY_LEN: usize = 4 + 8 + 8 + 8;

/// A decoded loopback key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PackedKey {
    pub(crate) instance: u64,
    pub(crate) region: u64,
    pub(crate) nonce: u64,
}

impl PackedKey {
    pub(crate) fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(PACKED_KEY_LEN);
        out.put_slice(&MAGIC);
        out.put_u64_le(self.instance);
        out.put_u64_le(self.region);
        out.put_u64_le(self.nonce);
        out.freeze()
    }

    /// Parse untrusted bytes; anything but exactly one well-formed key is
    /// [`RdmaError::InvalidKey`].
    pub(crate) fn decode(raw: &[u8]) -> Result<Self, RdmaError> {
        if raw.len() != PACKED_KEY_LEN || raw[..4] != MAGIC {
            return Err(RdmaError::InvalidKey);
        }
        let field = |at: usize| {
            let mut le = [0u8; 8];
            le.copy_from_slice(&raw[at..at + 8]);
            u64::from_le_bytes(le)
        };
        Ok(Self {
            instance: field(4),
            region: field(12),
            nonce: field(20),
        })
    }
}

/// A fresh nonce: the process-random hash keys of `RandomState` mixed with a
/// counter, so two registrations never share one by construction and nonces
/// are not predictable from outside the process.
pub(crate) fn fresh_nonce() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> PackedKey {
        PackedKey {
            instance: 3,
            region: 17,
            nonce: 0xDEAD_BEEF_0BAD_F00D,
        }
    }

    #[test]
    fn encoded_key_decodes_to_itself() {
        let key = sample();
        let wire = key.encode();
        assert_eq!(wire.len(), PACKED_KEY_LEN);
        assert_eq!(PackedKey::decode(&wire), Ok(key));
    }

    #[test]
    fn every_truncation_and_every_extension_is_invalid() {
        let wire = sample().encode();
        for cut in 0..wire.len() {
            assert_eq!(PackedKey::decode(&wire[..cut]), Err(RdmaError::InvalidKey));
        }
        let mut longer = wire.to_vec();
        longer.push(0);
        assert_eq!(PackedKey::decode(&longer), Err(RdmaError::InvalidKey));
    }

    #[test]
    fn wrong_magic_is_invalid() {
        let mut wire = sample().encode().to_vec();
        wire[3] = b'2';
        assert_eq!(PackedKey::decode(&wire), Err(RdmaError::InvalidKey));
    }

    #[test]
    fn nonces_do_not_repeat() {
        let nonces: std::collections::HashSet<u64> = (0..1000).map(|_| fresh_nonce()).collect();
        assert_eq!(nonces.len(), 1000);
    }
}
