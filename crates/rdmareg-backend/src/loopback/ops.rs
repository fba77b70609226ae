//! `map` and `unmap` of the loopback backend.
//!
//! Both are built so that cancellation cannot leave a half state:
//!
//! - `map` registers in its last, synchronous step, after every await: a
//!   future dropped at any await point has registered nothing.
//! - `unmap` does its state change synchronously on the first poll (the
//!   region stops accepting new transfers), then waits out its injected
//!   faults, then lets the region go. A guard lets the region go if the future
//!   is dropped while waiting, so a submitted unmap always proceeds; only the
//!   answer is lost.

use rdmareg_core::{BackendRegion, RdmaError, page_enclosing_range};
use tokio::select;

use super::key::{PackedKey, fresh_nonce};
use super::table::{RegionTable, UnmapStart};
use super::{FaultOp, LoopbackBackend, page_size, shut_down};

impl LoopbackBackend {
    pub(super) async fn run_map(&self, ptr: usize, len: usize) -> Result<BackendRegion, RdmaError> {
        let end = ptr.checked_add(len);
        if ptr == 0 || len == 0 || end.is_none() {
            return Err(RdmaError::OutOfRange);
        }
        let pinned = page_enclosing_range(ptr as u64, len as u64, page_size())
            .ok_or(RdmaError::OutOfRange)?;
        if self.is_shutting_down() {
            return Err(RdmaError::ShuttingDown);
        }

        let plan = self.faults.take(FaultOp::Map);
        if !plan.is_immediate() {
            select! {
                () = plan.wait() => {}
                () = shut_down(self.shutdown_signal()) => return Err(RdmaError::ShuttingDown),
            }
        }
        if let Some(injected) = plan.injected_failure() {
            return Err(injected);
        }

        // From here to the return there is no await: the registration and the
        // answer are one step, so a dropped future cannot strand a region.
        let nonce = fresh_nonce();
        let region = self
            .table
            .insert(ptr, len, nonce)
            .ok_or(RdmaError::ShuttingDown)?;
        let packed_key = PackedKey {
            instance: self.instance,
            region,
            nonce,
        }
        .encode();
        self.counters
            .maps
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tracing::trace!(peer = %self.peer_id, region, ptr, len, "loopback map");
        Ok(BackendRegion {
            backend_region_id: region,
            effective_addr: pinned.start,
            effective_len: pinned.len,
            packed_key,
        })
    }

    pub(super) async fn run_unmap(&self, id: u64) -> Result<(), RdmaError> {
        match self.table.peek(id) {
            UnmapStart::Absent => return Ok(()),
            UnmapStart::AlreadyUnmapping => {
                self.table.wait_absent(id).await;
                return Ok(());
            }
            UnmapStart::Closed => return Err(RdmaError::ShuttingDown),
            UnmapStart::Started => {}
        }
        if self.faults.unmaps_refused() {
            return Err(RdmaError::Backend(
                "injected: loopback refuses unmaps; the region stays registered".into(),
            ));
        }
        let plan = self.faults.take(FaultOp::Unmap);
        if let Some(injected) = plan.injected_failure() {
            plan.wait().await;
            return Err(injected);
        }

        match self.table.start_unmap(id) {
            // Unmapped (or closed) by someone else between the peek and now.
            UnmapStart::Absent => return Ok(()),
            UnmapStart::Closed => return Err(RdmaError::ShuttingDown),
            UnmapStart::AlreadyUnmapping => {
                self.table.wait_absent(id).await;
                return Ok(());
            }
            UnmapStart::Started => {}
        }
        tracing::trace!(peer = %self.peer_id, region = id, "loopback unmap submitted");
        let release = ReleaseOnDrop {
            table: &self.table,
            id,
        };
        if !plan.is_immediate() {
            // Shutdown releases the region itself; waiting on is pointless.
            select! {
                () = plan.wait() => {}
                () = shut_down(self.shutdown_signal()) => {}
            }
        }
        drop(release);
        self.table.wait_absent(id).await;
        Ok(())
    }
}

/// Lets a `Requested` region go when dropped: on the normal path once the
/// unmap's faults are over, and also when the unmap future is dropped while
/// waiting for them.
struct ReleaseOnDrop<'a> {
    table: &'a RegionTable,
    id: u64,
}

impl Drop for ReleaseOnDrop<'_> {
    fn drop(&mut self) {
        self.table.release_unmap(self.id);
    }
}
