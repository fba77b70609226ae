//! A list's reads of 16 to 32 KiB asked in two gathered pieces, answered
//! by an owner engine under attack.
//!
//! Over an endpoint whose every lane is tcp, a read of a batch of two or
//! more that is longer than the gathered bound (`MAX_GATHERED_ENTRY`,
//! 16 KiB) and at most twice it goes as two reads, 16 KiB and the rest,
//! each gathered into the list requests with the batch's small reads and
//! answered by the owner like any gathered entry; the caller sees one
//! answer per entry (`progress::chunks`). These tests attack that with an
//! owner engine under odd lengths and offsets, second pieces past the
//! registration, microsecond deadlines, batches deeper than 1024 reads, an
//! unmap of the source, a dropped batch, either engine shutting down and a
//! per-connection bound of unfinished replies.
//! (A hostile owner answering pieces by hand is played against the
//! consumer's rules for each piece by the engine kit's deterministic
//! scenarios, `rdmareg-engine`'s `served::scenarios::lists`.)
//!
//! What every test holds the consumer to: each entry is answered once; an
//! entry answered `Ok` holds exactly its bytes; an entry answered with an
//! error holds nothing but bytes its owner sent for it (a piece that landed
//! before its sibling failed); no byte lands outside an entry's range; and
//! once the batch answered, nothing lands in its destinations and their
//! unmap answers `Ok`.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::list_pieces::{BOUND, judge, pieced, unscribbled};
use common::list_scene::{Answers, KIB, SCRIBBLE, Slots, WATCH};
use common::scene::{Gone, SOURCE_LEN, Scene, shut_down_clean, unmap_and_zero_source};
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, Descriptor, RdmaError};
use rdmareg_ucx::read_protocol::BUSY_TEXT;
use rdmareg_ucx::{Transport, UcxBackend};

/// Lengths a list asks in two pieces: one byte over the bound, odd ones,
/// and twice the bound.
const PIECED: [usize; 4] = [BOUND + 1, 20 * KIB + 3, 24 * KIB + 1, 2 * BOUND];

/// Waits `wait` without yielding: finer than the runtime's millisecond
/// timer.
fn spin(wait: Duration) {
    let until = std::time::Instant::now() + wait;
    while std::time::Instant::now() < until {
        std::hint::spin_loop();
    }
}

/// Where entry `i` of a list reads in a [`Scene`]'s source: odd offsets,
/// spread out, room for 128 KiB after each.
fn src_at(i: usize) -> usize {
    7 + (i * 12_289) % (SOURCE_LEN - 128 * KIB)
}

/// The requests of `slots`, entry `i` from `at(i)` in `source`, due in
/// `deadline`.
fn requests(
    slots: &Slots,
    source: &Descriptor,
    at: impl Fn(usize) -> usize,
    deadline: Option<Duration>,
) -> Vec<BackendGet> {
    (0..slots.lens.len())
        .map(|i| {
            let addr = source.addr() + at(i) as u64;
            slots.request(i, OWNER, addr, source.packed_key(), deadline)
        })
        .collect()
}

/// Judges a list read from a source whose bytes are `want`, entry `i` from
/// `at(i)` (see [`judge`]). Returns how many were `Ok`.
fn judge_source(
    slots: &Slots,
    snapshot: &[u8],
    answers: &Answers,
    want: &[u8],
    at: impl Fn(usize) -> usize,
    what: &str,
) -> usize {
    let bytes = |i: usize| {
        let start = at(i).min(want.len());
        want[start..(start + slots.lens[i]).min(want.len())].to_vec()
    };
    judge(slots, snapshot, answers, bytes, bytes, what)
}

/// Once the batch answered: overwrites the destination, unmaps it (which
/// must answer `Ok`) and checks nothing lands for [`WATCH`].
async fn unmap_and_watch(cb: &UcxBackend, slots: &Slots, what: &str) {
    slots.buf.fill(SCRIBBLE);
    assert_eq!(
        cb.unmap(slots.region).await,
        Ok(()),
        "{what}: the destination unmaps"
    );
    tokio::time::sleep(WATCH).await;
    let changed = unscribbled(&slots.buf);
    assert_eq!(
        changed, 0,
        "{what}: {changed} bytes landed after the answer"
    );
}

/// Lists mixing reads of one byte over the gathered bound to twice it with
/// reads of exactly the bound, one byte over twice it, reads pieced in
/// 60 KiB and tiny ones, at odd source and destination offsets: each lands
/// exactly, nothing between them is touched, and each read in the two
/// ranges is counted once as asked in pieces.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pieced_entries_at_odd_offsets_land_exactly_beside_small_and_long_ones() {
    let scene = Scene::new(engines(Transport::Tcp)).await;
    let mut lens: Vec<usize> = vec![7, BOUND, 2 * BOUND + 1, 64 * KIB, 100_003, 4 * KIB, 1];
    lens.extend(PIECED);
    lens.extend(
        PIECED
            .iter()
            .map(|len| len + 2 * KIB)
            .filter(|&len| pieced(len)),
    );
    for round in 0..4 {
        lens.rotate_left(3);
        let at = |i: usize| src_at(i + round * 7);
        let slots = Slots::new(&scene.cb, &lens).await;
        let before = scene.consumer.reads_asked_in_chunks();
        let answers = scene
            .cb
            .get_batch_into_test_memory(requests(&slots, &scene.source, at, None))
            .await;
        let snapshot = slots.buf.snapshot();
        let what = format!("round {round}");
        assert_eq!(answers, vec![Ok(()); lens.len()], "{what}");
        judge_source(&slots, &snapshot, &answers, &scene.want, at, &what);
        let split = scene.consumer.reads_asked_in_chunks() - before;
        assert_eq!(
            split,
            lens.iter().filter(|&&len| pieced(len)).count() as u64,
            "{what}"
        );
        unmap_and_watch(&scene.cb, &slots, &what).await;
    }
    scene.end("odd offsets").await;
}

/// Reads whose second piece runs past the registration's end (by one
/// byte, or wholly) answer `OutOfRange` holding at most their first
/// piece's source bytes; a read ending exactly at the end, and the small
/// reads around them, land exactly; nothing lands after the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_whose_second_piece_runs_past_the_registration_answer_out_of_range() {
    let scene = Scene::new(engines(Transport::Tcp)).await;
    let end = SOURCE_LEN;
    // (length, source offset, outcome)
    let entries = [
        (BOUND + 1, end - BOUND, Err(RdmaError::OutOfRange)),
        (4 * KIB, 11, Ok(())),
        (2 * BOUND, end - 2 * BOUND + 1, Err(RdmaError::OutOfRange)),
        (20 * KIB + 3, end - BOUND, Err(RdmaError::OutOfRange)),
        (2 * BOUND, end - 2 * BOUND, Ok(())),
        (24 * KIB + 1, end - BOUND - 5, Err(RdmaError::OutOfRange)),
        (7, end - 7, Ok(())),
    ];
    let lens: Vec<usize> = entries.iter().map(|e| e.0).collect();
    let at = |i: usize| entries[i].1;
    for round in 0..3 {
        let slots = Slots::new(&scene.cb, &lens).await;
        let deadline = Some(Duration::from_secs(5));
        let requests = requests(&slots, &scene.source, at, deadline);
        let answers = scene.cb.get_batch_into_test_memory(requests).await;
        let snapshot = slots.buf.snapshot();
        let what = format!("round {round}");
        let expected: Answers = entries.iter().map(|e| e.2.clone()).collect();
        assert_eq!(answers, expected, "{what}");
        judge_source(&slots, &snapshot, &answers, &scene.want, at, &what);
        unmap_and_watch(&scene.cb, &slots, &what).await;
    }
    scene.end("past the end").await;
}

/// Lists of pieced and small reads with deadlines of 1 to 200 µs: each
/// entry answers `Ok` with exactly its bytes or `Timeout` holding only
/// source bytes, never another error, and nothing lands after the batch
/// answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn microsecond_deadlines_on_lists_of_pieces_answer_timeout_and_land_nothing_after() {
    let scene = Scene::new(engines(Transport::Tcp)).await;
    let lens: Vec<usize> = (0..48)
        .map(|i| [PIECED[i % 4], 4 * KIB, 100][i % 3])
        .collect();
    let (mut ok, mut timeouts) = (0, 0);
    for round in 0..24u64 {
        let deadline = Duration::from_micros(1 + (round % 8) * 28);
        let slots = Slots::new(&scene.cb, &lens).await;
        let at = |i: usize| src_at(i + round as usize);
        let requests = requests(&slots, &scene.source, at, Some(deadline));
        let answers = scene.cb.get_batch_into_test_memory(requests).await;
        let snapshot = slots.buf.snapshot();
        let what = format!("round {round}, {deadline:?}");
        ok += judge_source(&slots, &snapshot, &answers, &scene.want, at, &what);
        for (i, answer) in answers.iter().enumerate() {
            match answer {
                Ok(()) => {}
                Err(RdmaError::Timeout) => timeouts += 1,
                Err(other) => panic!("{what}: entry {i} ({} B): {other:?}", lens[i]),
            }
        }
        unmap_and_watch(&scene.cb, &slots, &what).await;
    }
    assert!(timeouts > 0, "no deadline passed ({ok} Ok)");
    scene.end("deadlines").await;
}

/// A batch of 1100 reads of 32 KiB: only the reads posted while fewer than
/// 1024 reads (pieces included) are in flight go in pieces, the first 512,
/// and every read lands exactly, none refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_deeper_than_1024_reads_pieces_only_its_first_512_and_lands_every_one() {
    let scene = Scene::new(engines(Transport::Tcp)).await;
    let lens = vec![2 * BOUND; 1100];
    let slots = Slots::new(&scene.cb, &lens).await;
    let requests = requests(&slots, &scene.source, src_at, None);
    let answers = scene.cb.get_batch_into_test_memory(requests).await;
    let snapshot = slots.buf.snapshot();
    let first_failed = answers.iter().position(Result::is_err);
    assert_eq!(
        first_failed,
        None,
        "{:?}",
        first_failed.map(|i| &answers[i])
    );
    judge_source(&slots, &snapshot, &answers, &scene.want, src_at, "deep");
    assert_eq!(scene.consumer.reads_asked_in_chunks(), 512);
    unmap_and_watch(&scene.cb, &slots, "deep").await;
    scene.end("deep").await;
}

/// Each piece holds one place under the owner's bound of unfinished
/// replies per connection, and a list's pieces are admitted together. An
/// owner whose bound (12) holds the pieces of a batch of six 32 KiB reads
/// serves them all. Under a bound of 8 (above the batch's six reads, below
/// their twelve pieces: the documented cost of pieces, `docs/safety.md`),
/// an entry is `Ok` with exactly its bytes or refused busy: a transient
/// error holding only source bytes, and posting the refused reads again
/// lands them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pieces_hold_one_place_each_under_the_owners_bound_and_busy_reads_succeed_again() {
    let lens = vec![2 * BOUND; 6];
    for bound in [12u32, 8] {
        let scene = Scene::new(engines_with(
            config(Transport::Tcp).with_max_served_replies_per_connection(bound),
        ))
        .await;
        for round in 0..3 {
            let slots = Slots::new(&scene.cb, &lens).await;
            let at = |i: usize| src_at(i + round);
            let requests = requests(&slots, &scene.source, at, Some(Duration::from_secs(5)));
            let answers = scene.cb.get_batch_into_test_memory(requests.clone()).await;
            let snapshot = slots.buf.snapshot();
            let what = format!("bound {bound}, round {round}");
            judge_source(&slots, &snapshot, &answers, &scene.want, at, &what);
            let busy: Vec<usize> = (0..lens.len())
                .filter(
                    |&i| matches!(&answers[i], Err(RdmaError::Backend(text)) if text == BUSY_TEXT),
                )
                .collect();
            for (i, answer) in answers.iter().enumerate() {
                assert!(
                    answer.is_ok() || busy.contains(&i),
                    "{what}: entry {i} is Ok or busy, not {answer:?}"
                );
            }
            if bound == 12 {
                assert!(busy.is_empty(), "{what}: the bound holds every piece");
            }
            if !busy.is_empty() {
                assert!(answers[busy[0]].as_ref().unwrap_err().is_transient());
                let again: Vec<BackendGet> = busy.iter().map(|&i| requests[i].clone()).collect();
                let retried = scene.cb.get_batch_into_test_memory(again).await;
                assert_eq!(
                    retried,
                    vec![Ok(()); busy.len()],
                    "{what}: busy reads posted again"
                );
                let snapshot = slots.buf.snapshot();
                let all_ok = vec![Ok(()); lens.len()];
                judge_source(&slots, &snapshot, &all_ok, &scene.want, at, &what);
            }
            unmap_and_watch(&scene.cb, &slots, &what).await;
        }
        scene.end("bound").await;
    }
}

/// The owner unmaps its source while lists of pieced reads stream from it,
/// and zeroes it the moment the unmap confirms: an `Ok` entry holds only
/// the source's bytes (none served after the unmap), a failed one
/// `RegionNotFound` with only source bytes, and the owner has no reply in
/// flight once the unmap confirmed. The unmap comes from no wait to four
/// times a warm-up batch's time after it, so that it lands before,
/// inside and after batches however fast this build serves them (a
/// sanitizer build is several times slower).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owners_unmap_mid_batch_serves_no_piece_after_it_confirmed() {
    let lens: Vec<usize> = (0..24).map(|i| [PIECED[i % 4], 4 * KIB][i % 2]).collect();
    let (mut served, mut refused) = (0, 0);
    for (round, quarters) in [0u32, 1, 2, 4, 8, 16].into_iter().enumerate() {
        let (owner, consumer) = engines(Transport::Tcp);
        let (ob, cb) = (owner.backend(), consumer.backend());
        let src = Arc::new(PageBuf::filled(SOURCE_LEN, pattern));
        let want = Arc::new(src.snapshot());
        let src_region = map(&ob, &src).await;
        let source = describe(&src, &src_region);
        let unmapped = Arc::new(AtomicBool::new(false));
        let (warm, warmed) = tokio::sync::oneshot::channel();
        let reader = tokio::spawn({
            let (cb, unmapped, want, lens) =
                (cb.clone(), Arc::clone(&unmapped), want, lens.clone());
            async move {
                let slots = Slots::new(&cb, &lens).await;
                let deadline = Some(Duration::from_secs(5));
                let requests = requests(&slots, &source, src_at, deadline);
                let started = std::time::Instant::now();
                let answers = cb.get_batch_into_test_memory(requests.clone()).await;
                assert_eq!(answers, vec![Ok(()); lens.len()], "round {round}: warm-up");
                warm.send(started.elapsed()).unwrap();
                let (mut served, mut refused) = (0, 0);
                loop {
                    let last = unmapped.load(Ordering::Acquire);
                    slots.buf.fill(0);
                    let answers = cb.get_batch_into_test_memory(requests.clone()).await;
                    let snapshot = slots.buf.snapshot();
                    let what = format!("round {round}, after the unmap: {last}");
                    let ok = judge_source(&slots, &snapshot, &answers, &want, src_at, &what);
                    assert!(!last || ok == 0, "{what}: {ok} entries served");
                    for answer in answers.iter().filter(|a| a.is_err()) {
                        assert_eq!(answer, &Err(RdmaError::RegionNotFound), "{what}");
                    }
                    served += ok;
                    refused += lens.len() - ok;
                    if last {
                        unmap_and_watch(&cb, &slots, &what).await;
                        return (served, refused);
                    }
                }
            }
        });
        let batch = warmed.await.expect("the reader warmed up");
        tokio::time::sleep(batch * quarters / 4).await;
        let what = format!("round {round}");
        unmap_and_zero_source(&owner, src_region.backend_region_id, &src, &unmapped, &what).await;
        let (s, r) = reader.await.expect("the reader task");
        (served, refused) = (served + s, refused + r);
        shut_down_clean(owner, consumer, &format!("round {round}")).await;
        drop(src);
    }
    assert!(
        served > 0 && refused > 0,
        "{served} served, {refused} refused"
    );
}

/// Batches of pieced reads dropped by their caller mid-flight: the
/// destination's unmap answers `Ok` (once no piece holds it), nothing lands
/// after it, the owner ends with no reply in flight, and the consumer still
/// reads exactly afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_pieces_dropped_mid_flight_lets_its_destination_unmap_and_lands_nothing_after() {
    let scene = Scene::new(engines(Transport::Tcp)).await;
    let lens: Vec<usize> = (0..40).map(|i| [PIECED[i % 4], 300][i % 2]).collect();
    let mut answered = 0;
    for round in 0..24u64 {
        let slots = Slots::new(&scene.cb, &lens).await;
        let requests = requests(&slots, &scene.source, src_at, None);
        let cb = scene.cb.clone();
        let batch = tokio::spawn(async move { cb.get_batch_into_test_memory(requests).await });
        spin(Duration::from_micros(round * 6));
        batch.abort();
        let what = format!("round {round}");
        if let Ok(answers) = batch.await {
            answered += 1;
            let snapshot = slots.buf.snapshot();
            judge_source(&slots, &snapshot, &answers, &scene.want, src_at, &what);
        }
        assert_eq!(scene.cb.unmap(slots.region).await, Ok(()), "{what}");
        let snapshot = slots.buf.snapshot();
        let none = vec![Err(RdmaError::Timeout); lens.len()];
        judge_source(&slots, &snapshot, &none, &scene.want, src_at, &what);
        slots.buf.fill(SCRIBBLE);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(unscribbled(&slots.buf), 0, "{what}: landed after");
    }
    assert!(answered < 24, "no batch was dropped before its answer");
    let slots = Slots::new(&scene.cb, &lens).await;
    let requests = requests(&slots, &scene.source, src_at, None);
    let answers = scene.cb.get_batch_into_test_memory(requests).await;
    let (snapshot, what) = (slots.buf.snapshot(), "after the drops");
    assert_eq!(answers, vec![Ok(()); lens.len()], "{what}");
    judge_source(&slots, &snapshot, &answers, &scene.want, src_at, what);
    unmap_and_watch(&scene.cb, &slots, what).await;
    scene.end("dropped batches").await;
}

/// Either engine shutting down while lists of pieced reads are in flight:
/// every entry is answered, `Ok` exactly or an error with only source
/// bytes, and nothing lands after the answer.
async fn shutdown_mid_batch(gone: Gone) {
    let lens: Vec<usize> = (0..32)
        .map(|i| [PIECED[i % 4], 4 * KIB, 9][i % 3])
        .collect();
    let (mut ok, mut failed) = (0, 0);
    for round in 0..12u64 {
        let (owner, consumer) = engines(Transport::Tcp);
        let (ob, cb) = (owner.backend(), consumer.backend());
        let src = Arc::new(PageBuf::filled(SOURCE_LEN, pattern));
        let want = src.snapshot();
        let src_region = map(&ob, &src).await;
        let source = describe(&src, &src_region);
        let slots = Slots::new(&cb, &lens).await;
        let requests = requests(&slots, &source, src_at, Some(Duration::from_secs(5)));
        // Connected first, so that the shutdown meets the batch in flight.
        let warm = cb.get_batch_into_test_memory(requests[..2].to_vec()).await;
        assert_eq!(warm, vec![Ok(()); 2], "warm-up");
        slots.buf.fill(0);
        let batch = tokio::spawn({
            let cb = cb.clone();
            async move { cb.get_batch_into_test_memory(requests).await }
        });
        spin(Duration::from_micros(round * 120));
        match gone {
            Gone::Consumer => consumer.shutdown().await,
            Gone::Owner => owner.shutdown().await,
        }
        let answers = tokio::time::timeout(Duration::from_secs(10), batch)
            .await
            .expect("every entry answered")
            .expect("the batch task");
        let snapshot = slots.buf.snapshot();
        let what = format!("{gone:?} gone, round {round}");
        let landed = judge_source(&slots, &snapshot, &answers, &want, src_at, &what);
        (ok, failed) = (ok + landed, failed + lens.len() - landed);
        unmap_and_watch(&cb, &slots, &what).await;
        shut_down_clean(owner, consumer, &what).await;
        drop(src);
    }
    tracing::info!(?gone, ok, failed, "shutdown rounds");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumer_shutting_down_mid_batch_answers_every_pieced_entry_and_lands_nothing_after() {
    shutdown_mid_batch(Gone::Consumer).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_owner_shutting_down_mid_batch_answers_every_pieced_entry_and_lands_nothing_after() {
    shutdown_mid_batch(Gone::Owner).await;
}
