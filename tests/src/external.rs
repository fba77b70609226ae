//! [`ExternalMemory`]: memory a test owns and registers with
//! [`RdmaRegistry::register_external`], freed only when every registration
//! made over it has been released.
//!
//! `register_external` is `unsafe` because the registry cannot keep the
//! caller's memory alive: the caller promises the range stays allocated and
//! is never reached through a Rust reference until the guard's
//! `deregistered()` resolves. This type keeps that promise for tests. It
//! hands out no references to its bytes once it has been registered, keeps a
//! [`RegionWatch`] of each registration, and frees its allocation on drop
//! only if every one of them reports released; otherwise it leaks the
//! allocation (and logs), the same rule the registry applies to its own
//! pages. A test that panics half-way therefore leaks instead of freeing
//! memory a peer may still read.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;

use rdmareg_registry::{RdmaError, RdmaRegistry, RegionGuard, RegionWatch};

use crate::pattern;

/// Page-aligned heap memory for external registrations.
#[derive(Debug)]
pub struct ExternalMemory {
    ptr: NonNull<u8>,
    layout: Layout,
    /// One watch per registration made through [`register`](Self::register).
    registrations: Vec<RegionWatch>,
}

// SAFETY: ExternalMemory uniquely owns its heap allocation and only ever
// hands out its address; it has no thread affinity.
unsafe impl Send for ExternalMemory {}
// SAFETY: shared access reads the address and the watches (themselves Sync),
// never the bytes.
unsafe impl Sync for ExternalMemory {}

impl ExternalMemory {
    /// `len` bytes (`len > 0`), page-aligned, holding the pattern with
    /// `seed` from the first byte.
    pub fn patterned(len: usize, seed: u8) -> ExternalMemory {
        let layout = Layout::from_size_align(len, 4096).expect("a valid layout");
        assert!(len > 0, "external memory must not be empty");
        // SAFETY: the layout has a non-zero size (asserted above).
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).expect("allocation succeeded");
        // SAFETY: the allocation is fresh, `len` bytes long and initialised
        // (zeroed); this is the only reference to it, and it ends before the
        // memory can be registered.
        let bytes = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), len) };
        pattern::fill(bytes, seed);
        ExternalMemory {
            ptr,
            layout,
            registrations: Vec::new(),
        }
    }

    /// Length of the allocation in bytes.
    pub fn len(&self) -> usize {
        self.layout.size()
    }

    /// Always `false`: empty allocations are refused.
    pub fn is_empty(&self) -> bool {
        self.layout.size() == 0
    }

    /// Address of the first byte.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Register `[offset, offset + len)` of this memory with `registry`.
    ///
    /// # Errors
    /// Whatever [`RdmaRegistry::register_external`] answers; out-of-bounds
    /// requests are [`RdmaError::OutOfRange`] without reaching the registry.
    pub async fn register(
        &mut self,
        registry: &RdmaRegistry,
        offset: usize,
        len: usize,
    ) -> Result<RegionGuard, RdmaError> {
        let end = offset.checked_add(len).ok_or(RdmaError::OutOfRange)?;
        if end > self.len() {
            return Err(RdmaError::OutOfRange);
        }
        let start = self.ptr.as_ptr().wrapping_add(offset);
        // SAFETY: `[start, start + len)` lies inside this allocation (checked
        // above). The allocation is freed only by `Drop`, and only once every
        // watch pushed below reports its registration released, which is
        // exactly the guard's `deregistered()` event; a registration that
        // fails leaves nothing registered, per `register_external`'s contract.
        // No reference to the bytes is created after construction: this type
        // lends none, and readers go through `RegionWatch::read`.
        let guard = unsafe { registry.register_external(start, len) }.await?;
        self.registrations.push(guard.watch());
        Ok(guard)
    }

    /// Whether every registration made through [`register`](Self::register)
    /// has been released (so dropping this frees the memory).
    pub fn is_released(&self) -> bool {
        self.registrations.iter().all(RegionWatch::is_deregistered)
    }

    /// Resolves once every registration made over this memory is released.
    ///
    /// # Cancel safety
    /// Cancel-safe: it only observes.
    pub async fn released(&self) {
        for watch in &self.registrations {
            watch.deregistered().await;
        }
    }
}

impl Drop for ExternalMemory {
    fn drop(&mut self) {
        if !self.is_released() {
            tracing::error!(
                addr = self.addr(),
                len = self.len(),
                "external memory dropped while a registration over it is unreleased: leaking it"
            );
            return;
        }
        // SAFETY: allocated in `patterned` with this layout and freed only
        // here, once; every registration over it is released, so no peer or
        // backend can reach it any more.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) };
    }
}
