//! [`OfiBackend`]: the [`RdmaBackend`] seam over an [`OfiEngine`](crate::OfiEngine).
//!
//! Each method is the engine kit's front ([`rdmareg_engine::front`]): one
//! command for the progress thread and an await of its one-shot answer,
//! with the kit's cancellation rules:
//!
//! - a dropped `map` leaves no registration behind;
//! - `unmap` is submitted when it is called, in order with the caller's
//!   GETs, and proceeds whether or not its future is polled;
//! - `get` and `get_batch` leave everything to the thread once pushed: the
//!   destination stays held until the provider let go of the read.

use futures::future::BoxFuture;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, BackendRegion, RdmaError};

use crate::engine::OfiFront;

/// The libfabric implementation of [`RdmaBackend`]; obtained from
/// [`OfiEngine::backend`](crate::OfiEngine::backend). Its backend key is
/// `"ofi"`.
#[derive(Debug, Clone)]
pub struct OfiBackend {
    front: OfiFront,
}

impl OfiBackend {
    pub(crate) fn new(front: OfiFront) -> OfiBackend {
        OfiBackend { front }
    }
}

// SAFETY: the engine keeps contract points 1, 3, 4 and 8 (the conformance
// kit runs against it over tcp and shm): see `engine` and `progress`.
unsafe impl RdmaBackend for OfiBackend {
    fn key(&self) -> &str {
        "ofi"
    }

    /// # Cancel safety
    /// Dropping the future leaves no registration behind.
    unsafe fn map(
        &self,
        ptr: usize,
        len: usize,
    ) -> BoxFuture<'_, Result<BackendRegion, RdmaError>> {
        // SAFETY: this method's contract is the front's.
        unsafe { self.front.map(ptr, len) }
    }

    /// # Cancel safety
    /// The unmap is submitted when this method is called; dropping the
    /// future abandons only the answer.
    fn unmap(&self, backend_region_id: u64) -> BoxFuture<'_, Result<(), RdmaError>> {
        self.front.unmap(backend_region_id)
    }

    /// # Cancel safety
    /// Once submitted, dropping the future does not stop the read; the
    /// destination stays held until the provider let go of it.
    unsafe fn get(&self, request: BackendGet) -> BoxFuture<'_, Result<(), RdmaError>> {
        // SAFETY: this method's contract is the front's.
        unsafe { self.front.get(request) }
    }

    /// One command for the whole batch: every entry is posted in one turn
    /// of the progress thread, the answers come back together.
    unsafe fn get_batch(
        &self,
        requests: Vec<BackendGet>,
    ) -> BoxFuture<'_, Vec<Result<(), RdmaError>>> {
        // SAFETY: this method's contract is the front's.
        unsafe { self.front.get_batch(requests) }
    }

    /// The progress thread's own count: moved only by successful
    /// `fi_mr_reg` and `fi_close` of a region.
    fn live_registrations(&self) -> Option<usize> {
        self.front.live_registrations()
    }
}
