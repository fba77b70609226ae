//! Shared helpers of the integration tests: two engines on one provider.

#![allow(dead_code)] // Each test binary uses its own subset.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use rdmareg_backend::RdmaBackend;
use rdmareg_backend::conformance::{BackendPair, Capabilities};
use rdmareg_core::{Access, BackendGet, BackendPut, BackendRegion, PeerId, RdmaError};
use rdmareg_ofi::{OfiConfig, OfiEngine, Provider, ReadPath};

/// How the consumer engine names the owner engine.
pub const OWNER: PeerId = PeerId(1);

/// The seam's `unsafe` calls, made on memory that follows these tests'
/// discipline.
///
/// The discipline: every range a test maps is inside a buffer the test owns
/// (a `Vec<u8>` it neither grows nor drops while it is registered) or is
/// degenerate, which the engine refuses; the test keeps it until an unmap
/// of the registration answered `Ok` or the engine shut down. A test touches
/// a destination only once the GETs into it answered, and holds no
/// reference into it across a GET. Region ids a test names are its own
/// registrations, or ids that name nothing.
pub trait SeamForTestMemory: RdmaBackend {
    fn map_test_memory(
        &self,
        ptr: usize,
        len: usize,
    ) -> BoxFuture<'_, Result<BackendRegion, RdmaError>> {
        // SAFETY: by the discipline above, the range is a test buffer that
        // outlives its registration, or degenerate.
        unsafe { self.map(ptr, len) }
    }

    fn map_test_memory_with_access(
        &self,
        ptr: usize,
        len: usize,
        access: Access,
    ) -> BoxFuture<'_, Result<BackendRegion, RdmaError>> {
        // SAFETY: by the discipline above, the range is a test buffer that
        // outlives its registration, or degenerate; a writable one is read
        // only through raw copies once the writes into it answered.
        unsafe { self.map_with_access(ptr, len, access) }
    }

    fn put_from_test_memory(&self, request: BackendPut) -> BoxFuture<'_, Result<(), RdmaError>> {
        // SAFETY: by the discipline above, nothing writes the source until
        // the put answered.
        unsafe { self.put(request) }
    }

    fn put_batch_from_test_memory(
        &self,
        requests: Vec<BackendPut>,
    ) -> BoxFuture<'_, Vec<Result<(), RdmaError>>> {
        // SAFETY: as `put_from_test_memory`, for every request.
        unsafe { self.put_batch(requests) }
    }

    fn get_into_test_memory(&self, request: BackendGet) -> BoxFuture<'_, Result<(), RdmaError>> {
        // SAFETY: by the discipline above, nothing touches the destination
        // until the GET answered.
        unsafe { self.get(request) }
    }

    fn get_batch_into_test_memory(
        &self,
        requests: Vec<BackendGet>,
    ) -> BoxFuture<'_, Vec<Result<(), RdmaError>>> {
        // SAFETY: as `get_into_test_memory`, for every request.
        unsafe { self.get_batch(requests) }
    }
}

impl<B: RdmaBackend + ?Sized> SeamForTestMemory for B {}

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
    // refuses a key of a region it no longer holds, on both providers, and
    // serves descriptor leases.
    let path = provider.default_read_path();
    backend_pair_on(provider, path)
}

/// [`backend_pair`] on a chosen read path, declaring every capability (on
/// the one-sided path only the lease checks hold: a one-sided read may
/// outlive its region's unmap, so run only those there).
pub fn backend_pair_on(provider: Provider, path: ReadPath) -> BackendPair {
    // Writes are served on either path; the kit's write checks run on the
    // owner-served one (`conformance_tcp`, `conformance_shm`).
    let capabilities = Capabilities::full();
    let (owner, consumer) = engines_on(provider, path);
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
