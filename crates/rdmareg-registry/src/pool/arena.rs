//! One registered arena: its page memory, its registration, and (for a pooled
//! arena) the granule allocator carving it up.
//!
//! An arena is shared (`Arc`) by the registry's table, the pool and its
//! buffers; [`PageMemory`] frees its pages only after a confirmed unmap.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use rdmareg_core::RdmaError;

use super::allocator::GranuleAllocator;
use super::memory::PageMemory;
use crate::budget::Reservation;
use crate::gate::Ticket;
use crate::registry::Inner;

/// Allocation state of a pooled arena.
#[derive(Debug)]
pub(crate) struct PooledSlots {
    pub(crate) allocator: GranuleAllocator,
    /// Buffers currently carved from this arena.
    pub(crate) live: usize,
    /// Taken out of service by reclaim: no new allocations.
    pub(crate) retired: bool,
}

/// A registered arena.
#[derive(Debug)]
pub(crate) struct Arena {
    pub(crate) generation: u64,
    pub(crate) backend_region_id: u64,
    pub(crate) memory: PageMemory,
    charge: Mutex<Option<Reservation>>,
    /// `Some` for a pooled arena, `None` for a dedicated one.
    pub(crate) slots: Option<Mutex<PooledSlots>>,
    /// A dedicated arena's buffer is alive.
    pub(crate) dedicated_in_use: AtomicBool,
    /// Copied from the configuration, so a free need not reach the registry.
    pub(crate) reclaim_when_empty: bool,
    unmapped: AtomicBool,
    pub(crate) registry: Weak<Inner>,
}

/// Everything known about a freshly mapped arena.
pub(crate) struct NewArena {
    pub(crate) generation: u64,
    pub(crate) backend_region_id: u64,
    pub(crate) memory: PageMemory,
    pub(crate) charge: Reservation,
    pub(crate) pooled: bool,
    pub(crate) reclaim_when_empty: bool,
}

impl Arena {
    pub(crate) fn new(arena: NewArena, registry: Weak<Inner>) -> Self {
        let granules = (arena.memory.len() as u64 / crate::GRANULE) as u32;
        Self {
            generation: arena.generation,
            backend_region_id: arena.backend_region_id,
            memory: arena.memory,
            charge: Mutex::new(Some(arena.charge)),
            slots: arena.pooled.then(|| {
                Mutex::new(PooledSlots {
                    allocator: GranuleAllocator::new(granules),
                    live: 0,
                    retired: false,
                })
            }),
            dedicated_in_use: AtomicBool::new(!arena.pooled),
            reclaim_when_empty: arena.reclaim_when_empty,
            unmapped: AtomicBool::new(false),
            registry,
        }
    }

    pub(crate) fn is_pooled(&self) -> bool {
        self.slots.is_some()
    }

    pub(crate) fn len(&self) -> u64 {
        self.memory.len() as u64
    }

    pub(crate) fn is_unmapped(&self) -> bool {
        self.unmapped.load(Ordering::SeqCst)
    }

    /// Bytes carved into live buffers: the granules the allocator has
    /// handed out, or the whole arena for a dedicated one in use.
    pub(crate) fn bytes_in_use(&self) -> u64 {
        match &self.slots {
            Some(slots) => {
                let free = u64::from(slots.lock().allocator.free_granules()) * crate::GRANULE;
                self.len().saturating_sub(free)
            }
            None if self.dedicated_in_use.load(Ordering::SeqCst) => self.len(),
            None => 0,
        }
    }

    /// Buffers currently carved from this arena.
    pub(crate) fn live_allocations(&self) -> usize {
        match &self.slots {
            Some(slots) => slots.lock().live,
            None => usize::from(self.dedicated_in_use.load(Ordering::SeqCst)),
        }
    }

    /// The backend no longer pins the arena: return the charge and let the
    /// last holder free the pages.
    /// Returns whether this call marked it (it was not already).
    pub(crate) fn mark_unmapped(&self) -> bool {
        self.memory.confirm_unregistered();
        let marked = !self.unmapped.swap(true, Ordering::SeqCst);
        if marked && let Some(inner) = self.registry.upgrade() {
            inner.counters.unregistered();
        }
        drop(self.charge.lock().take());
        marked
    }
}

/// Unmap an arena unless already confirmed; on success drop it from the
/// registry's table.
///
/// # Cancel safety
/// Dropping it abandons only the result; a later call (the sweep) confirms.
pub(crate) async fn unmap_arena(inner: &Inner, arena: &Arc<Arena>) -> Result<(), RdmaError> {
    if !arena.is_unmapped() {
        inner.backend.unmap(arena.backend_region_id).await?;
        arena.mark_unmapped();
    }
    inner.tables.lock().arenas.remove(&arena.generation);
    Ok(())
}

/// Unmap an arena on the registry's runtime, holding `ticket` (if any) so
/// shutdown waits for it.
pub(crate) fn spawn_arena_release(
    inner: Arc<Inner>,
    arena: Arc<Arena>,
    ticket: Option<Ticket>,
    why: &'static str,
) {
    let budget: Duration = inner.config.background_deregistration_budget;
    let handle = inner.handle.clone();
    handle.spawn(async move {
        let _ticket = ticket;
        match tokio::time::timeout(budget, unmap_arena(&inner, &arena)).await {
            Ok(Ok(())) => tracing::debug!(generation = arena.generation, why, "arena unmapped"),
            Ok(Err(error)) => tracing::error!(
                generation = arena.generation,
                %error,
                why,
                "arena unmap failed: it stays tracked for the shutdown sweep; its pages are leaked unless a later unmap is confirmed"
            ),
            Err(_) => tracing::error!(
                generation = arena.generation,
                why,
                "arena unmap did not complete within the background-deregistration budget"
            ),
        }
    });
}
