//! Latency samples and their summary (median, p99, mean), and throughput.
//!
//! Percentiles use the nearest-rank method on the sorted samples, the same
//! definition `ucx_perftest` reports for its "50.0%ile" column, so the two
//! columns of a comparison mean the same thing.

use std::time::Duration;

/// A set of latency samples in nanoseconds.
#[derive(Debug, Default, Clone)]
pub struct Samples {
    nanos: Vec<u64>,
}

/// What a run of samples summarises to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    /// Number of samples.
    pub count: usize,
    /// Median, microseconds.
    pub p50_us: f64,
    /// 99th percentile, microseconds.
    pub p99_us: f64,
    /// Mean, microseconds.
    pub mean_us: f64,
}

impl Samples {
    /// An empty set with room for `capacity` samples.
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            nanos: Vec::with_capacity(capacity),
        }
    }

    /// Record one sample.
    pub fn push(&mut self, sample: Duration) {
        self.nanos
            .push(u64::try_from(sample.as_nanos()).unwrap_or(u64::MAX));
    }

    /// Summarise; `None` when there are no samples.
    pub fn summary(&mut self) -> Option<Summary> {
        if self.nanos.is_empty() {
            return None;
        }
        self.nanos.sort_unstable();
        let total: u128 = self.nanos.iter().map(|&n| u128::from(n)).sum();
        Some(Summary {
            count: self.nanos.len(),
            p50_us: nearest_rank(&self.nanos, 50.0) as f64 / 1000.0,
            p99_us: nearest_rank(&self.nanos, 99.0) as f64 / 1000.0,
            mean_us: total as f64 / self.nanos.len() as f64 / 1000.0,
        })
    }
}

/// Nearest-rank percentile of sorted, non-empty samples.
fn nearest_rank(sorted: &[u64], percentile: f64) -> u64 {
    let rank = ((percentile / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Bytes per second in MiB/s (2^20 bytes), the unit `ucx_perftest` prints
/// in its "MB/s" columns (checked: 65536 B at 52.746 µs a message prints
/// 1184.91).
pub fn mebibytes_per_second(bytes: u64, elapsed: Duration) -> f64 {
    let seconds = elapsed.as_secs_f64();
    if seconds == 0.0 {
        return 0.0;
    }
    bytes as f64 / seconds / (1u64 << 20) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_follow_nearest_rank() {
        let mut s = Samples::default();
        for n in 1..=100u64 {
            s.push(Duration::from_nanos(n * 1000));
        }
        let summary = s.summary().unwrap();
        assert_eq!(summary.p50_us, 50.0);
        assert_eq!(summary.p99_us, 99.0);
        assert_eq!(summary.mean_us, 50.5);
    }

    #[test]
    fn one_sample_is_every_percentile() {
        let mut s = Samples::default();
        s.push(Duration::from_micros(3));
        let summary = s.summary().unwrap();
        assert_eq!((summary.p50_us, summary.p99_us), (3.0, 3.0));
    }

    #[test]
    fn no_samples_have_no_summary() {
        assert!(Samples::default().summary().is_none());
    }

    #[test]
    fn throughput_is_in_mebibytes() {
        assert_eq!(mebibytes_per_second(2 << 20, Duration::from_secs(2)), 1.0);
        assert_eq!(mebibytes_per_second(5, Duration::ZERO), 0.0);
    }
}
