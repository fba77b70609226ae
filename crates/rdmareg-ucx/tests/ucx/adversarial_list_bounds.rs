//! Gathered reads on workers whose largest active-message header is smaller
//! than a full list's (small transport segments; on hardware, a small
//! network MTU). UCX as built here does not check a header's length: a
//! list header longer than the worker's bound is written past UCX's
//! fragment buffer (measured before the bound was kept: with
//! `TCP_TX_SEG_SIZE=1k` a consumer sending a 64-entry list died of
//! SIGSEGV, and an owner answering one of SIGABRT). So both sides size
//! their list headers by the worker's bound.

use crate::common;

use std::time::Duration;

use common::raw_am::Raw;
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, RdmaError};
use rdmareg_ucx::read_list::{ListReply, ListRequest, MAX_LIST_ENTRIES, READ_LIST_REPLY_AM_ID};
use rdmareg_ucx::read_protocol::{ReadRequest, ReplyStatus, ServedKey};
use rdmareg_ucx::{Transport, UcxConfig, UcxEngine};

/// A transmit segment well under a full list request (3080 bytes) and
/// reply (1544 bytes).
const SMALL_SEGMENT: usize = 1024;

fn small_segments() -> UcxConfig {
    config(Transport::Tcp).with_ucx_setting("TCP_TX_SEG_SIZE", SMALL_SEGMENT.to_string())
}

/// A batch of `MAX_LIST_ENTRIES` reads of 4 KiB from `owner` into a fresh
/// destination on `consumer`; returns the answers and whether each read
/// landed its own bytes.
fn full_batch(
    rt: &tokio::runtime::Runtime,
    owner: &UcxEngine,
    consumer: &UcxEngine,
) -> (Vec<Result<(), RdmaError>>, Vec<bool>) {
    consumer.add_peer(OWNER, owner.worker_address()).unwrap();
    let source = PageBuf::filled(1 << 20, pattern);
    let source_region = rt.block_on(map(&owner.backend(), &source));
    let dest = PageBuf::zeroed(MAX_LIST_ENTRIES * 4096);
    let backend = consumer.backend();
    let dest_region = rt.block_on(map(&backend, &dest));
    let requests: Vec<BackendGet> = (0..MAX_LIST_ENTRIES as u64)
        .map(|i| BackendGet {
            peer: OWNER,
            remote_addr: source.addr() as u64 + i * 8192 + 3,
            packed_key: source_region.packed_key.clone(),
            local_region_id: dest_region.backend_region_id,
            local_offset: i * 4096,
            len: 4096,
            deadline: Some(Duration::from_secs(10)),
        })
        .collect();
    let answers = rt.block_on(backend.get_batch_into_test_memory(requests));
    let bytes = dest.snapshot();
    let landed = (0..MAX_LIST_ENTRIES)
        .map(|i| {
            let want: Vec<u8> = (i * 8192 + 3..i * 8192 + 3 + 4096).map(pattern).collect();
            bytes[i * 4096..(i + 1) * 4096] == want[..]
        })
        .collect();
    assert_eq!(
        rt.block_on(backend.unmap(dest_region.backend_region_id)),
        Ok(())
    );
    assert_eq!(
        rt.block_on(owner.backend().unmap(source_region.backend_region_id)),
        Ok(())
    );
    (answers, landed)
}

/// A consumer whose worker cannot send a full list request gathers fewer
/// reads per list, and every read of a full batch lands its own bytes.
#[test]
fn a_consumer_with_small_transport_segments_lands_a_full_batch_of_small_reads() {
    init_tracing();
    let rt = runtime();
    let owner = UcxEngine::start(config(Transport::Tcp)).expect("owner starts");
    let consumer = UcxEngine::start(small_segments()).expect("consumer starts");
    let (answers, landed) = full_batch(&rt, &owner, &consumer);
    rt.block_on(consumer.shutdown());
    rt.block_on(owner.shutdown());
    assert!(answers.iter().all(|a| a.is_ok()), "{answers:?}");
    assert!(landed.iter().all(|&ok| ok), "{landed:?}");
}

/// An owner whose worker cannot send a full list reply answers a full list
/// in several replies, each header within its bound, together answering
/// every entry once, in order, with the right bytes.
#[test]
fn an_owner_with_small_transport_segments_answers_a_full_list_in_replies_that_fit() {
    init_tracing();
    let rt = runtime();
    let owner = UcxEngine::start(small_segments()).expect("owner starts");
    let backend = owner.backend();
    let buf = PageBuf::filled(1 << 20, pattern);
    let region = rt.block_on(map(&backend, &buf));
    let key = ServedKey::decode(&region.packed_key).unwrap();
    let base = buf.addr() as u64;
    let request = ListRequest {
        entries: (0..MAX_LIST_ENTRIES as u64)
            .map(|i| ReadRequest {
                request_id: 1000 + i,
                key,
                address: base + i * 4096 + 5,
                length: 64,
            })
            .collect(),
    };
    let consumer = Raw::new(false);
    consumer.ask_list(&owner.worker_address(), &request);
    let all = consumer.progress_until(Duration::from_secs(5), |r| {
        r.list_entries_answered() >= MAX_LIST_ENTRIES
    });
    consumer.progress_for(Duration::from_millis(100));
    let replies: Vec<(usize, ListReply, Vec<u8>)> = consumer
        .messages(READ_LIST_REPLY_AM_ID)
        .iter()
        .map(|m| {
            (
                m.header.len(),
                ListReply::decode(&m.header).expect("a well-formed reply"),
                m.data.clone(),
            )
        })
        .collect();
    drop(consumer);
    assert_eq!(rt.block_on(backend.unmap(region.backend_region_id)), Ok(()));
    let live = owner.live_registrations();
    rt.block_on(owner.shutdown());
    assert!(all, "not every entry was answered: {}", replies.len());
    assert_eq!(live, Some(0));
    assert!(replies.len() > 1, "one reply could not fit");
    for (header_len, _, _) in &replies {
        assert!(*header_len < SMALL_SEGMENT, "a {header_len}-byte header");
    }
    let ids: Vec<u64> = replies
        .iter()
        .flat_map(|(_, reply, _)| reply.entries.iter().map(|e| e.request_id))
        .collect();
    let asked: Vec<u64> = request.entries.iter().map(|e| e.request_id).collect();
    assert_eq!(ids, asked, "every entry once, in order");
    let mut payload = Vec::new();
    for (_, reply, data) in &replies {
        assert!(
            reply
                .entries
                .iter()
                .all(|e| e.status == ReplyStatus::Served)
        );
        payload.extend_from_slice(data);
    }
    let want: Vec<u8> = (0..MAX_LIST_ENTRIES)
        .flat_map(|i| (i * 4096 + 5..i * 4096 + 69).map(pattern))
        .collect();
    assert_eq!(payload, want);
}
