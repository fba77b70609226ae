//! [`PinnedBuf`]: a buffer carved from registered pool memory, and the
//! [`Slot`] that owns its granules.
//!
//! A GET into the buffer moves the slot into the transfer, so a transfer
//! whose caller went away still holds the granules until the backend is
//! done; the buffer is then *surrendered* (empty). A buffer has no
//! descriptor because its arena's key covers every other buffer of the
//! arena: `describe` gives it a registration of its own, which is unmapped
//! before the granules serve another buffer (`docs/safety.md`).

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use rdmareg_core::{Descriptor, RdmaError};

use super::arena::{Arena, spawn_arena_release};
use crate::GRANULE;
use crate::budget::Reservation;
use crate::gate::Ticket;
use crate::mapping::{LeakUnlessReleased, MappedMemory};
use crate::registry::Inner;

/// Ownership of `granules` granules from `start` in a pooled arena, or of a
/// whole dedicated arena.
#[derive(Debug)]
pub(crate) struct Slot {
    pub(crate) arena: Arc<Arena>,
    pub(crate) start: u32,
    pub(crate) granules: u32,
    /// The buffer's own registration, once described.
    pub(crate) own: Option<OwnRegistration>,
}

/// A registration of one pooled buffer's bytes, made by `describe`.
#[derive(Debug)]
pub(crate) struct OwnRegistration {
    pub(crate) backend_region_id: u64,
    pub(crate) descriptor: Descriptor,
    pub(crate) _charge: Reservation,
    pub(crate) _counted: LentCount,
}

/// A live own registration, counted in
/// [`ShutdownReport::lent_buffers_registered`](crate::ShutdownReport::lent_buffers_registered) until its
/// unmap is confirmed (a leaked one stays counted).
#[derive(Debug)]
pub(crate) struct LentCount(Arc<std::sync::atomic::AtomicUsize>);

impl LentCount {
    pub(crate) fn new(count: &Arc<std::sync::atomic::AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Self(Arc::clone(count))
    }
}

impl Drop for LentCount {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// An arena whose pages a registration may outlive: kept alive forever.
impl MappedMemory for Arc<Arena> {
    fn leak(self) {
        std::mem::forget(self);
    }
}

/// A slot whose registration's fate is unknown is never reused.
impl MappedMemory for Slot {
    fn leak(self) {
        self.leak_because("the unmap of its own registration was never confirmed");
    }
}

impl Slot {
    /// Never give the slot back; its granules are counted as leaked.
    fn leak_because(self, why: &str) {
        let slot = std::mem::ManuallyDrop::new(self);
        let inner = slot.arena.registry.upgrade();
        leak_granules(
            inner.as_deref(),
            Arc::clone(&slot.arena),
            slot.granules,
            why,
        );
    }

    /// Byte offset of the slot from the arena's mapped pointer.
    pub(crate) fn offset(&self) -> u64 {
        u64::from(self.start) * GRANULE
    }

    /// Where the slot's bytes start.
    pub(crate) fn bytes_ptr(&self) -> *mut u8 {
        // `offset() < arena length`, so the add stays inside the arena.
        self.arena
            .memory
            .ptr()
            .as_ptr()
            .wrapping_add(self.offset() as usize)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        match self.own.take() {
            // The key must die before the granules can serve another buffer.
            Some(own) => {
                release_after_unmap(own, Arc::clone(&self.arena), self.start, self.granules)
            }
            None => release_granules(&self.arena, self.start, self.granules),
        }
    }
}

/// Give a slot's granules back to its arena (or free a dedicated arena).
fn release_granules(arena: &Arc<Arena>, start: u32, granules: u32) {
    let Some(slots) = &arena.slots else {
        arena.dedicated_in_use.store(false, Ordering::SeqCst);
        release_dedicated(arena);
        return;
    };
    let now_empty = {
        let mut slots = slots.lock();
        slots.allocator.release(start, granules);
        slots.live -= 1;
        slots.live == 0 && !slots.retired
    };
    if now_empty
        && arena.reclaim_when_empty
        && let Some(inner) = arena.registry.upgrade()
    {
        super::maybe_reclaim(&inner, arena);
    }
}

/// Unmap a freed buffer's own registration, then release its granules, or
/// leak them if the unmap fails.
fn release_after_unmap(own: OwnRegistration, arena: Arc<Arena>, start: u32, granules: u32) {
    let slot = Slot {
        arena,
        start,
        granules,
        own: Some(own),
    };
    let Some(inner) = slot.arena.registry.upgrade() else {
        slot.leak_because("the registry is gone");
        return;
    };
    // Admitted work, so shutdown drains this unmap. Once shutdown began it
    // runs without a ticket, and leaks the granules if it fails.
    let ticket = inner.gate.enter();
    spawn_own_unmap(&inner, slot, ticket, |outcome| match outcome {
        // Without its registration, the slot releases its granules on drop.
        Ok(slot) => drop(slot),
        Err((error, slot)) => {
            tracing::error!(%error, "unmap of a freed buffer's own registration failed");
            slot.leak_because("its unmap failed");
        }
    });
}

/// Unmap `slot`'s own registration on the registry's runtime, holding the
/// slot (and `ticket`) until it completes, then hand the slot to `then`:
/// without its registration on `Ok`, with it on `Err`. A task dropped
/// unfinished leaks the slot rather than free it under a live key.
pub(crate) fn spawn_own_unmap(
    inner: &Arc<Inner>,
    slot: Slot,
    ticket: Option<Ticket>,
    then: impl FnOnce(Result<Slot, (RdmaError, Slot)>) + Send + 'static,
) {
    let Some(id) = slot.own.as_ref().map(|own| own.backend_region_id) else {
        return then(Ok(slot));
    };
    let kept = LeakUnlessReleased::new(slot);
    let task_inner = Arc::clone(inner);
    inner.handle.spawn(async move {
        let _ticket = ticket;
        let outcome = task_inner.backend.unmap(id).await;
        let Some(mut slot) = kept.release() else {
            return;
        };
        then(match outcome {
            Ok(()) => {
                drop(slot.own.take());
                Ok(slot)
            }
            Err(error) => Err((error, slot)),
        });
    });
}

/// Never give these granules or the arena's pages back.
fn leak_granules(inner: Option<&Inner>, arena: Arc<Arena>, granules: u32, why: &str) {
    let bytes = u64::from(granules) * GRANULE;
    tracing::error!(
        bytes,
        why,
        "a pool buffer's own registration could not be confirmed unmapped: its granules and its arena's pages are leaked"
    );
    if let Some(inner) = inner {
        inner.leaked_bytes.fetch_add(bytes, Ordering::SeqCst);
    }
    arena.leak();
}

/// Unmap and free a dropped buffer's dedicated arena (the sweep does it once
/// shutdown has begun).
fn release_dedicated(arena: &Arc<Arena>) {
    let Some(inner) = arena.registry.upgrade() else {
        return;
    };
    if let Some(ticket) = inner.gate.enter() {
        spawn_arena_release(
            Arc::clone(&inner),
            Arc::clone(arena),
            Some(ticket),
            "dedicated buffer dropped",
        );
    }
}

/// A buffer in registered memory from the pinned pool.
///
/// Derefs to `[u8]` of exactly the requested length, with unspecified
/// initial contents. Dropping it returns its space to the pool, or when a
/// GET into it finishes. It has no descriptor: [`describe`](Self::describe)
/// it to lend its bytes to peers' reads.
#[derive(Debug)]
pub struct PinnedBuf {
    slot: Option<Slot>,
    len: usize,
}

impl PinnedBuf {
    pub(crate) fn new(slot: Slot, len: usize) -> Self {
        Self {
            slot: Some(slot),
            len,
        }
    }

    /// Length in bytes: the requested length, or 0 once surrendered.
    pub fn len(&self) -> usize {
        if self.slot.is_some() { self.len } else { 0 }
    }

    /// Whether the buffer has no bytes (only once surrendered).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether a cancelled GET surrendered this buffer; the memory returns
    /// to the pool when the backend is done.
    pub fn is_surrendered(&self) -> bool {
        self.slot.is_none()
    }

    /// Whether the buffer has an arena of its own.
    pub fn is_dedicated(&self) -> bool {
        self.slot.as_ref().is_some_and(|s| !s.arena.is_pooled())
    }

    /// Generation of the arena the buffer lives in.
    pub fn generation(&self) -> Option<u64> {
        self.slot.as_ref().map(|s| s.arena.generation)
    }

    pub(crate) fn slot(&self) -> Option<&Slot> {
        self.slot.as_ref()
    }

    /// Whether registry `inner` allocated this buffer (only its backend knows
    /// the arena's id; the arena's `Weak` keeps that address from reuse).
    pub(crate) fn belongs_to(&self, inner: &std::sync::Arc<crate::registry::Inner>) -> bool {
        self.slot.as_ref().is_some_and(|slot| {
            std::ptr::eq(slot.arena.registry.as_ptr(), std::sync::Arc::as_ptr(inner))
        })
    }

    /// Move the slot out (into a transfer), surrendering the buffer.
    pub(crate) fn take_slot(&mut self) -> Option<Slot> {
        self.slot.take()
    }

    pub(crate) fn restore(&mut self, slot: Slot) {
        self.slot = Some(slot);
    }

    fn raw(&self) -> (*mut u8, usize) {
        match &self.slot {
            Some(slot) => (slot.bytes_ptr(), self.len),
            None => (std::ptr::NonNull::<u8>::dangling().as_ptr(), 0),
        }
    }
}

impl Deref for PinnedBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        let (ptr, len) = self.raw();
        // SAFETY: with a slot, `[ptr, ptr + len)` lies inside granules the
        // allocator gave this slot alone, in an arena its `Arc` keeps alive,
        // initialised (zeroed at allocation). No transfer writes them: a GET
        // moves the slot out, under a `&mut self` that excludes this `&self`.
        // Without a slot the slice is empty over a dangling aligned pointer.
        unsafe { std::slice::from_raw_parts(ptr, len) }
    }
}

impl DerefMut for PinnedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        let (ptr, len) = self.raw();
        // SAFETY: as for `deref`, and `&mut self` makes this the only
        // reference to those bytes.
        unsafe { std::slice::from_raw_parts_mut(ptr, len) }
    }
}
