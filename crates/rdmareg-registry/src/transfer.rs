//! GETs into pool buffers and PUTs from them.
//!
//! An admitted transfer owns its ticket (shutdown waits), the local
//! buffer's slot (its granules cannot serve another buffer meanwhile) and an
//! in-flight count until the backend completes it. The caller polls the
//! transfer itself, since a spawn costs more than a shared-memory GET; only
//! a dropped caller moves it into a task ([`PendingTransfer`]), surrendering
//! the buffer: a GET's backend may still write it, a PUT's still read it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::BoxFuture;

use rdmareg_backend::{BackendGet, BackendPut};
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

/// Which way a transfer moves bytes, and what it brings along.
pub(crate) enum Direction {
    /// Read the remote range into the buffer; the notice follows a read
    /// that completed.
    Get { notice: Option<Bytes> },
    /// Write the buffer's bytes into the remote range.
    Put,
}

impl Direction {
    fn operation(&self) -> &'static str {
        match self {
            Direction::Get { .. } => "read",
            Direction::Put => "write",
        }
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
    transfer(inner, peer, src, dst, dst_offset, Direction::Get { notice }).await
}

/// [`RdmaRegistry::put_from`](crate::RdmaRegistry::put_from), counted.
pub(crate) async fn put(
    inner: &Arc<Inner>,
    peer: PeerId,
    src: &mut PinnedBuf,
    src_offset: usize,
    dst: &Descriptor,
) -> Result<(), RdmaError> {
    transfer(inner, peer, dst, src, src_offset, Direction::Put).await
}

/// A GET or PUT between `remote` and `local` at `offset`, counted.
async fn transfer(
    inner: &Arc<Inner>,
    peer: PeerId,
    remote: &Descriptor,
    local: &mut PinnedBuf,
    offset: usize,
    direction: Direction,
) -> Result<(), RdmaError> {
    let mut took = None;
    let is_get = matches!(direction, Direction::Get { .. });
    let result = transfer_timed(inner, peer, remote, local, offset, direction, &mut took).await;
    match took {
        Some(took) if is_get => inner.counters.get(remote.len(), took, &result),
        Some(_) => inner.counters.put(remote.len(), &result),
        None => inner.counters.outcome(&result),
    }
    result
}

/// The transfer; sets `took` to the time from admission to the result.
async fn transfer_timed(
    inner: &Arc<Inner>,
    peer: PeerId,
    remote: &Descriptor,
    local: &mut PinnedBuf,
    offset: usize,
    direction: Direction,
    took: &mut Option<Duration>,
) -> Result<(), RdmaError> {
    if let Direction::Get {
        notice: Some(notice),
    } = &direction
        && notice.len() > MAX_NOTICE_BYTES
    {
        return Err(RdmaError::NoticeTooLarge {
            length: notice.len() as u64,
        });
    }
    if remote.backend_key() != inner.backend_key {
        return Err(RdmaError::InvalidDescriptor(
            DescriptorError::InvalidBackendKey,
        ));
    }
    // The owner enforces access; a descriptor that says it grants less
    // saves the round trip.
    let granted = match direction {
        Direction::Get { .. } => remote.access().allows_read(),
        Direction::Put => remote.access().allows_write(),
    };
    if !granted {
        return Err(RdmaError::AccessDenied {
            operation: direction.operation(),
        });
    }
    let slot = local.slot().ok_or(RdmaError::BufferSurrendered)?;
    if !local.belongs_to(inner) {
        return Err(RdmaError::ForeignBuffer);
    }
    let end = (offset as u64)
        .checked_add(remote.len())
        .ok_or(RdmaError::OutOfRange)?;
    if end > local.len() as u64 {
        let (needed, available) = (end, local.len() as u64);
        return Err(match direction {
            Direction::Get { .. } => RdmaError::DestinationTooSmall { needed, available },
            Direction::Put => RdmaError::SourceTooSmall { needed, available },
        });
    }
    let (local_region_id, local_offset) = (slot.arena.backend_region_id, slot.offset());
    let ticket = inner.gate.enter().ok_or(RdmaError::ShuttingDown)?;
    let admitted = Instant::now();
    let in_flight = InFlight::new(inner);
    let alone = inner.transfers_in_flight.load(Ordering::SeqCst) == 1;
    let busy_poll = (alone && !inner.config.get_busy_poll.is_zero())
        .then(|| busy_poll_window(inner.config.get_busy_poll, remote.len()));
    let Some(slot) = local.take_slot() else {
        return Err(RdmaError::RegionNotFound);
    };
    let backend = Arc::clone(&inner.backend);
    let (remote_addr, packed_key, len) = (remote.addr(), remote.packed_key().clone(), remote.len());
    let (local_offset, deadline) = (
        local_offset + offset as u64,
        Some(inner.config.get_deadline),
    );
    // Owning the backend handle makes the future `'static`, for a task.
    let transfer: BoxFuture<'static, Result<(), RdmaError>> = match direction {
        Direction::Get { notice } => {
            let request = BackendGet {
                peer,
                remote_addr,
                packed_key,
                local_region_id,
                local_offset,
                len,
                deadline,
            };
            match notice {
                // SAFETY: the destination is the slot's bytes in a pool
                // arena the registry mapped; the slot was taken out of
                // `local`, so no `PinnedBuf` reaches them until `pending`
                // hands it back after the GET completed (contract points 4
                // and 8).
                None => Box::pin(async move { unsafe { backend.get(request) }.await }),
                Some(notice) => Box::pin(async move {
                    // SAFETY: as above; the notice adds no memory.
                    unsafe { backend.get_with_notice(request, notice) }.await
                }),
            }
        }
        Direction::Put => {
            let request = BackendPut {
                peer,
                remote_addr,
                packed_key,
                local_region_id,
                local_offset,
                len,
                deadline,
            };
            // SAFETY: the source is the slot's bytes in a pool arena the
            // registry mapped; the slot was taken out of `local`, so no
            // `PinnedBuf` writes them until `pending` hands it back after
            // the PUT completed, which is after the backend let go of them
            // (contract point 12).
            Box::pin(async move { unsafe { backend.put(request) }.await })
        }
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
            local.restore(slot);
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
            "transfer cancelled while in flight: its buffer is surrendered; its memory returns to the pool when the transfer finishes"
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

/// The local slots of a transfer in flight: dropped before the transfer
/// completed, they leak, since the backend may still write (GET) or read
/// (PUT) them.
pub(crate) struct HeldSlots(pub(crate) Vec<Slot>);

impl Drop for HeldSlots {
    fn drop(&mut self) {
        for slot in self.0.drain(..) {
            tracing::error!(
                "transfer task dropped before the backend completed it: its buffer's slot is leaked, not reused"
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
