//! [`RegistryMetrics`]: cumulative counters and a GET-latency histogram.
//!
//! Each figure is a relaxed atomic bumped once on the hot path, so keeping
//! them needs no feature flag; exporting them is the `rdmareg` facade's.
//! What is counted:
//! - **registrations / unregistrations**: regions and pool arenas mapped,
//!   and those confirmed unmapped or released after teardown (not
//!   [`PinnedBuf::describe`](crate::PinnedBuf::describe)'s own maps);
//! - **errors by kind**: every error a public operation returned (each
//!   failed batch entry once), by [`RdmaError::kind`]; budget refusals are
//!   [`ErrorKind::BudgetExceeded`];
//! - **GETs and bytes**: reads completed `Ok`, a batch entry as one;
//! - **GET latency**: admission to completion of every completed read; each
//!   batch entry observes the batch's time; dropped GETs are not observed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rdmareg_core::{ErrorKind, RdmaError};

use crate::stats::RegistryStats;

/// Upper bounds of the GET-latency histogram's buckets, in seconds (a last
/// bucket, `+Inf`, holds the rest): 1 µs to 10 s, three per decade.
pub const GET_LATENCY_BUCKETS: [f64; 22] = [
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
    5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// The registry's counters (see the module docs).
#[derive(Debug)]
pub(crate) struct Counters {
    registrations: AtomicU64,
    unregistrations: AtomicU64,
    gets: AtomicU64,
    get_bytes: AtomicU64,
    puts: AtomicU64,
    put_bytes: AtomicU64,
    errors: [AtomicU64; ErrorKind::ALL.len()],
    latency_buckets: [AtomicU64; GET_LATENCY_BUCKETS.len() + 1],
    latency_sum_nanos: AtomicU64,
    latency_count: AtomicU64,
}

impl Default for Counters {
    fn default() -> Self {
        Self {
            registrations: AtomicU64::new(0),
            unregistrations: AtomicU64::new(0),
            gets: AtomicU64::new(0),
            get_bytes: AtomicU64::new(0),
            puts: AtomicU64::new(0),
            put_bytes: AtomicU64::new(0),
            errors: std::array::from_fn(|_| AtomicU64::new(0)),
            latency_buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            latency_sum_nanos: AtomicU64::new(0),
            latency_count: AtomicU64::new(0),
        }
    }
}

impl Counters {
    pub(crate) fn registered(&self) {
        self.registrations.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn unregistered(&self) {
        self.unregistrations.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn error(&self, error: &RdmaError) {
        self.errors[error.kind().index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Record an operation's outcome: its error, if any.
    pub(crate) fn outcome<T>(&self, result: &Result<T, RdmaError>) {
        if let Err(error) = result {
            self.error(error);
        }
    }

    /// One completed read of `len` bytes that took `took`.
    pub(crate) fn get(&self, len: u64, took: Duration, result: &Result<(), RdmaError>) {
        match result {
            Ok(()) => {
                self.gets.fetch_add(1, Ordering::Relaxed);
                self.get_bytes.fetch_add(len, Ordering::Relaxed);
            }
            Err(error) => self.error(error),
        }
        self.observe_latency(took, 1);
    }

    /// One completed write of `len` bytes: counted with its bytes, or by
    /// its error. Writes stay out of the read latency.
    pub(crate) fn put(&self, len: u64, result: &Result<(), RdmaError>) {
        match result {
            Ok(()) => {
                self.puts.fetch_add(1, Ordering::Relaxed);
                self.put_bytes.fetch_add(len, Ordering::Relaxed);
            }
            Err(error) => self.error(error),
        }
    }

    /// The entries of one completed list that took `took`, counted as that
    /// many `get`s with one update per counter.
    pub(crate) fn list<'a>(
        &self,
        entries: impl IntoIterator<Item = (u64, &'a Result<(), RdmaError>)>,
        took: Duration,
    ) {
        let (mut completed, mut reads, mut bytes) = (0u64, 0u64, 0u64);
        for (len, result) in entries {
            completed += 1;
            match result {
                Ok(()) => {
                    reads += 1;
                    bytes = bytes.saturating_add(len);
                }
                Err(error) => self.error(error),
            }
        }
        if reads > 0 {
            self.gets.fetch_add(reads, Ordering::Relaxed);
            self.get_bytes.fetch_add(bytes, Ordering::Relaxed);
        }
        if completed > 0 {
            self.observe_latency(took, completed);
        }
    }

    /// `times` observations that each took `took`.
    fn observe_latency(&self, took: Duration, times: u64) {
        let seconds = took.as_secs_f64();
        let bucket = GET_LATENCY_BUCKETS
            .iter()
            .position(|bound| seconds <= *bound)
            .unwrap_or(GET_LATENCY_BUCKETS.len());
        self.latency_buckets[bucket].fetch_add(times, Ordering::Relaxed);
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.latency_sum_nanos
            .fetch_add(nanos.saturating_mul(times), Ordering::Relaxed);
        self.latency_count.fetch_add(times, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self, stats: RegistryStats) -> RegistryMetrics {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let errors = ErrorKind::ALL.map(|kind| (kind, load(&self.errors[kind.index()])));
        let buckets: Vec<u64> = self.latency_buckets.iter().map(load).collect();
        RegistryMetrics {
            registrations: load(&self.registrations),
            unregistrations: load(&self.unregistrations),
            budget_refusals: load(&self.errors[ErrorKind::BudgetExceeded.index()]),
            gets: load(&self.gets),
            get_bytes: load(&self.get_bytes),
            puts: load(&self.puts),
            put_bytes: load(&self.put_bytes),
            errors: errors.to_vec(),
            get_latency: LatencyHistogram {
                // The count is the buckets' sum, so the snapshot is
                // self-consistent even while GETs complete.
                count: buckets.iter().sum(),
                buckets,
                sum: Duration::from_nanos(load(&self.latency_sum_nanos)),
            },
            stats,
        }
    }
}

/// A snapshot of the registry's counters and, taken with them, its gauges.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct RegistryMetrics {
    /// What the registry holds now.
    pub stats: RegistryStats,
    /// Regions and pool arenas registered so far.
    pub registrations: u64,
    /// Regions and pool arenas released so far.
    pub unregistrations: u64,
    /// Registrations and allocations refused by the budget so far.
    pub budget_refusals: u64,
    /// Reads that completed `Ok` so far.
    pub gets: u64,
    /// Bytes those reads moved.
    pub get_bytes: u64,
    /// Writes that completed `Ok` so far.
    pub puts: u64,
    /// Bytes those writes moved.
    pub put_bytes: u64,
    /// Errors returned so far, one entry per [`ErrorKind`] (zeros included),
    /// in [`ErrorKind::ALL`] order.
    pub errors: Vec<(ErrorKind, u64)>,
    /// Latency of completed reads.
    pub get_latency: LatencyHistogram,
}

impl RegistryMetrics {
    /// Errors of `kind` returned so far.
    pub fn errors_of(&self, kind: ErrorKind) -> u64 {
        self.errors
            .iter()
            .find(|(k, _)| *k == kind)
            .map_or(0, |(_, n)| *n)
    }
}

/// A latency histogram over [`GET_LATENCY_BUCKETS`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LatencyHistogram {
    /// Observations per bucket, not cumulative; the last is `+Inf`.
    pub buckets: Vec<u64>,
    /// Sum of every observation.
    pub sum: Duration,
    /// Number of observations.
    pub count: u64,
}

impl LatencyHistogram {
    /// `(upper bound in seconds, cumulative count)` per bucket, `+Inf`
    /// last: the form Prometheus histograms take.
    pub fn cumulative(&self) -> Vec<(f64, u64)> {
        let bounds = GET_LATENCY_BUCKETS.iter().copied().chain([f64::INFINITY]);
        let mut total = 0;
        bounds
            .zip(&self.buckets)
            .map(|(bound, n)| {
                total += n;
                (bound, total)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latencies_are_counted_in_the_bucket_of_their_bound() {
        let counters = Counters::default();
        counters.get(8, Duration::from_nanos(500), &Ok(()));
        counters.get(8, Duration::from_micros(1), &Ok(()));
        counters.get(8, Duration::from_micros(30), &Err(RdmaError::Timeout));
        counters.get(8, Duration::from_secs(60), &Ok(()));
        let m = counters.snapshot(RegistryStats::default());
        assert_eq!(m.get_latency.count, 4);
        assert_eq!(m.get_latency.buckets[0], 2, "500 ns and 1 µs are <= 1 µs");
        let fifty_micros = GET_LATENCY_BUCKETS.iter().position(|b| *b == 5e-5).unwrap();
        assert_eq!(m.get_latency.buckets[fifty_micros], 1);
        assert_eq!(*m.get_latency.buckets.last().unwrap(), 1, "60 s is +Inf");
        assert_eq!(m.get_latency.cumulative().last(), Some(&(f64::INFINITY, 4)));
        assert_eq!(m.gets, 3);
        assert_eq!(m.get_bytes, 24);
        assert_eq!(m.errors_of(ErrorKind::Timeout), 1);
        assert_eq!(
            m.get_latency.sum,
            Duration::from_nanos(500) + Duration::from_micros(31) + Duration::from_secs(60)
        );
    }

    #[test]
    fn a_list_counts_exactly_as_its_entries_read_one_by_one() {
        let outcomes = [
            (8, Ok(())),
            (64, Err(RdmaError::Timeout)),
            (4096, Ok(())),
            (16, Err(RdmaError::OutOfRange)),
        ];
        let took = Duration::from_micros(30);
        let one_by_one = Counters::default();
        for (len, outcome) in &outcomes {
            one_by_one.get(*len, took, outcome);
        }
        let as_list = Counters::default();
        as_list.list(outcomes.iter().map(|(len, outcome)| (*len, outcome)), took);
        let (a, b) = (
            one_by_one.snapshot(RegistryStats::default()),
            as_list.snapshot(RegistryStats::default()),
        );
        assert_eq!(b, a);
        assert_eq!(b.gets, 2);
        assert_eq!(b.get_bytes, 4104);
        assert_eq!(b.get_latency.count, 4);
        assert_eq!(b.get_latency.sum, took * 4);
    }

    #[test]
    fn an_empty_list_counts_nothing() {
        let counters = Counters::default();
        counters.list([], Duration::from_micros(30));
        let m = counters.snapshot(RegistryStats::default());
        assert_eq!(m, Counters::default().snapshot(RegistryStats::default()));
    }

    #[test]
    fn budget_refusals_are_the_budget_exceeded_errors() {
        let counters = Counters::default();
        let refusal = RdmaError::BudgetExceeded {
            requested: 1,
            registered: 0,
            budget: 0,
        };
        counters.outcome::<()>(&Err(refusal.clone()));
        counters.outcome::<()>(&Err(refusal));
        counters.outcome::<()>(&Err(RdmaError::OutOfRange));
        counters.outcome(&Ok(()));
        let m = counters.snapshot(RegistryStats::default());
        assert_eq!(m.budget_refusals, 2);
        assert_eq!(m.errors_of(ErrorKind::OutOfRange), 1);
        assert_eq!(m.errors.len(), ErrorKind::ALL.len());
    }
}
