//! Lending a pool buffer over the real engines: what a peer's read of a
//! stale descriptor answers on each lane, and cancelled describes and
//! withdrawals that must leave nothing behind.
//!
//! A stale descriptor (of a buffer withdrawn and described again, or freed
//! and reused by another buffer nobody described) grants nothing: its read
//! is refused with a typed error and no byte of the owner's current memory
//! arrives.

use std::time::Duration;

use rdmareg_registry::{Descriptor, RdmaError};
use rdmareg_tests::{KIB, Lane, OWNER, Pair, eventually, registry_config, within};

per_lane!(
    cancelled_describes_and_withdrawals_leave_nothing_registered_or_leaked,
    lent_buffers_held_past_engine_teardown_are_refused_withdrawal_and_leak_nothing_when_dropped,
);
// Each suite says which of its lanes still read stale descriptors.
per_lane_refusing_stale_descriptors!(
    a_stale_descriptor_of_a_lent_buffer_reads_nothing_once_withdrawn_or_freed
);

const LEN: usize = 16 * KIB;
const LIMIT: Duration = Duration::from_secs(10);
/// Describes started together in one round of
/// [`cancelled_describes_and_withdrawals_leave_nothing_registered_or_leaked`].
const BURST: usize = 4;

/// Read `descriptor` into a zeroed consumer buffer: the answer, and
/// whether any byte equal to `marker` arrived.
async fn read(pair: &Pair, descriptor: &Descriptor, marker: u8) -> (Result<(), RdmaError>, bool) {
    let mut dst = pair.consumer.registry.alloc_pinned(LEN).await.unwrap();
    dst.fill(0);
    let answer = pair
        .consumer
        .registry
        .get(OWNER, descriptor, &mut dst)
        .await;
    (answer, dst.contains(&marker))
}

async fn a_stale_descriptor_of_a_lent_buffer_reads_nothing_once_withdrawn_or_freed(lane: Lane) {
    let pair = Pair::start(lane.clone(), registry_config());
    let mut buf = pair.owner.registry.alloc_pinned(LEN).await.unwrap();
    buf.fill(0x11);
    let lent = buf.describe().await.unwrap();
    let first = lent.descriptor();
    let (fresh, arrived) = read(&pair, &first, 0x11).await;
    assert_eq!(fresh, Ok(()), "{lane:?}: a fresh descriptor reads");
    assert!(arrived);

    // Withdrawn, rewritten, described again: the first descriptor is stale.
    let mut buf = lent.withdraw().await.unwrap();
    buf.fill(0x22);
    let lent = buf.describe().await.unwrap();
    let second = lent.descriptor();
    assert_eq!(second.addr(), first.addr(), "the same bytes");
    assert_ne!(second.generation(), first.generation());
    let (withdrawn, withdrawn_arrived) = read(&pair, &first, 0x22).await;
    eprintln!("{lane:?}: a withdrawn, re-described buffer's old descriptor: {withdrawn:?}");
    assert_eq!(read(&pair, &second, 0x22).await, (Ok(()), true));

    // Freed; its granules serve a new buffer that nobody described.
    drop(lent);
    let mut reused = None;
    for _ in 0..400 {
        let candidate = pair.owner.registry.alloc_pinned(LEN).await.unwrap();
        if candidate.as_ptr() as u64 == second.addr() {
            reused = Some(candidate);
            break;
        }
        drop(candidate);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut reused = reused.expect("the freed granules serve a new buffer");
    reused.fill(0x33);
    let (freed, freed_arrived) = read(&pair, &second, 0x33).await;
    eprintln!("{lane:?}: a freed buffer's descriptor over reused memory: {freed:?}");
    drop(reused);
    pair.shut_down(LIMIT).await;
    assert!(
        withdrawn.is_err() && !withdrawn_arrived,
        "{lane:?}: a withdrawn descriptor read the re-described bytes ({withdrawn:?})"
    );
    assert!(
        freed.is_err() && !freed_arrived,
        "{lane:?}: a freed buffer's descriptor read the buffer now in its memory ({freed:?})"
    );
}

async fn cancelled_describes_and_withdrawals_leave_nothing_registered_or_leaked(lane: Lane) {
    let pair = Pair::start(lane.clone(), registry_config());
    let registry = &pair.owner.registry;
    let baseline = {
        let warm = registry.alloc_pinned(LEN).await.unwrap();
        drop(warm);
        (registry.stats().registered_bytes, pair.owner.engine_live())
    };
    // Rounds after whose cancellation a map rollback was in flight (this
    // round's or an earlier one's): the scenario must exercise rollbacks.
    // Each round describes a burst of buffers, polls each in turn, and
    // cancels: a lone describe may never be caught mid-map on a loaded
    // machine, where waking the parked progress thread can hand it the CPU
    // until the map has answered. At least 40 rounds, more (up to 400)
    // until a cancellation landed during a map.
    let mut rollbacks_seen = 0;
    let mut rounds = 0u32;
    while rounds < 40 || (rollbacks_seen == 0 && rounds < 400) {
        let round = rounds;
        rounds += 1;
        let mut describing = Vec::new();
        for _ in 0..BURST {
            let buf = registry.alloc_pinned(LEN).await.unwrap();
            describing.push(Box::pin(buf.describe()));
        }
        // Cancel the describes right after their `round % 4`th poll (0:
        // never polled), yielding between polls.
        let polls = round % 4;
        let mut described = Vec::new();
        for poll in 0..polls {
            if poll > 0 {
                tokio::task::yield_now().await;
            }
            let mut still = Vec::new();
            for mut future in describing {
                match futures::poll!(&mut future) {
                    std::task::Poll::Ready(answer) => described.push(answer.unwrap()),
                    std::task::Poll::Pending => still.push(future),
                }
            }
            describing = still;
        }
        drop(describing);
        if registry.stats().map_rollbacks_in_flight > 0 {
            rollbacks_seen += 1;
        }
        // Describes that finished: cancel their withdrawals the same way.
        for lent in described {
            let mut withdrawing = Box::pin(lent.withdraw());
            for _ in 0..(round / 4) % 3 {
                if let std::task::Poll::Ready(answer) = futures::poll!(&mut withdrawing) {
                    drop(answer.unwrap());
                    break;
                }
                tokio::task::yield_now().await;
            }
        }
    }
    eprintln!(
        "{lane:?}: a rollback was in flight after {rollbacks_seen} of {rounds} cancellations"
    );
    assert!(
        rollbacks_seen > 0,
        "{lane:?}: no cancellation landed during a map"
    );
    within(LIMIT, "the rollbacks", registry.map_rollbacks_settled()).await;
    eventually(LIMIT, "every buffer is back", || {
        registry.stats().live_allocations == 0
            && pair.owner.engine_live() == baseline.1
            && registry.stats().registered_bytes == baseline.0
    })
    .await;
    assert_eq!(
        registry.stats().leaked_bytes,
        0,
        "{lane:?}: an ordinary cancellation leaked"
    );
    pair.shut_down(LIMIT).await;
}

/// Lent buffers the application still holds through the documented shutdown
/// order (registry shutdown, engine teardown, release): a withdrawal is then
/// refused with the buffer back, and dropping them leaks nothing, since the
/// teardown already unregistered their keys.
async fn lent_buffers_held_past_engine_teardown_are_refused_withdrawal_and_leak_nothing_when_dropped(
    lane: Lane,
) {
    let pair = Pair::start(lane.clone(), registry_config());
    let registry = &pair.owner.registry;
    let dropped = registry
        .alloc_pinned(LEN)
        .await
        .unwrap()
        .describe()
        .await
        .unwrap();
    let withdrawn = registry
        .alloc_pinned(LEN)
        .await
        .unwrap()
        .describe()
        .await
        .unwrap();
    pair.shut_down(LIMIT).await;
    drop(dropped);
    let refused = withdrawn.withdraw().await.unwrap_err();
    assert_eq!(refused.error(), &RdmaError::ShuttingDown);
    drop(refused.into_buf().expect("the buffer comes back"));
    // Both own registrations' unmaps are confirmed (after the teardown,
    // the engine answers them `Ok`); until then their tasks hold the slots.
    eventually(LIMIT, "both buffers' own registrations are let go", || {
        registry.stats().lent_registrations == 0
    })
    .await;
    assert_eq!(
        registry.stats().leaked_bytes,
        0,
        "{lane:?}: a key the teardown unregistered was counted as leaked"
    );
    assert_eq!(pair.owner.engine_live(), 0);
}
