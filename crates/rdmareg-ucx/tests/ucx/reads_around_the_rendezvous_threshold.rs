//! Owner-served reads from 256 KiB to just past UCX's own rendezvous
//! threshold for a reply over tcp (273 738 bytes with 64 KiB segments:
//! below it a read goes in pieces of one fragment each, above it the reply
//! is a rendezvous into the destination), many in flight at once and
//! raced against the owner's unmap. An `Ok` read holds exactly its source's
//! bytes at its offset and nothing around it; an error answer means UCX let
//! go of the destination (each read's buffer is overwritten the moment its
//! error answers and must stay so); an unmap that confirmed means no later
//! reply carries the region's bytes; nothing stays registered.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::RdmaError;
use rdmareg_ucx::{Transport, UcxEngine};

const KIB: u64 = 1024;
/// Lengths from 256 KiB to just past UCX's own threshold over tcp
/// (273 738 bytes is the largest eager reply UCX 1.22 sends there).
const LENGTHS: [u64; 7] = [
    256 * KIB - 1,
    256 * KIB,
    256 * KIB + 1,
    260 * KIB + 3,
    267 * KIB,
    273_738,
    273_739,
];
/// The longest read asked in pieces over tcp (see `progress::chunks`).
const PIECED_UP_TO: u64 = 273_738;
/// Where in its own buffer each read lands: odd, with room on both sides.
const DEST_OFFSET: u64 = 4096 + 13;
/// Long enough for any straggling fragment of a quarter-MiB transfer.
const WATCH: Duration = Duration::from_millis(300);
/// The byte a buffer is overwritten with once its read answered an error.
const SCRIBBLE: u8 = 0xEE;

fn served_transports() -> [Transport; 3] {
    [
        Transport::Tcp,
        Transport::SameHost,
        Transport::SharedMemoryNoErrorHandling,
    ]
}

/// One read in flight: its own destination buffer, the source range it
/// reads, and its task. The task overwrites the buffer with [`SCRIBBLE`]
/// the moment its read answers an error: the buffer is the caller's then.
struct Flight {
    dst: Arc<PageBuf>,
    dst_id: u64,
    src_offset: u64,
    len: u64,
    task: tokio::task::JoinHandle<Result<(), RdmaError>>,
}

/// Maps a destination for each of `count` reads of the source `whole`
/// (lengths cycling through [`LENGTHS`], odd source offsets), then posts
/// them all at once, each from its own task.
async fn launch(
    consumer: &UcxEngine,
    whole: &rdmareg_core::Descriptor,
    count: usize,
    deadline: Option<Duration>,
) -> Vec<Flight> {
    let cb = consumer.backend();
    let mut prepared = Vec::new();
    for i in 0..count {
        let len = LENGTHS[i % LENGTHS.len()];
        let src_offset = 7 + 4093 * (i as u64 % 11);
        let dst = Arc::new(PageBuf::zeroed((DEST_OFFSET + len) as usize + 4096));
        let dst_region = map(&cb, &dst).await;
        let source = whole.slice(src_offset, len).expect("inside the source");
        let request = get_request(OWNER, &source, &dst_region, DEST_OFFSET, deadline);
        prepared.push((dst, dst_region.backend_region_id, src_offset, len, request));
    }
    prepared
        .into_iter()
        .map(|(dst, dst_id, src_offset, len, request)| {
            let (cb, buf) = (cb.clone(), dst.clone());
            let task = tokio::spawn(async move {
                let outcome = cb.get_into_test_memory(request).await;
                if outcome.is_err() {
                    buf.fill(SCRIBBLE);
                }
                outcome
            });
            Flight {
                dst,
                dst_id,
                src_offset,
                len,
                task,
            }
        })
        .collect()
}

/// What a raced round saw.
#[derive(Debug, Default)]
struct Tally {
    ok: usize,
    errors: Vec<RdmaError>,
}

/// Waits for every read of `flights`, checks each `Ok` read landed exactly
/// its source bytes (`want` is the source's content) at its offset and
/// nothing around them, then waits [`WATCH`] and checks no buffer of an
/// error answer changed after it was overwritten.
async fn settle(
    flights: Vec<Flight>,
    want: &[u8],
    what: &str,
) -> (Tally, Vec<(Arc<PageBuf>, u64)>) {
    let mut tally = Tally::default();
    let mut failed = Vec::new();
    let mut buffers = Vec::new();
    for flight in flights {
        let outcome = flight.task.await.expect("a read task");
        let len = flight.len as usize;
        match outcome {
            Ok(()) => {
                tally.ok += 1;
                let landed = flight.dst.snapshot();
                let (from, to) = (DEST_OFFSET as usize, DEST_OFFSET as usize + len);
                let source = &want[flight.src_offset as usize..flight.src_offset as usize + len];
                assert!(
                    landed[..from].iter().all(|&b| b == 0),
                    "{what}: an Ok read of {len} B wrote before its offset"
                );
                assert!(
                    landed[to..].iter().all(|&b| b == 0),
                    "{what}: an Ok read of {len} B wrote past its end"
                );
                let wrong = differing_bytes(&landed[from..to], source);
                assert_eq!(
                    wrong, 0,
                    "{what}: an Ok read of {len} B has {wrong} bytes not its source's"
                );
            }
            Err(error) => {
                tally.errors.push(error);
                failed.push((flight.dst.clone(), flight.len));
            }
        }
        buffers.push((flight.dst, flight.dst_id));
    }
    if !failed.is_empty() {
        tokio::time::sleep(WATCH).await;
    }
    for (dst, len) in failed {
        let changed = dst.snapshot().iter().filter(|&&b| b != SCRIBBLE).count();
        assert_eq!(
            changed, 0,
            "{what}: {changed} bytes written into a {len} B read's buffer after its error answer"
        );
    }
    (tally, buffers)
}

/// Source buffer of the owner: the pattern, room for every read.
fn source() -> PageBuf {
    PageBuf::filled(1024 * 1024, pattern)
}

/// Reads from 256 KiB to just past UCX's own threshold, all in flight at
/// once on one connection (each into its own buffer at an odd offset, from
/// odd source offsets), land exactly their
/// bytes and nothing around them; afterwards the owner has no reply in
/// flight, and every unmap on both sides confirms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_reads_around_the_threshold_land_exactly_and_release_everything() {
    for transport in served_transports() {
        let (owner, consumer) = served_engines(transport.clone());
        let (ob, cb) = (owner.backend(), consumer.backend());
        let src = source();
        let want = src.snapshot();
        let src_region = map(&ob, &src).await;
        let whole = describe(&src, &src_region);
        for round in 0..3 {
            let flights = launch(&consumer, &whole, 3 * LENGTHS.len(), None).await;
            let what = format!("round {round} over {transport:?}");
            let (tally, buffers) = settle(flights, &want, &what).await;
            assert!(tally.errors.is_empty(), "{what}: {:?}", tally.errors);
            for (_, id) in &buffers {
                assert_eq!(cb.unmap(*id).await, Ok(()), "{what}");
            }
            assert_eq!(consumer.live_registrations(), Some(0), "{what}");
        }
        // The owner learns its last sends completed on its next progress
        // turn, which a loaded machine may delay a little.
        let deadline = Instant::now() + Duration::from_secs(5);
        while owner.served_replies_in_flight() != 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(owner.served_replies_in_flight(), 0, "{transport:?}");
        assert_eq!(ob.unmap(src_region.backend_region_id).await, Ok(()));
        assert_eq!(owner.live_registrations(), Some(0), "{transport:?}");
        consumer.shutdown().await;
        owner.shutdown().await;
    }
}

/// An owner unmaps its source while consumers stream reads of this size
/// from it, and overwrites it (with zeros, which the pattern never holds)
/// the moment the unmap confirms. An `Ok` read carries only the source's
/// pattern — no reply read the region after its unmap confirmed — every
/// read posted after the unmap confirmed is refused, and the owner has no
/// reply left in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owners_unmap_confirms_only_after_its_replies_around_the_threshold_finished() {
    init_tracing();
    for transport in [Transport::Tcp, Transport::SameHost] {
        let until = Instant::now() + Duration::from_millis(2500);
        let (mut served_total, mut refused_total, mut rounds) = (0usize, 0usize, 0usize);
        for delay_us in [0u64, 200, 500, 1000, 2000, 4000].iter().cycle() {
            let (owner, consumer) = served_engines(transport.clone());
            let (ob, cb) = (owner.backend(), consumer.backend());
            let src = Arc::new(source());
            let want = Arc::new(src.snapshot());
            let src_region = map(&ob, &src).await;
            let whole = describe(&src, &src_region);
            let unmapped = Arc::new(AtomicBool::new(false));
            let mut readers = Vec::new();
            for reader in 0..3usize {
                let len = LENGTHS[(reader * 2 + rounds) % LENGTHS.len()];
                let src_offset = 7 + 4093 * reader as u64;
                let dst = Arc::new(PageBuf::zeroed((DEST_OFFSET + len) as usize + 4096));
                let dst_region = map(&cb, &dst).await;
                let source = whole.slice(src_offset, len).expect("inside the source");
                let request = get_request(OWNER, &source, &dst_region, DEST_OFFSET, None);
                let warm = cb.get_into_test_memory(request.clone()).await;
                assert_eq!(warm, Ok(()), "warm-up over {transport:?}");
                let (cb, unmapped, want) = (cb.clone(), unmapped.clone(), want.clone());
                let transport = transport.clone();
                readers.push(tokio::spawn(async move {
                    let (mut served, mut refused) = (0usize, 0usize);
                    loop {
                        let last = unmapped.load(Ordering::Acquire);
                        dst.fill(0);
                        let outcome = cb.get_into_test_memory(request.clone()).await;
                        let landed = dst.snapshot();
                        let (from, to) = (DEST_OFFSET as usize, (DEST_OFFSET + len) as usize);
                        match outcome {
                            Ok(()) => {
                                let expected =
                                    &want[src_offset as usize..src_offset as usize + len as usize];
                                let wrong = differing_bytes(&landed[from..to], expected);
                                assert_eq!(
                                    wrong, 0,
                                    "an Ok read of {len} B carries {wrong} bytes written after the unmap"
                                );
                                assert!(!last, "a {len} B read served after the unmap confirmed");
                                served += 1;
                            }
                            Err(RdmaError::RegionNotFound) => {
                                // Over tcp a read up to 273 738 B goes in
                                // pieces: those the owner served before the
                                // unmap may have landed, and only those
                                // bytes, read while the region was leased.
                                let expected =
                                    &want[src_offset as usize..src_offset as usize + len as usize];
                                let pieced = matches!(transport, Transport::Tcp)
                                    && len <= PIECED_UP_TO;
                                let foreign = landed[from..to]
                                    .iter()
                                    .zip(expected)
                                    .filter(|&(&a, &b)| a != 0 && !(pieced && a == b))
                                    .count();
                                assert_eq!(
                                    foreign, 0,
                                    "a refused {len} B read wrote {foreign} bytes it may not have"
                                );
                                refused += 1;
                            }
                            Err(other) => panic!("a {len} B read: unexpected {other:?}"),
                        }
                        assert!(
                            landed[..from].iter().chain(&landed[to..]).all(|&b| b == 0),
                            "a {len} B read wrote outside its range"
                        );
                        if last {
                            return (served, refused, dst, dst_region.backend_region_id);
                        }
                    }
                }));
            }
            tokio::time::sleep(Duration::from_micros(*delay_us)).await;
            assert_eq!(ob.unmap(src_region.backend_region_id).await, Ok(()));
            // The region is the owner's again: overwrite it at once.
            src.fill(0);
            unmapped.store(true, Ordering::Release);
            let mut buffers = Vec::new();
            for reader in readers {
                let (served, refused, dst, id) = reader.await.expect("a reader task");
                served_total += served;
                refused_total += refused;
                buffers.push((dst, id));
            }
            assert_eq!(owner.served_replies_in_flight(), 0, "{transport:?}");
            assert_eq!(owner.live_registrations(), Some(0), "{transport:?}");
            for (_, id) in &buffers {
                assert_eq!(cb.unmap(*id).await, Ok(()), "{transport:?}");
            }
            assert_eq!(consumer.live_registrations(), Some(0), "{transport:?}");
            consumer.shutdown().await;
            owner.shutdown().await;
            drop((buffers, src));
            rounds += 1;
            if Instant::now() > until {
                break;
            }
        }
        tracing::info!(
            ?transport,
            rounds,
            served_total,
            refused_total,
            "unmap races"
        );
        assert!(
            served_total > 0 && refused_total >= 3 * rounds,
            "{transport:?}: served {served_total}, refused {refused_total} in {rounds} rounds"
        );
    }
}
