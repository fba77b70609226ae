//! Attacks on remote writes through the registry over loopback: forged,
//! stale and foreign descriptors, writes racing unregister and shutdown,
//! cancelled puts and lists, mixed lists posted again, and the counters.
//! Safe code only, except `register_external_with` used as its contract
//! allows.

use std::time::Duration;

use rdmareg_backend::loopback::FaultOp;
use rdmareg_registry::{
    Access, Descriptor, ErrorKind, PeerId, PinnedBuf, RdmaError, RegionGuard, UnregisterOutcome,
};

use crate::common::*;

const LEN: usize = 4096;

async fn owned(side: &Side, seed: u8, access: Access) -> RegionGuard {
    side.registry
        .register_owned_with(pattern(LEN, seed), access)
        .await
        .unwrap()
}

async fn source(side: &Side, bytes: &[u8]) -> PinnedBuf {
    let mut buf = side.registry.alloc_pinned(bytes.len()).await.unwrap();
    buf.copy_from_slice(bytes);
    buf
}

fn bytes_of(guard: &RegionGuard) -> Vec<u8> {
    guard.watch().read(|view| view.to_vec()).unwrap()
}

/// The bytes of `ext` now, read through a fresh read-only registration on
/// a registry of its own (the safe way to look at registered memory).
async fn external_bytes(
    fabric: &rdmareg_backend::loopback::LoopbackFabric,
    ext: &External,
) -> Vec<u8> {
    let side = Side::new(fabric, PeerId(99), small_config());
    // SAFETY: `ext` stays allocated until after the shutdown below, which
    // confirms the registration is gone; no reference points into it.
    let guard = unsafe { side.registry.register_external(ext.ptr(), ext.len()) }
        .await
        .unwrap();
    let bytes = bytes_of(&guard);
    guard.unregister(Duration::from_secs(5)).await.unwrap();
    shut_down(&side).await;
    bytes
}

fn errors_of(side: &Side, kind: ErrorKind) -> u64 {
    side.registry.metrics().errors_of(kind)
}

/// Turn a read-only descriptor's wire bytes into a version 2 encoding
/// claiming `access`, by hand (as a hostile peer would).
fn forge_v2(read_only: &Descriptor, access: Access) -> Descriptor {
    let wire = read_only.encode().to_vec();
    assert_eq!(wire[2], 1, "a read-only descriptor is version 1");
    let mut forged = wire[..2].to_vec();
    forged.push(2);
    forged.push(access.to_bits());
    forged.extend_from_slice(&wire[3..]);
    Descriptor::decode(&forged).unwrap()
}

/// A read-only registration stays unwritten whatever the descriptor says:
/// version 2 bytes forged by hand, `granting`, slices of either, through
/// `put`, `put_from` and a list, for `register_owned` and
/// `register_owned_with(.., Read)` alike.
#[tokio::test]
async fn forged_write_grants_never_write_read_only_memory() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let plain = owner
        .registry
        .register_owned(pattern(LEN, 1))
        .await
        .unwrap();
    let explicit = owned(&owner, 2, Access::Read).await;
    let denied = RdmaError::AccessDenied { operation: "write" };
    let mut src = source(&consumer, &pattern(LEN, 200)).await;
    for guard in [&plain, &explicit] {
        let honest = guard.descriptor().unwrap();
        for access in [Access::Write, Access::ReadWrite] {
            let forged = [
                forge_v2(&honest, access),
                honest.clone().granting(access),
                forge_v2(&honest.slice(10, 100).unwrap(), access),
                honest.slice(LEN as u64 - 1, 1).unwrap().granting(access),
            ];
            for d in &forged {
                assert_eq!(d.access(), access);
                assert_eq!(
                    consumer.registry.put(OWNER, &mut src, d).await,
                    Err(denied.clone())
                );
                if d.len() as usize + 7 <= LEN {
                    assert_eq!(
                        consumer.registry.put_from(OWNER, &mut src, 7, d).await,
                        Err(denied.clone())
                    );
                }
                let mut list = consumer.registry.transfer_list(OWNER);
                list.push_put(d, 0, 0).unwrap();
                let answers = consumer
                    .registry
                    .post(&list, std::slice::from_mut(&mut src))
                    .await
                    .unwrap();
                assert_eq!(answers, vec![Err(denied.clone())]);
            }
        }
    }
    assert_eq!(bytes_of(&plain), pattern(LEN, 1).to_vec());
    assert_eq!(bytes_of(&explicit), pattern(LEN, 2).to_vec());
    assert!(!src.is_surrendered());
    drop((src, plain, explicit));
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// Every one-byte mutation of a writable descriptor, put with write
/// access, leaves a read-only neighbour on the same owner untouched and
/// answers with a typed error or `Ok` — never a panic.
#[tokio::test]
async fn mutated_descriptors_never_write_a_read_only_neighbour() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let writable = owned(&owner, 3, Access::Write).await;
    let neighbour = owned(&owner, 4, Access::Read).await;
    let wire = writable.descriptor().unwrap().encode().to_vec();
    let neighbour_wire = neighbour.descriptor().unwrap().encode().to_vec();
    let mut src = source(&consumer, &pattern(LEN, 250)).await;
    let mut tried = 0;
    for at in 0..wire.len() {
        for value in [0u8, 1, 0xff, wire[at] ^ 0x01, wire[at].wrapping_add(16)] {
            let mut mutated = wire.clone();
            mutated[at] = value;
            let Ok(d) = Descriptor::decode(&mutated) else {
                continue;
            };
            let d = d.granting(Access::Write);
            tried += 1;
            let len = (d.len() as usize).min(LEN);
            let Ok(d) = d.slice(0, len as u64) else {
                continue;
            };
            let _ = consumer.registry.put(OWNER, &mut src, &d).await;
            assert!(!src.is_surrendered());
        }
    }
    // The neighbour's own bytes with its key swapped for the writable one's
    // and the other way round.
    let n = Descriptor::decode(&neighbour_wire).unwrap();
    let w = writable.descriptor().unwrap();
    let swapped = Descriptor::new(
        n.backend_key(),
        n.addr(),
        n.len(),
        n.generation(),
        w.packed_key().clone(),
    )
    .unwrap()
    .granting(Access::Write);
    assert_eq!(
        consumer.registry.put(OWNER, &mut src, &swapped).await,
        Err(RdmaError::OutOfRange)
    );
    assert!(tried > 50, "{tried}");
    assert_eq!(bytes_of(&neighbour), pattern(LEN, 4).to_vec());
    drop((src, writable, neighbour));
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// A writable descriptor kept past its registration writes nothing into
/// the same memory registered again read-only: the stale key is refused
/// as gone, and the new read-only key refuses the write.
#[tokio::test]
async fn a_stale_writable_descriptor_cannot_write_a_re_registration() {
    let (fabric, owner, consumer) = two_sides(small_config());
    let ext = External::new(LEN, 5);
    // SAFETY: `ext` outlives every registration of it (each is confirmed
    // gone before it drops) and is only read through `RegionWatch`.
    let first = unsafe {
        owner
            .registry
            .register_external_with(ext.ptr(), ext.len(), Access::Write)
    }
    .await
    .unwrap();
    let stale = first.descriptor().unwrap();
    first.unregister(Duration::from_secs(5)).await.unwrap();
    // SAFETY: as above.
    let again = unsafe { owner.registry.register_external(ext.ptr(), ext.len()) }
        .await
        .unwrap();
    assert_eq!(again.addr(), stale.addr());
    let mut src = source(&consumer, &pattern(LEN, 77)).await;
    assert_eq!(
        consumer.registry.put(OWNER, &mut src, &stale).await,
        Err(RdmaError::RegionNotFound)
    );
    let fresh = again.descriptor().unwrap().granting(Access::Write);
    assert_eq!(
        consumer.registry.put(OWNER, &mut src, &fresh).await,
        Err(RdmaError::AccessDenied { operation: "write" })
    );
    assert_eq!(bytes_of(&again), pattern(LEN, 5).to_vec());
    again.unregister(Duration::from_secs(5)).await.unwrap();
    drop(src);
    shut_down(&consumer).await;
    shut_down(&owner).await;
    assert_eq!(
        external_bytes(&fabric, &ext).await,
        pattern(LEN, 5).to_vec()
    );
}

/// A writable descriptor of one owner, sent to another owner, names
/// nothing there: the other owner's memory is untouched.
#[tokio::test]
async fn a_descriptor_of_another_instance_writes_nothing() {
    let (fabric, owner, consumer) = two_sides(small_config());
    let other = Side::new(&fabric, PeerId(3), small_config());
    let mine = owned(&owner, 6, Access::Write).await;
    let theirs = owned(&other, 7, Access::ReadWrite).await;
    let mut src = source(&consumer, &pattern(LEN, 99)).await;
    let d = mine.descriptor().unwrap();
    assert_eq!(
        consumer.registry.put(PeerId(3), &mut src, &d).await,
        Err(RdmaError::RegionNotFound)
    );
    // The other owner's address under the first owner's key, sent to
    // either owner.
    let t = theirs.descriptor().unwrap();
    let mixed = Descriptor::new(
        t.backend_key(),
        t.addr(),
        t.len(),
        t.generation(),
        d.packed_key().clone(),
    )
    .unwrap()
    .granting(Access::Write);
    assert_eq!(
        consumer.registry.put(PeerId(3), &mut src, &mixed).await,
        Err(RdmaError::RegionNotFound)
    );
    assert_eq!(
        consumer.registry.put(OWNER, &mut src, &mixed).await,
        Err(RdmaError::OutOfRange)
    );
    assert_eq!(
        consumer.registry.put(PeerId(42), &mut src, &d).await,
        Err(RdmaError::NotConfigured)
    );
    assert_eq!(bytes_of(&mine), pattern(LEN, 6).to_vec());
    assert_eq!(bytes_of(&theirs), pattern(LEN, 7).to_vec());
    drop((src, mine, theirs));
    shut_down(&other).await;
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// A lease grants reads only, even of a read-write registration and even
/// when its descriptor is edited to claim a write.
#[tokio::test]
async fn a_lease_descriptor_never_writes() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let target = owned(&owner, 8, Access::ReadWrite).await;
    let lease = target.lease(2, Duration::from_secs(60)).await.unwrap();
    let leased = lease.descriptor().clone();
    assert_eq!(leased.access(), Access::Read);
    let mut src = source(&consumer, &pattern(LEN, 31)).await;
    let denied = RdmaError::AccessDenied { operation: "write" };
    assert_eq!(
        consumer.registry.put(OWNER, &mut src, &leased).await,
        Err(denied.clone())
    );
    for forged in [
        leased.clone().granting(Access::Write),
        forge_v2(&leased, Access::ReadWrite),
    ] {
        assert_eq!(
            consumer.registry.put(OWNER, &mut src, &forged).await,
            Err(denied.clone())
        );
    }
    // The lease still reads.
    let mut dst = consumer.registry.alloc_pinned(LEN).await.unwrap();
    consumer
        .registry
        .get(OWNER, &leased, &mut dst)
        .await
        .unwrap();
    assert_eq!(&dst[..], &pattern(LEN, 8)[..]);
    drop((src, dst, lease, target));
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// A forged range cannot spill out of a writable registration into the
/// read-only one right after it in memory: the write is refused whole.
#[tokio::test]
async fn a_forged_range_cannot_spill_into_the_next_registration() {
    let (fabric, owner, consumer) = two_sides(small_config());
    let half = page();
    let ext = External::new(2 * half, 9);
    // SAFETY: `ext` outlives both registrations (confirmed gone by the
    // owner's shutdown) and is read only through registrations' watches.
    let low = unsafe {
        owner
            .registry
            .register_external_with(ext.ptr(), half, Access::Write)
    }
    .await
    .unwrap();
    // SAFETY: as above.
    let high = unsafe {
        owner
            .registry
            .register_external(ext.ptr().wrapping_add(half), half)
    }
    .await
    .unwrap();
    let d = low.descriptor().unwrap();
    let mut src = source(&consumer, &pattern(2 * half, 40)).await;
    for (addr, len) in [
        (d.addr(), d.len() + 1),
        (d.addr() + d.len() - 8, 16),
        (d.addr() + d.len(), 8),
        (d.addr() - 1, 8),
    ] {
        let forged = Descriptor::new(
            d.backend_key(),
            addr,
            len,
            d.generation(),
            d.packed_key().clone(),
        )
        .unwrap()
        .granting(Access::Write);
        assert_eq!(
            consumer.registry.put(OWNER, &mut src, &forged).await,
            Err(RdmaError::OutOfRange),
            "[{addr:#x}, +{len})"
        );
    }
    assert_eq!(bytes_of(&low), pattern(2 * half, 9)[..half].to_vec());
    assert_eq!(bytes_of(&high), pattern(2 * half, 9)[half..].to_vec());
    drop((src, low, high));
    shut_down(&consumer).await;
    shut_down(&owner).await;
    assert_eq!(
        external_bytes(&fabric, &ext).await,
        pattern(2 * half, 9).to_vec()
    );
}

/// An unregister that times out behind a write in flight reports the
/// transfer and does not release the region until the write is done; the
/// write lands before `deregistered()` resolves, never after.
#[tokio::test(start_paused = true)]
async fn a_timed_out_unregister_holds_until_the_put_lands() {
    let (fabric, owner, consumer) = two_sides(small_config());
    let ext = External::new(LEN, 10);
    // SAFETY: `ext` outlives the registration: the test waits for
    // `deregistered()` before it drops, and reads it through watches.
    let target = unsafe {
        owner
            .registry
            .register_external_with(ext.ptr(), ext.len(), Access::Write)
    }
    .await
    .unwrap();
    let d = target.descriptor().unwrap();
    let watch = target.watch();
    let gate = consumer.backend.faults().hang(FaultOp::Put);
    let registry = consumer.registry.clone();
    let mut src = source(&consumer, &pattern(LEN, 11)).await;
    let put = tokio::spawn(async move {
        let result = registry.put(OWNER, &mut src, &d).await;
        (result, src)
    });
    gate.until_waiting(1).await;
    let outcome = target.unregister(Duration::from_millis(20)).await.unwrap();
    assert!(
        matches!(
            outcome,
            UnregisterOutcome::UnmapPending {
                transfers: Some(1),
                ..
            }
        ),
        "{outcome:?}"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!watch.is_deregistered());
    gate.release();
    let (result, src) = put.await.unwrap();
    assert_eq!(result, Ok(()));
    within(Duration::from_secs(5), "deregistered", watch.deregistered()).await;
    drop(src);
    shut_down(&consumer).await;
    shut_down(&owner).await;
    assert_eq!(
        external_bytes(&fabric, &ext).await,
        pattern(LEN, 11).to_vec()
    );
}

/// The owner shutting down under a write that waits in the consumer's
/// transport ends that write without writing: once the owner's memory is
/// released, releasing the write changes nothing.
#[tokio::test(start_paused = true)]
async fn an_owner_shutdown_ends_a_waiting_put_unwritten() {
    let (fabric, owner, consumer) = two_sides(small_config());
    let ext = External::new(LEN, 12);
    // SAFETY: `ext` outlives the registration (the owner's shutdown
    // confirms it gone) and is read only through registrations.
    let target = unsafe {
        owner
            .registry
            .register_external_with(ext.ptr(), ext.len(), Access::ReadWrite)
    }
    .await
    .unwrap();
    let d = target.descriptor().unwrap();
    let watch = target.watch();
    let gate = consumer.backend.faults().hang(FaultOp::Put);
    let registry = consumer.registry.clone();
    let mut src = source(&consumer, &pattern(LEN, 13)).await;
    let put = tokio::spawn(async move {
        let result = registry.put(OWNER, &mut src, &d).await;
        (result, src)
    });
    gate.until_waiting(1).await;
    drop(target);
    within(Duration::from_secs(30), "owner shutdown", shut_down(&owner)).await;
    assert!(watch.is_deregistered());
    assert_eq!(owner.live(), 0);
    gate.release();
    let (result, src) = put.await.unwrap();
    assert!(result.is_err(), "{result:?}");
    assert!(!src.is_surrendered());
    drop(src);
    shut_down(&consumer).await;
    assert_eq!(
        external_bytes(&fabric, &ext).await,
        pattern(LEN, 12).to_vec()
    );
}

/// The consumer's registry shut down while its put waits: shutdown does not
/// free the source under the transport, the put ends with a typed error,
/// its source comes back, and every registration is released.
#[tokio::test(start_paused = true)]
async fn a_consumer_shutdown_under_a_waiting_put_leaks_nothing() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let target = owned(&owner, 14, Access::Write).await;
    let d = target.descriptor().unwrap();
    let gate = consumer.backend.faults().hang(FaultOp::Put);
    let registry = consumer.registry.clone();
    let mut src = source(&consumer, &pattern(LEN, 15)).await;
    let put_d = d.clone();
    let put = tokio::spawn(async move {
        let result = registry.put(OWNER, &mut src, &put_d).await;
        (result, src)
    });
    gate.until_waiting(1).await;
    let swept = consumer.registry.shutdown(Duration::from_millis(50)).await;
    consumer.backend.shutdown().await;
    let report = swept.finish_after_backend_teardown();
    assert!(report.released, "{report:?}");
    assert_eq!(consumer.live(), 0);
    let (result, src) = put.await.unwrap();
    assert_eq!(result, Err(RdmaError::ShuttingDown));
    assert!(!src.is_surrendered());
    drop(src);
    assert_eq!(bytes_of(&target), pattern(LEN, 14).to_vec());
    drop(gate);
    drop(target);
    shut_down(&owner).await;
}

/// A list with writes dropped mid-post surrenders exactly the buffers it
/// uses (sources included), not the others; its writes still land, and
/// the memory comes back so everything is released at shutdown.
#[tokio::test(start_paused = true)]
async fn a_dropped_mixed_post_surrenders_every_used_buffer() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let readable = owned(&owner, 16, Access::Read).await;
    let target = owned(&owner, 17, Access::Write).await;
    let mut list = consumer.registry.transfer_list(OWNER);
    list.push(&readable.descriptor_range(0, 500).unwrap(), 0, 0)
        .unwrap();
    list.push_put(&target.descriptor_range(1000, 500).unwrap(), 2, 0)
        .unwrap();
    let mut buffers = vec![
        consumer.registry.alloc_pinned(500).await.unwrap(),
        source(&consumer, &pattern(500, 1)).await,
        source(&consumer, &pattern(500, 18)).await,
    ];
    let gate = consumer.backend.faults().hang(FaultOp::Put);
    let cancelled = tokio::time::timeout(
        Duration::from_millis(10),
        consumer.registry.post(&list, &mut buffers),
    )
    .await;
    assert!(cancelled.is_err());
    assert!(buffers[0].is_surrendered() && buffers[2].is_surrendered());
    assert!(!buffers[1].is_surrendered(), "an unused buffer is kept");
    assert_eq!(
        consumer.registry.post(&list, &mut buffers).await,
        Err(RdmaError::BufferSurrendered)
    );
    assert_eq!(bytes_of(&target), pattern(LEN, 17).to_vec());
    gate.release();
    eventually("the detached write lands", || {
        bytes_of(&target)[1000..1500] == pattern(500, 18)[..]
    })
    .await;
    drop((buffers, readable, target));
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// A put cancelled at its only await point, at every poll count, either
/// completed (and handed its source back) or surrendered it; a
/// surrendered source's write still lands.
#[tokio::test(start_paused = true)]
async fn a_put_cancelled_at_any_poll_keeps_its_promise() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let target = owned(&owner, 19, Access::Write).await;
    let d = target.descriptor().unwrap();
    consumer
        .backend
        .faults()
        .set_delay(FaultOp::Put, Duration::from_millis(5));
    for polls in 0..4u8 {
        let mut src = source(&consumer, &pattern(LEN, 100 + polls)).await;
        {
            let mut put = std::pin::pin!(consumer.registry.put(OWNER, &mut src, &d));
            for _ in 0..polls {
                if futures::poll!(put.as_mut()).is_ready() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        if polls == 0 {
            assert!(!src.is_surrendered(), "never polled, nothing taken");
            continue;
        }
        assert!(src.is_surrendered(), "polled {polls}");
        eventually("the surrendered put lands", || {
            bytes_of(&target) == pattern(LEN, 100 + polls).to_vec()
        })
        .await;
    }
    consumer.backend.faults().clear();
    drop(target);
    eventually("no transfer in flight", || {
        consumer.registry.stats().transfers_in_flight == 0
    })
    .await;
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// Entries of a mixed list are answered once each, in push order, each
/// with its own outcome: a read, a refused forged write, a write, a
/// stale write, a read of a write-only range.
#[tokio::test]
async fn a_mixed_list_answers_each_entry_in_order() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let readable = owned(&owner, 20, Access::Read).await;
    let target = owned(&owner, 21, Access::Write).await;
    let gone = owned(&owner, 22, Access::Write).await;
    let stale = gone.descriptor_range(0, 100).unwrap();
    gone.unregister(Duration::from_secs(5)).await.unwrap();
    let mut list = consumer.registry.transfer_list(OWNER);
    list.push(&readable.descriptor_range(0, 100).unwrap(), 0, 0)
        .unwrap();
    list.push_put(
        &readable
            .descriptor_range(0, 100)
            .unwrap()
            .granting(Access::Write),
        1,
        0,
    )
    .unwrap();
    list.push_put(&target.descriptor_range(0, 100).unwrap(), 1, 100)
        .unwrap();
    list.push_put(&stale, 1, 200).unwrap();
    list.push(
        &target
            .descriptor_range(0, 100)
            .unwrap()
            .granting(Access::ReadWrite),
        0,
        100,
    )
    .unwrap();
    list.push(&readable.descriptor_range(100, 100).unwrap(), 2, 0)
        .unwrap();
    let mut buffers = vec![
        consumer.registry.alloc_pinned(200).await.unwrap(),
        source(&consumer, &pattern(300, 50)).await,
        consumer.registry.alloc_pinned(100).await.unwrap(),
    ];
    let answers = consumer.registry.post(&list, &mut buffers).await.unwrap();
    assert_eq!(
        answers,
        vec![
            Ok(()),
            Err(RdmaError::AccessDenied { operation: "write" }),
            Ok(()),
            Err(RdmaError::RegionNotFound),
            Err(RdmaError::AccessDenied { operation: "read" }),
            Ok(()),
        ]
    );
    assert_eq!(&buffers[0][..100], &pattern(LEN, 20)[..100]);
    assert_eq!(&buffers[2][..], &pattern(LEN, 20)[100..200]);
    let mut want = pattern(LEN, 21).to_vec();
    want[..100].copy_from_slice(&pattern(300, 50)[100..200]);
    assert_eq!(bytes_of(&target), want);
    assert_eq!(bytes_of(&readable), pattern(LEN, 20).to_vec());
    drop((buffers, readable, target));
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// A mixed list posted again with other buffers reads into and writes
/// from the new ones only; the old buffers are not touched by the second
/// post (no request kept from the first post aims at them).
#[tokio::test]
async fn a_mixed_list_posted_with_new_buffers_uses_only_them() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let readable = owned(&owner, 23, Access::Read).await;
    let target = owned(&owner, 24, Access::Write).await;
    let mut list = consumer.registry.transfer_list(OWNER);
    list.push(&readable.descriptor_range(0, 256).unwrap(), 0, 0)
        .unwrap();
    list.push_put(&target.descriptor_range(0, 256).unwrap(), 1, 0)
        .unwrap();
    let mut first = vec![
        consumer.registry.alloc_pinned(256).await.unwrap(),
        source(&consumer, &pattern(256, 60)).await,
    ];
    assert_eq!(
        consumer.registry.post(&list, &mut first).await.unwrap(),
        vec![Ok(()); 2]
    );
    first[0].fill(0);
    let mut second = vec![
        consumer.registry.alloc_pinned(256).await.unwrap(),
        source(&consumer, &pattern(256, 61)).await,
    ];
    assert_eq!(
        consumer.registry.post(&list, &mut second).await.unwrap(),
        vec![Ok(()); 2]
    );
    assert_eq!(&first[0][..], &[0u8; 256][..]);
    assert_eq!(&second[0][..], &pattern(LEN, 23)[..256]);
    assert_eq!(&bytes_of(&target)[..256], &pattern(256, 61)[..]);
    // And once more into the first buffers, changed.
    first[1].copy_from_slice(&pattern(256, 62));
    consumer.registry.post(&list, &mut first).await.unwrap();
    assert_eq!(&first[0][..], &pattern(LEN, 23)[..256]);
    assert_eq!(&bytes_of(&target)[..256], &pattern(256, 62)[..]);
    drop((first, second, readable, target));
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// A read and a write never share buffer bytes, at every overlap shape
/// (inside, around, touching either end by one byte), in either push
/// order; bytes next to each other are fine.
#[tokio::test]
async fn reads_and_writes_never_share_a_byte_in_any_shape() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let target = owned(&owner, 25, Access::ReadWrite).await;
    let range = |len| target.descriptor_range(0, len).unwrap();
    for write_first in [false, true] {
        for (offset, len, shares) in [
            (100usize, 100u64, true),
            (150, 10, true),
            (50, 200, true),
            (199, 1, true),
            (99, 2, true),
            (0, 100, false),
            (200, 50, false),
            (100, 100, true),
        ] {
            let mut list = consumer.registry.transfer_list(OWNER);
            let (first, second): (fn(&mut _, &_, _, _) -> _, fn(&mut _, &_, _, _) -> _) =
                if write_first {
                    (
                        rdmareg_registry::TransferList::push_put,
                        rdmareg_registry::TransferList::push,
                    )
                } else {
                    (
                        rdmareg_registry::TransferList::push,
                        rdmareg_registry::TransferList::push_put,
                    )
                };
            first(&mut list, &range(100), 0, 100).unwrap();
            let got = second(&mut list, &range(len), 0, offset);
            assert_eq!(got.is_err(), shares, "{write_first} {offset} {len}");
            // Another buffer never conflicts.
            second(&mut list, &range(len), 1, offset).unwrap();
        }
    }
    drop(target);
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// The counters are honest: a landed put counts once with its bytes, a
/// refused one only as its error, a refused post once, and a mixed list's
/// writes stay out of the read latency and GET counts.
#[tokio::test]
async fn the_counters_count_puts_honestly() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let readable = owned(&owner, 26, Access::Read).await;
    let target = owned(&owner, 27, Access::Write).await;
    let mut src = source(&consumer, &pattern(LEN, 1)).await;
    let m0 = consumer.registry.metrics();
    consumer
        .registry
        .put(OWNER, &mut src, &target.descriptor_range(0, 123).unwrap())
        .await
        .unwrap();
    let m1 = consumer.registry.metrics();
    assert_eq!((m1.puts - m0.puts, m1.put_bytes - m0.put_bytes), (1, 123));
    assert_eq!(
        (m1.gets, m1.get_latency.count),
        (m0.gets, m0.get_latency.count)
    );

    let denied_before = errors_of(&consumer, ErrorKind::AccessDenied);
    let forged = readable.descriptor().unwrap().granting(Access::Write);
    assert!(
        consumer
            .registry
            .put(OWNER, &mut src, &forged)
            .await
            .is_err()
    );
    let short_before = errors_of(&consumer, ErrorKind::SourceTooSmall);
    let mut tiny = source(&consumer, &[1, 2, 3]).await;
    assert!(
        consumer
            .registry
            .put(OWNER, &mut tiny, &target.descriptor().unwrap())
            .await
            .is_err()
    );
    let m2 = consumer.registry.metrics();
    assert_eq!((m2.puts, m2.put_bytes), (m1.puts, m1.put_bytes));
    assert_eq!(
        errors_of(&consumer, ErrorKind::AccessDenied),
        denied_before + 1
    );
    assert_eq!(
        errors_of(&consumer, ErrorKind::SourceTooSmall),
        short_before + 1
    );

    let mut list = consumer.registry.transfer_list(OWNER);
    list.push(&readable.descriptor_range(0, 10).unwrap(), 0, 0)
        .unwrap();
    list.push_put(&target.descriptor_range(0, 20).unwrap(), 1, 0)
        .unwrap();
    list.push_put(&forged.slice(0, 30).unwrap(), 1, 20).unwrap();
    list.push_put(&target.descriptor_range(100, 40).unwrap(), 1, 50)
        .unwrap();
    let mut buffers = vec![
        consumer.registry.alloc_pinned(10).await.unwrap(),
        source(&consumer, &pattern(90, 2)).await,
    ];
    let answers = consumer.registry.post(&list, &mut buffers).await.unwrap();
    assert_eq!(answers.iter().filter(|a| a.is_ok()).count(), 3);
    let m3 = consumer.registry.metrics();
    assert_eq!((m3.puts - m2.puts, m3.put_bytes - m2.put_bytes), (2, 60));
    assert_eq!((m3.gets - m2.gets, m3.get_bytes - m2.get_bytes), (1, 10));
    assert_eq!(m3.get_latency.count - m2.get_latency.count, 1);
    assert_eq!(
        errors_of(&consumer, ErrorKind::AccessDenied),
        denied_before + 2
    );

    // A post refused before submission counts one error and no transfer.
    let mut short = vec![
        consumer.registry.alloc_pinned(10).await.unwrap(),
        source(&consumer, &pattern(50, 3)).await,
    ];
    assert!(matches!(
        consumer.registry.post(&list, &mut short).await,
        Err(RdmaError::SourceTooSmall { .. })
    ));
    let m4 = consumer.registry.metrics();
    assert_eq!((m4.puts, m4.gets), (m3.puts, m3.gets));
    assert_eq!(
        errors_of(&consumer, ErrorKind::SourceTooSmall),
        short_before + 2
    );
    drop((src, tiny, buffers, short, readable, target));
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// A source from another registry, a surrendered source and a put after
/// shutdown began are typed errors that leave the target as it was.
#[tokio::test(start_paused = true)]
async fn bad_sources_are_typed_errors() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let target = owned(&owner, 28, Access::Write).await;
    let d = target.descriptor().unwrap();
    let mut foreign = source(&owner, &pattern(LEN, 1)).await;
    assert_eq!(
        consumer.registry.put(OWNER, &mut foreign, &d).await,
        Err(RdmaError::ForeignBuffer)
    );
    let mut src = source(&consumer, &pattern(LEN, 2)).await;
    let gate = consumer.backend.faults().hang(FaultOp::Put);
    let cancelled = tokio::time::timeout(
        Duration::from_millis(5),
        consumer.registry.put(OWNER, &mut src, &d),
    )
    .await;
    assert!(cancelled.is_err());
    assert_eq!(
        consumer.registry.put(OWNER, &mut src, &d).await,
        Err(RdmaError::BufferSurrendered)
    );
    gate.release();
    let mut fresh = source(&consumer, &pattern(LEN, 3)).await;
    eventually("in flight done", || {
        consumer.registry.stats().transfers_in_flight == 0
    })
    .await;
    let swept = consumer.registry.shutdown(Duration::from_secs(5)).await;
    assert_eq!(
        consumer.registry.put(OWNER, &mut fresh, &d).await,
        Err(RdmaError::ShuttingDown)
    );
    consumer.backend.shutdown().await;
    assert!(swept.finish_after_backend_teardown().released);
    assert_eq!(bytes_of(&target), pattern(LEN, 2).to_vec());
    drop((foreign, src, fresh, target));
    shut_down(&owner).await;
}

/// Forged descriptors with huge lengths pushed into a list are refused at
/// post with a typed error, and asking the list its size must not panic.
#[tokio::test]
async fn huge_forged_lengths_never_panic_a_list() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let target = owned(&owner, 29, Access::Write).await;
    let d = target.descriptor().unwrap();
    let huge = Descriptor::new(
        d.backend_key(),
        1,
        u64::MAX / 2,
        d.generation(),
        d.packed_key().clone(),
    )
    .unwrap()
    .granting(Access::Write);
    let mut list = consumer.registry.transfer_list(OWNER);
    list.push_put(&huge, 0, 0).unwrap();
    list.push_put(&huge, 1, 0).unwrap();
    list.push_put(&huge, 2, 0).unwrap();
    let total = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| list.total_bytes()));
    assert!(total.is_ok(), "total_bytes panicked on forged lengths");
    let mut buffers = vec![
        source(&consumer, &[1; 8]).await,
        source(&consumer, &[1; 8]).await,
        source(&consumer, &[1; 8]).await,
    ];
    assert!(matches!(
        consumer.registry.post(&list, &mut buffers).await,
        Err(RdmaError::SourceTooSmall { .. })
    ));
    drop((buffers, target));
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// A put cancelled while its transport hangs, its source dropped, and both
/// sides shut down without ever releasing the hang: shutdown ends the put,
/// the detached task gives the memory back, and nothing stays registered;
/// the target never sees the write.
#[tokio::test(start_paused = true)]
async fn shutdown_after_a_cancelled_hung_put_releases_everything() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let target = owned(&owner, 30, Access::Write).await;
    let d = target.descriptor().unwrap();
    let gate = consumer.backend.faults().hang(FaultOp::Put);
    let mut src = source(&consumer, &pattern(LEN, 31)).await;
    let cancelled = tokio::time::timeout(
        Duration::from_millis(5),
        consumer.registry.put(OWNER, &mut src, &d),
    )
    .await;
    assert!(cancelled.is_err() && src.is_surrendered());
    drop(src);
    within(
        Duration::from_secs(60),
        "consumer shutdown",
        shut_down(&consumer),
    )
    .await;
    assert_eq!(consumer.live(), 0);
    assert_eq!(bytes_of(&target), pattern(LEN, 30).to_vec());
    drop((gate, target));
    shut_down(&owner).await;
}

/// A list of writes with one the owner refuses withholds its notice: the
/// owner is never told ranges were written when one was not.
#[tokio::test(start_paused = true)]
async fn a_refused_write_withholds_the_lists_notice() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let mut notices = owner.registry.notices().unwrap();
    let readable = owned(&owner, 32, Access::Read).await;
    let target = owned(&owner, 33, Access::Write).await;
    let mut list = consumer.registry.transfer_list(OWNER);
    list.push_put(&target.descriptor_range(0, 100).unwrap(), 0, 0)
        .unwrap();
    list.push_put(
        &readable
            .descriptor_range(0, 100)
            .unwrap()
            .granting(Access::Write),
        0,
        100,
    )
    .unwrap();
    let mut buffers = vec![source(&consumer, &pattern(200, 34)).await];
    let answers = consumer
        .registry
        .post_with_notice(&list, &mut buffers, "both written")
        .await
        .unwrap();
    assert_eq!(
        answers,
        vec![Ok(()), Err(RdmaError::AccessDenied { operation: "write" })]
    );
    let nothing = tokio::time::timeout(
        Duration::from_millis(100),
        futures::StreamExt::next(&mut notices),
    )
    .await;
    assert!(nothing.is_err(), "a notice was sent: {nothing:?}");
    assert_eq!(bytes_of(&readable), pattern(LEN, 32).to_vec());
    drop((buffers, readable, target, notices));
    shut_down(&consumer).await;
    shut_down(&owner).await;
}

/// `get_many` refusing a write-only range (the new access check at push)
/// is an error a public operation returned, so the registry counts it,
/// as it counts the same refusal from `get`.
#[tokio::test]
async fn get_many_counts_an_access_refusal() {
    let (_fabric, owner, consumer) = two_sides(small_config());
    let target = owned(&owner, 35, Access::Write).await;
    let d = target.descriptor_range(0, 100).unwrap();
    let mut buffers = vec![consumer.registry.alloc_pinned(100).await.unwrap()];
    let before = errors_of(&consumer, ErrorKind::AccessDenied);
    assert_eq!(
        consumer.registry.get(OWNER, &d, &mut buffers[0]).await,
        Err(RdmaError::AccessDenied { operation: "read" })
    );
    assert_eq!(errors_of(&consumer, ErrorKind::AccessDenied), before + 1);
    assert_eq!(
        consumer
            .registry
            .get_many(OWNER, &[(&d, 0, 0)], &mut buffers)
            .await,
        Err(RdmaError::AccessDenied { operation: "read" })
    );
    assert_eq!(
        errors_of(&consumer, ErrorKind::AccessDenied),
        before + 2,
        "get_many returned AccessDenied without counting it"
    );
    drop((buffers, target));
    shut_down(&consumer).await;
    shut_down(&owner).await;
}
