//! The state one registered region shares between its guard, its watches and
//! the registry's table, and the steps that release it.
//!
//! # When is a region released?
//!
//! Two facts must both hold before the release latch resolves:
//!
//! 1. **the backend no longer pins it** — an `unmap` returned `Ok(())`, or
//!    shutdown ended with the backend reporting nothing registered; and
//! 2. **no local reader is inside it** — every lease taken by
//!    [`RegionWatch::read`](crate::RegionWatch::read) has been given back, and
//!    the reader gate is closed so no new one can start.
//!
//! The unmap itself does not wait for readers: deregistering never frees
//! memory, so a reader still copying out of a just-unmapped range reads
//! allocated bytes. What waits is the latch, because the latch is what lets
//! the owner free the memory (or what frees an owned buffer). The budget
//! charge, on the other hand, is returned at the moment of (1): it counts
//! pinned bytes, and those are no longer pinned.
//!
//! Finalising (latch, table removal, freeing an owned buffer nobody will
//! claim) happens exactly once, from whichever of the two facts became true
//! last.

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

/// What [`unregister`](crate::RegionGuard::unregister) achieved within its
/// timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum UnregisterOutcome {
    /// Every reader had left before the unmap, and the backend confirmed the
    /// unmap: the region is fully released (`deregistered()` has resolved).
    Drained,
    /// Readers were still inside when the timeout passed; the region was
    /// unmapped anyway (confirmed). `deregistered()` resolves when the last
    /// of them leaves.
    DrainTimedOut,
    /// The timeout passed before the backend confirmed the unmap — it waits
    /// for transfers still using the region (contract point 4). The unmap was
    /// submitted and proceeds in the background; `deregistered()` resolves
    /// once it is confirmed and the readers have left. The region stays
    /// refused to new readers and new GETs.
    UnmapPending(StillRunning),
}

/// What was still using a region when
/// [`unregister`](crate::RegionGuard::unregister)'s timeout passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct StillRunning {
    /// Local readers ([`RegionWatch::read`](crate::RegionWatch::read)) still
    /// inside.
    pub readers: usize,
    /// Transfers into or from the region the backend could see still running
    /// ([`RdmaBackend::transfers_in_flight`](rdmareg_backend::RdmaBackend::transfers_in_flight));
    /// `None` if the backend cannot tell.
    pub transfers: Option<usize>,
}

/// The owner's buffer of an owned region and who may still claim it.
#[derive(Debug)]
struct OwnedSlot {
    buffer: Option<OwnedBuffer>,
    /// A guard (or an `unregister_owned` in progress) will take the buffer;
    /// until it says otherwise, finalising keeps it.
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
}

// SAFETY: the raw pointer is an address the state never dereferences itself;
// reads through it happen only under a reader lease (see `RegionWatch`), and
// every other field is Send + Sync.
unsafe impl Send for RegionState {}
// SAFETY: as for Send: shared access reads the pointer value, never the bytes
// without a lease.
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

    /// The backend no longer pins the region (fact 1). Returns the budget
    /// charge and finalises if no reader is inside.
    pub(crate) fn mark_unmapped(self: &Arc<Self>) {
        self.close_readers();
        if let Some(owned) = &self.owned
            && let Some(buffer) = owned.lock().buffer.as_mut()
        {
            buffer.confirm_unregistered();
        }
        if !self.unmapped.swap(true, Ordering::SeqCst)
            && let Some(inner) = self.registry.upgrade()
        {
            inner.counters.unregistered();
        }
        drop(self.charge.lock().take());
        self.try_finalize();
    }

    /// A reader lease of a closed gate was the last one out (fact 2).
    pub(crate) fn last_reader_left(self: &Arc<Self>) {
        self.try_finalize();
    }

    fn try_finalize(self: &Arc<Self>) {
        // Both sides store their fact before calling this (SeqCst), so
        // whichever comes second sees both.
        if !self.is_unmapped() || !self.readers.is_drained() {
            return;
        }
        if self.finalized.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Some(registry) = self.registry.upgrade() {
            registry.tables.lock().regions.remove(&self.generation);
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

    /// Nobody will claim the owned buffer: free it at (or, if already past,
    /// since) finalisation.
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
/// Dropping it after the first poll abandons only the result: the backend
/// proceeds with the unmap (contract point 2) and a later call — the
/// background deregistration, or the shutdown sweep — will confirm it.
pub(crate) async fn unmap_region(inner: &Inner, state: &Arc<RegionState>) -> Result<(), RdmaError> {
    if state.is_unmapped() {
        return Ok(());
    }
    inner.backend.unmap(state.backend_region_id).await?;
    state.mark_unmapped();
    Ok(())
}

/// Close the region to readers, wait for them to leave, then unmap.
///
/// The whole of it is bounded by `timeout`. Readers who outstay the timeout
/// do not hold the unmap back (it frees nothing); an unmap that outstays it
/// (the backend waits for a transfer using the region) goes on in the
/// background and the call returns [`UnregisterOutcome::UnmapPending`], with
/// what was still running.
///
/// # Cancel safety
/// As [`unmap_region`]: readers stay refused, and an unmap once submitted
/// proceeds.
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
    // Owned, so that an unmap that outstays the deadline can be carried on
    // rather than dropped (which would lose its confirmation). A timeout
    // polls its future once even when the deadline has passed, so an unmap
    // that completes at once still counts.
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
            let still = StillRunning {
                readers: state.readers.in_flight(),
                transfers: inner.backend.transfers_in_flight(state.backend_region_id),
            };
            tracing::warn!(
                generation = state.generation,
                ?timeout,
                ?still,
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
            Ok(UnregisterOutcome::UnmapPending(still))
        }
    }
}

/// [`unmap_region`] owning what it needs, to be carried on by a task.
async fn unmap_region_owned(inner: Arc<Inner>, state: Arc<RegionState>) -> Result<(), RdmaError> {
    unmap_region(&inner, &state).await
}

/// Deregister on the registry's runtime, without anyone awaiting it; used
/// when a guard is dropped, an `unregister` is cancelled, or a registration
/// arrives after the shutdown sweep.
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
