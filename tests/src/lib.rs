//! Shared fixtures of rdmareg's workspace integration tests, which exercise
//! the registry over the real backends: UCX and libfabric.
//!
//! - [`lane`] — the backend and transport a scenario runs over, an engine
//!   of either backend, and [`lane_tests!`] to run one scenario body per
//!   lane.
//! - [`fixture`] — an owner and a consumer, each an engine with an
//!   [`RdmaRegistry`] over it, and the shutdown ordering they end with.
//! - [`external`] — caller-owned memory for `register_external`, freed only
//!   once the registry says it was released.
//! - [`pattern`] — position-dependent byte patterns and their checks.
//! - [`wait`] — bounded waits, so a hang fails a test instead of stalling it.
//! - [`isolated`](mod@isolated) — scenarios run in a child process, so a UCX
//!   abort fails one test instead of the whole binary.
//!
//! Every engine is started on the loopback interface
//! ([`UcxConfig::with_net_devices`]`("lo")`, the libfabric `lo` domain for
//! `tcp`), set through the engine's own configuration, never through the
//! process environment.
//!
//! [`RdmaRegistry`]: rdmareg_registry::RdmaRegistry
//! [`UcxConfig::with_net_devices`]: rdmareg_ucx::UcxConfig::with_net_devices

pub mod external;
pub mod fixture;
pub mod isolated;
pub mod lane;
pub mod pattern;
pub mod wait;

pub use external::ExternalMemory;
pub use fixture::{CONSUMER, OWNER, Pair, Side, engine_config, registry_config};
pub use isolated::isolated;
pub use lane::{Engine, EngineConfig, Lane, SCENARIO_LIMIT, ofi_engine_config};
pub use pattern::{assert_all, assert_same_bytes, expected, fill, patterned};
pub use wait::{eventually, within};

/// One kibibyte.
pub const KIB: usize = 1 << 10;
/// One mebibyte.
pub const MIB: usize = 1 << 20;

/// Send `tracing` output to the test harness when `RUST_LOG` is set.
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}
