//! Remote writes through the registry: an owner registers memory writable,
//! a peer puts bytes into it, and nothing is written where the owner did
//! not allow it.

use std::time::Duration;

use rdmareg_registry::{Access, Descriptor, PeerId, RdmaError, RegionGuard};

use crate::common::*;
use crate::notices::next_notice;

const LEN: usize = 5000;

async fn writable(owner: &Side, seed: u8, access: Access) -> RegionGuard {
    owner
        .registry
        .register_owned_with(pattern(LEN, seed), access)
        .await
        .unwrap()
}

/// A pool buffer of `consumer` holding `bytes`.
async fn source(consumer: &Side, bytes: &[u8]) -> rdmareg_registry::PinnedBuf {
    let mut buf = consumer.registry.alloc_pinned(bytes.len()).await.unwrap();
    buf.copy_from_slice(bytes);
    buf
}

/// The owner's bytes of `guard` now.
fn owner_bytes(guard: &RegionGuard) -> Vec<u8> {
    guard.watch().read(|view| view.to_vec()).unwrap()
}

/// The whole path: a writable registration's descriptor says so, a put of
/// a slice lands exactly there, the bytes around it stay, and the owner
/// gets its buffer back holding the write.
#[tokio::test]
async fn a_put_lands_in_a_writable_registration() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let target = writable(&owner, 1, Access::Write).await;
    let descriptor = target.descriptor().unwrap();
    assert_eq!(descriptor.access(), Access::Write);
    let wire = Descriptor::decode(&descriptor.encode()).unwrap();
    let slice = wire.slice(100, 1000).unwrap();
    let mut src = source(&consumer, &pattern(1000, 9)).await;
    consumer
        .registry
        .put(OWNER, &mut src, &slice)
        .await
        .unwrap();

    let mut want = pattern(LEN, 1).to_vec();
    want[100..1100].copy_from_slice(&pattern(1000, 9));
    assert_eq!(owner_bytes(&target), want);
    let (buffer, _) = target
        .unregister_owned(Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(&buffer[..], &want[..]);
    drop(src);
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// Registrations are read-only unless their owner asked: a put to one is
/// refused by its owner even when the descriptor is edited to claim
/// write access, and not one byte changes.
#[tokio::test]
async fn a_put_to_a_read_only_registration_changes_nothing() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let target = owner
        .registry
        .register_owned(pattern(LEN, 2))
        .await
        .unwrap();
    let honest = target.descriptor().unwrap();
    assert_eq!(honest.access(), Access::Read);
    let mut src = source(&consumer, &pattern(LEN, 7)).await;
    let write = RdmaError::AccessDenied { operation: "write" };
    assert_eq!(
        consumer.registry.put(OWNER, &mut src, &honest).await,
        Err(write.clone())
    );
    let forged = honest.clone().granting(Access::ReadWrite);
    assert_eq!(
        consumer.registry.put(OWNER, &mut src, &forged).await,
        Err(write)
    );
    assert_eq!(owner_bytes(&target), pattern(LEN, 2).to_vec());
    assert!(!src.is_surrendered(), "a refused put hands its source back");
    drop((src, target));
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// A write-only registration is written and not read: its owner refuses
/// a GET with the read's own refusal.
#[tokio::test]
async fn a_write_only_registration_refuses_reads() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let target = writable(&owner, 3, Access::Write).await;
    let descriptor = target.descriptor().unwrap();
    let mut dst = consumer.registry.alloc_pinned(LEN).await.unwrap();
    let read = RdmaError::AccessDenied { operation: "read" };
    assert_eq!(
        consumer.registry.get(OWNER, &descriptor, &mut dst).await,
        Err(read.clone())
    );
    let forged = descriptor.granting(Access::ReadWrite);
    assert_eq!(
        consumer.registry.get(OWNER, &forged, &mut dst).await,
        Err(read)
    );
    drop((dst, target));
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// A read-write registration takes a write and serves it back to a read.
#[tokio::test]
async fn a_read_write_registration_reads_back_what_was_put() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let target = writable(&owner, 4, Access::ReadWrite).await;
    let descriptor = target.descriptor().unwrap();
    let mut src = source(&consumer, &pattern(LEN, 11)).await;
    consumer
        .registry
        .put(OWNER, &mut src, &descriptor)
        .await
        .unwrap();
    let mut dst = consumer.registry.alloc_pinned(LEN).await.unwrap();
    consumer
        .registry
        .get(OWNER, &descriptor, &mut dst)
        .await
        .unwrap();
    assert_eq!(&dst[..], &pattern(LEN, 11)[..]);
    drop((src, dst, target));
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// Bad input is a typed error that loses nothing: a source too short for
/// the range (or an offset past it), another backend's descriptor, and a
/// descriptor of a registration since unregistered.
#[tokio::test]
async fn bad_puts_are_typed_errors_that_keep_the_source() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let target = writable(&owner, 5, Access::Write).await;
    let descriptor = target.descriptor().unwrap();
    let mut short = source(&consumer, &pattern(LEN - 1, 1)).await;
    assert_eq!(
        consumer.registry.put(OWNER, &mut short, &descriptor).await,
        Err(RdmaError::SourceTooSmall {
            needed: LEN as u64,
            available: LEN as u64 - 1
        })
    );
    let mut src = source(&consumer, &pattern(LEN, 1)).await;
    assert!(matches!(
        consumer
            .registry
            .put_from(OWNER, &mut src, 1, &descriptor)
            .await,
        Err(RdmaError::SourceTooSmall { .. })
    ));
    assert_eq!(
        consumer
            .registry
            .put_from(OWNER, &mut src, usize::MAX, &descriptor)
            .await,
        Err(RdmaError::OutOfRange)
    );
    let other = Descriptor::new(
        "ucx",
        descriptor.addr(),
        8,
        1,
        descriptor.packed_key().clone(),
    )
    .unwrap()
    .granting(Access::Write);
    assert!(matches!(
        consumer.registry.put(OWNER, &mut src, &other).await,
        Err(RdmaError::InvalidDescriptor(_))
    ));
    target.unregister(Duration::from_secs(5)).await.unwrap();
    assert_eq!(
        consumer.registry.put(OWNER, &mut src, &descriptor).await,
        Err(RdmaError::RegionNotFound)
    );
    assert!(!src.is_surrendered() && !short.is_surrendered());
    drop((src, short));
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// A put cancelled in flight surrenders its source, as a cancelled GET
/// surrenders its destination: the backend may still be reading it.
#[tokio::test(start_paused = true)]
async fn a_cancelled_put_surrenders_its_source() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let target = writable(&owner, 6, Access::Write).await;
    let descriptor = target.descriptor().unwrap();
    let mut src = source(&consumer, &pattern(LEN, 8)).await;
    consumer.backend.faults().set_delay(
        rdmareg_backend::loopback::FaultOp::Put,
        Duration::from_secs(1),
    );
    let cancelled = tokio::time::timeout(
        Duration::from_millis(10),
        consumer.registry.put(OWNER, &mut src, &descriptor),
    )
    .await;
    assert!(cancelled.is_err(), "the put was still in flight");
    assert!(src.is_surrendered());
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        owner_bytes(&target),
        pattern(LEN, 8).to_vec(),
        "it finished"
    );
    drop((src, target));
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// The owner's unmap waits for a write into the region in flight, and a
/// write submitted after the unmap began is refused.
#[tokio::test(start_paused = true)]
async fn an_unregister_waits_for_a_put_in_flight() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let target = writable(&owner, 7, Access::Write).await;
    let descriptor = target.descriptor().unwrap();
    let mut src = source(&consumer, &pattern(LEN, 12)).await;
    let gate = consumer
        .backend
        .faults()
        .hang(rdmareg_backend::loopback::FaultOp::Put);
    let registry = consumer.registry.clone();
    let put_descriptor = descriptor.clone();
    let put = tokio::spawn(async move {
        let result = registry.put(OWNER, &mut src, &put_descriptor).await;
        (result, src)
    });
    gate.until_waiting(1).await;
    let watch = target.watch();
    let unregister = tokio::spawn(target.unregister(Duration::from_secs(30)));
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!watch.is_deregistered(), "the unmap waits for the put");
    gate.release();
    let (result, src) = put.await.unwrap();
    assert_eq!(result, Ok(()));
    unregister.await.unwrap().unwrap();
    assert!(watch.is_deregistered());
    let mut late = source(&consumer, &pattern(LEN, 1)).await;
    assert_eq!(
        consumer.registry.put(OWNER, &mut late, &descriptor).await,
        Err(RdmaError::RegionNotFound)
    );
    drop((src, late));
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// A registration's writes by a peer that is not this one: a third side
/// writes, the first reads it back, so writes are not tied to one peer.
#[tokio::test]
async fn any_peer_with_the_descriptor_may_write() {
    let (fabric, owner, consumer) = two_sides(small_config());
    let third = Side::new(&fabric, PeerId(3), small_config());
    let target = writable(&owner, 8, Access::ReadWrite).await;
    let descriptor = target.descriptor().unwrap();
    let mut src = source(&third, &pattern(LEN, 13)).await;
    third
        .registry
        .put(OWNER, &mut src, &descriptor)
        .await
        .unwrap();
    let mut dst = consumer.registry.alloc_pinned(LEN).await.unwrap();
    consumer
        .registry
        .get(OWNER, &descriptor, &mut dst)
        .await
        .unwrap();
    assert_eq!(&dst[..], &pattern(LEN, 13)[..]);
    drop((src, dst, target));
    shut_down(&third).await;
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// One list reads from a registration and writes into another; each entry
/// gets its own answer, in push order, and a write the owner refuses
/// (a descriptor edited to claim write access) changes nothing while its
/// neighbours complete. The registry counts reads and writes apart.
#[tokio::test]
async fn a_list_mixing_reads_and_writes_answers_each_in_order() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let readable = owner
        .registry
        .register_owned(pattern(LEN, 21))
        .await
        .unwrap();
    let target = writable(&owner, 22, Access::ReadWrite).await;
    let mut list = consumer.registry.transfer_list(OWNER);
    let read = list
        .push(&readable.descriptor_range(0, 1000).unwrap(), 0, 0)
        .unwrap();
    let write = list
        .push_put(&target.descriptor_range(2000, 500).unwrap(), 1, 0)
        .unwrap();
    let forged = readable
        .descriptor_range(0, 500)
        .unwrap()
        .granting(Access::Write);
    let refused = list.push_put(&forged, 1, 500).unwrap();
    assert_eq!((read, write, refused, list.writes()), (0, 1, 2, 2));
    let mut outgoing = pattern(1000, 23).to_vec();
    let mut buffers = vec![
        consumer.registry.alloc_pinned(1000).await.unwrap(),
        source(&consumer, &outgoing).await,
    ];
    let before = consumer.registry.metrics();
    let answers = consumer.registry.post(&list, &mut buffers).await.unwrap();
    assert_eq!(
        answers,
        vec![
            Ok(()),
            Ok(()),
            Err(RdmaError::AccessDenied { operation: "write" })
        ]
    );
    assert_eq!(&buffers[0][..], &pattern(LEN, 21)[..1000]);
    let mut want = pattern(LEN, 22).to_vec();
    want[2000..2500].copy_from_slice(&outgoing[..500]);
    assert_eq!(owner_bytes(&target), want);
    assert_eq!(owner_bytes(&readable), pattern(LEN, 21).to_vec());
    let after = consumer.registry.metrics();
    assert_eq!(after.gets - before.gets, 1);
    assert_eq!(
        (after.puts - before.puts, after.put_bytes - before.put_bytes),
        (1, 500)
    );

    // Posted again from other bytes, the list writes those.
    outgoing = pattern(1000, 24).to_vec();
    buffers[1].copy_from_slice(&outgoing);
    consumer.registry.post(&list, &mut buffers).await.unwrap();
    want[2000..2500].copy_from_slice(&outgoing[..500]);
    assert_eq!(owner_bytes(&target), want);
    drop((buffers, readable, target));
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// A read and a write of one list never share buffer bytes (the write
/// could send bytes the read replaces): such a push is refused and leaves
/// the list as it was; reads may overlap reads and writes writes.
#[tokio::test]
async fn a_read_and_a_write_of_one_list_never_share_bytes() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let target = writable(&owner, 25, Access::ReadWrite).await;
    let range = target.descriptor_range(0, 100).unwrap();
    let mut list = consumer.registry.transfer_list(OWNER);
    list.push(&range, 0, 0).unwrap();
    assert_eq!(
        list.push_put(&range, 0, 50),
        Err(RdmaError::OverlappingEntries { buffer: 0 })
    );
    assert_eq!(list.len(), 1);
    list.push_put(&range, 0, 100).unwrap();
    assert_eq!(
        list.push(&range, 0, 150),
        Err(RdmaError::OverlappingEntries { buffer: 0 })
    );
    list.push(&range, 0, 0).unwrap();
    list.push_put(&range, 0, 120).unwrap();
    list.push_put(&range, 1, 0).unwrap();
    assert_eq!((list.len(), list.writes()), (5, 3));
    let read_only = target
        .descriptor_range(0, 100)
        .unwrap()
        .granting(Access::Read);
    assert_eq!(
        list.push_put(&read_only, 2, 0),
        Err(RdmaError::AccessDenied { operation: "write" })
    );
    drop(target);
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// A list whose buffer is too short for a write names the source, not a
/// destination, and posts nothing.
#[tokio::test]
async fn a_list_write_from_a_short_buffer_is_source_too_small() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let target = writable(&owner, 26, Access::Write).await;
    let mut list = consumer.registry.transfer_list(OWNER);
    list.push_put(&target.descriptor_range(0, 1000).unwrap(), 0, 0)
        .unwrap();
    let mut buffers = vec![source(&consumer, &pattern(999, 1)).await];
    assert_eq!(
        consumer.registry.post(&list, &mut buffers).await,
        Err(RdmaError::SourceTooSmall {
            needed: 1000,
            available: 999
        })
    );
    assert_eq!(owner_bytes(&target), pattern(LEN, 26).to_vec());
    drop((buffers, target));
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// The target learns which ranges were written: a list of writes posted
/// with a notice naming them delivers the notice after every write landed,
/// so the owner reads the new bytes the moment it has the notice.
#[tokio::test(start_paused = true)]
async fn a_notice_after_a_list_of_writes_finds_them_landed() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let mut notices = owner.registry.notices().unwrap();
    let target = writable(&owner, 27, Access::Write).await;
    let mut list = consumer.registry.transfer_list(OWNER);
    list.push_put(&target.descriptor_range(0, 1000).unwrap(), 0, 0)
        .unwrap();
    list.push_put(&target.descriptor_range(4000, 1000).unwrap(), 0, 1000)
        .unwrap();
    let outgoing = pattern(2000, 28);
    let mut buffers = vec![source(&consumer, &outgoing).await];
    let answers = consumer
        .registry
        .post_with_notice(&list, &mut buffers, "wrote 0..1000 and 4000..5000")
        .await
        .unwrap();
    assert_eq!(answers, vec![Ok(()); 2]);
    let notice = next_notice(&mut notices).await;
    assert_eq!(&notice.bytes[..], b"wrote 0..1000 and 4000..5000");
    let bytes = owner_bytes(&target);
    assert_eq!(&bytes[..1000], &outgoing[..1000]);
    assert_eq!(&bytes[4000..], &outgoing[1000..]);
    assert_eq!(&bytes[1000..4000], &pattern(LEN, 27)[1000..4000]);
    drop((buffers, target, notices));
    shut_down(&consumer).await;
    shut_down(&owner).await;
}
