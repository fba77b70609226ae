//! Same-host reads copied on the caller's own thread: which reads take that
//! way, and that they keep every ordering and lifetime rule reads through
//! the progress thread keep.
//!
//! A read is copied on its caller's thread only once the progress thread
//! has checked its owner (the first read from a peer goes through the
//! thread), and only up to `UcxConfig::caller_copy_limit`;
//! `UcxEngine::reads_copied_on_caller_threads` tells which way each read
//! went.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{PeerId, RdmaError};
use rdmareg_ucx::{Transport, UcxEngine};

const LEN: usize = 4096;

/// Owner and consumer on the same-host lane, with a source registered on
/// the owner and a destination on the consumer.
struct Setup {
    owner: UcxEngine,
    consumer: UcxEngine,
    consumer_backend: Arc<rdmareg_ucx::UcxBackend>,
    src: PageBuf,
    dst: PageBuf,
    descriptor: rdmareg_core::Descriptor,
    dst_region: rdmareg_core::BackendRegion,
}

impl Setup {
    async fn new(config: rdmareg_ucx::UcxConfig, len: usize) -> Setup {
        let (owner, consumer) = engines_with(config);
        let (owner_backend, consumer_backend) = (owner.backend(), consumer.backend());
        let src = PageBuf::filled(len, pattern);
        let dst = PageBuf::zeroed(len);
        let region = map(&owner_backend, &src).await;
        let dst_region = map(&consumer_backend, &dst).await;
        let descriptor = describe(&src, &region);
        Setup {
            owner,
            consumer,
            consumer_backend,
            src,
            dst,
            descriptor,
            dst_region,
        }
    }

    fn request(&self) -> rdmareg_core::BackendGet {
        get_request(OWNER, &self.descriptor, &self.dst_region, 0, None)
    }

    async fn read(&self) -> Result<(), RdmaError> {
        self.read_request(self.request()).await
    }

    async fn read_request(&self, request: rdmareg_core::BackendGet) -> Result<(), RdmaError> {
        self.consumer_backend.get_into_test_memory(request).await
    }

    fn copied(&self) -> u64 {
        self.consumer.reads_copied_on_caller_threads()
    }

    async fn shutdown(self) {
        self.consumer.shutdown().await;
        self.owner.shutdown().await;
        assert_eq!(self.consumer.live_registrations(), Some(0));
        assert_eq!(self.owner.live_registrations(), Some(0));
    }
}

fn same_host() -> rdmareg_ucx::UcxConfig {
    config(Transport::SameHost)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_read_from_a_peer_goes_through_the_thread_and_later_ones_are_copied_by_the_caller()
 {
    let setup = Setup::new(same_host(), LEN).await;
    assert_eq!(setup.read().await, Ok(()));
    assert_eq!(setup.copied(), 0, "the thread checks the owner first");
    assert!(setup.dst.snapshot() == setup.src.snapshot());
    setup.dst.fill(0);
    for round in 1..=5 {
        assert_eq!(setup.read().await, Ok(()));
        assert_eq!(setup.copied(), round);
        assert!(setup.dst.snapshot() == setup.src.snapshot());
        setup.dst.fill(0);
    }
    setup.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_above_the_limit_goes_through_the_thread() {
    let setup = Setup::new(same_host().with_caller_copy_limit(LEN), 2 * LEN).await;
    assert_eq!(setup.read().await, Ok(()));
    assert_eq!(setup.read().await, Ok(()));
    assert_eq!(setup.copied(), 0, "8 KiB is above a 4 KiB limit");
    assert!(setup.dst.snapshot() == setup.src.snapshot());
    let mut request = setup.request();
    request.len = LEN as u64;
    assert_eq!(setup.read_request(request).await, Ok(()));
    assert_eq!(setup.copied(), 1, "4 KiB is at the limit");
    setup.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_of_zero_sends_every_read_through_the_thread() {
    let setup = Setup::new(same_host().with_caller_copy_limit(0), LEN).await;
    for _ in 0..3 {
        assert_eq!(setup.read().await, Ok(()));
    }
    assert_eq!(setup.copied(), 0);
    assert!(setup.dst.snapshot() == setup.src.snapshot());
    setup.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_over_tcp_is_never_copied_by_the_caller() {
    let setup = Setup::new(config(Transport::Tcp), LEN).await;
    for _ in 0..3 {
        assert_eq!(setup.read().await, Ok(()));
    }
    assert_eq!(setup.copied(), 0, "tcp keys are served by the owner");
    setup.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_submitted_after_an_unmap_of_its_destination_is_refused() {
    let setup = Setup::new(same_host(), LEN).await;
    assert_eq!(setup.read().await, Ok(()));
    assert_eq!(setup.read().await, Ok(()));
    let copied = setup.copied();
    assert_eq!(copied, 1);
    let unmap = setup
        .consumer_backend
        .unmap(setup.dst_region.backend_region_id);
    setup.dst.fill(0xEE);
    assert_eq!(setup.read().await, Err(RdmaError::RegionNotFound));
    assert_eq!(unmap.await, Ok(()));
    assert_eq!(setup.copied(), copied);
    assert!(setup.dst.snapshot().iter().all(|&b| b == 0xEE));
    setup.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_submitted_after_remove_peer_is_refused_as_not_configured() {
    let setup = Setup::new(same_host(), LEN).await;
    assert_eq!(setup.read().await, Ok(()));
    assert_eq!(setup.read().await, Ok(()));
    assert_eq!(setup.copied(), 1);
    setup.consumer.remove_peer(OWNER).unwrap();
    assert_eq!(setup.read().await, Err(RdmaError::NotConfigured));
    assert_eq!(setup.copied(), 1);
    setup.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_re_added_with_another_address_is_checked_by_the_thread_again() {
    let setup = Setup::new(same_host(), LEN).await;
    assert_eq!(setup.read().await, Ok(()));
    assert_eq!(setup.read().await, Ok(()));
    assert_eq!(setup.copied(), 1);
    let other = UcxEngine::start(same_host()).expect("second owner starts");
    let other_src = PageBuf::filled(LEN, |i| pattern(i + 7));
    let other_region = map(&other.backend(), &other_src).await;
    setup
        .consumer
        .add_peer(OWNER, other.worker_address())
        .unwrap();
    let request = get_request(
        OWNER,
        &describe(&other_src, &other_region),
        &setup.dst_region,
        0,
        None,
    );
    assert_eq!(setup.read_request(request).await, Ok(()));
    assert_eq!(
        setup.copied(),
        1,
        "the new owner's first read is the thread's"
    );
    assert!(setup.dst.snapshot() == other_src.snapshot());
    other.shutdown().await;
    setup.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_copy_outside_the_keys_range_or_the_destination_gets_the_threads_typed_error() {
    let setup = Setup::new(same_host(), LEN).await;
    assert_eq!(setup.read().await, Ok(()));
    let mut past_the_key = setup.request();
    past_the_key.remote_addr += 1;
    assert_eq!(
        setup.read_request(past_the_key).await,
        Err(RdmaError::OutOfRange)
    );
    let mut past_the_destination = setup.request();
    past_the_destination.local_offset = 1;
    assert_eq!(
        setup.read_request(past_the_destination).await,
        Err(RdmaError::OutOfRange)
    );
    let mut unknown_destination = setup.request();
    unknown_destination.local_region_id = u64::MAX;
    assert_eq!(
        setup.read_request(unknown_destination).await,
        Err(RdmaError::RegionNotFound)
    );
    let mut unknown_peer = setup.request();
    unknown_peer.peer = PeerId(99);
    assert_eq!(
        setup.read_request(unknown_peer).await,
        Err(RdmaError::NotConfigured)
    );
    assert_eq!(setup.copied(), 0);
    setup.shutdown().await;
}

/// Readers on two threads copy into the destination as fast as they can
/// while it is unmapped (or the engine shut down); once that answered, the
/// buffer is refilled and must keep its bytes while the readers go on.
async fn race_readers_against(end: impl AsyncFnOnce(&Setup)) {
    let setup = Arc::new(Setup::new(same_host(), LEN).await);
    assert_eq!(setup.read().await, Ok(()));
    let stop = Arc::new(AtomicBool::new(false));
    let refused = Arc::new(AtomicU64::new(0));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (setup, stop) = (Arc::clone(&setup), Arc::clone(&stop));
            let refused = Arc::clone(&refused);
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    match setup.read().await {
                        Ok(()) => {}
                        Err(RdmaError::RegionNotFound | RdmaError::ShuttingDown) => {
                            refused.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(other) => panic!("unexpected answer {other:?}"),
                    }
                    tokio::task::yield_now().await;
                }
            })
        })
        .collect();
    while setup.copied() < 100 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    end(&setup).await;
    setup.dst.fill(0xEE);
    // The readers go on for at least 50 ms, and until one was refused
    // (a reader may get no CPU for a while on a busy host), up to 10 s.
    let ended = std::time::Instant::now();
    tokio::time::sleep(Duration::from_millis(50)).await;
    while refused.load(Ordering::Relaxed) == 0 && ended.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for reader in readers {
        reader.await.unwrap();
    }
    assert!(
        refused.load(Ordering::Relaxed) > 0,
        "the readers kept reading after the end"
    );
    assert!(
        setup.dst.snapshot().iter().all(|&b| b == 0xEE),
        "a copy landed after the answer"
    );
    let setup = Arc::into_inner(setup).expect("readers are done");
    setup.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_caller_copy_lands_after_an_unmap_of_its_destination_answered() {
    race_readers_against(async |setup: &Setup| {
        assert_eq!(
            setup
                .consumer_backend
                .unmap(setup.dst_region.backend_region_id)
                .await,
            Ok(())
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_caller_copy_lands_after_the_engine_shut_down() {
    race_readers_against(async |setup: &Setup| {
        setup.consumer.shutdown().await;
        assert_eq!(setup.consumer.live_registrations(), Some(0));
    })
    .await;
}

/// `count` reads of `LEN / count` bytes each, entry `i` reading the
/// source's `i`-th piece into the destination's `i`-th piece.
fn pieces(setup: &Setup, count: usize) -> Vec<rdmareg_core::BackendGet> {
    let piece = (LEN / count) as u64;
    (0..count as u64)
        .map(|i| {
            let mut request = setup.request();
            request.remote_addr += i * piece;
            request.local_offset = i * piece;
            request.len = piece;
            request
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_batch_from_a_checked_owner_is_copied_whole_by_the_caller() {
    let setup = Setup::new(same_host(), LEN).await;
    assert_eq!(setup.read().await, Ok(()));
    setup.dst.fill(0);
    let answers = setup
        .consumer_backend
        .get_batch_into_test_memory(pieces(&setup, 4))
        .await;
    assert_eq!(answers, vec![Ok(()); 4]);
    assert_eq!(setup.copied(), 4);
    assert!(setup.dst.snapshot() == setup.src.snapshot());
    setup.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_with_one_bad_entry_goes_to_the_thread_and_each_entry_gets_its_own_answer() {
    let setup = Setup::new(same_host(), LEN).await;
    assert_eq!(setup.read().await, Ok(()));
    setup.dst.fill(0);
    let mut batch = pieces(&setup, 4);
    batch[2].remote_addr += LEN as u64;
    let answers = setup
        .consumer_backend
        .get_batch_into_test_memory(batch)
        .await;
    assert_eq!(
        answers,
        vec![Ok(()), Ok(()), Err(RdmaError::OutOfRange), Ok(())]
    );
    assert_eq!(setup.copied(), 0, "a batch is copied whole or not at all");
    let (src, dst) = (setup.src.snapshot(), setup.dst.snapshot());
    assert!(dst[..2048] == src[..2048] && dst[3072..] == src[3072..]);
    assert!(dst[2048..3072].iter().all(|&b| b == 0));
    setup.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_above_the_limit_in_all_goes_through_the_thread() {
    let setup = Setup::new(same_host().with_caller_copy_limit(LEN / 2), LEN).await;
    let mut first = setup.request();
    first.len = (LEN / 2) as u64;
    assert_eq!(setup.read_request(first).await, Ok(()));
    let answers = setup
        .consumer_backend
        .get_batch_into_test_memory(pieces(&setup, 4))
        .await;
    assert_eq!(answers, vec![Ok(()); 4]);
    assert_eq!(setup.copied(), 0, "4 KiB in all is above a 2 KiB limit");
    let answers = setup
        .consumer_backend
        .get_batch_into_test_memory(pieces(&setup, 4)[..2].to_vec())
        .await;
    assert_eq!(answers, vec![Ok(()); 2]);
    assert_eq!(setup.copied(), 2, "2 KiB in all is at the limit");
    assert!(setup.dst.snapshot() == setup.src.snapshot());
    setup.shutdown().await;
}
