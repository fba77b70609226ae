//! Attacks on PUTs cut into 60 KiB chunks over tcp (a PUT of more than
//! 256 KiB and at most 4 MiB, while the writer has fewer than 1024 writes
//! in flight; docs/operations.md, "Chunked writes over tcp").
//!
//! What they hold the writer to: a chunked PUT answers once, `Ok` only
//! when every chunk was acknowledged with its exact length; a failed PUT's
//! target holds, 60 KiB chunk by chunk, its earlier bytes or the new ones;
//! its source's unmap waits for every chunk; past the in-flight bound PUTs
//! go in 1 MiB chunks and still land exactly. (The chunks' shapes as a
//! raw owner sees them: `write_chunks.rs`.)

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::raw_am::Raw;
use common::raw_put::{RAW_TARGET, RawPut, raw_owner_key};
use common::write_lists::*;
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{Access, BackendPut, RdmaError};
use rdmareg_engine::served::{Refusal, wire};
use rdmareg_ucx::read_protocol::{BUSY_TEXT, WRITE_REQUEST_AM_ID};
use rdmareg_ucx::{Transport, UcxBackend, UcxEngine};

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;
/// The chunk a PUT of 256 KiB to 4 MiB is cut in over tcp.
const CHUNK: usize = 60 * KIB;
/// A page, to keep guard bytes around targets.
const PAGE: usize = 4096;

/// Each `CHUNK`-sized piece of `got` (from the PUT's first byte) holds
/// only `old` or exactly `new`'s bytes at its place.
fn old_or_new_by_chunk(got: &[u8], new: &[u8], old: u8) -> Result<(), String> {
    for (index, (got, new)) in got.chunks(CHUNK).zip(new.chunks(CHUNK)).enumerate() {
        if got.iter().all(|&b| b == old) || got == new {
            continue;
        }
        return Err(format!(
            "chunk {index} (bytes {}..{}) holds neither its old bytes nor the new ones: {:?}",
            index * CHUNK,
            index * CHUNK + got.len(),
            differences(got, new)
        ));
    }
    Ok(())
}

/// A writer over tcp with a PUT of `len` bytes, due in `deadline`, in
/// flight to a raw owner that has received every chunk and answered none.
fn chunked_put_to_a_raw_owner(len: usize, deadline: Duration) -> RawPut {
    let put = RawPut::start(config(Transport::Tcp), len, Some(deadline));
    assert_eq!(
        put.received.len(),
        len.div_ceil(CHUNK),
        "the PUT went in chunks"
    );
    put
}

/// A raw owner answers a 1 MiB PUT's eighteen chunks in several wrong
/// ways: one chunk never acknowledged, one acknowledged twice in place of
/// another, one acknowledged one byte short, one refused (`RegionNotFound`
/// or busy), one acknowledged with a payload, each wrong answer followed
/// by honest ones. The PUT answers once and never `Ok` (the
/// missing acknowledgement by its deadline), and its source's unmap then
/// returns. Acknowledging every chunk in reverse order answers `Ok`.
#[test]
fn a_put_is_ok_only_once_every_chunk_is_acknowledged() {
    /// How the raw owner answers chunk `i` of `n`.
    #[derive(Debug, Clone, Copy)]
    enum Script {
        AllButLast,
        TwiceInPlaceOfAnother,
        OneByteShort,
        Refused,
        RefusedBusy,
        WithPayload,
        ReverseOrder,
    }
    for script in [
        Script::AllButLast,
        Script::TwiceInPlaceOfAnother,
        Script::OneByteShort,
        Script::Refused,
        Script::RefusedBusy,
        Script::WithPayload,
        Script::ReverseOrder,
    ] {
        let mut scene = chunked_put_to_a_raw_owner(MIB, Duration::from_millis(400));
        let n = scene.received.len();
        match script {
            Script::AllButLast => (0..n - 1).for_each(|i| scene.acknowledge(i)),
            // Every wrong answer comes in its chunk's place, with
            // honest ones after it.
            Script::TwiceInPlaceOfAnother => (0..n).for_each(|i| match i {
                6 => scene.acknowledge(5),
                i => scene.acknowledge(i),
            }),
            Script::OneByteShort => (0..n).for_each(|i| match i {
                3 => scene.reply(3, 0, CHUNK as u64 - 1, &[]),
                i => scene.acknowledge(i),
            }),
            Script::Refused => (0..n).for_each(|i| match i {
                9 => scene.reply(9, wire::refusal_code(Refusal::RegionUnknown), 0, &[]),
                i => scene.acknowledge(i),
            }),
            Script::RefusedBusy => (0..n).for_each(|i| match i {
                0 => scene.reply(0, wire::refusal_code(Refusal::Busy), 0, &[]),
                i => scene.acknowledge(i),
            }),
            Script::WithPayload => (0..n).for_each(|i| match i {
                2 => scene.reply(2, 0, CHUNK as u64, &[7; 16]),
                i => scene.acknowledge(i),
            }),
            Script::ReverseOrder => (0..n).rev().for_each(|i| scene.acknowledge(i)),
        }
        let answers = scene.answers();
        assert_eq!(answers.len(), 1, "{script:?}: one answer");
        let answer = &answers[0];
        match script {
            Script::AllButLast | Script::TwiceInPlaceOfAnother => {
                assert_eq!(answer, &Err(RdmaError::Timeout), "{script:?}")
            }
            Script::Refused => assert_eq!(answer, &Err(RdmaError::RegionNotFound), "{script:?}"),
            Script::RefusedBusy => assert!(
                matches!(answer, Err(RdmaError::Backend(text)) if *text == BUSY_TEXT),
                "{script:?}: {answer:?}"
            ),
            Script::OneByteShort | Script::WithPayload => assert!(
                matches!(answer, Err(RdmaError::Backend(_))),
                "{script:?}: {answer:?}"
            ),
            Script::ReverseOrder => assert_eq!(answer, &Ok(()), "{script:?}"),
        }
        // Late and repeated acknowledgements change nothing.
        (0..n).for_each(|i| scene.acknowledge(i));
        scene.raw.progress_for(Duration::from_millis(20));
        scene.finish();
    }
}

/// A 1 MiB PUT to a raw owner that acknowledges all its chunks but the
/// last: the unmap of the PUT's source does not return while that chunk
/// is unanswered, and returns `Ok` once it is acknowledged and the PUT
/// answered `Ok`.
#[test]
fn the_source_unmap_waits_for_the_last_chunk() {
    let mut scene = chunked_put_to_a_raw_owner(MIB, Duration::from_secs(10));
    let n = scene.received.len();
    (0..n - 1).for_each(|i| scene.acknowledge(i));
    let unmap = scene.rt.spawn({
        let backend = Arc::clone(&scene.backend);
        let region = scene.src_region.backend_region_id;
        async move { backend.unmap(region).await }
    });
    scene.raw.progress_for(Duration::from_millis(100));
    assert!(
        !unmap.is_finished(),
        "the source's unmap returned while a chunk of the PUT was in flight: {:?}",
        scene.rt.block_on(unmap)
    );
    scene.acknowledge(n - 1);
    assert_eq!(scene.answers(), [Ok(())]);
    let start = Instant::now();
    while !unmap.is_finished() && start.elapsed() < Duration::from_secs(5) {
        scene.raw.progress_for(Duration::from_millis(2));
    }
    assert_eq!(
        scene.rt.block_on(unmap).expect("the unmap task"),
        Ok(()),
        "the source's unmap once the PUT answered"
    );
    let RawPut { rt, writer, .. } = scene;
    rt.block_on(writer.shutdown());
    assert_eq!(writer.live_registrations(), Some(0));
}

/// An owner and a writer engine over tcp, the owner's target
/// `[guard][len][guard]` zeroed and registered writable.
struct Pair {
    rt: tokio::runtime::Runtime,
    owner: UcxEngine,
    consumer: UcxEngine,
    ob: Arc<UcxBackend>,
    cb: Arc<UcxBackend>,
}

impl Pair {
    fn new(owner_bound: Option<u32>) -> Pair {
        init_tracing();
        let base = config(Transport::Tcp).with_same_host_direct_reads(false);
        let owner_config = match owner_bound {
            Some(bound) => base.clone().with_max_served_replies_per_connection(bound),
            None => base.clone(),
        };
        let owner = UcxEngine::start(owner_config).expect("owner starts");
        let consumer = UcxEngine::start(base).expect("consumer starts");
        consumer.add_peer(OWNER, owner.worker_address()).unwrap();
        let (ob, cb) = (owner.backend(), consumer.backend());
        Pair {
            rt: runtime(),
            owner,
            consumer,
            ob,
            cb,
        }
    }

    fn shut_down(self) {
        self.rt.block_on(self.consumer.shutdown());
        self.rt.block_on(self.owner.shutdown());
        assert_eq!(self.consumer.live_registrations(), Some(0));
        assert_eq!(self.owner.live_registrations(), Some(0));
    }
}

/// A PUT of `len` bytes of `src` from `src_offset` to `at` bytes into
/// `target`, due in `deadline`.
fn put_into(
    src: &rdmareg_core::BackendRegion,
    src_offset: usize,
    target: &Part,
    at: usize,
    len: usize,
    deadline: Duration,
) -> BackendPut {
    let mut put = put_of(
        OWNER,
        src,
        src_offset,
        target.start + at as u64,
        &target.packed,
        len,
    );
    put.deadline = Some(deadline);
    put
}

/// Chunked PUTs of 1 MiB + 3 and 4 MiB from an engine writer to an engine
/// owner over tcp, due in 1 µs to 5 ms, so that most time out mid-way;
/// the owner takes its log and unmaps the target as soon as the PUT
/// answered, racing chunks still on their way. Each PUT answers `Ok`
/// (every byte in) or `Timeout`; at the unmap each 60 KiB chunk of the
/// target holds the old bytes or the new ones, the log taken at the
/// answer listed only whole chunks that hold the new bytes, no byte
/// changes after the unmap returned, and the source's unmap returns.
/// (A timed-out PUT's chunks already sent may still land after its
/// answer: its target then holds "unspecified bytes of the source or its
/// earlier ones", `RdmaBackend::put`.)
#[test]
fn a_timed_out_chunked_put_leaves_whole_chunks() {
    let pair = Pair::new(None);
    let (mut ok, mut timed_out) = (0, 0);
    for (round, (len, deadline_us)) in [MIB + 3, 4 * MIB]
        .into_iter()
        .flat_map(|len| [1u64, 100, 1000, 5000].map(move |d| (len, d)))
        .enumerate()
    {
        let r = format!("round {round}: {len} B due in {deadline_us} µs");
        let dst = PageBuf::zeroed(len + 2 * PAGE);
        let target = pair
            .rt
            .block_on(map_part(&pair.ob, &dst, PAGE, len, Access::Write));
        // A source unlike any other round's, never zero.
        let src = PageBuf::filled(len + 7, |i| pattern(i + 13 * round));
        let src_region = pair.rt.block_on(map(&pair.cb, &src));
        let put = put_into(
            &src_region,
            7,
            &target,
            0,
            len,
            Duration::from_micros(deadline_us),
        );
        let answer = pair.rt.block_on(put_batch(&pair.cb, vec![put]));
        let at_answer = dst.snapshot();
        let written = pair
            .rt
            .block_on(pair.ob.take_written(target.id))
            .expect("the owner's log");
        assert_eq!(pair.rt.block_on(pair.ob.unmap(target.id)), Ok(()), "{r}");
        let at_unmap = dst.snapshot();
        std::thread::sleep(Duration::from_millis(50));
        let later = dst.snapshot();
        let new = &src.snapshot()[7..7 + len];
        assert_eq!(answer.len(), 1, "{r}");
        match &answer[0] {
            Ok(()) => {
                ok += 1;
                assert_eq!(
                    differences(&at_answer[PAGE..PAGE + len], new),
                    None,
                    "{r}: Ok but not every byte in"
                );
                assert_eq!(
                    written,
                    listed(std::iter::once(0..len as u64)),
                    "{r}: Ok, all listed"
                );
            }
            Err(RdmaError::Timeout) => timed_out += 1,
            Err(other) => panic!("{r}: answered {other}"),
        }
        old_or_new_by_chunk(&at_unmap[PAGE..PAGE + len], new, 0)
            .unwrap_or_else(|e| panic!("{r}: at the unmap, {e}"));
        assert!(!written.incomplete, "{r}");
        for range in &written.ranges {
            let (start, end) = (range.start as usize, range.end as usize);
            assert!(
                start % CHUNK == 0 && (end % CHUNK == 0 || end == len),
                "{r}: listed {range:?}, not whole chunks"
            );
            assert_eq!(
                differences(&at_unmap[PAGE + start..PAGE + end], &new[start..end]),
                None,
                "{r}: listed {range:?} without its new bytes"
            );
        }
        assert!(
            at_unmap[..PAGE]
                .iter()
                .chain(&at_unmap[PAGE + len..])
                .all(|&b| b == 0),
            "{r}: guard bytes changed"
        );
        assert_eq!(
            differences(&later, &at_unmap),
            None,
            "{r} ({:?}): bytes landed after the target's unmap returned",
            answer[0]
        );
        let unmap = pair.cb.unmap(src_region.backend_region_id);
        let unmapped = pair
            .rt
            .block_on(async { tokio::time::timeout(Duration::from_secs(5), unmap).await });
        assert_eq!(unmapped, Ok(Ok(())), "{r}: the source's unmap");
    }
    eprintln!("{ok} PUTs answered Ok, {timed_out} Timeout");
    pair.shut_down();
}

/// An owner allowing a single unfinished reply per connection receives
/// eight concurrent 1 MiB PUTs (eighteen chunks each) over tcp, in
/// several rounds: each PUT answers `Ok` with every byte in, or the busy
/// error, never a timeout or another error, and a refused PUT's 60 KiB
/// chunks each hold the old bytes or the new ones. Some PUTs land: the
/// chunks give their places back.
#[test]
fn a_tight_reply_bound_refuses_chunks_as_busy_only() {
    const PUTS: usize = 8;
    let pair = Pair::new(Some(1));
    let len = MIB;
    let src = PageBuf::filled(PUTS * len, pattern);
    let src_region = pair.rt.block_on(map(&pair.cb, &src));
    let new = src.snapshot();
    let (mut ok, mut busy) = (0, 0);
    for round in 0..4 {
        let dst = PageBuf::zeroed(PUTS * len);
        let target = pair
            .rt
            .block_on(map_part(&pair.ob, &dst, 0, PUTS * len, Access::Write));
        let handles: Vec<_> = (0..PUTS)
            .map(|i| {
                let backend = Arc::clone(&pair.cb);
                let request = put_into(
                    &src_region,
                    i * len,
                    &target,
                    i * len,
                    len,
                    Duration::from_secs(2),
                );
                pair.rt.spawn(async move { put(&backend, request).await })
            })
            .collect();
        let answers: Vec<_> = handles
            .into_iter()
            .map(|h| pair.rt.block_on(h).expect("the put task"))
            .collect();
        std::thread::sleep(Duration::from_millis(50));
        let got = dst.snapshot();
        for (i, answer) in answers.iter().enumerate() {
            let range = i * len..(i + 1) * len;
            let r = format!("round {round}, put {i}");
            match answer {
                Ok(()) => {
                    ok += 1;
                    assert_eq!(
                        differences(&got[range.clone()], &new[range]),
                        None,
                        "{r}: Ok but not every byte in"
                    );
                }
                Err(RdmaError::Backend(text)) if *text == BUSY_TEXT => {
                    busy += 1;
                    old_or_new_by_chunk(&got[range.clone()], &new[range], 0)
                        .unwrap_or_else(|e| panic!("{r}: {e}"));
                }
                Err(other) => panic!("{r}: answered {other}"),
            }
        }
        assert_eq!(pair.rt.block_on(pair.ob.unmap(target.id)), Ok(()));
    }
    eprintln!("{ok} PUTs answered Ok, {busy} busy");
    assert!(ok > 0, "no PUT landed under the bound");
    assert_eq!(
        pair.rt
            .block_on(pair.cb.unmap(src_region.backend_region_id)),
        Ok(())
    );
    pair.shut_down();
}

/// Fifty-nine 1 MiB PUTs posted as one batch to a raw owner that answers
/// nothing until all arrived: the first 57 go in 60 KiB chunks (eighteen
/// each, so the writer then has 1026 writes in flight), every later one
/// in a single 1 MiB write, since a writer cuts only while it has fewer
/// than 1024 writes in flight; each covers its PUT exactly once with its
/// bytes, and the batch answers `Ok` once all are acknowledged.
#[test]
fn past_1024_writes_in_flight_puts_go_whole() {
    const PUTS: usize = 59;
    init_tracing();
    let rt = runtime();
    let writer = UcxEngine::start(config(Transport::Tcp)).expect("writer starts");
    let raw = Raw::new(false);
    writer.add_peer(OWNER, raw.address()).unwrap();
    let backend = writer.backend();
    let src = PageBuf::filled(PUTS * MIB, pattern);
    let src_region = rt.block_on(map(&backend, &src));
    let key = raw_owner_key();
    let puts = (0..PUTS)
        .map(|i| {
            put_of(
                OWNER,
                &src_region,
                i * MIB,
                RAW_TARGET + (i * MIB) as u64,
                &key,
                MIB,
            )
        })
        .collect();
    let batch = rt.spawn({
        let backend = Arc::clone(&backend);
        async move { put_batch(&backend, puts).await }
    });
    let received = |raw: &Raw| {
        raw.messages(WRITE_REQUEST_AM_ID)
            .iter()
            .map(|m| m.data.len())
            .sum::<usize>()
    };
    let all_in = raw.progress_until(Duration::from_secs(20), |raw| received(raw) >= PUTS * MIB);
    raw.progress_for(Duration::from_millis(20));
    assert!(all_in, "the PUTs' bytes did not all reach the raw owner");
    let source = src.snapshot();
    let mut lens: Vec<Vec<usize>> = vec![Vec::new(); PUTS];
    let mut next = vec![0usize; PUTS];
    for m in raw.messages(WRITE_REQUEST_AM_ID).iter() {
        let write = wire::decode_write_request(&m.header).expect("a write request");
        let offset = (write.address - RAW_TARGET) as usize;
        let put = offset / MIB;
        assert_eq!(offset, put * MIB + next[put], "put {put}: chunks in order");
        assert_eq!(write.length as usize, m.data.len());
        assert!(
            m.data[..] == source[offset..offset + m.data.len()],
            "put {put}: the source's bytes at their place"
        );
        next[put] += m.data.len();
        lens[put].push(m.data.len());
    }
    assert!(next.iter().all(|&n| n == MIB), "every PUT covered once");
    for (i, lens) in lens.iter().enumerate() {
        if i < 57 {
            assert_eq!(lens.len(), 18, "put {i} goes in 60 KiB chunks: {lens:?}");
            assert!(lens[..17].iter().all(|&l| l == CHUNK), "put {i}: {lens:?}");
        } else {
            assert_eq!(lens, &[MIB], "put {i}, past 1024 writes in flight");
        }
    }
    acknowledge_all(&raw);
    let start = Instant::now();
    while !batch.is_finished() && start.elapsed() < Duration::from_secs(10) {
        raw.progress_for(Duration::from_millis(2));
    }
    let answers = rt.block_on(batch).expect("the batch task");
    assert!(answers.iter().all(Result::is_ok), "{answers:?}");
    assert_eq!(
        rt.block_on(backend.unmap(src_region.backend_region_id)),
        Ok(())
    );
    rt.block_on(writer.shutdown());
    assert_eq!(writer.live_registrations(), Some(0));
}

/// Sixty 1 MiB PUTs as one batch to a real owner over tcp, so the
/// later ones go whole past 1024 writes in flight, at odd source and
/// target offsets: every PUT answers `Ok`, every byte lands, the guard
/// bytes around the target do not change, and the owner's log lists
/// exactly the target.
#[test]
fn a_batch_past_the_cut_bound_lands_exactly() {
    const PUTS: usize = 60;
    let pair = Pair::new(None);
    let len = PUTS * MIB;
    let src = PageBuf::filled(len + 5, pattern);
    let src_region = pair.rt.block_on(map(&pair.cb, &src));
    let dst = PageBuf::zeroed(len + 2 * PAGE);
    let target = pair
        .rt
        .block_on(map_part(&pair.ob, &dst, PAGE - 3, len + 6, Access::Write));
    let puts = (0..PUTS)
        .map(|i| {
            put_into(
                &src_region,
                5 + i * MIB,
                &target,
                3 + i * MIB,
                MIB,
                DEADLINE,
            )
        })
        .collect();
    let answers = pair.rt.block_on(put_batch(&pair.cb, puts));
    assert!(answers.iter().all(Result::is_ok), "{answers:?}");
    let got = dst.snapshot();
    let new = src.snapshot();
    if got[PAGE..PAGE + len] != new[5..] {
        panic!(
            "not every byte landed: {:?}",
            differences(&got[PAGE..PAGE + len], &new[5..])
        );
    }
    assert!(
        got[..PAGE]
            .iter()
            .chain(&got[PAGE + len..])
            .all(|&b| b == 0),
        "guard bytes changed"
    );
    let written = pair
        .rt
        .block_on(pair.ob.take_written(target.id))
        .expect("the owner's log");
    assert_eq!(written, listed(std::iter::once(3..3 + len as u64)));
    assert_eq!(pair.rt.block_on(pair.ob.unmap(target.id)), Ok(()));
    assert_eq!(
        pair.rt
            .block_on(pair.cb.unmap(src_region.backend_region_id)),
        Ok(())
    );
    pair.shut_down();
}

/// PUTs of lengths around the cut's bounds and its 60 KiB grain (256 KiB
/// and 1, 300 000, 17 x 60 KiB and 1, 1 MiB and 3, 4 MiB less 1, 4 MiB,
/// 4 MiB and 1) from odd source offsets to odd target offsets of a real owner over
/// tcp: each answers `Ok`, lands exactly, touches no byte around it, and
/// the owner's log lists exactly its range.
#[test]
fn chunked_puts_at_odd_offsets_land_exactly() {
    let pair = Pair::new(None);
    let lens = [
        256 * KIB + 1,
        300_000,
        17 * CHUNK + 1,
        MIB + 3,
        4 * MIB - 1,
        4 * MIB,
        4 * MIB + 1,
    ];
    for (round, len) in lens.into_iter().enumerate() {
        let (src_offset, at) = (1 + 2 * round, 4093 - round);
        let src = PageBuf::filled(len + src_offset, |i| pattern(i + round));
        let src_region = pair.rt.block_on(map(&pair.cb, &src));
        let dst = PageBuf::zeroed(len + 3 * PAGE);
        let target = pair
            .rt
            .block_on(map_part(&pair.ob, &dst, PAGE, len + PAGE, Access::Write));
        let put = put_into(&src_region, src_offset, &target, at, len, DEADLINE);
        let answer = pair.rt.block_on(put_batch(&pair.cb, vec![put]));
        assert_eq!(answer, [Ok(())], "{len} B");
        let got = dst.snapshot();
        let start = PAGE + at;
        assert_eq!(
            differences(&got[start..start + len], &src.snapshot()[src_offset..]),
            None,
            "{len} B: landed exactly"
        );
        assert!(
            got[..start]
                .iter()
                .chain(&got[start + len..])
                .all(|&b| b == 0),
            "{len} B: a byte around the PUT changed"
        );
        let written = pair
            .rt
            .block_on(pair.ob.take_written(target.id))
            .expect("the owner's log");
        assert_eq!(
            written,
            listed(std::iter::once(at as u64..(at + len) as u64)),
            "{len} B"
        );
        assert_eq!(pair.rt.block_on(pair.ob.unmap(target.id)), Ok(()));
        assert_eq!(
            pair.rt
                .block_on(pair.cb.unmap(src_region.backend_region_id)),
            Ok(())
        );
    }
    pair.shut_down();
}
