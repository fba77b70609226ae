//! A cancelled registration frees its memory only once the backend's
//! rollback is confirmed.
//!
//! The loopback backend runs with detached maps: like UCX's progress thread,
//! a map that was submitted registers even after its future is dropped, and
//! is rolled back by an unmap of its own, which an unmap hang gate holds
//! open. A global allocator records when the watched memory is freed, so the
//! test sees the moment the registry lets it go — and checks that the
//! backend's own live count is back to zero by then.
//!
//! Its own test binary, because it installs a global allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use rdmareg_backend::RdmaBackend;
use rdmareg_backend::loopback::{FaultOp, LoopbackBackend, LoopbackFabric};
use rdmareg_registry::{PeerId, RdmaConfig, RdmaRegistry};

/// The system allocator, noting when the watched address or an allocation of
/// the watched size is freed.
struct WatchingAllocator;

static WATCHED_ADDR: AtomicUsize = AtomicUsize::new(0);
static WATCHED_ADDR_FREED: AtomicBool = AtomicBool::new(false);
static WATCHED_SIZE: AtomicUsize = AtomicUsize::new(0);
static WATCHED_SIZE_FREES: AtomicUsize = AtomicUsize::new(0);

fn note_free(ptr: *mut u8, layout: Layout) {
    if ptr as usize == WATCHED_ADDR.load(Ordering::SeqCst) {
        WATCHED_ADDR_FREED.store(true, Ordering::SeqCst);
    }
    if layout.size() == WATCHED_SIZE.load(Ordering::SeqCst) {
        WATCHED_SIZE_FREES.fetch_add(1, Ordering::SeqCst);
    }
}

// SAFETY: every call is forwarded unchanged to `System`, which upholds the
// `GlobalAlloc` contract; the bookkeeping only touches atomics and never
// allocates.
unsafe impl GlobalAlloc for WatchingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        note_free(ptr, layout);
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note_free(ptr, layout);
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: WatchingAllocator = WatchingAllocator;

/// Both tests watch process-wide statics: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A registry over a loopback instance whose maps run detached.
fn detached_side() -> (LoopbackFabric, Arc<LoopbackBackend>, RdmaRegistry) {
    let fabric = LoopbackFabric::new();
    let backend = fabric.backend(PeerId(1));
    backend.faults().detach_maps(true);
    let mut config = RdmaConfig::default();
    config.budget_bytes = 64 << 20;
    config.pool.first_arena_bytes = ARENA_BYTES;
    config.pool.max_arena_bytes = ARENA_BYTES;
    config.pool.retention_floor_bytes = ARENA_BYTES;
    config.pool.dedicated_threshold_bytes = 1 << 20;
    let registry = RdmaRegistry::new(
        Arc::clone(&backend) as Arc<dyn RdmaBackend>,
        config,
        tokio::runtime::Handle::current(),
    )
    .expect("valid configuration");
    (fabric, backend, registry)
}

/// An arena size no other allocation of these tests has.
const ARENA_BYTES: u64 = 3 << 20;

fn live(backend: &LoopbackBackend) -> usize {
    backend.live_registrations().expect("loopback counts")
}

/// Wait (up to five seconds) until `freed` holds, asserting that the backend
/// holds no registration by then.
async fn until_freed(what: &str, backend: &LoopbackBackend, freed: impl Fn() -> bool) {
    for _ in 0..5_000 {
        if freed() {
            assert_eq!(
                live(backend),
                0,
                "memory freed while the backend still holds a registration"
            );
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("never happened: {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_owned_registration_frees_its_buffer_only_after_the_rollback_is_confirmed() {
    let _serial = SERIAL.lock().await;
    let (_fabric, backend, registry) = detached_side();
    let map_gate = backend.faults().hang(FaultOp::Map);
    let unmap_gate = backend.faults().hang(FaultOp::Unmap);

    let buffer = vec![7u8; 64 << 10].into_boxed_slice();
    WATCHED_ADDR.store(buffer.as_ptr() as usize, Ordering::SeqCst);
    WATCHED_ADDR_FREED.store(false, Ordering::SeqCst);
    let freed = || WATCHED_ADDR_FREED.load(Ordering::SeqCst);
    {
        let mut register = pin!(registry.register_owned(buffer));
        tokio::select! {
            biased;
            _ = &mut register => panic!("the map is held at its gate"),
            () = map_gate.until_waiting(1) => {}
        }
        // The registration is given up while the backend is mapping.
    }
    assert!(
        !freed(),
        "the buffer was freed the moment its registration was cancelled, while the backend was still mapping it"
    );

    // The map lands; its rollback is held at the unmap gate.
    map_gate.release();
    unmap_gate.until_waiting(1).await;
    assert_eq!(live(&backend), 1, "the cancelled map registered");
    assert!(!freed(), "the buffer was freed while still registered");
    assert_eq!(registry.stats().map_rollbacks_in_flight, 1);

    unmap_gate.release();
    until_freed("the buffer is freed", &backend, freed).await;
    assert_eq!(live(&backend), 0);
    tokio::time::timeout(Duration::from_secs(5), registry.map_rollbacks_settled())
        .await
        .expect("rollbacks settle");
    assert_eq!(registry.stats().registered_bytes, 0);
    assert_eq!(registry.stats().leaked_bytes, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_arena_map_frees_its_pages_only_after_the_rollback_is_confirmed() {
    let _serial = SERIAL.lock().await;
    let (_fabric, backend, registry) = detached_side();
    let map_gate = backend.faults().hang(FaultOp::Map);
    let unmap_gate = backend.faults().hang(FaultOp::Unmap);
    WATCHED_SIZE.store(ARENA_BYTES as usize, Ordering::SeqCst);
    let frees_before = WATCHED_SIZE_FREES.load(Ordering::SeqCst);
    let freed = || WATCHED_SIZE_FREES.load(Ordering::SeqCst) > frees_before;
    {
        let mut alloc = pin!(registry.alloc_pinned(4096));
        tokio::select! {
            biased;
            _ = &mut alloc => panic!("the arena's map is held at its gate"),
            () = map_gate.until_waiting(1) => {}
        }
    }
    assert!(
        !freed(),
        "the arena's pages were freed the moment its map was cancelled, while the backend was still mapping them"
    );
    map_gate.release();
    unmap_gate.until_waiting(1).await;
    assert_eq!(live(&backend), 1, "the cancelled arena map registered");
    assert!(
        !freed(),
        "the arena's pages were freed while still registered"
    );

    unmap_gate.release();
    until_freed("the arena's pages are freed", &backend, freed).await;
    assert_eq!(live(&backend), 0);
    assert_eq!(registry.stats().leaked_bytes, 0);
    assert_eq!(registry.stats().registered_bytes, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_external_registration_is_reusable_once_the_rollbacks_settle() {
    let _serial = SERIAL.lock().await;
    let (_fabric, backend, registry) = detached_side();
    let map_gate = backend.faults().hang(FaultOp::Map);
    let unmap_gate = backend.faults().hang(FaultOp::Unmap);
    let mut memory = vec![0u8; 8192].into_boxed_slice();
    let ptr = memory.as_mut_ptr();
    {
        // SAFETY: `memory` is neither referenced nor freed until the rollback
        // of this registration has settled (asserted below).
        let mut register = pin!(unsafe { registry.register_external(ptr, 8192) });
        tokio::select! {
            biased;
            _ = &mut register => panic!("the map is held at its gate"),
            () = map_gate.until_waiting(1) => {}
        }
    }
    let mut settled = pin!(registry.map_rollbacks_settled());
    assert!(
        futures::poll!(&mut settled).is_pending(),
        "the range is still being registered"
    );
    map_gate.release();
    unmap_gate.until_waiting(1).await;
    assert_eq!(live(&backend), 1);
    assert!(futures::poll!(&mut settled).is_pending(), "rollback held");
    unmap_gate.release();
    tokio::time::timeout(Duration::from_secs(5), settled)
        .await
        .expect("the rollback settles");
    assert_eq!(live(&backend), 0);
    memory.fill(1); // the range is ours again
    assert_eq!(registry.stats().registered_bytes, 0);
}
