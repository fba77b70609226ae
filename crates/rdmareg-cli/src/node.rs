//! One side of a demo or benchmark: a UCX engine, a registry over it, and
//! the shutdown in the order the lifecycle requires (registry sweep → engine
//! teardown → release of survivors only on the backend's word).

use std::sync::Arc;

use anyhow::Context as _;
use rdmareg_registry::{RdmaConfig, RdmaRegistry, TeardownVerdict};
use rdmareg_ucx::{Transport, UcxConfig, UcxEngine};

use crate::cli::TransportArg;
use crate::control::Bounds;

/// An engine and the registry over it.
pub struct Node {
    /// The UCX progress thread.
    pub engine: UcxEngine,
    /// The registry over the engine's backend.
    pub registry: RdmaRegistry,
    /// The GET deadline and teardown bound it runs with.
    pub bounds: Bounds,
}

/// What shutting a node down established.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShutdownOutcome {
    /// Registrations the backend reports after its teardown.
    pub live_registrations: usize,
    /// Whether every registration was released in order (sweep confirmed, or
    /// survivors released on the backend's `Some(0)`).
    pub clean: bool,
}

impl Node {
    /// Start an engine on `transport` and a registry over it. Every GET
    /// carries `bounds.get_deadline`; the engine's teardown and the
    /// registry's sweep are each bounded by `bounds.teardown`.
    pub fn start(
        transport: TransportArg,
        net_devices: Option<&str>,
        registry_config: RdmaConfig,
        bounds: Bounds,
    ) -> anyhow::Result<Node> {
        let mut config = UcxConfig::default()
            .with_transport(match transport {
                TransportArg::Tcp => Transport::Tcp,
                TransportArg::Shm | TransportArg::ShmServed => Transport::SameHost,
            })
            .with_default_get_deadline(bounds.get_deadline)
            .with_teardown_timeout(bounds.teardown);
        if transport == TransportArg::ShmServed {
            config = config.with_same_host_direct_reads(false);
        }
        if let Some(devices) = net_devices {
            config = config.with_net_devices(devices);
        }
        let engine = UcxEngine::start(config).context("starting the UCX engine")?;
        let registry = RdmaRegistry::new(
            engine.backend() as Arc<dyn rdmareg_backend::RdmaBackend>,
            registry_config.with_get_deadline(bounds.get_deadline),
            tokio::runtime::Handle::current(),
        )
        .context("creating the registry")?;
        Ok(Node {
            engine,
            registry,
            bounds,
        })
    }

    /// Sweep the registry, tear the engine down, then release survivors if
    /// the backend reports nothing registered. The sweep's drain and its
    /// unmaps, and the engine's teardown, are each bounded by the teardown
    /// bound.
    pub async fn shutdown(self) -> ShutdownOutcome {
        let swept = self.registry.shutdown(self.bounds.teardown).await;
        let report = swept.report().clone();
        self.engine.shutdown().await;
        let verdict = swept.finish_after_backend_teardown();
        // The engine always reports its count; a missing one reads as
        // "not zero", never as clean.
        let live_registrations = self.engine.live_registrations().unwrap_or(usize::MAX);
        let clean = report.drained
            && live_registrations == 0
            && matches!(verdict, TeardownVerdict::Released { .. });
        if !clean {
            tracing::error!(?report, ?verdict, live_registrations, "unclean shutdown");
        }
        ShutdownOutcome {
            live_registrations,
            clean,
        }
    }
}

/// The registry configuration for a run that needs `bytes` registered at
/// once, with headroom.
pub fn registry_config_for(bytes: u64) -> RdmaConfig {
    let mut config = RdmaConfig::default();
    config.budget_bytes = config.budget_bytes.max(bytes.saturating_mul(2));
    config
}

/// Whether `address` (host or host:port) names the loopback interface, in
/// which case UCX is kept on `lo`.
pub fn is_loopback(address: &str) -> bool {
    let host = address.rsplit_once(':').map_or(address, |(host, _)| host);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_addresses_are_recognised() {
        assert!(is_loopback("127.0.0.1:7000"));
        assert!(is_loopback("localhost:1"));
        assert!(is_loopback("[::1]:5"));
        assert!(!is_loopback("10.1.2.3:7000"));
        assert!(!is_loopback("owner-host:7000"));
    }
}
