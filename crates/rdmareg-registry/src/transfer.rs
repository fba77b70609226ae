//! GETs into pool buffers.
//!
//! An admitted transfer owns its ticket (shutdown waits), the destination's
//! slot (its granules cannot serve another buffer meanwhile) and an
//! in-flight count until the GET completes. The caller polls the GET itself,
//! since a spawn costs more than a shared-memory GET; only a dropped caller
//! moves it into a task ([`PendingTransfer`]), surrendering the buffer.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::BoxFuture;

use rdmareg_backend::BackendGet;
use rdmareg_core::{Descriptor, DescriptorError, MAX_NOTICE_BYTES, PeerId, RdmaError};

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

/// [`RdmaRegistry::get_into`](crate::RdmaRegistry::get_into), counted.
pub(crate) async fn get(
    inner: &Arc<Inner>,
    peer: PeerId,
    src: &Descriptor,
    dst: &mut PinnedBuf,
    dst_offset: usize,
    notice: Option<Bytes>,
) -> Result<(), RdmaError> {
    let mut took = None;
    let result = get_timed(inner, peer, src, dst, dst_offset, notice, &mut took).await;
    match took {
        Some(took) => inner.counters.get(src.len(), took, &result),
        None => inner.counters.outcome(&result),
    }
    result
}

/// The GET; sets `took` to the time from admission to the result.
async fn get_timed(
    inner: &Arc<Inner>,
    peer: PeerId,
    src: &Descriptor,
    dst: &mut PinnedBuf,
    dst_offset: usize,
    notice: Option<Bytes>,
    took: &mut Option<Duration>,
) -> Result<(), RdmaError> {
    if let Some(notice) = &notice
        && notice.len() > MAX_NOTICE_BYTES
    {
        return Err(RdmaError::NoticeTooLarge {
            length: notice.len() as u64,
        });
    }
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
    // Owning the backend handle makes the future `'static`, for a task.
    let transfer: BoxFuture<'static, Result<(), RdmaError>> = match notice {
        // SAFETY: the destination is the slot's bytes in a pool arena the
        // registry mapped; the slot was taken out of `dst`, so no
        // `PinnedBuf` reaches them until `pending` hands it back after the
        // GET completed (contract points 4 and 8).
        None => Box::pin(async move { unsafe { backend.get(request) }.await }),
        Some(notice) => Box::pin(async move {
            // SAFETY: as above; the notice adds no memory.
            unsafe { backend.get_with_notice(request, notice) }.await
        }),
    };
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

/// Assumed rate of a busy-polled GET (5 GB/s, below local tcp), so a lone
/// read of up to about 1 MiB completes within its window on any local lane.
const BUSY_POLL_BYTES_PER_MICROSECOND: u64 = 5_000;
/// Longest window: past it a wake-up costs under a tenth of the transfer.
const BUSY_POLL_CAP: Duration = Duration::from_micros(200);

/// A lone GET's busy-poll window: the base plus the expected duration,
/// capped.
pub(crate) fn busy_poll_window(base: Duration, len: u64) -> Duration {
    let expected = Duration::from_micros(len / BUSY_POLL_BYTES_PER_MICROSECOND);
    (base + expected).min(BUSY_POLL_CAP.max(base))
}

/// A GET (or batch) in flight and everything it holds; dropped unfinished,
/// it detaches onto the runtime until the backend is done with the memory.
pub(crate) struct PendingTransfer<T: Send + 'static> {
    pub(crate) transfer: Option<BoxFuture<'static, T>>,
    pub(crate) slots: HeldSlots,
    pub(crate) ticket: Option<Ticket>,
    pub(crate) in_flight: Option<InFlight>,
    pub(crate) handle: tokio::runtime::Handle,
    /// The first poll's spin window (`get_busy_poll`), taken by that poll.
    pub(crate) busy_poll: Option<Duration>,
}

impl<T: Send + 'static> PendingTransfer<T> {
    /// After the GET completed: release ticket and count, return the slots.
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
                // Yield: the completing thread may share this CPU.
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
        // A task dropped unpolled leaks `slots` rather than reuse them.
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
/// The destination slots of a transfer in flight: dropped before the GET
/// completed, they leak, since the backend may still write them.
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
