//! A list's reads of 16 to 32 KiB asked in two gathered pieces, answered
//! by a hostile owner.
//!
//! Over an endpoint whose every lane is tcp, a read of a batch of two or
//! more that is longer than the gathered bound (`MAX_GATHERED_ENTRY`,
//! 16 KiB) and at most twice it goes as two reads, 16 KiB and the rest,
//! each gathered into the list requests with the batch's small reads and
//! answered by the owner like any gathered entry; the caller sees one
//! answer per entry (`progress::pieces`). These tests attack that from the
//! owner's side: a raw owner answering the pieces by hand (only first
//! pieces, crossed ids, twice, out of order across replies, with ids never
//! asked, refused, with wrong lengths, while the consumer shuts down).
//! (`list_pieces_from_a_real_owner.rs` attacks the same pieces with an
//! owner engine.)
//!
//! What every test holds the consumer to: each entry is answered once; an
//! entry answered `Ok` holds exactly its bytes; an entry answered with an
//! error holds nothing but bytes its owner sent for it (a piece that landed
//! before its sibling failed); no byte lands outside an entry's range; and
//! once the batch answered, nothing lands in its destinations and their
//! unmap answers `Ok`.

use crate::common;

use std::ops::Range;
use std::time::Duration;

use bytes::Bytes;
use common::list_pieces::{BOUND, judge, pieced, unscribbled};
use common::list_scene::{Answers, KIB, SCRIBBLE, Slots, WATCH, unmap_and_shut_down};
use common::raw_am::Raw;
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, PeerId, RdmaError};
use rdmareg_ucx::UcxEngine;
use rdmareg_ucx::read_list::{
    ListReply, ListReplyEntry, ListRequest, READ_LIST_REPLY_AM_ID, READ_LIST_REQUEST_AM_ID,
};
use rdmareg_ucx::read_protocol::{
    READ_REQUEST_AM_ID, ReadRequest, Refusal, ReplyStatus, ServedKey,
};
use ucx_sys as sys;

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
        unmap_and_shut_down(&self.rt, &self.consumer, self.slots.region);
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
    let mut parts = vec![list.own(0, 0), refused(&list, 0, 1, Refusal::OutOfRange)];
    parts.push(refused(&list, 2, 0, Refusal::RegionUnknown));
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
