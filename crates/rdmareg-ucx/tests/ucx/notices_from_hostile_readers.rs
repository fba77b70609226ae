//! Notices from raw peers that do not play by the rules: malformed and
//! rendezvous messages, replays, floods, and forged sender numbers. The
//! owner drops what it must, counts each drop by reason, keeps its queue
//! within its bounds and goes on serving honest readers.

use crate::common;

use std::time::Duration;

use common::raw_am::Raw;
use common::*;
use futures::StreamExt;
use futures::stream::BoxStream;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{Notice, NoticeSender};
use rdmareg_engine::notices::{NoticeLimits, wire};
use rdmareg_ucx::read_protocol::NOTICE_AM_ID;
use rdmareg_ucx::{Transport, UcxEngine};
use ucx_sys as sys;

fn notice(sender: u64, sequence: u64, bytes: &[u8]) -> Vec<u8> {
    wire::encode(sender, sequence, bytes).expect("within the bound")
}

/// Sends `message` as a notice from `raw` on `ep`, with the reply flag as
/// an engine sends it, and waits for the send to complete.
fn send(raw: &Raw, ep: sys::ucp_ep_h, message: &[u8]) {
    raw.send_wait(
        ep,
        NOTICE_AM_ID,
        &[],
        message,
        sys::UCP_AM_SEND_FLAG_REPLY | sys::UCP_AM_SEND_FLAG_EAGER,
    );
}

/// The notices that arrive within `quiet` of each other.
fn collect(
    rt: &tokio::runtime::Runtime,
    notices: &mut BoxStream<'static, Notice>,
    raw: &Raw,
    quiet: Duration,
) -> Vec<Notice> {
    let mut got = Vec::new();
    loop {
        raw.progress_for(Duration::from_millis(20));
        match rt.block_on(async { tokio::time::timeout(quiet, notices.next()).await }) {
            Ok(Some(notice)) => got.push(notice),
            _ => return got,
        }
    }
}

/// Truncated, mis-versioned, oversized and mis-sized notices are dropped
/// and counted as malformed; the well-formed one after them arrives.
#[test]
fn malformed_notices_are_counted_and_honest_ones_still_arrive() {
    let rt = runtime();
    let engine = tcp_engine();
    let backend = engine.backend();
    let mut notices = backend.notices().unwrap();
    let raw = Raw::new(false);
    let ep = raw.connect(&engine.worker_address());
    let good = notice(7, 1, b"good");
    let mut wrong_version = good.clone();
    wrong_version[0] = 9;
    let mut oversized = good.clone();
    oversized[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    let mut short = good.clone();
    short.pop();
    for bad in [&[0xAB; 5][..], &wrong_version, &oversized, &short] {
        send(&raw, ep, bad);
    }
    send(&raw, ep, &good);

    let got = collect(&rt, &mut notices, &raw, Duration::from_millis(300));
    assert_eq!(got.len(), 1, "only the well-formed notice");
    assert_eq!(got[0].from, NoticeSender(7));
    assert_eq!(&got[0].bytes[..], b"good");
    assert_eq!(backend.notice_drops().unwrap().malformed, 4);
    drop(raw);
    rt.block_on(engine.shutdown());
}

/// A notice sent by rendezvous is not one an engine sends: the owner
/// drops it inside its handler, holding none of UCX's data, and counts it.
#[test]
fn a_rendezvous_notice_is_dropped_and_counted() {
    let rt = runtime();
    let engine = tcp_engine();
    let backend = engine.backend();
    let raw = Raw::new(false);
    let ep = raw.connect(&engine.worker_address());
    raw.send_wait(
        ep,
        NOTICE_AM_ID,
        &[],
        &notice(7, 1, &[1; 4096]),
        sys::UCP_AM_SEND_FLAG_REPLY | sys::UCP_AM_SEND_FLAG_RNDV,
    );
    let counted = raw.progress_until(Duration::from_secs(5), |_| {
        backend.notice_drops().unwrap().malformed == 1
    });
    assert!(counted, "{:?}", backend.notice_drops());
    assert_eq!(engine.live_registrations(), Some(0));
    drop(raw);
    rt.block_on(engine.shutdown());
}

/// A number already taken from a sender on a connection is a replay; a
/// second peer naming the same sender number on its own connection is
/// heard, and spends nothing of the first's.
#[test]
fn replays_are_dropped_and_a_forged_sender_harms_no_one() {
    let rt = runtime();
    let engine = tcp_engine();
    let backend = engine.backend();
    let mut notices = backend.notices().unwrap();
    let (honest, forger) = (Raw::new(false), Raw::new(false));
    let honest_ep = honest.connect(&engine.worker_address());
    let forger_ep = forger.connect(&engine.worker_address());
    send(&honest, honest_ep, &notice(7, 1, b"one"));
    send(&honest, honest_ep, &notice(7, 1, b"one again"));
    send(&forger, forger_ep, &notice(7, u64::MAX, b"forged"));
    send(&honest, honest_ep, &notice(7, 2, b"two"));
    forger.progress_for(Duration::from_millis(50));

    let got: Vec<_> = collect(&rt, &mut notices, &honest, Duration::from_millis(300))
        .into_iter()
        .map(|n| n.bytes)
        .collect();
    assert_eq!(got.len(), 3, "{got:?}");
    assert!(got.iter().any(|b| &b[..] == b"forged"));
    let honest_ones: Vec<_> = got.iter().filter(|b| &b[..] != b"forged").collect();
    assert_eq!(honest_ones, [&b"one"[..], &b"two"[..]]);
    assert_eq!(backend.notice_drops().unwrap().replayed, 1);
    drop((honest, forger));
    rt.block_on(engine.shutdown());
}

/// A peer flooding notices fills its own share of the owner's bounded
/// queue and loses the rest, counted; another reader's notices still get
/// in, and a reader of the engine's own kind reads the queue out.
#[test]
fn a_flood_fills_one_share_and_others_get_in() {
    let rt = runtime();
    init_tracing();
    let limits = NoticeLimits {
        queued: 8,
        queued_per_sender: 4,
        ..NoticeLimits::default()
    };
    let engine =
        UcxEngine::start(config(Transport::Tcp).with_notice_limits(limits)).expect("engine starts");
    let backend = engine.backend();
    let raw = Raw::new(false);
    let ep = raw.connect(&engine.worker_address());
    for sequence in 1..=100 {
        send(&raw, ep, &notice(7, sequence, b"flood"));
    }
    send(&raw, ep, &notice(8, 1, b"quiet"));
    let arrived = raw.progress_until(Duration::from_secs(5), |_| {
        backend.notice_drops().unwrap().sender_queue_full == 96
    });
    assert!(arrived, "{:?}", backend.notice_drops());

    let mut notices = backend.notices().unwrap();
    let got = collect(&rt, &mut notices, &raw, Duration::from_millis(300));
    let flood = got.iter().filter(|n| n.from == NoticeSender(7)).count();
    let quiet = got.iter().filter(|n| n.from == NoticeSender(8)).count();
    assert_eq!((flood, quiet), (4, 1));
    drop(raw);
    rt.block_on(engine.shutdown());
}

/// Shutting the engine down ends its stream of notices.
#[test]
fn shutdown_ends_the_stream_of_notices() {
    let rt = runtime();
    let engine = tcp_engine();
    let mut notices = engine.backend().notices().unwrap();
    rt.block_on(engine.shutdown());
    let end =
        rt.block_on(async { tokio::time::timeout(Duration::from_secs(5), notices.next()).await });
    assert!(matches!(end, Ok(None)), "the stream ended");
}
