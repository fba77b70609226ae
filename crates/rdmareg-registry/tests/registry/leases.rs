//! Descriptor leases through the registry: an owner hands a region out to
//! a number of readers for a while, learns when they are done, and no
//! read is served under a lease that ended.

use std::time::Duration;

use bytes::Bytes;
use rdmareg_registry::{
    Descriptor, LeaseOutcome, MAX_LEASE_READERS, PeerId, RdmaError, ReadersDone, RegionGuard,
};

use crate::common::*;

const TTL: Duration = Duration::from_secs(10);

fn readers(released: usize, expired: usize, withdrawn: usize) -> ReadersDone {
    let mut done = ReadersDone::default();
    done.released = released;
    done.expired = expired;
    done.withdrawn = withdrawn;
    done
}

/// What a read of the whole of `descriptor` by `side` returns.
async fn read_all(side: &Side, descriptor: &Descriptor) -> Result<Vec<u8>, RdmaError> {
    let mut buf = side
        .registry
        .alloc_pinned(descriptor.len() as usize)
        .await
        .unwrap();
    side.registry
        .get_into(OWNER, descriptor, &mut buf, 0)
        .await?;
    Ok(buf.to_vec())
}

async fn owned(owner: &Side, seed: u8) -> RegionGuard {
    owner
        .registry
        .register_owned(pattern(5000, seed))
        .await
        .unwrap()
}

/// The lifecycle leases exist for: two readers read and release, and the
/// owner's wait ends with the second reader's release, long before the
/// expiry. A reader releasing twice is still one reader.
#[tokio::test(start_paused = true)]
async fn readers_done_resolves_once_every_reader_released() {
    let (fabric, owner, first) = two_sides(small_config());
    let second = Side::new(&fabric, PeerId(3), small_config());
    let source = owned(&owner, 4).await;
    let lease = source.lease(2, TTL).await.unwrap();
    let mut done = Box::pin(source.readers_done());
    for reader in [&first, &second] {
        let bytes = read_all(reader, lease.descriptor()).await.unwrap();
        assert_eq!(&bytes[..], &pattern(5000, 4)[..]);
    }
    for _ in 0..2 {
        first
            .registry
            .release_lease(OWNER, lease.descriptor())
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(
        futures::poll!(done.as_mut()).is_pending(),
        "one reader released, twice"
    );
    second
        .registry
        .release_lease(OWNER, lease.descriptor())
        .await
        .unwrap();
    let started = tokio::time::Instant::now();
    let done = within(Duration::from_secs(1), "readers done", done).await;
    assert_eq!(done, readers(1, 0, 0));
    assert!(started.elapsed() < TTL);
    assert_eq!(lease.ended().await, LeaseOutcome::Released);
    assert_eq!(
        read_all(&first, lease.descriptor()).await,
        Err(RdmaError::LeaseExpired),
        "a released lease serves no more reads"
    );
    drop(source);
    shut_down(&second).await;
    shut_down(&first).await;
    shut_down(&owner).await;
}

/// A reader that never releases costs the owner the lease's time and no
/// more: from the expiry on its reads fail, and the owner's wait ends.
/// The region's own descriptor is untouched.
#[tokio::test(start_paused = true)]
async fn a_lease_serves_no_read_from_its_expiry_on() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let source = owned(&owner, 5).await;
    let lease = source.lease(1, Duration::from_millis(100)).await.unwrap();
    assert!(read_all(&consumer, lease.descriptor()).await.is_ok());
    let started = tokio::time::Instant::now();
    let done = source.readers_done().await;
    assert_eq!(done, readers(0, 1, 0));
    assert!(started.elapsed() <= Duration::from_millis(100));
    assert_eq!(
        read_all(&consumer, lease.descriptor()).await,
        Err(RdmaError::LeaseExpired)
    );
    assert_eq!(lease.ended().await, LeaseOutcome::Expired);
    assert!(
        read_all(&consumer, &source.descriptor().unwrap())
            .await
            .is_ok()
    );
    drop(source);
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// A release must prove the lease: one with a capability changed in one
/// byte, or of another lease of the same region, ends nothing it names.
#[tokio::test(start_paused = true)]
async fn forged_and_foreign_releases_end_no_one_elses_lease() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let source = owned(&owner, 6).await;
    let mine = source.lease(1, TTL).await.unwrap();
    let theirs = source.lease(1, TTL).await.unwrap();
    let key = mine.descriptor().packed_key();
    let mut forged = key.to_vec();
    *forged.last_mut().unwrap() ^= 1;
    let forged = Descriptor::new(
        mine.descriptor().backend_key(),
        mine.descriptor().addr(),
        mine.descriptor().len(),
        mine.descriptor().generation(),
        Bytes::from(forged),
    )
    .unwrap();
    consumer
        .registry
        .release_lease(OWNER, &forged)
        .await
        .unwrap();
    consumer
        .registry
        .release_lease(OWNER, theirs.descriptor())
        .await
        .unwrap();
    assert_eq!(theirs.ended().await, LeaseOutcome::Released);
    let mut mine_ended = Box::pin(mine.ended());
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(futures::poll!(mine_ended.as_mut()).is_pending());
    assert!(read_all(&consumer, mine.descriptor()).await.is_ok());
    assert_eq!(
        read_all(&consumer, &forged).await,
        Err(RdmaError::RegionNotFound),
        "a forged lease key reads nothing"
    );
    drop(source);
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// `unregister_after_readers` frees the region the moment its reader
/// released it, and says how the leases ended.
#[tokio::test(start_paused = true)]
async fn unregister_after_readers_frees_at_the_release() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let source = owned(&owner, 7).await;
    let watch = source.watch();
    let lease = source.lease(1, TTL).await.unwrap();
    let unregister = tokio::spawn(source.unregister_after_readers(Duration::from_secs(30)));
    assert!(read_all(&consumer, lease.descriptor()).await.is_ok());
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!watch.is_deregistered(), "the reader has not released yet");
    let started = tokio::time::Instant::now();
    consumer
        .registry
        .release_lease(OWNER, lease.descriptor())
        .await
        .unwrap();
    let (done, _) = within(Duration::from_secs(1), "unregister", unregister)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(done, Some(readers(1, 0, 0)));
    assert!(started.elapsed() < Duration::from_secs(1));
    assert!(watch.is_deregistered());
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// Unregistering ends the region's leases: their waiters learn the
/// backend withdrew them, and their readers get nothing.
#[tokio::test(start_paused = true)]
async fn an_unregister_withdraws_the_regions_leases() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let source = owned(&owner, 8).await;
    let lease = source.lease(1, TTL).await.unwrap();
    source.unregister(Duration::from_secs(1)).await.unwrap();
    assert_eq!(lease.ended().await, LeaseOutcome::Withdrawn);
    assert_eq!(
        read_all(&consumer, lease.descriptor()).await,
        Err(RdmaError::RegionNotFound)
    );
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

#[tokio::test(start_paused = true)]
async fn bad_terms_and_bad_releases_are_typed_errors() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let source = owned(&owner, 9).await;
    for (readers, ttl) in [
        (0, TTL),
        (MAX_LEASE_READERS + 1, TTL),
        (1, Duration::ZERO),
        (1, Duration::MAX),
    ] {
        assert_eq!(
            source.lease(readers, ttl).await.err(),
            Some(RdmaError::OutOfRange),
            "{readers} readers for {ttl:?}"
        );
    }
    let lease = source.lease(1, TTL).await.unwrap();
    assert_eq!(
        consumer
            .registry
            .release_lease(OWNER, &source.descriptor().unwrap())
            .await,
        Err(RdmaError::InvalidKey),
        "a region's own descriptor is no lease"
    );
    assert_eq!(
        consumer
            .registry
            .release_lease(PeerId(77), lease.descriptor())
            .await,
        Err(RdmaError::NotConfigured)
    );
    drop(source);
    shut_down(&consumer).await;
    shut_down(&owner).await;
    assert_eq!(
        consumer
            .registry
            .release_lease(OWNER, lease.descriptor())
            .await,
        Err(RdmaError::ShuttingDown)
    );
}

/// A lease a reader released is forgotten at the region's next lease, not
/// kept until its expiry: a long-lived region leased and released many
/// times holds only what is live, and `readers_done` counts only that.
#[tokio::test(start_paused = true)]
async fn released_leases_are_forgotten_at_the_next_lease() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let source = owned(&owner, 10).await;
    for _ in 0..50 {
        let lease = source.lease(1, TTL).await.unwrap();
        consumer
            .registry
            .release_lease(OWNER, lease.descriptor())
            .await
            .unwrap();
    }
    let last = source.lease(1, TTL).await.unwrap();
    consumer
        .registry
        .release_lease(OWNER, last.descriptor())
        .await
        .unwrap();
    let done = within(
        Duration::from_secs(1),
        "readers done",
        source.readers_done(),
    )
    .await;
    assert_eq!(done, readers(1, 0, 0), "only the last lease is still known");
    drop(source);
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// A `ttl` that lands within a second of the last `Instant` would make
/// the timers waiting for it overflow: refused as out of range, like one
/// past it.
#[tokio::test(start_paused = true)]
async fn a_ttl_at_the_end_of_time_is_out_of_range() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let source = owned(&owner, 11).await;
    let now = tokio::time::Instant::now().into_std();
    let (mut fits, mut overflows) = (0u64, u64::MAX);
    while overflows - fits > 1 {
        let middle = fits + (overflows - fits) / 2;
        if now.checked_add(Duration::from_secs(middle)).is_some() {
            fits = middle;
        } else {
            overflows = middle;
        }
    }
    let ttl = Duration::from_secs(fits) - Duration::from_micros(300);
    assert!(now.checked_add(ttl).is_some());
    assert_eq!(
        source.lease(1, ttl).await.err(),
        Some(RdmaError::OutOfRange)
    );
    drop(source);
    shut_down(&consumer).await;
    shut_down(&owner).await;
}
