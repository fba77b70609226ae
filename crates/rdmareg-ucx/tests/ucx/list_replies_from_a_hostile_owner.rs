//! Lists answered in several replies, by a hostile owner.
//!
//! Over tcp a consumer asks a whole list (up to 64 reads, 256 KiB) in one
//! request and the owner answers it in replies of at most one fragment's
//! payload each; the consumer lands each entry by its request id, whichever
//! reply brings it. Each entry keeps its own lease, hold, deadline and
//! answer. A raw owner here answers entries with the wrong number of
//! bytes, and a reply with fewer bytes than its entries claim: how the
//! UCX driver walks a reply's payload to each entry's place is its own.
//! (`list_replies_from_a_real_owner.rs` attacks the seams between the
//! replies of one list with an owner engine; entries answered twice, with
//! ids never asked, after their deadline or while the consumer shuts down
//! are the engine kit's deterministic scenarios, `rdmareg-engine`'s
//! `served::scenarios::lists` and `deadlines`.)
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
use rdmareg_core::{BackendGet, PeerId, RdmaError};
use rdmareg_ucx::UcxEngine;
use rdmareg_ucx::read_list::{
    ListReply, ListReplyEntry, ListRequest, MAX_LIST_ENTRIES, READ_LIST_REPLY_AM_ID,
    READ_LIST_REQUEST_AM_ID,
};
use rdmareg_ucx::read_protocol::{ReadRequest, ReplyStatus, ServedKey};
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
