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
    /// The owner's engine serves each read itself over tagged messages: it
    /// checks the key's region id, capability and range against its live
    /// registrations, and an unmap answers only after the reads it is
    /// serving from the region ended. The default on `tcp` and `shm`.
    OwnerServed,
    /// One-sided `fi_read` against the provider's memory keys, for
    /// providers with hardware RMA (`verbs`, `efa`, `cxi`): untested here.
    /// On `tcp` and `shm` this path lets a read in flight outlive the unmap
    /// of its region, and `shm` serves stale keys (see `docs/ofi.md`).
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
    /// The longest the loop sleeps between progress calls. Both tested
    /// providers progress data only when called (`FI_PROGRESS_MANUAL`), and
    /// a peer's read of this engine's memory is served by this loop, so this
    /// bounds how long a parked owner can leave a read waiting when the
    /// completion queue has no wait descriptor to wake it.
    pub park_timeout: Duration,
    /// The deadline of a GET that names none.
    pub default_get_deadline: Duration,
    /// How long teardown waits for GETs in flight before it closes the
    /// endpoint under them.
    pub teardown_timeout: Duration,
    /// Most replies this engine, as an owner on the owner-served path, keeps
    /// unfinished for one consumer address: reads it is sending whose bytes
    /// the consumer has not received yet. Each holds a read lease on its
    /// region (an unmap waits for it) and a send, so without a bound one
    /// consumer that asks and never receives grows the owner's memory and
    /// stalls its unmaps without limit. A valid read beyond it is refused
    /// as busy: the consumer's caller gets a transient
    /// [`RdmaError::Backend`](rdmareg_core::RdmaError::Backend) saying so.
    /// Refusals one address has not received are bounded by the same
    /// number, separately; past it its requests are dropped unanswered.
    /// The default, 4096, is four times the deepest window of this
    /// workspace's own consumers. Must be at least 1.
    pub max_served_replies_per_peer: u32,
    /// How long a message to a peer may stay unsendable (the provider
    /// answering "try again"), with nothing to or from that peer completing
    /// meanwhile, before the peer is declared unreachable: its
    /// reads in flight and queued end with an
    /// [`RdmaError::Backend`](rdmareg_core::RdmaError::Backend) that says
    /// so, and replies queued for it end (their leases with them). Over
    /// `tcp;ofi_rxm` a peer whose process died refuses every reconnection,
    /// and the provider reports nothing else: a posted receive learns
    /// nothing of the lost connection. While reads from a peer are in
    /// flight and nothing arrives from it, the engine sends it a small
    /// probe every 100 ms, so a dead owner is found within about this long
    /// plus the probe interval. A stopped (not dead) peer keeps its
    /// connection and is not declared unreachable; its reads end at their
    /// deadlines. Must be positive.
    pub unreachable_after: Duration,
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
