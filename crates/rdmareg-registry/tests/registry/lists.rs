//! Transfer lists: reads checked once, posted as one batch any number of
//! times; each entry answered on its own; destinations checked before
//! anything is submitted and held (surrendered if the caller leaves) while
//! the batch is in flight.

use rdmareg_backend::loopback::FaultOp;
use rdmareg_registry::{Descriptor, DescriptorError, RdmaError};

use crate::common::*;

#[tokio::test(start_paused = true)]
async fn a_list_posted_twice_lands_its_ranges_each_time() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let source = owner
        .registry
        .register_owned(pattern(8000, 7))
        .await
        .unwrap();
    let mut list = consumer.registry.transfer_list(OWNER);
    // Scattered blocks into two buffers, out of source order.
    assert_eq!(
        list.push(&source.descriptor_range(4000, 1000).unwrap(), 0, 0),
        Ok(0)
    );
    assert_eq!(
        list.push(&source.descriptor_range(0, 1000).unwrap(), 0, 2000),
        Ok(1)
    );
    assert_eq!(
        list.push(&source.descriptor_range(7000, 1000).unwrap(), 1, 10),
        Ok(2)
    );
    assert_eq!(
        (list.len(), list.total_bytes(), list.buffers_needed()),
        (3, 3000, 2)
    );
    let want = pattern(8000, 7);
    for round in 0..2 {
        let mut buffers = vec![
            consumer.registry.alloc_pinned(3000).await.unwrap(),
            consumer.registry.alloc_pinned(1010).await.unwrap(),
        ];
        for b in &mut buffers {
            b.fill(0xEE);
        }
        let answers = consumer.registry.post(&list, &mut buffers).await.unwrap();
        assert_eq!(answers, vec![Ok(()); 3], "round {round}");
        assert_eq!(&buffers[0][..1000], &want[4000..5000]);
        assert!(buffers[0][1000..2000].iter().all(|&b| b == 0xEE));
        assert_eq!(&buffers[0][2000..3000], &want[..1000]);
        assert!(buffers[1][..10].iter().all(|&b| b == 0xEE));
        assert_eq!(&buffers[1][10..], &want[7000..8000]);
    }
    assert_eq!(consumer.registry.stats().transfers_in_flight, 0);
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

#[tokio::test(start_paused = true)]
async fn get_many_answers_each_read_and_a_stale_one_fails_alone() {
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
    gone.unregister(std::time::Duration::from_secs(5))
        .await
        .unwrap();
    let mut buffers = vec![consumer.registry.alloc_pinned(4000).await.unwrap()];
    let answers = consumer
        .registry
        .get_many(OWNER, &[(&live_d, 0, 0), (&gone_d, 0, 2000)], &mut buffers)
        .await
        .unwrap();
    assert_eq!(answers[0], Ok(()));
    assert!(
        answers[1].is_err(),
        "the stale read fails: {:?}",
        answers[1]
    );
    assert_eq!(&buffers[0][..2000], &pattern(2000, 1)[..]);
    assert!(!buffers[0].is_surrendered(), "the buffer is given back");
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

#[tokio::test(start_paused = true)]
async fn malformed_entries_are_refused_when_pushed_and_leave_the_list_as_it_was() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let source = owner
        .registry
        .register_owned(pattern(100, 0))
        .await
        .unwrap();
    let real = source.descriptor().unwrap();
    let foreign = Descriptor::new(
        "another-backend",
        real.addr(),
        real.len(),
        real.generation(),
        real.packed_key().clone(),
    )
    .unwrap();
    let mut list = consumer.registry.transfer_list(OWNER);
    assert_eq!(
        list.push(&foreign, 0, 0),
        Err(RdmaError::InvalidDescriptor(
            DescriptorError::InvalidBackendKey
        ))
    );
    assert_eq!(list.push(&real, 0, usize::MAX), Err(RdmaError::OutOfRange));
    assert!(list.is_empty());
    assert_eq!(list.buffers_needed(), 0);
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

#[tokio::test(start_paused = true)]
async fn a_post_into_missing_or_short_buffers_submits_nothing() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let source = owner
        .registry
        .register_owned(pattern(1000, 0))
        .await
        .unwrap();
    let mut list = consumer.registry.transfer_list(OWNER);
    list.push(&source.descriptor().unwrap(), 1, 0).unwrap();
    let mut one = vec![consumer.registry.alloc_pinned(1000).await.unwrap()];
    assert_eq!(
        consumer.registry.post(&list, &mut one).await,
        Err(RdmaError::MissingBuffers {
            needed: 2,
            given: 1
        }),
        "buffer 1 is missing"
    );
    let mut short = vec![
        consumer.registry.alloc_pinned(10).await.unwrap(),
        consumer.registry.alloc_pinned(999).await.unwrap(),
    ];
    short[1].fill(0xEE);
    assert_eq!(
        consumer.registry.post(&list, &mut short).await,
        Err(RdmaError::DestinationTooSmall {
            needed: 1000,
            available: 999
        }),
        "buffer 1 is one byte short"
    );
    assert!(short[1].iter().all(|&b| b == 0xEE), "nothing was written");
    assert!(!short[1].is_surrendered());
    assert_eq!(consumer.registry.stats().transfers_in_flight, 0);
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

#[tokio::test(start_paused = true)]
async fn a_dropped_post_surrenders_its_buffers_and_holds_their_slots_until_the_batch_is_over() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let source = owner
        .registry
        .register_owned(pattern(4096, 1))
        .await
        .unwrap();
    let descriptor = source.descriptor().unwrap();
    let mut list = consumer.registry.transfer_list(OWNER);
    list.push(&descriptor, 0, 0).unwrap();
    list.push(&descriptor, 1, 0).unwrap();
    let mut buffers = vec![
        consumer.registry.alloc_pinned(4096).await.unwrap(),
        consumer.registry.alloc_pinned(4096).await.unwrap(),
    ];
    let hold = consumer.backend.faults().hang(FaultOp::Get);
    {
        let mut posting = Box::pin(consumer.registry.post(&list, &mut buffers));
        assert!(futures::poll!(&mut posting).is_pending());
        hold.until_waiting(2).await;
    }
    assert!(
        buffers.iter().all(|b| b.is_surrendered()),
        "their memory went with the batch"
    );
    assert_eq!(
        consumer.registry.post(&list, &mut buffers).await,
        Err(RdmaError::BufferSurrendered),
        "a post into surrendered buffers"
    );
    drop(buffers);
    let stats = consumer.registry.stats();
    assert_eq!(stats.transfers_in_flight, 1, "the batch is one transfer");
    assert_eq!(stats.live_allocations, 2, "the batch holds both slots");
    hold.release();
    eventually("batch finished", || {
        consumer.registry.stats().transfers_in_flight == 0
    })
    .await;
    assert_eq!(
        consumer.registry.stats().live_allocations,
        0,
        "slots returned"
    );
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

#[tokio::test(start_paused = true)]
async fn shutdown_waits_for_a_posted_batch() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let source = owner
        .registry
        .register_owned(pattern(4096, 1))
        .await
        .unwrap();
    let mut list = consumer.registry.transfer_list(OWNER);
    list.push(&source.descriptor().unwrap(), 0, 0).unwrap();
    let mut buffers = vec![consumer.registry.alloc_pinned(4096).await.unwrap()];
    let hold = consumer.backend.faults().hang(FaultOp::Get);
    let registry = consumer.registry.clone();
    let posting = tokio::spawn(async move {
        let answers = registry.post(&list, &mut buffers).await;
        (answers, buffers)
    });
    hold.until_waiting(1).await;
    assert!(
        consumer
            .registry
            .post(&consumer.registry.transfer_list(OWNER), &mut [])
            .await
            .is_ok()
    );
    let shutdown = tokio::spawn({
        let registry = consumer.registry.clone();
        async move { registry.shutdown(std::time::Duration::from_secs(5)).await }
    });
    tokio::task::yield_now().await;
    assert!(!shutdown.is_finished(), "shutdown waits for the batch");
    hold.release();
    let (answers, buffers) = posting.await.unwrap();
    assert_eq!(answers, Ok(vec![Ok(())]));
    assert_eq!(&buffers[0][..], &pattern(4096, 1)[..]);
    drop(buffers);
    let _ = shutdown.await.unwrap();
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

#[tokio::test(start_paused = true)]
async fn a_buffer_index_past_any_slice_is_refused_at_push_without_allocating() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let source = owner.registry.register_owned(pattern(64, 1)).await.unwrap();
    let descriptor = source.descriptor().unwrap();
    let mut list = consumer.registry.transfer_list(OWNER);
    list.push(&descriptor, 0, 0).unwrap();
    // An index no slice of buffers can reach, and the largest index there
    // is: each is a typed refusal, not an allocation of that many entries.
    for index in [1usize << 40, usize::MAX / 2, usize::MAX] {
        assert_eq!(
            list.push(&descriptor, index, 0),
            Err(RdmaError::OutOfRange),
            "index {index}"
        );
    }
    assert_eq!(
        (list.len(), list.buffers_needed()),
        (1, 1),
        "the list is unchanged"
    );
    let reads = [(&descriptor, usize::MAX, 0)];
    let mut buffers = vec![consumer.registry.alloc_pinned(64).await.unwrap()];
    assert_eq!(
        consumer
            .registry
            .get_many(OWNER, &reads, &mut buffers)
            .await,
        Err(RdmaError::OutOfRange)
    );
    drop(buffers);
    shut_down(&consumer).await;
    shut_down(&owner).await;
}
