//! Destinations belong to the registry that reads into them: a pool buffer
//! carries its registry's backend registration, and another registry's
//! backend would read that registration's id as one of its own — a
//! different buffer. Every read path refuses a foreign buffer with
//! [`RdmaError::ForeignBuffer`] before anything is submitted, and leaves
//! both registries' buffers as they were.

use rdmareg_registry::{PeerId, RdmaError};

use crate::common::*;

const OTHER: PeerId = PeerId(3);

/// An owner with an 8 KiB source, a consumer holding a buffer of its own
/// (so its backend has a registration whose id a foreign buffer's id can
/// alias), and a third registry whose buffer is handed to the consumer.
struct Scene {
    _fabric: rdmareg_backend::loopback::LoopbackFabric,
    owner: Side,
    consumer: Side,
    other: Side,
}

fn scene() -> Scene {
    let (fabric, owner, consumer) = two_sides(small_config());
    let other = Side::new(&fabric, OTHER, small_config());
    Scene {
        _fabric: fabric,
        owner,
        consumer,
        other,
    }
}

async fn shut_down_all(scene: &Scene) {
    shut_down(&scene.consumer).await;
    shut_down(&scene.other).await;
    shut_down(&scene.owner).await;
}

#[tokio::test(start_paused = true)]
async fn a_get_into_another_registrys_buffer_is_refused_and_writes_nothing() {
    let scene = scene();
    let source = scene
        .owner
        .registry
        .register_owned(pattern(4096, 9))
        .await
        .unwrap();
    let mut own = scene.consumer.registry.alloc_pinned(4096).await.unwrap();
    own.fill(0xEE);
    let mut foreign = scene.other.registry.alloc_pinned(4096).await.unwrap();
    foreign.fill(0xDD);
    let answer = scene
        .consumer
        .registry
        .get(OWNER, &source.descriptor().unwrap(), &mut foreign)
        .await;
    assert_eq!(answer, Err(RdmaError::ForeignBuffer));
    assert!(
        own.iter().all(|&b| b == 0xEE),
        "the consumer's own buffer was written"
    );
    assert!(!foreign.is_surrendered());
    assert!(
        foreign.iter().all(|&b| b == 0xDD),
        "the foreign buffer was written"
    );
    drop((own, foreign));
    shut_down_all(&scene).await;
}

#[tokio::test(start_paused = true)]
async fn a_list_posted_into_another_registrys_buffer_is_refused_as_a_whole() {
    let scene = scene();
    let source = scene
        .owner
        .registry
        .register_owned(pattern(4096, 3))
        .await
        .unwrap();
    let mut list = scene.consumer.registry.transfer_list(OWNER);
    list.push(&source.descriptor_range(0, 1024).unwrap(), 0, 0)
        .unwrap();
    list.push(&source.descriptor_range(1024, 1024).unwrap(), 1, 0)
        .unwrap();
    let mut buffers = vec![
        scene.consumer.registry.alloc_pinned(1024).await.unwrap(),
        scene.other.registry.alloc_pinned(1024).await.unwrap(),
    ];
    buffers[0].fill(0xEE);
    buffers[1].fill(0xDD);
    let answer = scene.consumer.registry.post(&list, &mut buffers).await;
    assert_eq!(answer, Err(RdmaError::ForeignBuffer));
    assert!(buffers.iter().all(|b| !b.is_surrendered()));
    assert!(
        buffers[0].iter().all(|&b| b == 0xEE),
        "nothing is submitted"
    );
    assert!(buffers[1].iter().all(|&b| b == 0xDD));
    let reads = [(&source.descriptor_range(0, 16).unwrap(), 0, 0)];
    let answer = scene
        .consumer
        .registry
        .get_many(OWNER, &reads, &mut buffers[1..])
        .await;
    assert_eq!(answer, Err(RdmaError::ForeignBuffer));
    assert!(buffers[1].iter().all(|&b| b == 0xDD));
    drop(buffers);
    shut_down_all(&scene).await;
}
