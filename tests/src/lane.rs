//! The backends the integration suites run over, behind one type, so the
//! same scenario bodies run over every one of them.
//!
//! - [`Lane`] names a backend and its transport: UCX over tcp or same-host,
//!   libfabric over `tcp;ofi_rxm` or `shm`.
//! - [`EngineConfig`] is a lane's engine configuration, for a scenario
//!   that adjusts it before starting.
//! - [`Engine`] is a running engine of either backend: its backend for the
//!   registry, its address for peers, its own count of registrations and
//!   its teardown.
//!
//! The registry sees only `Arc<dyn RdmaBackend>`: nothing here reaches into
//! the registry crate, which knows no backend by name.
//!
//! A scenario is an `async fn(Lane)`; each test binary turns it into one
//! test per lane of its backend with [`lane_tests!`](crate::lane_tests).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rdmareg_backend::RdmaBackend;
use rdmareg_ofi::{OfiConfig, OfiEngine, Provider};
use rdmareg_registry::{PeerId, RdmaError};
use rdmareg_ucx::{Transport, UcxConfig, UcxEngine};

use crate::fixture::engine_config;

/// A backend and the transport (UCX) or provider (libfabric) it runs on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lane {
    /// `rdmareg-ucx` on a UCX transport.
    Ucx(Transport),
    /// `rdmareg-ofi` on a libfabric provider.
    Ofi(Provider),
}

impl From<Transport> for Lane {
    fn from(transport: Transport) -> Lane {
        Lane::Ucx(transport)
    }
}

impl From<Provider> for Lane {
    fn from(provider: Provider) -> Lane {
        Lane::Ofi(provider)
    }
}

impl Lane {
    /// The backend key descriptors of this lane carry.
    pub fn backend_key(&self) -> &'static str {
        match self {
            Lane::Ucx(_) => "ucx",
            Lane::Ofi(_) => "ofi",
        }
    }

    /// The test configuration of this lane's engine: loopback only, a
    /// two-second teardown timeout.
    pub fn engine_config(&self) -> EngineConfig {
        match self {
            Lane::Ucx(transport) => EngineConfig::Ucx(engine_config(transport.clone())),
            Lane::Ofi(provider) => EngineConfig::Ofi(ofi_engine_config(provider.clone())),
        }
    }

    /// [`Lane::engine_config`] with every write served by the owner's
    /// engine (UCX's same-host direct writes off), so the owner's written
    /// log sees each one.
    pub fn engine_config_serving_every_write(&self) -> EngineConfig {
        match self.engine_config() {
            EngineConfig::Ucx(config) => {
                EngineConfig::Ucx(config.with_same_host_direct_writes(false))
            }
            other => other,
        }
    }
}

/// A libfabric engine configuration for tests: `provider`, with tcp kept on
/// the loopback domain, and a short teardown timeout.
pub fn ofi_engine_config(provider: Provider) -> OfiConfig {
    let config = OfiConfig::new(provider.clone()).with_teardown_timeout(Duration::from_secs(2));
    match provider {
        Provider::Tcp => config.with_domain("lo"),
        _ => config,
    }
}

/// How to start an [`Engine`] of either backend.
#[derive(Debug, Clone)]
pub enum EngineConfig {
    /// A UCX engine.
    Ucx(UcxConfig),
    /// A libfabric engine.
    Ofi(OfiConfig),
}

impl From<UcxConfig> for EngineConfig {
    fn from(config: UcxConfig) -> EngineConfig {
        EngineConfig::Ucx(config)
    }
}

impl From<OfiConfig> for EngineConfig {
    fn from(config: OfiConfig) -> EngineConfig {
        EngineConfig::Ofi(config)
    }
}

impl From<Lane> for EngineConfig {
    fn from(lane: Lane) -> EngineConfig {
        lane.engine_config()
    }
}

impl From<Transport> for EngineConfig {
    fn from(transport: Transport) -> EngineConfig {
        Lane::from(transport).engine_config()
    }
}

impl From<Provider> for EngineConfig {
    fn from(provider: Provider) -> EngineConfig {
        Lane::from(provider).engine_config()
    }
}

/// A running engine of either backend.
#[derive(Debug)]
pub enum Engine {
    /// A UCX progress thread.
    Ucx(UcxEngine),
    /// A libfabric progress thread.
    Ofi(OfiEngine),
}

impl Engine {
    /// Start an engine from `config`.
    ///
    /// # Errors
    /// What the backend's engine answers when it cannot start.
    pub fn start(config: impl Into<EngineConfig>) -> Result<Engine, RdmaError> {
        Ok(match config.into() {
            EngineConfig::Ucx(config) => Engine::Ucx(UcxEngine::start(config)?),
            EngineConfig::Ofi(config) => Engine::Ofi(OfiEngine::start(config)?),
        })
    }

    /// The backend the registry is built over.
    pub fn backend(&self) -> Arc<dyn RdmaBackend> {
        match self {
            Engine::Ucx(engine) => engine.backend(),
            Engine::Ofi(engine) => Arc::new(engine.backend()),
        }
    }

    /// What a peer needs to reach this engine: the UCX worker address or the
    /// libfabric fabric address.
    pub fn address(&self) -> Bytes {
        match self {
            Engine::Ucx(engine) => engine.worker_address(),
            Engine::Ofi(engine) => engine.fabric_address(),
        }
    }

    /// Record how to reach `peer`.
    ///
    /// # Errors
    /// The engine's refusal of a malformed address, or `ShuttingDown`.
    pub fn add_peer(&self, peer: PeerId, address: Bytes) -> Result<(), RdmaError> {
        match self {
            Engine::Ucx(engine) => engine.add_peer(peer, address),
            Engine::Ofi(engine) => engine.add_peer(peer, address),
        }
    }

    /// Forget `peer`.
    ///
    /// # Errors
    /// `ShuttingDown` after teardown began.
    pub fn remove_peer(&self, peer: PeerId) -> Result<(), RdmaError> {
        match self {
            Engine::Ucx(engine) => engine.remove_peer(peer),
            Engine::Ofi(engine) => engine.remove_peer(peer),
        }
    }

    /// Registrations the engine's progress thread holds (its own count).
    pub fn live_registrations(&self) -> Option<usize> {
        match self {
            Engine::Ucx(engine) => engine.live_registrations(),
            Engine::Ofi(engine) => Some(engine.live_registrations()),
        }
    }

    /// Tear the engine down and wait for its thread.
    ///
    /// # Cancel safety
    /// Dropping the future does not stop the teardown.
    pub async fn shutdown(&self) {
        match self {
            Engine::Ucx(engine) => engine.shutdown().await,
            Engine::Ofi(engine) => engine.shutdown().await,
        }
    }
}

/// Longest any one scenario may run before it counts as hung. Scenarios
/// take well under two seconds on an idle two-core machine; the margin is
/// for machines shared with other builds.
pub const SCENARIO_LIMIT: Duration = Duration::from_secs(20);

/// Turns a scenario into one test per lane, in a module named after it.
///
/// `lane_tests!(name, test_a => lane_a, test_b => lane_b)` expects
/// `async fn name(lane: Lane)` in the calling module and makes
/// `name::test_a` and `name::test_b`, multi-threaded Tokio tests bounded by
/// [`SCENARIO_LIMIT`].
///
/// `lane_tests!(isolated name, ...)` expects `fn name(test_path: &str, lane:
/// Lane)`, which runs the scenario through
/// [`isolated`](crate::isolated::isolated) under `test_path`, and makes
/// plain `#[test]`s that pass it their own path.
///
/// Attributes written before a test's name (`#[ignore = "why"]`) go on
/// that test.
#[macro_export]
macro_rules! lane_tests {
    (isolated $scenario:ident, $($(#[$attr:meta])* $test:ident => $lane:expr),+ $(,)?) => {
        mod $scenario {
            $(
                #[test]
                $(#[$attr])*
                fn $test() {
                    super::$scenario(
                        concat!(module_path!(), "::", stringify!($test)),
                        $crate::Lane::from($lane),
                    );
                }
            )+
        }
    };
    ($scenario:ident, $($(#[$attr:meta])* $test:ident => $lane:expr),+ $(,)?) => {
        mod $scenario {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                $(#[$attr])*
                async fn $test() {
                    let lane = $crate::Lane::from($lane);
                    let what = format!("{} over {lane:?}", stringify!($scenario));
                    $crate::within($crate::SCENARIO_LIMIT, &what, super::$scenario(lane)).await;
                }
            )+
        }
    };
}
