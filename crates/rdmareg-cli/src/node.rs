//! One side of a demo or benchmark: an engine (UCX or libfabric), a
//! registry over it, and the ordered shutdown.

use std::sync::Arc;

use anyhow::Context as _;
use bytes::Bytes;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{PeerId, RdmaError};
use rdmareg_ofi::{OfiConfig, OfiEngine, Provider};
use rdmareg_registry::{RdmaConfig, RdmaRegistry};
use rdmareg_ucx::{Transport, UcxConfig, UcxEngine};

use crate::cli::TransportArg;
use crate::control::Bounds;

/// A progress-thread engine of either backend.
pub enum Engine {
    /// `rdmareg-ucx`.
    Ucx(UcxEngine),
    /// `rdmareg-ofi`.
    Ofi(OfiEngine),
}

impl Engine {
    /// The backend the registry is built over.
    pub fn backend(&self) -> Arc<dyn RdmaBackend> {
        match self {
            Engine::Ucx(engine) => engine.backend(),
            Engine::Ofi(engine) => Arc::new(engine.backend()),
        }
    }

    /// What a peer needs to reach this engine (the bootstrap's
    /// `worker_address`).
    pub fn worker_address(&self) -> Bytes {
        match self {
            Engine::Ucx(engine) => engine.worker_address(),
            Engine::Ofi(engine) => engine.fabric_address(),
        }
    }

    /// Record how to reach `peer`.
    pub fn add_peer(&self, peer: PeerId, address: Bytes) -> Result<(), RdmaError> {
        match self {
            Engine::Ucx(engine) => engine.add_peer(peer, address),
            Engine::Ofi(engine) => engine.add_peer(peer, address),
        }
    }

    /// Forget `peer`.
    pub fn remove_peer(&self, peer: PeerId) -> Result<(), RdmaError> {
        match self {
            Engine::Ucx(engine) => engine.remove_peer(peer),
            Engine::Ofi(engine) => engine.remove_peer(peer),
        }
    }

    /// The engine's own count of registrations it holds.
    pub fn live_registrations(&self) -> Option<usize> {
        match self {
            Engine::Ucx(engine) => engine.live_registrations(),
            Engine::Ofi(engine) => Some(engine.live_registrations()),
        }
    }

    /// Tear the engine down and wait for its thread.
    pub async fn shutdown(&self) {
        match self {
            Engine::Ucx(engine) => engine.shutdown().await,
            Engine::Ofi(engine) => engine.shutdown().await,
        }
    }

    /// Start the engine of `transport`. `net_devices` is UCX's device list,
    /// or, on libfabric tcp, the domain (interface) to open.
    fn start(
        transport: TransportArg,
        net_devices: Option<&str>,
        bounds: Bounds,
    ) -> anyhow::Result<Engine> {
        let provider = match transport {
            TransportArg::OfiTcp => Some(Provider::Tcp),
            TransportArg::OfiShm => Some(Provider::Shm),
            TransportArg::Tcp | TransportArg::Shm | TransportArg::ShmServed => None,
        };
        if let Some(provider) = provider {
            let mut config = OfiConfig::new(provider.clone())
                .with_default_get_deadline(bounds.get_deadline)
                .with_teardown_timeout(bounds.teardown);
            if provider == Provider::Tcp {
                if let Some(device) = net_devices.and_then(|d| d.split(',').next()) {
                    config = config.with_domain(device);
                }
            }
            let engine = OfiEngine::start(config).context("starting the libfabric engine")?;
            return Ok(Engine::Ofi(engine));
        }
        let mut config = UcxConfig::default()
            .with_transport(match transport {
                TransportArg::Tcp => Transport::Tcp,
                _ => Transport::SameHost,
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
        Ok(Engine::Ucx(engine))
    }
}

/// An engine and the registry over it.
pub struct Node {
    /// The progress thread.
    pub engine: Engine,
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
    /// Whether every registration was released in order.
    pub clean: bool,
}

impl Node {
    /// Start an engine on `transport` and a registry over it, with
    /// `bounds` on every GET and teardown step.
    pub fn start(
        transport: TransportArg,
        net_devices: Option<&str>,
        registry_config: RdmaConfig,
        bounds: Bounds,
    ) -> anyhow::Result<Node> {
        let engine = Engine::start(transport, net_devices, bounds)?;
        let registry = RdmaRegistry::new(
            engine.backend(),
            registry_config.with_get_deadline(bounds.get_deadline),
            tokio::runtime::Handle::current(),
        )
        .context("creating the registry")?;
        crate::metrics::publish(&registry);
        Ok(Node {
            engine,
            registry,
            bounds,
        })
    }

    /// Sweep the registry, tear the engine down, then release survivors if
    /// the backend reports nothing registered; each step bounded.
    pub async fn shutdown(self) -> ShutdownOutcome {
        let swept = self.registry.shutdown(self.bounds.teardown).await;
        self.engine.shutdown().await;
        let report = swept.finish_after_backend_teardown();
        // The engine always reports its count; a missing one reads as
        // "not zero", never as clean.
        let live_registrations = self.engine.live_registrations().unwrap_or(usize::MAX);
        let clean = report.drained && live_registrations == 0 && report.released;
        if !clean {
            tracing::error!(?report, live_registrations, "unclean shutdown");
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
