//! [`PinnedBuf`]: a buffer carved from registered pool memory, and the
//! [`Slot`] that owns its granules.
//!
//! The slot is what returns the granules to the arena when dropped. A GET
//! into the buffer *moves* the slot into the transfer for its duration, so a
//! transfer that outlives its caller (the future was dropped) still holds the
//! granules until the backend has finished writing them; the buffer it was
//! taken from is then *surrendered* — empty — because its memory may still
//! be written.
//!
//! # A descriptor never grants more than it describes
//!
//! An arena's key covers the whole arena (64 MiB – 1 GiB): on RDMA hardware,
//! handing it out for one buffer would let the peer read and write every
//! other buffer carved from the same arena. So a `PinnedBuf` has no
//! descriptor at all; [`PinnedBuf::describe`] maps just the buffer's bytes
//! (the backend pins their pages — already pinned by the arena — once more,
//! and the budget is charged for them) and returns a read-only
//! [`DescribedBuf`](super::DescribedBuf) whose descriptors carry that key
//! (see `described.rs`). When the buffer is freed, its own registration is
//! unmapped *before* its granules go back to the allocator, so the key dies
//! before the memory can serve another buffer; if that unmap fails, the
//! granules are never reused (leaked, and the arena's pages with them).

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

/// A registration of one pooled buffer's bytes, made by
/// [`PinnedBuf::describe`].
#[derive(Debug)]
pub(crate) struct OwnRegistration {
    pub(crate) backend_region_id: u64,
    pub(crate) descriptor: Descriptor,
    /// The budget charge for the registration's pages, released when it drops.
    pub(crate) _charge: Reservation,
    /// Counted among the registry's live lent registrations while it exists.
    pub(crate) _counted: LentCount,
}

/// One live own registration of a lent buffer, counted in the registry's
/// [`Survivors::lent_buffers`](crate::Survivors::lent_buffers) until it is
/// dropped (its unmap confirmed). A registration leaked with its slot stays
/// counted: it may still be live.
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

/// A slot whose registration's fate is unknown (a describe's rollback whose
/// unmap failed, a withdrawal or rollback dropped with its runtime) is never
/// reused: its granules stay taken, and its arena — so the pages — alive
/// forever, counted as leaked.
impl MappedMemory for Slot {
    fn leak(self) {
        self.leak_because("the unmap of its own registration was never confirmed");
    }
}

impl Slot {
    /// Never give the slot back: its granules stay taken, its arena alive,
    /// and its own registration (if any) kept whole, so its pages stay
    /// charged; the granules are counted as leaked.
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

/// Give a slot's granules back to its arena (or a dedicated arena back to
/// the backend).
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

/// Unmap a freed buffer's own registration, then release its granules; if
/// the unmap fails (or cannot be run), the granules are never reused and the
/// registration stays charged.
fn release_after_unmap(own: OwnRegistration, arena: Arc<Arena>, start: u32, granules: u32) {
    // The slot again, holding its registration until the unmap is confirmed.
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
    // Admitted work like any other: a shutdown drains this unmap before it
    // tears the backend down, instead of racing it. Once shutdown has begun
    // no ticket is issued; the unmap is still tried, and if the backend has
    // gone meanwhile the granules are leaked (its teardown unmapped them).
    let ticket = inner.gate.enter();
    spawn_own_unmap(&inner, slot, ticket, |outcome| match outcome {
        // Without a registration now, the slot gives its granules back as
        // it drops.
        Ok(slot) => drop(slot),
        Err((error, slot)) => {
            tracing::error!(%error, "unmap of a freed buffer's own registration failed");
            slot.leak_because("its unmap failed");
        }
    });
}

/// Unmap `slot`'s own registration on the registry's runtime.
///
/// Holds the slot — granules taken, registration charged — until the unmap
/// completes, then hands it to `then`: without its registration (key dead,
/// charge released) on `Ok`, with it on `Err`. `ticket`, if any, is held
/// until the unmap completes. A task dropped unfinished (its runtime shut
/// down) leaks the slot whole rather than freeing it under a key that may
/// be live.
pub(crate) fn spawn_own_unmap(
    inner: &Arc<Inner>,
    slot: Slot,
    ticket: Option<Ticket>,
    then: impl FnOnce(Result<Slot, (RdmaError, Slot)>) + Send + 'static,
) {
    let Some(id) = slot.own.as_ref().map(|own| own.backend_region_id) else {
        // Nothing registered of its own: nothing to revoke.
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

/// Never give these granules (or the arena's pages) back: a registration of
/// them may outlive everything.
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

/// A dedicated arena's buffer is gone: unmap and free it, unless shutdown
/// has begun (the sweep does it then).
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
/// Derefs to `[u8]` of exactly the requested length. Its contents on
/// allocation are unspecified (zero for fresh memory, a previous buffer's
/// bytes for reused memory). Dropping it returns its space to the pool — at
/// once, or, if a GET into it is still in flight, when that transfer
/// finishes. A buffer of a dedicated arena unmaps and frees the arena.
///
/// It has no descriptor: [`describe`](Self::describe) it to lend its bytes
/// to peers' reads. That gives it a registration of its own, so the
/// descriptor grants this buffer and not the rest of its arena, and turns
/// it into a read-only [`DescribedBuf`](super::DescribedBuf) until it is
/// withdrawn.
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

    /// Whether the buffer has no bytes (only after it was surrendered).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether a cancelled GET surrendered this buffer: its memory went with
    /// the transfer, which returns it to the pool when the backend is done.
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

    /// Whether this buffer was allocated by the registry `inner`: only that
    /// registry's backend knows its arena's registration id. (The arena's
    /// `Weak` keeps the registry's allocation, so its address cannot be
    /// reused by another registry while this buffer lives.) A surrendered
    /// buffer belongs to nobody.
    pub(crate) fn belongs_to(&self, inner: &std::sync::Arc<crate::registry::Inner>) -> bool {
        self.slot.as_ref().is_some_and(|slot| {
            std::ptr::eq(slot.arena.registry.as_ptr(), std::sync::Arc::as_ptr(inner))
        })
    }

    /// Move the slot out (into a transfer); the buffer is surrendered until
    /// [`restore`](Self::restore).
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
        // SAFETY: with a slot, `[ptr, ptr + len)` lies inside the slot's
        // granules (`len <= granules * GRANULE`, or the dedicated arena's
        // length), which the allocator handed to this slot alone; the arena's
        // memory is alive (the slot holds an `Arc<Arena>`) and initialised
        // (zeroed at allocation, only bytes written since); no transfer
        // writes it (a GET moves the slot out of the buffer, and `&self`
        // cannot coexist with the `&mut self` it borrows). Without a slot the
        // slice is empty over a dangling, well-aligned pointer.
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
