//! Shared helpers of the integration tests: two engines on one provider.

#![allow(dead_code)] // Each test binary uses its own subset.

use std::sync::Arc;
use std::time::Duration;

use rdmareg_backend::conformance::{BackendPair, Capabilities};
use rdmareg_core::PeerId;
use rdmareg_ofi::{OfiConfig, OfiEngine, Provider, ReadPath};

/// How the consumer engine names the owner engine.
pub const OWNER: PeerId = PeerId(1);

/// Logs to the test output when `RUST_LOG` is set.
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// A test configuration: tcp stays on the loopback domain.
pub fn config(provider: Provider) -> OfiConfig {
    let config = OfiConfig::new(provider.clone()).with_teardown_timeout(Duration::from_secs(2));
    match provider {
        Provider::Tcp => config.with_domain("lo"),
        _ => config,
    }
}

/// An owner and a consumer engine; the consumer knows the owner as [`OWNER`].
pub fn engines(provider: Provider) -> (OfiEngine, OfiEngine) {
    let path = provider.default_read_path();
    engines_on(provider, path)
}

/// [`engines`] on a chosen read path.
pub fn engines_on(provider: Provider, path: ReadPath) -> (OfiEngine, OfiEngine) {
    init_tracing();
    let config = config(provider).with_read_path(path);
    let owner = OfiEngine::start(config.clone()).expect("owner engine starts");
    let consumer = OfiEngine::start(config).expect("consumer engine starts");
    consumer
        .add_peer(OWNER, owner.fabric_address())
        .expect("consumer records the owner");
    (owner, consumer)
}

/// A conformance-kit pair; its teardown shuts both engines down and checks
/// they released everything.
pub fn backend_pair(provider: Provider) -> BackendPair {
    // Owner-served reads (the default on tcp and shm): the owner's engine
    // refuses a key of a region it no longer holds, on both providers.
    let capabilities = Capabilities::full();
    let (owner, consumer) = engines(provider);
    let pair = BackendPair::new(
        Arc::new(owner.backend()),
        Arc::new(consumer.backend()),
        OWNER,
    )
    .with_capabilities(capabilities);
    pair.with_teardown(async move {
        consumer.shutdown().await;
        owner.shutdown().await;
        assert_eq!(
            consumer.live_registrations(),
            0,
            "consumer released everything"
        );
        assert_eq!(owner.live_registrations(), 0, "owner released everything");
    })
}
