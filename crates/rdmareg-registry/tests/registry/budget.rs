//! The registered-bytes budget: page-enclosing charges reconciled to the
//! backend, charges returned by cancellation, no overshoot under races, and
//! refusals that say why.

use std::time::Duration;

use rdmareg_backend::loopback::FaultOp;
use rdmareg_core::page_enclosing_len;
use rdmareg_registry::RdmaError;

use crate::common::*;

#[tokio::test(start_paused = true)]
async fn budget_is_charged_on_the_page_enclosing_range() {
    let (_fabric, side) = one_side(small_config());
    let memory = External::new(3 * page(), 1);
    // One page of bytes starting 100 bytes in: it straddles two pages.
    // SAFETY: the range lies inside `memory`, which outlives the
    // registration (unregistered below before `memory` drops) and is not
    // referenced while registered.
    let ptr = unsafe { memory.ptr().add(100) };
    // SAFETY: as above.
    let guard = unsafe { side.registry.register_external(ptr, page()) }
        .await
        .unwrap();
    let enclosing = page_enclosing_len(ptr as u64, page() as u64, page() as u64).unwrap();
    assert_eq!(enclosing, 2 * page() as u64);
    assert_eq!(side.registered_bytes(), enclosing);
    assert_eq!(guard.effective_range().len, enclosing);
    assert!(guard.effective_range().start <= guard.addr());
    guard.unregister(Duration::from_secs(60)).await.unwrap();
    assert_eq!(side.registered_bytes(), 0);
}

#[tokio::test(start_paused = true)]
async fn charge_is_reserved_at_the_configured_page_size_and_reconciled_to_what_the_backend_pinned()
{
    // The registry assumes pages 16 times larger than the backend's: it
    // reserves that much, then settles on the backend's report.
    let coarse = 16 * page() as u64;
    let mut config = small_config();
    config.page_size = coarse;
    config.budget_bytes = coarse;
    let (_fabric, side) = one_side(config.clone());
    let memory = External::new(page(), 2);
    // SAFETY: `memory` outlives the registration and is not referenced.
    let guard = unsafe { side.registry.register_external(memory.ptr(), page()) }
        .await
        .unwrap();
    assert_eq!(guard.effective_range().len, page() as u64);
    assert_eq!(side.registered_bytes(), page() as u64);
    guard.unregister(Duration::from_secs(60)).await.unwrap();

    // One byte less of budget than the coarse page: the reservation itself
    // is refused, before the backend is asked.
    config.budget_bytes = coarse - 1;
    let (_fabric, tight) = one_side(config);
    // A heap buffer of one page may straddle a coarse page boundary: then
    // two coarse pages are reserved.
    let buffer = pattern(page(), 3);
    let expected = page_enclosing_len(buffer.as_ptr() as u64, page() as u64, coarse).unwrap();
    assert!(expected == coarse || expected == 2 * coarse);
    let refused = tight.registry.register_owned(buffer).await.unwrap_err();
    assert!(
        matches!(
            refused.error,
            RdmaError::BudgetExceeded { requested, .. } if requested == expected
        ),
        "{:?}, expected a refusal of {expected} B",
        refused.error
    );
    assert_eq!(tight.live(), 0);
    drop(memory);
}

#[tokio::test(start_paused = true)]
async fn cancelled_registration_returns_its_charge() {
    let (_fabric, side) = one_side(small_config());
    let hold = side.backend.faults().hang(FaultOp::Map);
    let buffer = pattern(page(), 4);
    let charge = page_enclosing_len(buffer.as_ptr() as u64, page() as u64, page() as u64).unwrap();
    let mut registering = Box::pin(side.registry.register_owned(buffer));
    assert!(futures::poll!(&mut registering).is_pending());
    assert_eq!(side.registered_bytes(), charge, "charged while mapping");
    drop(registering);
    assert_eq!(side.registered_bytes(), 0);
    assert_eq!(side.live(), 0);
    drop(hold);
    settle_rollbacks(&side).await;
}

#[tokio::test(start_paused = true)]
async fn cancelled_allocation_returns_its_charge() {
    let (_fabric, side) = one_side(small_config());
    let hold = side.backend.faults().hang(FaultOp::Map);
    let mut allocating = Box::pin(side.registry.alloc_pinned(100));
    assert!(futures::poll!(&mut allocating).is_pending());
    assert_eq!(
        side.registered_bytes(),
        64 * KIB as u64,
        "first arena charged while mapping"
    );
    drop(allocating);
    assert_eq!(side.registered_bytes(), 0);
    assert_eq!(side.live(), 0);
    assert_eq!(side.registry.stats().pooled_arenas, 0);
    drop(hold);
    settle_rollbacks(&side).await;
}

/// The cancelled map's rollback finishes once the map is let go, and frees
/// the memory: nothing is leaked on this ordinary path.
async fn settle_rollbacks(side: &Side) {
    tokio::time::timeout(
        Duration::from_secs(5),
        side.registry.map_rollbacks_settled(),
    )
    .await
    .expect("the rollback settles");
    assert_eq!(side.live(), 0);
    assert_eq!(side.registry.stats().leaked_bytes, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_registrations_never_overshoot_the_budget() {
    const ROOM: usize = 8;
    const CONTENDERS: usize = 32;
    let mut config = small_config();
    config.budget_bytes = (ROOM * page()) as u64;
    let (_fabric, side) = one_side(config);
    // Maps hang, so every winner keeps its reservation while the others race.
    let hold = side.backend.faults().hang(FaultOp::Map);
    let tasks: Vec<_> = (0..CONTENDERS)
        .map(|i| {
            let registry = side.registry.clone();
            // One byte: exactly one page whatever the heap address.
            tokio::spawn(async move { registry.register_owned(pattern(1, i as u8)).await })
        })
        .collect();
    within(
        Duration::from_secs(10),
        "winners reach the map",
        hold.until_waiting(ROOM),
    )
    .await;
    assert_eq!(side.registered_bytes(), (ROOM * page()) as u64);
    hold.release();
    let mut guards = Vec::new();
    let mut refused = 0;
    for task in tasks {
        match task.await.unwrap() {
            Ok(guard) => guards.push(guard),
            Err(e) => {
                let RdmaError::BudgetExceeded {
                    requested,
                    registered,
                    budget,
                } = e.error
                else {
                    panic!("unexpected refusal: {}", e.error);
                };
                assert_eq!(requested, page() as u64);
                assert_eq!(budget, (ROOM * page()) as u64);
                assert!(registered + requested > budget);
                refused += 1;
            }
        }
    }
    assert_eq!(guards.len(), ROOM);
    assert_eq!(refused, CONTENDERS - ROOM);
    assert_eq!(side.registered_bytes(), (ROOM * page()) as u64);
    assert_eq!(side.live(), ROOM);
    for guard in guards {
        guard.unregister(Duration::from_secs(60)).await.unwrap();
    }
    assert_eq!(side.registered_bytes(), 0);
}

#[tokio::test(start_paused = true)]
async fn budget_refusal_carries_requested_registered_and_budget_and_hands_the_buffer_back() {
    let mut config = small_config();
    config.budget_bytes = 3 * page() as u64;
    let (_fabric, side) = one_side(config);
    let memory = External::new(2 * page(), 5);
    // SAFETY: `memory` outlives the registration (unregistered below).
    let held = unsafe { side.registry.register_external(memory.ptr(), memory.len()) }
        .await
        .unwrap();
    let buffer = pattern(2 * page(), 6);
    let charge =
        page_enclosing_len(buffer.as_ptr() as u64, buffer.len() as u64, page() as u64).unwrap();
    let refused = side.registry.register_owned(buffer).await.unwrap_err();
    assert_eq!(
        refused.error,
        RdmaError::BudgetExceeded {
            requested: charge,
            registered: 2 * page() as u64,
            budget: 3 * page() as u64,
        }
    );
    assert_eq!(
        refused.buffer,
        pattern(2 * page(), 6),
        "the caller's data survives"
    );
    assert_eq!(side.live(), 1);
    held.unregister(Duration::from_secs(60)).await.unwrap();
    drop(memory);
}

/// A loopback instance that reports each registration's bytes unrounded as
/// its effective range, the way UCX's `ucp_mem_query` does.
struct ReportsUnroundedRanges(std::sync::Arc<rdmareg_backend::loopback::LoopbackBackend>);

// SAFETY: every method that can pin memory or write a destination is the
// loopback's own (delegated unchanged); only the reported range differs.
unsafe impl rdmareg_backend::RdmaBackend for ReportsUnroundedRanges {
    fn key(&self) -> &str {
        self.0.key()
    }

    unsafe fn map(
        &self,
        ptr: usize,
        len: usize,
    ) -> futures::future::BoxFuture<'_, Result<rdmareg_backend::BackendRegion, RdmaError>> {
        Box::pin(async move {
            // SAFETY: forwards the promise this method's own caller gave.
            let region = unsafe { self.0.map(ptr, len) }.await?;
            Ok(rdmareg_backend::BackendRegion {
                effective_addr: ptr as u64,
                effective_len: len as u64,
                ..region
            })
        })
    }

    fn unmap(&self, id: u64) -> futures::future::BoxFuture<'_, Result<(), RdmaError>> {
        self.0.unmap(id)
    }

    unsafe fn get(
        &self,
        request: rdmareg_backend::BackendGet,
    ) -> futures::future::BoxFuture<'_, Result<(), RdmaError>> {
        // SAFETY: forwards the promise this method's own caller gave.
        unsafe { self.0.get(request) }
    }

    fn live_registrations(&self) -> Option<usize> {
        self.0.live_registrations()
    }
}

#[tokio::test(start_paused = true)]
async fn a_backend_reporting_unrounded_ranges_is_still_charged_whole_pages() {
    let fabric = rdmareg_backend::loopback::LoopbackFabric::new();
    let backend = std::sync::Arc::new(ReportsUnroundedRanges(fabric.backend(OWNER)));
    let mut config = small_config();
    config.budget_bytes = 2 * page() as u64;
    let registry =
        rdmareg_registry::RdmaRegistry::new(backend, config, tokio::runtime::Handle::current())
            .expect("valid configuration");
    let memory = External::new(4 * page(), 7);

    // One byte at the end of the second page: one page pinned, one charged.
    // SAFETY: every range below lies inside `memory`, which outlives the
    // registrations (all unregistered before it drops) and is not referenced
    // while registered.
    let last_byte = unsafe { memory.ptr().add(page() + page() - 1) };
    // SAFETY: as above.
    let first = unsafe { registry.register_external(last_byte, 1) }
        .await
        .expect("one page fits the budget");
    assert_eq!(registry.stats().registered_bytes, page() as u64);
    assert_eq!(
        first.effective_range(),
        rdmareg_registry::PageRange {
            start: memory.ptr() as u64 + page() as u64,
            len: page() as u64
        }
    );

    // Two more single bytes in two other pages: only one more page fits.
    let mut admitted = vec![first];
    let mut refused = 0;
    for page_index in [2, 3] {
        // SAFETY: as above.
        let byte = unsafe { memory.ptr().add(page_index * page()) };
        // SAFETY: as above.
        match unsafe { registry.register_external(byte, 1) }.await {
            Ok(guard) => admitted.push(guard),
            Err(RdmaError::BudgetExceeded { .. }) => refused += 1,
            Err(e) => panic!("unexpected refusal: {e}"),
        }
    }
    assert_eq!(
        (admitted.len(), refused),
        (2, 1),
        "three pages admitted under a two-page budget"
    );
    assert_eq!(registry.stats().registered_bytes, 2 * page() as u64);
    for guard in admitted {
        guard.unregister(Duration::from_secs(60)).await.unwrap();
    }
    assert_eq!(registry.stats().registered_bytes, 0);
}

/// What a caller writes with `?`: a refused owned registration becomes its
/// `RdmaError` without `.map_err`.
async fn register_with_question_mark(
    registry: &rdmareg_registry::RdmaRegistry,
    buffer: Box<[u8]>,
) -> Result<rdmareg_registry::RegionGuard, RdmaError> {
    Ok(registry.register_owned(buffer).await?)
}

#[tokio::test(start_paused = true)]
async fn question_mark_turns_an_owned_registration_refusal_into_its_rdma_error() {
    // Two pages or more never fit a one-page budget.
    let (_fabric, side) = one_side(small_config().with_budget_bytes(page() as u64));
    let refused = register_with_question_mark(&side.registry, pattern(2 * page(), 2)).await;
    assert!(
        matches!(refused, Err(RdmaError::BudgetExceeded { .. })),
        "{refused:?}"
    );
    let error = side
        .registry
        .register_owned(pattern(2 * page(), 3))
        .await
        .unwrap_err();
    assert_eq!(
        error.into_buffer(),
        pattern(2 * page(), 3),
        "into_buffer hands the refused buffer back"
    );
    assert_eq!(side.live(), 0);
}

#[tokio::test(start_paused = true)]
async fn question_mark_turns_an_unregister_owned_failure_into_its_rdma_error() {
    let (_fabric, side) = one_side(small_config());
    let memory = External::new(page(), 8);
    // SAFETY: `memory` outlives the region: it is dropped after
    // `deregistered()` resolves below.
    let external = unsafe { side.registry.register_external(memory.ptr(), page()) }
        .await
        .unwrap();
    let error = external
        .unregister_owned(Duration::from_secs(5))
        .await
        .unwrap_err();
    let guard = error
        .into_guard()
        .expect("a caller-owned region's guard comes back");
    async fn via_question_mark(guard: rdmareg_registry::RegionGuard) -> Result<(), RdmaError> {
        guard.unregister_owned(Duration::from_secs(5)).await?;
        Ok(())
    }
    let watch = guard.watch();
    assert_eq!(via_question_mark(guard).await, Err(RdmaError::NotOwned));
    watch.deregistered().await;
    drop(memory);
}
