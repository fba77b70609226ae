//! Remote writes through the registry over a real backend: bytes a
//! consumer puts land in the owner's writable registration exactly where
//! the descriptor says, at every size (one chunk and many), alone and in
//! lists mixed with reads; an unregister waits for a write in flight; a
//! read-only registration is never written; the owner learns which ranges
//! writes filled.

use std::time::Duration;

use rdmareg_registry::{Access, Descriptor, RdmaError, RegionGuard};
use rdmareg_tests::{KIB, Lane, MIB, OWNER, Pair, assert_same_bytes, expected, registry_config};

/// Byte the owner's registrations start as, to show what no write touched.
const UNTOUCHED: u8 = 0x5A;

/// The sizes written: below a tcp segment, one segment, and several
/// chunks of every backend (UCX 60 KiB over tcp and 1 MiB, libfabric
/// 256 KiB).
const SIZES: [usize; 5] = [1, 4 * KIB, 64 * KIB, MIB, 8 * MIB];

per_lane!(
    writes_of_every_size_land_where_they_were_aimed,
    a_list_mixing_writes_and_reads_answers_each_entry,
    an_unregister_waits_for_a_large_write_in_flight,
    a_read_only_registration_is_never_written,
    the_owner_learns_which_ranges_writes_filled,
);

/// The owner's bytes of `guard` now.
fn owner_bytes(guard: &RegionGuard) -> Vec<u8> {
    guard
        .watch()
        .read(|view| view.to_vec())
        .expect("the region is registered")
}

/// Each size is written at an odd offset of a read-write registration, read
/// back with a GET, and found in the owner's memory with every other byte
/// untouched.
async fn writes_of_every_size_land_where_they_were_aimed(lane: Lane) {
    let pair = Pair::start(lane.clone(), registry_config());
    let (owner, consumer) = (&pair.owner.registry, &pair.consumer.registry);
    let len = 8 * MIB + 64 * KIB;
    let target = owner
        .register_owned_with(vec![UNTOUCHED; len].into_boxed_slice(), Access::ReadWrite)
        .await
        .expect("a writable registration");
    let wire = target.descriptor().expect("describable").encode();
    let descriptor = Descriptor::decode(&wire).expect("decodes");
    assert_eq!(descriptor.access(), Access::ReadWrite);
    let mut want = vec![UNTOUCHED; len];
    for (seed, size) in SIZES.into_iter().enumerate() {
        let seed = seed as u8 + 1;
        let offset = 17 * (seed as usize);
        let range = descriptor
            .slice(offset as u64, size as u64)
            .expect("inside");
        let mut src = consumer.alloc_pinned(size).await.expect("a source");
        src.copy_from_slice(&expected(seed, 0, size));
        consumer
            .put(OWNER, &mut src, &range)
            .await
            .unwrap_or_else(|e| panic!("{lane:?}: put of {size} B: {e}"));
        want[offset..offset + size].copy_from_slice(&expected(seed, 0, size));
        let mut back = consumer.alloc_pinned(size).await.expect("a destination");
        consumer
            .get(OWNER, &range, &mut back)
            .await
            .unwrap_or_else(|e| panic!("{lane:?}: read back of {size} B: {e}"));
        assert_same_bytes(
            &format!("{size} B read back"),
            &back,
            &expected(seed, 0, size),
        );
    }
    assert_same_bytes("the owner's registration", &owner_bytes(&target), &want);
    let metrics = consumer.metrics();
    assert_eq!(metrics.puts, SIZES.len() as u64);
    assert_eq!(metrics.put_bytes, SIZES.iter().sum::<usize>() as u64);
    drop(target);
    pair.shut_down(Duration::from_secs(5)).await;
}

/// One list writes two ranges and reads a third, posted twice with new
/// bytes; each entry is answered in order and the second post's bytes are
/// the ones that stay.
async fn a_list_mixing_writes_and_reads_answers_each_entry(lane: Lane) {
    let pair = Pair::start(lane.clone(), registry_config());
    let (owner, consumer) = (&pair.owner.registry, &pair.consumer.registry);
    let target = owner
        .register_owned_with(vec![UNTOUCHED; 2 * MIB].into_boxed_slice(), Access::Write)
        .await
        .expect("a writable registration");
    let readable = owner
        .register_owned(expected(9, 0, 64 * KIB).into_boxed_slice())
        .await
        .expect("a readable registration");
    let mut list = consumer.transfer_list(OWNER);
    list.push_put(&target.descriptor_range(0, 4 * KIB as u64).unwrap(), 0, 0)
        .unwrap();
    list.push_put(
        &target.descriptor_range(MIB as u64, MIB as u64).unwrap(),
        0,
        4 * KIB,
    )
    .unwrap();
    list.push(&readable.descriptor().unwrap(), 1, 0).unwrap();
    let mut buffers = vec![
        consumer.alloc_pinned(MIB + 4 * KIB).await.unwrap(),
        consumer.alloc_pinned(64 * KIB).await.unwrap(),
    ];
    for seed in [3u8, 4] {
        buffers[0].copy_from_slice(&expected(seed, 0, MIB + 4 * KIB));
        let answers = consumer.post(&list, &mut buffers).await.expect("posted");
        assert_eq!(answers, vec![Ok(()); 3], "{lane:?}");
        assert_same_bytes("the list's read", &buffers[1], &expected(9, 0, 64 * KIB));
    }
    let written = owner_bytes(&target);
    assert_same_bytes("first write", &written[..4 * KIB], &expected(4, 0, 4 * KIB));
    assert_same_bytes("second write", &written[MIB..], &expected(4, 4 * KIB, MIB));
    assert!(written[4 * KIB..MIB].iter().all(|&b| b == UNTOUCHED));
    drop((target, readable, buffers));
    pair.shut_down(Duration::from_secs(5)).await;
}

/// The owner unregisters its buffer while an 8 MiB write into it is in
/// flight: the buffer it gets back holds the whole write if the PUT
/// answered `Ok`, and otherwise each chunk whole or not at all (the unmap
/// waited for every chunk being copied); a write after the unregister is
/// refused.
async fn an_unregister_waits_for_a_large_write_in_flight(lane: Lane) {
    let pair = Pair::start(lane.clone(), registry_config());
    let (owner, consumer) = (&pair.owner.registry, &pair.consumer.registry);
    let len = 8 * MIB;
    let target = owner
        .register_owned_with(vec![UNTOUCHED; len].into_boxed_slice(), Access::Write)
        .await
        .expect("a writable registration");
    let descriptor = target.descriptor().unwrap();
    let mut src = consumer.alloc_pinned(len).await.unwrap();
    src.copy_from_slice(&expected(6, 0, len));
    let put = consumer.put(OWNER, &mut src, &descriptor);
    let unregister = async {
        // Let the write start before the owner lets go.
        tokio::time::sleep(Duration::from_micros(200)).await;
        target.unregister_owned(Duration::from_secs(10)).await
    };
    let (written, unregistered) = tokio::join!(put, unregister);
    let (buffer, _) = unregistered.expect("the unregister completes");
    match written {
        // The write landed before the unmap: all of it.
        Ok(()) => assert_same_bytes("the returned buffer", &buffer, &expected(6, 0, len)),
        // Refused, at least in part, because the unmap came first: a PUT
        // goes in chunks, each landed whole before the unmap or not at all
        // (256 KiB divides both backends' chunk sizes).
        Err(RdmaError::RegionNotFound) => {
            let want = expected(6, 0, len);
            for (block, (got, new)) in buffer
                .chunks(256 * KIB)
                .zip(want.chunks(256 * KIB))
                .enumerate()
            {
                assert!(
                    got == new || got.iter().all(|&b| b == UNTOUCHED),
                    "{lane:?}: block {block} holds part of a chunk"
                );
            }
        }
        Err(other) => panic!("{lane:?}: a write racing an unregister: {other}"),
    }
    assert_eq!(
        consumer.put(OWNER, &mut src, &descriptor).await,
        Err(RdmaError::RegionNotFound)
    );
    drop(src);
    pair.shut_down(Duration::from_secs(5)).await;
}

/// A registration made without write access refuses a write through its
/// own descriptor and through one edited to claim write access, at eager
/// and rendezvous sizes, and keeps every byte.
async fn a_read_only_registration_is_never_written(lane: Lane) {
    let pair = Pair::start(lane.clone(), registry_config());
    let (owner, consumer) = (&pair.owner.registry, &pair.consumer.registry);
    let len = 2 * MIB;
    let target = owner
        .register_owned(vec![UNTOUCHED; len].into_boxed_slice())
        .await
        .expect("a registration");
    let honest = target.descriptor().unwrap();
    let forged = honest.clone().granting(Access::Write);
    let denied = RdmaError::AccessDenied { operation: "write" };
    for size in [64, len] {
        let mut src = consumer.alloc_pinned(size).await.unwrap();
        src.copy_from_slice(&expected(7, 0, size));
        let range = forged.slice(0, size as u64).unwrap();
        assert_eq!(
            consumer.put(OWNER, &mut src, &range).await,
            Err(denied.clone()),
            "{lane:?}: {size} B"
        );
        assert_eq!(
            consumer
                .put(OWNER, &mut src, &honest.slice(0, size as u64).unwrap())
                .await,
            Err(denied.clone())
        );
    }
    assert!(owner_bytes(&target).iter().all(|&b| b == UNTOUCHED));
    drop(target);
    pair.shut_down(Duration::from_secs(5)).await;
}

/// Writes of several chunks and of a few bytes, some touching, one
/// apart, and one refused: the owner's `take_written` lists the ranges
/// they filled, coalesced, relative to the registration, and nothing for
/// the refused one or for a read-only registration; a second take lists
/// nothing.
async fn the_owner_learns_which_ranges_writes_filled(lane: Lane) {
    // Writes one-sided over UCX's same-host direct lane never reach the
    // owner's log: every write is served here.
    let pair = Pair::start_with(lane.engine_config_serving_every_write(), registry_config());
    let (owner, consumer) = (&pair.owner.registry, &pair.consumer.registry);
    let len = 4 * MIB;
    let target = owner
        .register_owned_with(vec![UNTOUCHED; len].into_boxed_slice(), Access::Write)
        .await
        .expect("a writable registration");
    let read_only = owner
        .register_owned(vec![UNTOUCHED; 64].into_boxed_slice())
        .await
        .expect("a registration");
    let descriptor = target.descriptor().unwrap();
    let puts = [
        (100, 3 * MIB),
        (100 + 3 * MIB, 10),
        (2 * MIB, 50),
        (len - 8, 8),
    ];
    for (offset, size) in puts {
        let mut src = consumer.alloc_pinned(size).await.unwrap();
        src.copy_from_slice(&expected(3, offset, size));
        let range = descriptor.slice(offset as u64, size as u64).unwrap();
        consumer
            .put(OWNER, &mut src, &range)
            .await
            .unwrap_or_else(|e| panic!("{lane:?}: put of {size} B at {offset}: {e}"));
    }
    let mut src = consumer.alloc_pinned(16).await.unwrap();
    let forged = read_only.descriptor().unwrap().granting(Access::Write);
    assert_eq!(
        consumer
            .put(OWNER, &mut src, &forged.slice(0, 16).unwrap())
            .await,
        Err(RdmaError::AccessDenied { operation: "write" })
    );
    let written = target.take_written().await.expect("the log");
    let end = len as u64;
    assert_eq!(
        (written.ranges.as_slice(), written.incomplete),
        (&[100..100 + 3 * MIB as u64 + 10, end - 8..end][..], false),
        "{lane:?}"
    );
    assert!(target.take_written().await.unwrap().is_empty(), "{lane:?}");
    assert!(
        read_only.take_written().await.unwrap().is_empty(),
        "{lane:?}"
    );
    drop((target, read_only, src));
    pair.shut_down(Duration::from_secs(5)).await;
}
