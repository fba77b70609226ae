//! The pinned pool: granule rounding, geometric growth that saturates,
//! dedicated arenas for large requests, reuse, reclaim with a floor, and
//! arena pages freed only after a confirmed unmap.

use std::time::Duration;

use rdmareg_registry::{GRANULE, PinnedBuf, RdmaError};

use crate::common::*;

fn addr(buf: &PinnedBuf) -> u64 {
    buf.as_ptr() as u64
}

#[tokio::test(start_paused = true)]
async fn buffers_have_exactly_the_requested_length_and_whole_granules_of_space() {
    let (_fabric, side) = one_side(small_config());
    let mut one = side.registry.alloc_pinned(1).await.unwrap();
    let straddling = side
        .registry
        .alloc_pinned(GRANULE as usize + 1)
        .await
        .unwrap();
    let after = side.registry.alloc_pinned(1).await.unwrap();
    assert_eq!((one.len(), straddling.len(), after.len()), (1, 4097, 1));
    assert_eq!(
        addr(&straddling) - addr(&one),
        GRANULE,
        "1 byte takes one granule"
    );
    assert_eq!(
        addr(&after) - addr(&straddling),
        2 * GRANULE,
        "4097 bytes take two"
    );
    one[0] = 0xAB;
    assert_eq!(one[0], 0xAB);
    assert_eq!(one.describe().await.unwrap().len(), 1);
    assert_eq!(side.registry.stats().live_allocations, 3);
    assert_eq!(side.registry.stats().pooled_arenas, 1);
}

#[tokio::test(start_paused = true)]
async fn pooled_arenas_grow_geometrically_and_saturate_at_the_maximum() {
    let (_fabric, side) = one_side(small_config());
    let chunk = 64 * KIB;
    let mut held = Vec::new();
    let mut arena_sizes = Vec::new();
    let mut last_bytes = 0;
    // 64 KiB + 128 KiB + 256 KiB + 256 KiB = 11 chunks.
    for _ in 0..11 {
        held.push(side.registry.alloc_pinned(chunk).await.unwrap());
        let bytes = side.registry.stats().pooled_arena_bytes;
        if bytes != last_bytes {
            arena_sizes.push((bytes - last_bytes) / KIB as u64);
            last_bytes = bytes;
        }
    }
    assert_eq!(arena_sizes, vec![64, 128, 256, 256]);
    assert_eq!(side.live(), 4);
    assert_eq!(side.registered_bytes(), 704 * KIB as u64);
}

#[tokio::test(start_paused = true)]
async fn large_requests_get_a_dedicated_arena_that_is_released_on_drop() {
    let (_fabric, side) = one_side(small_config());
    let big = side.registry.alloc_pinned(200 * KIB).await.unwrap();
    assert!(big.is_dedicated());
    assert_eq!(big.len(), 200 * KIB);
    let stats = side.registry.stats();
    assert_eq!((stats.dedicated_arenas, stats.pooled_arenas), (1, 0));
    assert_eq!(stats.dedicated_arena_bytes, 200 * KIB as u64);
    assert_eq!(side.registered_bytes(), 200 * KIB as u64);
    drop(big);
    eventually("dedicated arena unmapped", || side.live() == 0).await;
    let stats = side.registry.stats();
    assert_eq!(stats.dedicated_arenas, 0);
    assert_eq!(stats.registered_bytes, 0);
    assert_eq!(
        stats.leaked_bytes, 0,
        "confirmed unmap: pages freed, not leaked"
    );
}

#[tokio::test(start_paused = true)]
async fn space_freed_by_a_dropped_buffer_is_reused() {
    let (_fabric, side) = one_side(small_config());
    let first = side.registry.alloc_pinned(10 * KIB).await.unwrap();
    let where_first = addr(&first);
    drop(first);
    let second = side
        .registry
        .try_alloc_pinned(10 * KIB)
        .expect("room in the arena");
    assert_eq!(addr(&second), where_first);
    assert_eq!(side.registry.stats().pooled_arenas, 1);
    assert_eq!(side.live(), 1);
}

#[tokio::test(start_paused = true)]
async fn try_alloc_never_maps() {
    let (_fabric, side) = one_side(small_config());
    assert!(
        side.registry.try_alloc_pinned(100).is_none(),
        "no arena yet"
    );
    assert_eq!(side.live(), 0);
    drop(side.registry.alloc_pinned(100).await.unwrap());
    assert!(side.registry.try_alloc_pinned(100).is_some());
    assert!(
        side.registry.try_alloc_pinned(200 * KIB).is_none(),
        "a dedicated arena would need a map"
    );
    assert!(side.registry.try_alloc_pinned(0).is_none());
    assert_eq!(side.live(), 1);
}

#[tokio::test(start_paused = true)]
async fn degenerate_allocations_are_refused() {
    let (_fabric, side) = one_side(small_config());
    assert_eq!(
        side.registry.alloc_pinned(0).await.unwrap_err(),
        RdmaError::OutOfRange
    );
    assert!(matches!(
        side.registry.alloc_pinned(usize::MAX).await.unwrap_err(),
        RdmaError::OutOfRange | RdmaError::BudgetExceeded { .. }
    ));
    assert_eq!(side.live(), 0);
    assert_eq!(side.registered_bytes(), 0);
}

#[tokio::test(start_paused = true)]
async fn empty_pooled_arenas_are_reclaimed_down_to_the_retention_floor() {
    let mut config = small_config();
    config.pool.reclaim_empty_arenas = true;
    let (_fabric, side) = one_side(config);
    let first = side.registry.alloc_pinned(64 * KIB).await.unwrap();
    let second = side.registry.alloc_pinned(64 * KIB).await.unwrap();
    assert_eq!(side.registry.stats().pooled_arenas, 2);
    drop(second);
    eventually("second arena reclaimed", || side.live() == 1).await;
    drop(first);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let stats = side.registry.stats();
    assert_eq!(stats.pooled_arenas, 1, "the floor keeps the first arena");
    assert_eq!(stats.pooled_arena_bytes, 64 * KIB as u64);
    assert_eq!(stats.registered_bytes, 64 * KIB as u64);
    assert_eq!(side.live(), 1);
    assert!(
        side.registry.try_alloc_pinned(64 * KIB).is_some(),
        "still in service"
    );
}

#[tokio::test(start_paused = true)]
async fn empty_pooled_arenas_are_kept_when_reclaim_is_off() {
    let (_fabric, side) = one_side(small_config());
    let first = side.registry.alloc_pinned(64 * KIB).await.unwrap();
    let second = side.registry.alloc_pinned(64 * KIB).await.unwrap();
    drop((first, second));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(side.registry.stats().pooled_arenas, 2);
    assert_eq!(side.live(), 2);
}

#[tokio::test(start_paused = true)]
async fn an_arena_shrinks_to_what_is_left_of_the_budget() {
    let mut config = small_config();
    config.budget_bytes = 3 * page() as u64;
    let (_fabric, side) = one_side(config);
    let buf = side.registry.alloc_pinned(100).await.unwrap();
    assert_eq!(side.registry.stats().pooled_arena_bytes, 3 * page() as u64);
    assert!(matches!(
        side.registry.alloc_pinned(3 * page()).await.unwrap_err(),
        RdmaError::BudgetExceeded { .. }
    ));
    drop(buf);
}

#[tokio::test(start_paused = true)]
async fn arena_pages_stay_allocated_until_the_unmap_is_confirmed() {
    let (_fabric, side) = one_side(small_config());
    let mut big = side.registry.alloc_pinned(200 * KIB).await.unwrap();
    big[0] = 1;
    side.backend.faults().refuse_unmaps(true);
    drop(big);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let stats = side.registry.stats();
    assert_eq!(stats.dedicated_arenas, 1, "failed unmap: still tracked");
    assert_eq!(stats.registered_bytes, 200 * KIB as u64, "still charged");
    assert_eq!(stats.leaked_bytes, 0, "kept, not yet given up on");

    side.backend.faults().refuse_unmaps(false);
    let swept = side.registry.shutdown(Duration::from_secs(1)).await;
    assert_eq!(swept.report().arenas_deregistered, 1);
    let stats = side.registry.stats();
    assert_eq!((stats.dedicated_arenas, stats.registered_bytes), (0, 0));
    assert_eq!(side.live(), 0);
}

#[tokio::test(start_paused = true)]
async fn arena_pages_never_confirmed_unmapped_are_leaked_loudly_not_freed() {
    let logs = Logs::capture();
    let (_fabric, side) = one_side(small_config());
    let big = side.registry.alloc_pinned(200 * KIB).await.unwrap();
    side.backend.faults().refuse_unmaps(true);
    let swept = side.registry.shutdown(Duration::from_secs(1)).await;
    assert_eq!(swept.report().arenas_surviving, 1);
    side.backend.shutdown().await;
    let report = swept.finish_after_backend_teardown();
    assert!(
        !report.released && report.arenas_registered == 1,
        "{report:?}"
    );
    let Side { backend, registry } = side;
    drop((big, swept, registry));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        logs.text().contains("arena pages leaked"),
        "{}",
        logs.text()
    );
    assert_eq!(
        rdmareg_backend::RdmaBackend::live_registrations(&*backend),
        Some(1)
    );
}
