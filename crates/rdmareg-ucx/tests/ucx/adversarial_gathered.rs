//! Gathered reads against hostile peers: a peer answering another owner's
//! list; an owner that answers a list by rendezvous where eager is
//! promised, with a stalled single rendezvous where a list reply is due,
//! or with malformed list replies; a consumer that asks for maximal lists
//! and then never reads the replies; an owner lost mid-list or gone
//! before it. After each, the answers are typed, no destination byte
//! changes after its answer, unmaps answer `Ok` only once the owner let go
//! of the memory, and the backends count nothing left. (Replays,
//! duplicates, crossed formats, hostile entries and deadlines within a
//! list are the engine kit's deterministic scenarios, `rdmareg-engine`'s
//! `served::scenarios`.)
//!
//! Each test plays the hostile side with a raw UCX peer (`common::raw_am`).

use crate::common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::raw_am::Raw;
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, PeerId, RdmaError};
use rdmareg_ucx::UcxEngine;
use rdmareg_ucx::read_list::{
    ListReply, ListReplyEntry, ListRequest, MAX_GATHERED_BYTES, MAX_GATHERED_ENTRY,
    MAX_LIST_ENTRIES, READ_LIST_REPLY_AM_ID, READ_LIST_REQUEST_AM_ID,
};
use rdmareg_ucx::read_protocol::{
    READ_REPLY_AM_ID, ReadReply, ReadRequest, Refusal, ReplyStatus, ServedKey,
};
use ucx_sys as sys;

const RAW_OWNER: PeerId = PeerId(1);
const READ_LEN: u64 = 64;

type Answers = Vec<Result<(), RdmaError>>;

/// `entries` reads of `READ_LEN` bytes from `RAW_OWNER`, posted as one batch
/// into consecutive slices of `dest` (mapped here); returns the batch's task
/// and the destination's region id.
fn batch_to_raw_owner(
    rt: &tokio::runtime::Runtime,
    consumer: &UcxEngine,
    dest: &PageBuf,
    entries: usize,
    deadline: Duration,
) -> (tokio::task::JoinHandle<Answers>, u64) {
    let backend = consumer.backend();
    let region = rt.block_on(map(&backend, dest));
    let key = ServedKey {
        region_id: 1,
        capability: [0x11; 16],
    };
    let requests = (0..entries as u64)
        .map(|i| BackendGet {
            peer: RAW_OWNER,
            remote_addr: 0x10_0000 + i * READ_LEN,
            packed_key: Bytes::copy_from_slice(&key.encode()),
            local_region_id: region.backend_region_id,
            local_offset: i * READ_LEN,
            len: READ_LEN,
            deadline: Some(deadline),
        })
        .collect();
    let task = rt.spawn(async move { backend.get_batch_into_test_memory(requests).await });
    (task, region.backend_region_id)
}

/// Progresses the raw peers until `task` finishes or `within` passes.
fn finish<T: Send + 'static>(
    rt: &tokio::runtime::Runtime,
    peers: &[&Raw],
    task: tokio::task::JoinHandle<T>,
    within: Duration,
) -> Option<T> {
    let start = Instant::now();
    while !task.is_finished() && start.elapsed() < within {
        for peer in peers {
            peer.progress_for(Duration::from_millis(2));
        }
        if peers.is_empty() {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    if task.is_finished() {
        Some(rt.block_on(task).unwrap())
    } else {
        task.abort();
        None
    }
}

/// The `nth` list request the raw owner received, and the endpoint to reply
/// on.
fn nth_list(owner: &Raw, nth: usize) -> (ListRequest, sys::ucp_ep_h) {
    assert!(
        owner.progress_until(Duration::from_secs(5), |r| {
            r.messages(READ_LIST_REQUEST_AM_ID).len() > nth
        }),
        "no list request reached the owner"
    );
    let messages = owner.messages(READ_LIST_REQUEST_AM_ID);
    (
        ListRequest::decode(&messages[nth].header).expect("a well-formed list request"),
        messages[nth].reply_ep,
    )
}

fn served(entry: &ReadRequest) -> ListReplyEntry {
    ListReplyEntry {
        request_id: entry.request_id,
        status: ReplyStatus::Served,
        length: entry.length,
    }
}

/// The payload of a reply serving every entry of `request`, entry `i`
/// filled with `first + i`.
fn payload_for(request: &ListRequest, first: u8) -> Vec<u8> {
    request
        .entries
        .iter()
        .enumerate()
        .flat_map(|(i, e)| vec![first.wrapping_add(i as u8); e.length as usize])
        .collect()
}

const EAGER_REPLY: u32 = sys::UCP_AM_SEND_FLAG_REPLY | sys::UCP_AM_SEND_FLAG_EAGER;
const RNDV_REPLY: u32 = sys::UCP_AM_SEND_FLAG_REPLY | sys::UCP_AM_SEND_FLAG_RNDV;

/// Unmaps `region` on `consumer` (which must answer `Ok`) and waits for the
/// backend's own count to reach zero.
fn unmap_and_count_nothing(rt: &tokio::runtime::Runtime, consumer: &UcxEngine, region: u64) {
    let backend = consumer.backend();
    let unmapped = rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(10), backend.unmap(region)).await
    });
    assert_eq!(unmapped, Ok(Ok(())), "the destination unmaps");
    assert_eq!(consumer.live_registrations(), Some(0));
}

/// A peer that is not the owner a list went to, replying with that list's
/// request ids on its own connection, lands nothing; the true owner's reply
/// then lands its bytes.
#[test]
fn another_peer_answering_a_lists_request_ids_lands_nothing() {
    let rt = runtime();
    let consumer = tcp_engine();
    let owner = Raw::new(false);
    let intruder = Raw::new(false);
    consumer.add_peer(RAW_OWNER, owner.address()).unwrap();
    let dest = PageBuf::zeroed(3 * READ_LEN as usize);
    let (batch, region) = batch_to_raw_owner(&rt, &consumer, &dest, 3, Duration::from_secs(5));
    let (request, reply_ep) = nth_list(&owner, 0);
    let reply = ListReply {
        entries: request.entries.iter().map(served).collect(),
    }
    .encode()
    .unwrap();
    let ep = intruder.connect(&consumer.worker_address());
    intruder.send_wait(
        ep,
        READ_LIST_REPLY_AM_ID,
        &reply,
        &payload_for(&request, 0xE0),
        EAGER_REPLY,
    );
    intruder.progress_for(Duration::from_millis(200));
    let after_intruder = dest.snapshot();
    owner.send_wait(
        reply_ep,
        READ_LIST_REPLY_AM_ID,
        &reply,
        &payload_for(&request, 0x40),
        EAGER_REPLY,
    );
    let answers = finish(&rt, &[&owner], batch, Duration::from_secs(5)).expect("answered");
    let bytes = dest.snapshot();
    drop(intruder);
    unmap_and_count_nothing(&rt, &consumer, region);
    rt.block_on(consumer.shutdown());
    assert!(
        after_intruder.iter().all(|&b| b == 0),
        "the intruder landed bytes"
    );
    assert_eq!(answers, vec![Ok(()); 3]);
    let expected: Vec<u8> = (0..3u8).flat_map(|i| vec![0x40 + i; 64]).collect();
    assert_eq!(bytes, expected);
}

/// A list reply sent by rendezvous, where the gathering promised eager,
/// fails the reads it serves and answers the ones it refuses; nothing lands.
#[test]
fn a_list_reply_sent_by_rendezvous_lands_nothing_and_answers_every_entry() {
    let rt = runtime();
    let consumer = tcp_engine();
    let owner = Raw::new(false);
    consumer.add_peer(RAW_OWNER, owner.address()).unwrap();
    let dest = PageBuf::zeroed(3 * READ_LEN as usize);
    let (batch, region) = batch_to_raw_owner(&rt, &consumer, &dest, 3, Duration::from_secs(5));
    let (request, reply_ep) = nth_list(&owner, 0);
    let reply = ListReply {
        entries: vec![
            served(&request.entries[0]),
            ListReplyEntry {
                request_id: request.entries[1].request_id,
                status: ReplyStatus::Refused(Refusal::RegionUnknown),
                length: 0,
            },
            served(&request.entries[2]),
        ],
    };
    let payload = vec![0x99u8; 2 * READ_LEN as usize];
    let sent = owner.send(
        reply_ep,
        READ_LIST_REPLY_AM_ID,
        &reply.encode().unwrap(),
        &payload,
        RNDV_REPLY,
    );
    let answers = finish(&rt, &[&owner], batch, Duration::from_secs(5)).expect("answered");
    owner.progress_for(Duration::from_millis(100));
    if !sent.is_null() && !common::raw_am::is_err(sent) {
        // SAFETY: a request of the raw owner's worker, returned once.
        unsafe { sys::ucp_request_free(sent.cast()) };
    }
    let bytes = dest.snapshot();
    unmap_and_count_nothing(&rt, &consumer, region);
    rt.block_on(consumer.shutdown());
    assert!(
        matches!(answers[0], Err(RdmaError::Backend(_))),
        "{answers:?}"
    );
    assert_eq!(answers[1], Err(RdmaError::RegionNotFound), "{answers:?}");
    assert!(
        matches!(answers[2], Err(RdmaError::Backend(_))),
        "{answers:?}"
    );
    assert!(bytes.iter().all(|&b| b == 0), "nothing landed");
}

/// A gathered read answered instead by a single rendezvous reply that the
/// owner then never completes is answered only when UCX lets go of its
/// destination (its deadline force-closes the endpoint), and the owner
/// progressing afterwards changes no byte of it.
#[test]
fn a_gathered_read_answered_by_a_stalled_rendezvous_is_answered_only_after_ucx_lets_go() {
    let rt = runtime();
    let consumer = tcp_engine();
    let owner = Raw::new(false);
    consumer.add_peer(RAW_OWNER, owner.address()).unwrap();
    let dest = PageBuf::zeroed(2 * READ_LEN as usize);
    let (batch, region) = batch_to_raw_owner(&rt, &consumer, &dest, 2, Duration::from_millis(800));
    let (request, reply_ep) = nth_list(&owner, 0);
    let member = &request.entries[1];
    let single = ReadReply {
        request_id: member.request_id,
        status: ReplyStatus::Served,
        length: member.length,
    };
    let payload = vec![0x66u8; member.length as usize];
    let sent = owner.send(
        reply_ep,
        READ_REPLY_AM_ID,
        &single.encode(),
        &payload,
        RNDV_REPLY,
    );
    // The announcement leaves inside the send; the owner then stalls (it
    // does not progress), so the consumer's receive never gets the data.
    let answers = finish(&rt, &[], batch, Duration::from_secs(10)).expect("answered");
    let at_answer = dest.snapshot();
    owner.progress_for(Duration::from_millis(500));
    let after = dest.snapshot();
    if !sent.is_null() && !common::raw_am::is_err(sent) {
        // SAFETY: a request of the raw owner's worker, returned once.
        unsafe { sys::ucp_request_free(sent.cast()) };
    }
    unmap_and_count_nothing(&rt, &consumer, region);
    rt.block_on(consumer.shutdown());
    // The member's receive was running (the engine force-closed the
    // endpoint to end it); both reads expired.
    assert_eq!(
        answers,
        vec![Err(RdmaError::Timeout), Err(RdmaError::Timeout)]
    );
    assert!(at_answer.iter().all(|&b| b == 0), "bytes landed");
    assert_eq!(after, at_answer, "a byte changed after the answer");
}

/// An owner that receives a list and then goes away: every read of the list
/// is answered with a typed error, nothing lands, the destination unmaps and
/// the consumer counts no registration.
#[test]
fn an_owner_lost_mid_list_answers_every_entry_and_leaves_nothing_registered() {
    let rt = runtime();
    let consumer = tcp_engine();
    let owner = Raw::new(false);
    consumer.add_peer(RAW_OWNER, owner.address()).unwrap();
    let dest = PageBuf::zeroed(MAX_LIST_ENTRIES * 2 * READ_LEN as usize);
    let (batch, region) = batch_to_raw_owner(
        &rt,
        &consumer,
        &dest,
        MAX_LIST_ENTRIES * 2,
        Duration::from_secs(3),
    );
    let (request, _) = nth_list(&owner, 0);
    assert_eq!(request.entries.len(), MAX_LIST_ENTRIES);
    drop(owner);
    let answers = finish(&rt, &[], batch, Duration::from_secs(10)).expect("answered");
    let bytes = dest.snapshot();
    unmap_and_count_nothing(&rt, &consumer, region);
    rt.block_on(consumer.shutdown());
    assert_eq!(answers.len(), MAX_LIST_ENTRIES * 2);
    assert!(
        answers
            .iter()
            .all(|a| matches!(a, Err(RdmaError::Backend(_) | RdmaError::Timeout))),
        "{answers:?}"
    );
    assert!(bytes.iter().all(|&b| b == 0), "nothing landed");
}

/// An owner engine (tcp) whose gathered replies from one region are stuck:
/// a raw consumer made one full exchange of a maximal list, so the
/// connection is wired both ways, then sent 400 more it never progresses
/// again. The owner's replies (256 KiB each) outgrow the socket buffers and
/// wait in UCX, holding their leases on the region.
struct StuckReplies {
    owner: UcxEngine,
    region: rdmareg_core::BackendRegion,
    key: ServedKey,
    base: u64,
    consumer: Raw,
    requests: Vec<sys::ucs_status_ptr_t>,
    buffer: PageBuf,
}

impl StuckReplies {
    fn new(rt: &tokio::runtime::Runtime) -> StuckReplies {
        let owner = tcp_engine();
        let buf = PageBuf::filled(MAX_GATHERED_BYTES as usize, pattern);
        let region = rt.block_on(map(&owner.backend(), &buf));
        let key = ServedKey::decode(&region.packed_key).unwrap();
        let consumer = Raw::new(false);
        let mut stuck = StuckReplies {
            owner,
            region,
            key,
            base: buf.addr() as u64,
            consumer,
            requests: Vec::new(),
            buffer: buf,
        };
        let ep = stuck.consumer.connect(&stuck.owner.worker_address());
        stuck.consumer.send_wait(
            ep,
            READ_LIST_REQUEST_AM_ID,
            &stuck.list(0).encode().unwrap(),
            &[],
            sys::UCP_AM_SEND_FLAG_REPLY,
        );
        assert!(stuck.consumer.progress_until(Duration::from_secs(5), |r| {
            !r.messages(READ_LIST_REPLY_AM_ID).is_empty()
        }));
        for n in 1..=400 {
            let sent = stuck.consumer.send(
                ep,
                READ_LIST_REQUEST_AM_ID,
                &stuck.list(n).encode().unwrap(),
                &[],
                sys::UCP_AM_SEND_FLAG_REPLY,
            );
            if !sent.is_null() && !common::raw_am::is_err(sent) {
                stuck.requests.push(sent);
            }
        }
        std::thread::sleep(Duration::from_millis(500));
        stuck
    }

    /// The `n`-th maximal list over the region: entries of
    /// `MAX_GATHERED_ENTRY` bytes, request ids of its own.
    fn list(&self, n: u64) -> ListRequest {
        let per_list = MAX_GATHERED_BYTES / MAX_GATHERED_ENTRY;
        ListRequest {
            entries: (0..per_list)
                .map(|i| ReadRequest {
                    request_id: n * per_list + i,
                    key: self.key,
                    address: self.base + i * MAX_GATHERED_ENTRY,
                    length: MAX_GATHERED_ENTRY,
                })
                .collect(),
        }
    }

    /// Returns the consumer's requests and closes it, so the stuck replies
    /// fail and their leases end; hands back the owner and the region's
    /// buffer, which the caller keeps until its unmap or shutdown ends the
    /// registration.
    fn release_consumer(self) -> (UcxEngine, PageBuf) {
        for request in self.requests {
            // SAFETY: requests of the raw consumer's worker, returned once
            // (UCX frees an unfinished one when it completes).
            unsafe { sys::ucp_request_free(request.cast()) };
        }
        drop(self.consumer);
        (self.owner, self.buffer)
    }
}

/// A consumer that sends many maximal lists and never reads the replies
/// holds the owner's leases: an unmap of the region does not answer while
/// the replies are stuck, another consumer's list naming the region
/// meanwhile is refused entry by entry, and the unmap answers `Ok` (with
/// nothing left registered) once that consumer is gone.
#[test]
fn replies_a_consumer_never_reads_hold_the_unmap_until_that_consumer_is_gone() {
    let rt = runtime();
    let stuck = StuckReplies::new(&rt);
    let (backend, region_id) = (stuck.owner.backend(), stuck.region.backend_region_id);
    let held = rt.block_on(async {
        tokio::time::timeout(Duration::from_millis(500), backend.unmap(region_id)).await
    });
    let live_while_held = stuck.owner.live_registrations();
    // Another consumer's list naming the region while its unmap waits is
    // refused entry by entry.
    let late = Raw::new(false);
    let late_ep = late.connect(&stuck.owner.worker_address());
    late.send_wait(
        late_ep,
        READ_LIST_REQUEST_AM_ID,
        &stuck.list(1000).encode().unwrap(),
        &[],
        sys::UCP_AM_SEND_FLAG_REPLY,
    );
    assert!(late.progress_until(Duration::from_secs(5), |r| {
        !r.messages(READ_LIST_REPLY_AM_ID).is_empty()
    }));
    let (late_reply, late_payload) = {
        let messages = late.messages(READ_LIST_REPLY_AM_ID);
        (
            ListReply::decode(&messages[0].header).unwrap(),
            messages[0].data.clone(),
        )
    };
    drop(late);
    let (owner, _buf) = stuck.release_consumer();
    let released = rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(20), backend.unmap(region_id)).await
    });
    let live = owner.live_registrations();
    rt.block_on(owner.shutdown());
    assert!(
        held.is_err(),
        "the unmap answered {held:?} while replies from the region were stuck"
    );
    assert_eq!(live_while_held, Some(1));
    assert!(
        late_reply
            .entries
            .iter()
            .all(|e| e.status == ReplyStatus::Refused(Refusal::Deregistering)),
        "{late_reply:?}"
    );
    assert!(late_payload.is_empty(), "bytes of a region being unmapped");
    assert_eq!(
        released,
        Ok(Ok(())),
        "the unmap answers once the consumer is gone"
    );
    assert_eq!(live, Some(0));
}

/// A list to an owner that is gone (its worker destroyed before the batch)
/// fails every read with a typed error before the deadline ends the wait,
/// and leaves nothing registered.
#[test]
fn a_list_to_a_vanished_owner_answers_every_read_and_leaves_nothing_registered() {
    let rt = runtime();
    let consumer = tcp_engine();
    let address = {
        let owner = Raw::new(false);
        owner.address()
    };
    consumer.add_peer(RAW_OWNER, address).unwrap();
    let dest = PageBuf::zeroed(8 * READ_LEN as usize);
    let (batch, region) = batch_to_raw_owner(&rt, &consumer, &dest, 8, Duration::from_secs(3));
    let answers = finish(&rt, &[], batch, Duration::from_secs(10)).expect("answered");
    unmap_and_count_nothing(&rt, &consumer, region);
    rt.block_on(consumer.shutdown());
    assert_eq!(answers.len(), 8);
    assert!(
        answers
            .iter()
            .all(|a| matches!(a, Err(RdmaError::Backend(_) | RdmaError::Timeout))),
        "{answers:?}"
    );
    assert!(dest.snapshot().iter().all(|&b| b == 0));
}

/// An owner engine shut down while gathered replies from a region are stuck
/// behind a consumer that never reads them finishes its teardown, and the
/// region then unmaps with nothing left registered.
#[test]
fn an_owner_shut_down_with_gathered_replies_stuck_finishes_and_leaves_nothing_registered() {
    let rt = runtime();
    let stuck = StuckReplies::new(&rt);
    let (backend, region_id) = (stuck.owner.backend(), stuck.region.backend_region_id);
    let stopped = rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(20), stuck.owner.shutdown()).await
    });
    let unmapped = rt.block_on(backend.unmap(region_id));
    let live = stuck.owner.live_registrations();
    let _owner_and_buffer = stuck.release_consumer();
    assert!(stopped.is_ok(), "the owner's shutdown did not finish");
    assert_eq!(unmapped, Ok(()));
    assert_eq!(live, Some(0));
}

/// Malformed list replies — truncated, padded, a count of zero or over the
/// bound, a wrong version, reserved bytes set, a refusal that claims bytes —
/// are dropped whole: they land nothing and answer nothing, and the owner's
/// well-formed reply afterwards lands every read.
#[test]
fn malformed_list_replies_are_dropped_whole_and_the_true_reply_still_lands() {
    let rt = runtime();
    let consumer = tcp_engine();
    let owner = Raw::new(false);
    consumer.add_peer(RAW_OWNER, owner.address()).unwrap();
    let dest = PageBuf::zeroed(3 * READ_LEN as usize);
    let (batch, region) = batch_to_raw_owner(&rt, &consumer, &dest, 3, Duration::from_secs(10));
    let (request, reply_ep) = nth_list(&owner, 0);
    let good = ListReply {
        entries: request.entries.iter().map(served).collect(),
    }
    .encode()
    .unwrap();
    let payload = payload_for(&request, 0xD0);
    let mut forged: Vec<Vec<u8>> = vec![
        good[..good.len() - 1].to_vec(),
        [good.clone(), vec![0]].concat(),
        good[..8].to_vec(),
        Vec::new(),
    ];
    for (at, value) in [(0, 2u8), (1, 1), (4, 0), (5, 1), (6, 1), (8 + 9, 1)] {
        let mut bytes = good.clone();
        if at == 4 {
            bytes[4..6].copy_from_slice(&0u16.to_le_bytes());
        } else if at == 5 {
            bytes[4..6].copy_from_slice(&(MAX_LIST_ENTRIES as u16 + 1).to_le_bytes());
        } else {
            bytes[at] = value;
        }
        forged.push(bytes);
    }
    let mut refused_with_bytes = good.clone();
    refused_with_bytes[8 + 8] = 2; // a refusal code, length left at 64
    forged.push(refused_with_bytes);
    for header in &forged {
        owner.send_wait(
            reply_ep,
            READ_LIST_REPLY_AM_ID,
            header,
            &payload,
            EAGER_REPLY,
        );
    }
    owner.progress_for(Duration::from_millis(200));
    let early = batch.is_finished();
    let after_forged = dest.snapshot();
    owner.send_wait(
        reply_ep,
        READ_LIST_REPLY_AM_ID,
        &good,
        &payload,
        EAGER_REPLY,
    );
    let answers = finish(&rt, &[&owner], batch, Duration::from_secs(5)).expect("answered");
    let bytes = dest.snapshot();
    unmap_and_count_nothing(&rt, &consumer, region);
    rt.block_on(consumer.shutdown());
    assert!(!early, "a malformed reply answered the batch");
    assert!(
        after_forged.iter().all(|&b| b == 0),
        "a malformed reply landed"
    );
    assert_eq!(answers, vec![Ok(()); 3]);
    assert_eq!(bytes, payload);
}
