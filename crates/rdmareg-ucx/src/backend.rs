//! [`UcxBackend`]: the [`RdmaBackend`](rdmareg_backend::RdmaBackend) seam
//! over a [`UcxEngine`](crate::UcxEngine).

use rdmareg_engine::backend::{Backend, Driver};

use crate::command::{PeerChange, Signals};

/// The UCX implementation of
/// [`RdmaBackend`](rdmareg_backend::RdmaBackend); obtained from
/// [`UcxEngine::backend`](crate::UcxEngine::backend). Its backend key is
/// `"ucx"`; see the crate documentation for the safety model.
///
/// Each method is one command for the engine's progress thread, with the
/// engine kit's cancellation rules ([`Backend`]); a same-host read the
/// caller's thread may copy itself is copied there.
pub type UcxBackend = Backend<UcxDriver>;

/// The UCX engine as a driver of the engine kit: names the types behind
/// [`UcxBackend`]. It has no values.
#[derive(Debug)]
pub enum UcxDriver {}

// SAFETY: the progress thread keeps the seam's contract (the conformance
// kit runs against it on tcp and same-host lanes): see `progress::regions`
// for unmaps and `progress::gets` for results only after UCX let go.
unsafe impl Driver for UcxDriver {
    const KEY: &'static str = "ucx";
    type PeerChange = PeerChange;
    type CallerCopies = Signals;
    const SENDS_NOTICES_AFTER_READS: bool = true;
    const WRITES: bool = true;
}
