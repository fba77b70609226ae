//! The values that cross the backend seam: a registration ([`BackendRegion`]),
//! one remote read ([`BackendGet`]), one remote write ([`BackendPut`]) and a
//! peer's name ([`PeerId`]).

use std::fmt;
use std::time::Duration;

use bytes::Bytes;

/// Names a remote peer to a backend, once told out of band how to reach it.
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
    /// Start of the range the backend pinned; may be below the mapped
    /// pointer (page rounding), so never a base for offsets.
    pub effective_addr: u64,
    /// Length of the pinned range; always covers the requested range.
    pub effective_len: u64,
    /// Opaque key material, fit to cache or send.
    pub packed_key: Bytes,
}

/// One remote read: `len` bytes at `remote_addr` on `peer`, written at
/// `local_offset` inside a locally registered region. Remote address and key
/// come from a descriptor the owner authored.
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
    /// Destination offset from the mapped pointer (not `effective_addr`).
    pub local_offset: u64,
    /// Bytes to read.
    pub len: u64,
    /// How long the transfer may take before it is cancelled with
    /// [`RdmaError::Timeout`](crate::RdmaError::Timeout); `None` uses the
    /// backend's default.
    pub deadline: Option<Duration>,
}

/// One remote write: `len` bytes read at `local_offset` inside a locally
/// registered region, written at `remote_addr` on `peer`. Remote address
/// and key come from a descriptor the owner authored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendPut {
    /// The peer to write to.
    pub peer: PeerId,
    /// Absolute address in the peer's address space, authored by the peer.
    pub remote_addr: u64,
    /// The peer's packed key covering `remote_addr`. Untrusted bytes.
    pub packed_key: Bytes,
    /// Source region, from a previous map on this side.
    pub local_region_id: u64,
    /// Source offset from the mapped pointer (not `effective_addr`).
    pub local_offset: u64,
    /// Bytes to write.
    pub len: u64,
    /// How long the transfer may take before it is cancelled with
    /// [`RdmaError::Timeout`](crate::RdmaError::Timeout); `None` uses the
    /// backend's default.
    pub deadline: Option<Duration>,
}
