//! What a guard or a pool buffer says about its memory (a descriptor grants
//! exactly what it describes), and degenerate registrations.

use std::time::Duration;

use rdmareg_backend::loopback::FaultOp;
use rdmareg_registry::{RdmaConfig, RdmaError, RdmaRegistry};

use crate::common::*;

#[tokio::test(start_paused = true)]
async fn guard_describes_the_whole_region_and_its_sub_ranges() {
    let (_fabric, side) = one_side(small_config());
    let guard = side
        .registry
        .register_owned(pattern(3000, 0))
        .await
        .unwrap();
    let whole = guard.descriptor().unwrap();
    assert_eq!(whole.backend_key(), "loopback");
    assert_eq!(side.registry.backend_key(), "loopback");
    assert_eq!((whole.addr(), whole.len()), (guard.addr(), 3000));
    assert_eq!(guard.len(), 3000);
    assert_eq!(whole.generation(), guard.generation());
    let part = guard.descriptor_range(10, 20).unwrap();
    assert_eq!((part.addr(), part.len()), (guard.addr() + 10, 20));
    assert_eq!(guard.descriptor_range(2990, 11), Err(RdmaError::OutOfRange));
    assert_eq!(guard.descriptor_range(0, 0), Err(RdmaError::OutOfRange));
    assert!(guard.is_owned());
    let decoded = rdmareg_registry::Descriptor::decode(&whole.encode()).unwrap();
    assert_eq!(decoded, whole);
}

#[tokio::test(start_paused = true)]
async fn registering_the_same_memory_again_gets_a_new_generation() {
    let (_fabric, side) = one_side(small_config());
    let first = side.registry.register_owned(pattern(100, 0)).await.unwrap();
    let (addr, generation) = (first.addr(), first.generation());
    let (buffer, _) = first
        .unregister_owned(Duration::from_secs(60))
        .await
        .unwrap();
    let second = side.registry.register_owned(buffer).await.unwrap();
    assert_eq!(second.addr(), addr, "the same allocation");
    assert!(second.generation() > generation);
}

#[tokio::test(start_paused = true)]
async fn degenerate_registrations_are_typed_errors() {
    let (_fabric, side) = one_side(small_config());
    let empty = side
        .registry
        .register_owned(Box::new([]))
        .await
        .unwrap_err();
    assert_eq!(empty.error, RdmaError::OutOfRange);
    // SAFETY: refused before anything is mapped or dereferenced.
    let null = unsafe { side.registry.register_external(std::ptr::null_mut(), 10) }.await;
    assert_eq!(null.unwrap_err(), RdmaError::OutOfRange);
    let memory = External::new(page(), 0);
    // SAFETY: as above; zero length and overflowing ranges are refused.
    let zero = unsafe { side.registry.register_external(memory.ptr(), 0) }.await;
    assert_eq!(zero.unwrap_err(), RdmaError::OutOfRange);
    // SAFETY: as above.
    let overflow = unsafe { side.registry.register_external(memory.ptr(), usize::MAX) }.await;
    assert_eq!(overflow.unwrap_err(), RdmaError::OutOfRange);
    assert_eq!(side.live(), 0);
    assert_eq!(side.registered_bytes(), 0);
}

#[tokio::test(start_paused = true)]
async fn watch_reads_copies_of_the_region_and_checks_bounds() {
    let (_fabric, side) = one_side(small_config());
    let guard = side.registry.register_owned(pattern(64, 7)).await.unwrap();
    let watch = guard.watch();
    let copied = watch.read(|view| {
        let mut part = [0u8; 4];
        view.copy_to_slice(60, &mut part).unwrap();
        assert_eq!(
            view.copy_to_slice(61, &mut part),
            Err(RdmaError::OutOfRange)
        );
        assert_eq!(
            view.copy_to_slice(usize::MAX, &mut part),
            Err(RdmaError::OutOfRange)
        );
        (view.len(), part, view.to_vec())
    });
    let (len, part, all) = copied.expect("open region");
    assert_eq!(len, 64);
    assert_eq!(&part[..], &pattern(64, 7)[60..]);
    assert_eq!(&all[..], &pattern(64, 7)[..]);
    guard.unregister(Duration::from_secs(60)).await.unwrap();
    assert!(watch.read(|_| ()).is_none());
    assert!(watch.is_deregistered());
}

#[tokio::test(start_paused = true)]
async fn a_configuration_the_pool_cannot_honour_is_refused() {
    let fabric = rdmareg_backend::loopback::LoopbackFabric::new();
    let mut config = RdmaConfig::default();
    config.pool.dedicated_threshold_bytes = config.pool.max_arena_bytes + 1;
    let built = RdmaRegistry::new(
        fabric.backend(OWNER),
        config,
        tokio::runtime::Handle::current(),
    );
    assert!(built.is_err());
}

fn assert_send<T: Send>(_: &T) {}
fn assert_send_sync<T: Send + Sync>() {}

#[tokio::test(start_paused = true)]
async fn handles_are_shareable_and_every_future_can_be_spawned() {
    assert_send_sync::<RdmaRegistry>();
    assert_send_sync::<rdmareg_registry::RegionGuard>();
    assert_send_sync::<rdmareg_registry::RegionWatch>();
    assert_send_sync::<rdmareg_registry::PinnedBuf>();
    assert_send_sync::<rdmareg_registry::SweptRegistry>();

    let (_fabric, side) = one_side(small_config());
    let registry = &side.registry;
    let descriptor = {
        let guard = registry.register_owned(pattern(8, 0)).await.unwrap();
        let descriptor = guard.descriptor().unwrap();
        assert_send(&guard.deregistered());
        assert_send(&guard.shutdown_initiated());
        assert_send(&guard.watch().deregistered());
        assert_send(&guard.unregister(Duration::from_secs(60)));
        descriptor
    };
    let guard = registry.register_owned(pattern(8, 0)).await.unwrap();
    assert_send(&guard.unregister_owned(Duration::from_secs(60)));
    let mut buf = registry.alloc_pinned(8).await.unwrap();
    assert_send(&registry.register_owned(pattern(8, 0)));
    // SAFETY: the future is only inspected, never polled.
    assert_send(&unsafe { registry.register_external(std::ptr::null_mut(), 1) });
    assert_send(&registry.alloc_pinned(8));
    assert_send(&registry.get(OWNER, &descriptor, &mut buf));
    assert_send(&registry.shutdown(Duration::ZERO));
}

/// Two neighbouring buffers of one arena on the owner; the first described.
async fn described_neighbours(
    owner: &Side,
) -> (
    rdmareg_registry::DescribedBuf,
    rdmareg_registry::PinnedBuf,
    rdmareg_registry::Descriptor,
) {
    let mut described = owner.registry.alloc_pinned(page()).await.unwrap();
    let mut neighbour = owner.registry.alloc_pinned(page()).await.unwrap();
    assert_eq!(
        owner.registry.stats().pooled_arenas,
        1,
        "both buffers share one arena"
    );
    described.fill(0x11);
    neighbour.fill(0x22);
    let described = described.describe().await.unwrap();
    let descriptor = described.descriptor();
    (described, neighbour, descriptor)
}

#[tokio::test(start_paused = true)]
async fn a_pool_buffers_descriptor_grants_only_that_buffer() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let (described, neighbour, descriptor) = described_neighbours(&owner).await;
    let mut dst = consumer.registry.alloc_pinned(page()).await.unwrap();

    // Inside: the described bytes arrive.
    consumer
        .registry
        .get(OWNER, &descriptor, &mut dst)
        .await
        .unwrap();
    assert!(dst.iter().all(|b| *b == 0x11));

    // Outside, with the same key: the neighbour's bytes are refused.
    let forged = rdmareg_registry::Descriptor::new(
        descriptor.backend_key(),
        neighbour.as_ptr() as u64,
        page() as u64,
        descriptor.generation(),
        descriptor.packed_key().clone(),
    )
    .unwrap();
    dst.fill(0);
    assert_eq!(
        consumer.registry.get(OWNER, &forged, &mut dst).await,
        Err(RdmaError::OutOfRange),
        "the described buffer's key reached its neighbour"
    );
    assert!(dst.iter().all(|b| *b == 0), "no neighbour byte arrived");
    drop((described, neighbour));
}

#[tokio::test(start_paused = true)]
async fn a_dedicated_buffer_is_described_by_a_registration_of_its_own() {
    let (_fabric, side) = one_side(small_config());
    let dedicated = side.registry.alloc_pinned(200 * KIB).await.unwrap();
    assert!(dedicated.is_dedicated());
    assert_eq!(side.live(), 1, "the dedicated arena");
    let described = dedicated.describe().await.unwrap();
    assert_eq!(side.live(), 2, "the arena and the buffer's own key");
    assert_eq!(described.descriptor().len(), 200 * KIB as u64);
    let writable = described.withdraw().await.unwrap();
    assert_eq!(
        side.live(),
        1,
        "withdrawing unmapped the own key, not the arena"
    );
    assert!(writable.is_dedicated());
    drop(writable);
    eventually("the dedicated arena is unmapped", || side.live() == 0).await;
}

#[tokio::test(start_paused = true)]
async fn describing_a_surrendered_buffer_is_refused_and_gives_it_back() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let source = owner
        .registry
        .register_owned(pattern(page(), 1))
        .await
        .unwrap();
    let descriptor = source.descriptor().unwrap();
    let mut dst = consumer.registry.alloc_pinned(page()).await.unwrap();
    let get_hold = consumer.backend.faults().hang(FaultOp::Get);
    {
        let mut get = Box::pin(consumer.registry.get(OWNER, &descriptor, &mut dst));
        assert!(futures::poll!(&mut get).is_pending());
        get_hold.until_waiting(1).await;
    }
    assert!(dst.is_surrendered());
    let refused = dst.describe().await.unwrap_err();
    assert_eq!(refused.error(), &RdmaError::BufferSurrendered);
    assert!(refused.into_buf().is_surrendered());
    get_hold.release();
}

#[tokio::test(start_paused = true)]
async fn a_described_buffer_withdrawn_is_unreadable_by_its_old_descriptors_and_writable_again() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let (described, _neighbour, descriptor) = described_neighbours(&owner).await;
    let mut dst = consumer.registry.alloc_pinned(page()).await.unwrap();
    consumer
        .registry
        .get(OWNER, &descriptor, &mut dst)
        .await
        .unwrap();
    assert!(dst.iter().all(|b| *b == 0x11));
    let charged = owner.registered_bytes();
    let mut writable = described.withdraw().await.unwrap();
    assert_eq!(owner.live(), 1, "only the arena is left registered");
    assert_eq!(owner.registered_bytes(), charged - page() as u64);
    writable.fill(0x33);
    dst.fill(0);
    assert!(
        consumer
            .registry
            .get(OWNER, &descriptor, &mut dst)
            .await
            .is_err(),
        "a withdrawn buffer's descriptor still reads"
    );
    assert!(
        dst.iter().all(|b| *b == 0),
        "no byte of the withdrawn buffer arrived"
    );
    // Described again, it reads under a new generation.
    let again = writable.describe().await.unwrap();
    assert!(again.generation() > descriptor.generation());
    consumer
        .registry
        .get(OWNER, &again.descriptor(), &mut dst)
        .await
        .unwrap();
    assert!(dst.iter().all(|b| *b == 0x33));
}

#[tokio::test(start_paused = true)]
async fn withdrawing_waits_for_the_unmap_and_a_refused_unmap_keeps_the_buffer_described() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let (described, _neighbour, descriptor) = described_neighbours(&owner).await;
    owner.backend.faults().refuse_unmaps(true);
    let refused = described.withdraw().await.unwrap_err();
    assert!(matches!(refused.error(), RdmaError::Backend(_)));
    let described = refused.into_buf().expect("the buffer comes back");
    owner.backend.faults().refuse_unmaps(false);
    // Still described: the key still reads.
    let mut dst = consumer.registry.alloc_pinned(page()).await.unwrap();
    consumer
        .registry
        .get(OWNER, &described.descriptor(), &mut dst)
        .await
        .unwrap();
    assert_eq!(described.descriptor(), descriptor);
    // An unmap that hangs holds the withdrawal: no writable buffer before
    // the key is gone.
    let unmap_hold = owner.backend.faults().hang(FaultOp::Unmap);
    let mut withdrawing = Box::pin(described.withdraw());
    assert!(futures::poll!(&mut withdrawing).is_pending());
    unmap_hold.until_waiting(1).await;
    assert!(futures::poll!(&mut withdrawing).is_pending());
    assert_eq!(owner.live(), 2, "the own key is still registered");
    unmap_hold.release();
    let writable = withdrawing.await.unwrap();
    assert_eq!(owner.live(), 1);
    assert_eq!(writable.len(), page());
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_withdrawal_frees_the_buffer_only_after_its_unmap() {
    let (_fabric, owner, _consumer) = two_sides(small_config());
    let (described, _neighbour, _descriptor) = described_neighbours(&owner).await;
    let addr = described.as_ptr() as u64;
    let unmap_hold = owner.backend.faults().hang(FaultOp::Unmap);
    {
        let mut withdrawing = Box::pin(described.withdraw());
        assert!(futures::poll!(&mut withdrawing).is_pending());
        unmap_hold.until_waiting(1).await;
    }
    // Until the key is gone, its granules are not handed out again.
    let other = owner.registry.try_alloc_pinned(page()).unwrap();
    assert_ne!(
        other.as_ptr() as u64,
        addr,
        "granules reused under a live key"
    );
    unmap_hold.release();
    eventually("the granules come back", || {
        owner.registry.stats().live_allocations == 2
    })
    .await;
    assert_eq!(owner.live(), 1);
    assert_eq!(owner.registry.stats().leaked_bytes, 0);
}

#[tokio::test(start_paused = true)]
async fn withdrawing_during_shutdown_is_refused_and_keeps_the_buffer_described() {
    let (_fabric, owner, _consumer) = two_sides(small_config());
    let (described, neighbour, _descriptor) = described_neighbours(&owner).await;
    drop(neighbour);
    let swept = owner.registry.shutdown(Duration::from_secs(5)).await;
    assert_eq!(swept.report().lent_buffers_registered, 1);
    let refused = described.withdraw().await.unwrap_err();
    assert_eq!(refused.error(), &RdmaError::ShuttingDown);
    let described = refused.into_buf().expect("the buffer comes back");
    assert!(described.iter().all(|b| *b == 0x11));
    drop(described);
    eventually("the dropped buffer's own key is unmapped", || {
        swept.report().lent_buffers_registered == 0
    })
    .await;
    drop(swept);
}

#[tokio::test(start_paused = true)]
async fn freeing_a_described_buffer_unmaps_its_key_before_its_memory_serves_another() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let (described, _neighbour, descriptor) = described_neighbours(&owner).await;
    let arena_only = 1;
    assert_eq!(
        owner.live(),
        arena_only + 1,
        "the arena and the buffer's own key"
    );
    let charged = owner.registered_bytes();
    let unmap_hold = owner.backend.faults().hang(FaultOp::Unmap);
    let addr = described.as_ptr() as u64;
    drop(described);
    unmap_hold.until_waiting(1).await;
    // Until the key is gone, its granules are not handed out again.
    let other = owner.registry.try_alloc_pinned(page()).unwrap();
    assert_ne!(
        other.as_ptr() as u64,
        addr,
        "granules reused under a live key"
    );
    unmap_hold.release();
    eventually("the buffer's own key is unmapped", || {
        owner.live() == arena_only
    })
    .await;
    assert_eq!(owner.registered_bytes(), charged - page() as u64);
    let mut dst = consumer.registry.alloc_pinned(page()).await.unwrap();
    assert!(
        consumer
            .registry
            .get(OWNER, &descriptor, &mut dst)
            .await
            .is_err(),
        "a freed buffer's descriptor still reads"
    );
    drop(other);
    eventually("the granules come back", || {
        owner.registry.stats().live_allocations == 1
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_describe_frees_the_buffer_and_leaves_nothing_registered() {
    let (_fabric, side) = one_side(small_config());
    let buf = side.registry.alloc_pinned(page()).await.unwrap();
    side.backend.faults().detach_maps(true);
    let map_hold = side.backend.faults().hang(FaultOp::Map);
    {
        let mut describing = Box::pin(buf.describe());
        assert!(futures::poll!(&mut describing).is_pending());
        map_hold.until_waiting(1).await;
    }
    map_hold.release();
    eventually("the cancelled describe is rolled back", || side.live() == 1).await;
    tokio::time::timeout(
        Duration::from_secs(5),
        side.registry.map_rollbacks_settled(),
    )
    .await
    .unwrap();
    assert_eq!(side.registry.stats().leaked_bytes, 0);
    assert_eq!(side.registry.stats().live_allocations, 0);
    let described = side
        .registry
        .alloc_pinned(page())
        .await
        .unwrap()
        .describe()
        .await
        .unwrap();
    assert_eq!(described.descriptor().len(), page() as u64);
}

/// What describing costs over the loopback: one map and one unmap of the
/// buffer's 4 KiB. A measurement, not a check; run with
/// `cargo nextest run -p rdmareg-registry --run-ignored only --no-capture describing_costs`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement; run explicitly"]
async fn describing_costs_one_map_and_one_unmap_over_the_loopback() {
    use rdmareg_backend::RdmaBackend;
    const ROUNDS: u32 = 20_000;
    let (_fabric, side) = one_side(small_config());
    let buf = side.registry.alloc_pinned(4096).await.unwrap();
    let ptr = buf.as_ptr() as usize;
    let started = std::time::Instant::now();
    for _ in 0..ROUNDS {
        // SAFETY: the range is the pool buffer `buf`, alive until after the
        // loop, which registers it a second time only for reads (no GET
        // names this registration) and unmaps it before the next round.
        let region = unsafe { side.backend.map(ptr, 4096) }.await.unwrap();
        side.backend.unmap(region.backend_region_id).await.unwrap();
    }
    let raw = started.elapsed() / ROUNDS;
    drop(buf);
    let started = std::time::Instant::now();
    for _ in 0..ROUNDS {
        let buf = side.registry.alloc_pinned(4096).await.unwrap();
        let described = buf.describe().await.unwrap();
        drop(described);
        while side.live() > 1 {
            tokio::task::yield_now().await;
        }
    }
    let whole = started.elapsed() / ROUNDS;
    println!(
        "loopback: backend map+unmap of 4 KiB {raw:?}; alloc + describe + free (unmap confirmed) {whole:?}"
    );
}
