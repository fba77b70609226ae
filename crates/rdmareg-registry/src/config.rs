//! Configuration of a registry ([`RdmaConfig`]) and of its pinned pool
//! ([`PoolConfig`]). Sizes are in bytes; [`RdmaConfig::validate`] refuses
//! at construction what the pool cannot honour.

use std::time::Duration;

/// Granularity of pool suballocation: every pinned buffer occupies a whole
/// number of 4 KiB granules.
pub const GRANULE: u64 = 4096;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Largest arena the granule allocator can index (`u32` granule numbers).
const MAX_ARENA_LIMIT: u64 = (u32::MAX as u64) * GRANULE;

/// Everything a [`RdmaRegistry`](crate::RdmaRegistry) can be told.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RdmaConfig {
    /// Ceiling on registered bytes (regions and arenas, page-enclosing):
    /// what `RLIMIT_MEMLOCK` and the NIC see. Past it a registration fails
    /// with [`RdmaError::BudgetExceeded`](rdmareg_core::RdmaError::BudgetExceeded).
    /// Default: 1 GiB.
    pub budget_bytes: u64,
    /// Page size registrations are charged by: a power of two, at least
    /// 4096 (the charge is reconciled to what the backend pinned). Default:
    /// 4096.
    pub page_size: u64,
    /// The shutdown budget a service passes to
    /// [`RdmaRegistry::shutdown`](crate::RdmaRegistry::shutdown) when it has
    /// no better figure. Default: 30 s.
    pub shutdown_budget: Duration,
    /// How long, in all, a background deregistration (a dropped guard or
    /// dedicated buffer, a reclaimed arena) waits for readers and the
    /// unmap. Default: 30 s.
    pub background_deregistration_budget: Duration,
    /// Deadline of every GET the registry issues, overriding any backend
    /// default (the `rdmareg` facade gives it to its engine too). Default:
    /// 30 s; must be positive.
    pub get_deadline: Duration,
    /// How long a GET or list post that is the only transfer in flight
    /// polls for completion before yielding, growing with its size up to
    /// 200 µs. Default: 20 µs; zero turns it off, which suits large reads
    /// on few CPUs. Why and when: `docs/operations.md` ("The GET busy poll").
    pub get_busy_poll: Duration,
    /// The pinned pool.
    pub pool: PoolConfig,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        Self {
            budget_bytes: GIB,
            page_size: 4096,
            shutdown_budget: Duration::from_secs(30),
            background_deregistration_budget: Duration::from_secs(30),
            get_deadline: Duration::from_secs(30),
            get_busy_poll: Duration::from_micros(20),
            pool: PoolConfig::default(),
        }
    }
}

/// Shape of the pinned pool: pooled arenas double from
/// [`first_arena_bytes`](Self::first_arena_bytes) up to
/// [`max_arena_bytes`](Self::max_arena_bytes); large requests get an arena
/// of their own, freed with the buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolConfig {
    /// Size of the first pooled arena. Default: 64 MiB. A multiple of
    /// [`GRANULE`].
    pub first_arena_bytes: u64,
    /// Size at which geometric growth stops. Default: 1 GiB. A multiple of
    /// [`GRANULE`], at least `first_arena_bytes`.
    pub max_arena_bytes: u64,
    /// Requests of this many bytes or more get a dedicated arena. Default:
    /// 64 MiB; at most `max_arena_bytes`.
    pub dedicated_threshold_bytes: u64,
    /// Whether a pooled arena left empty is unmapped and freed. Default:
    /// `false`, so a later burst does not pay for registration again.
    pub reclaim_empty_arenas: bool,
    /// With reclaim on, the pooled bytes below which empty arenas are kept.
    /// Default: 64 MiB (the first arena stays).
    pub retention_floor_bytes: u64,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            first_arena_bytes: 64 * MIB,
            max_arena_bytes: GIB,
            dedicated_threshold_bytes: 64 * MIB,
            reclaim_empty_arenas: false,
            retention_floor_bytes: 64 * MIB,
        }
    }
}

impl PoolConfig {
    /// Set [`first_arena_bytes`](Self::first_arena_bytes).
    pub fn with_first_arena_bytes(mut self, bytes: u64) -> Self {
        self.first_arena_bytes = bytes;
        self
    }

    /// Set [`max_arena_bytes`](Self::max_arena_bytes).
    pub fn with_max_arena_bytes(mut self, bytes: u64) -> Self {
        self.max_arena_bytes = bytes;
        self
    }

    /// Set [`dedicated_threshold_bytes`](Self::dedicated_threshold_bytes).
    pub fn with_dedicated_threshold_bytes(mut self, bytes: u64) -> Self {
        self.dedicated_threshold_bytes = bytes;
        self
    }

    /// Set [`reclaim_empty_arenas`](Self::reclaim_empty_arenas).
    pub fn with_reclaim_empty_arenas(mut self, reclaim: bool) -> Self {
        self.reclaim_empty_arenas = reclaim;
        self
    }

    /// Set [`retention_floor_bytes`](Self::retention_floor_bytes).
    pub fn with_retention_floor_bytes(mut self, bytes: u64) -> Self {
        self.retention_floor_bytes = bytes;
        self
    }
}

/// Why a configuration was refused.
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// The page size is not a power of two in 4096 ..= 1 GiB.
    #[error("page size {0} must be a power of two between 4096 and 1 GiB")]
    InvalidPageSize(u64),
    /// The arena sizes are zero, not granule multiples, out of order or too
    /// large for the allocator.
    #[error(
        "arena sizes must be non-zero multiples of {GRANULE} B with first ({first}) <= max ({max}) <= {MAX_ARENA_LIMIT}"
    )]
    InvalidArenaSize {
        /// The configured first arena size.
        first: u64,
        /// The configured maximum arena size.
        max: u64,
    },
    /// The dedicated threshold is zero or larger than the largest arena.
    #[error("dedicated-arena threshold {threshold} must be in 1..={max_arena}")]
    InvalidDedicatedThreshold {
        /// The configured threshold.
        threshold: u64,
        /// The configured maximum arena size.
        max_arena: u64,
    },
    /// The GET deadline is zero.
    #[error("the GET deadline must be positive")]
    ZeroGetDeadline,
}

impl RdmaConfig {
    /// Set [`budget_bytes`](Self::budget_bytes).
    pub fn with_budget_bytes(mut self, bytes: u64) -> Self {
        self.budget_bytes = bytes;
        self
    }

    /// Set [`page_size`](Self::page_size).
    pub fn with_page_size(mut self, bytes: u64) -> Self {
        self.page_size = bytes;
        self
    }

    /// Set [`shutdown_budget`](Self::shutdown_budget).
    pub fn with_shutdown_budget(mut self, budget: Duration) -> Self {
        self.shutdown_budget = budget;
        self
    }

    /// Set [`background_deregistration_budget`](Self::background_deregistration_budget).
    pub fn with_background_deregistration_budget(mut self, budget: Duration) -> Self {
        self.background_deregistration_budget = budget;
        self
    }

    /// Set [`get_deadline`](Self::get_deadline).
    pub fn with_get_deadline(mut self, deadline: Duration) -> Self {
        self.get_deadline = deadline;
        self
    }

    /// Set [`get_busy_poll`](Self::get_busy_poll).
    pub fn with_get_busy_poll(mut self, window: Duration) -> Self {
        self.get_busy_poll = window;
        self
    }

    /// Replace the [`pool`](Self::pool) configuration.
    pub fn with_pool(mut self, pool: PoolConfig) -> Self {
        self.pool = pool;
        self
    }

    /// Check that the pool can honour this configuration.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.get_deadline.is_zero() {
            return Err(ConfigError::ZeroGetDeadline);
        }
        if !self.page_size.is_power_of_two() || !(4096..=GIB).contains(&self.page_size) {
            return Err(ConfigError::InvalidPageSize(self.page_size));
        }
        let pool = &self.pool;
        let (first, max) = (pool.first_arena_bytes, pool.max_arena_bytes);
        if first == 0
            || first % GRANULE != 0
            || max % GRANULE != 0
            || first > max
            || max > MAX_ARENA_LIMIT
        {
            return Err(ConfigError::InvalidArenaSize { first, max });
        }
        let threshold = pool.dedicated_threshold_bytes;
        if threshold == 0 || threshold > max {
            return Err(ConfigError::InvalidDedicatedThreshold {
                threshold,
                max_arena: max,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_documented_figures() {
        let c = RdmaConfig::default();
        assert_eq!(c.budget_bytes, GIB);
        assert_eq!(c.shutdown_budget, Duration::from_secs(30));
        assert_eq!(c.background_deregistration_budget, Duration::from_secs(30));
        assert_eq!(c.pool.first_arena_bytes, 64 * MIB);
        assert_eq!(c.pool.max_arena_bytes, GIB);
        assert_eq!(c.pool.dedicated_threshold_bytes, 64 * MIB);
        assert!(!c.pool.reclaim_empty_arenas);
        assert_eq!(c.pool.retention_floor_bytes, 64 * MIB);
        assert_eq!(c.get_deadline, Duration::from_secs(30));
        assert_eq!(c.validate(), Ok(()));
    }

    #[test]
    fn builders_set_every_field_they_name() {
        let pool = PoolConfig::default()
            .with_first_arena_bytes(8 * MIB)
            .with_max_arena_bytes(256 * MIB)
            .with_dedicated_threshold_bytes(16 * MIB)
            .with_reclaim_empty_arenas(true)
            .with_retention_floor_bytes(32 * MIB);
        let c = RdmaConfig::default()
            .with_budget_bytes(3 * GIB)
            .with_page_size(8192)
            .with_shutdown_budget(Duration::from_secs(7))
            .with_background_deregistration_budget(Duration::from_secs(9))
            .with_get_deadline(Duration::from_millis(1500))
            .with_get_busy_poll(Duration::ZERO)
            .with_pool(pool.clone());
        assert_eq!(c.budget_bytes, 3 * GIB);
        assert_eq!(c.page_size, 8192);
        assert_eq!(c.shutdown_budget, Duration::from_secs(7));
        assert_eq!(c.background_deregistration_budget, Duration::from_secs(9));
        assert_eq!(c.get_deadline, Duration::from_millis(1500));
        assert_eq!(c.get_busy_poll, Duration::ZERO);
        assert_eq!(c.pool, pool);
        assert_eq!(c.pool.first_arena_bytes, 8 * MIB);
        assert_eq!(c.pool.max_arena_bytes, 256 * MIB);
        assert_eq!(c.pool.dedicated_threshold_bytes, 16 * MIB);
        assert!(c.pool.reclaim_empty_arenas);
        assert_eq!(c.pool.retention_floor_bytes, 32 * MIB);
        assert_eq!(c.validate(), Ok(()));
    }

    #[test]
    fn a_zero_get_deadline_is_refused_with_a_typed_error() {
        let c = RdmaConfig::default().with_get_deadline(Duration::ZERO);
        assert_eq!(c.validate(), Err(ConfigError::ZeroGetDeadline));
    }

    #[test]
    fn odd_page_sizes_are_refused() {
        for page in [0, 1000, 2048, 4097, 2 * GIB] {
            let c = RdmaConfig {
                page_size: page,
                ..RdmaConfig::default()
            };
            assert_eq!(c.validate(), Err(ConfigError::InvalidPageSize(page)));
        }
    }

    #[test]
    fn arena_sizes_out_of_order_or_unaligned_are_refused() {
        let mut c = RdmaConfig::default();
        c.pool.first_arena_bytes = 2 * GIB;
        assert!(matches!(
            c.validate(),
            Err(ConfigError::InvalidArenaSize { .. })
        ));
        c.pool.first_arena_bytes = 4095;
        assert!(matches!(
            c.validate(),
            Err(ConfigError::InvalidArenaSize { .. })
        ));
        c.pool.first_arena_bytes = 0;
        assert!(matches!(
            c.validate(),
            Err(ConfigError::InvalidArenaSize { .. })
        ));
    }

    #[test]
    fn dedicated_threshold_above_the_largest_arena_is_refused() {
        let mut c = RdmaConfig::default();
        c.pool.dedicated_threshold_bytes = 2 * GIB;
        assert!(matches!(
            c.validate(),
            Err(ConfigError::InvalidDedicatedThreshold { .. })
        ));
        c.pool.dedicated_threshold_bytes = 0;
        assert!(matches!(
            c.validate(),
            Err(ConfigError::InvalidDedicatedThreshold { .. })
        ));
    }
}
