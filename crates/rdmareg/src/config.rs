//! [`Config`]: what [`Rdma::start`](crate::Rdma::start) is told — the UCX
//! engine's settings and the registry's.

use std::time::Duration;

use rdmareg_registry::RdmaConfig;
use rdmareg_ucx::{Transport, UcxConfig};

/// The engine and the registry, configured together; the registry's GET
/// deadline ([`RdmaConfig::get_deadline`]) is handed to the engine too.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct Config {
    /// The UCX engine.
    pub ucx: UcxConfig,
    /// The registry: budget, pool, deadlines.
    pub registry: RdmaConfig,
}

impl Config {
    /// Defaults for both halves.
    pub fn new() -> Self {
        Self::default()
    }

    /// The UCX transport.
    pub fn with_transport(mut self, transport: Transport) -> Self {
        self.ucx = self.ucx.with_transport(transport);
        self
    }

    /// Restrict UCX to these network devices (`"lo"` keeps tests on the
    /// loopback interface).
    pub fn with_net_devices(mut self, devices: impl Into<String>) -> Self {
        self.ucx = self.ucx.with_net_devices(devices);
        self
    }

    /// Open (or not) the same-host direct-read lane, whatever the transport
    /// ([`UcxConfig::with_same_host_direct_reads`]; open by default on
    /// `Auto` and `SameHost`). Without it every read is served by the
    /// owner's engine (`docs/safety.md`).
    pub fn with_same_host_direct_reads(mut self, enabled: bool) -> Self {
        self.ucx = self.ucx.with_same_host_direct_reads(enabled);
        self
    }

    /// Let (or not) same-host peers write this side's writable
    /// registrations one-sided ([`UcxConfig::with_same_host_direct_writes`]).
    /// Closed, every PUT is served by the owner's engine, so its written log
    /// ([`RegionGuard::take_written`](rdmareg_registry::RegionGuard::take_written))
    /// is complete.
    pub fn with_same_host_direct_writes(mut self, enabled: bool) -> Self {
        self.ucx = self.ucx.with_same_host_direct_writes(enabled);
        self
    }

    /// Set one UCX configuration key (without the `UCX_` prefix), as
    /// [`UcxConfig::with_ucx_setting`]: `with_ucx_setting("LOG_LEVEL",
    /// "fatal")` keeps UCX's own error lines off standard output.
    pub fn with_ucx_setting(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.ucx = self.ucx.with_ucx_setting(key, value);
        self
    }

    /// The deadline of every GET ([`RdmaConfig::get_deadline`]).
    pub fn with_get_deadline(mut self, deadline: Duration) -> Self {
        self.registry = self.registry.with_get_deadline(deadline);
        self
    }

    /// The ceiling on registered bytes ([`RdmaConfig::budget_bytes`]).
    pub fn with_budget_bytes(mut self, bytes: u64) -> Self {
        self.registry = self.registry.with_budget_bytes(bytes);
        self
    }

    /// How long [`Rdma::shutdown`](crate::Rdma::shutdown) waits for
    /// deregistrations ([`RdmaConfig::shutdown_budget`]).
    pub fn with_shutdown_budget(mut self, budget: Duration) -> Self {
        self.registry = self.registry.with_shutdown_budget(budget);
        self
    }

    /// Replace the engine configuration, including what `with_transport`,
    /// `with_net_devices` and the other engine setters set before this
    /// call: call it first and chain those after it, or set everything on
    /// `ucx`.
    pub fn with_ucx(mut self, ucx: UcxConfig) -> Self {
        self.ucx = ucx;
        self
    }

    /// Replace the registry configuration, including what
    /// `with_get_deadline`, `with_budget_bytes` and `with_shutdown_budget`
    /// set before this call.
    pub fn with_registry(mut self, registry: RdmaConfig) -> Self {
        self.registry = registry;
        self
    }
}
