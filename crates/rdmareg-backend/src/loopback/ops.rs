//! `map` and `unmap` of the loopback backend.
//!
//! Both are built so that cancellation cannot leave a half state:
//!
//! - `map` registers in its last, synchronous step, after every await: a
//!   future dropped at any await point has registered nothing. With
//!   [`FaultInjector::detach_maps`](super::FaultInjector::detach_maps) the
//!   map runs on a task of its own instead, and a map whose future was
//!   dropped is rolled back by a compensating unmap once it has registered —
//!   the shape of a map submitted to a progress thread.
//! - `unmap` does its state change synchronously on the first poll (the
//!   region stops accepting new transfers), then waits out its injected
//!   faults, then lets the region go. A guard lets the region go if the future
//!   is dropped while waiting, so a submitted unmap always proceeds; only the
//!   result is lost.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use parking_lot::Mutex;
use rdmareg_core::{Access, BackendRegion, RdmaError, page_enclosing_range};
use tokio::select;
use tokio::sync::Notify;

use super::key::{PackedKey, fresh_nonce};
use super::table::{RegionTable, UnmapStart};
use super::{FaultOp, LoopbackBackend, page_size, shut_down};

impl LoopbackBackend {
    pub(super) async fn run_map(
        &self,
        ptr: usize,
        len: usize,
        access: Access,
    ) -> Result<BackendRegion, RdmaError> {
        let end = ptr.checked_add(len);
        if ptr == 0 || len == 0 || end.is_none() {
            return Err(RdmaError::OutOfRange);
        }
        if page_enclosing_range(ptr as u64, len as u64, page_size()).is_none() {
            return Err(RdmaError::OutOfRange);
        }
        if self.is_shutting_down() {
            return Err(RdmaError::ShuttingDown);
        }

        if self.faults.maps_detached()
            && let (Some(me), Ok(runtime)) =
                (self.me.upgrade(), tokio::runtime::Handle::try_current())
        {
            return detached_map(me, runtime, ptr, len, access).await;
        }
        self.finish_map(ptr, len, access).await
    }

    /// Faults, then the registration itself.
    async fn finish_map(
        &self,
        ptr: usize,
        len: usize,
        access: Access,
    ) -> Result<BackendRegion, RdmaError> {
        let pinned = page_enclosing_range(ptr as u64, len as u64, page_size())
            .ok_or(RdmaError::OutOfRange)?;
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
        // result are one step, so a dropped future cannot strand a region.
        let nonce = fresh_nonce();
        let region = self
            .table
            .insert(ptr, len, nonce, access)
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
            return Err(RdmaError::backend(
                "injected: loopback refuses unmaps; the region stays registered",
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
        self.withdraw_leases(id);
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

/// Where a detached map leaves its result, and whether anyone still wants it.
#[derive(Default)]
struct Handoff {
    result: Option<Result<BackendRegion, RdmaError>>,
    abandoned: bool,
}

/// Run the map on its own task; if this future is dropped, the task (or the
/// drop, if the result already arrived) rolls the registration back.
async fn detached_map(
    backend: Arc<LoopbackBackend>,
    runtime: tokio::runtime::Handle,
    ptr: usize,
    len: usize,
    access: Access,
) -> Result<BackendRegion, RdmaError> {
    let handoff = Arc::new((Mutex::new(Handoff::default()), Notify::new()));
    let task_handoff = Arc::clone(&handoff);
    let task_backend = Arc::clone(&backend);
    backend.counters.maps_pending.fetch_add(1, Ordering::SeqCst);
    runtime.spawn(async move {
        let result = task_backend.finish_map(ptr, len, access).await;
        // Registered (and so counted by the table) or failed: no longer
        // pending either way.
        task_backend
            .counters
            .maps_pending
            .fetch_sub(1, Ordering::SeqCst);
        let (slot, arrived) = &*task_handoff;
        let orphan = {
            let mut slot = slot.lock();
            if slot.abandoned {
                Some(result)
            } else {
                slot.result = Some(result);
                None
            }
        };
        match orphan {
            Some(Ok(region)) => roll_back(&task_backend, region.backend_region_id).await,
            Some(Err(_)) => {}
            None => arrived.notify_one(),
        }
    });
    let mut abandon = AbandonOnDrop {
        handoff: Arc::clone(&handoff),
        backend,
        runtime,
        taken: false,
    };
    let (slot, arrived) = &*handoff;
    loop {
        if let Some(result) = slot.lock().result.take() {
            abandon.taken = true;
            return result;
        }
        arrived.notified().await;
    }
}

/// The compensating unmap of a map nobody awaited any more.
async fn roll_back(backend: &LoopbackBackend, id: u64) {
    match backend.run_unmap(id).await {
        Ok(()) => {
            tracing::debug!(peer = %backend.peer_id, region = id, "loopback rolled back a dropped map")
        }
        Err(error) => tracing::warn!(
            peer = %backend.peer_id,
            region = id,
            %error,
            "loopback could not roll back a dropped map; the region stays registered"
        ),
    }
}

/// Marks a detached map abandoned when its future is dropped before it
/// completes, and rolls back a result that arrived but was never taken.
struct AbandonOnDrop {
    handoff: Arc<(Mutex<Handoff>, Notify)>,
    backend: Arc<LoopbackBackend>,
    runtime: tokio::runtime::Handle,
    taken: bool,
}

impl Drop for AbandonOnDrop {
    fn drop(&mut self) {
        if self.taken {
            return;
        }
        let stranded = {
            let mut slot = self.handoff.0.lock();
            slot.abandoned = true;
            slot.result.take()
        };
        if let Some(Ok(region)) = stranded {
            let backend = Arc::clone(&self.backend);
            self.runtime.spawn(async move {
                roll_back(&backend, region.backend_region_id).await;
            });
        }
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
