//! [`PinnedBuf`]: a buffer carved from registered pool memory, and the
//! [`Slot`] that owns its granules.
//!
//! The slot is what returns the granules to the arena when dropped. A GET
//! into the buffer *moves* the slot into the transfer for its duration, so a
//! transfer that outlives its caller (the future was dropped) still holds the
//! granules until the backend has finished writing them; the buffer it was
//! taken from is then *surrendered* — empty — because its memory may still
//! be written.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use rdmareg_core::{Descriptor, RdmaError};

use super::arena::{Arena, spawn_arena_release};
use crate::GRANULE;

/// Ownership of `granules` granules from `start` in a pooled arena, or of a
/// whole dedicated arena.
#[derive(Debug)]
pub(crate) struct Slot {
    pub(crate) arena: Arc<Arena>,
    pub(crate) start: u32,
    pub(crate) granules: u32,
}

impl Slot {
    /// Byte offset of the slot from the arena's mapped pointer.
    pub(crate) fn offset(&self) -> u64 {
        u64::from(self.start) * GRANULE
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let Some(slots) = &self.arena.slots else {
            self.arena.dedicated_in_use.store(false, Ordering::SeqCst);
            release_dedicated(&self.arena);
            return;
        };
        let now_empty = {
            let mut slots = slots.lock();
            slots.allocator.release(self.start, self.granules);
            slots.live -= 1;
            slots.live == 0 && !slots.retired
        };
        if now_empty
            && self.arena.reclaim_when_empty
            && let Some(inner) = self.arena.registry.upgrade()
        {
            super::maybe_reclaim(&inner, &self.arena);
        }
    }
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
/// Anyone holding a descriptor of this buffer (or, on tcp and shared memory,
/// any peer with an endpoint) can write it: hand its descriptor only to
/// peers whose writes your protocol expects.
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

    /// A descriptor of the whole buffer.
    ///
    /// # Errors
    /// [`RdmaError::RegionNotFound`] for a surrendered buffer.
    pub fn descriptor(&self) -> Result<Descriptor, RdmaError> {
        self.descriptor_range(0, self.len as u64)
    }

    /// A descriptor of `[offset, offset + len)` of the buffer.
    ///
    /// # Errors
    /// [`RdmaError::OutOfRange`] for an empty range or one that leaves the
    /// buffer; [`RdmaError::RegionNotFound`] for a surrendered buffer.
    pub fn descriptor_range(&self, offset: u64, len: u64) -> Result<Descriptor, RdmaError> {
        let slot = self.slot.as_ref().ok_or(RdmaError::RegionNotFound)?;
        let end = offset.checked_add(len).ok_or(RdmaError::OutOfRange)?;
        if len == 0 || end > self.len as u64 {
            return Err(RdmaError::OutOfRange);
        }
        let arena = slot
            .arena
            .descriptor
            .as_ref()
            .ok_or(RdmaError::RegionNotFound)?;
        arena.slice(slot.offset() + offset, len)
    }

    /// Generation of the arena the buffer lives in.
    pub fn generation(&self) -> Option<u64> {
        self.slot.as_ref().map(|s| s.arena.generation)
    }

    pub(crate) fn slot(&self) -> Option<&Slot> {
        self.slot.as_ref()
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
            // `offset() < arena length`, so the add stays inside the arena.
            Some(slot) => (
                slot.arena
                    .memory
                    .ptr()
                    .as_ptr()
                    .wrapping_add(slot.offset() as usize),
                self.len,
            ),
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
