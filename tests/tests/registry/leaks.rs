//! Soak with leak checks, and the registered-bytes budget over UCX.
//!
//! The soak repeats the short lifecycles a service runs all day — register,
//! describe, GET, unregister; allocate, GET, drop; now and then a guard
//! dropped without unregister — and then checks that the registry holds
//! nothing but its pool arenas, that the engine's own count agrees, and that
//! shutdown brings both to zero.

use std::time::{Duration, Instant};

use rdmareg_core::page_enclosing_len;
use rdmareg_registry::{Descriptor, RdmaConfig, RdmaError, RdmaRegistry};
use rdmareg_tests::{
    KIB, Lane, OWNER, Pair, Side, assert_same_bytes, eventually, expected, fill, patterned,
    registry_config, within,
};

/// Rounds of the soak, unless the time cap comes first.
const ROUNDS: usize = 300;
/// Wall-clock cap of the soak loop once it has done [`MIN_ROUNDS`].
const TIME_CAP: Duration = Duration::from_secs(3);
/// Rounds the soak must at least complete for its checks to mean something:
/// it runs past [`TIME_CAP`] until it has them (a loaded machine, or a
/// sanitizer build, can be several times slower), up to [`HARD_CAP`].
const MIN_ROUNDS: usize = 50;
/// Wall-clock cap of the soak loop, whatever it has done.
const HARD_CAP: Duration = Duration::from_secs(60);
/// Buffer sizes the rounds cycle through: sub-granule, granule edges, odd.
const SIZES: [usize; 6] = [1, 100, 4096, 4097, 64 * KIB + 3, 200 * KIB];

per_lane!(
    repeated_lifecycles_leave_only_the_pool_arenas_registered,
    a_small_budget_refuses_with_its_figures_and_hands_the_owned_buffer_back,
);

/// Decode what `descriptor` encodes, as the consumer would.
fn over_the_wire(descriptor: Result<Descriptor, RdmaError>) -> Descriptor {
    Descriptor::decode(&descriptor.expect("a descriptor").encode()).expect("decodes")
}

/// No region, allocation, transfer, dedicated arena or leak; only pooled
/// arenas, each charged and each held by the engine.
#[track_caller]
fn assert_only_pool_arenas_remain(what: &str, side: &Side) {
    let stats = side.registry.stats();
    assert_eq!(
        (
            stats.live_regions,
            stats.live_allocations,
            stats.transfers_in_flight,
            stats.dedicated_arenas,
            stats.leaked_bytes
        ),
        (0, 0, 0, 0, 0),
        "{what}: {stats:?}"
    );
    assert!(
        stats.pooled_arenas >= 1,
        "{what}: the pool was used: {stats:?}"
    );
    assert_eq!(
        stats.registered_bytes, stats.pooled_arena_bytes,
        "{what}: only the arenas stay charged: {stats:?}"
    );
    assert_eq!(
        side.engine_live(),
        stats.pooled_arenas,
        "{what}: the engine holds exactly the registry's arenas"
    );
}

#[track_caller]
fn assert_nothing_remains(what: &str, registry: &RdmaRegistry) {
    let stats = registry.stats();
    assert_eq!(
        (
            stats.live_regions,
            stats.live_allocations,
            stats.transfers_in_flight,
            stats.pooled_arenas,
            stats.dedicated_arenas,
            stats.registered_bytes,
            stats.leaked_bytes
        ),
        (0, 0, 0, 0, 0, 0, 0),
        "{what}: {stats:?}"
    );
}

async fn repeated_lifecycles_leave_only_the_pool_arenas_registered(lane: Lane) {
    let pair = Pair::start(lane, registry_config());
    let (owner, consumer) = (&pair.owner.registry, &pair.consumer.registry);
    let started = Instant::now();
    let mut rounds = 0;
    let mut dropped = Vec::new();

    while rounds < ROUNDS
        && (started.elapsed() < TIME_CAP || (rounds < MIN_ROUNDS && started.elapsed() < HARD_CAP))
    {
        let len = SIZES[rounds % SIZES.len()];
        let seed = rounds as u8;

        // An owned region: register, describe, GET, unregister.
        let original = patterned(len, seed);
        let guard = owner
            .register_owned(original.clone())
            .await
            .expect("owned registration");
        let descriptor = over_the_wire(guard.descriptor());
        let mut dst = consumer.alloc_pinned(len).await.expect("consumer buffer");
        consumer
            .get(OWNER, &descriptor, &mut dst)
            .await
            .unwrap_or_else(|e| panic!("round {rounds}: GET of the region: {e}"));
        assert_same_bytes("region GET", &dst, &original);
        drop(dst);
        if rounds % 10 == 9 {
            // Left to the background deregistration.
            dropped.push(guard.watch());
            drop(guard);
        } else {
            let (back, _) = guard
                .unregister_owned(Duration::from_secs(1))
                .await
                .expect("the buffer comes back");
            assert_same_bytes("handed back", &back, &original);
        }

        // Pool to pool: allocate, fill, GET, drop both.
        let mut src = owner.alloc_pinned(len).await.expect("owner buffer");
        fill(&mut src, seed.wrapping_add(1));
        let src = src.describe().await.expect("a describable buffer");
        let descriptor = over_the_wire(Ok(src.descriptor()));
        let mut dst = consumer.alloc_pinned(len).await.expect("consumer buffer");
        consumer
            .get(OWNER, &descriptor, &mut dst)
            .await
            .unwrap_or_else(|e| panic!("round {rounds}: GET of the pool buffer: {e}"));
        assert_same_bytes("pool GET", &dst, &expected(seed.wrapping_add(1), 0, len));
        drop((src, dst));
        rounds += 1;
    }
    assert!(
        rounds >= MIN_ROUNDS,
        "only {rounds} rounds within {HARD_CAP:?}"
    );
    for watch in &dropped {
        within(
            Duration::from_secs(5),
            "a dropped guard's background release",
            watch.deregistered(),
        )
        .await;
    }
    // A described buffer's own registration is unmapped after it is dropped,
    // and only then are its granules free again.
    eventually(
        Duration::from_secs(5),
        "the described buffers' own registrations are unmapped",
        || pair.owner.registry.stats().live_allocations == 0,
    )
    .await;
    assert_only_pool_arenas_remain("owner after the soak", &pair.owner);
    assert_only_pool_arenas_remain("consumer after the soak", &pair.consumer);

    pair.shut_down(Duration::from_secs(5)).await;
    assert_nothing_remains("owner after shutdown", owner);
    assert_nothing_remains("consumer after shutdown", consumer);
}

/// 64 KiB of budget; pooled arenas of 16–32 KiB; 32 KiB and more dedicated.
fn small_budget() -> RdmaConfig {
    let mut config = registry_config();
    config.budget_bytes = 64 * KIB as u64;
    config.pool.first_arena_bytes = 16 * KIB as u64;
    config.pool.max_arena_bytes = 32 * KIB as u64;
    config.pool.dedicated_threshold_bytes = 32 * KIB as u64;
    config.pool.retention_floor_bytes = 16 * KIB as u64;
    config
}

async fn a_small_budget_refuses_with_its_figures_and_hands_the_owned_buffer_back(lane: Lane) {
    let pair = Pair::start(lane, small_budget());
    let owner = &pair.owner.registry;
    let budget = 64 * KIB as u64;

    let first = owner
        .register_owned(patterned(20 * KIB, 1))
        .await
        .expect("20 KiB fits");
    let registered = owner.stats().registered_bytes;
    assert_eq!(
        registered,
        first.effective_range().len,
        "charged what the engine pinned"
    );
    assert!(registered >= 20 * KIB as u64);
    assert_eq!(pair.owner.engine_live(), 1);

    let big = patterned(48 * KIB, 2);
    let big_addr = big.as_ptr() as u64;
    let requested = page_enclosing_len(big_addr, 48 * KIB as u64, 4096).unwrap();
    assert!(registered + requested > budget, "the test's premise");
    let refused = owner
        .register_owned(big)
        .await
        .expect_err("48 KiB more does not fit");
    assert_eq!(
        refused.error,
        RdmaError::BudgetExceeded {
            requested,
            registered,
            budget
        }
    );
    assert!(refused.error.is_transient());
    assert_eq!(
        refused.buffer.as_ptr() as u64,
        big_addr,
        "the same allocation comes back"
    );
    assert_same_bytes("refused buffer", &refused.buffer, &patterned(48 * KIB, 2));
    // The pool refuses an arena the same way.
    assert_eq!(
        owner.alloc_pinned(48 * KIB).await.err(),
        Some(RdmaError::BudgetExceeded {
            requested: 48 * KIB as u64,
            registered,
            budget
        })
    );
    // Refusals registered nothing.
    assert_eq!(pair.owner.engine_live(), 1);
    let stats = owner.stats();
    assert_eq!(
        (
            stats.registered_bytes,
            stats.live_regions,
            stats.dedicated_arenas
        ),
        (registered, 1, 0),
        "{stats:?}"
    );

    // Once there is room, the handed-back buffer registers and reads intact.
    first
        .unregister_owned(Duration::from_secs(1))
        .await
        .expect("unregister");
    assert_eq!(owner.stats().registered_bytes, 0);
    let guard = owner
        .register_owned(refused.buffer)
        .await
        .expect("fits once the budget has room");
    let descriptor = over_the_wire(guard.descriptor());
    let mut dst = pair
        .consumer
        .registry
        .alloc_pinned(48 * KIB)
        .await
        .expect("consumer buffer within its own budget");
    pair.consumer
        .registry
        .get(OWNER, &descriptor, &mut dst)
        .await
        .expect("GET");
    assert_same_bytes("after the refusal", &dst, &patterned(48 * KIB, 2));

    drop(dst);
    guard
        .unregister(Duration::from_secs(1))
        .await
        .expect("unregister");
    pair.shut_down(Duration::from_secs(5)).await;
}
