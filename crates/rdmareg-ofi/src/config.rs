//! [`OfiConfig`]: which provider, and the loop's timings.

use std::time::Duration;

/// Which libfabric provider the engine opens.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Provider {
    /// `tcp` with `ofi_rxm` layered on top for reliable-datagram endpoints.
    Tcp,
    /// `shm`, the same-host shared-memory provider.
    Shm,
    /// Any provider by its libfabric name (`efa`, `cxi`, `verbs;ofi_rxm` …):
    /// untested here.
    Named(String),
}

impl Provider {
    /// The name handed to `fi_getinfo` in the hints.
    pub fn name(&self) -> &str {
        match self {
            Provider::Tcp => "tcp;ofi_rxm",
            Provider::Shm => "shm",
            Provider::Named(name) => name,
        }
    }
}

/// How an engine's regions are read by its peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReadPath {
    /// The owner's engine serves each read over tagged messages, checking
    /// the key against its live registrations; an unmap completes only
    /// after the reads it serves from the region ended. The default on
    /// `tcp` and `shm`.
    OwnerServed,
    /// One-sided `fi_read` against the provider's memory keys, for
    /// providers with hardware RMA (`verbs`, `efa`, `cxi`): untested here.
    /// On `tcp` and `shm` this path lets a read in flight outlive the unmap
    /// of its region, and `shm` serves stale keys (see `docs/ofi.md`).
    /// Reads under a descriptor lease are owner-served on this path too
    /// (the owner posts request receives with its first lease), so a lease
    /// still ends them.
    OneSided,
}

impl Provider {
    /// The read path used unless the configuration names one: owner-served
    /// on the software providers, one-sided on any other.
    pub fn default_read_path(&self) -> ReadPath {
        match self {
            Provider::Tcp | Provider::Shm => ReadPath::OwnerServed,
            Provider::Named(_) => ReadPath::OneSided,
        }
    }
}

/// How to start an [`OfiEngine`](crate::OfiEngine).
#[derive(Debug, Clone)]
pub struct OfiConfig {
    /// The provider.
    pub provider: Provider,
    /// How peers read this engine's regions; `None` takes
    /// [`Provider::default_read_path`].
    pub read_path: Option<ReadPath>,
    /// The libfabric domain name to open (`lo` keeps tcp on loopback);
    /// `None` takes the provider's first.
    pub domain: Option<String>,
    /// Capacity of the bounded command ring.
    pub ring_capacity: usize,
    /// How long the loop keeps turning (yielding) after its last work before
    /// it parks.
    pub spin_window: Duration,
    /// The longest the loop sleeps between progress calls: how long a
    /// parked owner can leave a peer's read waiting when the completion
    /// queue has no wait descriptor (both tested providers progress only
    /// when called).
    pub park_timeout: Duration,
    /// The deadline of a GET that names none.
    pub default_get_deadline: Duration,
    /// How long teardown waits for GETs in flight before it closes the
    /// endpoint under them.
    pub teardown_timeout: Duration,
    /// Most replies this engine, as an owner on the served path, keeps
    /// unfinished for one consumer address; must be at least 1.
    ///
    /// Each holds a read lease and a send, so without a bound one consumer
    /// that never receives would grow the owner's memory and stall its
    /// unmaps. A valid read beyond it is refused as busy (a transient
    /// [`RdmaError::Backend`](rdmareg_core::RdmaError::Backend)); refusals
    /// not yet received are bounded by the same number, separately, and
    /// past it requests are dropped. Default 4096.
    pub max_served_replies_per_peer: u32,
    /// How long a message to a peer may stay unsendable, with nothing to or
    /// from that peer completing, before the peer is declared unreachable;
    /// must be positive.
    ///
    /// Its reads and queued replies then end, the reads with an
    /// [`RdmaError::Backend`](rdmareg_core::RdmaError::Backend) saying so.
    /// Over `tcp;ofi_rxm` a dead owner is noticed only this way: the engine
    /// probes an owner it waits on every 100 ms, and the probe cannot be
    /// sent. A stopped (not dead) peer keeps its connection; its reads end
    /// at their deadlines.
    pub unreachable_after: Duration,
    /// How many notices peers sent may wait for this engine's application,
    /// overall and per reader, and how many idle readers it remembers
    /// (`rdmareg_backend::notices::inbox`); notices past the bound are
    /// dropped and counted. Default:
    /// [`NoticeLimits::default`](rdmareg_backend::notices::NoticeLimits).
    pub notice_limits: rdmareg_backend::notices::NoticeLimits,
    /// The crate's tests shrink the owner's table of consumer addresses
    /// (`progress::MAX_SERVED_PEERS`) to reach its edges with a few peers.
    #[cfg(test)]
    pub(crate) served_peers_bound: Option<usize>,
}

impl Default for OfiConfig {
    fn default() -> Self {
        OfiConfig {
            provider: Provider::Tcp,
            read_path: None,
            domain: None,
            ring_capacity: 4096,
            spin_window: Duration::from_micros(50),
            park_timeout: Duration::from_millis(1),
            default_get_deadline: Duration::from_secs(30),
            teardown_timeout: Duration::from_secs(5),
            max_served_replies_per_peer: 4096,
            unreachable_after: Duration::from_secs(1),
            notice_limits: Default::default(),
            #[cfg(test)]
            served_peers_bound: None,
        }
    }
}

impl OfiConfig {
    /// The read path this configuration uses: [`read_path`](Self::read_path)
    /// if set, else the provider's default.
    pub fn effective_read_path(&self) -> ReadPath {
        self.read_path
            .unwrap_or_else(|| self.provider.default_read_path())
    }

    /// Choose the read path (both sides of a read must use the same one: a
    /// key of the other path is refused as [`InvalidKey`](rdmareg_core::RdmaError::InvalidKey)).
    pub fn with_read_path(mut self, path: ReadPath) -> Self {
        self.read_path = Some(path);
        self
    }

    /// The default configuration on `provider`.
    pub fn new(provider: Provider) -> Self {
        OfiConfig {
            provider,
            ..OfiConfig::default()
        }
    }

    /// Open the named libfabric domain (`lo` for tcp over loopback).
    pub fn with_domain(mut self, domain: impl Into<String>) -> Self {
        self.domain = Some(domain.into());
        self
    }

    /// Set [`default_get_deadline`](Self::default_get_deadline).
    pub fn with_default_get_deadline(mut self, deadline: Duration) -> Self {
        self.default_get_deadline = deadline;
        self
    }

    /// Set [`teardown_timeout`](Self::teardown_timeout).
    pub fn with_teardown_timeout(mut self, timeout: Duration) -> Self {
        self.teardown_timeout = timeout;
        self
    }

    /// Set [`park_timeout`](Self::park_timeout).
    pub fn with_park_timeout(mut self, timeout: Duration) -> Self {
        self.park_timeout = timeout;
        self
    }

    /// Set [`notice_limits`](Self::notice_limits).
    pub fn with_notice_limits(mut self, limits: rdmareg_backend::notices::NoticeLimits) -> Self {
        self.notice_limits = limits;
        self
    }

    /// Set [`unreachable_after`](Self::unreachable_after).
    pub fn with_unreachable_after(mut self, after: Duration) -> Self {
        self.unreachable_after = after;
        self
    }

    /// Set [`max_served_replies_per_peer`](Self::max_served_replies_per_peer).
    pub fn with_max_served_replies_per_peer(mut self, bound: u32) -> Self {
        self.max_served_replies_per_peer = bound;
        self
    }

    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.ring_capacity == 0 {
            return Err("ring_capacity must be at least 1".into());
        }
        if self.provider.name().is_empty() || self.provider.name().contains('\0') {
            return Err("the provider name is empty or holds a NUL".into());
        }
        if self.domain.as_deref().is_some_and(|d| d.contains('\0')) {
            return Err("the domain name holds a NUL".into());
        }
        if self.park_timeout.is_zero() {
            return Err("park_timeout must be positive".into());
        }
        if self.unreachable_after.is_zero() {
            return Err("unreachable_after must be positive".into());
        }
        if self.max_served_replies_per_peer == 0 {
            return Err(
                "max_served_replies_per_peer must be at least 1 (0 would refuse every read)".into(),
            );
        }
        Ok(())
    }
}
