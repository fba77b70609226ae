//! What safe code can do with the backend the facade hands out.
//!
//! `Rdma::engine().backend()` is an `Arc<UcxBackend>`, and `RdmaBackend` is
//! re-exported. Its `map` takes an address and a length and its `get` names
//! a destination by region id, both as safe methods. The registry wraps them
//! soundly (`register_external` is `unsafe`, and a GET's destination is a
//! pool buffer the call borrows mutably), but a caller that goes around the
//! registry reaches the seam directly. These tests state what must hold for
//! such a caller: no transport write into memory safe code owns or borrows.

use std::time::Duration;

use rdmareg::core::BackendGet;
use rdmareg::{Config, PeerId, Rdma, RdmaBackend, RdmaConfig, Transport};

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

/// Safe code maps the bytes of a `Vec` it owns through the facade's backend
/// and GETs into them: the transport then writes memory the `Vec` owns,
/// behind its back. A sound seam refuses this without `unsafe` (the map or
/// the GET), so the `Vec` must keep its bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "known defect: RdmaBackend::map and ::get are safe methods on a backend the facade hands out, so safe code can register memory it does not own and make the transport write it; the fix is making the seam's map/get/get_batch `unsafe fn` (every backend, the kit and their tests follow)"]
async fn safe_code_cannot_make_the_transport_write_into_a_vec_it_owns() {
    let (owner, consumer, source) = owner_and_consumer().await;
    let descriptor = source.descriptor().expect("descriptor");
    let backend = consumer.engine().backend();
    let vec = vec![0u8; 4096];
    let mapped = backend.map(vec.as_ptr() as usize, vec.len()).await;
    let landed = match &mapped {
        Ok(region) => backend
            .get(BackendGet {
                peer: OWNER,
                remote_addr: descriptor.addr(),
                packed_key: descriptor.packed_key().clone(),
                local_region_id: region.backend_region_id,
                local_offset: 0,
                len: 4096,
                deadline: Some(Duration::from_secs(5)),
            })
            .await
            .is_ok(),
        Err(_) => false,
    };
    let overwritten = vec.iter().filter(|&&b| b != 0).count();
    if let Ok(region) = &mapped {
        assert_eq!(backend.unmap(region.backend_region_id).await, Ok(()));
    }
    drop(vec);
    drop(source);
    owner.shutdown().await;
    consumer.shutdown().await;
    assert!(
        !landed && overwritten == 0,
        "the transport wrote {overwritten} bytes of a Vec that safe code owns (map answered {}, get landed: {landed})",
        if mapped.is_ok() { "Ok" } else { "Err" }
    );
}

/// Safe code holds a pool buffer (and could hold `&mut` to its bytes) and,
/// going around the registry, GETs into the region ids the backend has
/// issued — one of them is the buffer's arena. The buffer must keep its
/// bytes: a transport may write a pool buffer only through a registry GET
/// that borrows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "known defect: RdmaBackend::get names its destination by a region id, which safe code can guess (ids count up from 1), so it can make the transport write into a pool buffer another part of the program holds; the fix is making the seam's get/get_batch `unsafe fn`"]
async fn safe_code_cannot_make_the_transport_write_into_a_pool_buffer_it_holds() {
    let (owner, consumer, source) = owner_and_consumer().await;
    let descriptor = source.descriptor().expect("descriptor");
    let mut held = consumer.alloc_pinned(4096).await.expect("allocates");
    held.fill(0);
    let backend = consumer.engine().backend();
    let mut landed = 0;
    for guess in 0..64u64 {
        let get = backend.get(BackendGet {
            peer: OWNER,
            remote_addr: descriptor.addr(),
            packed_key: descriptor.packed_key().clone(),
            local_region_id: guess,
            local_offset: 0,
            len: 4096,
            deadline: Some(Duration::from_secs(5)),
        });
        if get.await.is_ok() {
            landed += 1;
        }
    }
    let overwritten = held.iter().filter(|&&b| b != 0).count();
    drop(held);
    drop(source);
    owner.shutdown().await;
    consumer.shutdown().await;
    assert!(
        landed == 0 && overwritten == 0,
        "{landed} GETs around the registry landed, and {overwritten} bytes of a pool buffer held by safe code changed"
    );
}
