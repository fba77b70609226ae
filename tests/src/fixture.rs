//! An owner and a consumer in one process: each an [`Engine`] of one
//! [`Lane`] with an [`RdmaRegistry`] over its backend, the consumer's engine
//! knowing the owner's address (and the other way round).
//!
//! # Why both engines stay up until the end
//!
//! Over UCX tcp and over both libfabric providers the owner's progress
//! thread serves every GET, so a GET completes only while the *owner's*
//! engine runs. [`Pair::shut_down`] therefore takes the consumer down first
//! and the owner last.
//!
//! # The shutdown ordering
//!
//! [`Side::shut_down`] is the ordering the registry documents: registry
//! sweep, then engine teardown, then
//! [`SweptRegistry::finish_after_backend_teardown`](rdmareg_registry::SweptRegistry::finish_after_backend_teardown).

use std::time::Duration;

use rdmareg_registry::{PeerId, RdmaConfig, RdmaRegistry, ShutdownReport};
use rdmareg_ucx::{Transport, UcxConfig};

use crate::lane::{Engine, EngineConfig, Lane};
use crate::{KIB, MIB};

/// How the consumer's engine names the owner.
pub const OWNER: PeerId = PeerId(1);
/// How the owner's engine names the consumer.
pub const CONSUMER: PeerId = PeerId(2);

/// A UCX engine configuration for tests: `transport` on the loopback
/// interface only, with a short teardown timeout.
pub fn engine_config(transport: Transport) -> UcxConfig {
    UcxConfig::default()
        .with_transport(transport)
        .with_net_devices("lo")
        .with_teardown_timeout(Duration::from_secs(2))
}

/// A registry configuration sized for tests: 256 MiB budget, pooled arenas
/// from 4 MiB up to 64 MiB, dedicated arenas from 16 MiB, a five-second
/// background deregistration budget and a ten-second GET deadline.
pub fn registry_config() -> RdmaConfig {
    let mut config = RdmaConfig::default();
    config.budget_bytes = 256 * MIB as u64;
    config.pool.first_arena_bytes = 4 * MIB as u64;
    config.pool.max_arena_bytes = 64 * MIB as u64;
    config.pool.dedicated_threshold_bytes = 16 * MIB as u64;
    config.pool.retention_floor_bytes = 4 * MIB as u64;
    config.background_deregistration_budget = Duration::from_secs(5);
    config.get_deadline = Duration::from_secs(10);
    debug_assert_eq!(config.page_size, 4 * KIB as u64);
    config
}

/// One engine and the registry over it.
#[derive(Debug)]
pub struct Side {
    /// The progress thread's handle.
    pub engine: Engine,
    /// The registry over [`engine`](Self::engine)'s backend, spawning on the
    /// runtime current when the side was started.
    pub registry: RdmaRegistry,
}

impl Side {
    /// Start an engine of `lane` (a [`Lane`], or a UCX [`Transport`]) and a
    /// registry with `config` over it. Must be called inside a Tokio runtime
    /// with timers.
    pub fn start(lane: impl Into<Lane>, config: RdmaConfig) -> Side {
        Side::start_with(lane.into().engine_config(), config)
    }

    /// Start an engine from `engine` and a registry with `config` over it.
    pub fn start_with(engine: impl Into<EngineConfig>, config: RdmaConfig) -> Side {
        let engine = Engine::start(engine).expect("the engine starts");
        let registry =
            RdmaRegistry::new(engine.backend(), config, tokio::runtime::Handle::current())
                .expect("a valid registry configuration");
        Side { engine, registry }
    }

    /// Registrations the engine's progress thread holds (its own count).
    pub fn engine_live(&self) -> usize {
        // The engine always reports; a missing count reads as "not zero".
        self.engine.live_registrations().unwrap_or(usize::MAX)
    }

    /// The documented ordering: registry shutdown with `budget`, engine
    /// teardown, then the release of what the sweep could not confirm.
    /// Returns the release's report: what the sweep did and what the release
    /// decided.
    ///
    /// # Cancel safety
    /// Not meant to be cancelled: a cancelled call leaves the side half shut
    /// down (calling it again completes it).
    pub async fn shut_down(&self, budget: Duration) -> ShutdownReport {
        let swept = self.registry.shutdown(budget).await;
        self.engine.shutdown().await;
        swept.finish_after_backend_teardown()
    }
}

/// An owner and a consumer on the same lane.
#[derive(Debug)]
pub struct Pair {
    /// The side whose memory is read.
    pub owner: Side,
    /// The side that GETs; knows the owner as [`OWNER`].
    pub consumer: Side,
}

impl Pair {
    /// Start both sides on `lane` (a [`Lane`], or a UCX [`Transport`]) with
    /// `config`, and introduce them to each other.
    pub fn start(lane: impl Into<Lane>, config: RdmaConfig) -> Pair {
        Pair::start_with(lane.into().engine_config(), config)
    }

    /// Start both sides' engines from `engine` and their registries with
    /// `config`, and introduce them to each other.
    pub fn start_with(engine: impl Into<EngineConfig>, config: RdmaConfig) -> Pair {
        crate::init_tracing();
        let engine = engine.into();
        let owner = Side::start_with(engine.clone(), config.clone());
        let consumer = Side::start_with(engine, config);
        consumer
            .engine
            .add_peer(OWNER, owner.engine.address())
            .expect("the consumer records the owner");
        owner
            .engine
            .add_peer(CONSUMER, consumer.engine.address())
            .expect("the owner records the consumer");
        Pair { owner, consumer }
    }

    /// Shut the consumer down, then the owner (see the module docs), each in
    /// the documented order with `budget`; checks that both engines end with
    /// nothing registered and that both releases were granted. Returns the
    /// consumer's and the owner's reports, in that order.
    ///
    /// # Cancel safety
    /// As [`Side::shut_down`].
    pub async fn shut_down(&self, budget: Duration) -> [ShutdownReport; 2] {
        let consumer = self.consumer.shut_down(budget).await;
        let owner = self.owner.shut_down(budget).await;
        for (side, report, live) in [
            ("consumer", &consumer, self.consumer.engine_live()),
            ("owner", &owner, self.owner.engine_live()),
        ] {
            assert_eq!(live, 0, "{side} engine still holds registrations");
            assert!(
                report.released && report.backend_live == Some(0),
                "{side} release after teardown: {report:?}"
            );
        }
        [consumer, owner]
    }
}
