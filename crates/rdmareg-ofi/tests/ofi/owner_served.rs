//! Owner-served reads, the default on `tcp` and `shm`: the owner's engine
//! refuses stale and forged keys with typed errors and keeps serving, and an
//! unmap answers only once no byte of the region can be copied any more.

use crate::common;

use std::time::Duration;

use bytes::Bytes;
use common::SeamForTestMemory;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, RdmaError};
use rdmareg_ofi::Provider;
use rdmareg_ofi::key::PackedKey;

use common::OWNER;

const PAGE: usize = 4096;

fn request(key: Bytes, remote_addr: u64, dst_id: u64, len: u64) -> BackendGet {
    BackendGet {
        peer: OWNER,
        remote_addr,
        packed_key: key,
        local_region_id: dst_id,
        local_offset: 0,
        len,
        deadline: Some(Duration::from_secs(20)),
    }
}

/// Unmaps the source, then reads it with its stale key: a typed refusal
/// from the owner, and nothing lands.
async fn stale_key_is_refused(provider: Provider) {
    let (owner, consumer) = common::engines(provider);
    let (o, c) = (owner.backend(), consumer.backend());
    let src = vec![0x11u8; PAGE];
    let mut dst = vec![0u8; PAGE];
    let s = o
        .map_test_memory(src.as_ptr() as usize, PAGE)
        .await
        .unwrap();
    let d = c
        .map_test_memory(dst.as_mut_ptr() as usize, PAGE)
        .await
        .unwrap();
    o.unmap(s.backend_region_id).await.unwrap();
    let answer = c
        .get_into_test_memory(request(
            s.packed_key,
            src.as_ptr() as u64,
            d.backend_region_id,
            64,
        ))
        .await;
    c.unmap(d.backend_region_id).await.unwrap();
    consumer.shutdown().await;
    owner.shutdown().await;
    assert_eq!(answer, Err(RdmaError::RegionNotFound));
    assert!(dst.iter().all(|&b| b == 0), "no byte landed");
    assert_eq!(owner.live_registrations(), 0);
    assert_eq!(consumer.live_registrations(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_key_is_refused_by_the_owner_over_tcp() {
    stale_key_is_refused(Provider::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_key_is_refused_by_the_owner_over_shm() {
    stale_key_is_refused(Provider::Shm).await;
}

/// A key with a forged capability, and one whose length was rewritten to
/// cover an unregistered page, are refused with typed errors; the owner
/// then still serves an honest read.
async fn forged_keys_are_refused_and_the_owner_keeps_serving(provider: Provider) {
    let (owner, consumer) = common::engines(provider);
    let (o, c) = (owner.backend(), consumer.backend());
    let mut src = vec![0x11u8; 2 * PAGE];
    src[PAGE..].fill(0x22);
    let mut dst = vec![0u8; PAGE];
    let s = o
        .map_test_memory(src.as_ptr() as usize, PAGE)
        .await
        .unwrap();
    let d = c
        .map_test_memory(dst.as_mut_ptr() as usize, PAGE)
        .await
        .unwrap();
    let honest = PackedKey::decode(&s.packed_key).unwrap();
    let base = src.as_ptr() as u64;

    let mut forged = honest.clone();
    forged.capability[0] ^= 0x80;
    let wrong_capability = c
        .get_into_test_memory(request(forged.encode(), base, d.backend_region_id, 64))
        .await;

    let mut longer = honest.clone();
    longer.len = 2 * PAGE as u64;
    let beyond = c
        .get_into_test_memory(request(
            longer.encode(),
            base + PAGE as u64,
            d.backend_region_id,
            64,
        ))
        .await;
    let untouched = dst.iter().all(|&b| b == 0);

    let served = c
        .get_into_test_memory(request(s.packed_key.clone(), base, d.backend_region_id, 64))
        .await;
    c.unmap(d.backend_region_id).await.unwrap();
    o.unmap(s.backend_region_id).await.unwrap();
    consumer.shutdown().await;
    owner.shutdown().await;

    assert_eq!(wrong_capability, Err(RdmaError::RegionNotFound));
    assert_eq!(beyond, Err(RdmaError::OutOfRange));
    assert!(untouched, "no byte landed from a refused read");
    assert_eq!(served, Ok(()), "the owner still serves an honest read");
    assert!(dst[..64].iter().all(|&b| b == 0x11));
    assert!(dst[64..].iter().all(|&b| b == 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_keys_get_typed_errors_and_the_owner_keeps_serving_over_tcp() {
    forged_keys_are_refused_and_the_owner_keeps_serving(Provider::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_keys_get_typed_errors_and_the_owner_keeps_serving_over_shm() {
    forged_keys_are_refused_and_the_owner_keeps_serving(Provider::Shm).await;
}

const STREAMED: usize = 64 << 20;
const BEFORE: u8 = 0x11;
const AFTER: u8 = 0x33;

/// The owner unmaps a 64 MiB source a moment after a consumer's GET of it
/// started, then at once overwrites it. A destination byte holding the new
/// value was copied after the unmap answered `Ok`.
async fn unmap_waits_for_the_read_it_interrupts(provider: Provider, delay: Duration) {
    let (owner, consumer) = common::engines(provider);
    let (o, c) = (owner.backend(), consumer.backend());
    let src = vec![BEFORE; STREAMED];
    let src_ptr = src.as_ptr() as usize;
    let mut dst = vec![0u8; STREAMED];
    let s = o.map_test_memory(src_ptr, STREAMED).await.unwrap();
    let d = c
        .map_test_memory(dst.as_mut_ptr() as usize, STREAMED)
        .await
        .unwrap();
    // Warm up: the first read opens the connection.
    c.get_into_test_memory(request(
        s.packed_key.clone(),
        src_ptr as u64,
        d.backend_region_id,
        8,
    ))
    .await
    .unwrap();
    // No read is in flight into `dst` now.
    dst[..8].fill(0);
    let get = c.get_into_test_memory(request(
        s.packed_key.clone(),
        src_ptr as u64,
        d.backend_region_id,
        STREAMED as u64,
    ));
    let (answer, ()) = futures::join!(get, async {
        tokio::time::sleep(delay).await;
        o.unmap(s.backend_region_id).await.unwrap();
        // SAFETY: the region is unregistered; this test owns `src` and
        // nothing borrows it while it is rewritten.
        unsafe { std::ptr::write_bytes(src_ptr as *mut u8, AFTER, STREAMED) };
    });
    c.unmap(d.backend_region_id).await.unwrap();
    consumer.shutdown().await;
    owner.shutdown().await;
    drop(src);
    let late = dst.iter().filter(|&&b| b == AFTER).count();
    assert_eq!(
        late, 0,
        "bytes copied after the unmap answered; GET answered {answer:?}"
    );
    match answer {
        Ok(()) => assert!(dst.iter().all(|&b| b == BEFORE), "an Ok GET copied all"),
        Err(err) => {
            assert_eq!(err, RdmaError::RegionNotFound, "refused, not failed");
            assert!(dst.iter().all(|&b| b == 0), "a refused GET copied nothing");
        }
    }
    assert_eq!(owner.live_registrations(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmap_mid_read_over_tcp_answers_only_after_the_last_byte_was_copied() {
    unmap_waits_for_the_read_it_interrupts(Provider::Tcp, Duration::from_millis(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmap_mid_read_over_shm_answers_only_after_the_last_byte_was_copied() {
    unmap_waits_for_the_read_it_interrupts(Provider::Shm, Duration::from_millis(5)).await;
}

/// A 64 MiB source the test reaches only through its raw pointer while it
/// is registered, so it can be freed (a mapping of its own: a late read
/// faults, and AddressSanitizer reports it as a heap-use-after-free).
struct Source {
    ptr: *mut u8,
}

impl Source {
    fn filled(len: usize) -> Source {
        let bytes: Box<[u8]> = (0..len).map(pattern).collect();
        Source {
            ptr: Box::into_raw(bytes).cast::<u8>(),
        }
    }

    fn addr(&self) -> usize {
        self.ptr as usize
    }

    /// Frees the memory.
    ///
    /// # Safety
    /// No registration of it may be live, and nothing may read it later.
    unsafe fn free(self) {
        let slice = std::ptr::slice_from_raw_parts_mut(self.ptr, STREAMED);
        // SAFETY: made by Box::into_raw of a STREAMED-byte slice in
        // `filled`; the caller promises nothing reads it any more.
        drop(unsafe { Box::from_raw(slice) });
    }
}

fn pattern(i: usize) -> u8 {
    (i % 251) as u8
}

/// The owner unregisters a 64 MiB source `delay` into a consumer's GET of
/// it and frees it the moment the unmap answers: the twin of the UCX
/// suite's use-after-free test. A byte copied after the free would fault
/// (or be reported by AddressSanitizer); the GET either got every byte or
/// was refused with nothing landed.
async fn an_owner_frees_right_after_its_unmap_answers(provider: Provider, delay: Duration) {
    let (owner, consumer) = common::engines(provider.clone());
    let (o, c) = (owner.backend(), consumer.backend());
    let src = Source::filled(STREAMED);
    let mut dst = vec![0u8; STREAMED];
    let s = o.map_test_memory(src.addr(), STREAMED).await.unwrap();
    let d = c
        .map_test_memory(dst.as_mut_ptr() as usize, STREAMED)
        .await
        .unwrap();
    let get = c.get_into_test_memory(request(
        s.packed_key.clone(),
        src.addr() as u64,
        d.backend_region_id,
        STREAMED as u64,
    ));
    let (answer, unmapped) = futures::join!(get, async {
        tokio::time::sleep(delay).await;
        let unmapped = o.unmap(s.backend_region_id).await;
        if unmapped == Ok(()) {
            // SAFETY: the unmap answered Ok: the owner's engine holds no
            // lease on the region and will copy nothing more out of it.
            unsafe { src.free() };
        }
        unmapped
    });
    c.unmap(d.backend_region_id).await.unwrap();
    consumer.shutdown().await;
    owner.shutdown().await;
    assert_eq!(unmapped, Ok(()), "{provider:?}: the owner's unmap");
    match answer {
        Ok(()) => {
            let wrong = dst
                .iter()
                .enumerate()
                .filter(|&(i, &b)| b != pattern(i))
                .count();
            assert_eq!(wrong, 0, "{provider:?}: a served read is whole");
        }
        Err(RdmaError::RegionNotFound) => {
            assert!(
                dst.iter().all(|&b| b == 0),
                "{provider:?}: a refused read landed nothing"
            );
        }
        Err(other) => panic!("{provider:?} after {delay:?}: unexpected answer {other}"),
    }
    assert_eq!(owner.live_registrations(), 0);
    assert_eq!(consumer.live_registrations(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_that_frees_right_after_unregistering_over_tcp_is_never_read_after_free() {
    for delay_ms in [0u64, 5, 20] {
        an_owner_frees_right_after_its_unmap_answers(
            Provider::Tcp,
            Duration::from_millis(delay_ms),
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_that_frees_right_after_unregistering_over_shm_is_never_read_after_free() {
    for delay_ms in [0u64, 5, 20] {
        an_owner_frees_right_after_its_unmap_answers(
            Provider::Shm,
            Duration::from_millis(delay_ms),
        )
        .await;
    }
}

/// A batch of 200 small reads of one owner (gathered into lists on the
/// owner-served path) lands every entry where it says, into two
/// destination regions, and answers each on its own: an entry with a
/// stale key is `RegionNotFound`, one past its registration `OutOfRange`,
/// a forged capability `RegionNotFound`, and none of those lands a byte.
async fn a_batch_of_small_reads_answers_and_lands_each_entry_on_its_own(provider: Provider) {
    const ENTRIES: usize = 200;
    const SLOT: usize = 512;
    let (owner, consumer) = common::engines(provider.clone());
    let (o, c) = (owner.backend(), consumer.backend());
    let src: Vec<u8> = (0..ENTRIES * SLOT).map(pattern).collect();
    let gone = vec![0x55u8; PAGE];
    let mut dst_a = vec![0u8; ENTRIES * SLOT];
    let mut dst_b = vec![0u8; ENTRIES * SLOT];
    let s = o
        .map_test_memory(src.as_ptr() as usize, src.len())
        .await
        .unwrap();
    let stale = o
        .map_test_memory(gone.as_ptr() as usize, PAGE)
        .await
        .unwrap();
    o.unmap(stale.backend_region_id).await.unwrap();
    let a = c
        .map_test_memory(dst_a.as_mut_ptr() as usize, dst_a.len())
        .await
        .unwrap();
    let b = c
        .map_test_memory(dst_b.as_mut_ptr() as usize, dst_b.len())
        .await
        .unwrap();
    let base = src.as_ptr() as u64;
    let mut forged = PackedKey::decode(&s.packed_key).unwrap();
    forged.capability[3] ^= 1;
    let mut longer = PackedKey::decode(&s.packed_key).unwrap();
    longer.len += PAGE as u64;
    // Entry i reads a length of 1..=SLOT bytes from slot (i * 7) % ENTRIES
    // into slot i of `a` (even i) or `b` (odd i).
    let length = |i: usize| 1 + (i * 37) % SLOT;
    let from = |i: usize| ((i * 7) % ENTRIES) * SLOT;
    let mut requests: Vec<BackendGet> = (0..ENTRIES)
        .map(|i| BackendGet {
            local_offset: (i * SLOT) as u64,
            ..request(
                s.packed_key.clone(),
                base + from(i) as u64,
                if i % 2 == 0 {
                    a.backend_region_id
                } else {
                    b.backend_region_id
                },
                length(i) as u64,
            )
        })
        .collect();
    requests[10].packed_key = stale.packed_key.clone();
    requests[10].remote_addr = gone.as_ptr() as u64;
    requests[11].packed_key = forged.encode();
    requests[12].packed_key = longer.encode();
    requests[12].remote_addr = base + src.len() as u64;
    let answers = c.get_batch_into_test_memory(requests).await;
    c.unmap(a.backend_region_id).await.unwrap();
    c.unmap(b.backend_region_id).await.unwrap();
    o.unmap(s.backend_region_id).await.unwrap();
    consumer.shutdown().await;
    owner.shutdown().await;

    assert_eq!(answers.len(), ENTRIES);
    assert_eq!(answers[10], Err(RdmaError::RegionNotFound), "stale key");
    assert_eq!(
        answers[11],
        Err(RdmaError::RegionNotFound),
        "forged capability"
    );
    assert_eq!(
        answers[12],
        Err(RdmaError::OutOfRange),
        "past the registration"
    );
    for (i, answer) in answers.iter().enumerate() {
        let dst = if i % 2 == 0 { &dst_a } else { &dst_b };
        let landed = &dst[i * SLOT..(i + 1) * SLOT];
        if (10..=12).contains(&i) {
            assert!(
                landed.iter().all(|&b| b == 0),
                "{provider:?}: refused entry {i} landed bytes"
            );
            continue;
        }
        assert_eq!(*answer, Ok(()), "{provider:?}: entry {i}");
        let len = length(i);
        assert_eq!(
            &landed[..len],
            &src[from(i)..from(i) + len],
            "{provider:?}: entry {i}'s bytes"
        );
        assert!(
            landed[len..].iter().all(|&b| b == 0),
            "{provider:?}: entry {i} wrote past its length"
        );
    }
    assert_eq!(owner.live_registrations(), 0);
    assert_eq!(consumer.live_registrations(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_small_reads_over_tcp_answers_and_lands_each_entry_on_its_own() {
    a_batch_of_small_reads_answers_and_lands_each_entry_on_its_own(Provider::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_small_reads_over_shm_answers_and_lands_each_entry_on_its_own() {
    a_batch_of_small_reads_answers_and_lands_each_entry_on_its_own(Provider::Shm).await;
}
