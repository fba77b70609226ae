//! `unregister(timeout)` and `shutdown(budget)` are bounded as a whole —
//! including the backend's unmap, which waits for GETs still using the
//! region — say what was still running, and count as surviving only what is
//! really still registered.

use std::time::Duration;

use rdmareg_backend::loopback::FaultOp;
use rdmareg_registry::{RdmaError, UnregisterOutcome};
use tokio::time::Instant;

use crate::common::*;

/// The owner registers a page; the consumer starts a GET of it that its hang
/// gate holds (the loopback pins both regions first). Answers the source
/// guard, the gate and the transfer.
async fn get_held_in_flight(
    owner: &Side,
    consumer: &Side,
) -> (
    rdmareg_registry::RegionGuard,
    rdmareg_backend::loopback::HangGate,
    tokio::task::JoinHandle<Result<(), RdmaError>>,
) {
    let source = owner
        .registry
        .register_owned(pattern(page(), 9))
        .await
        .unwrap();
    let descriptor = source.descriptor().unwrap();
    let mut buf = consumer.registry.alloc_pinned(page()).await.unwrap();
    let hold = consumer.backend.faults().hang(FaultOp::Get);
    let transfer = tokio::spawn({
        let registry = consumer.registry.clone();
        async move { registry.get(OWNER, &descriptor, &mut buf).await }
    });
    hold.until_waiting(1).await;
    (source, hold, transfer)
}

#[tokio::test(start_paused = true)]
async fn unregister_returns_within_its_timeout_while_a_get_reads_the_region_and_names_the_transfer()
{
    let (_fabric, owner, consumer) = two_sides(small_config());
    let (source, hold, transfer) = get_held_in_flight(&owner, &consumer).await;
    let watch = source.watch();

    let timeout = Duration::from_millis(50);
    let started = Instant::now();
    let outcome = within(
        Duration::from_secs(1),
        "unregister with a GET of the region in flight",
        source.unregister(timeout),
    )
    .await
    .unwrap();
    let took = started.elapsed();
    assert!(took <= timeout + Duration::from_millis(1), "took {took:?}");
    let UnregisterOutcome::UnmapPending {
        readers, transfers, ..
    } = outcome
    else {
        panic!("the unmap cannot be confirmed while the GET runs: {outcome:?}");
    };
    assert_eq!(
        (readers, transfers),
        (0, Some(1)),
        "the GET reading the region is named"
    );
    assert_ne!((readers, transfers), (0, None), "something is named");
    assert!(
        !watch.is_deregistered(),
        "still registered while the GET runs"
    );
    assert_eq!(owner.live(), 1);

    // The GET lands; the unmap carried on in the background completes.
    hold.release();
    transfer.await.unwrap().unwrap();
    within(
        Duration::from_secs(1),
        "deregistered after the late unmap",
        watch.deregistered(),
    )
    .await;
    assert_eq!(owner.live(), 0);
    assert_eq!(owner.registered_bytes(), 0);
}

#[tokio::test(start_paused = true)]
async fn unregister_owned_past_its_timeout_is_a_timeout_and_the_buffer_is_released_later() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let (source, hold, transfer) = get_held_in_flight(&owner, &consumer).await;
    let watch = source.watch();
    let refused = within(
        Duration::from_secs(1),
        "unregister_owned with a GET of the region in flight",
        source.unregister_owned(Duration::from_millis(50)),
    )
    .await
    .unwrap_err();
    assert_eq!(refused.error, RdmaError::Timeout);
    assert!(refused.guard.is_none());
    hold.release();
    transfer.await.unwrap().unwrap();
    within(
        Duration::from_secs(1),
        "deregistered after the late unmap",
        watch.deregistered(),
    )
    .await;
    assert_eq!((owner.live(), owner.registry.stats().leaked_bytes), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn shutdown_spends_one_budget_on_the_drain_and_the_unmaps_together() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let (_source, hold, transfer) = get_held_in_flight(&owner, &consumer).await;
    // An owner registration stuck in its map keeps the drain busy.
    let map_hold = owner.backend.faults().hang(FaultOp::Map);
    let stuck = tokio::spawn({
        let registry = owner.registry.clone();
        async move { registry.register_owned(pattern(page(), 1)).await.is_ok() }
    });
    map_hold.until_waiting(1).await;

    let budget = Duration::from_millis(100);
    let started = Instant::now();
    let swept = owner.registry.shutdown(budget).await;
    let took = started.elapsed();
    assert!(
        took <= budget + Duration::from_millis(1),
        "the drain and the unmaps together took {took:?} of a {budget:?} budget"
    );
    assert!(!swept.report().drained);

    map_hold.release();
    hold.release();
    transfer.await.unwrap().unwrap();
    assert!(stuck.await.unwrap(), "the late registration still answers");
    let _ = owner.registry.shutdown(budget).await;
}

#[tokio::test(start_paused = true)]
async fn a_region_the_backend_unmaps_after_the_shutdown_budget_is_no_survivor() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let (source, hold, transfer) = get_held_in_flight(&owner, &consumer).await;
    let watch = source.watch();

    let swept = owner.registry.shutdown(Duration::from_millis(100)).await;
    let report = swept.report();
    assert_eq!(
        (report.regions_surviving, report.regions_unmap_pending),
        (0, 1),
        "not refused, only not confirmed yet: {report:?}"
    );

    // The GET lands, and with it the unmap the sweep submitted.
    hold.release();
    transfer.await.unwrap().unwrap();
    within(
        Duration::from_secs(1),
        "the region is released by its late unmap, before any teardown",
        watch.deregistered(),
    )
    .await;
    assert_eq!(swept.report().regions_registered, 0);
    owner.backend.shutdown().await;
    let report = swept.finish_after_backend_teardown();
    assert_eq!(
        (
            report.released,
            report.regions_released_after_teardown,
            report.arenas_released_after_teardown,
            report.backend_live
        ),
        (true, 0, 0, Some(0)),
        "a region unmapped after the budget is not reported as a survivor"
    );
    drop(source);
}
