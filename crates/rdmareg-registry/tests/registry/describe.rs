//! What a guard says about its region, and degenerate registrations.

use std::time::Duration;

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
