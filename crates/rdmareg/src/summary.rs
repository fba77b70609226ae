//! [`ShutdownSummary`]: what [`Rdma::shutdown`](crate::Rdma::shutdown) did.

use std::fmt;
use std::time::Duration;

use rdmareg_registry::{RegistryStats, ShutdownReport};

/// What one [`Rdma::shutdown`](crate::Rdma::shutdown) did, step by step.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
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
