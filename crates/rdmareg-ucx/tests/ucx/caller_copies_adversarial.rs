//! Caller copies under attack: readers copying on several threads while
//! other threads change peers, unmap destinations or shut engines down;
//! runtimes of one thread; the registry on top.
//!
//! Each test states a promise reads through the progress thread keep and
//! checks that it holds while the caller's own thread copies.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendRegion, Descriptor, PeerId, RdmaError};
use rdmareg_ucx::{Transport, UcxBackend, UcxConfig};

const LEN: usize = 4096;

fn same_host() -> UcxConfig {
    config(Transport::SameHost)
}

async fn read_from(
    backend: &UcxBackend,
    peer: PeerId,
    source: &Descriptor,
    dst: &BackendRegion,
    offset: u64,
) -> Result<(), RdmaError> {
    backend
        .get_into_test_memory(get_request(peer, source, dst, offset, None))
        .await
}

/// Readers copying from a peer on other threads do not let a read
/// submitted after `remove_peer` (on this thread) copy from the removed
/// peer, nor one submitted after `add_peer` miss the re-added one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_after_a_peer_change_keeps_its_order_while_other_threads_copy_from_that_peer() {
    let (owner, consumer) = engines_with(same_host());
    let (ob, cb) = (owner.backend(), consumer.backend());
    let src = PageBuf::filled(LEN, pattern);
    let source = describe(&src, &map(&ob, &src).await);
    let dsts: Vec<PageBuf> = (0..3).map(|_| PageBuf::zeroed(LEN)).collect();
    let mut regions = Vec::new();
    for dst in &dsts {
        regions.push(map(&cb, dst).await);
    }
    assert_eq!(read_from(&cb, OWNER, &source, &regions[0], 0).await, Ok(()));
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = regions[1..]
        .iter()
        .map(|region| {
            let (cb, source, region, stop) = (
                cb.clone(),
                source.clone(),
                region.clone(),
                Arc::clone(&stop),
            );
            tokio::spawn(async move {
                let mut copied = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    match read_from(&cb, OWNER, &source, &region, 0).await {
                        Ok(()) => copied += 1,
                        Err(RdmaError::NotConfigured) => {}
                        Err(other) => panic!("a background read answered {other:?}"),
                    }
                    tokio::task::yield_now().await;
                }
                copied
            })
        })
        .collect();
    let address = owner.worker_address();
    for cycle in 0..300 {
        consumer.remove_peer(OWNER).unwrap();
        dsts[0].fill(0);
        assert_eq!(
            read_from(&cb, OWNER, &source, &regions[0], 0).await,
            Err(RdmaError::NotConfigured),
            "cycle {cycle}: a read after remove_peer"
        );
        assert!(dsts[0].snapshot().iter().all(|&b| b == 0), "cycle {cycle}");
        consumer.add_peer(OWNER, address.clone()).unwrap();
        for _ in 0..2 {
            assert_eq!(
                read_from(&cb, OWNER, &source, &regions[0], 0).await,
                Ok(()),
                "cycle {cycle}: a read after add_peer"
            );
        }
        assert!(dsts[0].snapshot() == src.snapshot(), "cycle {cycle}");
    }
    stop.store(true, Ordering::Relaxed);
    for reader in readers {
        reader.await.unwrap();
    }
    assert!(
        consumer.reads_copied_on_caller_threads() > 0,
        "the caller's copies ran"
    );
    consumer.shutdown().await;
    owner.shutdown().await;
    assert_eq!(consumer.live_registrations(), Some(0));
    assert_eq!(owner.live_registrations(), Some(0));
}

/// Round after round a fresh destination is mapped, two readers copy into
/// its halves as fast as they can, and it is unmapped under them: once the
/// unmap answered, nothing lands in it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_caller_copy_lands_in_a_destination_after_its_unmap_answered_round_after_round() {
    let (owner, consumer) = engines_with(same_host());
    let (ob, cb) = (owner.backend(), consumer.backend());
    let src = PageBuf::filled(LEN, pattern);
    let source = describe(&src, &map(&ob, &src).await);
    let warm = PageBuf::zeroed(LEN);
    let warm_region = map(&cb, &warm).await;
    assert_eq!(
        read_from(&cb, OWNER, &source, &warm_region, 0).await,
        Ok(())
    );
    let half = source.slice(0, LEN as u64 / 2).unwrap();
    let mut refused_total = 0;
    for round in 0..100 {
        let dst = Arc::new(PageBuf::zeroed(LEN));
        let region = map(&cb, &dst).await;
        let stop = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = [0, LEN as u64 / 2]
            .into_iter()
            .map(|offset| {
                let (cb, half, region, stop) =
                    (cb.clone(), half.clone(), region.clone(), Arc::clone(&stop));
                tokio::spawn(async move {
                    let (mut copied, mut refused) = (0u64, 0u64);
                    while !stop.load(Ordering::Relaxed) {
                        match read_from(&cb, OWNER, &half, &region, offset).await {
                            Ok(()) => copied += 1,
                            Err(RdmaError::RegionNotFound) => refused += 1,
                            Err(other) => panic!("a read answered {other:?}"),
                        }
                        tokio::task::yield_now().await;
                    }
                    (copied, refused)
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(2)).await;
        assert_eq!(cb.unmap(region.backend_region_id).await, Ok(()));
        dst.fill(0xEE);
        tokio::time::sleep(Duration::from_millis(3)).await;
        stop.store(true, Ordering::Relaxed);
        for reader in readers {
            let (_, refused) = reader.await.unwrap();
            refused_total += refused;
        }
        assert!(
            dst.snapshot().iter().all(|&b| b == 0xEE),
            "round {round}: a copy landed after the unmap answered"
        );
    }
    assert!(refused_total > 0, "readers ran past the unmaps");
    assert!(consumer.reads_copied_on_caller_threads() > 100);
    consumer.shutdown().await;
    owner.shutdown().await;
    assert_eq!(consumer.live_registrations(), Some(0));
    assert_eq!(owner.live_registrations(), Some(0));
}

/// On a runtime of one thread the caller's copies answer in order with the
/// thread's: a copied read, an unmap, a refused read, a shutdown, a read
/// refused as shutting down, and none of them waits for ever.
#[test]
fn a_current_thread_runtime_sees_copies_unmaps_and_shutdown_in_order() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(20), async {
            let (owner, consumer) = engines_with(same_host());
            let (ob, cb) = (owner.backend(), consumer.backend());
            let src = PageBuf::filled(LEN, pattern);
            let source = describe(&src, &map(&ob, &src).await);
            let dst = PageBuf::zeroed(LEN);
            let region = map(&cb, &dst).await;
            for _ in 0..3 {
                assert_eq!(read_from(&cb, OWNER, &source, &region, 0).await, Ok(()));
            }
            assert_eq!(consumer.reads_copied_on_caller_threads(), 2);
            let unmap = cb.unmap(region.backend_region_id);
            assert_eq!(
                read_from(&cb, OWNER, &source, &region, 0).await,
                Err(RdmaError::RegionNotFound)
            );
            assert_eq!(unmap.await, Ok(()));
            let other = PageBuf::zeroed(LEN);
            let other_region = map(&cb, &other).await;
            assert_eq!(
                read_from(&cb, OWNER, &source, &other_region, 0).await,
                Ok(())
            );
            consumer.shutdown().await;
            other.fill(0xEE);
            assert_eq!(
                read_from(&cb, OWNER, &source, &other_region, 0).await,
                Err(RdmaError::ShuttingDown)
            );
            assert!(other.snapshot().iter().all(|&b| b == 0xEE));
            owner.shutdown().await;
            assert_eq!(consumer.live_registrations(), Some(0));
            assert_eq!(owner.live_registrations(), Some(0));
        })
        .await
        .expect("nothing waits for ever on one thread");
    });
}

/// The registry over a same-host consumer: many tasks read into pool
/// buffers, some reads cancelled before their first poll answers, buffers
/// dropped and allocated again, and the registry shut down while they
/// read. Every `Ok` read holds the owner's bytes, the sweep leaves nothing
/// behind, and the engine ends with nothing registered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registry_keeps_its_pool_and_shutdown_guarantees_over_caller_copies() {
    use rdmareg_registry::{RdmaConfig, RdmaRegistry};

    let (owner, consumer) = engines_with(same_host());
    let ob = owner.backend();
    let src = PageBuf::filled(LEN, pattern);
    let source = describe(&src, &map(&ob, &src).await);
    let registry = Arc::new(
        RdmaRegistry::new(
            consumer.backend(),
            RdmaConfig::default(),
            tokio::runtime::Handle::current(),
        )
        .expect("registry"),
    );
    let expected = Arc::new(src.snapshot());
    let answered = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let tasks: Vec<_> = (0..4)
        .map(|task| {
            let (registry, source, expected, answered) = (
                Arc::clone(&registry),
                source.clone(),
                Arc::clone(&expected),
                Arc::clone(&answered),
            );
            tokio::spawn(async move {
                let mut oks = 0u64;
                for round in 0..2000u64 {
                    let mut buf = match registry.alloc_pinned(LEN).await {
                        Ok(buf) => buf,
                        Err(RdmaError::ShuttingDown) => break,
                        Err(other) => panic!("alloc_pinned answered {other:?}"),
                    };
                    let answer = if (round + task) % 7 == 0 {
                        // Dropped after at most one poll.
                        let get = registry.get(OWNER, &source, &mut buf);
                        futures::FutureExt::now_or_never(get)
                    } else {
                        Some(registry.get(OWNER, &source, &mut buf).await)
                    };
                    match answer {
                        Some(Ok(())) => {
                            assert!(
                                buf[..] == expected[..],
                                "an Ok read holds the owner's bytes"
                            );
                            oks += 1;
                            answered.fetch_add(1, Ordering::Relaxed);
                        }
                        Some(Err(RdmaError::ShuttingDown)) => break,
                        Some(Err(other)) => panic!("a read answered {other:?}"),
                        None => assert!(buf.is_surrendered() || buf.len() == LEN),
                    }
                    if round % 3 == 0 {
                        tokio::task::yield_now().await;
                    }
                }
                oks
            })
        })
        .collect();
    // Shut down while the tasks are well into their reads.
    while answered.load(Ordering::Relaxed) < 500 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let swept = registry.shutdown(Duration::from_secs(5)).await;
    let mut oks = 0;
    for task in tasks {
        oks += task.await.unwrap();
    }
    assert!(oks > 0);
    consumer.shutdown().await;
    let report = swept.finish_after_backend_teardown();
    assert!(report.released, "{report:?}");
    assert_eq!(consumer.live_registrations(), Some(0));
    assert!(consumer.reads_copied_on_caller_threads() > 0);
    owner.shutdown().await;
    assert_eq!(owner.live_registrations(), Some(0));
}

/// A task that reads in a loop under `tokio::time::timeout`, on a runtime
/// of one thread, ends when the timeout passes. Reads through the progress
/// thread wait for its answer, so the loop yields on each; a read copied on
/// the caller's thread answers on its first poll, and a loop of them must
/// still yield now and then, or the timer (and every other task of the
/// thread) never runs again.
#[test]
fn a_loop_of_caller_copied_reads_under_a_timeout_ends_when_the_timeout_passes() {
    /// Far more reads than fit in the timeout: reaching it means the timer
    /// never got a turn.
    const CAP: u64 = 300_000;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (owner, consumer) = engines_with(same_host());
        let (ob, cb) = (owner.backend(), consumer.backend());
        let src = PageBuf::filled(64, pattern);
        let source = describe(&src, &map(&ob, &src).await);
        let dst = PageBuf::zeroed(64);
        let region = map(&cb, &dst).await;
        assert_eq!(read_from(&cb, OWNER, &source, &region, 0).await, Ok(()));
        let mut reads = 0u64;
        let looped = tokio::time::timeout(Duration::from_millis(50), async {
            while reads < CAP {
                assert_eq!(read_from(&cb, OWNER, &source, &region, 0).await, Ok(()));
                reads += 1;
            }
        })
        .await;
        assert!(consumer.reads_copied_on_caller_threads() > 0);
        consumer.shutdown().await;
        owner.shutdown().await;
        assert!(
            looped.is_err(),
            "the timeout never fired: {reads} reads ran without a yield"
        );
    });
}

/// The owner engine (in this process: its memory stays) shuts down while
/// readers copy from it on two threads. Nothing panics or hangs; each read
/// answers, whole when `Ok` (the owner's bytes are still there), and the
/// consumer then shuts down with nothing registered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_shutting_down_under_copying_readers_leaves_every_read_answered() {
    for round in 0..20 {
        let (owner, consumer) = engines_with(same_host());
        let (ob, cb) = (owner.backend(), consumer.backend());
        let src = PageBuf::filled(LEN, pattern);
        let source = describe(&src, &map(&ob, &src).await);
        let dsts: Vec<Arc<PageBuf>> = (0..2).map(|_| Arc::new(PageBuf::zeroed(LEN))).collect();
        let mut regions = Vec::new();
        for dst in &dsts {
            regions.push(map(&cb, dst).await);
        }
        let want = Arc::new(src.snapshot());
        let stop = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = dsts
            .iter()
            .zip(&regions)
            .map(|(dst, region)| {
                let (cb, source, region, stop, dst, want) = (
                    cb.clone(),
                    source.clone(),
                    region.clone(),
                    Arc::clone(&stop),
                    Arc::clone(dst),
                    Arc::clone(&want),
                );
                tokio::spawn(async move {
                    let mut errors = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        dst.fill(0);
                        match read_from(&cb, OWNER, &source, &region, 0).await {
                            Ok(()) => assert!(dst.snapshot() == *want, "an Ok read is whole"),
                            Err(_) => errors += 1,
                        }
                        tokio::task::yield_now().await;
                    }
                    errors
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(5)).await;
        tokio::time::timeout(Duration::from_secs(20), owner.shutdown())
            .await
            .unwrap_or_else(|_| panic!("round {round}: the owner's shutdown hung"));
        tokio::time::sleep(Duration::from_millis(5)).await;
        stop.store(true, Ordering::Relaxed);
        for reader in readers {
            tokio::time::timeout(Duration::from_secs(20), reader)
                .await
                .unwrap_or_else(|_| panic!("round {round}: a reader hung"))
                .unwrap();
        }
        consumer.shutdown().await;
        assert_eq!(owner.live_registrations(), Some(0));
        assert_eq!(consumer.live_registrations(), Some(0));
        drop(src);
    }
}
