//! The registry's counters follow what it did: registrations and releases,
//! GETs and their bytes, errors by kind, and the gauges of `stats()`.

use std::time::Duration;

use rdmareg_backend::loopback::FaultOp;
use rdmareg_registry::{ErrorKind, RdmaError};

use crate::common::*;

#[tokio::test(start_paused = true)]
async fn counters_follow_registrations_gets_and_errors() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let source = owner
        .registry
        .register_owned(pattern(5000, 3))
        .await
        .unwrap();
    let descriptor = source.descriptor().unwrap();
    let mut buf = consumer.registry.alloc_pinned(5000).await.unwrap();
    for _ in 0..3 {
        consumer
            .registry
            .get(OWNER, &descriptor, &mut buf)
            .await
            .unwrap();
    }
    let _hold = consumer.backend.faults().hang(FaultOp::Get);
    let timed_out = consumer.registry.get(OWNER, &descriptor, &mut buf).await;
    assert_eq!(timed_out, Err(RdmaError::Timeout));
    drop(_hold);
    let refused = consumer.registry.alloc_pinned(0).await;
    assert!(refused.is_err());

    let m = consumer.registry.metrics();
    assert_eq!(m.gets, 3);
    assert_eq!(m.get_bytes, 3 * 5000);
    assert_eq!(m.get_latency.count, 4, "every answered GET is observed");
    assert_eq!(m.errors_of(ErrorKind::Timeout), 1);
    assert_eq!(m.errors_of(ErrorKind::OutOfRange), 1);
    assert_eq!(m.registrations, 1, "one pool arena");
    assert_eq!(m.stats, consumer.registry.stats());
    assert_eq!(m.stats.pool_bytes_in_use, 8192, "5000 B is two granules");
    drop(buf);
    assert_eq!(consumer.registry.stats().pool_bytes_in_use, 0);

    let o = owner.registry.metrics();
    assert_eq!((o.registrations, o.unregistrations), (1, 0));
    source.unregister(Duration::from_secs(5)).await.unwrap();
    let o = owner.registry.metrics();
    assert_eq!((o.registrations, o.unregistrations), (1, 1));
    assert_eq!(o.stats.live_regions, 0);
}

#[tokio::test(start_paused = true)]
async fn budget_refusals_count_each_refused_registration() {
    let (_fabric, side) = one_side(small_config().with_budget_bytes(page() as u64));
    for _ in 0..2 {
        let refused = side.registry.register_owned(pattern(2 * page(), 1)).await;
        assert!(refused.is_err());
    }
    let m = side.registry.metrics();
    assert_eq!(m.budget_refusals, 2);
    assert_eq!(m.errors_of(ErrorKind::BudgetExceeded), 2);
    assert_eq!(m.registrations, 0);
}

/// A transfer list is counted as its entries read one by one would be:
/// each served entry a GET and its bytes, each failed one its own error,
/// every entry one latency observation. A post dropped while its batch is
/// in flight counts nothing, not part of it, even once the batch is over;
/// the next list counts in full.
#[tokio::test(start_paused = true)]
async fn a_list_counts_its_entries_exactly_and_a_dropped_one_counts_nothing() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let live = owner
        .registry
        .register_owned(pattern(2000, 1))
        .await
        .unwrap();
    let gone = owner
        .registry
        .register_owned(pattern(2000, 2))
        .await
        .unwrap();
    let (live_d, gone_d) = (live.descriptor().unwrap(), gone.descriptor().unwrap());
    gone.unregister(Duration::from_secs(5)).await.unwrap();
    let mut buffers = vec![consumer.registry.alloc_pinned(6000).await.unwrap()];
    let answers = consumer
        .registry
        .get_many(
            OWNER,
            &[(&live_d, 0, 0), (&gone_d, 0, 2000), (&live_d, 0, 4000)],
            &mut buffers,
        )
        .await
        .unwrap();
    let failed = answers[1].clone().expect_err("the stale entry fails");
    assert_eq!((&answers[0], &answers[2]), (&Ok(()), &Ok(())));
    let m = consumer.registry.metrics();
    assert_eq!(m.gets, 2);
    assert_eq!(m.get_bytes, 4000);
    assert_eq!(m.get_latency.count, 3, "every entry is observed");
    assert_eq!(m.errors_of(failed.kind()), 1);

    let mut list = consumer.registry.transfer_list(OWNER);
    list.push(&live_d, 0, 0).unwrap();
    list.push(&live_d, 0, 2000).unwrap();
    let hold = consumer.backend.faults().hang(FaultOp::Get);
    {
        let mut posting = Box::pin(consumer.registry.post(&list, &mut buffers));
        assert!(futures::poll!(&mut posting).is_pending());
        hold.until_waiting(2).await;
    }
    hold.release();
    eventually("the dropped batch finished", || {
        consumer.registry.stats().transfers_in_flight == 0
    })
    .await;
    let after_drop = consumer.registry.metrics();
    assert_eq!(
        (
            after_drop.gets,
            after_drop.get_bytes,
            after_drop.get_latency.count
        ),
        (m.gets, m.get_bytes, m.get_latency.count),
        "a dropped list counted"
    );
    let mut fresh = vec![consumer.registry.alloc_pinned(4000).await.unwrap()];
    let answers = consumer.registry.post(&list, &mut fresh).await.unwrap();
    assert_eq!(answers, vec![Ok(()), Ok(())]);
    let m = consumer.registry.metrics();
    assert_eq!(m.gets, 4);
    assert_eq!(m.get_bytes, 8000);
    assert_eq!(m.get_latency.count, 5);
    drop((buffers, fresh));
    shut_down(&consumer).await;
    shut_down(&owner).await;
}
