//! The owner's PUT target: page-aligned memory registered read-write.
//!
//! perftest's buffers and the GET rows' pool buffers start on a page, so
//! the PUT rows' target does too: a heap buffer would start 16 bytes into
//! its page, and a same-host PUT into memory whose page offset differs
//! from its source's is staged (`docs/benchmarks.md`, "Same-host PUTs"),
//! which the rows would then measure instead of the lane.
//!
//! The memory is freed only once its unregistration is confirmed; memory
//! whose unmap was not confirmed is leaked, never handed back to the
//! allocator while a peer may still write it.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;
use std::time::Duration;

use anyhow::Context as _;
use rdmareg_core::{Access, Descriptor, RdmaError};
use rdmareg_registry::{RdmaRegistry, RegionGuard, UnregisterOutcome};

/// The page the target starts on.
const PAGE: usize = 4096;

/// Zeroed, page-aligned memory registered read-write.
#[derive(Debug)]
pub struct PutTarget {
    memory: NonNull<u8>,
    layout: Layout,
    guard: Option<RegionGuard>,
}

// SAFETY: the memory is only reached through the registry (peers' PUTs)
// and freed by whichever thread unregisters it; no reference into it is
// ever made.
unsafe impl Send for PutTarget {}

impl PutTarget {
    /// Registers `len` zeroed bytes read-write; `None` on a backend that
    /// cannot grant writes.
    pub async fn register(registry: &RdmaRegistry, len: usize) -> anyhow::Result<Option<Self>> {
        let layout = Layout::from_size_align(len.max(1), PAGE).context("the PUT target's size")?;
        // SAFETY: `layout` has a non-zero size.
        let memory =
            NonNull::new(unsafe { alloc_zeroed(layout) }).context("allocating the PUT target")?;
        // SAFETY: the memory stays allocated until the registration's
        // release is confirmed (`unregister`, `Drop`), and no reference
        // into it is ever made.
        let registered =
            unsafe { registry.register_external_with(memory.as_ptr(), len, Access::ReadWrite) }
                .await;
        let guard = match registered {
            Ok(guard) => guard,
            Err(error) => {
                // SAFETY: a failed registration leaves the range free for
                // reuse at once (`register_external`'s errors); allocated
                // above with `layout`.
                unsafe { dealloc(memory.as_ptr(), layout) };
                return match error {
                    RdmaError::Unsupported { .. } => Ok(None),
                    error => Err(error).context("registering the PUT target"),
                };
            }
        };
        Ok(Some(PutTarget {
            memory,
            layout,
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
                // memory any more; allocated in `register` with `layout`.
                unsafe { dealloc(self.memory.as_ptr(), self.layout) };
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
                bytes = self.layout.size(),
                "the PUT target was not unregistered; its memory is leaked"
            );
        }
    }
}
