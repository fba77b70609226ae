//! The release latch: resolves on a confirmed unmap and only then, stays
//! open on an unmap error, is reached by a dropped guard from any thread, and
//! at the end of shutdown only on the backend's word that nothing is
//! registered. Readers hold it open.

use std::sync::mpsc;
use std::time::Duration;

use rdmareg_backend::loopback::FaultOp;
use rdmareg_registry::{RdmaError, UnregisterOutcome};

use crate::common::*;

#[tokio::test(start_paused = true)]
async fn latch_resolves_only_once_the_unmap_is_confirmed() {
    let (_fabric, side) = one_side(small_config());
    let guard = side
        .registry
        .register_owned(pattern(page(), 1))
        .await
        .unwrap();
    let watch = guard.watch();
    let hold = side.backend.faults().hang(FaultOp::Unmap);
    let unregistering = tokio::spawn(guard.unregister(Duration::from_secs(60)));
    hold.until_waiting(1).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!watch.is_deregistered(), "the backend has not answered");
    assert_eq!(side.live(), 1);

    hold.release();
    assert_eq!(unregistering.await.unwrap(), Ok(UnregisterOutcome::Drained));
    assert!(watch.is_deregistered());
    within(
        Duration::from_millis(1),
        "released latch resolves",
        watch.deregistered(),
    )
    .await;
    assert_eq!(side.live(), 0);
    assert_eq!(side.registered_bytes(), 0);
    assert_eq!(side.registry.stats().live_regions, 0);
}

#[tokio::test(start_paused = true)]
async fn unmap_error_leaves_the_latch_open_and_the_region_tracked() {
    let (_fabric, side) = one_side(small_config());
    let guard = side
        .registry
        .register_owned(pattern(page(), 2))
        .await
        .unwrap();
    let charge = guard.effective_range().len;
    let watch = guard.watch();
    side.backend.faults().fail_next(FaultOp::Unmap, 1);
    let error = guard.unregister(Duration::from_secs(60)).await.unwrap_err();
    assert!(matches!(error, RdmaError::Backend(_)), "{error}");
    assert!(
        !watch.is_deregistered(),
        "an error means unknown, not unmapped"
    );
    assert_eq!(side.live(), 1);
    assert_eq!(side.registered_bytes(), charge, "still charged");
    assert_eq!(side.registry.stats().live_regions, 1);
    assert!(watch.read(|_| ()).is_none(), "readers stay refused");

    let swept = side.registry.shutdown(Duration::from_secs(1)).await;
    assert_eq!(swept.report().regions_deregistered, 1, "the sweep retries");
    assert!(watch.is_deregistered());
    assert_eq!(side.live(), 0);
}

#[tokio::test(start_paused = true)]
async fn dropped_guard_deregisters_in_the_background_and_warns() {
    let logs = Logs::capture();
    let (_fabric, side) = one_side(small_config());
    let guard = side
        .registry
        .register_owned(pattern(page(), 3))
        .await
        .unwrap();
    let watch = guard.watch();
    drop(guard);
    within(
        Duration::from_secs(5),
        "background deregistration",
        watch.deregistered(),
    )
    .await;
    assert_eq!(side.live(), 0);
    assert_eq!(side.registered_bytes(), 0);
    assert!(
        logs.text()
            .contains("RegionGuard dropped without unregister"),
        "{}",
        logs.text()
    );
}

#[tokio::test(start_paused = true)]
async fn guard_dropped_on_a_thread_outside_the_runtime_still_deregisters() {
    let (_fabric, side) = one_side(small_config());
    let memory = External::new(2 * page(), 4);
    // SAFETY: `memory` stays allocated until the latch resolves (awaited
    // below) and is not referenced meanwhile.
    let guard = unsafe { side.registry.register_external(memory.ptr(), memory.len()) }
        .await
        .unwrap();
    let watch = guard.watch();
    std::thread::spawn(move || drop(guard))
        .join()
        .expect("dropping on a foreign thread does not panic");
    within(
        Duration::from_secs(5),
        "background deregistration",
        watch.deregistered(),
    )
    .await;
    assert_eq!(side.live(), 0);
    drop(memory);
}

#[tokio::test(start_paused = true)]
async fn shutdown_latches_survivors_only_when_the_backend_reports_nothing_registered() {
    let (_fabric, side) = one_side(small_config());
    let guard = side
        .registry
        .register_owned(pattern(page(), 5))
        .await
        .unwrap();
    let watch = guard.watch();
    side.backend.faults().refuse_unmaps(true);

    let swept = side.registry.shutdown(Duration::from_secs(1)).await;
    assert_eq!(swept.report().regions_surviving, 1);
    // A wedged backend: its teardown cannot unmap either.
    side.backend.shutdown().await;
    assert_eq!(side.live(), 1);
    let refused = swept.finish_after_backend_teardown();
    assert_eq!(
        (
            refused.released,
            refused.backend_live,
            refused.regions_registered,
            refused.arenas_registered
        ),
        (false, Some(1), 1, 0),
        "refused: the region stays open"
    );
    assert!(
        !watch.is_deregistered(),
        "never released while the backend holds it"
    );

    side.backend.faults().refuse_unmaps(false);
    side.backend.shutdown().await;
    assert_eq!(side.live(), 0);
    let released = swept.finish_after_backend_teardown();
    assert_eq!(
        (
            released.released,
            released.regions_released_after_teardown,
            released.arenas_released_after_teardown,
            released.backend_live
        ),
        (true, 1, 0, Some(0))
    );
    assert!(watch.is_deregistered());
    assert_eq!(side.registered_bytes(), 0);
    let (buffer, _) = guard
        .unregister_owned(Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(
        buffer,
        pattern(page(), 5),
        "the owner still gets its buffer back"
    );
}

/// A report taken later, and a repeated finish, say what the last finish
/// decided: the refusal while the backend holds the region, then the
/// release, its survivor counted once.
#[tokio::test(start_paused = true)]
async fn later_reports_repeat_what_the_last_finish_decided() {
    let (_fabric, side) = one_side(small_config());
    let guard = side
        .registry
        .register_owned(pattern(page(), 8))
        .await
        .unwrap();
    side.backend.faults().refuse_unmaps(true);
    let swept = side.registry.shutdown(Duration::from_secs(1)).await;
    let before = swept.report();
    assert_eq!(
        (
            before.released,
            before.regions_registered,
            before.backend_live
        ),
        (false, 1, Some(1)),
        "{before:?}"
    );

    side.backend.shutdown().await;
    let refused = swept.finish_after_backend_teardown();
    assert!(!refused.released, "{refused:?}");
    assert_eq!(
        swept.report(),
        refused,
        "a later report repeats the refusal"
    );

    side.backend.faults().refuse_unmaps(false);
    side.backend.shutdown().await;
    let released = swept.finish_after_backend_teardown();
    assert_eq!(
        (
            released.released,
            released.regions_released_after_teardown,
            released.regions_registered
        ),
        (true, 1, 0),
        "{released:?}"
    );
    assert_eq!(
        swept.report(),
        released,
        "a later report repeats the release"
    );
    assert_eq!(
        swept.finish_after_backend_teardown(),
        released,
        "repeatable: the survivor is counted once"
    );
    let (buffer, _) = guard
        .unregister_owned(Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(buffer, pattern(page(), 8));
}

#[tokio::test(start_paused = true)]
async fn a_swept_registry_dropped_after_teardown_releases_its_survivors() {
    let (_fabric, side) = one_side(small_config());
    let guard = side
        .registry
        .register_owned(pattern(page(), 6))
        .await
        .unwrap();
    let watch = guard.watch();
    side.backend.faults().refuse_unmaps(true);
    let swept = side.registry.shutdown(Duration::from_secs(1)).await;
    assert_eq!(swept.report().regions_surviving, 1);
    side.backend.faults().refuse_unmaps(false);
    side.backend.shutdown().await;
    assert_eq!(side.live(), 0);

    drop(swept);
    assert!(
        watch.is_deregistered(),
        "the backend holds nothing: dropping the swept registry releases the survivor"
    );
    let (buffer, _) = guard
        .unregister_owned(Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(buffer, pattern(page(), 6));
}

#[tokio::test(start_paused = true)]
async fn a_swept_registry_dropped_before_teardown_leaves_a_way_back_through_shutdown() {
    let (_fabric, side) = one_side(small_config());
    let guard = side
        .registry
        .register_owned(pattern(page(), 7))
        .await
        .unwrap();
    let watch = guard.watch();
    side.backend.faults().refuse_unmaps(true);
    let swept = side.registry.shutdown(Duration::from_secs(1)).await;
    assert_eq!(swept.report().regions_surviving, 1);
    drop(swept);
    assert!(
        !watch.is_deregistered(),
        "never released while the backend still holds it"
    );

    side.backend.faults().refuse_unmaps(false);
    let again = side.registry.shutdown(Duration::from_secs(1)).await;
    side.backend.shutdown().await;
    assert!(again.finish_after_backend_teardown().released);
    assert!(watch.is_deregistered());
    drop(guard);
}

/// A reader on another thread that stays inside the region until told.
struct BlockedReader {
    leave: mpsc::Sender<()>,
    thread: std::thread::JoinHandle<Option<Vec<u8>>>,
}

fn block_a_reader(watch: rdmareg_registry::RegionWatch) -> BlockedReader {
    let (entered_tx, entered_rx) = mpsc::channel();
    let (leave_tx, leave_rx) = mpsc::channel::<()>();
    let thread = std::thread::spawn(move || {
        watch.read(|view| {
            entered_tx.send(()).unwrap();
            leave_rx.recv().unwrap();
            view.to_vec()
        })
    });
    entered_rx.recv().expect("reader entered the region");
    BlockedReader {
        leave: leave_tx,
        thread,
    }
}

#[tokio::test(start_paused = true)]
async fn unregister_reports_a_drain_timeout_and_the_latch_waits_for_the_last_reader() {
    let (_fabric, side) = one_side(small_config());
    let guard = side
        .registry
        .register_owned(pattern(page(), 6))
        .await
        .unwrap();
    let watch = guard.watch();
    let reader = block_a_reader(guard.watch());

    let outcome = guard.unregister(Duration::from_millis(50)).await.unwrap();
    assert_eq!(outcome, UnregisterOutcome::DrainTimedOut);
    assert_eq!(side.live(), 0, "unmapped regardless");
    assert_eq!(
        side.registered_bytes(),
        0,
        "nothing pinned, nothing charged"
    );
    assert!(!watch.is_deregistered(), "a reader is still inside");
    assert!(watch.read(|_| ()).is_none(), "no new readers");

    reader.leave.send(()).unwrap();
    let seen = reader.thread.join().unwrap();
    assert_eq!(seen.as_deref(), Some(&pattern(page(), 6)[..]));
    assert!(watch.is_deregistered());
}

#[tokio::test(start_paused = true)]
async fn unregister_owned_hands_the_buffer_back_only_after_the_last_reader_left() {
    let (_fabric, side) = one_side(small_config());
    let guard = side
        .registry
        .register_owned(pattern(page(), 7))
        .await
        .unwrap();
    let reader = block_a_reader(guard.watch());
    let unregistering = tokio::spawn(guard.unregister_owned(Duration::from_millis(50)));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        !unregistering.is_finished(),
        "the buffer is still being read"
    );
    assert_eq!(side.live(), 0);

    reader.leave.send(()).unwrap();
    reader.thread.join().unwrap();
    let (buffer, outcome) = unregistering.await.unwrap().unwrap();
    assert_eq!(outcome, UnregisterOutcome::DrainTimedOut);
    assert_eq!(buffer, pattern(page(), 7));
}

#[tokio::test(start_paused = true)]
async fn unregister_owned_hands_the_buffer_back_intact() {
    let (_fabric, side) = one_side(small_config());
    let guard = side
        .registry
        .register_owned(pattern(3000, 8))
        .await
        .unwrap();
    let (buffer, outcome) = guard
        .unregister_owned(Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(outcome, UnregisterOutcome::Drained);
    assert_eq!(buffer, pattern(3000, 8));
    assert_eq!(side.live(), 0);
}

#[tokio::test(start_paused = true)]
async fn unregister_owned_of_an_external_region_answers_not_owned_before_touching_anything() {
    let (_fabric, side) = one_side(small_config());
    let memory = External::new(page(), 9);
    // SAFETY: `memory` outlives the registration (unregistered below).
    let guard = unsafe { side.registry.register_external(memory.ptr(), page()) }
        .await
        .unwrap();
    let refused = guard
        .unregister_owned(Duration::from_secs(60))
        .await
        .unwrap_err();
    assert_eq!(refused.error, RdmaError::NotOwned);
    let guard = refused.guard.expect("the guard comes back");
    assert!(!guard.is_deregistered());
    assert_eq!(side.live(), 1);
    assert!(
        guard.watch().read(|_| ()).is_some(),
        "still open to readers"
    );
    assert_eq!(
        guard.unregister(Duration::from_secs(60)).await,
        Ok(UnregisterOutcome::Drained)
    );
    drop(memory);
}

#[tokio::test(start_paused = true)]
async fn cancelled_unregister_finishes_in_the_background() {
    let (_fabric, side) = one_side(small_config());
    let guard = side
        .registry
        .register_owned(pattern(page(), 10))
        .await
        .unwrap();
    let watch = guard.watch();
    side.backend
        .faults()
        .set_delay(FaultOp::Unmap, Duration::from_millis(10));
    let mut unregistering = Box::pin(guard.unregister(Duration::from_secs(60)));
    assert!(futures::poll!(&mut unregistering).is_pending());
    drop(unregistering);
    within(
        Duration::from_secs(5),
        "background completion",
        watch.deregistered(),
    )
    .await;
    assert_eq!(side.live(), 0);
    assert_eq!(side.registered_bytes(), 0);
}

/// `SURVIVORS` owned regions the backend refused to unmap in the sweep,
/// then a backend whose teardown released them all: a finish now releases
/// every one. The guards keep the regions alive for the caller.
async fn swept_with_survivors_after_teardown(
    side: &Side,
) -> (
    rdmareg_registry::SweptRegistry,
    Vec<rdmareg_registry::RegionGuard>,
) {
    let guards = survivor_guards(side).await;
    side.backend.faults().refuse_unmaps(true);
    let swept = side.registry.shutdown(Duration::from_secs(1)).await;
    assert_eq!(swept.report().regions_surviving, SURVIVORS);
    side.backend.faults().refuse_unmaps(false);
    side.backend.shutdown().await;
    assert_eq!(side.live(), 0);
    (swept, guards)
}

const SURVIVORS: usize = 128;

/// `SURVIVORS` owned one-page regions, each with its own pattern.
async fn survivor_guards(side: &Side) -> Vec<rdmareg_registry::RegionGuard> {
    let mut guards = Vec::new();
    for seed in 0..SURVIVORS {
        guards.push(
            side.registry
                .register_owned(pattern(page(), seed as u8))
                .await
                .unwrap(),
        );
    }
    guards
}

/// Two threads finish one token at once: each survivor is released once,
/// so neither report, nor a later one, counts more releases than there
/// were survivors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_finishes_count_each_survivor_once() {
    for round in 0..20 {
        let (_fabric, side) = one_side(small_config());
        let (swept, _guards) = swept_with_survivors_after_teardown(&side).await;
        let barrier = std::sync::Barrier::new(2);
        let [first, second] = std::thread::scope(|scope| {
            let finish = || {
                barrier.wait();
                swept.finish_after_backend_teardown()
            };
            let (a, b) = (scope.spawn(finish), scope.spawn(finish));
            [a.join().unwrap(), b.join().unwrap()]
        });
        for report in [first, second, swept.report()] {
            assert!(report.released, "round {round}: {report:?}");
            assert!(
                report.regions_released_after_teardown <= SURVIVORS,
                "round {round}: {} releases of {SURVIVORS} survivors: {report:?}",
                report.regions_released_after_teardown
            );
        }
    }
}

/// A report taken while another thread finishes never says both that no
/// finish released the survivors and that a finish released some.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_racing_a_finish_is_one_or_the_other() {
    for round in 0..20 {
        let (_fabric, side) = one_side(small_config());
        let (swept, _guards) = swept_with_survivors_after_teardown(&side).await;
        let done = std::sync::atomic::AtomicBool::new(false);
        let torn = std::thread::scope(|scope| {
            let reader = scope.spawn(|| {
                let mut torn = Vec::new();
                while !done.load(std::sync::atomic::Ordering::SeqCst) {
                    let report = swept.report();
                    if report.released != (report.regions_released_after_teardown > 0) {
                        torn.push(report);
                    }
                }
                torn
            });
            std::thread::sleep(Duration::from_millis(1));
            let released = swept.finish_after_backend_teardown();
            done.store(true, std::sync::atomic::Ordering::SeqCst);
            assert!(released.released);
            reader.join().unwrap()
        });
        assert!(
            torn.is_empty(),
            "round {round}: {} torn reports, first {:?}",
            torn.len(),
            torn.first()
        );
    }
}

/// Two shutdowns give two tokens over the same survivors; finished at
/// once, the two together count each survivor once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finishes_on_two_tokens_count_each_survivor_once() {
    for round in 0..20 {
        let (_fabric, side) = one_side(small_config());
        let _guards = survivor_guards(&side).await;
        side.backend.faults().refuse_unmaps(true);
        let first = side.registry.shutdown(Duration::from_secs(1)).await;
        let second = side.registry.shutdown(Duration::from_secs(1)).await;
        assert_eq!(second.report().regions_surviving, SURVIVORS);
        side.backend.faults().refuse_unmaps(false);
        side.backend.shutdown().await;
        assert_eq!(side.live(), 0);
        let barrier = std::sync::Barrier::new(2);
        let finish = |swept: &rdmareg_registry::SweptRegistry| {
            barrier.wait();
            swept.finish_after_backend_teardown()
        };
        let [a, b] = std::thread::scope(|scope| {
            let finish = &finish;
            let (first, second) = (&first, &second);
            let (a, b) = (
                scope.spawn(move || finish(first)),
                scope.spawn(move || finish(second)),
            );
            [a.join().unwrap(), b.join().unwrap()]
        });
        assert!(a.released && b.released, "round {round}: {a:?} {b:?}");
        assert!(
            a.regions_released_after_teardown + b.regions_released_after_teardown <= SURVIVORS,
            "round {round}: {} + {} releases of {SURVIVORS} survivors",
            a.regions_released_after_teardown,
            b.regions_released_after_teardown
        );
    }
}

/// A refused finish releases nothing; the token dropped while the backend
/// still holds the region releases nothing either; a later shutdown,
/// finished once the backend holds nothing, releases it.
#[tokio::test(start_paused = true)]
async fn a_token_dropped_after_a_refused_finish_keeps_its_survivor() {
    let (_fabric, side) = one_side(small_config());
    let guard = side
        .registry
        .register_owned(pattern(page(), 9))
        .await
        .unwrap();
    let watch = guard.watch();
    side.backend.faults().refuse_unmaps(true);
    let swept = side.registry.shutdown(Duration::from_secs(1)).await;
    side.backend.shutdown().await;
    for _ in 0..2 {
        let refused = swept.finish_after_backend_teardown();
        assert_eq!(
            (
                refused.released,
                refused.regions_released_after_teardown,
                refused.regions_registered
            ),
            (false, 0, 1),
            "{refused:?}"
        );
    }
    drop(swept);
    assert!(!watch.is_deregistered(), "the backend still holds it");
    assert!(side.registered_bytes() > 0, "still counted registered");

    side.backend.faults().refuse_unmaps(false);
    let again = side.registry.shutdown(Duration::from_secs(1)).await;
    side.backend.shutdown().await;
    let released = again.finish_after_backend_teardown();
    assert!(released.released, "{released:?}");
    assert!(watch.is_deregistered());
    let (buffer, _) = guard
        .unregister_owned(Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(buffer, pattern(page(), 9));
}
