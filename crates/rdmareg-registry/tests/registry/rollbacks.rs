//! A cancelled map is rolled back by a task on the registry's runtime. If
//! that runtime goes away first, the task is dropped unfinished: the memory
//! it held may be registered by a map the backend still completes (a map
//! pushed to a progress thread does, before the backend rolls it back on
//! its own), so it must be leaked and counted, never freed.

use std::time::Duration;

use rdmareg_backend::RdmaBackend;
use rdmareg_backend::loopback::FaultOp;

use crate::common::{KIB, registry_on_its_own_runtime};

#[test]
fn a_rollback_dropped_with_its_runtime_leaks_the_arena_pages_instead_of_freeing_them() {
    // The caller's runtime keeps running (and runs the detached map); the
    // registry's runtime, where rollbacks are spawned, is shut down below.
    let (caller, registry_runtime, backend, registry) = registry_on_its_own_runtime();
    backend.faults().detach_maps(true);
    let gate = backend.faults().hang(FaultOp::Map);

    caller.block_on(async {
        // The first allocation maps the first arena; the map hangs and the
        // allocation is cancelled, which hands the map to a rollback task.
        let cancelled =
            tokio::time::timeout(Duration::from_millis(50), registry.alloc_pinned(4 * KIB)).await;
        assert!(
            cancelled.is_err(),
            "the map hangs, so the allocation cannot finish"
        );
    });
    // The rollback task is dropped with its runtime, the map still pending:
    // the pages it held are leaked and counted, since the map may yet
    // register them.
    registry_runtime.shutdown_timeout(Duration::from_secs(5));
    assert_eq!(
        registry.stats().leaked_bytes,
        64 * KIB as u64,
        "pages a pending map may register are leaked and counted, not freed"
    );
    // The backend still answers for its map: once it completes with nobody
    // waiting, it rolls the registration back itself (contract point 1).
    gate.release();
    caller.block_on(async {
        for _ in 0..500 {
            if backend.live_registrations() == Some(0) && backend.stats().unmaps > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    assert_eq!(
        backend.stats().unmaps,
        1,
        "the orphaned map was rolled back"
    );
    assert_eq!(backend.live_registrations(), Some(0));
}
