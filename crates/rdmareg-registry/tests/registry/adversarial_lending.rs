//! Attacks on lending a pool buffer (`describe` / `withdraw`) and on the
//! rollback of cancelled maps, with safe code over the loopback and its
//! fault knobs: granules reused under a live key, leaks left uncounted,
//! stale descriptors, shutdown races.

use std::time::Duration;

use rdmareg_backend::RdmaBackend;
use rdmareg_backend::loopback::FaultOp;
use rdmareg_registry::{GRANULE, RdmaError};

use crate::common::*;

/// A buffer whose describe is cancelled while its map is held: the map then
/// registers its bytes (detached, as UCX's command ring does) and the
/// rollback's unmap is held too. Answers the bytes' address and the unmap
/// gate, with the registration live.
async fn cancelled_describe_with_live_registration(
    side: &Side,
) -> (u64, rdmareg_backend::loopback::HangGate) {
    let buf = side.registry.alloc_pinned(page()).await.unwrap();
    let addr = buf.as_ptr() as u64;
    side.backend.faults().detach_maps(true);
    let map_hold = side.backend.faults().hang(FaultOp::Map);
    {
        let mut describing = Box::pin(buf.describe());
        assert!(futures::poll!(&mut describing).is_pending());
        map_hold.until_waiting(1).await;
    }
    let unmap_hold = side.backend.faults().hang(FaultOp::Unmap);
    map_hold.release();
    unmap_hold.until_waiting(1).await;
    (addr, unmap_hold)
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_describe_keeps_its_granules_until_its_rollback_unmapped_them() {
    let (_fabric, side) = one_side(small_config());
    let (addr, unmap_hold) = cancelled_describe_with_live_registration(&side).await;
    assert_eq!(
        side.live(),
        2,
        "the arena and the cancelled describe's registration"
    );
    // The rollback has not unmapped the buffer's bytes yet: a new buffer
    // must not be carved from them (it would be writable, and a GET
    // destination, under a registration of its own bytes).
    let other = side.registry.try_alloc_pinned(page()).unwrap();
    assert_ne!(
        other.as_ptr() as u64,
        addr,
        "granules reused while the cancelled describe's registration is live"
    );
    unmap_hold.release();
    within(
        Duration::from_secs(5),
        "the rollback",
        side.registry.map_rollbacks_settled(),
    )
    .await;
    assert_eq!(side.live(), 1);
    drop(other);
    eventually("the granules come back", || {
        side.registry.stats().live_allocations == 0
    })
    .await;
    assert_eq!(side.registry.stats().leaked_bytes, 0);
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_describe_whose_rollback_unmap_is_refused_leaks_its_granules_and_counts_them() {
    let (_fabric, side) = one_side(small_config());
    let buf = side.registry.alloc_pinned(page()).await.unwrap();
    let addr = buf.as_ptr() as u64;
    side.backend.faults().detach_maps(true);
    let map_hold = side.backend.faults().hang(FaultOp::Map);
    {
        let mut describing = Box::pin(buf.describe());
        assert!(futures::poll!(&mut describing).is_pending());
        map_hold.until_waiting(1).await;
    }
    side.backend.faults().refuse_unmaps(true);
    map_hold.release();
    within(
        Duration::from_secs(5),
        "the rollback",
        side.registry.map_rollbacks_settled(),
    )
    .await;
    assert_eq!(side.live(), 2, "the refused rollback left a registration");
    assert_eq!(
        side.registry.stats().leaked_bytes,
        GRANULE,
        "the granules under the surviving registration are counted as leaked"
    );
    side.backend.faults().refuse_unmaps(false);
    // Those granules are never handed out again.
    let others: Vec<_> = (0..8)
        .map(|_| side.registry.try_alloc_pinned(page()).unwrap())
        .collect();
    assert!(
        others.iter().all(|b| b.as_ptr() as u64 != addr),
        "granules under a live registration were handed out again"
    );
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_describe_whose_rollback_finishes_leaks_nothing() {
    let (_fabric, side) = one_side(small_config());
    let (_addr, unmap_hold) = cancelled_describe_with_live_registration(&side).await;
    unmap_hold.release();
    within(
        Duration::from_secs(5),
        "the rollback",
        side.registry.map_rollbacks_settled(),
    )
    .await;
    eventually("the granules come back", || {
        side.registry.stats().live_allocations == 0
    })
    .await;
    let stats = side.registry.stats();
    assert_eq!(stats.leaked_bytes, 0);
    assert_eq!(side.live(), 1, "only the arena is registered");
    assert_eq!(
        stats.registered_bytes,
        64 * KIB as u64,
        "only the arena is charged"
    );
}

#[tokio::test(start_paused = true)]
async fn a_withdrawn_and_re_described_buffer_answers_its_old_descriptor_with_a_typed_error() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let mut buf = owner.registry.alloc_pinned(page()).await.unwrap();
    buf.fill(0x31);
    let first = buf.describe().await.unwrap();
    let old = first.descriptor();
    let mut buf = first.withdraw().await.unwrap();
    buf.fill(0x32);
    let second = buf.describe().await.unwrap();
    let new = second.descriptor();
    assert_eq!(old.addr(), new.addr(), "the same bytes");
    assert_ne!(old.generation(), new.generation());

    let mut dst = consumer.registry.alloc_pinned(page()).await.unwrap();
    dst.fill(0);
    let stale = consumer.registry.get(OWNER, &old, &mut dst).await;
    assert!(
        matches!(stale, Err(RdmaError::RegionNotFound)),
        "a withdrawn description still read: {stale:?}"
    );
    assert!(dst.iter().all(|b| *b == 0), "no byte arrived");
    consumer.registry.get(OWNER, &new, &mut dst).await.unwrap();
    assert!(dst.iter().all(|b| *b == 0x32));
    drop(second);
}

#[tokio::test(start_paused = true)]
async fn a_described_buffer_held_across_shutdown_loses_its_key_at_teardown_and_leaks_nothing() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let mut buf = owner.registry.alloc_pinned(page()).await.unwrap();
    buf.fill(0x41);
    let described = buf.describe().await.unwrap();
    let descriptor = described.descriptor();
    let swept = owner.registry.shutdown(Duration::from_secs(5)).await;
    assert!(swept.report().drained);
    // Shutdown does not wait for buffers the application holds: the
    // buffer's own key outlives the sweep, until the backend's teardown.
    assert_eq!(owner.live(), 1, "the described buffer's own key");
    let report = swept.report();
    assert_eq!(
        (
            report.regions_registered,
            report.arenas_registered,
            report.lent_buffers_registered
        ),
        (0, 0, 1),
        "the sweep's survivors name the lent buffer's live key"
    );
    assert!(described.iter().all(|b| *b == 0x41));
    owner.backend.shutdown().await;
    assert_eq!(owner.live(), 0);
    assert!(swept.finish_after_backend_teardown().released);
    assert_eq!(
        swept.report().lent_buffers_registered,
        0,
        "the teardown revoked it"
    );
    let mut dst = consumer.registry.alloc_pinned(page()).await.unwrap();
    dst.fill(0);
    assert!(
        consumer
            .registry
            .get(OWNER, &descriptor, &mut dst)
            .await
            .is_err(),
        "a torn-down owner's descriptor still reads"
    );
    assert!(dst.iter().all(|b| *b == 0), "no byte arrived");
    drop(described);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(owner.registry.stats().leaked_bytes, 0);
    assert_eq!(owner.registered_bytes(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_describe_admitted_before_shutdown_finishes_inside_the_drain_and_settles_after_it() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let mut buf = owner.registry.alloc_pinned(page()).await.unwrap();
    buf.fill(0x42);
    let map_hold = owner.backend.faults().hang(FaultOp::Map);
    let describing = tokio::spawn(buf.describe());
    map_hold.until_waiting(1).await;
    let registry = owner.registry.clone();
    let shutting = tokio::spawn(async move { registry.shutdown(Duration::from_secs(2)).await });
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(!shutting.is_finished(), "the drain waits for the describe");
    map_hold.release();
    let described = describing.await.unwrap().unwrap();
    let swept = shutting.await.unwrap();
    assert!(swept.report().drained);
    let mut dst = consumer.registry.alloc_pinned(page()).await.unwrap();
    consumer
        .registry
        .get(OWNER, &described.descriptor(), &mut dst)
        .await
        .unwrap();
    assert!(dst.iter().all(|b| *b == 0x42));
    // A withdrawal after shutdown began is refused; dropping the buffer
    // still unmaps its key and gives everything back.
    let refused = described.withdraw().await.unwrap_err();
    assert_eq!(refused.error(), &RdmaError::ShuttingDown);
    drop(refused);
    eventually("the key is unmapped", || owner.live() == 0).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(owner.registry.stats().leaked_bytes, 0);
    assert_eq!(owner.registered_bytes(), 0);
}

/// A caller runtime that keeps running, a registry whose background tasks
/// run on a runtime of their own (shut down by the test), and a described
/// page-long pool buffer of it, with the registry's charge before describing.
fn described_on_a_registry_runtime() -> (
    tokio::runtime::Runtime,
    tokio::runtime::Runtime,
    std::sync::Arc<rdmareg_backend::loopback::LoopbackBackend>,
    rdmareg_registry::RdmaRegistry,
    rdmareg_registry::DescribedBuf,
) {
    let (caller, registry_runtime, backend, registry) = registry_on_its_own_runtime();
    let described = caller.block_on(async {
        let buf = registry.alloc_pinned(page()).await.unwrap();
        buf.describe().await.unwrap()
    });
    assert_eq!(backend.live_registrations(), Some(2));
    (caller, registry_runtime, backend, registry, described)
}

#[test]
fn a_freed_described_buffer_whose_unmap_dies_with_its_runtime_stays_charged_and_counts_its_leak() {
    let (caller, registry_runtime, backend, registry, described) =
        described_on_a_registry_runtime();
    let charged = registry.stats().registered_bytes;
    let unmap_hold = backend.faults().hang(FaultOp::Unmap);
    drop(described);
    caller.block_on(unmap_hold.until_waiting(1));
    // The unmap of the buffer's own key is dropped with the runtime: as far
    // as the registry can tell the key may be live forever, so its granules
    // are leaked and counted, and its pages stay charged.
    registry_runtime.shutdown_timeout(Duration::from_secs(5));
    drop(unmap_hold);
    assert_eq!(
        registry.stats().leaked_bytes,
        GRANULE,
        "the leak is counted"
    );
    assert_eq!(
        registry.stats().registered_bytes,
        charged,
        "a registration that may be live stays charged"
    );
}

#[test]
fn a_withdrawal_whose_unmap_dies_with_its_runtime_keeps_the_key_charged_and_counts_its_leak() {
    let (caller, registry_runtime, backend, registry, described) =
        described_on_a_registry_runtime();
    let charged = registry.stats().registered_bytes;
    let unmap_hold = backend.faults().hang(FaultOp::Unmap);
    let withdrawing = caller.spawn(described.withdraw());
    caller.block_on(unmap_hold.until_waiting(1));
    registry_runtime.shutdown_timeout(Duration::from_secs(5));
    drop(unmap_hold);
    let refused = caller.block_on(withdrawing).unwrap().unwrap_err();
    assert_eq!(refused.error(), &RdmaError::ShuttingDown);
    assert!(refused.into_buf().is_none(), "the buffer was leaked");
    assert_eq!(
        registry.stats().leaked_bytes,
        GRANULE,
        "the leak is counted"
    );
    assert_eq!(
        registry.stats().registered_bytes,
        charged,
        "a registration that may be live stays charged"
    );
}

/// Cancels a `register_external` of `memory` while its map hangs, then lets
/// the map finish with the backend refusing unmaps: the rollback's unmap is
/// refused.
async fn cancelled_external_registration_with_refused_rollback(side: &Side, memory: &mut [u8]) {
    side.backend.faults().detach_maps(true);
    let map_hold = side.backend.faults().hang(FaultOp::Map);
    let (ptr, len) = (memory.as_mut_ptr(), memory.len());
    {
        // SAFETY: the caller keeps `memory` allocated and unreferenced until
        // the rollback has settled (or forever).
        let mut register = Box::pin(unsafe { side.registry.register_external(ptr, len) });
        assert!(futures::poll!(&mut register).is_pending());
        map_hold.until_waiting(1).await;
    }
    side.backend.faults().refuse_unmaps(true);
    map_hold.release();
    eventually("the map registered the range", || side.live() == 1).await;
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_external_registration_whose_rollback_is_refused_is_not_reported_reusable() {
    let (_fabric, side) = one_side(small_config());
    let mut memory = vec![0u8; 2 * page()].into_boxed_slice();
    cancelled_external_registration_with_refused_rollback(&side, &mut memory).await;
    // While the backend refuses, the range is not reported reusable.
    let early = tokio::time::timeout(
        Duration::from_secs(10),
        side.registry.map_rollbacks_settled(),
    )
    .await;
    assert!(early.is_err(), "settled with the range still registered");
    assert_eq!(side.live(), 1);
    assert_eq!(side.registry.stats().map_rollbacks_in_flight, 1);
    // Once the backend lets go, the retried unmap confirms it.
    side.backend.faults().refuse_unmaps(false);
    within(
        Duration::from_secs(5),
        "the retried rollback",
        side.registry.map_rollbacks_settled(),
    )
    .await;
    assert_eq!(side.live(), 0, "settled means unregistered");
    assert_eq!(side.registry.stats().leaked_bytes, 0);
    drop(memory);
}

#[tokio::test(start_paused = true)]
async fn a_refused_external_rollback_does_not_hold_shutdown_up_and_settles_after_teardown() {
    let (_fabric, side) = one_side(small_config());
    let mut memory = vec![0u8; 2 * page()].into_boxed_slice();
    cancelled_external_registration_with_refused_rollback(&side, &mut memory).await;
    // The retrying rollback does not hold the shutdown's drain up.
    let swept = side.registry.shutdown(Duration::from_secs(1)).await;
    assert!(swept.report().drained);
    assert_eq!(side.registry.stats().map_rollbacks_in_flight, 1);
    side.backend.faults().refuse_unmaps(false);
    side.backend.shutdown().await;
    assert_eq!(side.live(), 0);
    assert!(swept.finish_after_backend_teardown().released);
    within(
        Duration::from_secs(5),
        "the rollback ends with the teardown",
        side.registry.map_rollbacks_settled(),
    )
    .await;
    drop(memory);
}
