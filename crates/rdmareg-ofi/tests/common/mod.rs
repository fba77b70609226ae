//! Shared helpers of the integration tests: two engines on one provider.

#![allow(dead_code)] // Each test binary uses its own subset.

use std::sync::Arc;
use std::time::Duration;

use rdmareg_backend::conformance::{BackendPair, Capabilities};
use rdmareg_core::PeerId;
use rdmareg_ofi::{OfiConfig, OfiEngine, Provider};

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
    init_tracing();
    let owner = OfiEngine::start(config(provider.clone())).expect("owner engine starts");
    let consumer = OfiEngine::start(config(provider)).expect("consumer engine starts");
    consumer
        .add_peer(OWNER, owner.fabric_address())
        .expect("consumer records the owner");
    (owner, consumer)
}

/// A conformance-kit pair; its teardown shuts both engines down and checks
/// they released everything.
pub fn backend_pair(provider: Provider) -> BackendPair {
    // Measured on libfabric 1.17: tcp;ofi_rxm refuses a read with the key of
    // a closed region (the owner's provider verifies every access), shm
    // serves it (`shm_serves_a_read_after_fi_close_of_the_owners_region` in
    // provider_facts.rs). On shm the consumer engine still checks every read
    // against the range an honest key describes.
    let capabilities = match provider {
        Provider::Shm => Capabilities::full().with_unknown_remote_key_detected(false),
        _ => Capabilities::full(),
    };
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
