//! Served writes over `tcp;ofi_rxm` and `shm`: puts of every size around
//! the providers' eager, segmentation and chunk limits land exactly; a put
//! to a read-only registration is refused with nothing written; an unmap
//! racing large puts answers, and no byte lands after it did.

use crate::common;

use std::time::Duration;

use bytes::Bytes;
use common::{OWNER, SeamForTestMemory};
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{Access, BackendPut, RdmaError};
use rdmareg_ofi::Provider;

fn put(key: &Bytes, remote_addr: u64, src_id: u64, local_offset: u64, len: u64) -> BackendPut {
    BackendPut {
        peer: OWNER,
        remote_addr,
        packed_key: key.clone(),
        local_region_id: src_id,
        local_offset,
        len,
        deadline: Some(Duration::from_secs(20)),
    }
}

fn pattern(i: usize) -> u8 {
    (i % 251) as u8 ^ 0x5C
}

/// Sizes on both sides of `shm`'s inject size (4 KiB), `tcp;ofi_rxm`'s
/// eager (16 KiB) and segmentation (128 KiB) limits, the write chunk
/// (256 KiB), and several chunks.
const SIZES: [usize; 16] = [
    1,
    4095,
    4096,
    4097,
    16383,
    16384,
    16385,
    (128 << 10) - 1,
    128 << 10,
    (128 << 10) + 1,
    (256 << 10) - 1,
    256 << 10,
    (256 << 10) + 1,
    (1 << 20) + 3,
    (4 << 20) - 7,
    8 << 20,
];

async fn every_size_lands_exactly(provider: Provider) {
    const ROOM: usize = (8 << 20) + 64;
    let (owner, consumer) = common::engines(provider);
    let (o, c) = (owner.backend(), consumer.backend());
    let src: Vec<u8> = (0..ROOM).map(pattern).collect();
    let s = c
        .map_test_memory(src.as_ptr() as usize, ROOM)
        .await
        .unwrap();
    for size in SIZES {
        let mut dst = vec![0u8; ROOM];
        let d = o
            .map_test_memory_with_access(dst.as_mut_ptr() as usize, ROOM, Access::ReadWrite)
            .await
            .unwrap();
        // Odd offsets on both sides, so no chunk is aligned.
        let answer = c
            .put_from_test_memory(put(
                &d.packed_key,
                dst.as_ptr() as u64 + 13,
                s.backend_region_id,
                7,
                size as u64,
            ))
            .await;
        o.unmap(d.backend_region_id).await.unwrap();
        assert_eq!(answer, Ok(()), "a put of {size} bytes");
        assert!(
            dst[..13].iter().all(|&b| b == 0),
            "{size}: before the range"
        );
        assert!(
            dst[13 + size..].iter().all(|&b| b == 0),
            "{size}: after the range"
        );
        let wrong = (0..size).find(|&i| dst[13 + i] != pattern(7 + i));
        assert_eq!(wrong, None, "{size}: first wrong byte");
    }
    c.unmap(s.backend_region_id).await.unwrap();
    consumer.shutdown().await;
    owner.shutdown().await;
    assert_eq!(owner.live_registrations(), 0);
    assert_eq!(consumer.live_registrations(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn puts_of_every_size_land_exactly_over_tcp() {
    every_size_lands_exactly(Provider::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn puts_of_every_size_land_exactly_over_shm() {
    every_size_lands_exactly(Provider::Shm).await;
}

/// A put of several chunks to a read-only registration is refused as
/// access denied with nothing written, and the owner then serves reads of
/// it and puts into a writable one.
async fn read_only_is_refused_with_nothing_written(provider: Provider) {
    const LEN: usize = 1 << 20;
    let (owner, consumer) = common::engines(provider);
    let (o, c) = (owner.backend(), consumer.backend());
    let src = vec![0x42u8; LEN];
    let read_only = vec![0x17u8; LEN];
    let mut writable = vec![0u8; LEN];
    let s = c.map_test_memory(src.as_ptr() as usize, LEN).await.unwrap();
    let r = o
        .map_test_memory(read_only.as_ptr() as usize, LEN)
        .await
        .unwrap();
    let w = o
        .map_test_memory_with_access(writable.as_mut_ptr() as usize, LEN, Access::Write)
        .await
        .unwrap();
    let refused = c
        .put_from_test_memory(put(
            &r.packed_key,
            read_only.as_ptr() as u64,
            s.backend_region_id,
            0,
            LEN as u64,
        ))
        .await;
    let batch = c
        .put_batch_from_test_memory(vec![
            put(
                &r.packed_key,
                read_only.as_ptr() as u64,
                s.backend_region_id,
                0,
                64,
            ),
            put(
                &w.packed_key,
                writable.as_ptr() as u64,
                s.backend_region_id,
                0,
                LEN as u64,
            ),
        ])
        .await;
    let mut back = vec![0u8; 64];
    let b = c
        .map_test_memory(back.as_mut_ptr() as usize, 64)
        .await
        .unwrap();
    let read = c
        .get_into_test_memory(rdmareg_core::BackendGet {
            peer: OWNER,
            remote_addr: read_only.as_ptr() as u64,
            packed_key: r.packed_key.clone(),
            local_region_id: b.backend_region_id,
            local_offset: 0,
            len: 64,
            deadline: Some(Duration::from_secs(20)),
        })
        .await;
    for (engine, id) in [
        (&o, r.backend_region_id),
        (&o, w.backend_region_id),
        (&c, s.backend_region_id),
        (&c, b.backend_region_id),
    ] {
        engine.unmap(id).await.unwrap();
    }
    consumer.shutdown().await;
    owner.shutdown().await;
    let denied = RdmaError::AccessDenied { operation: "write" };
    assert_eq!(refused, Err(denied.clone()));
    assert_eq!(batch, vec![Err(denied), Ok(())]);
    assert!(read_only.iter().all(|&b| b == 0x17), "nothing written");
    assert!(
        writable.iter().all(|&b| b == 0x42),
        "the writable one written"
    );
    assert_eq!(read, Ok(()));
    assert!(back.iter().all(|&b| b == 0x17));
    assert_eq!(owner.live_registrations(), 0);
    assert_eq!(consumer.live_registrations(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_to_a_read_only_registration_is_refused_over_tcp() {
    read_only_is_refused_with_nothing_written(Provider::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_to_a_read_only_registration_is_refused_over_shm() {
    read_only_is_refused_with_nothing_written(Provider::Shm).await;
}

/// Four 8 MiB puts race an unmap of their target: the unmap answers, each
/// put answers `Ok` or a typed refusal, and no byte of the target changes
/// after the unmap answered.
async fn an_unmap_racing_puts_answers_and_nothing_lands_after(provider: Provider) {
    const LEN: usize = 8 << 20;
    let (owner, consumer) = common::engines(provider);
    let (o, c) = (owner.backend(), consumer.backend());
    let src = vec![0x99u8; LEN];
    let mut dst = vec![0u8; LEN];
    let s = c.map_test_memory(src.as_ptr() as usize, LEN).await.unwrap();
    let d = o
        .map_test_memory_with_access(dst.as_mut_ptr() as usize, LEN, Access::Write)
        .await
        .unwrap();
    let puts = c.put_batch_from_test_memory(
        (0..4)
            .map(|_| {
                put(
                    &d.packed_key,
                    dst.as_ptr() as u64,
                    s.backend_region_id,
                    0,
                    LEN as u64,
                )
            })
            .collect(),
    );
    let unmap = async {
        tokio::time::sleep(Duration::from_millis(5)).await;
        let answer = o.unmap(d.backend_region_id).await;
        // A copy, taken the moment the unmap answered.
        (answer, dst.clone())
    };
    let (results, (unmapped, at_unmap)) = futures::join!(puts, unmap);
    // Let any straggler arrive before looking again.
    tokio::time::sleep(Duration::from_millis(200)).await;
    c.unmap(s.backend_region_id).await.unwrap();
    consumer.shutdown().await;
    owner.shutdown().await;
    assert_eq!(unmapped, Ok(()));
    for result in &results {
        assert!(
            matches!(result, Ok(()) | Err(RdmaError::RegionNotFound)),
            "a racing put: {result:?}"
        );
    }
    assert!(dst == at_unmap, "no byte landed after the unmap answered");
    assert_eq!(owner.live_registrations(), 0);
    assert_eq!(consumer.live_registrations(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmap_racing_puts_answers_and_nothing_lands_after_over_tcp() {
    an_unmap_racing_puts_answers_and_nothing_lands_after(Provider::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmap_racing_puts_answers_and_nothing_lands_after_over_shm() {
    an_unmap_racing_puts_answers_and_nothing_lands_after(Provider::Shm).await;
}
