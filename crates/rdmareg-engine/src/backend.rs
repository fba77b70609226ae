//! A driver's [`RdmaBackend`]: the seam's methods delegated to its
//! [`Front`].
//!
//! Every progress-thread backend implements the seam the same way, so the
//! implementation lives here once. What stays with the driver is the
//! promise that its thread keeps the seam's contract, stated by
//! implementing the unsafe trait [`Driver`].

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use rdmareg_backend::{BackendLease, RdmaBackend};
use rdmareg_core::{
    Access, BackendGet, BackendPut, BackendRegion, LeaseTerms, Notice, NoticeDrops, NoticeSender,
    PeerId, RdmaError, WrittenRanges,
};

use crate::front::{CallerCopies, Front};

/// A transport whose progress thread keeps the backend seam's contract.
///
/// # Safety
/// The progress thread fed through a `Front<Self::PeerChange,
/// Self::CallerCopies>` keeps every contract point of [`RdmaBackend`]:
/// above all, it writes no byte into a destination after the read's result
/// was sent and touches no region after its unmap returned `Ok`.
pub unsafe trait Driver: Send + Sync + 'static {
    /// The backend key (`RdmaBackend::key`).
    const KEY: &'static str;
    /// The driver's own command ([`Command::Driver`](crate::command::Command::Driver)).
    type PeerChange: Send + 'static;
    /// Reads it completes on the caller's thread, if any.
    type CallerCopies: CallerCopies;
    /// Whether its thread sends a read's notice itself, on the read's own
    /// completion ([`Handler::get_with_notice`](crate::command::Handler::get_with_notice)):
    /// one hand-off fewer than the seam's default, which reads and then
    /// sends the notice as a second command.
    const SENDS_NOTICES_AFTER_READS: bool = false;
    /// Whether its thread maps memory writable and serves writes
    /// ([`Handler::put`](crate::command::Handler::put)); without, the
    /// backend refuses both as unsupported before submitting anything.
    const WRITES: bool = false;
}

/// The [`RdmaBackend`] of one engine of driver `D`.
///
/// # Cancellation
/// As [`front`](crate::front) describes: a dropped `map` leaves no
/// registration behind; an `unmap` is submitted when it is called and
/// proceeds whether or not its future is polled; a submitted `get` runs to
/// its end, its destination held until the transport released it.
pub struct Backend<D: Driver> {
    front: Front<D::PeerChange, D::CallerCopies>,
    driver: PhantomData<fn() -> D>,
}

impl<D: Driver> Backend<D> {
    /// The backend over `front`.
    pub fn new(front: Front<D::PeerChange, D::CallerCopies>) -> Backend<D> {
        Backend {
            front,
            driver: PhantomData,
        }
    }
}

impl<D: Driver> Clone for Backend<D> {
    fn clone(&self) -> Self {
        Backend::new(self.front.clone())
    }
}

impl<D: Driver> fmt::Debug for Backend<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Backend")
            .field("key", &D::KEY)
            .finish_non_exhaustive()
    }
}

// SAFETY: `D: Driver` promises that the thread behind the front keeps the
// contract; the front adds only submission and cancellation, which keep it.
unsafe impl<D: Driver> RdmaBackend for Backend<D> {
    fn key(&self) -> &str {
        D::KEY
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

    /// Writable access only for a driver with [`Driver::WRITES`]; without,
    /// refused before anything is submitted.
    ///
    /// # Cancel safety
    /// Dropping the future leaves no registration behind.
    unsafe fn map_with_access(
        &self,
        ptr: usize,
        len: usize,
        access: Access,
    ) -> BoxFuture<'_, Result<BackendRegion, RdmaError>> {
        if access != Access::Read && !D::WRITES {
            return Box::pin(async { Err(crate::command::unsupported_writes()) });
        }
        // SAFETY: this method's contract is the front's.
        unsafe { self.front.map_with_access(ptr, len, access) }
    }

    /// # Cancel safety
    /// Once submitted, dropping the future does not stop the write; the
    /// source stays held until the transport let go of it.
    unsafe fn put(&self, request: BackendPut) -> BoxFuture<'_, Result<(), RdmaError>> {
        if !D::WRITES {
            return Box::pin(async { Err(crate::command::unsupported_writes()) });
        }
        // SAFETY: this method's contract is the front's.
        unsafe { self.front.put(request) }
    }

    /// One command for the whole batch; the results come back together.
    unsafe fn put_batch(
        &self,
        requests: Vec<BackendPut>,
    ) -> BoxFuture<'_, Vec<Result<(), RdmaError>>> {
        if !D::WRITES {
            let refused = vec![Err(crate::command::unsupported_writes()); requests.len()];
            return Box::pin(async move { refused });
        }
        // SAFETY: this method's contract is the front's.
        unsafe { self.front.put_batch(requests) }
    }

    /// # Cancel safety
    /// The unmap is submitted when this method is called; dropping the
    /// future abandons only the result.
    fn unmap(&self, backend_region_id: u64) -> BoxFuture<'_, Result<(), RdmaError>> {
        self.front.unmap(backend_region_id)
    }

    /// # Cancel safety
    /// Once submitted, dropping the future does not stop the read; the
    /// destination stays held until the transport released it.
    unsafe fn get(&self, request: BackendGet) -> BoxFuture<'_, Result<(), RdmaError>> {
        // SAFETY: this method's contract is the front's.
        unsafe { self.front.get(request) }
    }

    /// One command for the whole batch; the results come back together.
    unsafe fn get_batch(
        &self,
        requests: Vec<BackendGet>,
    ) -> BoxFuture<'_, Vec<Result<(), RdmaError>>> {
        // SAFETY: this method's contract is the front's.
        unsafe { self.front.get_batch(requests) }
    }

    /// As `get_batch`; the driver may keep work derived from the list for
    /// the next post of the same `Arc`.
    unsafe fn get_shared_batch(
        &self,
        requests: Arc<[BackendGet]>,
    ) -> BoxFuture<'_, Vec<Result<(), RdmaError>>> {
        // SAFETY: this method's contract is the front's.
        unsafe { self.front.get_shared_batch(requests) }
    }

    /// The progress thread's own count, moved only by registrations and
    /// deregistrations that succeeded.
    fn live_registrations(&self) -> Option<usize> {
        self.front.live_registrations()
    }

    fn send_notice(&self, peer: PeerId, notice: Bytes) -> BoxFuture<'_, Result<(), RdmaError>> {
        self.front.send_notice(peer, notice)
    }

    unsafe fn get_with_notice(
        &self,
        request: BackendGet,
        notice: Bytes,
    ) -> BoxFuture<'_, Result<(), RdmaError>> {
        if D::SENDS_NOTICES_AFTER_READS {
            // SAFETY: this method's contract is the front's.
            unsafe { self.front.get_with_notice(request, notice) }
        } else {
            // SAFETY: as above.
            unsafe { self.front.get_then_notice(request, notice) }
        }
    }

    fn notices(&self) -> Result<BoxStream<'static, Notice>, RdmaError> {
        self.front.notices()
    }

    fn notice_drops(&self) -> Option<NoticeDrops> {
        self.front.notice_drops()
    }

    fn notice_sender(&self) -> Option<NoticeSender> {
        self.front.notice_sender()
    }

    fn lease(
        &self,
        backend_region_id: u64,
        terms: LeaseTerms,
    ) -> BoxFuture<'_, Result<BackendLease, RdmaError>> {
        self.front.lease(backend_region_id, terms)
    }

    fn release_lease(
        &self,
        peer: PeerId,
        packed_key: Bytes,
    ) -> BoxFuture<'_, Result<(), RdmaError>> {
        self.front.release_lease(peer, packed_key)
    }

    /// Only for a driver with [`Driver::WRITES`]; without, refused before
    /// anything is submitted.
    fn take_written(
        &self,
        backend_region_id: u64,
    ) -> BoxFuture<'_, Result<WrittenRanges, RdmaError>> {
        if !D::WRITES {
            return Box::pin(async { Err(crate::command::unsupported_writes()) });
        }
        self.front.take_written(backend_region_id)
    }
}
