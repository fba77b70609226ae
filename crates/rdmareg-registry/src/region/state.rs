//! The state one registered region shares between its guard, its watches and
//! the registry's table, and the steps that release it.
//!
//! A region is released (its latch resolves) once the backend no longer
//! pins it (fact 1: an unmap returned `Ok(())`, or shutdown ended with
//! nothing registered) and no local reader is inside (fact 2: the reader
//! gate is closed and drained). The unmap does not wait for readers, since
//! it frees nothing; the latch does, since it lets the owner free. The
//! budget charge is returned at fact 1. Finalising runs once, from whichever
//! fact came last.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use rdmareg_core::{Descriptor, PageRange, RdmaError};

use super::owned::OwnedBuffer;
use crate::budget::Reservation;
use crate::gate::Gate;
use crate::latch::Latch;
use crate::registry::Inner;

/// What [`unregister`](crate::RegionGuard::unregister) achieved in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum UnregisterOutcome {
    /// Readers had left and the unmap is confirmed: released.
    Drained,
    /// Readers outstayed the timeout; the unmap is confirmed, and
    /// `deregistered()` resolves when the last reader leaves.
    DrainTimedOut,
    /// The unmap was not confirmed in time (a transfer still uses the
    /// region, contract point 4) and goes on in the background; the region
    /// stays refused to new readers and GETs. The fields name what still
    /// used the region when the timeout passed.
    #[non_exhaustive]
    UnmapPending {
        /// Local readers still inside.
        readers: usize,
        /// Transfers using the region, if the backend can tell
        /// ([`RdmaBackend::transfers_in_flight`](rdmareg_backend::RdmaBackend::transfers_in_flight)).
        transfers: Option<usize>,
    },
}

/// The owner's buffer of an owned region and who may still claim it.
#[derive(Debug)]
struct OwnedSlot {
    buffer: Option<OwnedBuffer>,
    /// A guard or `unregister_owned` will take the buffer: finalising keeps it.
    owner_present: bool,
}

/// Shared state of one registered region.
#[derive(Debug)]
pub(crate) struct RegionState {
    pub(crate) generation: u64,
    pub(crate) backend_region_id: u64,
    ptr: NonNull<u8>,
    len: usize,
    pub(crate) effective: PageRange,
    pub(crate) descriptor: Result<Descriptor, RdmaError>,
    charge: Mutex<Option<Reservation>>,
    /// Leases of local readers.
    pub(crate) readers: Gate,
    unmapped: AtomicBool,
    finalized: AtomicBool,
    pub(crate) latch: Latch,
    owned: Option<Mutex<OwnedSlot>>,
    registry: Weak<Inner>,
    /// Descriptor leases handed out, until they ended.
    pub(crate) leases: super::leases::RegionLeaseList,
}

// SAFETY: the state never dereferences the raw pointer itself; reads
// through it happen only under a reader lease (see `RegionWatch`), and every
// other field is Send + Sync.
unsafe impl Send for RegionState {}
// SAFETY: as for Send: shared access reads the pointer value only.
unsafe impl Sync for RegionState {}

/// Everything the registry knows about a fresh registration.
pub(crate) struct NewRegion {
    pub(crate) generation: u64,
    pub(crate) backend_region_id: u64,
    pub(crate) ptr: NonNull<u8>,
    pub(crate) len: usize,
    pub(crate) effective: PageRange,
    pub(crate) descriptor: Result<Descriptor, RdmaError>,
    pub(crate) charge: Reservation,
    pub(crate) owned: Option<OwnedBuffer>,
}

impl RegionState {
    pub(crate) fn new(region: NewRegion, registry: Weak<Inner>) -> Self {
        Self {
            generation: region.generation,
            backend_region_id: region.backend_region_id,
            ptr: region.ptr,
            len: region.len,
            effective: region.effective,
            descriptor: region.descriptor,
            charge: Mutex::new(Some(region.charge)),
            readers: Gate::new(),
            unmapped: AtomicBool::new(false),
            finalized: AtomicBool::new(false),
            latch: Latch::new(),
            owned: region.owned.map(|buffer| {
                Mutex::new(OwnedSlot {
                    buffer: Some(buffer),
                    owner_present: true,
                })
            }),
            registry,
            leases: super::leases::RegionLeaseList::default(),
        }
    }

    pub(crate) fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn is_owned(&self) -> bool {
        self.owned.is_some()
    }

    pub(crate) fn is_unmapped(&self) -> bool {
        self.unmapped.load(Ordering::SeqCst)
    }

    pub(crate) fn is_finalized(&self) -> bool {
        self.finalized.load(Ordering::SeqCst)
    }

    /// Refuse new readers from now on.
    pub(crate) fn close_readers(&self) {
        self.readers.close();
    }

    /// Fact 1: return the charge, and finalise if no reader is inside.
    /// Returns whether this call marked it (it was not already).
    pub(crate) fn mark_unmapped(self: &Arc<Self>) -> bool {
        self.close_readers();
        if let Some(owned) = &self.owned
            && let Some(buffer) = owned.lock().buffer.as_mut()
        {
            buffer.confirm_unregistered();
        }
        let marked = !self.unmapped.swap(true, Ordering::SeqCst);
        if marked && let Some(inner) = self.registry.upgrade() {
            inner.counters.unregistered();
        }
        drop(self.charge.lock().take());
        self.try_finalize();
        marked
    }

    /// A reader lease of a closed gate was the last one out (fact 2).
    pub(crate) fn last_reader_left(self: &Arc<Self>) {
        self.try_finalize();
    }

    fn try_finalize(self: &Arc<Self>) {
        // Both sides store their fact (SeqCst) first: the second sees both.
        if !self.is_unmapped() || !self.readers.is_drained() {
            return;
        }
        // Every caller that sees both facts takes the region out of the
        // table, not only the one that finalises: a sweep or finish that
        // marks it returns with it gone even while another thread is still
        // finalising it. Removing twice is harmless.
        if let Some(registry) = self.registry.upgrade() {
            registry.tables.lock().regions.remove(&self.generation);
        }
        if self.finalized.swap(true, Ordering::SeqCst) {
            return;
        }
        let unclaimed = self.owned.as_ref().and_then(|owned| {
            let mut slot = owned.lock();
            if slot.owner_present {
                None
            } else {
                slot.buffer.take()
            }
        });
        drop(unclaimed); // not registered any more: this frees it.
        self.latch.release();
    }

    /// Nobody will claim the owned buffer: free it at finalisation.
    pub(crate) fn disown(&self) {
        let Some(owned) = &self.owned else { return };
        let freed = {
            let mut slot = owned.lock();
            slot.owner_present = false;
            if self.is_finalized() {
                slot.buffer.take()
            } else {
                None
            }
        };
        drop(freed);
    }

    /// Take the owned buffer after finalisation (for `unregister_owned`).
    pub(crate) fn take_owned(&self) -> Option<Box<[u8]>> {
        if !self.is_finalized() {
            return None;
        }
        let buffer = self.owned.as_ref()?.lock().buffer.take()?;
        buffer.into_box()
    }
}

/// Ask the backend to unmap the region, unless that is already confirmed.
///
/// # Cancel safety
/// Dropped after the first poll, the unmap proceeds (contract point 2) and a
/// later call confirms it.
pub(crate) async fn unmap_region(inner: &Inner, state: &Arc<RegionState>) -> Result<(), RdmaError> {
    if state.is_unmapped() {
        return Ok(());
    }
    inner.backend.unmap(state.backend_region_id).await?;
    state.mark_unmapped();
    Ok(())
}

/// Close the region to readers, wait for them, then unmap, all within
/// `timeout`. Readers who outstay it do not hold the unmap back (it frees
/// nothing); an unmap that outstays it goes on in the background
/// ([`UnregisterOutcome::UnmapPending`]).
///
/// # Cancel safety
/// As [`unmap_region`].
pub(crate) async fn deregister(
    inner: &Arc<Inner>,
    state: &Arc<RegionState>,
    timeout: Duration,
) -> Result<UnregisterOutcome, RdmaError> {
    let deadline = tokio::time::Instant::now() + timeout;
    state.close_readers();
    let drained = tokio::time::timeout_at(deadline, state.readers.drained())
        .await
        .is_ok();
    // Owned, so an unmap that outstays the deadline is carried on, not
    // dropped; the timeout still polls it once, so an instant unmap counts.
    let mut unmap = Box::pin(unmap_region_owned(Arc::clone(inner), Arc::clone(state)));
    match tokio::time::timeout_at(deadline, &mut unmap).await {
        Ok(result) => result.map(|()| {
            if drained {
                UnregisterOutcome::Drained
            } else {
                UnregisterOutcome::DrainTimedOut
            }
        }),
        Err(_) => {
            let readers = state.readers.in_flight();
            let transfers = inner.backend.transfers_in_flight(state.backend_region_id);
            tracing::warn!(
                generation = state.generation,
                ?timeout,
                readers,
                ?transfers,
                "unmap not confirmed within the timeout; it goes on in the background"
            );
            let generation = state.generation;
            inner.handle.spawn(async move {
                match unmap.await {
                    Ok(()) => tracing::debug!(generation, "late unmap confirmed"),
                    Err(error) => tracing::error!(
                        generation,
                        %error,
                        "late unmap failed: the region stays registered and tracked until the shutdown sweep"
                    ),
                }
            });
            Ok(UnregisterOutcome::UnmapPending { readers, transfers })
        }
    }
}

/// [`unmap_region`] owning what it needs, to be carried on by a task.
async fn unmap_region_owned(inner: Arc<Inner>, state: Arc<RegionState>) -> Result<(), RdmaError> {
    unmap_region(&inner, &state).await
}

/// Deregister on the registry's runtime, unawaited (a dropped guard, a
/// cancelled `unregister`, a registration after the sweep).
pub(crate) fn spawn_background_deregistration(
    inner: Arc<Inner>,
    state: Arc<RegionState>,
    why: &'static str,
) {
    let budget = inner.config.background_deregistration_budget;
    let handle = inner.handle.clone();
    handle.spawn(async move {
        match deregister(&inner, &state, budget).await {
            Ok(outcome) => tracing::debug!(
                generation = state.generation,
                ?outcome,
                why,
                "background deregistration finished"
            ),
            Err(error) => tracing::error!(
                generation = state.generation,
                %error,
                why,
                "background deregistration failed: the region stays registered and tracked until the shutdown sweep"
            ),
        }
    });
}
