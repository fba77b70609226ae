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
//! Every step reports in one [`ShutdownReport`].

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use std::future::Future;

use futures::future::join_all;
use parking_lot::Mutex;
use rdmareg_core::RdmaError;

use crate::pool::arena::unmap_arena;
use crate::region::state::unmap_region;
use crate::registry::Inner;

/// What a shutdown did and what is still registered.
///
/// One report covers the whole ordering: the sweep's counts (fixed once the
/// sweep ends), the release after the backend's teardown, and what the
/// registry and the backend still count registered when the report was
/// taken. [`SweptRegistry::report`] takes one at any time;
/// [`SweptRegistry::finish_after_backend_teardown`] returns the one taken
/// right after its decision.
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
    /// Whether the survivors were released after the backend's teardown:
    /// the decision of the [`finish_after_backend_teardown`] call that
    /// returned this report, or, from [`report`], whether any finish on
    /// this [`SweptRegistry`] released them. `false` before a finish and
    /// when the backend still counted registrations (refused: retry after
    /// its teardown).
    ///
    /// [`finish_after_backend_teardown`]: SweptRegistry::finish_after_backend_teardown
    /// [`report`]: SweptRegistry::report
    pub released: bool,
    /// Surviving regions whose latch a finish on this [`SweptRegistry`]
    /// released (0 until one releases).
    pub regions_released_after_teardown: usize,
    /// Surviving arenas a finish on this [`SweptRegistry`] released.
    pub arenas_released_after_teardown: usize,
    /// The backend's own count of registrations when this report was taken
    /// (`None`: it cannot count). A finish releases only on `Some(0)` or
    /// `None`.
    pub backend_live: Option<usize>,
    /// Regions the registry still counted registered when this report was
    /// taken: failed or pending unmaps. After a refused finish, the regions
    /// it left open.
    pub regions_registered: usize,
    /// Arenas still counted registered when this report was taken. After a
    /// refused finish, the arenas it left registered.
    pub arenas_registered: usize,
    /// Lent buffers ([`DescribedBuf`](crate::DescribedBuf)s) whose own
    /// registration was not yet confirmed unmapped when this report was
    /// taken; left to their holders, revoked by the backend's teardown.
    pub lent_buffers_registered: usize,
}

impl ShutdownReport {
    /// Whether the registry still counts anything registered (regions,
    /// arenas or lent buffers).
    fn anything_registered(&self) -> bool {
        self.regions_registered + self.arenas_registered + self.lent_buffers_registered > 0
    }
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
    /// The sweep's counts; the other fields are filled when a report is taken.
    sweep: ShutdownReport,
    /// What finishes on this token released. A finish holds it from its
    /// read of the backend's count to its last release, and a report while
    /// it reads, so two finishes do not release (and count) one survivor
    /// twice and a report sees a whole decision or none of it.
    release: Mutex<Release>,
}

/// What finishes on one [`SweptRegistry`] released.
#[derive(Debug, Default)]
struct Release {
    /// A finish released every survivor.
    released: bool,
    regions: usize,
    arenas: usize,
}

impl SweptRegistry {
    /// What the sweep did, what finishes on this token released, and what
    /// the registry and the backend count registered now.
    pub fn report(&self) -> ShutdownReport {
        let release = self.release.lock();
        self.report_now(
            &release,
            release.released,
            self.inner.backend.live_registrations(),
        )
    }

    /// The sweep's counts, `release`'s, `released` and `backend_live` as
    /// given, and the rest read now.
    fn report_now(
        &self,
        release: &Release,
        released: bool,
        backend_live: Option<usize>,
    ) -> ShutdownReport {
        let lent_buffers_registered = if *self.inner.backend_released_everything.borrow() {
            0
        } else {
            self.inner.lent_registrations.load(Ordering::SeqCst)
        };
        let (regions_registered, arenas_registered) = {
            let tables = self.inner.tables.lock();
            (
                tables.regions.values().filter(|r| !r.is_unmapped()).count(),
                tables.arenas.values().filter(|a| !a.is_unmapped()).count(),
            )
        };
        ShutdownReport {
            released,
            regions_released_after_teardown: release.regions,
            arenas_released_after_teardown: release.arenas,
            backend_live,
            regions_registered,
            arenas_registered,
            lent_buffers_registered,
            ..self.sweep.clone()
        }
    }

    /// After the backend's teardown, release every survivor if it reports
    /// `Some(0)` or `None`, else refuse (logged; `released` is `false` and
    /// `regions_registered`/`arenas_registered` name what stays open).
    /// Repeatable. Finishes and reports on one token take turns: a survivor
    /// is released and counted once, and a report sees a whole decision.
    pub fn finish_after_backend_teardown(&self) -> ShutdownReport {
        let inner = &self.inner;
        let mut release = self.release.lock();
        let backend_live = inner.backend.live_registrations();
        let (regions, arenas) = {
            let tables = inner.tables.lock();
            (
                // Unmapped ones too: one another thread is still releasing
                // leaves the table here, not after this finish returned.
                tables.regions.values().cloned().collect::<Vec<_>>(),
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
                regions = regions.iter().filter(|r| !r.is_unmapped()).count(),
                arenas = arenas.len(),
                "backend still holds registrations after teardown: survivors are NOT released; their memory stays allocated"
            );
            return self.report_now(&release, false, backend_live);
        }
        // Counted only where this finish marked it: a finish on another
        // token, or a confirmed unmap, may have marked it since.
        let mut regions_marked = 0;
        for region in &regions {
            if region.mark_unmapped() {
                regions_marked += 1;
            }
        }
        let mut arenas_marked = 0;
        {
            let mut tables = inner.tables.lock();
            for arena in &arenas {
                if arena.mark_unmapped() {
                    arenas_marked += 1;
                }
                tables.arenas.remove(&arena.generation);
            }
        }
        inner.pool.pooled.write().clear();
        // Rollbacks retrying an unmap of a caller's range can stop.
        inner.backend_released_everything.send_replace(true);
        release.regions += regions_marked;
        release.arenas += arenas_marked;
        release.released = true;
        self.report_now(&release, true, backend_live)
    }
}

impl Drop for SweptRegistry {
    fn drop(&mut self) {
        if self.release.get_mut().released {
            return;
        }
        let now = self.report();
        if !now.anything_registered() {
            return;
        }
        match now.backend_live {
            Some(0) => {
                tracing::info!(
                    regions = now.regions_registered,
                    arenas = now.arenas_registered,
                    "swept registry dropped unfinished; the backend holds nothing, so its survivors are released"
                );
                let _ = self.finish_after_backend_teardown();
            }
            live => tracing::warn!(
                regions = now.regions_registered,
                arenas = now.arenas_registered,
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
    let swept = SweptRegistry {
        inner: Arc::clone(inner),
        sweep: ShutdownReport {
            drained,
            in_flight_at_sweep,
            regions_deregistered: count(&region_results, Sweep::Confirmed),
            arenas_deregistered: count(&arena_results, Sweep::Confirmed),
            regions_surviving: count(&region_results, Sweep::Refused),
            arenas_surviving: count(&arena_results, Sweep::Refused),
            regions_unmap_pending: count(&region_results, Sweep::Pending),
            arenas_unmap_pending: count(&arena_results, Sweep::Pending),
            // Filled when a report is taken.
            released: false,
            regions_released_after_teardown: 0,
            arenas_released_after_teardown: 0,
            backend_live: None,
            regions_registered: 0,
            arenas_registered: 0,
            lent_buffers_registered: 0,
        },
        release: Mutex::new(Release::default()),
    };
    let report = swept.report();
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
    swept
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
