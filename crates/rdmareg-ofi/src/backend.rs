//! [`OfiBackend`]: the [`RdmaBackend`](rdmareg_backend::RdmaBackend) seam
//! over an [`OfiEngine`](crate::OfiEngine).

use rdmareg_engine::backend::{Backend, Driver};
use rdmareg_engine::front::NoCallerCopies;

use crate::engine::PeerChange;

/// The libfabric implementation of
/// [`RdmaBackend`](rdmareg_backend::RdmaBackend); obtained from
/// [`OfiEngine::backend`](crate::OfiEngine::backend). Its backend key is
/// `"ofi"`.
///
/// Each method is one command for the engine's progress thread, with the
/// engine kit's cancellation rules ([`Backend`]).
pub type OfiBackend = Backend<OfiDriver>;

/// The libfabric engine as a driver of the engine kit: names the types
/// behind [`OfiBackend`]. It has no values.
#[derive(Debug)]
pub enum OfiDriver {}

// SAFETY: the progress thread keeps the seam's contract (the conformance
// kit runs against it over tcp and shm): see `progress::regions` for
// unmaps and `progress::reads` for results only after the provider let go.
unsafe impl Driver for OfiDriver {
    const KEY: &'static str = "ofi";
    type PeerChange = PeerChange;
    type CallerCopies = NoCallerCopies;
    /// Served writes (`progress::writes`, `progress::serve_writes`).
    const WRITES: bool = true;
}
