//! GETs into pool buffers.
//!
//! A transfer is admitted through the gate and then owns three things until the
//! backend's GET completes: the admission ticket (so shutdown waits for it),
//! the destination's pool slot (so its granules cannot be handed to another
//! buffer while the backend may still write them), and an in-flight count.
//!
//! The caller's future polls the backend's GET directly: no task is spawned
//! on the fast path, because a spawn and a join-handle wake-up cost more
//! than a shared-memory GET. Only if the caller's future is dropped while
//! the GET is in flight does [`PendingTransfer`] move the GET, with
//! everything it owns, into a task on the registry's runtime that finishes
//! it; the slot returns to the pool then. The caller's buffer stays
//! *surrendered* (empty), since its memory left with the transfer.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;

use rdmareg_backend::BackendGet;
use rdmareg_core::{Descriptor, DescriptorError, PeerId, RdmaError};

use crate::gate::Ticket;
use crate::pool::PinnedBuf;
use crate::pool::pinned_buf::Slot;
use crate::registry::Inner;

/// Counts a transfer in flight for as long as it lives.
pub(crate) struct InFlight(Arc<Inner>);

impl InFlight {
    pub(crate) fn new(inner: &Arc<Inner>) -> Self {
        inner.transfers_in_flight.fetch_add(1, Ordering::SeqCst);
        Self(Arc::clone(inner))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.transfers_in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// See [`RdmaRegistry::get_into`](crate::RdmaRegistry::get_into); counts
/// the outcome.
pub(crate) async fn get(
    inner: &Arc<Inner>,
    peer: PeerId,
    src: &Descriptor,
    dst: &mut PinnedBuf,
    dst_offset: usize,
) -> Result<(), RdmaError> {
    let mut took = None;
    let result = get_timed(inner, peer, src, dst, dst_offset, &mut took).await;
    match took {
        Some(took) => inner.counters.get(src.len(), took, &result),
        None => inner.counters.outcome(&result),
    }
    result
}

/// The GET; sets `took` to the time from admission to the backend's result
/// once it has one.
async fn get_timed(
    inner: &Arc<Inner>,
    peer: PeerId,
    src: &Descriptor,
    dst: &mut PinnedBuf,
    dst_offset: usize,
    took: &mut Option<Duration>,
) -> Result<(), RdmaError> {
    if src.backend_key() != inner.backend_key {
        return Err(RdmaError::InvalidDescriptor(
            DescriptorError::InvalidBackendKey,
        ));
    }
    let slot = dst.slot().ok_or(RdmaError::BufferSurrendered)?;
    if !dst.belongs_to(inner) {
        return Err(RdmaError::ForeignBuffer);
    }
    let end = (dst_offset as u64)
        .checked_add(src.len())
        .ok_or(RdmaError::OutOfRange)?;
    if end > dst.len() as u64 {
        return Err(RdmaError::DestinationTooSmall {
            needed: end,
            available: dst.len() as u64,
        });
    }
    let request = BackendGet {
        peer,
        remote_addr: src.addr(),
        packed_key: src.packed_key().clone(),
        local_region_id: slot.arena.backend_region_id,
        local_offset: slot.offset() + dst_offset as u64,
        len: src.len(),
        deadline: Some(inner.config.get_deadline),
    };
    let ticket = inner.gate.enter().ok_or(RdmaError::ShuttingDown)?;
    let admitted = Instant::now();
    let in_flight = InFlight::new(inner);
    let alone = inner.transfers_in_flight.load(Ordering::SeqCst) == 1;
    let busy_poll = (alone && !inner.config.get_busy_poll.is_zero())
        .then(|| busy_poll_window(inner.config.get_busy_poll, src.len()));
    let Some(slot) = dst.take_slot() else {
        return Err(RdmaError::RegionNotFound);
    };
    let backend = Arc::clone(&inner.backend);
    // Owning the backend handle inside the future makes it `'static`, so a
    // cancelled caller can hand it to a task.
    let transfer: BoxFuture<'static, Result<(), RdmaError>> =
        // SAFETY: the destination is the slot's bytes in a pool arena the
        // registry mapped; the slot was taken out of `dst` above, so no
        // `PinnedBuf` reaches those bytes until `pending` hands it back,
        // which it does only once the backend's GET completed (or, for a
        // dropped call, once the transfer ended, contract point 4).
        Box::pin(async move { unsafe { backend.get(request) }.await });
    let mut pending = PendingTransfer {
        transfer: Some(transfer),
        slots: HeldSlots(vec![slot]),
        ticket: Some(ticket),
        in_flight: Some(in_flight),
        handle: inner.handle.clone(),
        busy_poll,
    };
    let result = (&mut pending).await;
    *took = Some(admitted.elapsed());
    match pending.finish().pop() {
        Some(slot) => {
            dst.restore(slot);
            result.unwrap_or(Err(RdmaError::RegionNotFound))
        }
        None => Err(RdmaError::RegionNotFound),
    }
}

/// Bytes per microsecond a busy-polled GET is assumed to move (5 GB/s,
/// below what tcp moves between processes of one host): the poll window
/// grows by the transfer's expected duration, so a lone GET or list of up
/// to about 1 MiB completes without a wake-up on any local lane. A faster
/// rate would let a tcp read outlast its window and sleep.
const BUSY_POLL_BYTES_PER_MICROSECOND: u64 = 5_000;
/// Longest busy-poll window, whatever the size: past it a wake-up costs
/// under a tenth of the transfer.
const BUSY_POLL_CAP: Duration = Duration::from_micros(200);

/// The busy-poll window of a lone GET of `len` bytes: the configured base
/// plus the transfer's expected duration, capped.
pub(crate) fn busy_poll_window(base: Duration, len: u64) -> Duration {
    let expected = Duration::from_micros(len / BUSY_POLL_BYTES_PER_MICROSECOND);
    (base + expected).min(BUSY_POLL_CAP.max(base))
}

/// A GET (or a batch of them) in flight and everything it holds.
///
/// Polled by the caller; if it is dropped before the backend's GET completed,
/// its `Drop` detaches the transfer onto the runtime so the slots, ticket and
/// count are released only when the backend is done with the memory.
pub(crate) struct PendingTransfer<T: Send + 'static> {
    pub(crate) transfer: Option<BoxFuture<'static, T>>,
    pub(crate) slots: HeldSlots,
    pub(crate) ticket: Option<Ticket>,
    pub(crate) in_flight: Option<InFlight>,
    pub(crate) handle: tokio::runtime::Handle,
    /// Poll this long on the first poll (see `RdmaConfig::get_busy_poll`);
    /// taken by that poll so later polls never spin.
    pub(crate) busy_poll: Option<Duration>,
}

impl<T: Send + 'static> PendingTransfer<T> {
    /// After the backend's GET completed: release the ticket and count, hand
    /// back the slots.
    pub(crate) fn finish(&mut self) -> Vec<Slot> {
        self.in_flight.take();
        self.ticket.take();
        std::mem::take(&mut self.slots.0)
    }
}

impl<T: Send + 'static> Future for PendingTransfer<T> {
    /// `None` only if polled again after it completed.
    type Output = Option<T>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let busy_poll = self.busy_poll.take();
        let Some(transfer) = self.transfer.as_mut() else {
            return Poll::Ready(None);
        };
        let mut polled = transfer.as_mut().poll(cx);
        if let (Poll::Pending, Some(window)) = (&polled, busy_poll) {
            let started = Instant::now();
            while polled.is_pending() && started.elapsed() < window {
                // Yield rather than spin: the thread that completes the GET
                // may share this CPU.
                std::thread::yield_now();
                polled = transfer.as_mut().poll(cx);
            }
        }
        let Poll::Ready(result) = polled else {
            return Poll::Pending;
        };
        self.transfer = None;
        Poll::Ready(Some(result))
    }
}

impl<T: Send + 'static> Drop for PendingTransfer<T> {
    fn drop(&mut self) {
        let Some(transfer) = self.transfer.take() else {
            return;
        };
        tracing::debug!(
            "GET cancelled while in flight: the destination buffer is surrendered; its memory returns to the pool when the transfer finishes"
        );
        let mut slots = HeldSlots(std::mem::take(&mut self.slots.0));
        let ticket = self.ticket.take();
        let in_flight = self.in_flight.take();
        // If the runtime is gone the task is dropped unpolled, and `slots`'
        // drop leaks the memory rather than reusing it.
        self.handle.spawn(async move {
            let _ = transfer.await;
            drop(in_flight);
            drop(ticket);
            drop(std::mem::take(&mut slots.0));
        });
    }
}

/// The destination slots of a transfer in flight.
///
/// If they are dropped before the backend's GET completed (a detached transfer
/// whose runtime is shutting down), the backend may still write their memory,
/// so they are leaked — never returned to the pool.
pub(crate) struct HeldSlots(pub(crate) Vec<Slot>);

impl Drop for HeldSlots {
    fn drop(&mut self) {
        for slot in self.0.drain(..) {
            tracing::error!(
                "transfer task dropped before the backend's GET completed: its destination slot is leaked, not reused"
            );
            std::mem::forget(slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_poll_grows_with_size_and_is_capped() {
        let base = Duration::from_micros(20);
        assert_eq!(busy_poll_window(base, 8), base);
        assert_eq!(
            busy_poll_window(base, 512 << 10),
            base + Duration::from_micros((512 << 10) / BUSY_POLL_BYTES_PER_MICROSECOND)
        );
        // A lone 1 MiB read (about 160 µs over local tcp) polls to the cap
        // rather than sleeping just before it completes.
        assert_eq!(busy_poll_window(base, 1 << 20), BUSY_POLL_CAP);
        assert_eq!(busy_poll_window(base, 1 << 30), BUSY_POLL_CAP);
        let large_base = Duration::from_millis(1);
        assert_eq!(busy_poll_window(large_base, 1 << 30), large_base);
    }
}
