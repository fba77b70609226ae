//! Fixtures shared by the registry's integration tests: registries over
//! loopback instances on one fabric, caller-owned memory for external
//! regions, polling helpers and log capture.

use std::alloc::Layout;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use rdmareg_backend::RdmaBackend;
use rdmareg_backend::loopback::{LoopbackBackend, LoopbackFabric, page_size};
use rdmareg_registry::{PeerId, RdmaConfig, RdmaRegistry};

pub const OWNER: PeerId = PeerId(1);
pub const CONSUMER: PeerId = PeerId(2);

pub const KIB: usize = 1024;

/// The machine page size, as the loopback rounds registrations.
pub fn page() -> usize {
    page_size() as usize
}

/// A small configuration: 1 MiB budget, arenas 64 KiB → 256 KiB, dedicated
/// arenas from 128 KiB, five-second background budget.
pub fn small_config() -> RdmaConfig {
    let mut config = RdmaConfig::default();
    config.budget_bytes = 1 << 20;
    config.page_size = page() as u64;
    config.pool.first_arena_bytes = 64 * KIB as u64;
    config.pool.max_arena_bytes = 256 * KIB as u64;
    config.pool.dedicated_threshold_bytes = 128 * KIB as u64;
    config.pool.retention_floor_bytes = 64 * KIB as u64;
    config.background_deregistration_budget = Duration::from_secs(5);
    config
}

/// A registry over a loopback instance whose tasks run on a runtime of
/// their own (the second one returned), apart from the caller's runtime (the
/// first): a test can shut the registry's runtime down under it.
pub fn registry_on_its_own_runtime() -> (
    tokio::runtime::Runtime,
    tokio::runtime::Runtime,
    Arc<LoopbackBackend>,
    RdmaRegistry,
) {
    let runtime = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    };
    let (caller, registry_runtime) = (runtime(), runtime());
    let fabric = LoopbackFabric::new();
    let backend = fabric.backend(OWNER);
    let registry = RdmaRegistry::new(
        Arc::clone(&backend) as Arc<dyn RdmaBackend>,
        small_config(),
        registry_runtime.handle().clone(),
    )
    .expect("valid configuration");
    (caller, registry_runtime, backend, registry)
}

/// One loopback instance and the registry over it.
pub struct Side {
    pub backend: Arc<LoopbackBackend>,
    pub registry: RdmaRegistry,
}

impl Side {
    pub fn new(fabric: &LoopbackFabric, id: PeerId, config: RdmaConfig) -> Self {
        let backend = fabric.backend(id);
        let registry = RdmaRegistry::new(
            Arc::clone(&backend) as Arc<dyn RdmaBackend>,
            config,
            tokio::runtime::Handle::current(),
        )
        .expect("valid configuration");
        Side { backend, registry }
    }

    /// Registrations the backend itself still holds.
    pub fn live(&self) -> usize {
        self.backend
            .live_registrations()
            .expect("loopback reports its count")
    }

    pub fn registered_bytes(&self) -> u64 {
        self.registry.stats().registered_bytes
    }
}

/// An owner side and a consumer side on one fabric.
pub fn two_sides(config: RdmaConfig) -> (LoopbackFabric, Side, Side) {
    let fabric = LoopbackFabric::new();
    let owner = Side::new(&fabric, OWNER, config.clone());
    let consumer = Side::new(&fabric, CONSUMER, config);
    (fabric, owner, consumer)
}

/// One side alone.
pub fn one_side(config: RdmaConfig) -> (LoopbackFabric, Side) {
    let fabric = LoopbackFabric::new();
    let side = Side::new(&fabric, OWNER, config);
    (fabric, side)
}

/// Bytes `seed, seed + 1, ...` (wrapping).
pub fn pattern(len: usize, seed: u8) -> Box<[u8]> {
    (0..len)
        .map(|i| seed.wrapping_add(i as u8))
        .collect::<Vec<u8>>()
        .into_boxed_slice()
}

/// Page-aligned memory the test owns, for external registrations. It is only
/// ever touched through raw pointers while registered.
pub struct External {
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: External is a uniquely owned heap allocation addressed by a raw
// pointer; nothing about it is tied to a thread.
unsafe impl Send for External {}

impl External {
    /// `len` bytes holding `pattern(len, seed)`.
    pub fn new(len: usize, seed: u8) -> Self {
        let layout = Layout::from_size_align(len, page()).expect("valid layout");
        // SAFETY: the layout has a non-zero size (tests pass len > 0).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "allocation failed");
        let bytes = pattern(len, seed);
        // SAFETY: `ptr` is a fresh allocation of `len` bytes, distinct from
        // `bytes`.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr, len) };
        External { ptr, layout }
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.layout.size()
    }
}

impl Drop for External {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout; tests drop an External
        // only after every registration of it was released.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

/// Poll `condition` every millisecond (of the test clock) until it holds;
/// fail after ten thousand tries.
pub async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    for _ in 0..10_000 {
        if condition() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("never happened: {what}");
}

/// Await `future`, failing the test if it takes longer than `limit`.
pub async fn within<F: std::future::Future>(limit: Duration, what: &str, future: F) -> F::Output {
    tokio::time::timeout(limit, future)
        .await
        .unwrap_or_else(|_| panic!("did not finish within {limit:?}: {what}"))
}

/// Log output of the current thread from the moment of
/// [`capture`](Self::capture).
///
/// One process-wide subscriber writes each event into a buffer of the thread
/// that emitted it. (A per-test scoped subscriber would race with other
/// tests over tracing's cached callsite interest and miss events.)
/// `current_thread` runtimes run spawned tasks on the test's thread, so
/// their events land there too.
pub struct Logs;

thread_local! {
    static THREAD_LOG: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Logs {
    pub fn capture() -> Self {
        static INSTALL: std::sync::Once = std::sync::Once::new();
        INSTALL.call_once(|| {
            let subscriber = tracing_subscriber::fmt()
                .with_max_level(tracing::Level::WARN)
                .with_ansi(false)
                .with_writer(|| ThreadWriter)
                .finish();
            tracing::subscriber::set_global_default(subscriber)
                .expect("no other global subscriber in this test binary");
        });
        THREAD_LOG.with(|log| log.borrow_mut().clear());
        Logs
    }

    pub fn text(&self) -> String {
        THREAD_LOG.with(|log| String::from_utf8_lossy(&log.borrow()).into_owned())
    }
}

struct ThreadWriter;

impl io::Write for ThreadWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        THREAD_LOG.with(|log| log.borrow_mut().extend_from_slice(buf));
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The documented shutdown order for one side: sweep the registry, tear the
/// backend down, release what the sweep could not; asserts everything was
/// released (so nothing is left registered when the test ends).
pub async fn shut_down(side: &Side) {
    let swept = side.registry.shutdown(Duration::from_secs(5)).await;
    side.backend.shutdown().await;
    let report = swept.finish_after_backend_teardown();
    assert!(report.released, "{report:?}");
}
