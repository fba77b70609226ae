//! Teardown of a loopback instance: what it refuses, what it waits for, what
//! it force-unmaps, and the wedged backend fault injection simulates.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use rdmareg_backend::loopback::FaultOp;
use rdmareg_backend::{RdmaBackend, RdmaError};

use common::{OWNER, SeamForTestMemory, TestMemory, get, pair, settle};

mod force_unmap {
    use super::*;

    #[tokio::test]
    async fn shutdown_force_unmaps_every_region() {
        let (_fabric, owner, _consumer) = pair();
        let mems: Vec<TestMemory> = (1..=3).map(|n| TestMemory::blank(n * 100)).collect();
        for mem in &mems {
            owner.map_test_memory(mem.addr(), mem.len()).await.unwrap();
        }
        assert_eq!(owner.live_registrations(), Some(3));
        owner.shutdown().await;
        assert_eq!(owner.live_registrations(), Some(0));
        assert_eq!(owner.stats().unmaps, 3);
        assert!(owner.is_shutting_down());
    }

    #[tokio::test]
    async fn shutdown_is_idempotent_and_may_run_concurrently() {
        let (_fabric, owner, _consumer) = pair();
        let mem = TestMemory::blank(64);
        owner.map_test_memory(mem.addr(), 64).await.unwrap();
        tokio::join!(owner.shutdown(), owner.shutdown());
        owner.shutdown().await;
        assert_eq!(owner.live_registrations(), Some(0));
        assert_eq!(owner.stats().unmaps, 1);
    }

    #[tokio::test]
    async fn shutdown_with_refused_unmaps_leaves_regions_registered() {
        let (_fabric, owner, _consumer) = pair();
        let (a, b) = (TestMemory::blank(64), TestMemory::blank(64));
        let ra = owner.map_test_memory(a.addr(), 64).await.unwrap();
        owner.map_test_memory(b.addr(), 64).await.unwrap();
        owner.faults().refuse_unmaps(true);
        owner.shutdown().await;
        assert_eq!(
            owner.live_registrations(),
            Some(2),
            "a wedged backend keeps its regions"
        );
        assert_eq!(
            owner.unmap(ra.backend_region_id).await,
            Err(RdmaError::ShuttingDown),
            "an unmap of a region still held after teardown began"
        );
        owner.faults().refuse_unmaps(false);
        owner.shutdown().await;
        assert_eq!(
            owner.live_registrations(),
            Some(0),
            "a second shutdown releases them"
        );
    }

    #[tokio::test]
    async fn shutdown_completes_an_unmap_submitted_before_unmaps_were_refused() {
        let (_fabric, owner, _consumer) = pair();
        let (a, b) = (TestMemory::blank(64), TestMemory::blank(64));
        let ra = owner.map_test_memory(a.addr(), 64).await.unwrap();
        owner.map_test_memory(b.addr(), 64).await.unwrap();
        owner
            .faults()
            .set_delay(FaultOp::Unmap, Duration::from_secs(3600));
        let unmap = {
            let (owner, id) = (Arc::clone(&owner), ra.backend_region_id);
            tokio::spawn(async move { owner.unmap(id).await })
        };
        settle().await;
        owner.faults().refuse_unmaps(true);
        owner.shutdown().await;
        assert_eq!(unmap.await.unwrap(), Ok(()));
        assert_eq!(
            owner.live_registrations(),
            Some(1),
            "only the refused region stays"
        );
    }
}

mod refusals {
    use super::*;

    #[tokio::test]
    async fn after_shutdown_maps_and_gets_are_refused_and_gone_regions_unmap_ok() {
        let (_fabric, owner, consumer) = pair();
        let (src, dst) = (TestMemory::pattern(64), TestMemory::blank(64));
        let s = owner.map_test_memory(src.addr(), 64).await.unwrap();
        let d = consumer.map_test_memory(dst.addr(), 64).await.unwrap();
        consumer.shutdown().await;
        assert_eq!(
            consumer.map_test_memory(dst.addr(), 64).await.map(|_| ()),
            Err(RdmaError::ShuttingDown)
        );
        assert_eq!(
            consumer
                .get_into_test_memory(get(OWNER, &s, src.addr(), &d, 0, 64))
                .await,
            Err(RdmaError::ShuttingDown)
        );
        assert_eq!(
            consumer.unmap(d.backend_region_id).await,
            Ok(()),
            "the region is gone"
        );
        assert_eq!(dst.bytes(), TestMemory::blank(64).bytes());
    }

    #[tokio::test]
    async fn get_from_a_peer_that_shut_down_is_a_backend_error() {
        let (_fabric, owner, consumer) = pair();
        let (src, dst) = (TestMemory::pattern(64), TestMemory::blank(64));
        let s = owner.map_test_memory(src.addr(), 64).await.unwrap();
        let d = consumer.map_test_memory(dst.addr(), 64).await.unwrap();
        // Wedged, so the source registration is still there to be refused.
        owner.faults().refuse_unmaps(true);
        owner.shutdown().await;
        let answer = consumer
            .get_into_test_memory(get(OWNER, &s, src.addr(), &d, 0, 64))
            .await;
        assert!(
            matches!(&answer, Err(RdmaError::Backend(text)) if text.contains("shutting down")),
            "{answer:?}"
        );
        assert_eq!(dst.bytes(), TestMemory::blank(64).bytes());
    }
}

mod in_flight_work {
    use super::*;

    #[tokio::test]
    async fn shutdown_answers_a_hung_get_and_then_releases_its_regions() {
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
        consumer.shutdown().await;
        assert_eq!(transfer.await.unwrap(), Err(RdmaError::ShuttingDown));
        assert_eq!(consumer.live_registrations(), Some(0));
        assert_eq!(dst.bytes(), TestMemory::blank(64).bytes());
    }

    #[tokio::test]
    async fn owner_shutdown_answers_a_hung_get_reading_from_it() {
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
        owner.shutdown().await;
        let answer = transfer.await.unwrap();
        assert!(matches!(answer, Err(RdmaError::Backend(_))), "{answer:?}");
        assert_eq!(owner.live_registrations(), Some(0));
        assert_eq!(consumer.live_registrations(), Some(1));
        assert_eq!(consumer.unmap(d.backend_region_id).await, Ok(()));
    }

    #[tokio::test]
    async fn shutdown_waits_for_a_submitted_get_that_nobody_polls() {
        let (_fabric, owner, consumer) = pair();
        let (src, dst) = (TestMemory::pattern(64), TestMemory::blank(64));
        let s = owner.map_test_memory(src.addr(), 64).await.unwrap();
        let d = consumer.map_test_memory(dst.addr(), 64).await.unwrap();
        let _gate = consumer.faults().hang(FaultOp::Get);
        let mut transfer = consumer.get_into_test_memory(get(OWNER, &s, src.addr(), &d, 0, 64));
        assert!(futures::poll!(transfer.as_mut()).is_pending());

        let mut shutdown = std::pin::pin!(consumer.shutdown());
        assert!(futures::poll!(shutdown.as_mut()).is_pending());
        settle().await;
        assert!(
            futures::poll!(shutdown.as_mut()).is_pending(),
            "shutdown ignored a pinned region"
        );
        assert_eq!(transfer.await, Err(RdmaError::ShuttingDown));
        shutdown.await;
        assert_eq!(consumer.live_registrations(), Some(0));
    }

    #[tokio::test]
    async fn shutdown_answers_a_hung_map_without_registering() {
        let (_fabric, owner, _consumer) = pair();
        let mem = TestMemory::blank(64);
        let gate = owner.faults().hang(FaultOp::Map);
        let map = {
            let (owner, addr) = (Arc::clone(&owner), mem.addr());
            tokio::spawn(async move { owner.map_test_memory(addr, 64).await.map(|_| ()) })
        };
        gate.until_waiting(1).await;
        owner.shutdown().await;
        assert_eq!(map.await.unwrap(), Err(RdmaError::ShuttingDown));
        assert_eq!(owner.live_registrations(), Some(0));
    }
}
