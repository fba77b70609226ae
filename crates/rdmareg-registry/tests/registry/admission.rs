//! The admission gate: work admitted before shutdown is waited for and
//! swept, work after it is refused, and a registration that outlasts the
//! drain still ends deregistered — never pinned and untracked.

use std::time::Duration;

use rdmareg_backend::loopback::FaultOp;
use rdmareg_registry::{Descriptor, RdmaError};

use crate::common::*;

#[tokio::test(start_paused = true)]
async fn registrations_racing_shutdown_are_either_refused_or_swept() {
    let (_fabric, side) = one_side(small_config());
    let hold = side.backend.faults().hang(FaultOp::Map);
    let admitted: Vec<_> = (0..3)
        .map(|i| {
            let registry = side.registry.clone();
            tokio::spawn(async move { registry.register_owned(pattern(page(), i)).await })
        })
        .collect();
    hold.until_waiting(3).await;
    let shutdown = tokio::spawn({
        let registry = side.registry.clone();
        async move { registry.shutdown(Duration::from_secs(10)).await }
    });
    eventually("shutdown begins", || side.registry.is_shutting_down()).await;

    let late = side.registry.register_owned(pattern(page(), 9)).await;
    assert_eq!(late.unwrap_err().error, RdmaError::ShuttingDown);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!shutdown.is_finished(), "shutdown waits for admitted maps");

    hold.release();
    let guards: Vec<_> = futures::future::join_all(admitted)
        .await
        .into_iter()
        .map(|joined| joined.unwrap().expect("admitted before the gate closed"))
        .collect();
    let swept = shutdown.await.unwrap();
    assert!(swept.report().drained);
    assert_eq!(swept.report().regions_deregistered, 3);
    for guard in &guards {
        assert!(guard.is_deregistered(), "swept by shutdown");
    }
    assert_eq!(side.live(), 0);
    assert_eq!(side.registered_bytes(), 0);
}

#[tokio::test(start_paused = true)]
async fn registration_that_outlasts_the_drain_is_deregistered_when_it_lands() {
    let (_fabric, side) = one_side(small_config());
    let hold = side.backend.faults().hang(FaultOp::Map);
    let registering = tokio::spawn({
        let registry = side.registry.clone();
        async move { registry.register_owned(pattern(page(), 1)).await }
    });
    hold.until_waiting(1).await;
    let swept = side.registry.shutdown(Duration::from_millis(100)).await;
    assert!(!swept.report().drained);
    assert_eq!(swept.report().in_flight_at_sweep, 1);

    hold.release();
    let guard = registering.await.unwrap().expect("the map was admitted");
    assert!(guard.is_shutting_down());
    within(
        Duration::from_secs(5),
        "late registration released",
        guard.deregistered(),
    )
    .await;
    assert_eq!(side.live(), 0);
    assert_eq!(side.registered_bytes(), 0);
    let (buffer, _) = guard
        .unregister_owned(Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(buffer, pattern(page(), 1));
}

#[tokio::test(start_paused = true)]
async fn allocation_that_outlasts_the_drain_is_refused_and_its_arena_released() {
    let (_fabric, side) = one_side(small_config());
    let hold = side.backend.faults().hang(FaultOp::Map);
    let allocating = tokio::spawn({
        let registry = side.registry.clone();
        async move { registry.alloc_pinned(100).await }
    });
    hold.until_waiting(1).await;
    let _swept = side.registry.shutdown(Duration::from_millis(100)).await;
    hold.release();
    assert_eq!(
        allocating.await.unwrap().unwrap_err(),
        RdmaError::ShuttingDown
    );
    eventually("late arena released", || side.live() == 0).await;
    eventually("charge returned", || side.registered_bytes() == 0).await;
    let stats = side.registry.stats();
    assert_eq!((stats.pooled_arenas, stats.leaked_bytes), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn every_entry_is_refused_after_shutdown() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let source = owner
        .registry
        .register_owned(pattern(page(), 1))
        .await
        .unwrap();
    let descriptor: Descriptor = source.descriptor().unwrap();
    let mut buf = consumer.registry.alloc_pinned(page()).await.unwrap();
    let _swept = consumer.registry.shutdown(Duration::from_secs(1)).await;

    assert_eq!(
        consumer
            .registry
            .register_owned(pattern(10, 0))
            .await
            .unwrap_err()
            .error,
        RdmaError::ShuttingDown
    );
    let memory = External::new(page(), 0);
    // SAFETY: refused before anything is mapped; `memory` outlives the call.
    let external = unsafe { consumer.registry.register_external(memory.ptr(), page()) }.await;
    assert_eq!(external.unwrap_err(), RdmaError::ShuttingDown);
    assert_eq!(
        consumer.registry.alloc_pinned(10).await.unwrap_err(),
        RdmaError::ShuttingDown
    );
    assert!(consumer.registry.try_alloc_pinned(10).is_none());
    assert_eq!(
        consumer.registry.get(OWNER, &descriptor, &mut buf).await,
        Err(RdmaError::ShuttingDown)
    );
    assert!(
        !buf.is_surrendered(),
        "a refused GET leaves the buffer alone"
    );
    source.unregister(Duration::from_secs(60)).await.unwrap();
}
