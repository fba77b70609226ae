//! The pinned pool: a few large registered arenas suballocated in 4 KiB
//! granules, so registration is paid per arena, not per buffer.
//!
//! Pooled arenas double in size up to a maximum and are mapped only when
//! none has room (concurrent growers queue, so a burst maps one); large
//! requests get a dedicated arena; empty arenas may be reclaimed down to a
//! floor (see [`PoolConfig`](crate::PoolConfig)). Pages are freed only
//! after a confirmed unmap (`memory.rs`).

mod allocator;
pub(crate) mod arena;
mod described;
pub(crate) mod memory;
pub(crate) mod pinned_buf;

use std::sync::Arc;

use parking_lot::RwLock;
use rdmareg_core::{Access, PageRange, RdmaError, round_up};

use crate::GRANULE;
use crate::registry::Inner;
use arena::{Arena, NewArena, spawn_arena_release};
use memory::PageMemory;

use crate::mapping::MapInFlight;
pub use described::{DescribeError, DescribedBuf, WithdrawError};
pub use pinned_buf::PinnedBuf;
use pinned_buf::Slot;

/// The pool's arenas and its growth state.
#[derive(Debug)]
pub(crate) struct Pool {
    /// Pooled arenas in service, oldest (smallest) first.
    pub(crate) pooled: RwLock<Vec<Arc<Arena>>>,
    /// Held while mapping a new pooled arena; holds the next arena's size.
    growth: tokio::sync::Mutex<u64>,
}

impl Pool {
    pub(crate) fn new(first_arena_bytes: u64) -> Self {
        Self {
            pooled: RwLock::new(Vec::new()),
            growth: tokio::sync::Mutex::new(first_arena_bytes),
        }
    }

    /// Carve `granules` granules from an arena in service, if one has room.
    fn carve(&self, granules: u32, len: usize) -> Option<PinnedBuf> {
        let pooled = self.pooled.read();
        pooled
            .iter()
            .find_map(|arena| carve_from(arena, granules, len))
    }
}

fn carve_from(arena: &Arc<Arena>, granules: u32, len: usize) -> Option<PinnedBuf> {
    let slots = arena.slots.as_ref()?;
    let start = {
        let mut slots = slots.lock();
        if slots.retired {
            return None;
        }
        let start = slots.allocator.allocate(granules)?;
        slots.live += 1;
        start
    };
    Some(PinnedBuf::new(
        Slot {
            arena: Arc::clone(arena),
            start,
            granules,
            own: None,
        },
        len,
    ))
}

/// Granules covering `len` bytes, if that fits the allocator's index.
fn granules_for(len: usize) -> Option<u32> {
    let bytes = round_up(len as u64, GRANULE)?;
    u32::try_from(bytes / GRANULE).ok()
}

/// See [`RdmaRegistry::alloc_pinned`](crate::RdmaRegistry::alloc_pinned).
pub(crate) async fn alloc_pinned(inner: &Arc<Inner>, len: usize) -> Result<PinnedBuf, RdmaError> {
    if len == 0 {
        return Err(RdmaError::OutOfRange);
    }
    let _ticket = inner.gate.enter_local().ok_or(RdmaError::ShuttingDown)?;
    let pool_config = &inner.config.pool;
    if len as u64 >= pool_config.dedicated_threshold_bytes {
        let bytes = round_up(len as u64, inner.config.page_size).ok_or(RdmaError::OutOfRange)?;
        let arena = map_arena(inner, bytes, false).await?;
        return Ok(PinnedBuf::new(
            Slot {
                arena,
                start: 0,
                granules: 0,
                own: None,
            },
            len,
        ));
    }
    let granules = granules_for(len).ok_or(RdmaError::OutOfRange)?;
    if let Some(buf) = inner.pool.carve(granules, len) {
        return Ok(buf);
    }
    let mut next_size = inner.pool.growth.lock().await;
    // Someone may have grown the pool while we queued.
    if let Some(buf) = inner.pool.carve(granules, len) {
        return Ok(buf);
    }
    let needed = u64::from(granules) * GRANULE;
    let size = (*next_size).max(needed);
    let size = round_up(size, inner.config.page_size).ok_or(RdmaError::OutOfRange)?;
    let arena = match map_arena(inner, size, true).await {
        // Too big for the budget; an arena of what is left still serves.
        Err(RdmaError::BudgetExceeded { .. }) if size > needed => {
            let left = inner.budget.limit().saturating_sub(inner.budget.used());
            let fitting = left / inner.config.page_size * inner.config.page_size;
            if fitting < needed {
                return Err(inner.budget.refusal(size));
            }
            map_arena(inner, fitting, true).await?
        }
        other => other?,
    };
    let buf = carve_from(&arena, granules, len).ok_or_else(|| {
        RdmaError::backend("a new arena could not hold the request it was mapped for")
    });
    inner.pool.pooled.write().push(Arc::clone(&arena));
    *next_size = next_size.saturating_mul(2).min(pool_config.max_arena_bytes);
    buf
}

/// See [`RdmaRegistry::try_alloc_pinned`](crate::RdmaRegistry::try_alloc_pinned).
pub(crate) fn try_alloc_pinned(inner: &Inner, len: usize) -> Option<PinnedBuf> {
    if len == 0 || len as u64 >= inner.config.pool.dedicated_threshold_bytes {
        return None;
    }
    let _ticket = inner.gate.enter_local()?;
    inner.pool.carve(granules_for(len)?, len)
}

/// Allocate, register and track an arena of `bytes` (a page multiple).
///
/// # Cancel safety
/// A cancelled map is rolled back (`mapping.rs`); once it completes there
/// is no further await.
async fn map_arena(inner: &Arc<Inner>, bytes: u64, pooled: bool) -> Result<Arc<Arena>, RdmaError> {
    let len = usize::try_from(bytes).map_err(|_| RdmaError::OutOfRange)?;
    let mut charge = inner.budget.reserve(bytes)?;
    let align = usize::try_from(inner.config.page_size).map_err(|_| RdmaError::OutOfRange)?;
    let memory = PageMemory::allocate(len, align, Arc::clone(&inner.leaked_bytes))?;
    let ptr = memory.ptr().as_ptr() as usize;
    // SAFETY: `[ptr, ptr + len)` is exactly the pages `memory` owns, which
    // `MapInFlight` keeps until nothing registers them; an arena is written
    // only by GETs into `PinnedBuf`s the GET borrows.
    let (outcome, memory) =
        unsafe { MapInFlight::start(inner, ptr, len, Access::Read, memory) }.await;
    let region = outcome?;
    // No await from here on.
    memory.mark_registered();
    // Never less than the arena's own pages (contract point 7).
    let pinned = PageRange {
        start: memory.ptr().as_ptr() as u64,
        len: bytes,
    }
    .cover(region.effective_addr, region.effective_len);
    charge.reconcile(pinned.len);
    let generation = inner.next_generation();
    let arena = Arc::new(Arena::new(
        NewArena {
            generation,
            backend_region_id: region.backend_region_id,
            memory,
            charge,
            pooled,
            reclaim_when_empty: inner.config.pool.reclaim_empty_arenas,
        },
        Arc::downgrade(inner),
    ));
    inner.counters.registered();
    let late = {
        let mut tables = inner.tables.lock();
        tables.arenas.insert(generation, Arc::clone(&arena));
        tables.swept
    };
    tracing::debug!(
        generation,
        bytes,
        pooled,
        effective = ?pinned,
        "arena mapped"
    );
    if late {
        arena
            .dedicated_in_use
            .store(false, std::sync::atomic::Ordering::SeqCst);
        spawn_arena_release(
            Arc::clone(inner),
            arena,
            None,
            "mapped after the shutdown sweep",
        );
        return Err(RdmaError::ShuttingDown);
    }
    Ok(arena)
}

/// A pooled arena became empty: unmap it if reclaim keeps the floor.
pub(crate) fn maybe_reclaim(inner: &Arc<Inner>, arena: &Arc<Arena>) {
    let floor = inner.config.pool.retention_floor_bytes;
    let mut pooled = inner.pool.pooled.write();
    let total: u64 = pooled.iter().map(|a| a.len()).sum();
    if total.saturating_sub(arena.len()) < floor {
        return;
    }
    let Some(slots) = &arena.slots else { return };
    {
        let mut slots = slots.lock();
        if slots.live != 0 || slots.retired {
            return;
        }
        slots.retired = true;
    }
    pooled.retain(|a| !Arc::ptr_eq(a, arena));
    drop(pooled);
    // During shutdown the sweep unmaps it instead.
    if let Some(ticket) = inner.gate.enter() {
        spawn_arena_release(
            Arc::clone(inner),
            Arc::clone(arena),
            Some(ticket),
            "empty arena reclaimed",
        );
    }
}
