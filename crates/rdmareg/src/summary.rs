//! [`ShutdownSummary`]: what [`Rdma::shutdown`](crate::Rdma::shutdown) did.

use std::fmt;
use std::time::Duration;

use rdmareg_registry::{RegistryStats, ShutdownReport};

/// What one [`Rdma::shutdown`](crate::Rdma::shutdown) did, step by step.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
#[must_use = "check `is_clean()`: an unclean shutdown leaves memory registered or leaked"]
pub struct ShutdownSummary {
    /// The registry's report: its sweep, the release after the engine's
    /// teardown, and the engine's own registration count after that
    /// teardown ([`ShutdownReport::backend_live`]).
    pub report: ShutdownReport,
    /// Regions released by the sweep or after the teardown.
    pub regions_released: usize,
    /// Pool arenas released, counted as regions are.
    pub arenas_released: usize,
    /// Regions the application left registered that the sweep had to
    /// deregister: not unsafe, but usually a missing `unregister`.
    pub regions_swept: usize,
    /// Registered bytes (page-rounded) before minus after the shutdown.
    pub bytes_released: u64,
    /// Registered bytes still counted afterwards (0 when clean).
    pub bytes_still_registered: u64,
    /// Bytes leaked over the registry's life (unmap never confirmed).
    pub leaked_bytes: u64,
    /// Time spent in the registry's sweep.
    pub sweep_time: Duration,
    /// Time spent in the engine's teardown.
    pub teardown_time: Duration,
    /// The whole shutdown.
    pub total_time: Duration,
}

impl ShutdownSummary {
    pub(crate) fn new(
        report: ShutdownReport,
        before: &RegistryStats,
        after: &RegistryStats,
        [sweep_time, teardown_time, total_time]: [Duration; 3],
    ) -> Self {
        ShutdownSummary {
            regions_released: report.regions_deregistered + report.regions_released_after_teardown,
            arenas_released: report.arenas_deregistered + report.arenas_released_after_teardown,
            regions_swept: report.regions_deregistered + report.regions_surviving,
            bytes_released: before
                .registered_bytes
                .saturating_sub(after.registered_bytes),
            bytes_still_registered: after.registered_bytes,
            leaked_bytes: after.leaked_bytes,
            report,
            sweep_time,
            teardown_time,
            total_time,
        }
    }

    /// Whether everything ended as it should: admitted work drained, every
    /// registration released, the engine holding none, nothing leaked.
    pub fn is_clean(&self) -> bool {
        self.report.drained
            && self.report.released
            && self.report.backend_live == Some(0)
            && self.bytes_still_registered == 0
            && self.leaked_bytes == 0
    }
}

/// One line: whether it is clean, what was released, what the caller left
/// registered, and how long it took.
impl fmt::Display for ShutdownSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verdict = if self.is_clean() {
            "clean"
        } else {
            "NOT clean"
        };
        write!(
            f,
            "shutdown {verdict} in {:.1?}: {} regions and {} arenas released ({} B)",
            self.total_time, self.regions_released, self.arenas_released, self.bytes_released
        )?;
        if self.regions_swept > 0 {
            write!(
                f,
                ", {} left registered by the caller and swept",
                self.regions_swept
            )?;
        }
        if !self.report.drained {
            f.write_str(", admitted work not drained")?;
        }
        if self.bytes_still_registered > 0 {
            write!(f, ", {} B still registered", self.bytes_still_registered)?;
        }
        if self.leaked_bytes > 0 {
            write!(f, ", {} B leaked", self.leaked_bytes)?;
        }
        match self.report.backend_live {
            Some(live) => write!(f, "; the engine holds {live} registrations"),
            None => f.write_str("; the engine cannot count its registrations"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use rdmareg_backend::RdmaBackend;
    use rdmareg_backend::loopback::{LoopbackBackend, LoopbackFabric, page_size};
    use rdmareg_registry::{PeerId, RdmaConfig, RdmaRegistry};

    use super::ShutdownSummary;

    /// How a situation is set up before the ordered shutdown.
    #[derive(Clone, Copy, Debug)]
    enum Situation {
        /// Nothing left registered.
        Empty,
        /// A region the caller left registered: the sweep unmaps it.
        LeftRegistered,
        /// A region whose unmap the backend refuses in the sweep, released
        /// by the backend's teardown.
        SurvivorThenTornDown,
        /// A region whose unmap the backend refuses, in the sweep and in its
        /// teardown: a wedged backend.
        Wedged,
    }

    /// The ordered shutdown over a loopback backend, as
    /// [`Rdma::shutdown`](crate::Rdma::shutdown) runs it over the engine,
    /// and the engine's count read after the release, as the summary read
    /// it before its `backend_live` became the release's own.
    async fn shut_down(situation: Situation) -> (ShutdownSummary, Option<usize>) {
        let fabric = LoopbackFabric::new();
        let backend: Arc<LoopbackBackend> = fabric.backend(PeerId(1));
        let mut config = RdmaConfig::default();
        config.page_size = page_size();
        let registry = RdmaRegistry::new(
            Arc::clone(&backend) as Arc<dyn RdmaBackend>,
            config,
            tokio::runtime::Handle::current(),
        )
        .expect("valid configuration");
        let page = usize::try_from(page_size()).unwrap();
        let guard = match situation {
            Situation::Empty => None,
            _ => Some(
                registry
                    .register_owned(vec![7u8; page].into_boxed_slice())
                    .await
                    .unwrap(),
            ),
        };
        if matches!(
            situation,
            Situation::SurvivorThenTornDown | Situation::Wedged
        ) {
            backend.faults().refuse_unmaps(true);
        }
        let before = registry.stats();
        let swept = registry.shutdown(Duration::from_secs(1)).await;
        if matches!(situation, Situation::SurvivorThenTornDown) {
            backend.faults().refuse_unmaps(false);
        }
        backend.shutdown().await;
        let report = swept.finish_after_backend_teardown();
        let after = registry.stats();
        let live_after = backend.live_registrations();
        let summary = ShutdownSummary::new(report, &before, &after, [Duration::ZERO; 3]);
        drop(guard);
        (summary, live_after)
    }

    /// For each situation, `is_clean` and the one-line `Display` say what
    /// they said when the summary read the engine's count after the
    /// release, and the lines are pinned.
    #[tokio::test]
    async fn summary_verdicts_match_the_count_read_after_release() {
        let cases = [
            (
                Situation::Empty,
                true,
                "shutdown clean in 0.0ns: 0 regions and 0 arenas released (0 B); \
                 the engine holds 0 registrations",
            ),
            (
                Situation::LeftRegistered,
                true,
                "shutdown clean in 0.0ns: 1 regions and 0 arenas released (8192 B), \
                 1 left registered by the caller and swept; the engine holds 0 registrations",
            ),
            (
                Situation::SurvivorThenTornDown,
                true,
                "shutdown clean in 0.0ns: 1 regions and 0 arenas released (8192 B), \
                 1 left registered by the caller and swept; the engine holds 0 registrations",
            ),
            (
                Situation::Wedged,
                false,
                "shutdown NOT clean in 0.0ns: 0 regions and 0 arenas released (0 B), \
                 1 left registered by the caller and swept, 8192 B still registered; \
                 the engine holds 1 registrations",
            ),
        ];
        for (situation, clean, line) in cases {
            let (summary, live_after) = shut_down(situation).await;
            let mut as_before = summary.clone();
            as_before.report.backend_live = live_after;
            assert_eq!(
                (summary.is_clean(), summary.to_string()),
                (as_before.is_clean(), as_before.to_string()),
                "{situation:?}: {summary:?}"
            );
            if page_size() == 4096 {
                assert_eq!(
                    (summary.is_clean(), summary.to_string().as_str()),
                    (clean, line),
                    "{situation:?}"
                );
            }
        }
    }
}
