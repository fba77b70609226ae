//! The owner's PUT target: memory on transparent huge pages, registered
//! read-write.
//!
//! perftest's buffers and the GET rows' pool buffers start on a page, so
//! the PUT rows' target does too: a heap buffer would start 16 bytes into
//! its page, and a same-host PUT into memory whose page offset differs
//! from its source's is staged (`docs/benchmarks.md`, "Same-host PUTs"),
//! which the rows would then measure instead of the lane. And as UCX
//! allocates perftest's buffers (`ucp_mem_map` with its `thp` method) and
//! the registry its large pool arenas, the target is 2 MiB-aligned and
//! advised `MADV_HUGEPAGE`: the kernel writes into huge pages faster
//! (`process_vm_writev` of 1 MiB: about 86 against 110 µs here).
//!
//! The memory is freed only once its unregistration is confirmed; memory
//! whose unmap was not confirmed is leaked, never handed back to the
//! allocator while a peer may still write it.

use std::ptr::NonNull;
use std::time::Duration;

use anyhow::Context as _;
use rdmareg_core::{Access, Descriptor, RdmaError};
use rdmareg_registry::{RdmaRegistry, RegionGuard, UnregisterOutcome};

/// The huge page the target starts on, and the unit of its length.
const HUGE_PAGE: usize = 2 << 20;

/// Zeroed memory on transparent huge pages, registered read-write.
#[derive(Debug)]
pub struct PutTarget {
    memory: HugeMapping,
    guard: Option<RegionGuard>,
}

/// An anonymous mapping with a zeroed, `HUGE_PAGE`-aligned range inside it
/// advised `MADV_HUGEPAGE` before its first touch; unmapped on `free`.
#[derive(Debug)]
struct HugeMapping {
    /// The mapping as `mmap` returned it.
    base: NonNull<u8>,
    mapped: usize,
    /// The aligned range's first byte and length.
    start: NonNull<u8>,
    len: usize,
}

impl HugeMapping {
    /// At least `len` bytes (rounded up to whole huge pages).
    fn new(len: usize) -> anyhow::Result<HugeMapping> {
        let len = len
            .max(1)
            .checked_next_multiple_of(HUGE_PAGE)
            .context("the PUT target's size")?;
        let mapped = len
            .checked_add(HUGE_PAGE)
            .context("the PUT target's size")?;
        // SAFETY: a fresh private anonymous mapping; no memory is aliased.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error()).context("mapping the PUT target");
        }
        let base = NonNull::new(base.cast::<u8>()).context("mapping the PUT target")?;
        let skip = (base.as_ptr() as usize).next_multiple_of(HUGE_PAGE) - base.as_ptr() as usize;
        // In bounds: `skip < HUGE_PAGE`, and the mapping has `len +
        // HUGE_PAGE` bytes.
        let start =
            NonNull::new(base.as_ptr().wrapping_add(skip)).context("mapping the PUT target")?;
        // SAFETY: madvise reads no memory through the pointer; the range is
        // inside the mapping above, HUGE_PAGE-aligned, and MADV_HUGEPAGE
        // changes no contents (the pages are not touched yet, so they are
        // faulted in huge).
        let advised = unsafe { libc::madvise(start.as_ptr().cast(), len, libc::MADV_HUGEPAGE) };
        if advised != 0 {
            tracing::debug!(
                error = %std::io::Error::last_os_error(),
                "MADV_HUGEPAGE refused; the PUT target stays on small pages"
            );
        }
        // Fault the pages in now, not under the first PUT.
        // SAFETY: `len` writable bytes inside the fresh mapping.
        unsafe { start.as_ptr().write_bytes(0, len) };
        Ok(HugeMapping {
            base,
            mapped,
            start,
            len,
        })
    }

    /// Unmaps it.
    ///
    /// # Safety
    /// Nothing reaches the memory any more: no registration, no peer; and
    /// it is called once.
    unsafe fn free(&self) {
        // SAFETY: the mapping `new` made, unmapped once (the caller's
        // contract), and nothing reaches it any more.
        let rc = unsafe { libc::munmap(self.base.as_ptr().cast(), self.mapped) };
        if rc != 0 {
            tracing::warn!(
                error = %std::io::Error::last_os_error(),
                "unmapping the PUT target failed"
            );
        }
    }
}

// SAFETY: the memory is only reached through the registry (peers' PUTs)
// and freed by whichever thread unregisters it; no reference into it is
// ever made.
unsafe impl Send for PutTarget {}

impl PutTarget {
    /// Registers `len` zeroed bytes read-write; `None` on a backend that
    /// cannot grant writes.
    pub async fn register(registry: &RdmaRegistry, len: usize) -> anyhow::Result<Option<Self>> {
        let memory = HugeMapping::new(len)?;
        // SAFETY: the memory stays allocated until the registration's
        // release is confirmed (`unregister`, `Drop`), and no reference
        // into it is ever made.
        let registered = unsafe {
            registry.register_external_with(memory.start.as_ptr(), len, Access::ReadWrite)
        }
        .await;
        let guard = match registered {
            Ok(guard) => guard,
            Err(error) => {
                // SAFETY: a failed registration leaves the range free for
                // reuse at once (`register_external`'s errors).
                unsafe { memory.free() };
                return match error {
                    RdmaError::Unsupported { .. } => Ok(None),
                    error => Err(error).context("registering the PUT target"),
                };
            }
        };
        Ok(Some(PutTarget {
            memory,
            guard: Some(guard),
        }))
    }

    /// The descriptor peers PUT into.
    pub fn descriptor(&self) -> Result<Descriptor, RdmaError> {
        self.guard
            .as_ref()
            .map_or(Err(RdmaError::RegionNotFound), RegionGuard::descriptor)
    }

    /// Unregisters within `timeout`, and frees the memory once the release
    /// is confirmed.
    pub async fn unregister(mut self, timeout: Duration) -> anyhow::Result<()> {
        let Some(guard) = self.guard.take() else {
            return Ok(());
        };
        let released = guard.deregistered();
        match guard.unregister(timeout).await {
            Ok(UnregisterOutcome::Drained | UnregisterOutcome::DrainTimedOut) => {
                released.await;
                // SAFETY: released: no peer or local reader reaches the
                // memory any more; the guard is gone, so this is the one
                // call (`Drop` frees nothing).
                unsafe { self.memory.free() };
                Ok(())
            }
            Ok(outcome) => {
                anyhow::bail!(
                    "the PUT target's unmap was not confirmed ({outcome:?}); its memory is leaked"
                )
            }
            Err(error) => Err(error).context("unregistering the PUT target; its memory is leaked"),
        }
    }
}

impl Drop for PutTarget {
    fn drop(&mut self) {
        if self.guard.is_some() {
            // Still registered: the guard's own drop deregisters in the
            // background, and the memory must outlive that.
            tracing::warn!(
                bytes = self.memory.len,
                "the PUT target was not unregistered; its memory is leaked"
            );
        }
    }
}
