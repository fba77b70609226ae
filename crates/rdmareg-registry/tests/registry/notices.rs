//! Notices through the registry: a reader tells an owner it is done, the
//! owner frees what was read, and bad notices are typed errors that read
//! nothing.

use std::time::Duration;

use futures::StreamExt;
use rdmareg_registry::{MAX_NOTICE_BYTES, Notice, RdmaError};

use crate::common::*;

/// The next notice an owner receives, within a second of virtual time.
pub(crate) async fn next_notice(
    stream: &mut futures::stream::BoxStream<'static, Notice>,
) -> Notice {
    within(Duration::from_secs(1), "a notice", stream.next())
        .await
        .expect("the stream is open")
}

#[tokio::test(start_paused = true)]
async fn a_read_with_a_notice_reaches_the_owner_after_its_bytes() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let mut notices = owner.registry.notices().unwrap();
    let source = owner
        .registry
        .register_owned(pattern(5000, 3))
        .await
        .unwrap();
    let mut buf = consumer.registry.alloc_pinned(5000).await.unwrap();
    consumer
        .registry
        .get_with_notice(OWNER, &source.descriptor().unwrap(), &mut buf, "done")
        .await
        .unwrap();
    assert_eq!(&buf[..], &pattern(5000, 3)[..]);
    let notice = next_notice(&mut notices).await;
    assert_eq!(&notice.bytes[..], b"done");
    assert_eq!(Some(notice.from), consumer.registry.notice_sender());
    drop((source, buf));
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// The lifecycle the notices exist for: the reader names in its notice
/// what it read, and the owner unregisters exactly that once told, with
/// no guessing and no timeout.
#[tokio::test(start_paused = true)]
async fn an_owner_frees_each_range_when_its_reader_is_done() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let mut notices = owner.registry.notices().unwrap();
    let mut ranges = Vec::new();
    for seed in 0..3u8 {
        let guard = owner
            .registry
            .register_owned(pattern(4096, seed))
            .await
            .unwrap();
        ranges.push(Some(guard));
    }
    let descriptors: Vec<_> = ranges
        .iter()
        .map(|g| g.as_ref().unwrap().descriptor().unwrap())
        .collect();
    for (index, descriptor) in descriptors.iter().enumerate() {
        let mut buf = consumer.registry.alloc_pinned(4096).await.unwrap();
        consumer
            .registry
            .get_with_notice(OWNER, descriptor, &mut buf, vec![index as u8])
            .await
            .unwrap();
        assert_eq!(&buf[..], &pattern(4096, index as u8)[..]);
    }
    for _ in 0..3 {
        let index = next_notice(&mut notices).await.bytes[0] as usize;
        let guard = ranges[index].take().expect("each range is released once");
        let watch = guard.watch();
        guard.unregister(Duration::from_secs(1)).await.unwrap();
        assert!(watch.is_deregistered());
    }
    assert_eq!(owner.registry.stats().live_regions, 0);
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// A read that fails sends no notice: a notice sent on its own afterwards
/// is the first the owner receives.
#[tokio::test(start_paused = true)]
async fn a_failed_read_sends_no_notice() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let mut notices = owner.registry.notices().unwrap();
    let source = owner
        .registry
        .register_owned(pattern(5000, 3))
        .await
        .unwrap();
    let descriptor = source.descriptor().unwrap();
    let mut small = consumer.registry.alloc_pinned(100).await.unwrap();
    assert!(matches!(
        consumer
            .registry
            .get_with_notice(OWNER, &descriptor, &mut small, "too small")
            .await,
        Err(RdmaError::DestinationTooSmall { .. })
    ));
    // The owner unmaps the source: the next read fails at the owner.
    source.unregister(Duration::from_secs(1)).await.unwrap();
    let mut buf = consumer.registry.alloc_pinned(5000).await.unwrap();
    assert!(
        consumer
            .registry
            .get_with_notice(OWNER, &descriptor, &mut buf, "stale")
            .await
            .is_err()
    );
    consumer.registry.notify(OWNER, "marker").await.unwrap();
    assert_eq!(&next_notice(&mut notices).await.bytes[..], b"marker");
    drop((small, buf));
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// A notice over the bound is refused before anything is read: the buffer
/// keeps its bytes and is not surrendered.
#[tokio::test(start_paused = true)]
async fn an_oversized_notice_is_refused_and_reads_nothing() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let source = owner.registry.register_owned(pattern(64, 3)).await.unwrap();
    let mut buf = consumer.registry.alloc_pinned(64).await.unwrap();
    buf.fill(0xEE);
    let too_large = vec![0u8; MAX_NOTICE_BYTES + 1];
    assert_eq!(
        consumer
            .registry
            .get_with_notice(
                OWNER,
                &source.descriptor().unwrap(),
                &mut buf,
                too_large.clone()
            )
            .await,
        Err(RdmaError::NoticeTooLarge {
            length: MAX_NOTICE_BYTES as u64 + 1
        })
    );
    assert!(!buf.is_surrendered());
    assert!(buf.iter().all(|&b| b == 0xEE));
    assert!(matches!(
        consumer.registry.notify(OWNER, too_large).await,
        Err(RdmaError::NoticeTooLarge { .. })
    ));
    drop((source, buf));
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

#[tokio::test(start_paused = true)]
async fn a_notice_after_shutdown_is_refused() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let swept = consumer.registry.shutdown(Duration::from_secs(1)).await;
    assert_eq!(
        consumer.registry.notify(OWNER, "late").await,
        Err(RdmaError::ShuttingDown)
    );
    consumer.backend.shutdown().await;
    assert!(swept.finish_after_backend_teardown().released);
    shut_down(&owner).await;
}

#[tokio::test(start_paused = true)]
async fn a_notice_to_an_unknown_peer_is_not_configured() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    assert_eq!(
        consumer
            .registry
            .notify(rdmareg_registry::PeerId(99), "nobody")
            .await,
        Err(RdmaError::NotConfigured)
    );
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// A list's notice reaches the owner once every entry landed; a list
/// with one failed entry withholds it, so the first notice the owner then
/// sees is a later one.
#[tokio::test(start_paused = true)]
async fn a_lists_notice_follows_its_entries_and_only_whole_lists() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let mut notices = owner.registry.notices().unwrap();
    let source = owner
        .registry
        .register_owned(pattern(8000, 6))
        .await
        .unwrap();
    let mut list = consumer.registry.transfer_list(OWNER);
    list.push(&source.descriptor_range(0, 1000).unwrap(), 0, 0)
        .unwrap();
    list.push(&source.descriptor_range(5000, 1000).unwrap(), 0, 1000)
        .unwrap();
    let mut buffers = vec![consumer.registry.alloc_pinned(2000).await.unwrap()];
    let answers = consumer
        .registry
        .post_with_notice(&list, &mut buffers, "list done")
        .await
        .unwrap();
    assert_eq!(answers, vec![Ok(()); 2]);
    assert_eq!(&buffers[0][1000..], &pattern(8000, 6)[5000..6000]);
    assert_eq!(&next_notice(&mut notices).await.bytes[..], b"list done");

    let stale = owner
        .registry
        .register_owned(pattern(1000, 1))
        .await
        .unwrap();
    let stale_descriptor = stale.descriptor().unwrap();
    stale.unregister(Duration::from_secs(1)).await.unwrap();
    let mut half_stale = consumer.registry.transfer_list(OWNER);
    half_stale
        .push(&source.descriptor_range(0, 1000).unwrap(), 0, 0)
        .unwrap();
    half_stale.push(&stale_descriptor, 0, 1000).unwrap();
    let answers = consumer
        .registry
        .post_with_notice(&half_stale, &mut buffers, "withheld")
        .await
        .unwrap();
    assert_eq!(answers[0], Ok(()));
    assert!(answers[1].is_err());
    consumer.registry.notify(OWNER, "marker").await.unwrap();
    assert_eq!(&next_notice(&mut notices).await.bytes[..], b"marker");
    // An empty list has nothing to wait for: its notice goes at once.
    let empty = consumer.registry.transfer_list(OWNER);
    assert_eq!(
        consumer
            .registry
            .post_with_notice(&empty, &mut buffers, "nothing to read")
            .await,
        Ok(Vec::new())
    );
    assert_eq!(
        &next_notice(&mut notices).await.bytes[..],
        b"nothing to read"
    );
    // An empty list has nothing to wait for: its notice goes at once.
    let empty = consumer.registry.transfer_list(OWNER);
    assert_eq!(
        consumer
            .registry
            .post_with_notice(&empty, &mut buffers, "nothing to read")
            .await,
        Ok(Vec::new())
    );
    assert_eq!(
        &next_notice(&mut notices).await.bytes[..],
        b"nothing to read"
    );
    assert_eq!(
        consumer
            .registry
            .post_with_notice(&list, &mut buffers, vec![0; MAX_NOTICE_BYTES + 1])
            .await,
        Err(RdmaError::NoticeTooLarge {
            length: MAX_NOTICE_BYTES as u64 + 1
        })
    );
    drop((source, buffers));
    shut_down(&consumer).await;
    shut_down(&owner).await;
}
