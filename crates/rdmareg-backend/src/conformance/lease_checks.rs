//! Checks of descriptor leases (contract point 11): a lease key reads
//! what the region's key reads until the lease ended, by expiry or by its
//! readers' releases, and not after; a release counts only for the lease
//! it names. A backend without leases must say so.

use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::BoxFuture;
use rdmareg_core::{LeaseEnd, LeaseTerms, RdmaError};

use super::BackendPair;
use super::buffer::Mapped;
use super::support::{FILL, assert_copied, get_request, kit_get, source_byte};

/// How long a release may take to arrive.
const ARRIVAL: Duration = Duration::from_secs(10);

/// How long the kit waits to see that a lease did not end.
const SILENCE: Duration = Duration::from_millis(200);

/// A lease the checks do not expect to expire.
const LONG: Duration = Duration::from_secs(60);

fn terms(readers: u32, ttl: Duration) -> LeaseTerms {
    LeaseTerms {
        readers,
        expires_at: Instant::now() + ttl,
    }
}

/// Whether the backend leases; one that does not must refuse as
/// [`RdmaError::Unsupported`], and the check ends there.
async fn leases_supported(pair: &BackendPair, src: &Mapped) -> bool {
    if pair.capabilities.leases {
        return true;
    }
    let leased = pair.owner.lease(src.id(), terms(1, LONG)).await;
    assert!(
        matches!(leased, Err(RdmaError::Unsupported { .. })),
        "a backend without leases refuses one as unsupported: {leased:?}"
    );
    false
}

/// What a 4,000-byte read of `src` under `key` returns, checking the
/// bytes when it succeeds.
async fn read_under(
    pair: &BackendPair,
    src: &Mapped,
    key: &Bytes,
    what: &str,
) -> Result<(), RdmaError> {
    let dst = Mapped::filled(&*pair.consumer, 8192, |_| FILL).await;
    let mut request = get_request(pair, src, 100, &dst, 0, 4000);
    request.packed_key = key.clone();
    let result = kit_get(&*pair.consumer, request).await;
    if result.is_ok() {
        assert_copied(&dst.buf.snapshot(), 0, 100, 4000, what);
    } else {
        assert_copied(&dst.buf.snapshot(), 0, 0, 0, what);
    }
    dst.release(&*pair.consumer).await;
    result
}

async fn release(pair: &BackendPair, key: &Bytes) -> Result<(), RdmaError> {
    pair.consumer
        .release_lease(pair.owner_as_seen_by_consumer, key.clone())
        .await
}

/// `released`, if it resolves within `limit`.
async fn ended_within(
    released: &mut BoxFuture<'static, LeaseEnd>,
    limit: Duration,
) -> Option<LeaseEnd> {
    tokio::time::timeout(limit, released).await.ok()
}

/// A lease key reads the region's bytes until the lease's expiry and is
/// refused [`RdmaError::LeaseExpired`] from then on, with nothing
/// written; the region's own key still reads.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn a_lease_serves_reads_until_its_expiry(pair: &BackendPair) {
    let src = Mapped::filled(&*pair.owner, 8192, source_byte).await;
    if leases_supported(pair, &src).await {
        let lease = pair
            .owner
            .lease(src.id(), terms(1, Duration::from_millis(500)))
            .await
            .expect("a lease of a mapped region");
        let expires_at = Instant::now() + Duration::from_millis(500);
        assert_eq!(
            read_under(pair, &src, &lease.packed_key, "a read under a live lease").await,
            Ok(())
        );
        tokio::time::sleep_until(expires_at.into()).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(
            read_under(pair, &src, &lease.packed_key, "a read after the expiry").await,
            Err(RdmaError::LeaseExpired)
        );
        let own = src.region.packed_key.clone();
        assert_eq!(
            read_under(pair, &src, &own, "the region's own key").await,
            Ok(())
        );
    }
    src.release(&*pair.owner).await;
}

/// The reader's release ends a one-reader lease: the owner's future
/// resolves `Released` and later reads under it are refused.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn a_lease_ends_when_its_reader_released_it(pair: &BackendPair) {
    let src = Mapped::filled(&*pair.owner, 8192, source_byte).await;
    if leases_supported(pair, &src).await {
        let mut lease = pair
            .owner
            .lease(src.id(), terms(1, LONG))
            .await
            .expect("a lease of a mapped region");
        assert_eq!(
            read_under(pair, &src, &lease.packed_key, "a read under a live lease").await,
            Ok(())
        );
        assert_eq!(
            ended_within(&mut lease.released, SILENCE).await,
            None,
            "no release yet"
        );
        assert_eq!(release(pair, &lease.packed_key).await, Ok(()));
        assert_eq!(
            ended_within(&mut lease.released, ARRIVAL).await,
            Some(LeaseEnd::Released),
            "the release arrived"
        );
        assert_eq!(
            read_under(pair, &src, &lease.packed_key, "a read after the release").await,
            Err(RdmaError::LeaseExpired)
        );
    }
    src.release(&*pair.owner).await;
}

/// A release counts once per reader and only for the lease it names: a
/// second release by the same reader leaves a two-reader lease live, a
/// release of one lease leaves another of the same region live, and a
/// key changed in its last byte ends nothing.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn a_release_counts_once_and_only_for_its_lease(pair: &BackendPair) {
    let src = Mapped::filled(&*pair.owner, 8192, source_byte).await;
    if leases_supported(pair, &src).await {
        let mut two_readers = pair
            .owner
            .lease(src.id(), terms(2, LONG))
            .await
            .expect("a lease");
        let mut other = pair
            .owner
            .lease(src.id(), terms(1, LONG))
            .await
            .expect("a lease");
        let mut forged = other.packed_key.to_vec();
        *forged.last_mut().expect("a key") ^= 0x5A;
        let forged = pair
            .consumer
            .release_lease(pair.owner_as_seen_by_consumer, Bytes::from(forged))
            .await;
        assert!(
            matches!(forged, Ok(()) | Err(RdmaError::InvalidKey)),
            "a forged release is sent or refused as a bad key: {forged:?}"
        );
        assert_eq!(release(pair, &two_readers.packed_key).await, Ok(()));
        assert_eq!(release(pair, &two_readers.packed_key).await, Ok(()));
        assert_eq!(
            ended_within(&mut two_readers.released, SILENCE).await,
            None,
            "one reader released twice: a two-reader lease stays live"
        );
        assert_eq!(
            ended_within(&mut other.released, SILENCE).await,
            None,
            "no release named the other lease but a forged one"
        );
        assert_eq!(
            read_under(pair, &src, &other.packed_key, "the other lease").await,
            Ok(())
        );
        assert_eq!(
            read_under(pair, &src, &two_readers.packed_key, "the two-reader lease").await,
            Ok(())
        );
        assert_eq!(release(pair, &other.packed_key).await, Ok(()));
        assert_eq!(
            ended_within(&mut other.released, ARRIVAL).await,
            Some(LeaseEnd::Released)
        );
        assert_eq!(
            ended_within(&mut two_readers.released, SILENCE).await,
            None,
            "releasing one lease ends only that one"
        );
    }
    src.release(&*pair.owner).await;
}

/// Bad terms, unknown regions and unmaps: typed errors, and an unmap ends
/// the region's leases (`Withdrawn`), after which nothing reads.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn leases_of_bad_terms_or_unmapped_regions_are_refused(pair: &BackendPair) {
    let src = Mapped::filled(&*pair.owner, 8192, source_byte).await;
    if !leases_supported(pair, &src).await {
        src.release(&*pair.owner).await;
        return;
    }
    for (readers, ttl) in [(0, LONG), (crate::leases::MAX_LEASE_READERS + 1, LONG)] {
        let leased = pair.owner.lease(src.id(), terms(readers, ttl)).await;
        assert!(
            matches!(leased, Err(RdmaError::OutOfRange)),
            "{readers} readers: {leased:?}"
        );
    }
    let expired = LeaseTerms {
        readers: 1,
        expires_at: Instant::now(),
    };
    assert!(matches!(
        pair.owner.lease(src.id(), expired).await,
        Err(RdmaError::OutOfRange)
    ));
    assert!(matches!(
        pair.owner.lease(u64::MAX - 7, terms(1, LONG)).await,
        Err(RdmaError::RegionNotFound)
    ));
    let mut lease = pair
        .owner
        .lease(src.id(), terms(1, LONG))
        .await
        .expect("a lease");
    let key = lease.packed_key.clone();
    let (id, addr) = (src.id(), src.addr());
    src.release(&*pair.owner).await;
    assert_eq!(
        ended_within(&mut lease.released, ARRIVAL).await,
        Some(LeaseEnd::Withdrawn),
        "the unmap ended the lease"
    );
    let dst = Mapped::filled(&*pair.consumer, 8192, |_| FILL).await;
    let request = rdmareg_core::BackendGet {
        peer: pair.owner_as_seen_by_consumer,
        remote_addr: addr,
        packed_key: key,
        local_region_id: dst.id(),
        local_offset: 0,
        len: 64,
        deadline: None,
    };
    let read = kit_get(&*pair.consumer, request).await;
    assert!(read.is_err(), "a lease of an unmapped region reads nothing");
    assert_copied(&dst.buf.snapshot(), 0, 0, 0, "after the unmap");
    dst.release(&*pair.consumer).await;
    assert!(matches!(
        pair.owner.lease(id, terms(1, LONG)).await,
        Err(RdmaError::RegionNotFound)
    ));
}
