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
