//! The owner-served read protocol over tagged messages: what a consumer
//! asks an owner for, and how the owner's answer is told apart.
//!
//! # Why owners serve reads themselves
//!
//! On the software providers tested here (`tcp;ofi_rxm`, `shm`) a one-sided
//! `fi_read` already in flight keeps copying out of a region after `fi_close`
//! of the region returned, and `shm` serves a key of a closed region (see
//! `docs/ofi.md`). So on those providers the owner's engine serves each read
//! itself: it checks the request against its live registrations, takes a
//! read lease on the region, and sends the bytes as one tagged message
//! straight into the consumer's destination; an unmap answers only once
//! every lease on the region was released, which happens when the send's
//! completion (success or error) was read.
//!
//! # Exchange
//!
//! 1. The consumer posts a tagged receive of `length` bytes into its
//!    destination, directed at the owner's address, with tag
//!    `request_id` and ignore mask [`REPLY_IGNORE`] — *before* it asks.
//! 2. It sends a [`ReadRequest`] with tag [`REQUEST_TAG`].
//! 3. The owner (which keeps receives posted for [`REQUEST_TAG`]) checks it
//!    and sends either the `length` bytes with tag `request_id`, or a
//!    zero-length refusal with tag [`refusal_tag`]`(request_id, reason)`.
//!    Both match the consumer's receive; the completion's tag tells which.
//!
//! Request ids are below 2⁴⁸, so the refusal bit, the reason byte and the
//! request bit never collide with one.
//!
//! # Request, version 1 (integers little-endian)
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 1 | version, `1` |
//! | 1 | 3 | zero |
//! | 4 | 8 | `request_id`, 1 to 2⁴⁸ − 1 |
//! | 12 | 8 | `region_id` (from the key) |
//! | 20 | 16 | `capability` (from the key) |
//! | 36 | 8 | `address`: the first byte wanted, as an address in the owner |
//! | 44 | 8 | `length`, non-zero |
//! | 52 | 2 | `reply_len`: length of the consumer's fabric address, 1 to 256 |
//! | 54 | `reply_len` | the consumer's fabric address: where the answer goes |
//!
//! Decoding never panics and refuses trailing or missing bytes: requests
//! come from peers.
//!
//! # Probe
//!
//! A message of exactly the four bytes [`PROBE`] with tag [`REQUEST_TAG`]
//! asks nothing: the owner takes it and answers nothing. A consumer sends
//! one to an owner it waits on and hears nothing from; what it watches is
//! whether the provider can deliver it at all (over `tcp;ofi_rxm` a dead
//! owner refuses the reconnection, and the send is never accepted). Its
//! first byte is not a request version, so an owner that does not know
//! probes drops it as malformed — also without an answer.

use rdmareg_core::RdmaError;

use crate::key::{CAPABILITY_LEN, MAX_FABRIC_ADDRESS};

/// The request layout version.
pub const REQUEST_VERSION: u8 = 1;
/// Bytes of a request before the consumer's address.
pub const REQUEST_HEADER_LEN: usize = 54;
/// The longest request.
pub const REQUEST_MAX: usize = REQUEST_HEADER_LEN + MAX_FABRIC_ADDRESS;
/// A liveness probe (see the module docs).
pub const PROBE: [u8; 4] = [0xFF, 0, 0, 0];
/// The tag of every request.
pub const REQUEST_TAG: u64 = 1 << 63;
/// The tag bit of a refusal.
pub const REFUSAL_BIT: u64 = 1 << 62;
/// Where a refusal's reason sits in its tag.
const REASON_SHIFT: u32 = 48;
/// The bits of a refusal's reason.
const REASON_MASK: u64 = 0xFF << REASON_SHIFT;
/// The bits of a request id.
pub const REQUEST_ID_MASK: u64 = (1 << REASON_SHIFT) - 1;
/// What a consumer's receive ignores of the tag: it matches the reply and
/// every refusal of its request id.
pub const REPLY_IGNORE: u64 = REFUSAL_BIT | REASON_MASK;

/// Why an owner refused a read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No live registration has that id (deregistered, or a stale key).
    RegionUnknown,
    /// The registration exists but the capability does not match it.
    CapabilityMismatch,
    /// The range lies outside the registration.
    OutOfRange,
    /// The registration is being deregistered.
    Deregistering,
    /// The owner already has as many unfinished replies to this consumer
    /// as it allows (`OfiConfig::max_served_replies_per_peer`); the read
    /// can be retried once earlier ones were answered.
    Busy,
}

impl Refusal {
    /// Codes are only ever added, never reassigned; a consumer that gets a
    /// code it does not know fails the read with a typed error naming it.
    fn code(self) -> u64 {
        match self {
            Refusal::RegionUnknown => 1,
            Refusal::CapabilityMismatch => 2,
            Refusal::OutOfRange => 3,
            Refusal::Deregistering => 4,
            Refusal::Busy => 5,
        }
    }
}

/// The text of the error a read refused as [`Refusal::Busy`] gets.
pub const BUSY_TEXT: &str = "ofi: owner busy: too many of this consumer's reads are in flight at the owner (its per-consumer bound of unfinished replies); retry once earlier reads have been answered";

/// The tag of a refusal of `request_id`.
pub fn refusal_tag(request_id: u64, refusal: Refusal) -> u64 {
    REFUSAL_BIT | (refusal.code() << REASON_SHIFT) | (request_id & REQUEST_ID_MASK)
}

/// What a completed reply receive means, from its tag: `Ok` for the bytes,
/// else the seam's error for the refusal — `OutOfRange` for a range the
/// registration does not cover, `RegionNotFound` for a registration that is
/// gone, going, or not the consumer's (a wrong capability says no more
/// than that), a transient `Backend` with [`BUSY_TEXT`] for a busy owner,
/// `Backend` for a reason this build does not know.
pub fn reply_outcome(tag: u64) -> Result<(), RdmaError> {
    if tag & REFUSAL_BIT == 0 {
        return Ok(());
    }
    match (tag & REASON_MASK) >> REASON_SHIFT {
        3 => Err(RdmaError::OutOfRange),
        1 | 2 | 4 => Err(RdmaError::RegionNotFound),
        5 => Err(RdmaError::Backend(BUSY_TEXT.to_owned())),
        other => Err(RdmaError::Backend(format!(
            "ofi: the owner refused the read for an unknown reason {other}"
        ))),
    }
}

/// A consumer's request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadRequest {
    /// The consumer's id of this read (the reply's tag).
    pub request_id: u64,
    /// The owner's registration id, from the key.
    pub region_id: u64,
    /// The capability, from the key.
    pub capability: [u8; CAPABILITY_LEN],
    /// First byte wanted, as an address in the owner.
    pub address: u64,
    /// Bytes wanted.
    pub length: u64,
    /// The consumer's fabric address.
    pub reply_to: Vec<u8>,
}

impl ReadRequest {
    /// The wire form.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(REQUEST_HEADER_LEN + self.reply_to.len());
        out.extend_from_slice(&[REQUEST_VERSION, 0, 0, 0]);
        out.extend_from_slice(&self.request_id.to_le_bytes());
        out.extend_from_slice(&self.region_id.to_le_bytes());
        out.extend_from_slice(&self.capability);
        out.extend_from_slice(&self.address.to_le_bytes());
        out.extend_from_slice(&self.length.to_le_bytes());
        out.extend_from_slice(&(self.reply_to.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.reply_to);
        out
    }

    /// Decodes untrusted request bytes; `None` for anything malformed.
    pub fn decode(bytes: &[u8]) -> Option<ReadRequest> {
        if bytes.len() < REQUEST_HEADER_LEN || bytes.len() > REQUEST_MAX {
            return None;
        }
        if bytes[0] != REQUEST_VERSION || bytes[1..4] != [0, 0, 0] {
            return None;
        }
        let u64_at = |at: usize| {
            let mut raw = [0u8; 8];
            raw.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(raw)
        };
        let request_id = u64_at(4);
        let length = u64_at(44);
        let reply_len = usize::from(u16::from_le_bytes([bytes[52], bytes[53]]));
        if request_id == 0 || request_id & !REQUEST_ID_MASK != 0 || length == 0 {
            return None;
        }
        if reply_len == 0 || bytes.len() != REQUEST_HEADER_LEN + reply_len {
            return None;
        }
        let mut capability = [0u8; CAPABILITY_LEN];
        capability.copy_from_slice(&bytes[20..36]);
        Some(ReadRequest {
            request_id,
            region_id: u64_at(12),
            capability,
            address: u64_at(36),
            length,
            reply_to: bytes[REQUEST_HEADER_LEN..].to_vec(),
        })
    }
}

/// Compares capabilities in time independent of where they differ.
pub fn capability_matches(a: &[u8; CAPABILITY_LEN], b: &[u8; CAPABILITY_LEN]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ReadRequest {
        ReadRequest {
            request_id: 42,
            region_id: 7,
            capability: [5; CAPABILITY_LEN],
            address: 0x1000,
            length: 64,
            reply_to: b"fi_shm://9\0".to_vec(),
        }
    }

    #[test]
    fn a_request_round_trips_and_every_cut_or_extension_is_refused() {
        let wire = sample().encode();
        assert_eq!(ReadRequest::decode(&wire), Some(sample()));
        for cut in 0..wire.len() {
            assert_eq!(ReadRequest::decode(&wire[..cut]), None, "cut at {cut}");
        }
        let mut longer = wire.clone();
        longer.push(0);
        assert_eq!(ReadRequest::decode(&longer), None);
    }

    #[test]
    fn a_probe_is_no_request() {
        assert_eq!(ReadRequest::decode(&PROBE), None);
        assert_ne!(PROBE[0], REQUEST_VERSION);
    }

    #[test]
    fn a_request_id_beyond_48_bits_or_zero_is_refused() {
        for id in [0, 1 << 48, REQUEST_TAG | 1] {
            let wire = ReadRequest {
                request_id: id,
                ..sample()
            }
            .encode();
            assert_eq!(ReadRequest::decode(&wire), None, "id {id:#x}");
        }
    }

    #[test]
    fn each_refusal_tag_maps_to_its_seam_error_and_a_plain_tag_to_ok() {
        assert_eq!(reply_outcome(42), Ok(()));
        assert_eq!(
            reply_outcome(refusal_tag(42, Refusal::OutOfRange)),
            Err(RdmaError::OutOfRange)
        );
        for refusal in [
            Refusal::RegionUnknown,
            Refusal::CapabilityMismatch,
            Refusal::Deregistering,
        ] {
            let tag = refusal_tag(42, refusal);
            assert_eq!(tag & REQUEST_ID_MASK, 42);
            assert_eq!(tag & !REPLY_IGNORE, 42, "the reply receive matches it");
            assert_eq!(reply_outcome(tag), Err(RdmaError::RegionNotFound));
        }
        assert!(matches!(
            reply_outcome(REFUSAL_BIT | (9 << 48) | 42),
            Err(RdmaError::Backend(text)) if text.contains("unknown reason 9")
        ));
    }

    #[test]
    fn a_busy_refusal_is_code_five_and_a_transient_error() {
        let tag = refusal_tag(42, Refusal::Busy);
        assert_eq!((tag & REASON_MASK) >> REASON_SHIFT, 5);
        assert_eq!(tag & !REPLY_IGNORE, 42, "the reply receive matches it");
        let err = reply_outcome(tag).unwrap_err();
        assert_eq!(err, RdmaError::Backend(BUSY_TEXT.to_owned()));
        assert!(err.is_transient());
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_decode_to_a_canonical_request_or_nothing(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400)
        ) {
            if let Some(request) = ReadRequest::decode(&bytes) {
                proptest::prop_assert_eq!(request.encode(), bytes);
            }
        }
    }

    #[test]
    fn capabilities_match_only_when_every_byte_does() {
        let a = [3u8; CAPABILITY_LEN];
        let mut b = a;
        assert!(capability_matches(&a, &b));
        b[15] ^= 1;
        assert!(!capability_matches(&a, &b));
    }
}
