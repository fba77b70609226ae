//! Reads in pieces under attack: over a tcp-only endpoint with UCX's own
//! protocol thresholds an owner-served read of 65 521 to 273 738 bytes goes
//! as up to five pieces, each a read of its own, answered as one. Whatever happens between the pieces —
//! deadlines, cancellation, either side shutting down, the owner unmapping,
//! a range only partly inside the registration, a small per-connection
//! bound, batches — the read's answer comes only once no piece can write
//! any more, an `Ok` read holds exactly its bytes, no byte lands outside the
//! requested range, and nothing stays registered or leased.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::scene::*;
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, Descriptor, RdmaError};
use rdmareg_ucx::{Transport, UcxBackend};

const KIB: u64 = 1024;
/// Read lengths that go in pieces over tcp: the smallest, odd ones, 64 KiB
/// and 256 KiB, and the largest.
const PIECED: [u64; 6] = [65_521, 100_003, 64 * KIB, 131_071, 256 * KIB, 273_738];
/// Guard bytes before and after every destination range.
const GUARD: u64 = 4096 + 7;
/// Long enough for any straggling piece of a quarter-MiB read.
const WATCH: Duration = Duration::from_millis(300);
/// What a buffer is overwritten with once its read answered an error.
const SCRIBBLE: u8 = 0xEE;

/// One read's own destination: `GUARD` bytes, the range, `GUARD` bytes.
struct Dest {
    buf: Arc<PageBuf>,
    id: u64,
    len: u64,
    src_offset: u64,
}

impl Dest {
    async fn new(cb: &UcxBackend, len: u64, src_offset: u64) -> Dest {
        let buf = Arc::new(PageBuf::zeroed((2 * GUARD + len) as usize));
        let region = map(cb, &buf).await;
        Dest {
            buf,
            id: region.backend_region_id,
            len,
            src_offset,
        }
    }

    fn request(&self, source: &Descriptor, deadline: Option<Duration>) -> BackendGet {
        BackendGet {
            peer: OWNER,
            remote_addr: source.addr() + self.src_offset,
            packed_key: source.packed_key().clone(),
            local_region_id: self.id,
            local_offset: GUARD,
            len: self.len,
            deadline,
        }
    }

    /// The same read judged on `snapshot`, its buffer as it was when the
    /// read answered.
    fn as_answered(&self, snapshot: &[u8]) -> Dest {
        Dest {
            buf: Arc::new(PageBuf::filled(snapshot.len(), |i| snapshot[i])),
            id: self.id,
            len: self.len,
            src_offset: self.src_offset,
        }
    }

    fn range(&self) -> std::ops::Range<usize> {
        GUARD as usize..(GUARD + self.len) as usize
    }

    /// An `Ok` read: exactly the source bytes, guards untouched.
    fn assert_exact(&self, want: &[u8], what: &str) {
        let landed = self.buf.snapshot();
        let range = self.range();
        let expected = &want[self.src_offset as usize..(self.src_offset + self.len) as usize];
        let wrong = differing_bytes(&landed[range], expected);
        assert_eq!(
            wrong, 0,
            "{what}: an Ok read of {} B has {wrong} wrong bytes",
            self.len
        );
        self.assert_guards(what);
    }

    /// An error answer: guards untouched, and every byte of the range is
    /// either untouched (0) or the source's own byte (a piece that landed
    /// before another failed). Returns how many bytes landed.
    fn assert_partial(&self, want: &[u8], what: &str) -> usize {
        let landed = self.buf.snapshot();
        let range = self.range();
        let expected = &want[self.src_offset as usize..(self.src_offset + self.len) as usize];
        let foreign = landed[range.clone()]
            .iter()
            .zip(expected)
            .filter(|&(&a, &b)| a != 0 && a != b)
            .count();
        assert_eq!(
            foreign, 0,
            "{what}: a failed read of {} B holds {foreign} bytes that are not its source's",
            self.len
        );
        self.assert_guards(what);
        landed[range].iter().filter(|&&b| b != 0).count()
    }

    fn assert_guards(&self, what: &str) {
        let landed = self.buf.snapshot();
        let range = self.range();
        let outside = landed[..range.start]
            .iter()
            .chain(&landed[range.end..])
            .filter(|&&b| b != 0)
            .count();
        assert_eq!(
            outside, 0,
            "{what}: a read of {} B wrote {outside} bytes outside its range",
            self.len
        );
    }
}

/// Waits [`WATCH`] and checks that no buffer overwritten with [`SCRIBBLE`]
/// after its error answer changed since.
async fn assert_quiet(scribbled: &[Arc<PageBuf>], what: &str) {
    if scribbled.is_empty() {
        return;
    }
    tokio::time::sleep(WATCH).await;
    for buf in scribbled {
        let changed = buf.snapshot().iter().filter(|&&b| b != SCRIBBLE).count();
        assert_eq!(
            changed, 0,
            "{what}: {changed} bytes written into a buffer after its read answered an error"
        );
    }
}

fn src_offset(i: usize) -> u64 {
    7 + 4093 * (i as u64 % 13)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_lengths_at_odd_offsets_land_exactly_and_touch_no_byte_outside_their_range() {
    let scene = Scene::new(engines(Transport::Tcp)).await;
    let lengths = [
        65_521u64, 65_522, 69_633, 100_003, 122_881, 131_071, 184_321, 245_761, 262_143, 273_737,
        273_738,
    ];
    for (i, &len) in lengths.iter().enumerate() {
        let dest = Dest::new(&scene.cb, len, src_offset(i)).await;
        let before = scene.consumer.reads_asked_in_chunks();
        let what = format!("{len} B from offset {}", dest.src_offset);
        assert_eq!(
            scene
                .cb
                .get_into_test_memory(dest.request(&scene.source, None))
                .await,
            Ok(()),
            "{what}"
        );
        assert_eq!(
            scene.consumer.reads_asked_in_chunks() - before,
            1,
            "{what}: split once"
        );
        dest.assert_exact(&scene.want, &what);
        assert_eq!(scene.cb.unmap(dest.id).await, Ok(()), "{what}");
    }
    assert_eq!(
        scene.owner.reads_asked_in_chunks(),
        0,
        "the owner asks nothing"
    );
    scene.end("odd lengths").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_are_counted_in_pieces_only_over_tcp_only_endpoints() {
    let cases: [(Transport, bool, bool); 5] = [
        (Transport::Tcp, false, true),
        (Transport::Tcp, true, true),
        (Transport::SameHost, true, false),
        (Transport::SharedMemoryNoErrorHandling, true, false),
        (Transport::SameHost, false, false),
    ];
    for (transport, served_only, split) in cases {
        let scene = Scene::new(if served_only {
            served_engines(transport.clone())
        } else {
            engines(transport.clone())
        })
        .await;
        let what = format!("{transport:?}, served only: {served_only}");
        for (i, &len) in PIECED.iter().enumerate() {
            let dest = Dest::new(&scene.cb, len, src_offset(i)).await;
            assert_eq!(
                scene
                    .cb
                    .get_into_test_memory(dest.request(&scene.source, None))
                    .await,
                Ok(()),
                "{what}: {len} B"
            );
            dest.assert_exact(&scene.want, &format!("{what}: {len} B"));
            assert_eq!(scene.cb.unmap(dest.id).await, Ok(()));
        }
        let want_count = if split { PIECED.len() as u64 } else { 0 };
        assert_eq!(scene.consumer.reads_asked_in_chunks(), want_count, "{what}");
        assert_eq!(scene.owner.reads_asked_in_chunks(), 0, "{what}: owner");
        assert_eq!(
            scene.ob.unmap(scene.src_region.backend_region_id).await,
            Ok(())
        );
        scene.shut_down(&what).await;
    }
}

/// Deadlines from 1 µs to 200 µs pass while some pieces landed and others
/// not: an error answer leaves only source bytes in the range, nothing
/// outside it, and nothing lands after it; an `Ok` answer is whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_passing_between_pieces_lets_no_piece_land_after_the_answer() {
    deadlines_between_pieces(config(Transport::Tcp), false).await;
}

/// As above under an operator's low `UCX_RNDV_THRESH`: pieces sized for
/// UCX's own threshold would come back by rendezvous there, so reads go
/// whole, and a read past its deadline during its receive lands nothing
/// after its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_an_operators_rendezvous_threshold_reads_go_whole_and_nothing_lands_after_a_deadline()
{
    deadlines_between_pieces(
        config(Transport::Tcp).with_ucx_setting("RNDV_THRESH", "8K"),
        true,
    )
    .await;
}

/// One read at a time, nothing else in flight, under an operator's low
/// `UCX_RNDV_THRESH`: a read whose own deadline passes while it is received
/// by rendezvous answers `Timeout` — not an error naming "another read's
/// deadline", which is what a split read's sibling pieces met before reads
/// there went whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_an_operators_rendezvous_threshold_a_lone_read_past_its_deadline_answers_timeout() {
    let scene = Scene::new(engines_with(
        config(Transport::Tcp).with_ucx_setting("RNDV_THRESH", "8K"),
    ))
    .await;
    let mut wrong = Vec::new();
    let (mut timeouts, mut whole_timeouts) = (0usize, 0usize);
    let mut scribbled = Vec::new();
    for round in 0..150u64 {
        let deadline = Duration::from_micros(1 + (round % 20) * 10);
        for len in [256 * KIB, 512 * KIB] {
            let dest = Dest::new(&scene.cb, len, src_offset(round as usize)).await;
            let before = scene.consumer.reads_asked_in_chunks();
            let outcome = scene
                .cb
                .get_into_test_memory(dest.request(&scene.source, Some(deadline)))
                .await;
            let pieced = scene.consumer.reads_asked_in_chunks() - before == 1;
            let what = format!("round {round}, {len} B, pieced {pieced}");
            match outcome {
                Ok(()) => dest.assert_exact(&scene.want, &what),
                Err(err) => {
                    dest.assert_partial(&scene.want, &what);
                    dest.buf.fill(SCRIBBLE);
                    scribbled.push(Arc::clone(&dest.buf));
                    match (err, pieced) {
                        (RdmaError::Timeout, true) => timeouts += 1,
                        (RdmaError::Timeout, false) => whole_timeouts += 1,
                        (other, _) => wrong.push(format!("{what}: {other}")),
                    }
                }
            }
        }
    }
    assert_quiet(&scribbled, "lone rendezvous pieces").await;
    assert_eq!(
        scene.consumer.reads_asked_in_chunks(),
        0,
        "an operator's rendezvous threshold keeps reads whole"
    );
    assert!(
        wrong.is_empty(),
        "lone reads past their own deadline answered another error ({} wrong, {timeouts} pieced and {whole_timeouts} whole Timeouts): {:#?}",
        wrong.len(),
        &wrong[..wrong.len().min(6)]
    );
    // A forced close leaves the owner's side of the connection, and the
    // rendezvous sends on it, until its keepalive notices: no owner unmap
    // here, the teardown ends them.
    scene.shut_down("lone rendezvous pieces").await;
}

async fn deadlines_between_pieces(config: rdmareg_ucx::UcxConfig, rendezvous: bool) {
    let scene = Scene::new(engines_with(config)).await;
    let deadlines_us = [1u64, 5, 10, 20, 35, 50, 75, 100, 150, 200];
    let (mut ok, mut timeouts, mut partial) = (0usize, 0usize, 0usize);
    let mut others = Vec::new();
    let mut scribbled = Vec::new();
    let mut dests = Vec::new();
    for round in 0..12 {
        let mut tasks = Vec::new();
        for (i, &deadline_us) in deadlines_us.iter().enumerate() {
            let len = PIECED[(i + round) % PIECED.len()];
            let dest = Dest::new(&scene.cb, len, src_offset(i + round)).await;
            let request = dest.request(&scene.source, Some(Duration::from_micros(deadline_us)));
            let (cb, buf) = (scene.cb.clone(), Arc::clone(&dest.buf));
            tasks.push((
                dest,
                tokio::spawn(async move {
                    let outcome = cb.get_into_test_memory(request).await;
                    // The buffer is the caller's the moment the error answers.
                    let snapshot = buf.snapshot();
                    if outcome.is_err() {
                        buf.fill(SCRIBBLE);
                    }
                    (outcome, snapshot)
                }),
            ));
        }
        for (dest, task) in tasks {
            let (outcome, snapshot) = task.await.expect("a read task");
            let what = format!("round {round}, {} B", dest.len);
            // Judge what was there at the answer.
            let at_answer = dest.as_answered(&snapshot);
            match outcome {
                Ok(()) => {
                    ok += 1;
                    at_answer.assert_exact(&scene.want, &what);
                }
                Err(RdmaError::Timeout) => {
                    timeouts += 1;
                    let landed = at_answer.assert_partial(&scene.want, &what);
                    if landed > 0 && (landed as u64) < dest.len {
                        partial += 1;
                    }
                    scribbled.push(Arc::clone(&dest.buf));
                }
                Err(other) => {
                    at_answer.assert_partial(&scene.want, &what);
                    scribbled.push(Arc::clone(&dest.buf));
                    others.push(format!("{what}: {other}"));
                }
            }
            dests.push(dest);
        }
    }
    assert!(timeouts > 0, "1 µs deadlines never passed: {ok} Ok");
    if rendezvous {
        assert_eq!(
            scene.consumer.reads_asked_in_chunks(),
            0,
            "an operator's rendezvous threshold keeps reads whole"
        );
    }
    tracing::info!(ok, timeouts, partial, rendezvous, "deadline rounds");
    assert_quiet(&scribbled, "deadlines").await;
    // With rendezvous pieces, another read's deadline may force-close the
    // endpoint under this one: other errors are expected there.
    assert!(
        rendezvous || others.is_empty(),
        "reads whose own deadline passed answered another error ({} of {}): {:#?}",
        others.len(),
        others.len() + timeouts,
        &others[..others.len().min(5)]
    );
    for dest in &dests {
        assert_eq!(scene.cb.unmap(dest.id).await, Ok(()), "destination unmap");
    }
    // The consumer still reads whole afterwards.
    let dest = Dest::new(&scene.cb, 256 * KIB, 11).await;
    assert_eq!(
        scene
            .cb
            .get_into_test_memory(dest.request(&scene.source, None))
            .await,
        Ok(())
    );
    dest.assert_exact(&scene.want, "after the deadlines");
    assert_eq!(scene.cb.unmap(dest.id).await, Ok(()));
    if rendezvous {
        scene.shut_down("deadlines").await;
    } else {
        scene.end("deadlines").await;
    }
}

/// A lone read asked in pieces is one read to its caller: an owner whose
/// per-connection bound of unfinished replies is smaller than the number of
/// pieces must still serve a single read it would serve whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_read_in_pieces_is_not_refused_as_busy_by_a_bound_below_its_piece_count() {
    // The same lone read below the split range is served whole.
    let lone = lone_reads_under_small_bounds(|config| config, 60 * KIB).await;
    assert!(
        lone.failures.is_empty(),
        "lone reads refused because their pieces exceed the owner's bound: {:#?}",
        lone.failures
    );
    assert!(
        lone.splits.iter().all(|&split| split == 1),
        "every lone read in the range was asked in pieces: {:?}",
        lone.splits
    );
}

/// What [`lone_reads_under_small_bounds`] saw.
struct LoneReads {
    failures: Vec<String>,
    /// Per read in the split range: how many reads the consumer split for it.
    splits: Vec<u64>,
}

/// Under owner bounds of 1, 2 and 4 unfinished replies per connection
/// (`configure` adds to the tcp configuration of both engines): a lone
/// `warm_len` read that must be served, then lone reads of 256 KiB and
/// 100 003 bytes, each checked for exact bytes or, failed, for nothing but
/// source bytes in its range.
async fn lone_reads_under_small_bounds(
    configure: impl Fn(rdmareg_ucx::UcxConfig) -> rdmareg_ucx::UcxConfig,
    warm_len: u64,
) -> LoneReads {
    let mut seen = LoneReads {
        failures: Vec::new(),
        splits: Vec::new(),
    };
    for bound in [1u32, 2, 4] {
        let scene = Scene::new(engines_with(configure(
            config(Transport::Tcp).with_max_served_replies_per_connection(bound),
        )))
        .await;
        let warm = Dest::new(&scene.cb, warm_len, 3).await;
        assert_eq!(
            scene
                .cb
                .get_into_test_memory(warm.request(&scene.source, Some(Duration::from_secs(5))))
                .await,
            Ok(()),
            "bound {bound}: a lone {warm_len} B read"
        );
        for &len in &[256 * KIB, 100_003] {
            let dest = Dest::new(&scene.cb, len, 5).await;
            let before = scene.consumer.reads_asked_in_chunks();
            let outcome = scene
                .cb
                .get_into_test_memory(dest.request(&scene.source, Some(Duration::from_secs(5))))
                .await;
            let split = scene.consumer.reads_asked_in_chunks() - before;
            seen.splits.push(split);
            match &outcome {
                Ok(()) => dest.assert_exact(&scene.want, &format!("bound {bound}, {len} B")),
                Err(err) => {
                    dest.assert_partial(&scene.want, &format!("bound {bound}, {len} B"));
                    seen.failures.push(format!(
                        "bound {bound}, lone {len} B read (split: {split}): {err}"
                    ));
                }
            }
            assert_eq!(scene.cb.unmap(dest.id).await, Ok(()));
        }
        assert_eq!(scene.cb.unmap(warm.id).await, Ok(()));
        scene.end(&format!("bound {bound}")).await;
    }
    seen
}

/// Batches mixing entries in pieces with small ones and with failing ones
/// answer each entry as its own read, land each in its place, and leave
/// the gaps between them untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_mixing_pieced_small_and_failing_entries_answers_each_on_its_own() {
    let scene = Scene::new(engines(Transport::Tcp)).await;
    // (length, source offset, expected outcome); offsets past the end fail.
    let end = SOURCE_LEN as u64;
    let entries: Vec<(u64, u64, Result<(), RdmaError>)> = vec![
        (256 * KIB, 3, Ok(())),
        (1, 11, Ok(())),
        (100_003, end - 50_000, Err(RdmaError::OutOfRange)),
        (4096, 17, Ok(())),
        (65_521, 65_536 + 1, Ok(())),
        (273_738, end - 273_737, Err(RdmaError::OutOfRange)),
        (16 * KIB, 100, Ok(())),
        (131_071, 500_001, Ok(())),
        (273_739, 1, Ok(())),
        (65_520, 2, Ok(())),
        (24_577, 200_003, Ok(())),
        (30_000, end - 10_000, Err(RdmaError::OutOfRange)),
    ];
    for round in 0..3 {
        let gap = 4099u64;
        let total: u64 = entries.iter().map(|(len, ..)| len + gap).sum::<u64>() + gap;
        let dst = PageBuf::zeroed(total as usize);
        let dst_region = map(&scene.cb, &dst).await;
        let mut requests = Vec::new();
        let mut places = Vec::new();
        let mut at = gap;
        for &(len, offset, _) in &entries {
            requests.push(BackendGet {
                peer: OWNER,
                remote_addr: scene.source.addr() + offset,
                packed_key: scene.source.packed_key().clone(),
                local_region_id: dst_region.backend_region_id,
                local_offset: at,
                len,
                deadline: Some(Duration::from_secs(5)),
            });
            places.push(at as usize);
            at += len + gap;
        }
        let before = scene.consumer.reads_asked_in_chunks();
        let answers = scene.cb.get_batch_into_test_memory(requests).await;
        let expected: Vec<_> = entries.iter().map(|(.., e)| e.clone()).collect();
        assert_eq!(answers, expected, "round {round}");
        // Past one fragment, and in a list above the gathered bound up to
        // twice it (`progress::chunks`).
        let pieced = entries
            .iter()
            .filter(|(len, ..)| {
                (65_521..=273_738).contains(len) || (16 * KIB + 1..=32 * KIB).contains(len)
            })
            .count() as u64;
        assert_eq!(
            scene.consumer.reads_asked_in_chunks() - before,
            pieced,
            "round {round}: pieced entries counted once each"
        );
        let landed = dst.snapshot();
        let mut covered = vec![false; landed.len()];
        for (&(len, offset, ref outcome), &place) in entries.iter().zip(&places) {
            let (len, offset) = (len as usize, offset as usize);
            let got = &landed[place..place + len];
            match outcome {
                Ok(()) => assert!(
                    got == &scene.want[offset..offset + len],
                    "round {round}: entry of {len} B at {offset} exact"
                ),
                Err(_) => {
                    let readable = SOURCE_LEN.saturating_sub(offset).min(len);
                    let foreign = got
                        .iter()
                        .enumerate()
                        .filter(|&(i, &b)| b != 0 && (i >= readable || b != scene.want[offset + i]))
                        .count();
                    assert_eq!(foreign, 0, "round {round}: failed entry of {len} B");
                }
            }
            covered[place..place + len]
                .iter_mut()
                .for_each(|c| *c = true);
        }
        let outside = landed
            .iter()
            .zip(&covered)
            .filter(|&(&b, &c)| !c && b != 0)
            .count();
        assert_eq!(outside, 0, "round {round}: bytes in the gaps");
        dst.fill(SCRIBBLE);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            dst.snapshot().iter().all(|&b| b == SCRIBBLE),
            "round {round}: bytes landed after the batch answered"
        );
        assert_eq!(scene.cb.unmap(dst_region.backend_region_id).await, Ok(()));
    }
    scene.end("batches").await;
}

/// Batches whose entries in pieces run into short deadlines: every entry's
/// answer and the batch's come only once nothing writes any more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_pieced_entries_past_short_deadlines_lets_nothing_land_after_its_answer() {
    let scene = Scene::new(engines(Transport::Tcp)).await;
    let mut scribbled = Vec::new();
    let mut errors = 0;
    for round in 0..20u64 {
        let deadline = Duration::from_micros(1 + round * 10);
        let dests = {
            let mut dests = Vec::new();
            for (i, &len) in PIECED.iter().enumerate() {
                dests.push(Dest::new(&scene.cb, len, src_offset(i + round as usize)).await);
            }
            dests
        };
        let requests = dests
            .iter()
            .map(|dest| dest.request(&scene.source, Some(deadline)))
            .collect();
        let answers = scene.cb.get_batch_into_test_memory(requests).await;
        for (dest, answer) in dests.iter().zip(&answers) {
            let what = format!("round {round}, {} B", dest.len);
            match answer {
                Ok(()) => dest.assert_exact(&scene.want, &what),
                Err(RdmaError::Timeout) => {
                    errors += 1;
                    dest.assert_partial(&scene.want, &what);
                    dest.buf.fill(SCRIBBLE);
                    scribbled.push(Arc::clone(&dest.buf));
                }
                Err(other) => panic!("{what}: unexpected {other:?}"),
            }
        }
        for dest in &dests {
            assert_eq!(scene.cb.unmap(dest.id).await, Ok(()));
        }
    }
    assert!(errors > 0, "no deadline ever passed");
    assert_quiet(&scribbled, "batch deadlines").await;
    scene.end("batch deadlines").await;
}

/// Many reads in pieces in flight at once on one connection all land
/// exactly, are each counted once, and release everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_reads_in_pieces_land_exactly_and_release_everything() {
    let scene = Scene::new(engines(Transport::Tcp)).await;
    let count = 96;
    for round in 0..2 {
        let mut dests = Vec::new();
        for i in 0..count {
            dests.push(Dest::new(&scene.cb, PIECED[i % PIECED.len()], src_offset(i + round)).await);
        }
        let before = scene.consumer.reads_asked_in_chunks();
        let outcomes = futures::future::join_all(dests.iter().map(|dest| {
            let request = dest.request(&scene.source, None);
            let cb = scene.cb.clone();
            async move { cb.get_into_test_memory(request).await }
        }))
        .await;
        for (dest, outcome) in dests.iter().zip(outcomes) {
            assert_eq!(outcome, Ok(()), "round {round}: {} B", dest.len);
            dest.assert_exact(&scene.want, &format!("round {round}"));
        }
        assert_eq!(
            scene.consumer.reads_asked_in_chunks() - before,
            count as u64
        );
        for dest in &dests {
            assert_eq!(scene.cb.unmap(dest.id).await, Ok(()));
        }
    }
    scene.end("concurrent").await;
}

/// Reads in pieces dropped by their callers mid-flight: the destination's
/// unmap confirms (only once no piece holds it), nothing lands after that,
/// the owner ends with no reply in flight, and the consumer reads on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_reads_in_pieces_mid_flight_leaks_nothing_and_lands_nothing_after_the_unmap() {
    let scene = Scene::new(engines(Transport::Tcp)).await;
    let mut scribbled = Vec::new();
    for round in 0..20u64 {
        let mut dests = Vec::new();
        let mut tasks = Vec::new();
        for (i, &len) in PIECED.iter().enumerate() {
            let dest = Dest::new(&scene.cb, len, src_offset(i + round as usize)).await;
            let request = dest.request(&scene.source, None);
            let cb = scene.cb.clone();
            tasks.push(tokio::spawn(async move {
                cb.get_into_test_memory(request).await
            }));
            dests.push(dest);
        }
        if round % 4 != 0 {
            tokio::time::sleep(Duration::from_micros(round * 15)).await;
        }
        for task in &tasks {
            task.abort();
        }
        for (dest, task) in dests.iter().zip(tasks) {
            let finished = task.await;
            if let Ok(outcome) = finished {
                // It answered before the abort: judge it.
                match outcome {
                    Ok(()) => dest.assert_exact(&scene.want, "answered before the drop"),
                    Err(err) => panic!("round {round}: {err:?}"),
                }
            }
            // The unmap waits for every piece's hold.
            assert_eq!(scene.cb.unmap(dest.id).await, Ok(()), "round {round}");
            dest.assert_guards(&format!("round {round}"));
            dest.assert_partial(&scene.want, &format!("round {round}"));
            dest.buf.fill(SCRIBBLE);
            scribbled.push(Arc::clone(&dest.buf));
        }
    }
    assert_quiet(&scribbled, "dropped reads").await;
    assert_eq!(scene.consumer.live_registrations(), Some(0));
    let dest = Dest::new(&scene.cb, 256 * KIB, 1).await;
    assert_eq!(
        scene
            .cb
            .get_into_test_memory(dest.request(&scene.source, None))
            .await,
        Ok(())
    );
    dest.assert_exact(&scene.want, "after the drops");
    assert_eq!(scene.cb.unmap(dest.id).await, Ok(()));
    scene.end("dropped reads").await;
}

/// Either side shutting down while reads in pieces are in flight: each
/// read answers `Ok` whole or an error, and nothing lands after an error.
async fn shutdown_mid_read(gone: Gone) {
    let mut scribbled = Vec::new();
    let (mut ok, mut failed) = (0usize, 0usize);
    for round in 0..8u64 {
        let (owner, consumer) = engines(Transport::Tcp);
        let (ob, cb) = (owner.backend(), consumer.backend());
        let src = Arc::new(PageBuf::filled(SOURCE_LEN, pattern));
        let want = Arc::new(src.snapshot());
        let src_region = map(&ob, &src).await;
        let source = describe(&src, &src_region);
        let mut tasks = Vec::new();
        for i in 0..12 {
            let dest = Dest::new(&cb, PIECED[i % PIECED.len()], src_offset(i)).await;
            let request = dest.request(&source, Some(Duration::from_secs(5)));
            let (cb, buf) = (cb.clone(), Arc::clone(&dest.buf));
            tasks.push((
                dest,
                tokio::spawn(async move {
                    let outcome = cb.get_into_test_memory(request).await;
                    let snapshot = buf.snapshot();
                    if outcome.is_err() {
                        buf.fill(SCRIBBLE);
                    }
                    (outcome, snapshot)
                }),
            ));
        }
        tokio::time::sleep(Duration::from_micros(round * 40)).await;
        let (owner, consumer) = (Arc::new(owner), Arc::new(consumer));
        let shutdown = tokio::spawn({
            let (owner, consumer) = (Arc::clone(&owner), Arc::clone(&consumer));
            async move {
                match gone {
                    Gone::Consumer => consumer.shutdown().await,
                    Gone::Owner => owner.shutdown().await,
                }
            }
        });
        for (dest, task) in tasks {
            let (outcome, snapshot) = task.await.expect("a read task");
            let at_answer = dest.as_answered(&snapshot);
            let what = format!("{gone:?} gone, round {round}, {} B", dest.len);
            match outcome {
                Ok(()) => {
                    ok += 1;
                    at_answer.assert_exact(&want, &what);
                }
                Err(_) => {
                    failed += 1;
                    at_answer.assert_partial(&want, &what);
                    scribbled.push(Arc::clone(&dest.buf));
                }
            }
        }
        shutdown.await.expect("the shutdown task");
        consumer.shutdown().await;
        owner.shutdown().await;
        assert_eq!(consumer.live_registrations(), Some(0), "round {round}");
        assert_eq!(owner.live_registrations(), Some(0), "round {round}");
        drop(src);
    }
    tracing::info!(?gone, ok, failed, "shutdown rounds");
    assert_quiet(&scribbled, &format!("{gone:?} gone")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_lands_after_the_consumer_shuts_down_mid_read_in_pieces() {
    shutdown_mid_read(Gone::Consumer).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_lands_after_the_owner_shuts_down_mid_read_in_pieces() {
    shutdown_mid_read(Gone::Owner).await;
}

/// The owner unmaps its source while reads in pieces of every size stream
/// from it and overwrites it with zeros the moment the unmap confirms: an
/// `Ok` read carries only the source's bytes, a refused one only bytes
/// leased before the unmap, no read posted after the unmap confirmed is
/// served, and the owner has no reply in flight once it confirmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owners_unmap_mid_read_in_pieces_confirms_only_after_its_replies_finished() {
    let until = Instant::now() + Duration::from_millis(3000);
    let (mut served_total, mut refused_total) = (0usize, 0usize);
    for (round, delay_us) in [0u64, 50, 100, 200, 400, 800, 1600]
        .iter()
        .cycle()
        .enumerate()
    {
        let (owner, consumer) = engines(Transport::Tcp);
        let (ob, cb) = (owner.backend(), consumer.backend());
        let src = Arc::new(PageBuf::filled(SOURCE_LEN, pattern));
        let want = Arc::new(src.snapshot());
        let src_region = map(&ob, &src).await;
        let source = describe(&src, &src_region);
        let unmapped = Arc::new(AtomicBool::new(false));
        let mut readers = Vec::new();
        for reader in 0..4usize {
            let len = PIECED[(reader + round) % PIECED.len()];
            let dest = Dest::new(&cb, len, src_offset(reader)).await;
            let request = dest.request(&source, Some(Duration::from_secs(5)));
            assert_eq!(
                cb.get_into_test_memory(request.clone()).await,
                Ok(()),
                "warm-up"
            );
            let (cb, unmapped, want) = (cb.clone(), Arc::clone(&unmapped), Arc::clone(&want));
            readers.push(tokio::spawn(async move {
                let (mut served, mut refused) = (0usize, 0usize);
                loop {
                    let last = unmapped.load(Ordering::Acquire);
                    dest.buf.fill(0);
                    let outcome = cb.get_into_test_memory(request.clone()).await;
                    let what = format!("{len} B");
                    match outcome {
                        Ok(()) => {
                            dest.assert_exact(&want, &what);
                            assert!(!last, "{what}: served after the unmap confirmed");
                            served += 1;
                        }
                        Err(RdmaError::RegionNotFound) => {
                            dest.assert_partial(&want, &what);
                            refused += 1;
                        }
                        Err(other) => panic!("{what}: unexpected {other:?}"),
                    }
                    if last {
                        return (served, refused, dest);
                    }
                }
            }));
        }
        tokio::time::sleep(Duration::from_micros(*delay_us)).await;
        let what = format!("round {round}");
        unmap_and_zero_source(&owner, src_region.backend_region_id, &src, &unmapped, &what).await;
        let mut dests = Vec::new();
        for reader in readers {
            let (served, refused, dest) = reader.await.expect("a reader task");
            served_total += served;
            refused_total += refused;
            dests.push(dest);
        }
        for dest in &dests {
            assert_eq!(cb.unmap(dest.id).await, Ok(()));
        }
        shut_down_clean(owner, consumer, &format!("unmap round {round}")).await;
        drop(src);
        if Instant::now() > until {
            break;
        }
    }
    assert!(served_total > 0, "no read was served before an unmap");
    assert!(refused_total > 0, "no read was refused after an unmap");
}

/// With UCX's rendezvous threshold set low (an operator's `UCX_RNDV_THRESH`
/// through `with_ucx_setting`), pieces would come back by rendezvous and
/// hold the owner's sends open until the consumer takes them, so a lone
/// read could be refused for its own pieces: reads go whole there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_an_operators_rendezvous_threshold_a_lone_read_is_never_refused_for_its_own_pieces() {
    let lone = lone_reads_under_small_bounds(
        |config| config.with_ucx_setting("RNDV_THRESH", "8K"),
        512 * KIB,
    )
    .await;
    assert!(
        lone.failures.is_empty(),
        "lone reads refused because their pieces exceed the owner's bound: {:#?}",
        lone.failures
    );
    assert!(
        lone.splits.iter().all(|&split| split == 0),
        "an operator's rendezvous threshold keeps reads whole: {:?}",
        lone.splits
    );
}
