//! [`RegistryStats`]: a snapshot of what the registry holds.
//!
//! Figures are read one after another, so under load they may disagree by
//! the operations in progress.

use std::sync::atomic::Ordering;

use crate::registry::Inner;

/// A snapshot of a registry's holdings.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct RegistryStats {
    /// Bytes charged against the budget (page-rounded, reconciled).
    pub registered_bytes: u64,
    /// The budget's ceiling.
    pub budget_bytes: u64,
    /// Regions not yet released (including failed deregistrations).
    pub live_regions: usize,
    /// Pooled arenas still registered.
    pub pooled_arenas: usize,
    /// Total size of those pooled arenas.
    pub pooled_arena_bytes: u64,
    /// Dedicated arenas still registered.
    pub dedicated_arenas: usize,
    /// Total size of those dedicated arenas.
    pub dedicated_arena_bytes: u64,
    /// Pool buffers alive (held by the application or a transfer).
    pub live_allocations: usize,
    /// Bytes of those arenas carved into live buffers (whole granules).
    pub pool_bytes_in_use: u64,
    /// GETs admitted and not yet completed by the backend.
    pub transfers_in_flight: usize,
    /// Cancelled registrations still being rolled back.
    pub map_rollbacks_in_flight: usize,
    /// Bytes of arena pages and owned buffers leaked because their unmap
    /// was never confirmed.
    pub leaked_bytes: u64,
    /// Lent buffers' own registrations not yet confirmed unmapped.
    pub lent_registrations: usize,
}

impl RegistryStats {
    pub(crate) fn collect(inner: &Inner) -> Self {
        let mut stats = RegistryStats {
            registered_bytes: inner.budget.used(),
            budget_bytes: inner.budget.limit(),
            transfers_in_flight: inner.transfers_in_flight.load(Ordering::SeqCst),
            leaked_bytes: inner.leaked_bytes.load(Ordering::SeqCst),
            map_rollbacks_in_flight: *inner.map_rollbacks.borrow(),
            lent_registrations: inner.lent_registrations.load(Ordering::SeqCst),
            ..RegistryStats::default()
        };
        let tables = inner.tables.lock();
        stats.live_regions = tables.regions.len();
        for arena in tables.arenas.values() {
            if arena.is_pooled() {
                stats.pooled_arenas += 1;
                stats.pooled_arena_bytes += arena.len();
            } else {
                stats.dedicated_arenas += 1;
                stats.dedicated_arena_bytes += arena.len();
            }
            stats.live_allocations += arena.live_allocations();
            stats.pool_bytes_in_use += arena.bytes_in_use();
        }
        drop(tables);
        stats
    }
}
