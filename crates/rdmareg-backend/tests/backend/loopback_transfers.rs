//! GETs of the loopback backend: what they copy, how they hold both regions
//! against unmaps, deadlines, and how keys and peers are checked.

use crate::common;

use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use futures::FutureExt;
use rdmareg_backend::loopback::{FaultOp, LoopbackConfig, page_size};
use rdmareg_backend::{PeerId, RdmaBackend, RdmaError};
use tokio::time::Instant;

use common::{CONSUMER, FILL, OWNER, SeamForTestMemory, TestMemory, get, pair, settle};

mod copies {
    use super::*;

    #[tokio::test]
    async fn get_copies_the_named_bytes_and_counts_them() {
        let (_fabric, owner, consumer) = pair();
        let (src, dst) = (TestMemory::pattern(1000), TestMemory::blank(1000));
        let s = owner.map_test_memory(src.addr(), 1000).await.unwrap();
        let d = consumer.map_test_memory(dst.addr(), 1000).await.unwrap();
        let mut request = get(OWNER, &s, src.addr(), &d, 500, 300);
        request.remote_addr += 7;
        consumer.get_into_test_memory(request).await.unwrap();
        let (src_bytes, dst_bytes) = (src.bytes(), dst.bytes());
        assert_eq!(&dst_bytes[500..800], &src_bytes[7..307]);
        assert!(
            dst_bytes[..500]
                .iter()
                .chain(&dst_bytes[800..])
                .all(|&b| b == FILL)
        );
        let stats = consumer.stats();
        assert_eq!((stats.gets_completed, stats.bytes_copied), (1, 300));
        assert_eq!(owner.stats().maps, 1);
    }

    #[tokio::test]
    async fn get_within_one_instance_copies_overlapping_ranges_like_memmove() {
        let (_fabric, _owner, consumer) = pair();
        let mem = TestMemory::pattern(100);
        let region = consumer.map_test_memory(mem.addr(), 100).await.unwrap();
        let before = mem.bytes();
        let request = get(CONSUMER, &region, mem.addr(), &region, 10, 50);
        consumer.get_into_test_memory(request).await.unwrap();
        let after = mem.bytes();
        assert_eq!(&after[10..60], &before[0..50]);
        assert_eq!(&after[..10], &before[..10]);
        assert_eq!(&after[60..], &before[60..]);
    }

    #[tokio::test]
    async fn effective_range_is_the_page_enclosing_range_of_the_mapped_bytes() {
        let (_fabric, owner, _consumer) = pair();
        let page = page_size();
        assert!(page.is_power_of_two());
        let mem = TestMemory::blank(3 * page as usize);
        let ptr = mem.addr() + 5;
        let len = page as usize;
        let region = owner.map_test_memory(ptr, len).await.unwrap();
        assert_eq!(region.effective_addr % page, 0);
        assert_eq!(region.effective_len % page, 0);
        assert!(region.effective_addr <= ptr as u64);
        assert!(region.effective_addr + region.effective_len >= (ptr + len) as u64);
        assert!(region.effective_len <= 2 * page);
        owner.unmap(region.backend_region_id).await.unwrap();
    }

    #[tokio::test]
    async fn mapping_the_same_bytes_twice_gives_two_registrations_with_distinct_keys() {
        let (_fabric, owner, _consumer) = pair();
        let mem = TestMemory::blank(64);
        let a = owner.map_test_memory(mem.addr(), 64).await.unwrap();
        let b = owner.map_test_memory(mem.addr(), 64).await.unwrap();
        assert_ne!(a.backend_region_id, b.backend_region_id);
        assert_ne!(a.packed_key, b.packed_key);
        assert_eq!(owner.live_registrations(), Some(2));
        owner.unmap(a.backend_region_id).await.unwrap();
        owner.unmap(b.backend_region_id).await.unwrap();
    }

    #[tokio::test]
    async fn map_whose_page_rounding_overflows_is_out_of_range() {
        let (_fabric, owner, _consumer) = pair();
        let answer = owner
            .map_test_memory(usize::MAX - 100, 50)
            .await
            .map(|_| ());
        assert_eq!(answer, Err(RdmaError::OutOfRange));
        assert_eq!(owner.live_registrations(), Some(0));
    }
}

mod held_regions {
    use super::*;

    /// Spawn a GET held at a fresh hang gate of `consumer`, and wait until it
    /// is submitted (both regions pinned).
    async fn held_get(
        consumer: &Arc<rdmareg_backend::loopback::LoopbackBackend>,
        request: rdmareg_backend::BackendGet,
    ) -> (
        rdmareg_backend::loopback::HangGate,
        tokio::task::JoinHandle<Result<(), RdmaError>>,
    ) {
        let gate = consumer.faults().hang(FaultOp::Get);
        let task = {
            let consumer = Arc::clone(consumer);
            tokio::spawn(async move { consumer.get_into_test_memory(request).await })
        };
        gate.until_waiting(1).await;
        (gate, task)
    }

    #[tokio::test]
    async fn unmap_of_a_destination_waits_for_the_get_in_flight() {
        let (_fabric, owner, consumer) = pair();
        let (src, dst) = (TestMemory::pattern(4096), TestMemory::blank(4096));
        let s = owner.map_test_memory(src.addr(), 4096).await.unwrap();
        let d = consumer.map_test_memory(dst.addr(), 4096).await.unwrap();
        let (gate, transfer) = held_get(&consumer, get(OWNER, &s, src.addr(), &d, 0, 4096)).await;

        let unmap = {
            let (consumer, id) = (Arc::clone(&consumer), d.backend_region_id);
            tokio::spawn(async move { consumer.unmap(id).await })
        };
        settle().await;
        assert!(
            !unmap.is_finished(),
            "unmap answered while the GET was in flight"
        );
        assert_eq!(consumer.live_registrations(), Some(1));
        assert_eq!(
            consumer
                .get_into_test_memory(get(OWNER, &s, src.addr(), &d, 0, 8))
                .await,
            Err(RdmaError::RegionNotFound),
            "a new GET into a destination being unmapped"
        );
        assert!(!unmap.is_finished());
        gate.release();
        assert_eq!(transfer.await.unwrap(), Ok(()));
        assert_eq!(unmap.await.unwrap(), Ok(()));
        assert_eq!(dst.bytes(), src.bytes());
        assert_eq!(consumer.live_registrations(), Some(0));
    }

    #[tokio::test]
    async fn owner_unmap_of_a_source_waits_for_the_get_in_flight() {
        let (_fabric, owner, consumer) = pair();
        let (src, dst) = (TestMemory::pattern(4096), TestMemory::blank(4096));
        let s = owner.map_test_memory(src.addr(), 4096).await.unwrap();
        let d = consumer.map_test_memory(dst.addr(), 4096).await.unwrap();
        let (gate, transfer) = held_get(&consumer, get(OWNER, &s, src.addr(), &d, 0, 4096)).await;

        let unmap = {
            let (owner, id) = (Arc::clone(&owner), s.backend_region_id);
            tokio::spawn(async move { owner.unmap(id).await })
        };
        settle().await;
        assert!(
            !unmap.is_finished(),
            "source unmap answered while a GET read it"
        );
        assert_eq!(owner.live_registrations(), Some(1));
        assert_eq!(
            consumer
                .get_into_test_memory(get(OWNER, &s, src.addr(), &d, 0, 8))
                .await,
            Err(RdmaError::RegionNotFound),
            "a new GET from a source being unmapped"
        );
        assert!(!unmap.is_finished());
        gate.release();
        assert_eq!(transfer.await.unwrap(), Ok(()));
        assert_eq!(unmap.await.unwrap(), Ok(()));
        assert_eq!(dst.bytes(), src.bytes());
        assert_eq!(owner.live_registrations(), Some(0));
    }

    #[tokio::test]
    async fn dropped_get_abandons_its_copy_and_releases_both_regions() {
        let (_fabric, owner, consumer) = pair();
        let (src, dst) = (TestMemory::pattern(4096), TestMemory::blank(4096));
        let s = owner.map_test_memory(src.addr(), 4096).await.unwrap();
        let d = consumer.map_test_memory(dst.addr(), 4096).await.unwrap();
        let gate = consumer.faults().hang(FaultOp::Get);
        let mut transfer = consumer.get_into_test_memory(get(OWNER, &s, src.addr(), &d, 0, 4096));
        assert!(matches!(futures::poll!(transfer.as_mut()), Poll::Pending));
        assert_eq!(gate.waiting(), 1);

        let mut unmap = consumer.unmap(d.backend_region_id);
        assert!(matches!(futures::poll!(unmap.as_mut()), Poll::Pending));
        drop(transfer);
        assert_eq!(unmap.await, Ok(()));
        assert_eq!(
            owner.unmap(s.backend_region_id).now_or_never(),
            Some(Ok(()))
        );
        assert_eq!(
            dst.bytes(),
            TestMemory::blank(4096).bytes(),
            "an abandoned GET wrote"
        );
        assert_eq!(consumer.stats().gets_failed, 1);
    }
}

mod deadlines {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn get_past_its_deadline_times_out_and_releases_both_regions() {
        let (_fabric, owner, consumer) = pair();
        let (src, dst) = (TestMemory::pattern(64), TestMemory::blank(64));
        let s = owner.map_test_memory(src.addr(), 64).await.unwrap();
        let d = consumer.map_test_memory(dst.addr(), 64).await.unwrap();
        consumer
            .faults()
            .set_delay(FaultOp::Get, Duration::from_secs(10));
        let mut request = get(OWNER, &s, src.addr(), &d, 0, 64);
        request.deadline = Some(Duration::from_secs(1));
        let start = Instant::now();
        assert_eq!(
            consumer.get_into_test_memory(request).await,
            Err(RdmaError::Timeout)
        );
        assert_eq!(start.elapsed(), Duration::from_secs(1));
        assert_eq!(dst.bytes(), TestMemory::blank(64).bytes());
        assert_eq!(
            consumer.unmap(d.backend_region_id).now_or_never(),
            Some(Ok(()))
        );
        assert_eq!(
            owner.unmap(s.backend_region_id).now_or_never(),
            Some(Ok(()))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn get_without_a_deadline_uses_the_configured_default() {
        let (fabric, owner, _consumer) = pair();
        let consumer = fabric.backend_with_config(
            PeerId(7),
            LoopbackConfig::default().with_default_get_deadline(Duration::from_secs(2)),
        );
        let (src, dst) = (TestMemory::pattern(64), TestMemory::blank(64));
        let s = owner.map_test_memory(src.addr(), 64).await.unwrap();
        let d = consumer.map_test_memory(dst.addr(), 64).await.unwrap();
        let _gate = consumer.faults().hang(FaultOp::Get);
        let mut request = get(OWNER, &s, src.addr(), &d, 0, 64);
        request.deadline = None;
        let start = Instant::now();
        assert_eq!(
            consumer.get_into_test_memory(request).await,
            Err(RdmaError::Timeout)
        );
        assert_eq!(start.elapsed(), Duration::from_secs(2));
    }
}

mod keys_and_peers {
    use super::*;

    #[tokio::test]
    async fn stale_key_after_unmap_is_region_not_found() {
        let (_fabric, owner, consumer) = pair();
        let (src, dst) = (TestMemory::pattern(64), TestMemory::blank(64));
        let s = owner.map_test_memory(src.addr(), 64).await.unwrap();
        let d = consumer.map_test_memory(dst.addr(), 64).await.unwrap();
        owner.unmap(s.backend_region_id).await.unwrap();
        // The same bytes registered again do not revive the old key.
        let _again = owner.map_test_memory(src.addr(), 64).await.unwrap();
        assert_eq!(
            consumer
                .get_into_test_memory(get(OWNER, &s, src.addr(), &d, 0, 64))
                .await,
            Err(RdmaError::RegionNotFound)
        );
        assert_eq!(dst.bytes(), TestMemory::blank(64).bytes());
    }

    #[tokio::test]
    async fn key_of_a_replaced_instance_is_region_not_found() {
        let (fabric, owner, consumer) = pair();
        let (src, dst) = (TestMemory::pattern(64), TestMemory::blank(64));
        let s = owner.map_test_memory(src.addr(), 64).await.unwrap();
        let d = consumer.map_test_memory(dst.addr(), 64).await.unwrap();
        let restarted = fabric.backend(OWNER);
        let _fresh = restarted.map_test_memory(src.addr(), 64).await.unwrap();
        assert_eq!(
            consumer
                .get_into_test_memory(get(OWNER, &s, src.addr(), &d, 0, 64))
                .await,
            Err(RdmaError::RegionNotFound)
        );
    }

    #[tokio::test]
    async fn key_presented_to_another_peer_is_region_not_found() {
        let (fabric, owner, consumer) = pair();
        let other = fabric.backend(PeerId(3));
        let (src, dst) = (TestMemory::pattern(64), TestMemory::blank(64));
        let s = owner.map_test_memory(src.addr(), 64).await.unwrap();
        let _o = other.map_test_memory(src.addr(), 64).await.unwrap();
        let d = consumer.map_test_memory(dst.addr(), 64).await.unwrap();
        assert_eq!(
            consumer
                .get_into_test_memory(get(PeerId(3), &s, src.addr(), &d, 0, 64))
                .await,
            Err(RdmaError::RegionNotFound)
        );
    }

    #[tokio::test]
    async fn key_with_a_flipped_nonce_bit_is_region_not_found() {
        let (_fabric, owner, consumer) = pair();
        let (src, dst) = (TestMemory::pattern(64), TestMemory::blank(64));
        let s = owner.map_test_memory(src.addr(), 64).await.unwrap();
        let d = consumer.map_test_memory(dst.addr(), 64).await.unwrap();
        let mut request = get(OWNER, &s, src.addr(), &d, 0, 64);
        let mut key = request.packed_key.to_vec();
        *key.last_mut().unwrap() ^= 1;
        request.packed_key = key.into();
        assert_eq!(
            consumer.get_into_test_memory(request).await,
            Err(RdmaError::RegionNotFound)
        );
    }

    #[tokio::test]
    async fn get_from_a_dropped_instance_is_not_configured() {
        let (_fabric, owner, consumer) = pair();
        let (src, dst) = (TestMemory::pattern(64), TestMemory::blank(64));
        let s = owner.map_test_memory(src.addr(), 64).await.unwrap();
        let d = consumer.map_test_memory(dst.addr(), 64).await.unwrap();
        drop(owner);
        assert_eq!(
            consumer
                .get_into_test_memory(get(OWNER, &s, src.addr(), &d, 0, 64))
                .await,
            Err(RdmaError::NotConfigured)
        );
    }
}

/// Notices sent from many threads at once each arrive: the loopback
/// backend numbers and delivers each notice in one step, so none is
/// overtaken by a later number and dropped as a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn notices_sent_from_many_threads_all_arrive() {
    use futures::StreamExt;
    use rdmareg_backend::loopback::LoopbackFabric;
    use rdmareg_backend::notices::NoticeLimits;
    let fabric = LoopbackFabric::new();
    // Room for every notice: only a replay could drop one.
    let room = NoticeLimits {
        queued: 800,
        queued_per_sender: 800,
        queued_per_connection: 800,
        ..NoticeLimits::default()
    };
    let owner =
        fabric.backend_with_config(OWNER, LoopbackConfig::default().with_notice_limits(room));
    let consumer = fabric.backend(CONSUMER);
    let mut notices = owner.notices().unwrap();
    let senders: Vec<_> = (0..8u8)
        .map(|task| {
            let consumer = Arc::clone(&consumer);
            tokio::spawn(async move {
                for n in 0..100u8 {
                    consumer
                        .send_notice(OWNER, vec![task, n].into())
                        .await
                        .unwrap();
                }
            })
        })
        .collect();
    for sender in senders {
        sender.await.unwrap();
    }
    let mut received = 0;
    while received < 800 {
        let next = tokio::time::timeout(Duration::from_secs(5), notices.next()).await;
        assert!(matches!(next, Ok(Some(_))), "after {received} notices");
        received += 1;
    }
    assert_eq!(owner.notice_drops().unwrap().total(), 0);
}
