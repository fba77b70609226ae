//! Fault injection of the loopback backend: delays, injected failures, hang
//! gates, refused unmaps, and `clear`.

use crate::common;

use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use futures::FutureExt;
use rdmareg_backend::loopback::FaultOp;
use rdmareg_backend::{RdmaBackend, RdmaError};
use tokio::time::Instant;

use common::{OWNER, SeamForTestMemory, TestMemory, get, pair, settle};

fn is_injected(answer: &Result<impl Sized, RdmaError>) -> bool {
    matches!(answer, Err(RdmaError::Backend(text)) if text.starts_with("injected"))
}

mod delays {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn delayed_map_registers_only_once_the_delay_is_over() {
        let (_fabric, owner, _consumer) = pair();
        owner
            .faults()
            .set_delay(FaultOp::Map, Duration::from_millis(100));
        let mem = TestMemory::blank(64);
        let start = Instant::now();
        let task = {
            let owner = Arc::clone(&owner);
            let addr = mem.addr();
            tokio::spawn(async move { owner.map_test_memory(addr, 64).await })
        };
        tokio::time::sleep(Duration::from_millis(99)).await;
        assert!(!task.is_finished());
        assert_eq!(owner.live_registrations(), Some(0));
        let region = task.await.unwrap().unwrap();
        assert_eq!(start.elapsed(), Duration::from_millis(100));
        assert_eq!(owner.live_registrations(), Some(1));
        owner.unmap(region.backend_region_id).await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn delayed_unmap_refuses_new_gets_at_once_and_counts_the_region_until_done() {
        let (_fabric, owner, consumer) = pair();
        let (src, dst) = (TestMemory::pattern(64), TestMemory::blank(64));
        let s = owner.map_test_memory(src.addr(), 64).await.unwrap();
        let d = consumer.map_test_memory(dst.addr(), 64).await.unwrap();
        consumer
            .faults()
            .set_delay(FaultOp::Unmap, Duration::from_millis(100));

        let unmap = {
            let consumer = Arc::clone(&consumer);
            let id = d.backend_region_id;
            tokio::spawn(async move { consumer.unmap(id).await })
        };
        settle().await;
        assert_eq!(
            consumer
                .get_into_test_memory(get(OWNER, &s, src.addr(), &d, 0, 8))
                .await,
            Err(RdmaError::RegionNotFound)
        );
        assert_eq!(consumer.live_registrations(), Some(1));
        assert_eq!(unmap.await.unwrap(), Ok(()));
        assert_eq!(consumer.live_registrations(), Some(0));
        assert_eq!(dst.bytes(), TestMemory::blank(64).bytes());
    }

    #[tokio::test(start_paused = true)]
    async fn dropping_a_delayed_unmap_after_its_first_poll_still_unmaps() {
        let (_fabric, owner, _consumer) = pair();
        let mem = TestMemory::blank(64);
        let region = owner.map_test_memory(mem.addr(), 64).await.unwrap();
        owner
            .faults()
            .set_delay(FaultOp::Unmap, Duration::from_secs(3600));
        let mut unmap = owner.unmap(region.backend_region_id);
        assert!(unmap.as_mut().now_or_never().is_none());
        drop(unmap);
        assert_eq!(owner.live_registrations(), Some(0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_map_dropped_during_its_delay_registers_nothing() {
        let (_fabric, owner, _consumer) = pair();
        owner
            .faults()
            .set_delay(FaultOp::Map, Duration::from_millis(10));
        let mem = TestMemory::blank(64);
        let mut map = owner.map_test_memory(mem.addr(), 64);
        assert!(matches!(futures::poll!(map.as_mut()), Poll::Pending));
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(map);
        assert_eq!(owner.live_registrations(), Some(0));
        assert_eq!(owner.stats().maps, 0);
    }
}

mod injected_failures {
    use super::*;

    #[tokio::test]
    async fn fail_next_fails_exactly_that_many_maps_and_registers_nothing() {
        let (_fabric, owner, _consumer) = pair();
        let mem = TestMemory::blank(64);
        owner.faults().fail_next(FaultOp::Map, 2);
        assert!(is_injected(&owner.map_test_memory(mem.addr(), 64).await));
        assert!(is_injected(&owner.map_test_memory(mem.addr(), 64).await));
        assert_eq!(owner.live_registrations(), Some(0));
        let region = owner.map_test_memory(mem.addr(), 64).await.unwrap();
        assert_eq!(owner.live_registrations(), Some(1));
        owner.unmap(region.backend_region_id).await.unwrap();
    }

    #[tokio::test]
    async fn invalid_requests_do_not_consume_injected_failures() {
        let (_fabric, owner, _consumer) = pair();
        let mem = TestMemory::blank(64);
        owner.faults().fail_next(FaultOp::Map, 1);
        assert_eq!(
            owner.map_test_memory(0, 64).await.map(|_| ()),
            Err(RdmaError::OutOfRange)
        );
        assert!(is_injected(&owner.map_test_memory(mem.addr(), 64).await));
        let region = owner.map_test_memory(mem.addr(), 64).await.unwrap();
        owner.unmap(region.backend_region_id).await.unwrap();
    }

    #[tokio::test]
    async fn failed_unmap_leaves_the_region_registered_and_usable() {
        let (_fabric, owner, consumer) = pair();
        let (src, dst) = (TestMemory::pattern(64), TestMemory::blank(64));
        let s = owner.map_test_memory(src.addr(), 64).await.unwrap();
        let d = consumer.map_test_memory(dst.addr(), 64).await.unwrap();
        owner.faults().fail_next(FaultOp::Unmap, 1);
        assert!(is_injected(&owner.unmap(s.backend_region_id).await));
        assert_eq!(owner.live_registrations(), Some(1));
        consumer
            .get_into_test_memory(get(OWNER, &s, src.addr(), &d, 0, 64))
            .await
            .unwrap();
        assert_eq!(dst.bytes(), src.bytes());
        assert_eq!(owner.unmap(s.backend_region_id).await, Ok(()));
        assert_eq!(owner.live_registrations(), Some(0));
    }

    #[tokio::test]
    async fn failed_get_copies_nothing_and_the_next_one_works() {
        let (_fabric, owner, consumer) = pair();
        let (src, dst) = (TestMemory::pattern(64), TestMemory::blank(64));
        let s = owner.map_test_memory(src.addr(), 64).await.unwrap();
        let d = consumer.map_test_memory(dst.addr(), 64).await.unwrap();
        consumer.faults().fail_next(FaultOp::Get, 1);
        let request = get(OWNER, &s, src.addr(), &d, 0, 64);
        assert!(is_injected(
            &consumer.get_into_test_memory(request.clone()).await
        ));
        assert_eq!(dst.bytes(), TestMemory::blank(64).bytes());
        consumer.get_into_test_memory(request).await.unwrap();
        assert_eq!(dst.bytes(), src.bytes());
        let stats = consumer.stats();
        assert_eq!(
            (stats.gets_failed, stats.gets_completed, stats.bytes_copied),
            (1, 1, 64)
        );
    }

    #[tokio::test]
    async fn unmap_of_an_unknown_id_answers_ok_whatever_the_faults() {
        let (_fabric, owner, _consumer) = pair();
        owner.faults().fail_next(FaultOp::Unmap, 1);
        owner.faults().refuse_unmaps(true);
        let _gate = owner.faults().hang(FaultOp::Unmap);
        assert_eq!(owner.unmap(12345).await, Ok(()));
    }
}

mod hangs {
    use super::*;

    #[tokio::test]
    async fn hung_map_waits_for_the_gate_and_a_dropped_one_registers_nothing() {
        let (_fabric, owner, _consumer) = pair();
        let mem = TestMemory::blank(64);
        let gate = owner.faults().hang(FaultOp::Map);

        let abandoned = {
            let (owner, addr) = (Arc::clone(&owner), mem.addr());
            tokio::spawn(async move { owner.map_test_memory(addr, 64).await })
        };
        gate.until_waiting(1).await;
        abandoned.abort();
        assert!(abandoned.await.unwrap_err().is_cancelled());
        assert_eq!(gate.waiting(), 0);
        assert_eq!(owner.live_registrations(), Some(0));

        let held = {
            let (owner, addr) = (Arc::clone(&owner), mem.addr());
            tokio::spawn(async move { owner.map_test_memory(addr, 64).await })
        };
        gate.until_waiting(1).await;
        assert_eq!(owner.live_registrations(), Some(0));
        gate.release();
        let region = held.await.unwrap().unwrap();
        assert_eq!(owner.live_registrations(), Some(1));
        // A released gate holds nothing any more.
        let again = owner.map_test_memory(mem.addr(), 64).await.unwrap();
        owner.unmap(region.backend_region_id).await.unwrap();
        owner.unmap(again.backend_region_id).await.unwrap();
    }

    #[tokio::test]
    async fn dropping_the_gate_lets_waiting_operations_through() {
        let (_fabric, owner, consumer) = pair();
        let (src, dst) = (TestMemory::pattern(64), TestMemory::blank(64));
        let s = owner.map_test_memory(src.addr(), 64).await.unwrap();
        let d = consumer.map_test_memory(dst.addr(), 64).await.unwrap();
        let gate = consumer.faults().hang(FaultOp::Get);
        let transfer = {
            let consumer = Arc::clone(&consumer);
            let request = get(OWNER, &s, src.addr(), &d, 0, 64);
            tokio::spawn(async move { consumer.get_into_test_memory(request).await })
        };
        gate.until_waiting(1).await;
        assert_eq!(dst.bytes(), TestMemory::blank(64).bytes());
        drop(gate);
        assert_eq!(transfer.await.unwrap(), Ok(()));
        assert_eq!(dst.bytes(), src.bytes());
    }
}

mod refused_unmaps {
    use super::*;

    #[tokio::test]
    async fn refused_unmap_keeps_the_region_registered_until_refusal_is_lifted() {
        let (_fabric, owner, consumer) = pair();
        let (src, dst) = (TestMemory::pattern(64), TestMemory::blank(64));
        let s = owner.map_test_memory(src.addr(), 64).await.unwrap();
        let d = consumer.map_test_memory(dst.addr(), 64).await.unwrap();
        owner.faults().refuse_unmaps(true);
        for _ in 0..3 {
            assert!(is_injected(&owner.unmap(s.backend_region_id).await));
        }
        assert_eq!(owner.live_registrations(), Some(1));
        consumer
            .get_into_test_memory(get(OWNER, &s, src.addr(), &d, 0, 64))
            .await
            .unwrap();
        owner.faults().refuse_unmaps(false);
        assert_eq!(owner.unmap(s.backend_region_id).await, Ok(()));
        assert_eq!(owner.live_registrations(), Some(0));
    }
}

mod clearing {
    use super::*;

    #[tokio::test]
    async fn clear_removes_every_fault_and_releases_held_operations() {
        let (_fabric, owner, consumer) = pair();
        let (src, dst) = (TestMemory::pattern(64), TestMemory::blank(64));
        let s = owner.map_test_memory(src.addr(), 64).await.unwrap();
        let d = consumer.map_test_memory(dst.addr(), 64).await.unwrap();
        let gate = consumer.faults().hang(FaultOp::Get);
        let held = {
            let consumer = Arc::clone(&consumer);
            let request = get(OWNER, &s, src.addr(), &d, 0, 64);
            tokio::spawn(async move { consumer.get_into_test_memory(request).await })
        };
        gate.until_waiting(1).await;
        let faults = consumer.faults();
        faults.set_delay(FaultOp::Map, Duration::from_secs(3600));
        faults.fail_next(FaultOp::Unmap, 5);
        faults.refuse_unmaps(true);

        faults.clear();
        assert_eq!(held.await.unwrap(), Ok(()), "the GET held at the gate");
        assert_eq!(dst.bytes(), src.bytes());
        let mem = TestMemory::blank(64);
        let region = consumer
            .map_test_memory(mem.addr(), 64)
            .now_or_never()
            .unwrap()
            .unwrap();
        assert_eq!(consumer.unmap(region.backend_region_id).await, Ok(()));
        assert_eq!(consumer.unmap(d.backend_region_id).await, Ok(()));
        assert_eq!(consumer.live_registrations(), Some(0));
    }

    #[tokio::test(start_paused = true)]
    async fn faults_are_taken_at_submission_so_clear_does_not_shorten_a_running_delay() {
        let (_fabric, owner, _consumer) = pair();
        let mem = TestMemory::blank(64);
        owner
            .faults()
            .set_delay(FaultOp::Map, Duration::from_millis(100));
        let start = Instant::now();
        let held = {
            let (owner, addr) = (Arc::clone(&owner), mem.addr());
            tokio::spawn(async move { owner.map_test_memory(addr, 64).await })
        };
        settle().await;
        owner.faults().clear();
        let region = held.await.unwrap().unwrap();
        assert_eq!(start.elapsed(), Duration::from_millis(100));
        owner.unmap(region.backend_region_id).await.unwrap();
    }
}
