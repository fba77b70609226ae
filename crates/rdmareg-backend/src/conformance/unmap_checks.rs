//! Checks of `unmap`: idempotence, proceeding when dropped (contract point
//! 2), and the live count an `Ok` result implies (contract points 3 and 5).

use std::sync::Arc;
use std::task::Poll;

use super::BackendPair;
use super::buffer::Mapped;
use super::support::{FILL, assert_live_now, live, plus, poll_once, settle_live};

/// Ids no backend is expected to have minted for a fresh pair.
const NEVER_MAPPED: [u64; 3] = [0, u64::MAX, 0x5EED_0000_0000_0001];

/// Contract point 2: an unmap of an id that names nothing returns `Ok(())`
/// and leaves the registrations that do exist alone.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn unmap_of_a_never_mapped_id_returns_ok(pair: &BackendPair) {
    for backend in [&*pair.owner, &*pair.consumer] {
        let baseline = live(backend);
        let mapped = Mapped::filled(backend, 100, |_| FILL).await;
        for id in NEVER_MAPPED.into_iter().filter(|&id| id != mapped.id()) {
            assert_eq!(
                backend.unmap(id).await,
                Ok(()),
                "unmap of never-mapped id {id}"
            );
            assert_live_now(backend, plus(baseline, 1), "after unmapping an unknown id");
        }
        mapped.release(backend).await;
        assert_live_now(backend, baseline, "after unmapping the real region");
    }
}

/// Contract points 2 and 3: unmapping a region twice returns `Ok(())` both
/// times, and the count drops once.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn unmap_twice_returns_ok_and_counts_once(pair: &BackendPair) {
    for backend in [&*pair.owner, &*pair.consumer] {
        let baseline = live(backend);
        let mapped = Mapped::filled(backend, 4096, |_| FILL).await;
        let id = mapped.id();
        assert_live_now(backend, plus(baseline, 1), "after a map");
        mapped.release(backend).await;
        assert_live_now(backend, baseline, "after the first unmap");
        assert_eq!(backend.unmap(id).await, Ok(()), "second unmap of {id}");
        assert_live_now(backend, baseline, "after the second unmap");
    }
}

/// Contract point 2: several tasks unmapping one region at once all return
/// `Ok(())`, and once every one of them did, the region is gone.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn concurrent_unmaps_of_one_region_all_return_ok(pair: &BackendPair) {
    const TASKS: usize = 8;
    for backend in [&pair.owner, &pair.consumer] {
        let baseline = live(&**backend);
        let mapped = Mapped::filled(&**backend, 65536, |_| FILL).await;
        let id = mapped.id();
        let tasks: Vec<_> = (0..TASKS)
            .map(|_| {
                let backend = Arc::clone(backend);
                tokio::spawn(async move { backend.unmap(id).await })
            })
            .collect();
        for task in tasks {
            let outcome = task.await.expect("an unmap task panicked");
            assert_eq!(outcome, Ok(()), "concurrent unmap of {id}");
        }
        assert_live_now(&**backend, baseline, "after concurrent unmaps");
        drop(mapped.confirm_unmapped());
    }
}

/// Contract points 3 and 5: every `Ok` unmap lowers the backend's own count
/// by one, whatever the order.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn ok_unmap_decrements_the_live_count(pair: &BackendPair) {
    for backend in [&*pair.owner, &*pair.consumer] {
        let baseline = live(backend);
        let mut regions = Vec::new();
        for (n, len) in [1, 4096, 4097, 100_000].into_iter().enumerate() {
            regions.push(Mapped::filled(backend, len, |_| FILL).await);
            assert_live_now(backend, plus(baseline, n + 1), "while mapping");
        }
        // Unmap out of order: second, last, first, third.
        for (done, index) in [1, 2, 0, 0].into_iter().enumerate() {
            regions.remove(index).release(backend).await;
            assert_live_now(backend, plus(baseline, 3 - done), "while unmapping");
        }
    }
}

/// Contract point 2: an unmap polled once and dropped still proceeds (the
/// count drops), and a later unmap of the id returns `Ok(())`.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn dropped_unmap_still_unmaps(pair: &BackendPair) {
    for backend in [&*pair.owner, &*pair.consumer] {
        let baseline = live(backend);
        let mapped = Mapped::filled(backend, 8192, |_| FILL).await;
        let mut unmap = backend.unmap(mapped.id());
        let first = poll_once(unmap.as_mut());
        drop(unmap);
        if let Poll::Ready(outcome) = first {
            assert_eq!(outcome, Ok(()), "unmap completed on its first poll");
        }
        let within = pair.capabilities.rollback_within;
        settle_live(backend, baseline, within, "after a dropped unmap").await;
        mapped.release(backend).await;
        assert_live_now(backend, baseline, "after the confirming unmap");
    }
}

/// After teardown, an unmap of a released or unknown id returns `Ok(())`.
///
/// Contract point 2 after the pair's teardown
/// ([`BackendPair::with_teardown`]; without one, only the results before
/// it are checked): the same result as before, not a refusal, and a live
/// count of zero, so a registry sweeping late sees one result everywhere.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn unmap_after_teardown_returns_ok_for_released_ids(pair: &BackendPair) {
    let mut released = Vec::new();
    for backend in [&*pair.owner, &*pair.consumer] {
        let mapped = Mapped::filled(backend, 4096, |_| FILL).await;
        let id = mapped.id();
        mapped.release(backend).await;
        assert_eq!(backend.unmap(id).await, Ok(()), "repeated unmap of {id}");
        released.push(id);
    }
    if !pair.teardown_now().await {
        return;
    }
    for (backend, id) in [&*pair.owner, &*pair.consumer].into_iter().zip(released) {
        assert_eq!(
            backend.unmap(id).await,
            Ok(()),
            "unmap after teardown of region {id}, released before it"
        );
        for never in NEVER_MAPPED.into_iter().filter(|&never| never != id) {
            assert_eq!(
                backend.unmap(never).await,
                Ok(()),
                "unmap after teardown of never-mapped id {never}"
            );
        }
        assert_live_now(backend, live(backend).map(|_| 0), "after teardown");
    }
}
