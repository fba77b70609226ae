//! Owner-served reads asked in pieces: over an endpoint whose every lane is
//! tcp, a read longer than one reply fragment and no longer than UCX's
//! largest eager reply goes as several reads that each come back in one
//! fragment. The caller sees one read: it lands exactly its bytes, nothing
//! around them, answers once, and answers the error of any piece that
//! failed. Lanes where UCX receives large replies by rendezvous are never
//! split.

use crate::common;

use std::time::Duration;

use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, RdmaError};
use rdmareg_ucx::{Transport, UcxEngine};

/// One fragment's worth of reply over tcp with 64 KiB segments, and the
/// largest reply UCX 1.22 sends eager there (see `progress::chunks`).
const ONE_FRAGMENT: u64 = 65_520;
const LARGEST_SPLIT: u64 = 273_738;
/// Where each read lands in its destination: odd, with guard bytes on both
/// sides.
const DEST_OFFSET: u64 = 4096 + 7;
/// Where each read starts in its source: odd too.
const SRC_OFFSET: u64 = 333;
const SOURCE_LEN: usize = 512 * 1024;

/// Reads `len` bytes of `src` at [`SRC_OFFSET`] into a fresh destination at
/// [`DEST_OFFSET`] and checks they landed exactly there and nowhere else.
async fn read_and_check(
    owner: &UcxEngine,
    consumer: &UcxEngine,
    src: &PageBuf,
    len: u64,
    what: &str,
) {
    let (ob, cb) = (owner.backend(), consumer.backend());
    let src_region = map(&ob, src).await;
    let dst = PageBuf::zeroed(len as usize + 2 * DEST_OFFSET as usize);
    let dst_region = map(&cb, &dst).await;
    let source = describe(src, &src_region);
    let request = BackendGet {
        remote_addr: source.addr() + SRC_OFFSET,
        len,
        ..get_request(OWNER, &source, &dst_region, DEST_OFFSET, None)
    };
    assert_eq!(cb.get_into_test_memory(request).await, Ok(()), "{what}");
    let landed = dst.snapshot();
    let (start, end) = (DEST_OFFSET as usize, (DEST_OFFSET + len) as usize);
    assert!(
        landed[start..end]
            == src.snapshot()[SRC_OFFSET as usize..SRC_OFFSET as usize + len as usize],
        "{what}: the bytes landed exactly"
    );
    assert!(
        landed[..start]
            .iter()
            .chain(&landed[end..])
            .all(|&b| b == 0),
        "{what}: nothing around the range was touched"
    );
    cb.unmap(dst_region.backend_region_id)
        .await
        .expect("unmap destination");
    ob.unmap(src_region.backend_region_id)
        .await
        .expect("unmap source");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_reads_between_one_fragment_and_the_rendezvous_threshold_go_in_pieces_and_land_exactly()
{
    let (owner, consumer) = engines(Transport::Tcp);
    let src = PageBuf::filled(SOURCE_LEN, pattern);
    let cases = [
        (4096, false),
        (ONE_FRAGMENT, false),
        (ONE_FRAGMENT + 1, true),
        (64 * 1024, true),
        (100_003, true),
        (128 * 1024, true),
        (256 * 1024, true),
        (LARGEST_SPLIT, true),
        (LARGEST_SPLIT + 1, false),
        (400 * 1024, false),
    ];
    for (len, split) in cases {
        let before = consumer.reads_asked_in_chunks();
        read_and_check(&owner, &consumer, &src, len, &format!("{len} bytes")).await;
        assert_eq!(
            consumer.reads_asked_in_chunks() - before,
            u64::from(split),
            "{len} bytes: asked in pieces? expected {split}"
        );
    }
    consumer.shutdown().await;
    owner.shutdown().await;
    assert_eq!(consumer.live_registrations(), Some(0));
    assert_eq!(owner.live_registrations(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_through_the_owner_on_lanes_with_a_zero_copy_rendezvous_are_never_split() {
    for transport in [Transport::SameHost, Transport::SharedMemoryNoErrorHandling] {
        let (owner, consumer) = served_engines(transport.clone());
        let src = PageBuf::filled(SOURCE_LEN, pattern);
        for len in [ONE_FRAGMENT + 1, 128 * 1024, 256 * 1024] {
            read_and_check(
                &owner,
                &consumer,
                &src,
                len,
                &format!("{transport:?}, {len} bytes"),
            )
            .await;
        }
        assert_eq!(consumer.reads_asked_in_chunks(), 0, "{transport:?}");
        consumer.shutdown().await;
        owner.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_whose_last_pieces_run_past_the_registration_answers_out_of_range() {
    let (owner, consumer) = engines(Transport::Tcp);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let src = PageBuf::filled(SOURCE_LEN, pattern);
    let src_region = map(&ob, &src).await;
    let source = describe(&src, &src_region);
    let len = 256 * 1024;
    let dst = PageBuf::zeroed(len as usize);
    let dst_region = map(&cb, &dst).await;
    // The first pieces are inside the registration, the last ones past it:
    // the owner serves some and refuses the rest.
    let request = BackendGet {
        remote_addr: source.addr() + SOURCE_LEN as u64 - 100 * 1024,
        len,
        ..get_request(OWNER, &source, &dst_region, 0, None)
    };
    assert_eq!(
        cb.get_into_test_memory(request).await,
        Err(RdmaError::OutOfRange)
    );
    assert_eq!(consumer.reads_asked_in_chunks(), 1);
    // Every piece answered before the read did: nothing lands later.
    dst.fill(0xEE);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        dst.snapshot().iter().all(|&b| b == 0xEE),
        "nothing landed after the answer"
    );
    // The owner still serves in-range reads of the same registration.
    let whole = get_request(OWNER, &source, &dst_region, 0, None);
    let whole = BackendGet { len, ..whole };
    assert_eq!(cb.get_into_test_memory(whole).await, Ok(()));
    assert!(dst.snapshot() == src.snapshot()[..len as usize]);
    consumer.shutdown().await;
    owner.shutdown().await;
    assert_eq!(consumer.live_registrations(), Some(0));
    assert_eq!(owner.live_registrations(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_answers_each_read_in_pieces_as_one_entry() {
    let (owner, consumer) = engines(Transport::Tcp);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let src = PageBuf::filled(SOURCE_LEN, pattern);
    let src_region = map(&ob, &src).await;
    let source = describe(&src, &src_region);
    // Entries of 256 KiB, 4 KiB and 100 003 bytes, the middle one out of
    // range, back to back in one destination.
    let lengths = [256 * 1024u64, 4096, 100_003];
    let dst = PageBuf::zeroed(lengths.iter().sum::<u64>() as usize);
    let dst_region = map(&cb, &dst).await;
    let mut requests = Vec::new();
    let mut dest_offset = 0;
    for (index, &len) in lengths.iter().enumerate() {
        let remote_addr = if index == 1 {
            source.addr() + SOURCE_LEN as u64 // past the end
        } else {
            source.addr() + dest_offset
        };
        requests.push(BackendGet {
            remote_addr,
            len,
            ..get_request(OWNER, &source, &dst_region, dest_offset, None)
        });
        dest_offset += len;
    }
    let answers = cb.get_batch_into_test_memory(requests).await;
    assert_eq!(answers, vec![Ok(()), Err(RdmaError::OutOfRange), Ok(())]);
    assert_eq!(consumer.reads_asked_in_chunks(), 2);
    let landed = dst.snapshot();
    let source_bytes = src.snapshot();
    let first = lengths[0] as usize;
    let third = first + lengths[1] as usize;
    assert!(
        landed[..first] == source_bytes[..first],
        "first entry exact"
    );
    assert!(
        landed[third..] == source_bytes[third..third + lengths[2] as usize],
        "third entry exact"
    );
    assert!(
        landed[first..third].iter().all(|&b| b == 0),
        "the refused entry wrote nothing"
    );
    consumer.shutdown().await;
    owner.shutdown().await;
    assert_eq!(consumer.live_registrations(), Some(0));
    assert_eq!(owner.live_registrations(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deep_batch_splits_only_the_reads_posted_while_fewer_than_1024_are_in_flight() {
    // 400 reads of 200 000 bytes, four pieces each if all were split: 1600
    // replies against an owner that allows 1300 unfinished ones per
    // connection. Only the reads posted while fewer than 1024 are in flight
    // go in pieces, so at most about 1024 + 144 replies are ever asked for,
    // and every read is served.
    const READS: usize = 400;
    const LEN: usize = 200_000;
    let (owner, consumer) =
        engines_with(config(Transport::Tcp).with_max_served_replies_per_connection(1300));
    let (ob, cb) = (owner.backend(), consumer.backend());
    let src = PageBuf::filled(LEN, pattern);
    let src_region = map(&ob, &src).await;
    let source = describe(&src, &src_region);
    let dst = PageBuf::zeroed(READS * LEN);
    let dst_region = map(&cb, &dst).await;
    let requests = (0..READS)
        .map(|read| get_request(OWNER, &source, &dst_region, (read * LEN) as u64, None))
        .collect();
    let answers = cb.get_batch_into_test_memory(requests).await;
    let failed: Vec<_> = answers.iter().filter(|answer| answer.is_err()).collect();
    assert!(
        failed.is_empty(),
        "{} reads failed: {:?}",
        failed.len(),
        failed.first()
    );
    let split = consumer.reads_asked_in_chunks();
    assert!(
        split > 0 && split < READS as u64,
        "the first reads go in pieces, the rest whole: {split} of {READS} split"
    );
    let landed = dst.snapshot();
    let want = src.snapshot();
    for (read, chunk) in landed.chunks(LEN).enumerate() {
        assert!(chunk == &want[..], "read {read} landed exactly");
    }
    consumer.shutdown().await;
    owner.shutdown().await;
    assert_eq!(consumer.live_registrations(), Some(0));
    assert_eq!(owner.live_registrations(), Some(0));
}

/// Largest read a list gathers whole (`read_list::MAX_GATHERED_ENTRY`).
const GATHERED_BOUND: u64 = 16 * 1024;

/// Reads every length of `lengths` in one batch, each from its own odd
/// offset of `src` into its own range of one destination with guard bytes
/// between the ranges; checks each landed exactly and nothing else was
/// touched, and returns how many reads the consumer asked in pieces.
async fn list_and_check(
    owner: &UcxEngine,
    consumer: &UcxEngine,
    src: &PageBuf,
    lengths: &[u64],
    what: &str,
) -> u64 {
    let (ob, cb) = (owner.backend(), consumer.backend());
    let src_region = map(&ob, src).await;
    let source = describe(src, &src_region);
    let guard = DEST_OFFSET;
    let mut places = Vec::new(); // (source offset, destination offset, length)
    let mut dest_offset = guard;
    for (index, &len) in lengths.iter().enumerate() {
        let src_offset = SRC_OFFSET + 977 * index as u64;
        assert!(
            src_offset + len <= src.len() as u64,
            "{what}: the source holds read {index}"
        );
        places.push((src_offset, dest_offset, len));
        dest_offset += len + guard;
    }
    let dst = PageBuf::zeroed(dest_offset as usize);
    let dst_region = map(&cb, &dst).await;
    let requests = places
        .iter()
        .map(|&(src_offset, dest_offset, len)| BackendGet {
            remote_addr: source.addr() + src_offset,
            len,
            ..get_request(OWNER, &source, &dst_region, dest_offset, None)
        })
        .collect();
    let before = consumer.reads_asked_in_chunks();
    let answers = cb.get_batch_into_test_memory(requests).await;
    let split = consumer.reads_asked_in_chunks() - before;
    assert_eq!(answers, vec![Ok(()); lengths.len()], "{what}");
    let landed = dst.snapshot();
    let want = src.snapshot();
    let mut untouched = 0..0;
    for &(src_offset, dest_offset, len) in &places {
        let (src_offset, dest_offset, len) =
            (src_offset as usize, dest_offset as usize, len as usize);
        untouched.end = dest_offset;
        assert!(
            landed[untouched.clone()].iter().all(|&b| b == 0),
            "{what}: the guard before the {len}-byte read is untouched"
        );
        assert!(
            landed[dest_offset..dest_offset + len] == want[src_offset..src_offset + len],
            "{what}: the {len}-byte read landed exactly"
        );
        untouched = dest_offset + len..dest_offset + len;
    }
    assert!(
        landed[untouched.start..].iter().all(|&b| b == 0),
        "{what}: the last guard is untouched"
    );
    cb.unmap(dst_region.backend_region_id)
        .await
        .expect("unmap destination");
    ob.unmap(src_region.backend_region_id)
        .await
        .expect("unmap source");
    split
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_list_reads_of_up_to_twice_the_gathered_bound_go_in_gathered_pieces() {
    let (owner, consumer) = engines(Transport::Tcp);
    let src = PageBuf::filled(SOURCE_LEN, pattern);
    // (length, asked in pieces?) in one list.
    let cases = [
        (4096, false),
        (GATHERED_BOUND, false),
        (GATHERED_BOUND + 1, true),
        (20 * 1024 + 3, true),
        (2 * GATHERED_BOUND, true),
        (2 * GATHERED_BOUND + 1, false),
        (60 * 1024, false),
        (ONE_FRAGMENT, false),
        (ONE_FRAGMENT + 1, true),
        (LARGEST_SPLIT + 1, false),
        (7, false),
    ];
    let lengths: Vec<u64> = cases.iter().map(|&(len, _)| len).collect();
    let expected = cases.iter().filter(|&&(_, split)| split).count() as u64;
    let split = list_and_check(&owner, &consumer, &src, &lengths, "mixed list").await;
    assert_eq!(split, expected, "reads of the list asked in pieces");
    // A list of equal 32 KiB reads, as a list of KV blocks would be.
    let blocks = vec![32 * 1024; 12];
    let split = list_and_check(&owner, &consumer, &src, &blocks, "32 KiB blocks").await;
    assert_eq!(split, 12, "every 32 KiB read of the list asked in pieces");
    // The same length alone goes whole.
    let before = consumer.reads_asked_in_chunks();
    read_and_check(&owner, &consumer, &src, 32 * 1024, "a lone 32 KiB read").await;
    assert_eq!(
        consumer.reads_asked_in_chunks(),
        before,
        "a lone read goes whole"
    );
    common::scene::shut_down_clean(owner, consumer, "gathered pieces").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_reads_through_the_owner_on_lanes_with_a_zero_copy_rendezvous_are_never_split() {
    for transport in [Transport::SameHost, Transport::SharedMemoryNoErrorHandling] {
        let (owner, consumer) = served_engines(transport.clone());
        let src = PageBuf::filled(SOURCE_LEN, pattern);
        let lengths = [GATHERED_BOUND + 1, 32 * 1024, ONE_FRAGMENT, 128 * 1024];
        let split =
            list_and_check(&owner, &consumer, &src, &lengths, &format!("{transport:?}")).await;
        assert_eq!(split, 0, "{transport:?}");
        consumer.shutdown().await;
        owner.shutdown().await;
    }
}
