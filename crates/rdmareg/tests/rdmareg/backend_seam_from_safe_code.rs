//! The backend the facade hands out, used around the registry.
//!
//! `Rdma::engine().backend()` is an `Arc<UcxBackend>`, and `RdmaBackend` is
//! re-exported. Its `map` takes an address and a length and its `get` names
//! a destination by region id, so both are `unsafe fn`: safe code cannot
//! call them (the `compile_fail` examples in the crate documentation, under
//! "Going around the registry", pin that). These tests pin what a caller
//! that takes on the seam's promise in `unsafe` gets: the bytes it asked
//! for, typed refusals for ids and ranges it does not hold, and a registry
//! whose own accounting and buffers are untouched.

use std::time::Duration;

use rdmareg::backend::RdmaBackend;
use rdmareg::core::{BackendGet, RdmaError};
use rdmareg::registry::RdmaConfig;
use rdmareg::{Config, PeerId, Rdma, Transport};

fn config() -> Config {
    Config::new()
        .with_transport(Transport::Tcp)
        .with_net_devices("lo")
        .with_registry(
            RdmaConfig::default()
                .with_budget_bytes(256 << 20)
                .with_shutdown_budget(Duration::from_secs(5)),
        )
}

const OWNER: PeerId = PeerId(7);

/// An owner facade serving 4 KiB of 0xAB, and a consumer facade that has it
/// as a peer; returns both and the descriptor.
async fn owner_and_consumer() -> (Rdma, Rdma, rdmareg::RegionGuard) {
    let owner = Rdma::start(config()).expect("owner starts");
    let consumer = Rdma::start(config()).expect("consumer starts");
    let source = owner
        .register_owned(vec![0xABu8; 4096].into_boxed_slice())
        .await
        .expect("registers");
    consumer
        .add_peer(OWNER, owner.worker_address())
        .expect("peer");
    (owner, consumer, source)
}

/// Memory this test owns and reaches only through a raw pointer, as the
/// seam's `map` asks: page-aligned, never referenced while registered, and
/// freed only after its registration's unmap answered `Ok`.
struct RawPages {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl RawPages {
    fn zeroed(len: usize) -> RawPages {
        let layout = std::alloc::Layout::from_size_align(len, 4096).expect("layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "allocation of {len} bytes");
        RawPages { ptr, layout }
    }

    fn addr(&self) -> usize {
        self.ptr as usize
    }

    fn len(&self) -> usize {
        self.layout.size()
    }

    /// A copy of the bytes; taken only once no GET writes them.
    fn snapshot(&self) -> Vec<u8> {
        // SAFETY: `len()` initialised bytes owned by this value; callers
        // copy only after every GET into them answered.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len()) }.to_vec()
    }
}

impl Drop for RawPages {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout, freed once (tests
        // drop it only after its registration's unmap answered `Ok`).
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

// SAFETY: the value owns its allocation; the pointer is only an address.
unsafe impl Send for RawPages {}

/// A caller that keeps the seam's promise maps memory of its own through the
/// facade's backend and GETs into it: the bytes land, and the registry never
/// saw the registration (its counts are unchanged).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsafe_caller_that_keeps_the_seams_promise_gets_the_bytes() {
    let (owner, consumer, source) = owner_and_consumer().await;
    let descriptor = source.descriptor().expect("descriptor");
    let before = consumer.stats();
    let backend = consumer.engine().backend();
    let pages = RawPages::zeroed(4096);
    // SAFETY: `pages` is this test's, reached only through its pointer and
    // freed after the unmap below answered `Ok`.
    let region = unsafe { backend.map(pages.addr(), pages.len()) }
        .await
        .expect("map of owned pages");
    // SAFETY: the destination is `pages`, untouched until this answers.
    let answer = unsafe {
        backend.get(BackendGet {
            peer: OWNER,
            remote_addr: descriptor.addr(),
            packed_key: descriptor.packed_key().clone(),
            local_region_id: region.backend_region_id,
            local_offset: 0,
            len: 4096,
            deadline: Some(Duration::from_secs(5)),
        })
    }
    .await;
    let landed = pages.snapshot();
    assert_eq!(backend.unmap(region.backend_region_id).await, Ok(()));
    drop(pages);
    let after = consumer.stats();
    drop(source);
    // The owner's region was unmapped behind its registry, so neither
    // summary is what these tests check.
    let _ = owner.shutdown().await;
    let _ = consumer.shutdown().await;
    assert_eq!(answer, Ok(()));
    assert!(
        landed.iter().all(|&b| b == 0xAB),
        "the owner's bytes landed"
    );
    assert_eq!(
        (after.live_regions, after.registered_bytes),
        (before.live_regions, before.registered_bytes),
        "a registration made around the registry is not the registry's"
    );
}

/// Region ids the backend never issued, and a range past the end of the
/// caller's own registration, are refused with typed errors; a pool buffer
/// that safe code holds meanwhile keeps its bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_naming_an_unissued_id_or_a_range_outside_the_region_is_refused() {
    let (owner, consumer, source) = owner_and_consumer().await;
    let descriptor = source.descriptor().expect("descriptor");
    let mut held = consumer.alloc_pinned(4096).await.expect("allocates");
    held.fill(0);
    let backend = consumer.engine().backend();
    let pages = RawPages::zeroed(4096);
    // SAFETY: as in the test above.
    let region = unsafe { backend.map(pages.addr(), pages.len()) }
        .await
        .expect("map of owned pages");
    let request = |local_region_id, local_offset| BackendGet {
        peer: OWNER,
        remote_addr: descriptor.addr(),
        packed_key: descriptor.packed_key().clone(),
        local_region_id,
        local_offset,
        len: 4096,
        deadline: Some(Duration::from_secs(5)),
    };
    // SAFETY: ids counted down from the top of the id space, which the
    // engine (counting up from 1) never issued, name no memory at all.
    let unissued = unsafe { backend.get(request(u64::MAX, 0)) }.await;
    // SAFETY: the id is the caller's own registration of `pages`; the
    // range overruns it, which the engine refuses before any transfer.
    let overrun = unsafe { backend.get(request(region.backend_region_id, 1)) }.await;
    let untouched = pages.snapshot().iter().all(|&b| b == 0);
    assert_eq!(backend.unmap(region.backend_region_id).await, Ok(()));
    drop(pages);
    let held_kept = held.iter().all(|&b| b == 0);
    drop(held);
    drop(source);
    // The owner's region was unmapped behind its registry, so neither
    // summary is what these tests check.
    let _ = owner.shutdown().await;
    let _ = consumer.shutdown().await;
    assert_eq!(unissued, Err(RdmaError::RegionNotFound));
    assert_eq!(overrun, Err(RdmaError::OutOfRange));
    assert!(untouched, "a refused GET landed nothing");
    assert!(held_kept, "a pool buffer held by safe code kept its bytes");
}
