//! A list's reads of 16 to 32 KiB asked in two gathered pieces, under
//! attack.
//!
//! Over an endpoint whose every lane is tcp, a read of a batch of two or
//! more that is longer than the gathered bound (`MAX_GATHERED_ENTRY`,
//! 16 KiB) and at most twice it goes as two reads, 16 KiB and the rest,
//! each gathered into the list requests with the batch's small reads and
//! answered by the owner like any gathered entry; the caller sees one
//! answer per entry (`progress::pieces`). These tests attack that from
//! both ends: a raw owner answering the pieces by hand (only first pieces,
//! crossed ids, twice, out of order across replies, with ids never asked,
//! refused, with wrong lengths, while the consumer shuts down), and an
//! owner engine under odd lengths and offsets, second pieces past the
//! registration, microsecond deadlines, batches deeper than 1024 reads, an
//! unmap of the source, a dropped batch, either engine shutting down and a
//! per-connection bound of unfinished replies.
//!
//! What every test holds the consumer to: each entry is answered once; an
//! entry answered `Ok` holds exactly its bytes; an entry answered with an
//! error holds nothing but bytes its owner sent for it (a piece that landed
//! before its sibling failed); no byte lands outside an entry's range; and
//! once the batch answered, nothing lands in its destinations and their
//! unmap answers `Ok`.

mod common;

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::list_scene::{Answers, KIB, SCRIBBLE, Slots, WATCH};
use common::raw_am::Raw;
use common::scene::{Gone, SOURCE_LEN, Scene, shut_down_clean};
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, Descriptor, PeerId, RdmaError};
use rdmareg_ucx::read_list::{
    ListReply, ListReplyEntry, ListRequest, MAX_GATHERED_ENTRY, READ_LIST_REPLY_AM_ID,
    READ_LIST_REQUEST_AM_ID,
};
use rdmareg_ucx::read_protocol::{
    BUSY_TEXT, READ_REQUEST_AM_ID, ReadRequest, RemoteRefusal, ReplyStatus, ServedKey,
};
use rdmareg_ucx::{Transport, UcxBackend, UcxEngine};
use ucx_sys as sys;

/// The gathered bound: the first piece's length.
const BOUND: usize = MAX_GATHERED_ENTRY as usize;
/// Lengths a list asks in two pieces: one byte over the bound, odd ones,
/// and twice the bound.
const PIECED: [usize; 4] = [BOUND + 1, 20 * KIB + 3, 24 * KIB + 1, 2 * BOUND];

/// Whether a list's read of `len` bytes goes in pieces over tcp.
fn pieced(len: usize) -> bool {
    (BOUND + 1..=2 * BOUND).contains(&len) || (65_521..=273_738).contains(&len)
}

/// Checks that no byte of `snapshot` outside the entries of `slots` is set.
fn assert_guards(slots: &Slots, snapshot: &[u8], what: &str) {
    let mut inside = vec![false; snapshot.len()];
    for i in 0..slots.lens.len() {
        inside[slots.range(i)].iter_mut().for_each(|b| *b = true);
    }
    let outside = snapshot
        .iter()
        .zip(&inside)
        .filter(|&(&b, &entry)| !entry && b != 0)
        .count();
    assert_eq!(
        outside, 0,
        "{what}: {outside} bytes landed outside every entry"
    );
}

/// Judges `snapshot`, the destination when `answers` came: an `Ok` entry
/// holds exactly `want(i)`; an entry answered with an error holds at each
/// byte nothing or `owned(i)`'s byte there (what its owner sent for it);
/// no byte outside the entries is set. Returns how many were `Ok`.
fn judge(
    slots: &Slots,
    snapshot: &[u8],
    answers: &Answers,
    want: impl Fn(usize) -> Vec<u8>,
    owned: impl Fn(usize) -> Vec<u8>,
    what: &str,
) -> usize {
    assert_eq!(
        answers.len(),
        slots.lens.len(),
        "{what}: one answer per entry"
    );
    let mut ok = 0;
    for (i, answer) in answers.iter().enumerate() {
        let landed = &snapshot[slots.range(i)];
        let len = slots.lens[i];
        if answer.is_ok() {
            ok += 1;
            let wrong = differing_bytes(landed, &want(i));
            assert_eq!(
                wrong, 0,
                "{what}: entry {i} ({len} B) Ok with {wrong} wrong bytes"
            );
        } else {
            let owned = owned(i);
            let foreign = (0..len)
                .filter(|&k| landed[k] != 0 && owned.get(k) != Some(&landed[k]))
                .count();
            assert_eq!(
                foreign, 0,
                "{what}: entry {i} ({len} B) answered {answer:?} holds {foreign} foreign bytes"
            );
        }
    }
    assert_guards(slots, snapshot, what);
    ok
}

/// Waits `wait` without yielding: finer than the runtime's millisecond
/// timer.
fn spin(wait: Duration) {
    let until = std::time::Instant::now() + wait;
    while std::time::Instant::now() < until {
        std::hint::spin_loop();
    }
}

/// Bytes of `buf` that are no longer [`SCRIBBLE`].
fn unscribbled(buf: &PageBuf) -> usize {
    buf.snapshot().iter().filter(|&&b| b != SCRIBBLE).count()
}

// ---------------------------------------------------------------------
// A raw owner answering the pieces by hand.
// ---------------------------------------------------------------------

const RAW_OWNER: PeerId = PeerId(1);
/// Read `i` asks the raw owner for `RAW_BASE + i * RAW_STRIDE`.
const RAW_BASE: u64 = 0x10_0000;
const RAW_STRIDE: u64 = 64 * 1024;
const EAGER_REPLY: u32 = sys::UCP_AM_SEND_FLAG_REPLY | sys::UCP_AM_SEND_FLAG_EAGER;
/// The batch the raw owner answers: every pieced length, around small ones.
const RAW_LENS: [usize; 7] = [
    BOUND + 1,
    4 * KIB,
    20 * KIB + 3,
    7,
    24 * KIB + 1,
    2 * BOUND,
    BOUND,
];

/// Byte `at` of read `i` as the raw owner holds it: never zero.
fn raw_byte(i: usize, at: usize) -> u8 {
    ((i * 37 + at) % 251) as u8 + 1
}

/// One entry of a list reply and the payload it carries.
type Part = (ListReplyEntry, Vec<u8>);

fn raw_bytes(i: usize, range: Range<usize>) -> Vec<u8> {
    range.map(|at| raw_byte(i, at)).collect()
}

/// A consumer engine with a batch of reads of `RAW_LENS` posted to a raw
/// owner, and every list request it received for it.
struct Hostile {
    rt: tokio::runtime::Runtime,
    consumer: UcxEngine,
    owner: Raw,
    slots: Slots,
    batch: Option<tokio::task::JoinHandle<Answers>>,
    asked: Vec<ReadRequest>,
    reply_ep: sys::ucp_ep_h,
}

impl Hostile {
    fn new(deadline: Duration) -> Hostile {
        let rt = runtime();
        let consumer = tcp_engine();
        let owner = Raw::new(false);
        consumer.add_peer(RAW_OWNER, owner.address()).unwrap();
        let backend = consumer.backend();
        let slots = rt.block_on(Slots::new(&backend, &RAW_LENS));
        let key = Bytes::copy_from_slice(
            &ServedKey {
                region_id: 1,
                capability: [0x11; 16],
            }
            .encode(),
        );
        let requests: Vec<BackendGet> = (0..RAW_LENS.len())
            .map(|i| {
                let addr = RAW_BASE + i as u64 * RAW_STRIDE;
                slots.request(i, RAW_OWNER, addr, &key, Some(deadline))
            })
            .collect();
        let batch = rt.spawn(async move { backend.get_batch_into_test_memory(requests).await });
        let pieces: usize = RAW_LENS.iter().map(|&len| 1 + pieced(len) as usize).sum();
        let entries = |raw: &Raw| -> Vec<ReadRequest> {
            let lists = raw.messages(READ_LIST_REQUEST_AM_ID);
            let decoded = lists
                .iter()
                .map(|m| ListRequest::decode(&m.header).unwrap());
            decoded.flat_map(|list| list.entries).collect()
        };
        let all_asked =
            owner.progress_until(Duration::from_secs(5), |r| entries(r).len() >= pieces);
        assert!(
            all_asked,
            "the raw owner got {} of {pieces} pieces",
            entries(&owner).len()
        );
        owner.progress_for(Duration::from_millis(20));
        let asked = entries(&owner);
        assert_eq!(asked.len(), pieces, "every piece asked once, in lists");
        assert!(
            owner.messages(READ_REQUEST_AM_ID).is_empty(),
            "nothing asked alone"
        );
        let reply_ep = owner.messages(READ_LIST_REQUEST_AM_ID)[0].reply_ep;
        Hostile {
            rt,
            consumer,
            owner,
            slots,
            batch: Some(batch),
            asked,
            reply_ep,
        }
    }

    /// Piece `n` of read `i` as asked (the whole read for an unpieced one),
    /// with its offset in the read.
    fn piece(&self, i: usize, n: usize) -> (ReadRequest, usize) {
        let base = RAW_BASE + i as u64 * RAW_STRIDE;
        let mut pieces: Vec<ReadRequest> = self
            .asked
            .iter()
            .copied()
            .filter(|e| (base..base + RAW_STRIDE).contains(&e.address))
            .collect();
        pieces.sort_by_key(|e| e.address);
        let piece = pieces[n];
        (piece, (piece.address - base) as usize)
    }

    /// Piece `n` of read `i` served with `bytes`, under its own id.
    fn served(&self, i: usize, n: usize, bytes: Vec<u8>) -> Part {
        let entry = ListReplyEntry {
            request_id: self.piece(i, n).0.request_id,
            status: ReplyStatus::Served,
            length: bytes.len() as u64,
        };
        (entry, bytes)
    }

    /// Piece `n` of read `i` served with the owner's own bytes.
    fn own(&self, i: usize, n: usize) -> Part {
        let (piece, at) = self.piece(i, n);
        self.served(i, n, raw_bytes(i, at..at + piece.length as usize))
    }

    /// Every piece of read `i` served with the owner's own bytes.
    fn whole(&self, i: usize) -> Vec<Part> {
        (0..1 + pieced(RAW_LENS[i]) as usize)
            .map(|n| self.own(i, n))
            .collect()
    }

    /// Sends one eager list reply of `parts`, their payloads back to back.
    fn reply(&self, parts: Vec<Part>) {
        let entries = parts.iter().map(|(entry, _)| *entry).collect();
        let payload: Vec<u8> = parts.into_iter().flat_map(|(_, bytes)| bytes).collect();
        let header = ListReply { entries }
            .encode()
            .expect("a reply within its bounds");
        self.owner.send_wait(
            self.reply_ep,
            READ_LIST_REPLY_AM_ID,
            &header,
            &payload,
            EAGER_REPLY,
        );
    }

    fn answered(&self) -> bool {
        self.batch.as_ref().is_none_or(|batch| batch.is_finished())
    }

    /// Progresses the raw owner until the batch answers, and judges the
    /// destination as it was then; `Ok` entries must hold `want(i)`.
    fn settle(&mut self, want: impl Fn(usize) -> Vec<u8>, what: &str) -> Answers {
        let batch = self.batch.take().expect("the batch is waited for once");
        let answered = self
            .owner
            .progress_until(Duration::from_secs(5), |_| batch.is_finished());
        assert!(answered, "{what}: the batch did not answer within 5 s");
        let answers = self.rt.block_on(batch).expect("the batch task");
        let snapshot = self.slots.buf.snapshot();
        let owned = |i| raw_bytes(i, 0..RAW_LENS[i]);
        judge(&self.slots, &snapshot, &answers, want, owned, what);
        answers
    }

    /// Once the batch answered: overwrites the whole destination, lets the
    /// raw owner send `late`, and checks nothing changed.
    fn late_replies_land_nothing(&self, late: Vec<Vec<Part>>, what: &str) {
        self.slots.buf.fill(SCRIBBLE);
        for reply in late {
            self.reply(reply);
        }
        self.owner.progress_for(WATCH);
        let changed = unscribbled(&self.slots.buf);
        assert_eq!(
            changed, 0,
            "{what}: {changed} bytes landed after the batch answered"
        );
    }

    /// Unmaps the destination (it must answer `Ok`) and shuts the consumer
    /// down with nothing registered.
    fn end(self) {
        let backend = self.consumer.backend();
        let unmapped = self.rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(5), backend.unmap(self.slots.region)).await
        });
        assert_eq!(unmapped, Ok(Ok(())), "the destination unmaps");
        self.rt.block_on(self.consumer.shutdown());
        assert_eq!(self.consumer.live_registrations(), Some(0));
    }

    /// Every read's pieces, each with the owner's own bytes.
    fn everything(&self) -> Vec<Part> {
        (0..RAW_LENS.len()).flat_map(|i| self.whole(i)).collect()
    }
}

fn own_read(i: usize) -> Vec<u8> {
    raw_bytes(i, 0..RAW_LENS[i])
}

/// The owner answers every first piece and every small read, never a
/// second piece: no pieced entry is answered `Ok`; each answers `Timeout`
/// at its deadline holding exactly its first piece, and the second pieces
/// sent after the answer land nothing.
#[test]
fn an_owner_answering_only_first_pieces_gets_no_entry_answered_ok() {
    let mut list = Hostile::new(Duration::from_millis(300));
    list.reply((0..RAW_LENS.len()).map(|i| list.own(i, 0)).collect());
    let answers = list.settle(own_read, "first pieces only");
    let snapshot = list.slots.buf.snapshot();
    for (i, answer) in answers.iter().enumerate() {
        let len = RAW_LENS[i];
        if pieced(len) {
            assert_eq!(answer, &Err(RdmaError::Timeout), "entry {i} ({len} B)");
            let range = list.slots.range(i);
            let (first, second) = snapshot[range].split_at(BOUND);
            assert!(
                first == raw_bytes(i, 0..BOUND),
                "entry {i}: its first piece landed"
            );
            assert!(
                second.iter().all(|&b| b == 0),
                "entry {i}: its second piece did not"
            );
        } else {
            assert_eq!(answer, &Ok(()), "entry {i} ({len} B)");
        }
    }
    let late = vec![list.everything()];
    list.late_replies_land_nothing(late, "first pieces only");
    list.end();
}

/// The owner answers each pieced read's first piece with the second
/// piece's id and bytes, and the other way round. Where the two pieces
/// are of one length (a 32 KiB read) the halves land swapped inside the
/// entry, `Ok` (the owner decides what its bytes are); elsewhere each
/// piece has the other's length, is refused, and the entry fails holding
/// nothing. No byte lands outside an entry, and the right answers sent
/// afterwards land nothing.
#[test]
fn pieces_answered_under_each_others_ids_land_only_inside_their_own_entry() {
    let mut list = Hostile::new(Duration::from_secs(5));
    let mut crossed = Vec::new();
    for (i, &len) in RAW_LENS.iter().enumerate() {
        if !pieced(len) {
            crossed.extend(list.whole(i));
            continue;
        }
        let (first, second) = (list.own(i, 0), list.own(i, 1));
        crossed.push(list.served(i, 0, second.1));
        crossed.push(list.served(i, 1, first.1));
    }
    list.reply(crossed);
    let swapped = |i: usize| {
        let len = RAW_LENS[i];
        if len == 2 * BOUND {
            [raw_bytes(i, BOUND..len), raw_bytes(i, 0..BOUND)].concat()
        } else {
            own_read(i)
        }
    };
    let answers = list.settle(swapped, "crossed ids");
    let snapshot = list.slots.buf.snapshot();
    for (i, answer) in answers.iter().enumerate() {
        let len = RAW_LENS[i];
        if pieced(len) && len != 2 * BOUND {
            assert!(
                matches!(answer, Err(RdmaError::Backend(_))),
                "entry {i}: {answer:?}"
            );
            let range = list.slots.range(i);
            assert!(
                snapshot[range].iter().all(|&b| b == 0),
                "entry {i} holds nothing"
            );
        } else {
            assert_eq!(answer, &Ok(()), "entry {i} ({len} B)");
        }
    }
    let late = vec![list.everything()];
    list.late_replies_land_nothing(late, "crossed ids");
    list.end();
}

/// Second pieces come first, one of them twice in a row with other bytes,
/// among ids never asked; a later reply brings the first pieces in reverse
/// order, one twice, the second pieces again with foreign bytes, and the
/// small reads. Each piece lands once, from the first answer naming it,
/// every entry is `Ok` with exactly its bytes, and a replay of the whole
/// list after the answer lands nothing.
#[test]
fn pieces_answered_twice_out_of_order_and_among_strangers_land_once_in_place() {
    let mut list = Hostile::new(Duration::from_secs(5));
    let pieced_reads: Vec<usize> = (0..RAW_LENS.len())
        .filter(|&i| pieced(RAW_LENS[i]))
        .collect();
    let highest = list.asked.iter().map(|e| e.request_id).max().unwrap();
    let stranger = |request_id, len: usize| {
        let entry = ListReplyEntry {
            request_id,
            status: ReplyStatus::Served,
            length: len as u64,
        };
        (entry, vec![0xD0; len])
    };
    let mut seconds = vec![stranger(highest + 1, 4097)];
    for &i in &pieced_reads {
        seconds.push(list.own(i, 1));
        seconds.push(stranger(u64::MAX - i as u64, 13));
    }
    let (piece, _) = list.piece(pieced_reads[0], 1);
    seconds.insert(
        2,
        list.served(pieced_reads[0], 1, vec![0xF0; piece.length as usize]),
    );
    seconds.push(stranger(0, BOUND));
    list.reply(seconds);
    list.owner.progress_for(Duration::from_millis(30));
    assert!(
        !list.answered(),
        "the batch answered before its first pieces"
    );
    let mut rest = Vec::new();
    for &i in pieced_reads.iter().rev() {
        rest.push(list.own(i, 0));
        if i == pieced_reads[1] {
            rest.push(list.served(i, 0, vec![0xF1; BOUND]));
        }
        let (piece, _) = list.piece(i, 1);
        rest.push(list.served(i, 1, vec![0xF2; piece.length as usize]));
    }
    for i in (0..RAW_LENS.len()).filter(|&i| !pieced(RAW_LENS[i])) {
        rest.push(stranger(highest + 2 + i as u64, 1));
        rest.extend(list.whole(i));
    }
    list.reply(rest);
    let answers = list.settle(own_read, "repeats");
    assert_eq!(answers, vec![Ok(()); RAW_LENS.len()]);
    let late = vec![list.everything(), list.everything()];
    list.late_replies_land_nothing(late, "repeats");
    list.end();
}

/// One reply refuses one read's second piece (out of range: past the
/// registration's end) and another's first piece, and serves pieces of two
/// more reads with one byte too many and one too few (the payload carrying
/// exactly what the entries claim). Each of those reads fails with its own
/// error, holding at most its other piece; the rest land in place; the
/// right answers sent afterwards land nothing.
#[test]
fn refused_or_missized_pieces_fail_only_their_own_read() {
    let mut list = Hostile::new(Duration::from_secs(5));
    // Reads 0, 2, 4, 5 are pieced (`RAW_LENS`).
    let refused = |list: &Hostile, i, n, refusal| {
        let entry = ListReplyEntry {
            request_id: list.piece(i, n).0.request_id,
            status: ReplyStatus::Refused(refusal),
            length: 0,
        };
        (entry, Vec::new())
    };
    let mut parts = vec![
        list.own(0, 0),
        refused(&list, 0, 1, RemoteRefusal::OutOfRange),
    ];
    parts.push(refused(&list, 2, 0, RemoteRefusal::RegionUnknown));
    parts.push(list.own(2, 1));
    parts.push(list.own(4, 0));
    let (piece, at) = list.piece(4, 1);
    let one_more = at + piece.length as usize + 1;
    parts.push(list.served(4, 1, raw_bytes(4, at..one_more)));
    parts.push(list.served(5, 0, raw_bytes(5, 0..BOUND - 1)));
    parts.push(list.own(5, 1));
    for i in [1, 3, 6] {
        parts.extend(list.whole(i));
    }
    list.reply(parts);
    let answers = list.settle(own_read, "refused pieces");
    assert_eq!(answers[0], Err(RdmaError::OutOfRange));
    assert_eq!(answers[2], Err(RdmaError::RegionNotFound));
    for i in [4, 5] {
        assert!(
            matches!(answers[i], Err(RdmaError::Backend(_))),
            "entry {i}: {:?}",
            answers[i]
        );
    }
    for i in [1, 3, 6] {
        assert_eq!(answers[i], Ok(()), "entry {i}");
    }
    // The piece served beside a failed one stays: bytes of the entry,
    // sent for it while its read was live.
    let snapshot = list.slots.buf.snapshot();
    for (i, first_landed) in [(0, true), (2, false), (4, true), (5, false)] {
        let mut expected = own_read(i);
        let failed = if first_landed {
            BOUND..RAW_LENS[i]
        } else {
            0..BOUND
        };
        expected[failed].fill(0);
        assert!(
            snapshot[list.slots.range(i)] == expected,
            "entry {i}: only its served piece"
        );
    }
    let late = vec![list.everything()];
    list.late_replies_land_nothing(late, "refused pieces");
    list.end();
}

/// The consumer shuts down after the owner answered only the first pieces
/// and the small reads: the small reads stay `Ok`, every pieced entry
/// answers `ShuttingDown` holding at most its first piece, nothing changes
/// afterwards and the destination's registration is gone. (The raw owner
/// sends nothing after the shutdown: see `list_replies_from_a_hostile_owner`.)
#[test]
fn a_consumer_shut_down_between_the_pieces_of_its_reads_answers_them_shutting_down() {
    let mut list = Hostile::new(Duration::from_secs(30));
    list.reply((0..RAW_LENS.len()).map(|i| list.own(i, 0)).collect());
    list.owner.progress_for(Duration::from_millis(20));
    assert!(
        !list.answered(),
        "the batch answered without its second pieces"
    );
    list.rt.block_on(list.consumer.shutdown());
    let answers = list.settle(own_read, "consumer shutdown");
    for (i, answer) in answers.iter().enumerate() {
        let expected = if pieced(RAW_LENS[i]) {
            Err(RdmaError::ShuttingDown)
        } else {
            Ok(())
        };
        assert_eq!(answer, &expected, "entry {i}");
    }
    list.slots.buf.fill(SCRIBBLE);
    list.owner.progress_for(WATCH);
    assert_eq!(unscribbled(&list.slots.buf), 0, "nothing lands after");
    assert_eq!(
        list.rt
            .block_on(list.consumer.backend().unmap(list.slots.region)),
        Ok(())
    );
    assert_eq!(list.consumer.live_registrations(), Some(0));
}

// ---------------------------------------------------------------------
// An owner engine.
// ---------------------------------------------------------------------

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
        let before = scene.consumer.reads_asked_in_pieces();
        let answers = scene
            .cb
            .get_batch_into_test_memory(requests(&slots, &scene.source, at, None))
            .await;
        let snapshot = slots.buf.snapshot();
        let what = format!("round {round}");
        assert_eq!(answers, vec![Ok(()); lens.len()], "{what}");
        judge_source(&slots, &snapshot, &answers, &scene.want, at, &what);
        let split = scene.consumer.reads_asked_in_pieces() - before;
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
    assert_eq!(scene.consumer.reads_asked_in_pieces(), 512);
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
/// flight once the unmap confirmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owners_unmap_mid_batch_serves_no_piece_after_it_confirmed() {
    let lens: Vec<usize> = (0..24).map(|i| [PIECED[i % 4], 4 * KIB][i % 2]).collect();
    let (mut served, mut refused) = (0, 0);
    for (round, delay_us) in [0u64, 60, 150, 300, 700, 1500].into_iter().enumerate() {
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
                let answers = cb.get_batch_into_test_memory(requests.clone()).await;
                assert_eq!(answers, vec![Ok(()); lens.len()], "round {round}: warm-up");
                warm.send(()).unwrap();
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
        warmed.await.expect("the reader warmed up");
        tokio::time::sleep(Duration::from_micros(delay_us)).await;
        assert_eq!(ob.unmap(src_region.backend_region_id).await, Ok(()));
        assert_eq!(
            owner.served_replies_in_flight(),
            0,
            "round {round}: replies in flight"
        );
        src.fill(0);
        unmapped.store(true, Ordering::Release);
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
