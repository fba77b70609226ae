//! The owner serves every read itself: a registration bounds what a peer can
//! read, an unregistered region is unreadable, and forged, stale,
//! out-of-range or wrong-capability reads get a typed error at the consumer
//! (`OutOfRange`, `RegionNotFound`) while the owner stays untouched — on
//! every transport setting, with the same-host direct-read lane closed (see
//! `same_host_direct_reads.rs` for what that lane does instead).

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::RdmaError;
use rdmareg_ucx::Transport;
use rdmareg_ucx::read_protocol::ServedKey;

const MIB: usize = 1024 * 1024;

fn transports() -> [Transport; 3] {
    [
        Transport::Tcp,
        Transport::SameHost,
        Transport::SharedMemoryNoErrorHandling,
    ]
}

/// `key` with its capability replaced.
fn with_capability(key: &Bytes, capability: [u8; 16]) -> Bytes {
    let mut served = ServedKey::decode(key).expect("an owner-served key");
    served.capability = capability;
    Bytes::copy_from_slice(&served.encode())
}

/// `key` naming another region id.
fn with_region_id(key: &Bytes, region_id: u64) -> Bytes {
    let mut served = ServedKey::decode(key).expect("an owner-served key");
    served.region_id = region_id;
    Bytes::copy_from_slice(&served.encode())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_reads_are_refused_with_a_typed_error_and_the_owner_keeps_serving() {
    for transport in transports() {
        let (owner, consumer) = served_engines(transport.clone());
        let (ob, cb) = (owner.backend(), consumer.backend());
        let src = PageBuf::filled(8192, pattern);
        let secret = PageBuf::filled(4096, |_| 0x5A); // never registered
        let dst = PageBuf::zeroed(8192);
        let src_region = map(&ob, &src).await;
        let dst_region = map(&cb, &dst).await;
        let desc = describe(&src, &src_region);
        let key = src_region.packed_key.clone();

        let refused = |remote_addr: u64, len: u64, packed_key: Bytes| {
            let mut request = get_request(OWNER, &desc, &dst_region, 0, None);
            request.remote_addr = remote_addr;
            request.len = len;
            request.packed_key = packed_key;
            cb.get_into_test_memory(request)
        };
        let cases = [
            (
                "a forged low address",
                refused(0x1000, 64, key.clone()).await,
                RdmaError::OutOfRange,
            ),
            (
                "unregistered memory of the owner",
                refused(secret.addr() as u64, 4096, key.clone()).await,
                RdmaError::OutOfRange,
            ),
            (
                "one byte past the registration",
                refused(src.addr() as u64 + 1, 8192, key.clone()).await,
                RdmaError::OutOfRange,
            ),
            (
                "a guessed capability",
                refused(src.addr() as u64, 8192, with_capability(&key, [0; 16])).await,
                RdmaError::RegionNotFound,
            ),
            (
                "a region id never issued",
                refused(src.addr() as u64, 8192, with_region_id(&key, u64::MAX)).await,
                RdmaError::RegionNotFound,
            ),
        ];
        for (what, outcome, refusal) in cases {
            assert_eq!(outcome, Err(refusal), "{what} over {transport:?}");
        }
        assert!(
            dst.snapshot().iter().all(|&b| b == 0),
            "no refused read wrote a byte over {transport:?}"
        );

        // The owner is untouched and still serves its consumer.
        let request = get_request(OWNER, &desc, &dst_region, 0, None);
        assert_eq!(
            cb.get_into_test_memory(request).await,
            Ok(()),
            "{transport:?}"
        );
        assert_eq!(dst.snapshot(), src.snapshot(), "{transport:?}");
        assert!(secret.snapshot().iter().all(|&b| b == 0x5A));
        consumer.shutdown().await;
        owner.shutdown().await;
        assert_eq!(owner.live_registrations(), Some(0));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_descriptor_outliving_its_registration_reads_nothing() {
    for transport in transports() {
        let (owner, consumer) = served_engines(transport.clone());
        let (ob, cb) = (owner.backend(), consumer.backend());
        let src = PageBuf::filled(4096, pattern);
        let dst = PageBuf::zeroed(4096);
        let first = map(&ob, &src).await;
        let dst_region = map(&cb, &dst).await;
        let stale = describe(&src, &first);
        assert_eq!(ob.unmap(first.backend_region_id).await, Ok(()));

        let request = get_request(OWNER, &stale, &dst_region, 0, None);
        assert_eq!(
            cb.get_into_test_memory(request).await,
            Err(RdmaError::RegionNotFound),
            "an unregistered region is unreadable over {transport:?}"
        );

        // The same memory registered again: the old descriptor still names
        // nothing, the new one reads.
        let second = map(&ob, &src).await;
        let request = get_request(OWNER, &stale, &dst_region, 0, None);
        assert_eq!(
            cb.get_into_test_memory(request).await,
            Err(RdmaError::RegionNotFound),
            "a stale descriptor of re-registered memory over {transport:?}"
        );
        assert!(dst.snapshot().iter().all(|&b| b == 0));
        let request = get_request(OWNER, &describe(&src, &second), &dst_region, 0, None);
        assert_eq!(cb.get_into_test_memory(request).await, Ok(()));
        assert_eq!(dst.snapshot(), src.snapshot());
        consumer.shutdown().await;
        owner.shutdown().await;
    }
}

/// The use-after-free of the emulated GET: an owner that unregisters and
/// frees 64 MiB while a consumer streams it. With UCX's emulation the
/// owner's progress thread kept copying from the freed (unmapped) pages and
/// the process died; now the unmap waits for the reply's lease, so the
/// memory is freed only once UCX stopped reading it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_that_frees_right_after_unregistering_is_never_read_after_free() {
    for transport in [Transport::Tcp, Transport::SameHost] {
        for delay_ms in [0u64, 5, 20] {
            let (owner, consumer) = served_engines(transport.clone());
            let (ob, cb) = (owner.backend(), consumer.backend());
            let src = PageBuf::filled(64 * MIB, pattern);
            let dst = PageBuf::zeroed(64 * MIB);
            let src_region = map(&ob, &src).await;
            let dst_region = map(&cb, &dst).await;
            let request = get_request(OWNER, &describe(&src, &src_region), &dst_region, 0, None);
            let read = tokio::spawn({
                let cb = cb.clone();
                async move { cb.get_into_test_memory(request).await }
            });
            tokio::time::sleep(Duration::from_millis(delay_ms)).await;
            assert_eq!(ob.unmap(src_region.backend_region_id).await, Ok(()));
            // `deregistered()` would resolve now: free at once. A 64 MiB
            // allocation is its own mapping, so a late read faults.
            drop(src);
            let outcome = read.await.expect("the read task");
            match outcome {
                Ok(()) => {
                    let want = PageBuf::filled(64 * MIB, pattern);
                    assert!(dst.snapshot() == want.snapshot(), "a served read is whole");
                }
                Err(RdmaError::RegionNotFound) => {}
                Err(other) => panic!("unexpected outcome over {transport:?}: {other}"),
            }
            consumer.shutdown().await;
            owner.shutdown().await;
            assert_eq!(owner.live_registrations(), Some(0));
        }
    }
}

/// The same for lists: an owner's gathered replies of short ranges are
/// either copied into UCX's send segments (fast completion), their leases
/// ending when UCX has copied the last range, or, over tcp in replies of
/// one fragment of at most fifteen ranges, sent zero-copy from the region,
/// their leases ending when the send completes. An owner that unregisters
/// while such replies are in flight, then overwrites the region and frees
/// it, must never have a served entry carry the overwritten bytes (or
/// fault).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_that_overwrites_and_frees_right_after_unregistering_is_never_read_by_a_gathered_reply()
 {
    const BLOCK: usize = 4096;
    const BLOCKS: usize = 1000;
    const READERS: usize = 3;
    init_tracing();
    let want: Arc<Vec<u8>> = Arc::new((0..2 * BLOCKS * BLOCK).map(pattern).collect());
    for transport in [Transport::Tcp, Transport::SameHost] {
        for delay_us in [0u64, 500, 1000, 2000, 3000] {
            let (owner, consumer) = served_engines(transport.clone());
            let (ob, cb) = (owner.backend(), consumer.backend());
            // Every other block of the source: no two ranges merge.
            let src = PageBuf::filled(2 * BLOCKS * BLOCK, pattern);
            let src_region = map(&ob, &src).await;
            let desc = describe(&src, &src_region);
            let unmapped = Arc::new(AtomicBool::new(false));
            let mut readers = Vec::new();
            for _ in 0..READERS {
                let dst = Arc::new(PageBuf::zeroed(BLOCKS * BLOCK));
                let dst_region = map(&cb, &dst).await;
                let batch: Vec<_> = (0..BLOCKS)
                    .map(|i| {
                        let offset = (i * BLOCK) as u64;
                        let mut request = get_request(OWNER, &desc, &dst_region, offset, None);
                        request.remote_addr = desc.addr() + 2 * offset;
                        request.len = BLOCK as u64;
                        request
                    })
                    .collect();
                // Connected and served once before the race.
                let warm = cb.get_batch_into_test_memory(batch.clone()).await;
                assert!(warm.iter().all(Result::is_ok), "{warm:?}");
                let (cb, unmapped, want) = (cb.clone(), unmapped.clone(), want.clone());
                readers.push(tokio::spawn(async move {
                    let (mut served, mut refused) = (0usize, 0usize);
                    // Until the unmap answered, then one batch more.
                    loop {
                        let last = unmapped.load(Ordering::Acquire);
                        dst.fill(0);
                        let outcomes = cb.get_batch_into_test_memory(batch.clone()).await;
                        let got = dst.snapshot();
                        for (i, outcome) in outcomes.into_iter().enumerate() {
                            let landed = &got[i * BLOCK..(i + 1) * BLOCK];
                            match outcome {
                                Ok(()) => {
                                    let source = &want[2 * i * BLOCK..(2 * i + 1) * BLOCK];
                                    assert!(landed == source, "entry {i} is not its source's");
                                    assert!(!last, "entry {i} served after the unmap answered");
                                    served += 1;
                                }
                                Err(RdmaError::RegionNotFound) => refused += 1,
                                Err(other) => panic!("entry {i}: unexpected {other}"),
                            }
                        }
                        if last {
                            return (served, refused);
                        }
                    }
                }));
            }
            tokio::time::sleep(Duration::from_micros(delay_us)).await;
            assert_eq!(ob.unmap(src_region.backend_region_id).await, Ok(()));
            // `deregistered()` would resolve now: overwrite, then free.
            src.fill(0xEE);
            drop(src);
            unmapped.store(true, Ordering::Release);
            for reader in readers {
                let (served, refused) = reader.await.expect("a reader task");
                tracing::info!(
                    ?transport,
                    delay_us,
                    served,
                    refused,
                    "gathered reads around an unmap"
                );
            }
            consumer.shutdown().await;
            owner.shutdown().await;
            assert_eq!(owner.live_registrations(), Some(0));
        }
    }
}

/// UCX 1.22 sends a served reply of up to 273 738 bytes over tcp (64 KiB
/// segments) as eager fragments that the consumer's UCX reassembles, and a
/// longer one by rendezvous into the destination: reads on both sides of
/// that threshold land exactly their bytes at their offset, and the owner's
/// leases all end (its unmaps confirm at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_on_either_side_of_ucxs_rendezvous_threshold_land_exactly_their_bytes() {
    const KIB: u64 = 1024;
    let lengths = [256 * KIB, 273_738, 273_739, 300 * KIB];
    for transport in transports() {
        let (owner, consumer) = served_engines(transport.clone());
        let (ob, cb) = (owner.backend(), consumer.backend());
        let src = PageBuf::filled(MIB, pattern);
        let src_region = map(&ob, &src).await;
        let whole = describe(&src, &src_region);
        for (round, len) in lengths.into_iter().enumerate() {
            // Odd offsets on both sides, so no length or address is aligned.
            let (src_offset, dest_offset) = (4093 * round as u64 + 7, 13);
            let dst = PageBuf::zeroed(MIB);
            let dst_region = map(&cb, &dst).await;
            let source = whole.slice(src_offset, len).expect("inside the source");
            let request = get_request(OWNER, &source, &dst_region, dest_offset, None);
            assert_eq!(
                cb.get_into_test_memory(request).await,
                Ok(()),
                "{len} B over {transport:?}"
            );
            let landed = dst.snapshot();
            let (from, to) = (dest_offset as usize, (dest_offset + len) as usize);
            assert!(
                landed[..from].iter().all(|&b| b == 0),
                "{len} B over {transport:?}"
            );
            assert!(
                landed[to..].iter().all(|&b| b == 0),
                "{len} B over {transport:?}"
            );
            let expected = &src.snapshot()[src_offset as usize..(src_offset + len) as usize];
            assert!(landed[from..to] == *expected, "{len} B over {transport:?}");
            assert_eq!(cb.unmap(dst_region.backend_region_id).await, Ok(()));
        }
        assert_eq!(ob.unmap(src_region.backend_region_id).await, Ok(()));
        consumer.shutdown().await;
        owner.shutdown().await;
    }
}
