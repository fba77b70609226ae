//! Write list replies from an owner that does not play by the rules: a raw
//! UCX peer receives a real writer's write list and answers it from other
//! endpoints, for ids never listed, with the wrong lengths, with payload
//! bytes, with refusals, with headers that do not decode, twice, or only
//! in part.
//!
//! What every test holds the writer engine to (the writer machine's rules,
//! `rdmareg_engine::served::writer`): a PUT answers `Ok` only on a reply
//! entry from the endpoint its list went out on, naming it, saying exactly
//! its length was written, in a reply without payload; the first entry
//! taken for a PUT is its answer; a PUT no entry answers times out; and
//! every PUT of the batch is answered once.

use crate::common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::raw_am::Raw;
use common::write_lists::*;
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendPut, BackendRegion, RdmaError};
use rdmareg_engine::served::Write;
use rdmareg_engine::served::wire::{self, WRITE_REQUEST_ID_BIT};
use rdmareg_ucx::UcxEngine;
use rdmareg_ucx::read_protocol::{
    READ_REPLY_AM_ID, ServedKey, WRITE_LIST_REPLY_AM_ID, WRITE_LIST_REQUEST_AM_ID,
};
use ucx_sys as sys;

const KIB: usize = 1024;
const EAGER_REPLY: u32 = sys::UCP_AM_SEND_FLAG_REPLY | sys::UCP_AM_SEND_FLAG_EAGER;
const RNDV_REPLY: u32 = sys::UCP_AM_SEND_FLAG_REPLY | sys::UCP_AM_SEND_FLAG_RNDV;

type Answers = Vec<Result<(), RdmaError>>;

/// A writer engine whose [`OWNER`] is a raw peer, a batch of PUTs to it
/// posted, and the one write list the raw owner received for it.
struct RawOwner {
    rt: tokio::runtime::Runtime,
    writer: UcxEngine,
    owner: Raw,
    src: PageBuf,
    src_region: BackendRegion,
    batch: Option<tokio::task::JoinHandle<Answers>>,
    entries: Vec<Write>,
    reply_ep: sys::ucp_ep_h,
}

impl RawOwner {
    /// Posts `count` PUTs of 1 KiB (entry `i` of `KIB + i` bytes) to a raw
    /// owner, each due in `deadline`, and waits for their write list.
    fn new(count: usize, deadline: Duration) -> RawOwner {
        init_tracing();
        let rt = runtime();
        let writer = tcp_engine();
        let owner = Raw::new(false);
        writer.add_peer(OWNER, owner.address()).unwrap();
        let backend = writer.backend();
        let src = PageBuf::filled(count * 2 * KIB, pattern);
        let src_region = rt.block_on(map(&backend, &src));
        let key = Bytes::copy_from_slice(
            &ServedKey {
                region_id: 1,
                capability: [0x11; 16],
            }
            .encode(),
        );
        let requests: Vec<BackendPut> = (0..count)
            .map(|i| BackendPut {
                deadline: Some(deadline),
                ..put_request(
                    &src_region,
                    (i * 2 * KIB) as u64,
                    0x10_0000 + (i * 4 * KIB) as u64,
                    key.clone(),
                    KIB + i,
                )
            })
            .collect();
        let batch = rt.spawn({
            let backend = backend.clone();
            // SAFETY: the sources are `src`, mapped on the writer and alive
            // until after the batch answered (`settle`); nothing writes it.
            async move { unsafe { backend.put_batch(requests) }.await }
        });
        assert!(
            owner.progress_until(Duration::from_secs(10), |raw| {
                !raw.messages(WRITE_LIST_REQUEST_AM_ID).is_empty()
            }),
            "no write list reached the raw owner"
        );
        owner.progress_for(Duration::from_millis(20));
        let (entries, reply_ep, lists) = {
            let messages = owner.messages(WRITE_LIST_REQUEST_AM_ID);
            (
                wire::decode_write_list_request(&messages[0].header).expect("a write list"),
                messages[0].reply_ep,
                messages.len(),
            )
        };
        assert_eq!(lists, 1, "the batch went in one write list");
        assert_eq!(entries.len(), count, "every PUT in the list");
        RawOwner {
            rt,
            writer,
            owner,
            src,
            src_region,
            batch: Some(batch),
            entries,
            reply_ep,
        }
    }

    fn id(&self, i: usize) -> u64 {
        self.entries[i].request_id
    }

    fn len(&self, i: usize) -> u64 {
        self.entries[i].length
    }

    /// Sends a write list reply of `(id, status, length)` entries with
    /// `payload` from `raw` on `ep`.
    fn reply_from(
        raw: &Raw,
        ep: sys::ucp_ep_h,
        entries: &[(u64, u8, u64)],
        payload: &[u8],
        flags: u32,
    ) {
        let header = wire::encode_list_reply_fields(entries.iter().copied())
            .expect("a reply within its bounds");
        raw.send_wait(ep, WRITE_LIST_REPLY_AM_ID, &header, payload, flags);
    }

    /// A reply on the list's own endpoint.
    fn reply(&self, entries: &[(u64, u8, u64)]) {
        Self::reply_from(&self.owner, self.reply_ep, entries, &[], EAGER_REPLY);
    }

    /// Entries `range` acknowledged with their lengths.
    fn honest(&self, range: std::ops::Range<usize>) -> Vec<(u64, u8, u64)> {
        range.map(|i| (self.id(i), 0, self.len(i))).collect()
    }

    /// Progresses the raw owner until the batch answers (at most 10 s).
    fn settle(&mut self) -> Answers {
        let batch = self.batch.take().expect("the batch is waited for once");
        let start = Instant::now();
        while !batch.is_finished() && start.elapsed() < Duration::from_secs(10) {
            self.owner.progress_for(Duration::from_millis(2));
        }
        assert!(batch.is_finished(), "the batch did not answer within 10 s");
        let answers = self.rt.block_on(batch).expect("the batch task");
        assert_eq!(answers.len(), self.entries.len(), "one answer per PUT");
        answers
    }

    /// Unmaps the source (it must answer `Ok`: no PUT holds it any more),
    /// shuts the writer down and checks it holds no registration.
    fn end(self) {
        let backend = self.writer.backend();
        let unmapped = self.rt.block_on(async {
            tokio::time::timeout(
                Duration::from_secs(10),
                backend.unmap(self.src_region.backend_region_id),
            )
            .await
        });
        assert_eq!(unmapped, Ok(Ok(())), "the source's unmap");
        self.rt.block_on(self.writer.shutdown());
        assert_eq!(self.writer.live_registrations(), Some(0));
        drop(self.owner);
        drop(self.src);
    }
}

fn is_backend(answer: &Result<(), RdmaError>) -> bool {
    matches!(answer, Err(RdmaError::Backend(_)))
}

/// Replies that name a list's PUTs and say they were written, sent by a
/// peer other than the owner the list went to (another worker, as a list
/// reply and as single writes' replies), are not taken: the PUTs they name
/// time out (`Timeout`, never `Ok`); the owner then acknowledges the first
/// four on the list's endpoint and those answer `Ok`. (A second endpoint
/// the owner's own worker makes to the writer is matched by UCX to the
/// same connection: that is the owner answering, not another peer.)
#[test]
fn replies_from_another_peer_are_not_taken() {
    let mut list = RawOwner::new(8, Duration::from_millis(1500));
    let forger = Raw::new(false);
    let forger_ep = forger.connect(&serving(&list.writer));
    let all = list.honest(0..8);
    RawOwner::reply_from(&forger, forger_ep, &all, &[], EAGER_REPLY);
    for (id, _, len) in &all {
        let header = wire::encode_reply_fields(*id, 0, *len);
        forger.send_wait(forger_ep, READ_REPLY_AM_ID, &header, &[], EAGER_REPLY);
    }
    list.reply(&list.honest(0..4));
    let answers = list.settle();
    drop(forger);
    for (i, answer) in answers.iter().enumerate() {
        let want = if i < 4 {
            Ok(())
        } else {
            Err(RdmaError::Timeout)
        };
        assert_eq!(*answer, want, "PUT {i}");
    }
    list.end();
}

/// One list of 16 PUTs answered by a hostile owner, each PUT's story its
/// own: replies naming only ids never listed change nothing; entries
/// claiming one byte more, one less, none or all of memory fail the PUT
/// (a transient backend error); entries in a reply that carries payload
/// bytes, eager or by rendezvous, fail theirs; refusals answer their
/// typed errors; a reply whose header does not decode is not taken, and
/// an honest one after it is; and of two replies to one PUT the first is
/// its answer. Honest replies after the hostile ones change nothing.
#[test]
fn hostile_entries_never_answer_ok() {
    let mut list = RawOwner::new(16, Duration::from_secs(10));
    let (id, len) = (|i: usize| list.id(i), |i: usize| list.len(i));
    // Ids never listed: another write's, a read's, none.
    list.reply(&[
        (id(15) + 1000, 0, len(0)),
        (id(0) & !WRITE_REQUEST_ID_BIT, 0, len(0)),
        (0, 0, 0),
        (WRITE_REQUEST_ID_BIT, 0, 0),
    ]);
    list.reply(&[
        (id(0), 0, len(0) + 1),
        (id(1), 0, len(1) - 1),
        (id(2), 0, 0),
        (id(3), 0, u64::MAX),
    ]);
    RawOwner::reply_from(
        &list.owner,
        list.reply_ep,
        &list.honest(4..6),
        &[0],
        EAGER_REPLY,
    );
    RawOwner::reply_from(
        &list.owner,
        list.reply_ep,
        &list.honest(6..8),
        &vec![0xEE; 64 * KIB],
        RNDV_REPLY,
    );
    list.reply(&[(id(8), 1, 0), (id(9), 3, 0), (id(10), 8, 0), (id(11), 6, 0)]);
    let mut undecodable = wire::encode_list_reply_fields(list.honest(12..14).into_iter()).unwrap();
    undecodable[0] = 2;
    list.owner.send_wait(
        list.reply_ep,
        WRITE_LIST_REPLY_AM_ID,
        &undecodable,
        &[],
        EAGER_REPLY,
    );
    list.reply(&list.honest(12..14));
    list.reply(&[(id(14), 6, 0), (id(15), 0, len(15))]);
    list.reply(&[(id(14), 0, len(14)), (id(15), 8, 0)]);
    // Everything again, honestly: taken by none.
    list.reply(&list.honest(0..16));
    let answers = list.settle();
    let denied = Err(RdmaError::AccessDenied { operation: "write" });
    for (i, answer) in answers.iter().enumerate() {
        match i {
            0..8 | 11 | 14 => assert!(is_backend(answer), "PUT {i}: {answer:?}"),
            8 => assert_eq!(*answer, Err(RdmaError::RegionNotFound), "PUT {i}"),
            9 => assert_eq!(*answer, Err(RdmaError::OutOfRange), "PUT {i}"),
            10 => assert_eq!(*answer, denied, "PUT {i}"),
            _ => assert_eq!(*answer, Ok(()), "PUT {i}"),
        }
    }
    list.end();
}

/// An owner that acknowledges half a list and falls silent: those PUTs
/// answer `Ok`, the rest `Timeout` at their deadline (never `Ok`); their
/// acknowledgement after the deadline changes nothing, and the source's
/// unmap answers.
#[test]
fn a_half_answered_list_times_out_the_rest() {
    let mut list = RawOwner::new(12, Duration::from_millis(1500));
    list.reply(&list.honest(0..6));
    let answers = list.settle();
    list.reply(&list.honest(6..12));
    list.owner.progress_for(Duration::from_millis(50));
    for (i, answer) in answers.iter().enumerate() {
        let want = if i < 6 {
            Ok(())
        } else {
            Err(RdmaError::Timeout)
        };
        assert_eq!(*answer, want, "PUT {i}");
    }
    list.end();
}
