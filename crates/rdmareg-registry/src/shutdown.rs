//! Shutdown as an ordering that cannot be taken out of order.
//!
//! 1. **Gate**: refuse new work; guards' `shutdown_initiated()` resolves.
//! 2. **Drain**: wait for admitted work (maps, rollbacks, transfers), not
//!    for buffers merely held.
//! 3. **Sweep**: unmap everything tracked, drained or not, within one budget
//!    for steps 2 and 3. A refused unmap *survives*; an unfinished one is
//!    *pending* and releases its region when confirmed.
//! 4. The caller tears the backend down.
//! 5. [`SweptRegistry::finish_after_backend_teardown`] releases the
//!    survivors only if the backend reports `Some(0)` (or `None`): a region
//!    it may still pin must not be freed.
//!
//! Step 5 is reachable only through the [`SweptRegistry`] of step 3.
//! Registrations completing after the sweep release themselves at once.

use std::sync::Arc;
use std::time::Duration;

use std::future::Future;

use futures::future::join_all;
use rdmareg_core::RdmaError;

use crate::pool::arena::unmap_arena;
use crate::region::state::unmap_region;
use crate::registry::Inner;

/// What one [`shutdown`](crate::RdmaRegistry::shutdown) pass did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShutdownReport {
    /// Admitted work (maps, transfers) all finished inside the budget.
    pub drained: bool,
    /// Tickets still held when the sweep began (0 when `drained`).
    pub in_flight_at_sweep: usize,
    /// Regions whose unmap the sweep confirmed.
    pub regions_deregistered: usize,
    /// Arenas whose unmap the sweep confirmed.
    pub arenas_deregistered: usize,
    /// Regions whose unmap the backend refused: still registered.
    pub regions_surviving: usize,
    /// Arenas whose unmap the backend refused with an error.
    pub arenas_surviving: usize,
    /// Regions whose unmap did not complete within the budget (a transfer
    /// still used them); it goes on and releases each once confirmed.
    pub regions_unmap_pending: usize,
    /// Arenas whose unmap did not complete within the budget.
    pub arenas_unmap_pending: usize,
}

/// Regions and arenas the registry still tracks as registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Survivors {
    /// Regions not yet confirmed unmapped.
    pub regions: usize,
    /// Arenas not yet confirmed unmapped.
    pub arenas: usize,
    /// Lent buffers ([`DescribedBuf`](crate::DescribedBuf)s) whose own
    /// registration is not yet confirmed unmapped; left to their holders,
    /// revoked by the backend's teardown.
    pub lent_buffers: usize,
}

/// What [`SweptRegistry::finish_after_backend_teardown`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TeardownVerdict {
    /// The backend reported nothing (or cannot report): all released.
    Released {
        /// Surviving regions whose latch this released.
        regions: usize,
        /// Surviving arenas released.
        arenas: usize,
        /// What the backend reported.
        backend_live: Option<usize>,
    },
    /// The backend still holds registrations: nothing released; retry.
    Refused {
        /// The backend's own count.
        backend_live: usize,
        /// Regions left open.
        regions_open: usize,
        /// Arenas left registered.
        arenas_open: usize,
    },
}

/// Proof that the sweep ran; the only way to release survivors.
///
/// Dropped unfinished, it releases them only if the backend reports
/// `Some(0)`; otherwise it logs a warning, and a new
/// [`RdmaRegistry::shutdown`](crate::RdmaRegistry::shutdown) gives another.
#[derive(Debug)]
#[must_use = "tear the backend down, then call finish_after_backend_teardown to release what the sweep could not"]
pub struct SweptRegistry {
    inner: Arc<Inner>,
    report: ShutdownReport,
    /// Set once a finish released every survivor.
    finished: std::sync::atomic::AtomicBool,
}

impl SweptRegistry {
    /// What the sweep did.
    pub fn report(&self) -> &ShutdownReport {
        &self.report
    }

    /// What the registry still counts as registered now: failed or pending
    /// unmaps and lent buffers.
    pub fn survivors(&self) -> Survivors {
        let lent_buffers = if *self.inner.backend_released_everything.borrow() {
            0
        } else {
            self.inner
                .lent_registrations
                .load(std::sync::atomic::Ordering::SeqCst)
        };
        let tables = self.inner.tables.lock();
        Survivors {
            regions: tables.regions.values().filter(|r| !r.is_unmapped()).count(),
            arenas: tables.arenas.values().filter(|a| !a.is_unmapped()).count(),
            lent_buffers,
        }
    }

    /// After the backend's teardown, release every survivor if it reports
    /// `Some(0)` or `None`, else refuse (logged). Repeatable.
    pub fn finish_after_backend_teardown(&self) -> TeardownVerdict {
        let inner = &self.inner;
        let backend_live = inner.backend.live_registrations();
        let (regions, arenas) = {
            let tables = inner.tables.lock();
            (
                tables
                    .regions
                    .values()
                    .filter(|r| !r.is_unmapped())
                    .cloned()
                    .collect::<Vec<_>>(),
                tables
                    .arenas
                    .values()
                    .filter(|a| !a.is_unmapped())
                    .cloned()
                    .collect::<Vec<_>>(),
            )
        };
        if let Some(live) = backend_live
            && live > 0
        {
            tracing::error!(
                backend_live = live,
                regions = regions.len(),
                arenas = arenas.len(),
                "backend still holds registrations after teardown: survivors are NOT released; their memory stays allocated"
            );
            return TeardownVerdict::Refused {
                backend_live: live,
                regions_open: regions.len(),
                arenas_open: arenas.len(),
            };
        }
        for region in &regions {
            region.mark_unmapped();
        }
        {
            let mut tables = inner.tables.lock();
            for arena in &arenas {
                arena.mark_unmapped();
                tables.arenas.remove(&arena.generation);
            }
        }
        inner.pool.pooled.write().clear();
        // Rollbacks retrying an unmap of a caller's range can stop.
        inner.backend_released_everything.send_replace(true);
        self.finished
            .store(true, std::sync::atomic::Ordering::SeqCst);
        TeardownVerdict::Released {
            regions: regions.len(),
            arenas: arenas.len(),
            backend_live,
        }
    }
}

impl Drop for SweptRegistry {
    fn drop(&mut self) {
        if self.finished.load(std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        let survivors = self.survivors();
        if survivors == Survivors::default() {
            return;
        }
        match self.inner.backend.live_registrations() {
            Some(0) => {
                tracing::info!(
                    regions = survivors.regions,
                    arenas = survivors.arenas,
                    "swept registry dropped unfinished; the backend holds nothing, so its survivors are released"
                );
                let _ = self.finish_after_backend_teardown();
            }
            live => tracing::warn!(
                regions = survivors.regions,
                arenas = survivors.arenas,
                backend_live = ?live,
                "swept registry dropped before finish_after_backend_teardown: its survivors stay open; call RdmaRegistry::shutdown again after the backend's teardown and finish that"
            ),
        }
    }
}

/// Steps 1–3; see the module documentation.
pub(crate) async fn shutdown(inner: &Arc<Inner>, budget: Duration) -> SweptRegistry {
    let _serial = inner.shutdown_serial.lock().await;
    if inner.gate.close() {
        tracing::info!(?budget, "registry shutdown begins");
    }
    inner.shutdown_started.release();

    let deadline = tokio::time::Instant::now() + budget;
    let drained = tokio::time::timeout_at(deadline, inner.gate.drained())
        .await
        .is_ok();
    let in_flight_at_sweep = inner.gate.in_flight();
    if !drained {
        tracing::warn!(
            in_flight = in_flight_at_sweep,
            "admitted work did not finish within the shutdown budget; unmapping regardless"
        );
    }

    let (regions, arenas) = {
        let mut tables = inner.tables.lock();
        tables.swept = true;
        (
            tables.regions.values().cloned().collect::<Vec<_>>(),
            tables.arenas.values().cloned().collect::<Vec<_>>(),
        )
    };
    for region in &regions {
        region.close_readers();
    }
    let region_results = join_all(regions.iter().map(|region| {
        let (inner, region) = (Arc::clone(inner), Arc::clone(region));
        bounded(inner.handle.clone(), deadline, async move {
            unmap_region(&inner, &region).await
        })
    }))
    .await;
    let arena_results = join_all(arenas.iter().map(|arena| {
        let (inner, arena) = (Arc::clone(inner), Arc::clone(arena));
        bounded(inner.handle.clone(), deadline, async move {
            unmap_arena(&inner, &arena).await
        })
    }))
    .await;
    inner
        .pool
        .pooled
        .write()
        .retain(|arena| !arena.is_unmapped());

    let count = |results: &[Sweep], which: Sweep| results.iter().filter(|r| **r == which).count();
    let report = ShutdownReport {
        drained,
        in_flight_at_sweep,
        regions_deregistered: count(&region_results, Sweep::Confirmed),
        arenas_deregistered: count(&arena_results, Sweep::Confirmed),
        regions_surviving: count(&region_results, Sweep::Refused),
        arenas_surviving: count(&arena_results, Sweep::Refused),
        regions_unmap_pending: count(&region_results, Sweep::Pending),
        arenas_unmap_pending: count(&arena_results, Sweep::Pending),
    };
    if report.regions_surviving
        + report.arenas_surviving
        + report.regions_unmap_pending
        + report.arenas_unmap_pending
        > 0
    {
        tracing::warn!(
            ?report,
            "shutdown sweep left registrations it could not confirm"
        );
    } else {
        tracing::info!(?report, "shutdown sweep complete");
    }
    SweptRegistry {
        inner: Arc::clone(inner),
        report,
        finished: std::sync::atomic::AtomicBool::new(false),
    }
}

/// How one unmap of the sweep ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sweep {
    Confirmed,
    Refused,
    /// Not completed by the deadline; carried on in the background.
    Pending,
}

/// Run `unmap` until `deadline`, then carry it on in the background.
async fn bounded(
    handle: tokio::runtime::Handle,
    deadline: tokio::time::Instant,
    unmap: impl Future<Output = Result<(), RdmaError>> + Send + 'static,
) -> Sweep {
    let mut unmap = Box::pin(unmap);
    match tokio::time::timeout_at(deadline, &mut unmap).await {
        Ok(Ok(())) => Sweep::Confirmed,
        Ok(Err(_)) => Sweep::Refused,
        Err(_) => {
            handle.spawn(async move {
                if let Err(error) = unmap.await {
                    tracing::error!(%error, "an unmap the shutdown sweep left pending failed");
                }
            });
            Sweep::Pending
        }
    }
}
