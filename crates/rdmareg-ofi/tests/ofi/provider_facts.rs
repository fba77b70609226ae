//! What each provider lets a peer do with a key, measured through the
//! engine: a stale key (its region closed with `fi_close`) and a forged key
//! that claims more than was registered. The consumer engine's own checks
//! pass both (the forged key is well-formed and names the owner), so what
//! answers is the owner's provider. These run on the one-sided read path
//! (`fi_read`), which is what they measure; owner-served reads are tested
//! in `owner_served.rs`.

use crate::common;

use std::time::Duration;

use bytes::Bytes;
use common::SeamForTestMemory;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, RdmaError};
use rdmareg_ofi::key::PackedKey;
use rdmareg_ofi::{Provider, ReadPath};

use common::OWNER;

const PAGE: usize = 4096;

/// The source is two pages, only the first registered; the second holds a
/// different byte so a read of it shows.
struct Setup {
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl Setup {
    fn new() -> Setup {
        let mut src = vec![0x11u8; 2 * PAGE];
        src[PAGE..].fill(0x22);
        Setup {
            src,
            dst: vec![0u8; PAGE],
        }
    }
}

fn request(key: Bytes, remote_addr: u64, dst_id: u64, len: u64) -> BackendGet {
    BackendGet {
        peer: OWNER,
        remote_addr,
        packed_key: key,
        local_region_id: dst_id,
        local_offset: 0,
        len,
        deadline: Some(Duration::from_secs(5)),
    }
}

/// Unmaps the source, then reads 64 bytes with its (now stale) key;
/// answers the result and the first destination byte.
async fn read_with_a_stale_key(provider: Provider) -> (Result<(), RdmaError>, u8) {
    let (owner, consumer) = common::engines_on(provider, ReadPath::OneSided);
    let (o, c) = (owner.backend(), consumer.backend());
    let mut setup = Setup::new();
    let src = o
        .map_test_memory(setup.src.as_ptr() as usize, PAGE)
        .await
        .unwrap();
    let dst = c
        .map_test_memory(setup.dst.as_mut_ptr() as usize, PAGE)
        .await
        .unwrap();
    o.unmap(src.backend_region_id).await.unwrap();
    let answer = c
        .get_into_test_memory(request(
            src.packed_key,
            setup.src.as_ptr() as u64,
            dst.backend_region_id,
            64,
        ))
        .await;
    c.unmap(dst.backend_region_id).await.unwrap();
    consumer.shutdown().await;
    owner.shutdown().await;
    (answer, setup.dst[0])
}

/// Reads 64 bytes of the unregistered second page with a key whose length
/// was rewritten to cover it; answers the result and the first destination
/// byte.
async fn read_beyond_the_registration(provider: Provider) -> (Result<(), RdmaError>, u8) {
    let (owner, consumer) = common::engines_on(provider, ReadPath::OneSided);
    let (o, c) = (owner.backend(), consumer.backend());
    let mut setup = Setup::new();
    let src = o
        .map_test_memory(setup.src.as_ptr() as usize, PAGE)
        .await
        .unwrap();
    let dst = c
        .map_test_memory(setup.dst.as_mut_ptr() as usize, PAGE)
        .await
        .unwrap();
    let mut forged = PackedKey::decode(&src.packed_key).unwrap();
    forged.len = 2 * PAGE as u64;
    let answer = c
        .get_into_test_memory(request(
            forged.encode(),
            setup.src.as_ptr() as u64 + PAGE as u64,
            dst.backend_region_id,
            64,
        ))
        .await;
    c.unmap(dst.backend_region_id).await.unwrap();
    o.unmap(src.backend_region_id).await.unwrap();
    consumer.shutdown().await;
    owner.shutdown().await;
    (answer, setup.dst[0])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_refuses_a_read_after_fi_close_of_the_owners_region() {
    let (answer, first) = read_with_a_stale_key(Provider::Tcp).await;
    assert!(
        matches!(answer, Err(RdmaError::Backend(_))),
        "stale-key read answered {answer:?} (the owner's provider refuses, not the consumer)"
    );
    assert_eq!(first, 0, "no byte landed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_refuses_a_read_beyond_the_registration_with_a_forged_key() {
    let (answer, first) = read_beyond_the_registration(Provider::Tcp).await;
    assert!(
        matches!(answer, Err(RdmaError::Backend(_))),
        "forged-range read answered {answer:?} (the owner's provider refuses, not the consumer)"
    );
    assert_eq!(first, 0, "no byte landed");
}

/// The hazard this documents: on shm a closed region's memory is still
/// readable by a peer that kept its key. The registry frees memory only
/// after `deregistered()`, so on shm the owner's memory must be treated as
/// readable by key holders until it is freed — as with UCX's cma lane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_serves_a_read_after_fi_close_of_the_owners_region() {
    let (answer, first) = read_with_a_stale_key(Provider::Shm).await;
    assert_eq!(answer, Ok(()));
    assert_eq!(first, 0x11, "the closed region's bytes landed");
}

/// On shm a forged key reads past the registration: the owner's provider
/// does not check the range (the kernel copies, as with cma).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_serves_a_read_beyond_the_registration_with_a_forged_key() {
    let (answer, first) = read_beyond_the_registration(Provider::Shm).await;
    assert_eq!(answer, Ok(()));
    assert_eq!(first, 0x22, "bytes of the unregistered page landed");
}
