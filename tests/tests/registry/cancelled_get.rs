//! A GET whose future is dropped mid-flight: the destination buffer is
//! surrendered (its memory left with the transfer), the transfer still holds
//! the pool slot — or the dedicated arena — until the backend has finished
//! writing it, shutdown waits for it, and nothing stays registered.
//!
//! The GETs are 32 MiB: tens of milliseconds over tcp and several over
//! same-host cma, while the checks right after the drop take microseconds.

use std::time::Duration;

use rdmareg_registry::{Descriptor, PinnedBuf, RdmaError, RdmaRegistry, RegionGuard};
use rdmareg_tests::{Lane, MIB, OWNER, Pair, registry_config};

const TRANSFER: usize = 32 * MIB;

per_lane!(
    a_dropped_get_surrenders_its_buffer_and_shutdown_waits_for_the_transfer,
    a_dropped_get_into_a_dedicated_buffer_unmaps_the_arena_only_after_the_transfer,
);

/// The owner's 32 MiB source, and its descriptor as the consumer decoded it.
async fn large_source(pair: &Pair) -> (RegionGuard, Descriptor) {
    let guard = pair
        .owner
        .registry
        .register_owned(vec![0x5A; TRANSFER].into_boxed_slice())
        .await
        .expect("owned registration");
    let wire = guard.descriptor().expect("descriptor").encode();
    (guard, Descriptor::decode(&wire).expect("decodes"))
}

/// Polls a GET of `descriptor` into `dst` once and drops it while it is in
/// flight. On a loaded machine the caller can be descheduled for longer
/// than a same-host copy of 32 MiB takes, so a GET that already finished at
/// its first poll is tried again (it answered, and `dst` is whole); one
/// that never was in flight in 20 tries fails the test.
async fn drop_a_get_in_flight(
    consumer: &RdmaRegistry,
    descriptor: &Descriptor,
    dst: &mut PinnedBuf,
) {
    for _ in 0..20 {
        let mut get = Box::pin(consumer.get(OWNER, descriptor, dst));
        match futures::poll!(get.as_mut()) {
            std::task::Poll::Pending => return,
            std::task::Poll::Ready(answer) => {
                assert_eq!(answer, Ok(()), "a GET that finished at once");
            }
        }
    }
    panic!("a 32 MiB GET finished at its first poll 20 times out of 20");
}

async fn a_dropped_get_surrenders_its_buffer_and_shutdown_waits_for_the_transfer(lane: Lane) {
    let mut config = registry_config();
    // A pooled destination: its slot, not an arena of its own, is what the
    // transfer holds.
    config.pool.dedicated_threshold_bytes = 64 * MIB as u64;
    let pair = Pair::start(lane, config);
    let consumer = &pair.consumer.registry;
    let (source, descriptor) = large_source(&pair).await;
    let mut dst = consumer.alloc_pinned(TRANSFER).await.expect("pool buffer");
    assert!(!dst.is_dedicated());

    drop_a_get_in_flight(consumer, &descriptor, &mut dst).await;
    // The transfer holds the slot; taken before anything below awaits, since
    // a copy of 32 MiB on the same host lasts only a few milliseconds.
    let held = consumer.stats();
    assert!(
        dst.is_surrendered(),
        "a dropped GET surrenders its destination"
    );
    assert_eq!(dst.len(), 0);
    assert!(dst.is_empty());
    assert_eq!(dst.generation(), None);
    let refused = dst
        .describe()
        .await
        .expect_err("a surrendered buffer has nothing to lend");
    assert_eq!(refused.error(), &RdmaError::BufferSurrendered);
    let mut dst = refused.into_buf();
    assert!(
        dst.is_surrendered(),
        "a refused describe hands the buffer back as it was"
    );
    assert_eq!(
        consumer.get(OWNER, &descriptor, &mut dst).await,
        Err(RdmaError::BufferSurrendered),
        "a surrendered buffer is no destination"
    );
    drop(dst);
    // The application let go of the buffer; the transfer had not.
    assert_eq!(held.transfers_in_flight, 1, "{held:?}");
    assert_eq!(
        held.live_allocations, 1,
        "the transfer holds the slot: {held:?}"
    );

    let report = pair.consumer.shut_down(Duration::from_secs(8)).await;
    assert!(
        report.drained,
        "shutdown waited for the transfer: {report:?}"
    );
    assert_eq!(report.in_flight_at_sweep, 0);
    assert_eq!(
        (report.arenas_deregistered, report.arenas_surviving),
        (1, 0)
    );
    assert_eq!(
        (
            report.released,
            report.regions_released_after_teardown,
            report.arenas_released_after_teardown,
            report.backend_live
        ),
        (true, 0, 0, Some(0)),
        "{report:?}"
    );
    assert_eq!(pair.consumer.engine_live(), 0);
    let stats = consumer.stats();
    assert_eq!(
        (
            stats.transfers_in_flight,
            stats.live_allocations,
            stats.pooled_arenas,
            stats.registered_bytes,
            stats.leaked_bytes
        ),
        (0, 0, 0, 0, 0),
        "{stats:?}"
    );

    source
        .unregister(Duration::from_secs(1))
        .await
        .expect("owner unregisters");
    let report = pair.owner.shut_down(Duration::from_secs(5)).await;
    assert!(report.drained);
    assert_eq!(pair.owner.engine_live(), 0);
}

async fn a_dropped_get_into_a_dedicated_buffer_unmaps_the_arena_only_after_the_transfer(
    lane: Lane,
) {
    let pair = Pair::start(lane, registry_config());
    let consumer = &pair.consumer.registry;
    let (source, descriptor) = large_source(&pair).await;
    let mut dst = consumer
        .alloc_pinned(TRANSFER)
        .await
        .expect("dedicated buffer");
    assert!(
        dst.is_dedicated(),
        "32 MiB passes the 16 MiB dedicated threshold"
    );
    assert_eq!(pair.consumer.engine_live(), 1);

    drop_a_get_in_flight(consumer, &descriptor, &mut dst).await;
    assert!(dst.is_surrendered());
    drop(dst);
    // Dropping a dedicated buffer unmaps its arena — but not while the
    // transfer still writes it.
    let stats = consumer.stats();
    assert_eq!(stats.transfers_in_flight, 1, "{stats:?}");
    assert_eq!(stats.dedicated_arenas, 1, "{stats:?}");
    assert_eq!(
        pair.consumer.engine_live(),
        1,
        "the arena stays mapped under the transfer"
    );

    rdmareg_tests::eventually(Duration::from_secs(5), "the arena is unmapped", || {
        let stats = consumer.stats();
        pair.consumer.engine_live() == 0
            && stats.dedicated_arenas == 0
            && stats.transfers_in_flight == 0
    })
    .await;
    let stats = consumer.stats();
    assert_eq!(
        (stats.registered_bytes, stats.leaked_bytes),
        (0, 0),
        "{stats:?}"
    );

    source
        .unregister(Duration::from_secs(1))
        .await
        .expect("owner unregisters");
    pair.shut_down(Duration::from_secs(5)).await;
}
