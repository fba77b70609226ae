//! Teardown: every outstanding reply is answered, every registration is
//! released (the live count reads zero), later commands answer
//! `ShuttingDown`, GETs in flight land before connections close, and
//! dropping an engine does the same in bounded time.

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{PeerId, RdmaError};
use rdmareg_ucx::{Transport, UcxEngine};

const MIB: usize = 1024 * 1024;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_with_regions_mapped_and_gets_in_flight_ends_with_nothing_registered() {
    let (owner, consumer) = engines(Transport::Tcp);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let src = PageBuf::filled(32 * MIB, pattern);
    let src_region = map(&ob, &src).await;
    let desc = describe(&src, &src_region);
    let dsts: Vec<PageBuf> = (0..4).map(|_| PageBuf::zeroed(32 * MIB)).collect();
    let mut regions = Vec::new();
    for dst in &dsts {
        regions.push(map(&cb, dst).await);
    }
    let extra = PageBuf::zeroed(4096);
    let _unused_region = map(&cb, &extra).await;
    assert_eq!(consumer.live_registrations(), Some(5));

    let gets: Vec<_> = regions
        .iter()
        .map(|region| {
            let cb = cb.clone();
            let request = get_request(OWNER, &desc, region, 0, None);
            tokio::spawn(async move { cb.get_into_test_memory(request).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(2)).await;
    consumer.shutdown().await;

    assert_eq!(consumer.live_registrations(), Some(0));
    assert_eq!(cb.live_registrations(), Some(0));
    for get in gets {
        let answer = get.await.unwrap();
        assert!(
            matches!(answer, Ok(()) | Err(RdmaError::ShuttingDown)),
            "an in-flight GET at teardown answered {answer:?}"
        );
    }
    owner.shutdown().await;
    assert_eq!(owner.live_registrations(), Some(0));
    // Only now may the memory go.
    drop(dsts);
    drop(src);
}

/// On tcp the owner answers a GET by sending the bytes from inside its UCX
/// progress, and UCX aborts the owner's whole process when the consumer's
/// connection is reset while it is still answering. So a consumer that shuts
/// down with a GET in flight lets it finish before closing its connections.
/// Both engines live in this process: an abort fails this binary outright.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutting_down_mid_get_lets_the_owner_finish_answering() {
    // A teardown bound the 64 MiB drain fits in even on a loaded machine
    // (or under ASan): the point is that teardown waits for it, not how
    // fast it is.
    let (owner, consumer) =
        engines_with(config(Transport::Tcp).with_teardown_timeout(Duration::from_secs(30)));
    let (ob, cb) = (owner.backend(), consumer.backend());
    let src = PageBuf::filled(64 * MIB, pattern);
    let src_region = map(&ob, &src).await;
    let desc = describe(&src, &src_region);
    let want = src.snapshot();
    let dst = PageBuf::zeroed(64 * MIB);
    let region = map(&cb, &dst).await;
    // Connect first, so the large request reaches the owner at once.
    let warm = desc.slice(0, 8).unwrap();
    assert_eq!(
        cb.get_into_test_memory(get_request(OWNER, &warm, &region, 0, None))
            .await,
        Ok(())
    );

    // The warm read's reply may still count at the owner for a moment.
    let settled_by = Instant::now() + Duration::from_secs(20);
    while owner.served_replies_in_flight() > 0 {
        assert!(
            Instant::now() < settled_by,
            "the warm read's reply never ended"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }

    let get = {
        let cb = cb.clone();
        let request = get_request(OWNER, &desc, &region, 0, None);
        tokio::spawn(async move { cb.get_into_test_memory(request).await })
    };
    // Shut down only once the read is in flight: the owner is sending its
    // reply (or, on a fast machine, it has already completed). A fixed
    // sleep let a loaded machine shut down before the read left the
    // consumer's queue, which then fails `ShuttingDown` with nothing read.
    let in_flight_by = Instant::now() + Duration::from_secs(20);
    while owner.served_replies_in_flight() == 0 && !get.is_finished() {
        assert!(
            Instant::now() < in_flight_by,
            "the GET never reached the owner"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    consumer.shutdown().await;
    let answer = get.await.unwrap();
    assert!(
        matches!(answer, Ok(()) | Err(RdmaError::ShuttingDown)),
        "a GET in flight at teardown answered {answer:?}"
    );
    assert!(
        dst.snapshot() == want,
        "teardown closed the connection before the GET in flight had landed"
    );
    assert_eq!(consumer.live_registrations(), Some(0));

    // The owner survived and still serves.
    let next = UcxEngine::start(config(Transport::Tcp)).expect("consumer engine starts");
    next.add_peer(OWNER, owner.worker_address()).unwrap();
    let nb = next.backend();
    let next_dst = PageBuf::zeroed(64 * MIB);
    let next_region = map(&nb, &next_dst).await;
    assert_eq!(
        nb.get_into_test_memory(get_request(OWNER, &desc, &next_region, 0, None))
            .await,
        Ok(())
    );
    assert!(
        next_dst.snapshot() == want,
        "bytes served after the first consumer left"
    );
    next.shutdown().await;
    owner.shutdown().await;
    assert_eq!(owner.live_registrations(), Some(0));
    drop((dst, next_dst, src));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_after_shutdown_answers_shutting_down_but_unmaps_of_released_ids() {
    let (owner, consumer) = engines(Transport::SameHost);
    let cb = consumer.backend();
    let buf = PageBuf::zeroed(4096);
    let region = map(&cb, &buf).await;
    consumer.shutdown().await;
    consumer.shutdown().await; // Idempotent.

    assert_eq!(cb.live_registrations(), Some(0));
    assert_eq!(
        cb.map_test_memory(buf.addr(), 4096).await,
        Err(RdmaError::ShuttingDown)
    );
    // Teardown released the region: unmapping it again is the idempotent
    // unmap of a released id, `Ok` as the contract says for every backend.
    assert_eq!(cb.unmap(region.backend_region_id).await, Ok(()));
    let request = get_request(OWNER, &describe(&buf, &region), &region, 0, None);
    assert_eq!(
        cb.get_into_test_memory(request).await,
        Err(RdmaError::ShuttingDown)
    );
    assert_eq!(
        consumer.add_peer(PeerId(7), owner.worker_address()),
        Err(RdmaError::ShuttingDown)
    );
    assert_eq!(consumer.remove_peer(OWNER), Err(RdmaError::ShuttingDown));
    owner.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_an_engine_without_shutdown_is_bounded_and_releases_everything() {
    let (owner, consumer) = engines(Transport::SameHost);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let bufs: Vec<PageBuf> = (0..3).map(|_| PageBuf::zeroed(MIB)).collect();
    for buf in &bufs {
        map(&cb, buf).await;
    }
    let src = PageBuf::filled(4096, pattern);
    map(&ob, &src).await;

    let started = Instant::now();
    drop(consumer);
    drop(owner);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "dropping two engines took {:?}",
        started.elapsed()
    );
    assert_eq!(cb.live_registrations(), Some(0));
    assert_eq!(ob.live_registrations(), Some(0));
    assert_eq!(
        cb.map_test_memory(bufs[0].addr(), 10).await,
        Err(RdmaError::ShuttingDown)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmap_racing_shutdown_is_answered_by_what_happened_to_the_region() {
    let (owner, consumer) = engines(Transport::Tcp);
    let cb = consumer.backend();
    let buf = PageBuf::zeroed(4096);
    let region = map(&cb, &buf).await;
    let unmap = cb.unmap(region.backend_region_id);
    consumer.shutdown().await;
    // Whether the unmap ran before teardown or teardown unmapped the region,
    // it is no longer registered, so the answer is Ok.
    assert_eq!(unmap.await, Ok(()));
    assert_eq!(consumer.live_registrations(), Some(0));
    owner.shutdown().await;
}
