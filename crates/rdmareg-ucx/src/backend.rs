//! [`UcxBackend`]: the [`RdmaBackend`] seam over a [`UcxEngine`](crate::UcxEngine).
//!
//! Each method turns into one command for the progress thread and awaits its
//! one-shot answer. What this layer adds is cancellation safety:
//!
//! - `map` mints the region id *before* it pushes the command. If its future
//!   is dropped before the answer was taken, a guard pushes a compensating
//!   unmap of that id on the control lane (idempotent: harmless if the map
//!   never ran); the thread, for its part, skips a map whose caller is gone
//!   and rolls back one whose answer could not be delivered.
//! - `unmap` is pushed onto the ring when it is called, in order with the
//!   caller's earlier GETs (which it must wait for) and later ones (which it
//!   must refuse). Only if the ring is full does the future wait for room;
//!   dropped meanwhile, it diverts the unmap to the control lane, so an unmap
//!   proceeds whether or not its future is ever polled.
//! - `get` leaves everything to the thread once pushed: the destination stays
//!   held until UCX has released the request, whether or not anyone awaits.

use std::sync::Arc;

use futures::future::BoxFuture;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, BackendRegion, RdmaError};

use crate::engine::UcxFront;

/// The UCX implementation of [`RdmaBackend`]; obtained from
/// [`UcxEngine::backend`](crate::UcxEngine::backend).
///
/// Its backend key is `"ucx"`; see the crate documentation for the safety
/// model.
///
/// # Cancellation
///
/// - `map` mints the region id before it submits the command; if its future
///   is dropped before the answer was taken, a compensating unmap of that id
///   follows (harmless if the map never ran), and the progress thread skips a
///   map whose caller is gone or rolls back one whose answer it could not
///   deliver. A dropped map leaves no registration behind.
/// - `unmap` is submitted when it is called, in order with the caller's
///   earlier and later GETs; if the ring is full and the future is dropped
///   before there was room, the unmap is diverted to the control lane. It
///   proceeds whether or not the future is ever polled.
/// - `get`, once submitted, runs to its end whether or not anyone awaits it;
///   the destination stays held until UCX has released the request.
#[derive(Debug)]
pub struct UcxBackend {
    front: UcxFront,
}

impl UcxBackend {
    pub(crate) fn new(front: UcxFront) -> UcxBackend {
        UcxBackend { front }
    }
}

// SAFETY: the engine keeps contract points 1, 3, 4 and 8 (the conformance
// kit runs against it on tcp and same-host lanes): see `progress::regions`
// for unmaps and `progress::gets` for answers only after UCX let go.
unsafe impl RdmaBackend for UcxBackend {
    fn key(&self) -> &str {
        "ucx"
    }

    /// # Cancel safety
    /// Dropping the future leaves no registration behind: see
    /// [`UcxBackend`]'s cancellation rules.
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
    /// Once submitted, dropping the future does not stop the transfer; the
    /// destination region stays held until UCX has released it. Dropped
    /// before it was submitted, nothing happens.
    unsafe fn get(&self, request: BackendGet) -> BoxFuture<'_, Result<(), RdmaError>> {
        // SAFETY: this method's contract is the front's.
        unsafe { self.front.get(request) }
    }

    /// One command for the whole batch: every entry is posted in one turn
    /// of the progress thread and the answers come back together.
    unsafe fn get_batch(
        &self,
        requests: Vec<BackendGet>,
    ) -> BoxFuture<'_, Vec<Result<(), RdmaError>>> {
        // SAFETY: this method's contract is the front's.
        unsafe { self.front.get_batch(requests) }
    }

    /// As `get_batch`, and a same-host list the progress thread copies
    /// keeps its copy worked out for the next post of the same `Arc`
    /// (`progress::copy_plans`).
    unsafe fn get_shared_batch(
        &self,
        requests: Arc<[BackendGet]>,
    ) -> BoxFuture<'_, Vec<Result<(), RdmaError>>> {
        // SAFETY: this method's contract is the front's.
        unsafe { self.front.get_shared_batch(requests) }
    }

    /// The progress thread's own count: moved only by successful
    /// `ucp_mem_map` / `ucp_mem_unmap` calls, so `Some(0)` after teardown
    /// means every region was really unmapped.
    fn live_registrations(&self) -> Option<usize> {
        self.front.live_registrations()
    }
}
