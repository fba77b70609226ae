//! GETs into pool buffers.
//!
//! A transfer is admitted through the gate and then runs as its own task on
//! the registry's runtime, owning three things until the backend answers:
//! the admission ticket (so shutdown waits for it), the destination's pool
//! slot (so its granules cannot be handed to another buffer while the
//! backend may still write them), and an in-flight count. The caller's
//! future only waits for that task. If the caller goes away first, the task
//! finishes on its own and the slot returns to the pool then; the caller's
//! buffer stays *surrendered* (empty), since its memory left with the
//! transfer.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use rdmareg_backend::BackendGet;
use rdmareg_core::{Descriptor, DescriptorError, PeerId, RdmaError};

use crate::pool::PinnedBuf;
use crate::registry::Inner;

/// Counts a transfer in flight for as long as it lives.
struct InFlight(Arc<Inner>);

impl InFlight {
    fn new(inner: &Arc<Inner>) -> Self {
        inner.transfers_in_flight.fetch_add(1, Ordering::SeqCst);
        Self(Arc::clone(inner))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.transfers_in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// See [`RdmaRegistry::get_into`](crate::RdmaRegistry::get_into).
pub(crate) async fn get(
    inner: &Arc<Inner>,
    peer: PeerId,
    src: &Descriptor,
    dst: &mut PinnedBuf,
    dst_offset: usize,
) -> Result<(), RdmaError> {
    if src.backend_key() != inner.backend_key {
        return Err(RdmaError::InvalidDescriptor(
            DescriptorError::InvalidBackendKey,
        ));
    }
    let slot = dst.slot().ok_or(RdmaError::RegionNotFound)?;
    let end = (dst_offset as u64)
        .checked_add(src.len())
        .ok_or(RdmaError::OutOfRange)?;
    if end > dst.len() as u64 {
        return Err(RdmaError::OutOfRange);
    }
    let request = BackendGet {
        peer,
        remote_addr: src.addr(),
        packed_key: src.packed_key().clone(),
        local_region_id: slot.arena.backend_region_id,
        local_offset: slot.offset() + dst_offset as u64,
        len: src.len(),
        deadline: inner.config.get_deadline,
    };
    let ticket = inner.gate.enter().ok_or(RdmaError::ShuttingDown)?;
    let in_flight = InFlight::new(inner);
    let Some(slot) = dst.take_slot() else {
        return Err(RdmaError::RegionNotFound);
    };
    let backend = Arc::clone(&inner.backend);
    let task = inner.handle.spawn(async move {
        let mut held = HeldSlot(Some(slot));
        let result = backend.get(request).await;
        drop(in_flight);
        drop(ticket);
        (result, held.0.take())
    });
    let mut note = CancelNote { armed: true };
    let joined = task.await;
    note.armed = false;
    match joined {
        Ok((result, Some(slot))) => {
            dst.restore(slot);
            result
        }
        Ok((_, None)) => Err(RdmaError::RegionNotFound),
        Err(join_error) => Err(RdmaError::Backend(format!(
            "transfer task did not complete: {join_error}"
        ))),
    }
}

/// The destination slot inside a transfer task. If the task is dropped
/// before the backend answered (its runtime is shutting down), the backend
/// may still write the slot's memory, so the slot is leaked — never returned
/// to the pool.
struct HeldSlot(Option<crate::pool::pinned_buf::Slot>);

impl Drop for HeldSlot {
    fn drop(&mut self) {
        if let Some(slot) = self.0.take() {
            tracing::error!(
                "transfer task dropped before the backend answered: its destination slot is leaked, not reused"
            );
            std::mem::forget(slot);
        }
    }
}

/// Notes a caller that stopped waiting for its transfer: the destination
/// stays surrendered, the slot is the task's.
struct CancelNote {
    armed: bool,
}

impl Drop for CancelNote {
    fn drop(&mut self) {
        if self.armed {
            tracing::debug!(
                "GET cancelled while in flight: the destination buffer is surrendered; its memory returns to the pool when the transfer finishes"
            );
        }
    }
}
