//! Lists answered in several replies, by a hostile owner.
//!
//! Over tcp a consumer asks a whole list (up to 64 reads, 256 KiB) in one
//! request and the owner answers it in replies of at most one fragment's
//! payload each; the consumer lands each entry by its request id, whichever
//! reply brings it. Each entry keeps its own lease, hold, deadline and
//! answer. These tests attack the seams between the replies of one list
//! from the owner's side: a raw owner answering entries twice, with ids
//! never asked, with the wrong number of bytes, after their deadline or
//! while the consumer shuts down. (`list_replies_from_a_real_owner.rs`
//! attacks the same seams with an owner engine.)
//!
//! What every test holds the consumer engine to: an entry is answered
//! once, `Ok` only with exactly its own bytes; an entry answered with an
//! error holds none of its bytes (an eager entry lands whole inside the
//! reply handler or not at all) and no byte of it changes afterwards; no
//! byte lands outside an entry's range.

use crate::common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::list_scene::*;
use common::raw_am::Raw;
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, PeerId, RdmaError};
use rdmareg_ucx::UcxEngine;
use rdmareg_ucx::read_list::{
    ListReply, ListReplyEntry, ListRequest, MAX_LIST_ENTRIES, READ_LIST_REPLY_AM_ID,
    READ_LIST_REQUEST_AM_ID,
};
use rdmareg_ucx::read_protocol::{ReadRequest, Refusal, ReplyStatus, ServedKey};
use ucx_sys as sys;

const RAW_OWNER: PeerId = PeerId(1);
/// Where the raw owner's reads point: a made-up address.
const RAW_BASE: u64 = 0x10_0000;
const EAGER_REPLY: u32 = sys::UCP_AM_SEND_FLAG_REPLY | sys::UCP_AM_SEND_FLAG_EAGER;

fn raw_key() -> Bytes {
    Bytes::copy_from_slice(
        &ServedKey {
            region_id: 1,
            capability: [0x11; 16],
        }
        .encode(),
    )
}

/// Entry `i`'s own bytes in the raw owner's replies.
fn own_byte(i: usize) -> u8 {
    (i % 200) as u8 + 1
}

fn served_as(request_id: u64, length: usize) -> ListReplyEntry {
    ListReplyEntry {
        request_id,
        status: ReplyStatus::Served,
        length: length as u64,
    }
}

/// Checks entry `i` of `answers` is `expected(i)`, for every entry.
fn assert_each(
    answers: &[Result<(), RdmaError>],
    expected: impl Fn(usize) -> Result<(), RdmaError>,
) {
    for (i, answer) in answers.iter().enumerate() {
        assert_eq!(answer, &expected(i), "entry {i}");
    }
}

/// A consumer engine whose [`RAW_OWNER`] is a raw peer, a batch of
/// `lens.len()` reads to it posted, and the one list request the raw owner
/// received for it (with the endpoint to answer on).
struct RawList {
    rt: tokio::runtime::Runtime,
    consumer: UcxEngine,
    owner: Raw,
    slots: Slots,
    batch: Option<tokio::task::JoinHandle<Answers>>,
    request: ListRequest,
    reply_ep: sys::ucp_ep_h,
}

impl RawList {
    /// Posts reads of `lens` to a raw owner, entry `i` due in
    /// `deadline(i)`, and waits for their list request.
    fn new(lens: &[usize], deadline: impl Fn(usize) -> Duration) -> RawList {
        let rt = runtime();
        let consumer = tcp_engine();
        let owner = Raw::new(false);
        consumer.add_peer(RAW_OWNER, owner.address()).unwrap();
        let backend = consumer.backend();
        let slots = rt.block_on(Slots::new(&backend, lens));
        let key = raw_key();
        let requests: Vec<BackendGet> = (0..lens.len())
            .map(|i| {
                slots.request(
                    i,
                    RAW_OWNER,
                    RAW_BASE + (i * 16 * KIB) as u64,
                    &key,
                    Some(deadline(i)),
                )
            })
            .collect();
        let batch = rt.spawn(async move { backend.get_batch_into_test_memory(requests).await });
        assert!(
            owner.progress_until(Duration::from_secs(5), |r| {
                !r.messages(READ_LIST_REQUEST_AM_ID).is_empty()
            }),
            "no list request reached the raw owner"
        );
        // Let any further request of the batch arrive too.
        owner.progress_for(Duration::from_millis(20));
        let (request, reply_ep, lists) = {
            let messages = owner.messages(READ_LIST_REQUEST_AM_ID);
            (
                ListRequest::decode(&messages[0].header).expect("a well-formed list request"),
                messages[0].reply_ep,
                messages.len(),
            )
        };
        assert_eq!(lists, 1, "the batch asked in one list request");
        assert_eq!(request.entries.len(), lens.len(), "every read in the list");
        RawList {
            rt,
            consumer,
            owner,
            slots,
            batch: Some(batch),
            request,
            reply_ep,
        }
    }

    fn entry(&self, i: usize) -> &ReadRequest {
        &self.request.entries[i]
    }

    /// Sends one list reply of `entries` with `payload` on the request's
    /// endpoint, eager.
    fn reply(&self, entries: Vec<ListReplyEntry>, payload: &[u8]) {
        self.owner.send_wait(
            self.reply_ep,
            READ_LIST_REPLY_AM_ID,
            &ListReply { entries }
                .encode()
                .expect("a reply within its bounds"),
            payload,
            EAGER_REPLY,
        );
    }

    /// One reply serving each entry `i` of `entries` at its asked length,
    /// every byte of it `b`, in the order given.
    fn reply_bytes(&self, entries: impl IntoIterator<Item = (usize, u8)>) {
        let (mut served, mut payload) = (Vec::new(), Vec::new());
        for (i, b) in entries {
            let asked = self.entry(i);
            served.push(served_as(asked.request_id, asked.length as usize));
            payload.extend(vec![b; asked.length as usize]);
        }
        self.reply(served, &payload);
    }

    /// One reply serving `entries` with their own bytes.
    fn reply_own(&self, entries: impl IntoIterator<Item = usize>) {
        self.reply_bytes(entries.into_iter().map(|i| (i, own_byte(i))));
    }

    fn answered(&self) -> bool {
        self.batch.as_ref().is_none_or(|batch| batch.is_finished())
    }

    /// Progresses the raw owner until the batch answers (at most 5 s), and
    /// judges the destination as it is then against each entry's own
    /// bytes: the answers, that snapshot and how many answered `Ok`.
    fn settle(&mut self, what: &str) -> (Answers, Vec<u8>, usize) {
        let within = Duration::from_secs(5);
        let batch = self.batch.take().expect("the batch is waited for once");
        let start = Instant::now();
        while !batch.is_finished() && start.elapsed() < within {
            self.owner.progress_for(Duration::from_millis(2));
        }
        assert!(
            batch.is_finished(),
            "the batch did not answer within {within:?}"
        );
        let answers = self.rt.block_on(batch).expect("the batch task");
        let snapshot = self.slots.buf.snapshot();
        let ok = self.slots.judge(
            &snapshot,
            &answers,
            |i| vec![own_byte(i); self.slots.lens[i]],
            what,
        );
        (answers, snapshot, ok)
    }

    /// Progresses the raw owner for `watch`, then checks no entry of
    /// `failed` (scribbled over) changed.
    fn assert_quiet(&self, failed: &[usize], watch: Duration, what: &str) {
        self.owner.progress_for(watch);
        self.slots.assert_unchanged_since_scribbled(failed, what);
    }

    /// Unmaps the destination (it must answer `Ok`), shuts the consumer
    /// down and checks it holds no registration.
    fn end(self) {
        unmap_and_shut_down(&self.rt, &self.consumer, self.slots.region);
        drop(self.owner);
    }
}

/// The raw owner answers a list in three replies, entries answered again in
/// a later reply (with other bytes) and twice within one reply, among
/// entries answered for the first time. Each read lands once, from the
/// first reply that names it, and the entries after a repeated one still
/// take their own place in the payload.
#[test]
fn an_entry_answered_again_in_a_later_reply_of_the_same_list_lands_once_from_the_first() {
    let mut list = RawList::new(&scatter_lens(), |_| Duration::from_secs(5));
    // Reply 1: entries 0..15.
    list.reply_own(0..15);
    // Reply 2: entries 10..30, of which 10..15 again with foreign bytes.
    list.reply_bytes((10..30).map(|i| (i, if i < 15 { 0xF0 } else { own_byte(i) })));
    list.owner.progress_for(Duration::from_millis(50));
    assert!(
        !list.answered(),
        "the batch answered before its last entries"
    );
    // Reply 3: 40 named twice in a row, then 30..64, and 0 at the end.
    let mut third: Vec<(usize, u8)> = vec![(40, own_byte(40)), (40, 0xF1)];
    third.extend((30..64).filter(|&i| i != 40).map(|i| (i, own_byte(i))));
    third.push((0, 0xF2));
    // Past one fragment: the consumer's UCX gathers it, which lands the same.
    list.reply_bytes(third);
    let (answers, snapshot, ok) = list.settle("repeats");
    assert_eq!(ok, MAX_LIST_ENTRIES, "{answers:?}");
    let failed = list.slots.scribble_failed(&answers);
    assert!(failed.is_empty());
    // The same replies again, once every read answered: nothing moves.
    list.reply_bytes((0..15).map(|i| (i, 0xF3)));
    list.owner.progress_for(WATCH);
    assert_eq!(
        list.slots.buf.snapshot(),
        snapshot,
        "a replay changed a byte"
    );
    list.end();
}

/// Replies of one list that also name request ids the consumer never
/// asked (past the list's, zero, `u64::MAX`) with lengths of their own: the
/// strangers land nothing anywhere, and every real entry lands its own
/// bytes from its own place in the payload after them.
#[test]
fn entries_naming_ids_never_asked_land_nothing_and_shift_no_real_entry() {
    let mut list = RawList::new(&scatter_lens(), |_| Duration::from_secs(5));
    let len = 4 * KIB;
    let highest = list
        .request
        .entries
        .iter()
        .map(|e| e.request_id)
        .max()
        .unwrap();
    let strangers = [highest + 1, highest + 1000, 0, u64::MAX, highest + 64];
    let stranger_lens = [1usize, 4096, 8191, 16 * KIB, 4095];
    for part in 0..4usize {
        let mut entries = Vec::new();
        let mut payload = Vec::new();
        for (n, i) in (part * 16..part * 16 + 16).enumerate() {
            if n % 3 == 0 {
                let s = (part + n) % strangers.len();
                entries.push(served_as(strangers[s], stranger_lens[s]));
                payload.extend(vec![0xD0; stranger_lens[s]]);
            }
            entries.push(served_as(list.entry(i).request_id, len));
            payload.extend(vec![own_byte(i); len]);
        }
        // A refused stranger, too.
        entries.push(ListReplyEntry {
            request_id: highest + 7,
            status: ReplyStatus::Refused(Refusal::RegionUnknown),
            length: 0,
        });
        list.reply(entries, &payload);
    }
    let (answers, _, ok) = list.settle("strangers");
    assert_eq!(ok, MAX_LIST_ENTRIES, "{answers:?}");
    list.end();
}

/// Across the replies of one list, entries that carry one byte more, one
/// byte less or no bytes at all for a 4 KiB read fail alone (typed, nothing
/// landed), and a whole reply whose entries add up to one byte more than
/// its payload lands none of its entries; the entries of the other replies
/// land their own bytes in place.
#[test]
fn entries_carrying_the_wrong_byte_count_fail_alone_and_neighbours_land_in_place() {
    let mut list = RawList::new(&scatter_lens(), |_| Duration::from_secs(5));
    let len = 4 * KIB;
    let wrong: [(usize, usize); 3] = [(5, len + 1), (20, len - 1), (35, 0)];
    let claimed = |i: usize| wrong.iter().find(|w| w.0 == i).map_or(len, |w| w.1);
    // Replies of 15 entries, as a real owner cuts them; the fourth
    // (45..60) claims one byte more than it carries.
    let parts: Vec<std::ops::Range<usize>> = vec![0..15, 15..30, 30..45, 45..60, 60..64];
    for (p, part) in parts.iter().enumerate() {
        let entries: Vec<ListReplyEntry> = part
            .clone()
            .map(|i| served_as(list.entry(i).request_id, claimed(i)))
            .collect();
        let mut payload: Vec<u8> = part
            .clone()
            .flat_map(|i| vec![own_byte(i); claimed(i)])
            .collect();
        if p == 3 {
            payload.pop();
        }
        list.reply(entries, &payload);
    }
    let (answers, _, ok) = list.settle("wrong lengths");
    for (i, answer) in answers.iter().enumerate() {
        let bad = wrong.iter().any(|w| w.0 == i) || parts[3].contains(&i);
        if bad {
            assert!(
                matches!(answer, Err(RdmaError::Backend(_))),
                "entry {i}: {answer:?}"
            );
        } else {
            assert_eq!(answer, &Ok(()), "entry {i}");
        }
    }
    assert_eq!(ok, MAX_LIST_ENTRIES - wrong.len() - parts[3].len());
    let failed = list.slots.scribble_failed(&answers);
    // The failed entries answered again, properly this time: nothing moves.
    for part in [0..15usize, 45..60] {
        list.reply_own(part);
    }
    list.assert_quiet(&failed, WATCH, "wrong lengths");
    list.end();
}

/// A list whose even entries are due in 150 ms and odd ones in 5 s: the
/// owner answers the first 21 entries at once and the rest only after the
/// even deadlines passed, then answers every entry again. The late reply
/// lands only the odd entries; the expired ones hold nothing at their
/// answer and not one byte of them changes after it.
#[test]
fn replies_after_some_entries_of_the_list_timed_out_land_only_the_live_ones() {
    let mut list = RawList::new(&scatter_lens(), |i| {
        if i % 2 == 0 {
            Duration::from_millis(150)
        } else {
            Duration::from_secs(5)
        }
    });
    list.reply_own(0..21);
    list.owner.progress_for(Duration::from_millis(400));
    // Replies of at most 15 entries for the rest.
    for chunk in (21..64).collect::<Vec<usize>>().chunks(15) {
        list.reply_own(chunk.iter().copied());
    }
    let (answers, _, _) = list.settle("late replies");
    assert_each(&answers, |i| {
        if i < 21 || i % 2 == 1 {
            Ok(())
        } else {
            Err(RdmaError::Timeout)
        }
    });
    let failed = list.slots.scribble_failed(&answers);
    // Every entry again, after every answer.
    for chunk in (0..64).collect::<Vec<usize>>().chunks(15) {
        list.reply_bytes(chunk.iter().map(|&i| (i, 0xC0)));
    }
    list.assert_quiet(&failed, WATCH, "late replies");
    list.end();
}

/// The consumer engine shuts down after the first reply of a list landed:
/// the entries it brought stay `Ok` with their bytes, every other entry
/// answers `ShuttingDown` holding nothing, and nothing changes afterwards.
/// (The raw owner does not send the rest after the shutdown: its reply
/// endpoint has no error handling, and sending on it to a worker that is
/// gone is undefined in UCX; see `adversarial_gathered.rs`.)
#[test]
fn a_consumer_shut_down_between_the_replies_of_a_list_answers_the_rest_shutting_down() {
    let mut list = RawList::new(&scatter_lens(), |_| Duration::from_secs(30));
    list.reply_own(0..15);
    list.owner.progress_for(Duration::from_millis(20));
    list.rt.block_on(list.consumer.shutdown());
    let (answers, _, _) = list.settle("shutdown");
    assert_each(&answers, |i| {
        if i < 15 {
            Ok(())
        } else {
            Err(RdmaError::ShuttingDown)
        }
    });
    let failed = list.slots.scribble_failed(&answers);
    list.assert_quiet(&failed, Duration::from_millis(200), "shutdown");
    let unmapped = list
        .rt
        .block_on(list.consumer.backend().unmap(list.slots.region));
    assert_eq!(unmapped, Ok(()));
    assert_eq!(list.consumer.live_registrations(), Some(0));
}
