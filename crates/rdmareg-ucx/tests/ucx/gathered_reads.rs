//! Gathered reads on the owner-served lane: a batch's small reads of one
//! owner travel as one list request and come back as one eager reply, with
//! every entry answered on its own.
//!
//! Each test plays one side with a raw UCX peer (`common::raw_am`) so it can
//! see the wire, or runs two real engines end to end over tcp.

use crate::common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::raw_am::Raw;
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, PeerId, RdmaError};
use rdmareg_ucx::read_list::{
    ListReply, ListReplyEntry, ListRequest, MAX_GATHERED_ENTRY, MAX_LIST_ENTRIES,
    READ_LIST_REPLY_AM_ID, READ_LIST_REQUEST_AM_ID,
};
use rdmareg_ucx::read_protocol::{
    READ_REPLY_AM_ID, READ_REQUEST_AM_ID, ReadRequest, Refusal, ReplyStatus, ServedKey,
};
use rdmareg_ucx::{Transport, UcxEngine};
use ucx_sys as sys;

const RAW_OWNER: PeerId = PeerId(1);

/// A consumer engine with a raw owner as `RAW_OWNER`, and `entries` reads
/// of `len` bytes each, posted as one batch into consecutive slices of
/// `dest`; returns the batch's task.
fn batch_to_raw_owner(
    rt: &tokio::runtime::Runtime,
    consumer: &UcxEngine,
    dest: &PageBuf,
    entries: usize,
    len: u64,
) -> tokio::task::JoinHandle<Vec<Result<(), RdmaError>>> {
    let backend = consumer.backend();
    let region = rt.block_on(map(&backend, dest));
    let key = ServedKey {
        region_id: 1,
        capability: [0x11; 16],
    };
    let requests = (0..entries as u64)
        .map(|i| BackendGet {
            peer: RAW_OWNER,
            remote_addr: 0x10_0000 + i * len,
            packed_key: Bytes::copy_from_slice(&key.encode()),
            local_region_id: region.backend_region_id,
            local_offset: i * len,
            len,
            deadline: Some(Duration::from_secs(2)),
        })
        .collect();
    rt.spawn(async move { backend.get_batch_into_test_memory(requests).await })
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
    }
    if task.is_finished() {
        Some(rt.block_on(task).unwrap())
    } else {
        task.abort();
        None
    }
}

/// The list request the raw owner received, and the endpoint to reply on.
fn received_list(owner: &Raw) -> (ListRequest, sys::ucp_ep_h) {
    assert!(
        owner.progress_until(Duration::from_secs(5), |r| {
            !r.messages(READ_LIST_REQUEST_AM_ID).is_empty()
        }),
        "no list request reached the owner"
    );
    let messages = owner.messages(READ_LIST_REQUEST_AM_ID);
    (
        ListRequest::decode(&messages[0].header).expect("a well-formed list request"),
        messages[0].reply_ep,
    )
}

fn served(entry: &ReadRequest) -> ListReplyEntry {
    ListReplyEntry {
        request_id: entry.request_id,
        status: ReplyStatus::Served,
        length: entry.length,
    }
}

/// A batch of three small reads of one owner reaches it as one list request
/// of three entries (and no single request); a gathered reply that serves
/// two and refuses one lands the two and answers the third with its own
/// typed error.
#[test]
fn small_reads_of_one_owner_travel_as_one_list_and_are_answered_per_entry() {
    let rt = runtime();
    let consumer = tcp_engine();
    let owner = Raw::new(false);
    consumer.add_peer(RAW_OWNER, owner.address()).unwrap();
    let dest = PageBuf::zeroed(3 * 64);
    let batch = batch_to_raw_owner(&rt, &consumer, &dest, 3, 64);
    let (request, reply_ep) = received_list(&owner);
    assert_eq!(request.entries.len(), 3, "one list of three entries");
    assert!(
        owner.messages(READ_REQUEST_AM_ID).is_empty(),
        "no single read"
    );
    let addresses: Vec<u64> = request.entries.iter().map(|e| e.address).collect();
    assert_eq!(addresses, vec![0x10_0000, 0x10_0040, 0x10_0080]);

    let reply = ListReply {
        entries: vec![
            served(&request.entries[0]),
            ListReplyEntry {
                request_id: request.entries[1].request_id,
                status: ReplyStatus::Refused(Refusal::OutOfRange),
                length: 0,
            },
            served(&request.entries[2]),
        ],
    };
    let payload: Vec<u8> = [[0xA1u8; 64], [0xC3u8; 64]].concat();
    owner.send_wait(
        reply_ep,
        READ_LIST_REPLY_AM_ID,
        &reply.encode().unwrap(),
        &payload,
        sys::UCP_AM_SEND_FLAG_REPLY | sys::UCP_AM_SEND_FLAG_EAGER,
    );
    let answers = finish(&rt, &[&owner], batch, Duration::from_secs(5)).expect("answered");
    let bytes = dest.snapshot();
    rt.block_on(consumer.shutdown());
    assert_eq!(answers, vec![Ok(()), Err(RdmaError::OutOfRange), Ok(())]);
    assert!(bytes[..64].iter().all(|&b| b == 0xA1));
    assert!(
        bytes[64..128].iter().all(|&b| b == 0),
        "the refused entry landed nothing"
    );
    assert!(bytes[128..192].iter().all(|&b| b == 0xC3));
}

/// More reads than one list holds, and reads too large to gather, are split:
/// lists of at most `MAX_LIST_ENTRIES`, and the large reads alone. (Over
/// tcp a list's reads of up to twice `MAX_GATHERED_ENTRY` are gathered in
/// two pieces, see `progress::chunks`: the large reads here are longer.)
#[test]
fn long_batches_are_split_into_bounded_lists_and_large_reads_go_alone() {
    let rt = runtime();
    let consumer = tcp_engine();
    let owner = Raw::new(false);
    consumer.add_peer(RAW_OWNER, owner.address()).unwrap();
    let small = MAX_LIST_ENTRIES + 1;
    let large = 2 * MAX_GATHERED_ENTRY + 1;
    let dest = PageBuf::zeroed(small * 64 + 2 * large as usize);
    let backend = consumer.backend();
    let region = rt.block_on(map(&backend, &dest));
    let key = Bytes::copy_from_slice(
        &ServedKey {
            region_id: 1,
            capability: [0x11; 16],
        }
        .encode(),
    );
    let mut requests: Vec<BackendGet> = (0..small as u64)
        .map(|i| BackendGet {
            peer: RAW_OWNER,
            remote_addr: 0x10_0000,
            packed_key: key.clone(),
            local_region_id: region.backend_region_id,
            local_offset: i * 64,
            len: 64,
            deadline: Some(Duration::from_millis(300)),
        })
        .collect();
    for i in 0..2 {
        requests.push(BackendGet {
            local_offset: small as u64 * 64 + i * large,
            len: large,
            ..requests[0].clone()
        });
    }
    let batch = rt.spawn(async move { backend.get_batch_into_test_memory(requests).await });
    let answers = finish(&rt, &[&owner], batch, Duration::from_secs(5)).expect("answered");
    owner.progress_for(Duration::from_millis(20));
    let lists: Vec<usize> = owner
        .messages(READ_LIST_REQUEST_AM_ID)
        .iter()
        .map(|m| ListRequest::decode(&m.header).unwrap().entries.len())
        .collect();
    let singles: Vec<u64> = owner
        .messages(READ_REQUEST_AM_ID)
        .iter()
        .map(|m| ReadRequest::decode(&m.header).unwrap().length)
        .collect();
    rt.block_on(consumer.shutdown());
    assert!(
        answers.iter().all(|a| *a == Err(RdmaError::Timeout)),
        "a silent owner: every read times out"
    );
    assert_eq!(
        lists,
        vec![MAX_LIST_ENTRIES],
        "one full list; the last small read alone"
    );
    let mut singles = singles;
    singles.sort_unstable();
    assert_eq!(singles, vec![64, large, large], "reads sent alone");
}

/// A raw consumer asks a real owner for a list mixing an honest entry with a
/// wrong capability, a range outside the registration and an entry too
/// large to gather: the one reply is eager, serves the honest entry's bytes
/// only, and refuses each other entry with its own reason.
#[test]
fn an_owner_answers_each_entry_of_a_list_on_its_own_in_one_eager_reply() {
    let rt = runtime();
    let owner = tcp_engine();
    let backend = owner.backend();
    let buf = PageBuf::filled(64 << 10, pattern);
    let region = rt.block_on(map(&backend, &buf));
    let key = ServedKey::decode(&region.packed_key).unwrap();
    let base = buf.addr() as u64;
    let entry = |request_id, key, address, length| ReadRequest {
        request_id,
        key,
        address,
        length,
    };
    let forged = ServedKey {
        capability: [key.capability[0] ^ 1; 16],
        ..key
    };
    let request = ListRequest {
        entries: vec![
            entry(10, key, base + 100, 200),
            entry(11, forged, base, 8),
            entry(12, key, base + (64 << 10) - 4, 8),
            entry(13, key, base, MAX_GATHERED_ENTRY + 1),
            entry(14, key, base + 4096, 16),
        ],
    };
    let consumer = Raw::new(false);
    consumer.ask_list(&owner.worker_address(), &request);
    assert!(consumer.progress_until(Duration::from_secs(5), |r| {
        !r.messages(READ_LIST_REPLY_AM_ID).is_empty()
    }));
    let (reply, data, rendezvous) = {
        let messages = consumer.messages(READ_LIST_REPLY_AM_ID);
        (
            ListReply::decode(&messages[0].header).unwrap(),
            messages[0].data.clone(),
            messages[0].rndv_len,
        )
    };
    let singles = consumer.messages(READ_REPLY_AM_ID).len();
    drop(consumer);
    assert_eq!(rt.block_on(backend.unmap(region.backend_region_id)), Ok(()));
    rt.block_on(owner.shutdown());
    let statuses: Vec<(u64, ReplyStatus, u64)> = reply
        .entries
        .iter()
        .map(|e| (e.request_id, e.status, e.length))
        .collect();
    assert_eq!(
        statuses,
        vec![
            (10, ReplyStatus::Served, 200),
            (11, ReplyStatus::Refused(Refusal::CapabilityMismatch), 0),
            (12, ReplyStatus::Refused(Refusal::OutOfRange), 0),
            (13, ReplyStatus::Refused(Refusal::Malformed), 0),
            (14, ReplyStatus::Served, 16),
        ]
    );
    assert_eq!(rendezvous, 0, "the reply is eager");
    assert_eq!(singles, 0, "one reply for the list");
    let expected: Vec<u8> = (100..300).chain(4096..4112).map(pattern).collect();
    assert_eq!(data, expected, "the served entries' bytes, back to back");
}

/// Builds a hostile reply (header and payload) to a list request.
type Forge = fn(&ListRequest) -> (ListReply, Vec<u8>);

/// Gathered replies that do not add up land nothing: a payload shorter or
/// longer than the served entries claim, and an entry whose length is not
/// the read's, each fail the reads they name with a backend error and leave
/// the destination untouched.
#[test]
fn a_gathered_reply_whose_lengths_do_not_add_up_lands_nothing() {
    let rt = runtime();
    let consumer = tcp_engine();
    let owner = Raw::new(false);
    consumer.add_peer(RAW_OWNER, owner.address()).unwrap();
    let cases: [(&str, Forge); 3] = [
        ("a short payload", |request| {
            let reply = ListReply {
                entries: request.entries.iter().map(served).collect(),
            };
            (reply, vec![0x77; 64 + 32])
        }),
        ("a long payload", |request| {
            let reply = ListReply {
                entries: request.entries.iter().map(served).collect(),
            };
            (reply, vec![0x77; 3 * 64])
        }),
        ("an entry longer than its read", |request| {
            let mut entries: Vec<ListReplyEntry> = request.entries.iter().map(served).collect();
            entries[0].length = 96;
            entries[1].length = 32;
            (ListReply { entries }, vec![0x77; 128])
        }),
    ];
    for (what, forge) in cases {
        let dest = PageBuf::zeroed(2 * 64);
        let before = owner.messages(READ_LIST_REQUEST_AM_ID).len();
        let batch = batch_to_raw_owner(&rt, &consumer, &dest, 2, 64);
        assert!(owner.progress_until(Duration::from_secs(5), |r| {
            r.messages(READ_LIST_REQUEST_AM_ID).len() > before
        }));
        let (request, reply_ep) = {
            let messages = owner.messages(READ_LIST_REQUEST_AM_ID);
            let m = &messages[before];
            (ListRequest::decode(&m.header).unwrap(), m.reply_ep)
        };
        let (reply, payload) = forge(&request);
        owner.send_wait(
            reply_ep,
            READ_LIST_REPLY_AM_ID,
            &reply.encode().unwrap(),
            &payload,
            sys::UCP_AM_SEND_FLAG_REPLY | sys::UCP_AM_SEND_FLAG_EAGER,
        );
        let answers = finish(&rt, &[&owner], batch, Duration::from_secs(5)).expect("answered");
        assert!(
            answers
                .iter()
                .all(|a| matches!(a, Err(RdmaError::Backend(_)))),
            "{what}: {answers:?}"
        );
        assert!(
            dest.snapshot().iter().all(|&b| b == 0),
            "{what}: landed bytes"
        );
    }
    rt.block_on(consumer.shutdown());
}

/// End to end over tcp between two engines: a batch of 1000 reads of 4 KiB
/// scattered over a 16 MiB registration lands every byte where it belongs,
/// beside a large read in the same batch.
#[test]
fn a_thousand_small_reads_and_a_large_one_land_exactly_over_tcp() {
    let rt = runtime();
    let (owner, consumer) = engines(Transport::Tcp);
    let source = PageBuf::filled(16 << 20, pattern);
    let source_region = rt.block_on(map(&owner.backend(), &source));
    let dest = PageBuf::zeroed(4000 * 1024 + (1 << 20));
    let backend = consumer.backend();
    let dest_region = rt.block_on(map(&backend, &dest));
    let entry = |remote: u64, local: u64, len: u64| BackendGet {
        peer: OWNER,
        remote_addr: source.addr() as u64 + remote,
        packed_key: source_region.packed_key.clone(),
        local_region_id: dest_region.backend_region_id,
        local_offset: local,
        len,
        deadline: Some(Duration::from_secs(30)),
    };
    // Every 4 KiB read comes from a different 16 KiB stride, one byte in.
    let mut requests: Vec<BackendGet> = (0..1000u64)
        .map(|i| entry(i * 16384 + 1, i * 4096, 4096))
        .collect();
    requests.push(entry(7, 4000 * 1024, 1 << 20));
    let answers = rt.block_on(backend.get_batch_into_test_memory(requests));
    let bytes = dest.snapshot();
    rt.block_on(backend.unmap(dest_region.backend_region_id))
        .unwrap();
    rt.block_on(owner.backend().unmap(source_region.backend_region_id))
        .unwrap();
    rt.block_on(consumer.shutdown());
    rt.block_on(owner.shutdown());
    assert!(
        answers.iter().all(|a| a.is_ok()),
        "{:?}",
        answers.iter().find(|a| a.is_err())
    );
    for i in 0..1000usize {
        let got = &bytes[i * 4096..(i + 1) * 4096];
        let want: Vec<u8> = (i * 16384 + 1..i * 16384 + 4097).map(pattern).collect();
        assert_eq!(got, &want[..], "entry {i}");
    }
    let want: Vec<u8> = (7..7 + (1 << 20)).map(pattern).collect();
    assert_eq!(&bytes[4000 * 1024..], &want[..], "the large read");
}

/// Over tcp a batch's small reads of one owner travel as one list request
/// of up to the list's bounds (here sixteen reads of 16 KiB, 256 KiB in
/// all), not one request per tcp fragment's worth of reads: the owner cuts
/// its replies to fragment size (see the next test).
#[test]
fn over_tcp_a_list_request_asks_up_to_its_bounds_in_one_message() {
    let rt = runtime();
    let consumer = tcp_engine();
    let owner = Raw::new(false);
    consumer.add_peer(RAW_OWNER, owner.address()).unwrap();
    let dest = PageBuf::zeroed(16 * 16384);
    let batch = batch_to_raw_owner(&rt, &consumer, &dest, 16, 16384);
    let (request, _reply_ep) = received_list(&owner);
    let entries = request.entries.len();
    let requests = owner.messages(READ_LIST_REQUEST_AM_ID).len();
    // The owner never answers: the reads run into their deadlines.
    let answers = finish(&rt, &[&owner], batch, Duration::from_secs(10)).expect("answered");
    rt.block_on(consumer.shutdown());
    assert_eq!(entries, 16, "all sixteen reads in the first list");
    assert_eq!(requests, 1, "one list request");
    assert!(answers.iter().all(|a| a == &Err(RdmaError::Timeout)));
}

/// A real owner answers a list request of 256 KiB from a tcp consumer in
/// replies of at most one tcp fragment's payload (60 KiB), each eager,
/// which together serve every entry once with its own bytes.
#[test]
fn over_tcp_an_owner_answers_a_long_list_in_replies_of_one_fragment() {
    const PIECE: usize = 60 * 1024;
    let rt = runtime();
    let owner = tcp_engine();
    let backend = owner.backend();
    let buf = PageBuf::filled(1 << 20, pattern);
    let region = rt.block_on(map(&backend, &buf));
    let key = ServedKey::decode(&region.packed_key).unwrap();
    let base = buf.addr() as u64;
    let request = ListRequest {
        entries: (0..16u64)
            .map(|i| ReadRequest {
                request_id: 100 + i,
                key,
                address: base + 1 + i * 20_000,
                length: 16384,
            })
            .collect(),
    };
    let consumer = Raw::new(false);
    consumer.ask_list(&owner.worker_address(), &request);
    assert!(consumer.progress_until(Duration::from_secs(5), |r| {
        r.list_entries_answered() >= 16
    }));
    let replies: Vec<(ListReply, Vec<u8>, usize)> = consumer
        .messages(READ_LIST_REPLY_AM_ID)
        .iter()
        .map(|m| {
            (
                ListReply::decode(&m.header).unwrap(),
                m.data.clone(),
                m.rndv_len,
            )
        })
        .collect();
    drop(consumer);
    assert_eq!(rt.block_on(backend.unmap(region.backend_region_id)), Ok(()));
    rt.block_on(owner.shutdown());
    assert!(replies.len() > 1, "more than one reply");
    let mut seen = Vec::new();
    for (reply, data, rendezvous) in &replies {
        assert_eq!(*rendezvous, 0, "every reply is eager");
        assert!(data.len() <= PIECE, "a reply of {} bytes", data.len());
        let mut at = 0;
        for entry in &reply.entries {
            assert_eq!(entry.status, ReplyStatus::Served);
            let i = entry.request_id - 100;
            let from = (1 + i * 20_000) as usize;
            let want: Vec<u8> = (from..from + 16384).map(pattern).collect();
            assert!(data[at..at + 16384] == want[..], "entry {i}: its own bytes");
            at += 16384;
            seen.push(entry.request_id);
        }
        assert_eq!(at, data.len(), "the payload is the served entries'");
    }
    seen.sort_unstable();
    assert_eq!(seen, (100..116).collect::<Vec<u64>>(), "each entry once");
}
