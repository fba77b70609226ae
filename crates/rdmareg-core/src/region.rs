//! The values that cross the backend seam: what a registration looks like
//! from above ([`BackendRegion`]), one remote read ([`BackendGet`]), and the
//! name of a peer ([`PeerId`]).
//!
//! Nothing here is backend-specific: a region is an opaque id, a byte range
//! and packed key bytes.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;

/// Names a remote peer to a backend.
///
/// The backend is told how to reach a peer out of band (for UCX, its packed
/// worker address); from then on the peer is named by this id alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub u64);

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "peer#{}", self.0)
    }
}

impl From<u64> for PeerId {
    fn from(value: u64) -> Self {
        PeerId(value)
    }
}

/// One registered range, as the backend reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendRegion {
    /// Names the registration in a later unmap. Opaque above the backend.
    pub backend_region_id: u64,
    /// Start of the range the backend actually pinned. May be *below* the
    /// mapped pointer (backends round outward to pages), so it is a fact to
    /// report and charge, never a base for offset arithmetic.
    pub effective_addr: u64,
    /// Length of the pinned range; always covers the requested range.
    pub effective_len: u64,
    /// Endpoint-independent key material, opaque bytes that may be cached,
    /// sent on the wire, or held anywhere.
    pub packed_key: Bytes,
}

/// One remote read: `len` bytes at `remote_addr` on `peer`, written at
/// `local_offset` inside a locally registered region.
///
/// `remote_addr` and `packed_key` come from a descriptor the owner authored;
/// the consumer never computes remote addresses itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendGet {
    /// The peer to read from.
    pub peer: PeerId,
    /// Absolute address in the peer's address space, authored by the peer.
    pub remote_addr: u64,
    /// The peer's packed key covering `remote_addr`. Untrusted bytes.
    pub packed_key: Bytes,
    /// Destination region, from a previous map on this side.
    pub local_region_id: u64,
    /// Destination offset, measured from the pointer that was mapped (not from
    /// [`BackendRegion::effective_addr`]).
    pub local_offset: u64,
    /// Bytes to read.
    pub len: u64,
    /// How long the transfer may take.
    ///
    /// Past it the transfer is cancelled and the GET fails with
    /// [`RdmaError::Timeout`](crate::RdmaError::Timeout). `None` uses the
    /// backend's configured default.
    pub deadline: Option<Duration>,
}
