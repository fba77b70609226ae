//! Shutdown: deregisters everything, is idempotent, waits for transfers in
//! flight but not for buffers merely held, is bounded by its budget, and
//! unmaps regardless once the budget is spent; once its finish returns, no
//! region is left in the figures, whatever other threads still release.

use std::time::Duration;

use rdmareg_backend::loopback::FaultOp;
use rdmareg_registry::UnregisterOutcome;
use tokio::time::Instant;

use crate::common::*;

#[tokio::test(start_paused = true)]
async fn shutdown_deregisters_everything_and_is_idempotent() {
    let (_fabric, side) = one_side(small_config());
    let owned = side
        .registry
        .register_owned(pattern(page(), 1))
        .await
        .unwrap();
    let memory = External::new(page(), 2);
    // SAFETY: `memory` outlives the registration: it is dropped after the
    // latch resolved (asserted below).
    let external = unsafe { side.registry.register_external(memory.ptr(), page()) }
        .await
        .unwrap();
    let pooled = side.registry.alloc_pinned(100).await.unwrap();
    let dedicated = side.registry.alloc_pinned(200 * KIB).await.unwrap();

    let first = side.registry.shutdown(Duration::from_secs(1)).await;
    let report = first.report();
    assert!(report.drained);
    assert_eq!(
        (
            report.regions_deregistered,
            report.arenas_deregistered,
            report.regions_surviving,
            report.arenas_surviving
        ),
        (2, 2, 0, 0)
    );
    assert!(owned.is_deregistered() && external.is_deregistered());
    assert_eq!(side.live(), 0);
    assert_eq!(side.registered_bytes(), 0);

    let second = side.registry.shutdown(Duration::from_secs(1)).await;
    assert_eq!(
        (
            second.report().regions_deregistered,
            second.report().arenas_deregistered
        ),
        (0, 0)
    );
    side.backend.shutdown().await;
    for swept in [&first, &second] {
        let report = swept.finish_after_backend_teardown();
        assert_eq!(
            (
                report.released,
                report.regions_released_after_teardown,
                report.arenas_released_after_teardown,
                report.backend_live
            ),
            (true, 0, 0, Some(0))
        );
    }
    assert_eq!(
        external.unregister(Duration::from_secs(60)).await,
        Ok(UnregisterOutcome::Drained)
    );
    drop(memory);
    drop((owned, pooled, dedicated));
    assert_eq!(side.registry.stats().leaked_bytes, 0);
}

#[tokio::test(start_paused = true)]
async fn shutdown_waits_for_transfers_in_flight() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let source = owner
        .registry
        .register_owned(pattern(page(), 3))
        .await
        .unwrap();
    let descriptor = source.descriptor().unwrap();
    let mut buf = consumer.registry.alloc_pinned(page()).await.unwrap();
    let hold = consumer.backend.faults().hang(FaultOp::Get);
    let transfer = tokio::spawn({
        let registry = consumer.registry.clone();
        async move {
            let result = registry.get(OWNER, &descriptor, &mut buf).await;
            (result, buf)
        }
    });
    hold.until_waiting(1).await;
    let shutdown = tokio::spawn({
        let registry = consumer.registry.clone();
        async move { registry.shutdown(Duration::from_secs(10)).await }
    });
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(!shutdown.is_finished(), "a transfer is in flight");

    hold.release();
    let (result, buf) = transfer.await.unwrap();
    result.unwrap();
    assert_eq!(&buf[..], &pattern(page(), 3)[..]);
    let swept = shutdown.await.unwrap();
    assert!(swept.report().drained);
    assert_eq!(swept.report().arenas_deregistered, 1);
    assert_eq!(consumer.live(), 0);
}

#[tokio::test(start_paused = true)]
async fn shutdown_does_not_wait_for_buffers_merely_held() {
    let (_fabric, side) = one_side(small_config());
    let mut held = side.registry.alloc_pinned(100).await.unwrap();
    held[0] = 42;
    let started = Instant::now();
    let swept = side.registry.shutdown(Duration::from_secs(10)).await;
    assert!(started.elapsed() < Duration::from_millis(10));
    assert!(swept.report().drained);
    assert_eq!(swept.report().arenas_deregistered, 1);
    assert_eq!(side.live(), 0);
    assert_eq!(held[0], 42, "the memory outlives the unmap while held");
    drop(held);
    assert_eq!(side.registry.stats().leaked_bytes, 0);
}

#[tokio::test(start_paused = true)]
async fn shutdown_is_bounded_by_its_budget_and_then_unmaps_regardless() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let source = owner
        .registry
        .register_owned(pattern(page(), 4))
        .await
        .unwrap();
    let descriptor = source.descriptor().unwrap();
    let bystander = consumer
        .registry
        .register_owned(pattern(page(), 5))
        .await
        .unwrap();
    let mut buf = consumer.registry.alloc_pinned(page()).await.unwrap();
    let hold = consumer.backend.faults().hang(FaultOp::Get);
    let transfer = tokio::spawn({
        let registry = consumer.registry.clone();
        async move {
            let result = registry.get(OWNER, &descriptor, &mut buf).await;
            (result, buf)
        }
    });
    hold.until_waiting(1).await;

    let budget = Duration::from_secs(1);
    let started = Instant::now();
    let swept = consumer.registry.shutdown(budget).await;
    let took = started.elapsed();
    assert!(took >= budget, "it did wait for the transfer: {took:?}");
    assert!(
        took <= budget + Duration::from_millis(10),
        "one budget for the drain and the unmaps: {took:?}"
    );
    let report = swept.report();
    assert!(!report.drained);
    assert_eq!(report.in_flight_at_sweep, 1);
    assert_eq!(
        report.regions_deregistered, 1,
        "the bystander was unmapped anyway"
    );
    assert!(bystander.is_deregistered());
    assert_eq!(
        (report.arenas_surviving, report.arenas_unmap_pending),
        (0, 1),
        "the backend holds the transfer's destination until it lands"
    );

    hold.release();
    let (result, _buf) = transfer.await.unwrap();
    assert!(result.is_ok(), "{result:?}");
    // The unmap the sweep left pending confirms once the transfer landed.
    eventually("the pending arena unmap is confirmed", || {
        swept.report().arenas_registered == 0
    })
    .await;
    consumer.backend.shutdown().await;
    assert_eq!(consumer.live(), 0);
    let report = swept.finish_after_backend_teardown();
    assert_eq!(
        (
            report.released,
            report.regions_released_after_teardown,
            report.arenas_released_after_teardown,
            report.backend_live
        ),
        (true, 0, 0, Some(0))
    );
    assert_eq!(consumer.registered_bytes(), 0);
}

#[tokio::test(start_paused = true)]
async fn guards_learn_that_shutdown_began() {
    let (_fabric, side) = one_side(small_config());
    let guard = side
        .registry
        .register_owned(pattern(page(), 6))
        .await
        .unwrap();
    let began = tokio::spawn(guard.shutdown_initiated());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!began.is_finished() && !guard.is_shutting_down());
    let _swept = side.registry.shutdown(Duration::from_secs(1)).await;
    within(Duration::from_millis(1), "shutdown_initiated", began)
        .await
        .unwrap();
    assert!(guard.is_shutting_down());
}

#[tokio::test(start_paused = true)]
async fn cancelled_shutdown_stays_closed_and_completes_when_called_again() {
    let (_fabric, side) = one_side(small_config());
    let guard = side
        .registry
        .register_owned(pattern(page(), 7))
        .await
        .unwrap();
    side.backend
        .faults()
        .set_delay(FaultOp::Unmap, Duration::from_millis(10));
    let mut shutting_down = Box::pin(side.registry.shutdown(Duration::from_secs(1)));
    assert!(
        futures::poll!(&mut shutting_down).is_pending(),
        "the sweep's unmap is delayed"
    );
    drop(shutting_down);

    assert!(side.registry.is_shutting_down());
    assert!(side.registry.register_owned(pattern(1, 0)).await.is_err());
    assert!(!guard.is_deregistered(), "the unmap was never confirmed");

    side.backend
        .faults()
        .set_delay(FaultOp::Unmap, Duration::ZERO);
    let swept = side.registry.shutdown(Duration::from_secs(1)).await;
    assert_eq!(swept.report().regions_deregistered, 1);
    assert!(guard.is_deregistered());
    assert_eq!(side.live(), 0);
    assert_eq!(side.registered_bytes(), 0);
}

/// Guards dropped just before shutdown unmap their regions on background
/// tasks, which race the sweep and the finish on other threads. Once the
/// finish has released, no region without a reader inside may remain in
/// the table, even one another thread is still releasing: a caller that
/// reads the figures right after the finish sees nothing live.
#[test]
fn a_finish_racing_dropped_guards_leaves_no_region_live() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    for round in 0..1000 {
        runtime.block_on(async {
            let (_fabric, side) = one_side(small_config());
            let mut guards = Vec::new();
            for i in 0..32u8 {
                guards.push(side.registry.register_owned(pattern(64, i)).await.unwrap());
            }
            let watches: Vec<_> = guards.iter().map(|g| g.watch()).collect();
            drop(guards);
            let swept = side.registry.shutdown(Duration::from_secs(5)).await;
            side.backend.shutdown().await;
            let report = swept.finish_after_backend_teardown();
            let live_regions = side.registry.stats().live_regions;
            assert!(report.released, "{report:?}");
            assert_eq!(live_regions, 0, "round {round}: {report:?}");
            for watch in &watches {
                within(Duration::from_secs(5), "the latch", watch.deregistered()).await;
            }
        });
    }
}
