//! GETs into pool buffers: the bytes arrive, bad requests are typed errors
//! that leave the buffer alone, and a transfer holds its destination slot
//! even when its caller goes away.

use std::time::Duration;

use bytes::Bytes;
use std::sync::Arc;

use rdmareg_backend::RdmaBackend;
use rdmareg_backend::loopback::{FaultOp, LoopbackConfig, LoopbackFabric};
use rdmareg_registry::RdmaRegistry;
use rdmareg_registry::{Descriptor, DescriptorError, RdmaError};

use crate::common::*;

#[tokio::test(start_paused = true)]
async fn get_copies_the_described_bytes_into_the_buffer() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let source = owner
        .registry
        .register_owned(pattern(5000, 3))
        .await
        .unwrap();
    let mut buf = consumer.registry.alloc_pinned(5000).await.unwrap();
    consumer
        .registry
        .get(OWNER, &source.descriptor().unwrap(), &mut buf)
        .await
        .unwrap();
    assert_eq!(&buf[..], &pattern(5000, 3)[..]);
    assert_eq!(consumer.registry.stats().transfers_in_flight, 0);
}

#[tokio::test(start_paused = true)]
async fn get_into_lands_a_sub_range_at_an_offset() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let source = owner
        .registry
        .register_owned(pattern(1000, 0))
        .await
        .unwrap();
    let mut buf = consumer.registry.alloc_pinned(300).await.unwrap();
    buf.fill(0xEE);
    let slice = source.descriptor_range(100, 200).unwrap();
    consumer
        .registry
        .get_into(OWNER, &slice, &mut buf, 50)
        .await
        .unwrap();
    assert!(buf[..50].iter().all(|b| *b == 0xEE));
    assert_eq!(&buf[50..250], &pattern(1000, 0)[100..300]);
    assert!(buf[250..].iter().all(|b| *b == 0xEE));
}

#[tokio::test(start_paused = true)]
async fn get_refuses_a_descriptor_of_another_backend() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let source = owner
        .registry
        .register_owned(pattern(100, 0))
        .await
        .unwrap();
    let real = source.descriptor().unwrap();
    let foreign = Descriptor::new(
        "ucx",
        real.addr(),
        real.len(),
        real.generation(),
        Bytes::from_static(&[0; 9]),
    )
    .unwrap();
    let mut buf = consumer.registry.alloc_pinned(100).await.unwrap();
    assert_eq!(
        consumer.registry.get(OWNER, &foreign, &mut buf).await,
        Err(RdmaError::InvalidDescriptor(
            DescriptorError::InvalidBackendKey
        ))
    );
    assert!(!buf.is_surrendered());
}

#[tokio::test(start_paused = true)]
async fn get_refuses_a_range_that_does_not_fit_the_destination() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let source = owner
        .registry
        .register_owned(pattern(1000, 0))
        .await
        .unwrap();
    let descriptor = source.descriptor().unwrap();
    let mut small = consumer.registry.alloc_pinned(999).await.unwrap();
    assert_eq!(
        consumer.registry.get(OWNER, &descriptor, &mut small).await,
        Err(RdmaError::DestinationTooSmall {
            needed: 1000,
            available: 999
        })
    );
    let mut exact = consumer.registry.alloc_pinned(1000).await.unwrap();
    assert_eq!(
        consumer
            .registry
            .get_into(OWNER, &descriptor, &mut exact, 1)
            .await,
        Err(RdmaError::DestinationTooSmall {
            needed: 1001,
            available: 1000
        })
    );
    assert_eq!(
        consumer
            .registry
            .get_into(OWNER, &descriptor, &mut exact, usize::MAX)
            .await,
        Err(RdmaError::OutOfRange)
    );
    assert!(!small.is_surrendered() && !exact.is_surrendered());
    assert_eq!(consumer.registry.stats().transfers_in_flight, 0);
}

#[tokio::test(start_paused = true)]
async fn get_of_an_unregistered_remote_range_fails_and_returns_the_buffer() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let source = owner
        .registry
        .register_owned(pattern(100, 0))
        .await
        .unwrap();
    let descriptor = source.descriptor().unwrap();
    source.unregister(Duration::from_secs(60)).await.unwrap();
    let mut buf = consumer.registry.alloc_pinned(100).await.unwrap();
    assert_eq!(
        consumer.registry.get(OWNER, &descriptor, &mut buf).await,
        Err(RdmaError::RegionNotFound)
    );
    assert_eq!(
        buf.len(),
        100,
        "the buffer is back after the transfer answered"
    );
}

#[tokio::test(start_paused = true)]
async fn get_past_its_deadline_times_out_and_returns_the_buffer() {
    let mut config = small_config();
    config.get_deadline = Duration::from_millis(100);
    let (_fabric, owner, consumer) = two_sides(config);
    let source = owner
        .registry
        .register_owned(pattern(100, 0))
        .await
        .unwrap();
    let mut buf = consumer.registry.alloc_pinned(100).await.unwrap();
    let _hold = consumer.backend.faults().hang(FaultOp::Get);
    assert_eq!(
        consumer
            .registry
            .get(OWNER, &source.descriptor().unwrap(), &mut buf)
            .await,
        Err(RdmaError::Timeout)
    );
    assert!(!buf.is_surrendered());
}

#[tokio::test(start_paused = true)]
async fn a_get_carries_the_registry_deadline_not_the_backend_default() {
    let fabric = LoopbackFabric::new();
    let owner = Side::new(&fabric, OWNER, small_config());
    // A backend whose own default would wait an hour.
    let backend = fabric.backend_with_config(
        CONSUMER,
        LoopbackConfig::default().with_default_get_deadline(Duration::from_secs(3600)),
    );
    let registry = RdmaRegistry::new(
        Arc::clone(&backend) as Arc<dyn RdmaBackend>,
        small_config().with_get_deadline(Duration::from_secs(2)),
        tokio::runtime::Handle::current(),
    )
    .unwrap();
    let source = owner
        .registry
        .register_owned(pattern(100, 0))
        .await
        .unwrap();
    let mut buf = registry.alloc_pinned(100).await.unwrap();
    let _hold = backend.faults().hang(FaultOp::Get);
    let started = tokio::time::Instant::now();
    assert_eq!(
        registry
            .get(OWNER, &source.descriptor().unwrap(), &mut buf)
            .await,
        Err(RdmaError::Timeout)
    );
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_secs(60),
        "the GET timed out after {waited:?}, not at the registry's 2 s deadline"
    );
}

#[tokio::test(start_paused = true)]
async fn dropped_get_keeps_the_destination_slot_until_the_transfer_finishes() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let source = owner
        .registry
        .register_owned(pattern(4096, 1))
        .await
        .unwrap();
    let mut buf = consumer.registry.alloc_pinned(4096).await.unwrap();
    let slot_addr = buf.as_ptr() as u64;
    let hold = consumer.backend.faults().hang(FaultOp::Get);
    {
        let descriptor = source.descriptor().unwrap();
        let mut getting = Box::pin(consumer.registry.get(OWNER, &descriptor, &mut buf));
        assert!(futures::poll!(&mut getting).is_pending());
        hold.until_waiting(1).await;
    }
    assert!(buf.is_surrendered(), "its memory went with the transfer");
    assert!(buf.is_empty());
    drop(buf);
    let stats = consumer.registry.stats();
    assert_eq!(stats.transfers_in_flight, 1);
    assert_eq!(stats.live_allocations, 1, "the transfer holds the slot");
    let other = consumer.registry.try_alloc_pinned(4096).unwrap();
    assert_ne!(other.as_ptr() as u64, slot_addr, "the slot is not reused");

    hold.release();
    eventually("transfer finished", || {
        consumer.registry.stats().transfers_in_flight == 0
    })
    .await;
    assert_eq!(
        consumer.registry.stats().live_allocations,
        1,
        "slot returned"
    );
    drop(other);
    let reused = consumer.registry.try_alloc_pinned(4096).unwrap();
    assert_eq!(reused.as_ptr() as u64, slot_addr);
}
