//! Hostile raw UCX peers against the owner-served read protocol: owners
//! that answer reads sent to someone else or send malformed replies, by
//! rendezvous too, and vanish mid-rendezvous; consumers that send bad
//! requests, hold replies open past the owner's bound, its unmap or its
//! teardown, or vanish mid-reply. Each test asserts what the engine
//! promises where only the real transport shows it; the protocol's rules
//! alone are the engine kit's deterministic scenarios
//! (`rdmareg-engine`'s `served::scenarios`).
//!
//! Raw peers live on the test thread; the engines run their own progress
//! threads, and engine futures are driven on a small tokio runtime.

use crate::common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::raw_am::Raw;
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, PeerId, RdmaError};
use rdmareg_ucx::read_protocol::{
    READ_REPLY_AM_ID, READ_REQUEST_AM_ID, ReadReply, ReadRequest, Refusal, ReplyStatus, ServedKey,
};
use rdmareg_ucx::{Transport, UcxConfig, UcxEngine};
use ucx_sys as sys;

const SILENT_OWNER: PeerId = PeerId(1);

/// A served reply a hostile peer B forges for request id `id`.
fn forged_reply(id: u64, len: u64) -> [u8; 20] {
    ReadReply {
        request_id: id,
        status: ReplyStatus::Served,
        length: len,
    }
    .encode()
}

/// Posts a GET of `len` bytes to the silent raw owner A; returns the task.
fn post_get_to_silent_owner(
    rt: &tokio::runtime::Runtime,
    consumer: &UcxEngine,
    dest: &PageBuf,
    len: u64,
    deadline: Duration,
) -> tokio::task::JoinHandle<Result<(), RdmaError>> {
    let cb = consumer.backend();
    let dest_region = rt.block_on(map(&cb, dest));
    let key = ServedKey {
        region_id: 1,
        capability: [0x11; 16],
    };
    let request = BackendGet {
        peer: SILENT_OWNER,
        remote_addr: 0x10_0000,
        packed_key: Bytes::copy_from_slice(&key.encode()),
        local_region_id: dest_region.backend_region_id,
        local_offset: 0,
        len,
        deadline: Some(deadline),
    };
    rt.spawn(async move { cb.get_into_test_memory(request).await })
}

/// A consumer whose endpoint has no peer error handling starts a large
/// reply's rendezvous and then disappears entirely (its worker is
/// destroyed): the owner's lease ends, its unmap answers, and it survives.
#[test]
fn a_vanished_consumer_without_error_handling_releases_its_lease() {
    let rt = runtime();
    let owner = tcp_engine();
    let ob = owner.backend();
    let len = 8 * 1024 * 1024;
    let buf = PageBuf::filled(len, pattern);
    let region = rt.block_on(map(&ob, &buf));
    let key = ServedKey::decode(&region.packed_key).unwrap();

    let r = Raw::new(true);
    let ep = r.connect_mode(&owner.worker_address(), false);
    let request = ReadRequest {
        request_id: 1,
        key,
        address: buf.addr() as u64,
        length: len as u64,
    };
    r.send_wait(
        ep,
        READ_REQUEST_AM_ID,
        &request.encode(),
        &[],
        sys::UCP_AM_SEND_FLAG_REPLY,
    );
    assert!(r.progress_until(Duration::from_secs(5), |r| {
        !r.messages(READ_REPLY_AM_ID).is_empty()
    }));
    drop(r); // gone, socket closed
    let unmap = {
        let ob = ob.clone();
        let id = region.backend_region_id;
        rt.spawn(async move { ob.unmap(id).await })
    };
    let start = Instant::now();
    while !unmap.is_finished() && start.elapsed() < Duration::from_secs(8) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let answered = unmap.is_finished();
    eprintln!("unmap answered within 8 s after the consumer vanished: {answered}");
    let t = Instant::now();
    rt.block_on(owner.shutdown());
    eprintln!("owner shutdown took {:?}", t.elapsed());
    let result = rt.block_on(unmap).unwrap();
    eprintln!("unmap answered {result:?}");
    drop(buf);
    assert!(
        answered,
        "unmap never answered although the consumer is gone"
    );
}

/// Posts a GET to the raw owner `a` (added as SILENT_OWNER) and returns the
/// request `a` received plus the task.
fn get_from_raw_owner(
    rt: &tokio::runtime::Runtime,
    consumer: &UcxEngine,
    a: &Raw,
    dest: &PageBuf,
    len: u64,
    deadline: Duration,
) -> (
    ReadRequest,
    sys::ucp_ep_h,
    tokio::task::JoinHandle<Result<(), RdmaError>>,
) {
    let before = a.messages(READ_REQUEST_AM_ID).len();
    let get = post_get_to_silent_owner(rt, consumer, dest, len, deadline);
    assert!(a.progress_until(
        Duration::from_secs(5),
        |r| r.messages(READ_REQUEST_AM_ID).len() > before
    ));
    let msgs = a.messages(READ_REQUEST_AM_ID);
    let m = &msgs[before];
    (ReadRequest::decode(&m.header).unwrap(), m.reply_ep, get)
}

fn finish(
    rt: &tokio::runtime::Runtime,
    peers: &[&Raw],
    get: tokio::task::JoinHandle<Result<(), RdmaError>>,
    within: Duration,
) -> Option<Result<(), RdmaError>> {
    let start = Instant::now();
    while !get.is_finished() && start.elapsed() < within {
        for p in peers {
            p.progress_for(Duration::from_millis(2));
        }
    }
    if get.is_finished() {
        Some(rt.block_on(get).unwrap())
    } else {
        get.abort();
        None
    }
}

/// A hostile OWNER (the peer the read was sent to, replying on the endpoint
/// the request came from) answers with every kind of malformed reply. The consumer must neither panic nor land more than it
/// asked for, and keep working.
#[test]
fn a_hostile_owner_sending_malformed_replies_lands_nothing() {
    let rt = runtime();
    let consumer = tcp_engine();
    let a = Raw::new(false);
    consumer.add_peer(SILENT_OWNER, a.address()).unwrap();
    let d = Duration::from_secs(3);

    // 1. Eager reply: header says 4096, payload 8192 (overflow attempt).
    let dest = PageBuf::zeroed(8192);
    {
        let (req, ep, get) = get_from_raw_owner(&rt, &consumer, &a, &dest, 4096, d);
        a.send_wait(
            ep,
            READ_REPLY_AM_ID,
            &forged_reply(req.request_id, 4096),
            &[0xEE; 8192],
            sys::UCP_AM_SEND_FLAG_REPLY,
        );
        let r = finish(&rt, &[&a], get, Duration::from_secs(5));
        eprintln!("longer eager payload: {r:?}");
        assert!(matches!(r, Some(Err(RdmaError::Backend(_)))));
        assert!(dest.snapshot().iter().all(|&x| x == 0), "bytes landed");
    }
    // 2. Rendezvous reply larger than requested.
    let big = vec![0xEEu8; 1 << 20];
    {
        let (req, ep, get) = get_from_raw_owner(&rt, &consumer, &a, &dest, 4096, d);
        a.send_wait(
            ep,
            READ_REPLY_AM_ID,
            &forged_reply(req.request_id, 4096),
            &big,
            sys::UCP_AM_SEND_FLAG_REPLY | sys::UCP_AM_SEND_FLAG_RNDV,
        );
        let r = finish(&rt, &[&a], get, Duration::from_secs(5));
        eprintln!("oversized rendezvous: {r:?}");
        assert!(matches!(r, Some(Err(RdmaError::Backend(_)))));
        assert!(dest.snapshot().iter().all(|&x| x == 0), "bytes landed");
    }
    // 3. Short payload, header claims full length.
    {
        let (req, ep, get) = get_from_raw_owner(&rt, &consumer, &a, &dest, 4096, d);
        a.send_wait(
            ep,
            READ_REPLY_AM_ID,
            &forged_reply(req.request_id, 4096),
            &[0xEE; 100],
            sys::UCP_AM_SEND_FLAG_REPLY,
        );
        let r = finish(&rt, &[&a], get, Duration::from_secs(5));
        eprintln!("short payload: {r:?}");
        assert!(matches!(r, Some(Err(RdmaError::Backend(_)))));
    }
    // 4. Malformed headers of every length, unknown status, refusal with a
    //    rendezvous payload, replies to unknown ids; then a timed-out read
    //    gets a late reply.
    {
        let (req, ep, get) =
            get_from_raw_owner(&rt, &consumer, &a, &dest, 4096, Duration::from_millis(300));
        for n in 0..40usize {
            a.send_wait(ep, READ_REPLY_AM_ID, &vec![1u8; n], &[0xEE; 16], 0);
        }
        let mut bad = forged_reply(req.request_id, 4096);
        bad[1] = 99;
        a.send_wait(ep, READ_REPLY_AM_ID, &bad, &[0xEE; 4096], 0);
        a.send_wait(
            ep,
            READ_REPLY_AM_ID,
            &forged_reply(u64::MAX, 4096),
            &[0xEE; 4096],
            sys::UCP_AM_SEND_FLAG_REPLY,
        );
        let r = finish(&rt, &[&a], get, Duration::from_secs(5));
        eprintln!("after garbage, the read answered {r:?}");
        assert_eq!(r, Some(Err(RdmaError::Timeout)));
        // Late reply, eager and rendezvous.
        a.send_wait(
            ep,
            READ_REPLY_AM_ID,
            &forged_reply(req.request_id, 4096),
            &[0xEE; 4096],
            sys::UCP_AM_SEND_FLAG_REPLY,
        );
        a.send_wait(
            ep,
            READ_REPLY_AM_ID,
            &forged_reply(req.request_id, 4096),
            &[0xEE; 4096],
            sys::UCP_AM_SEND_FLAG_REPLY | sys::UCP_AM_SEND_FLAG_RNDV,
        );
        a.progress_for(Duration::from_millis(200));
        assert!(
            dest.snapshot().iter().all(|&x| x == 0),
            "a late reply landed"
        );
    }
    // 5. Rendezvous reply of the right length, then the owner vanishes
    //    mid-rendezvous (before sending data).
    {
        let a2 = Raw::new(false);
        consumer.add_peer(PeerId(7), a2.address()).unwrap();
        let cb = consumer.backend();
        let dest2 = PageBuf::zeroed(1 << 20);
        let dest_region = rt.block_on(map(&cb, &dest2));
        let request = BackendGet {
            peer: PeerId(7),
            remote_addr: 0x10_0000,
            packed_key: Bytes::copy_from_slice(
                &ServedKey {
                    region_id: 1,
                    capability: [0; 16],
                }
                .encode(),
            ),
            local_region_id: dest_region.backend_region_id,
            local_offset: 0,
            len: 1 << 20,
            deadline: Some(Duration::from_secs(3)),
        };
        let cb2 = cb.clone();
        let get = rt.spawn(async move { cb2.get_into_test_memory(request).await });
        assert!(a2.progress_until(Duration::from_secs(5), |r| {
            !r.messages(READ_REQUEST_AM_ID).is_empty()
        }));
        let (req, ep) = {
            let m = &a2.messages(READ_REQUEST_AM_ID)[0];
            (ReadRequest::decode(&m.header).unwrap(), m.reply_ep)
        };
        let _pending = a2.send(
            ep,
            READ_REPLY_AM_ID,
            &forged_reply(req.request_id, 1 << 20),
            &big,
            sys::UCP_AM_SEND_FLAG_REPLY | sys::UCP_AM_SEND_FLAG_RNDV,
        );
        drop(a2);
        let r = finish(&rt, &[&a], get, Duration::from_secs(8));
        eprintln!("owner vanished mid-rendezvous: {r:?}");
        assert!(r.is_some(), "the read never answered");
        let unmap = rt.block_on(cb.unmap(dest_region.backend_region_id));
        assert_eq!(unmap, Ok(()));
    }
    rt.block_on(consumer.shutdown());
    assert_eq!(consumer.live_registrations(), Some(0));
}

/// A hostile CONSUMER sends the owner every kind of bad request.
#[test]
fn a_hostile_consumer_sending_bad_requests_gets_refusals_only() {
    let rt = runtime();
    let owner = tcp_engine();
    let ob = owner.backend();
    let buf = PageBuf::filled(4096, pattern);
    let region = rt.block_on(map(&ob, &buf));
    let key = ServedKey::decode(&region.packed_key).unwrap();
    let r = Raw::new(false);
    let ep = r.connect(&owner.worker_address());
    let base = buf.addr() as u64;
    let ask = |id: u64, key: ServedKey, address: u64, length: u64| {
        ReadRequest {
            request_id: id,
            key,
            address,
            length,
        }
        .encode()
    };
    let mut forged = key;
    forged.capability[15] ^= 1;
    let cases: Vec<(u64, [u8; 52])> = vec![
        (1, ask(1, key, base, u64::MAX)),
        (2, ask(2, key, u64::MAX, 1)),
        (3, ask(3, key, u64::MAX - 10, 20)),
        (4, ask(4, key, base + 1, 4096)),
        (5, ask(5, key, base - 1, 2)),
        (6, ask(6, forged, base, 16)),
        (
            7,
            ask(
                7,
                ServedKey {
                    region_id: key.region_id + 1,
                    ..key
                },
                base,
                16,
            ),
        ),
        (8, ask(8, key, base, 0)),
        (9, ask(9, key, 0, 4096)),
    ];
    for (_, req) in &cases {
        r.send_wait(
            ep,
            READ_REQUEST_AM_ID,
            req,
            &[],
            sys::UCP_AM_SEND_FLAG_REPLY,
        );
    }
    // Without the reply flag, and malformed headers.
    r.send_wait(ep, READ_REQUEST_AM_ID, &ask(100, key, base, 16), &[], 0);
    for n in 0..60usize {
        r.send_wait(
            ep,
            READ_REQUEST_AM_ID,
            &vec![1u8; n],
            &[],
            sys::UCP_AM_SEND_FLAG_REPLY,
        );
    }
    // A request carried as a rendezvous payload.
    r.send_wait(
        ep,
        READ_REQUEST_AM_ID,
        &ask(101, key, base, 16),
        &vec![0u8; 1 << 20],
        sys::UCP_AM_SEND_FLAG_REPLY | sys::UCP_AM_SEND_FLAG_RNDV,
    );
    r.progress_for(Duration::from_millis(500));
    let replies: Vec<(ReadReply, usize)> = r
        .messages(READ_REPLY_AM_ID)
        .iter()
        .map(|m| {
            (
                ReadReply::decode(&m.header).unwrap(),
                m.data.len() + m.rndv_len,
            )
        })
        .collect();
    for (reply, n) in &replies {
        eprintln!("{:?} payload {}", reply, n);
    }
    for (reply, n) in &replies {
        if reply.request_id == 101 {
            continue;
        }
        assert!(matches!(reply.status, ReplyStatus::Refused(_)), "{reply:?}");
        assert_eq!(*n, 0);
    }
    assert!(!replies.iter().any(|(reply, _)| reply.request_id == 100));
    drop(r);
    assert_eq!(rt.block_on(ob.unmap(region.backend_region_id)), Ok(()));
    rt.block_on(owner.shutdown());
}

/// B is itself an owner the consumer reads from. From the consumer's
/// request to B it learns the id counter and gets a reply endpoint, and it
/// answers the consumer's next read — sent to owner A — over that
/// endpoint. The reply arrives on B's endpoint, not A's: dropped.
#[test]
fn an_owner_cannot_answer_a_read_sent_to_another_owner() {
    let rt = runtime();
    let consumer = tcp_engine();
    let a = Raw::new(false); // owner A: silent
    let b = Raw::new(false); // owner B: hostile, also holds its own read
    consumer.add_peer(SILENT_OWNER, a.address()).unwrap();
    consumer.add_peer(PeerId(2), b.address()).unwrap();
    let cb = consumer.backend();

    // The consumer reads from B.
    let dest_b = PageBuf::zeroed(4096);
    let dest_b_region = rt.block_on(map(&cb, &dest_b));
    let to_b = BackendGet {
        peer: PeerId(2),
        remote_addr: 0x20_0000,
        packed_key: Bytes::copy_from_slice(
            &ServedKey {
                region_id: 9,
                capability: [2; 16],
            }
            .encode(),
        ),
        local_region_id: dest_b_region.backend_region_id,
        local_offset: 0,
        len: 4096,
        deadline: Some(Duration::from_secs(5)),
    };
    let cb2 = cb.clone();
    let _get_b = rt.spawn(async move { cb2.get_into_test_memory(to_b).await });
    assert!(b.progress_until(Duration::from_secs(5), |r| {
        !r.messages(READ_REQUEST_AM_ID).is_empty()
    }));
    let (seen, reply_ep) = {
        let m = &b.messages(READ_REQUEST_AM_ID)[0];
        (
            ReadRequest::decode(&m.header).unwrap().request_id,
            m.reply_ep,
        )
    };

    // Then from A; B answers it with id seen + 1 over its reply endpoint.
    let dest = PageBuf::zeroed(4096);
    let (to_a, _, get_a) =
        get_from_raw_owner(&rt, &consumer, &a, &dest, 4096, Duration::from_secs(2));
    eprintln!(
        "B saw id {seen}; the read to A carries id {}",
        to_a.request_id
    );
    b.send_wait(
        reply_ep,
        READ_REPLY_AM_ID,
        &forged_reply(seen + 1, 4096),
        &[0xEE; 4096],
        0,
    );
    let r = finish(&rt, &[&a, &b], get_a, Duration::from_secs(5));
    let forged = dest.snapshot().iter().all(|&x| x == 0xEE);
    eprintln!("read to A answered {r:?}; destination holds B's bytes: {forged}");
    rt.block_on(consumer.shutdown());
    drop(b);
    drop(a);
    assert_eq!(
        r,
        Some(Err(RdmaError::Timeout)),
        "B's forged answer completed a read sent to A"
    );
}

/// Sends read requests of `length` bytes at the start of `buf` from `r` on
/// `ep`, ids `1..=count`, and progresses until every reply arrived (or 10 s).
fn request_many(
    r: &Raw,
    ep: sys::ucp_ep_h,
    key: ServedKey,
    buf: &PageBuf,
    length: u64,
    count: u64,
) {
    request_ids(r, ep, key, buf, length, 1..=count);
}

/// [`request_many`] with the ids `ids`; waits until `r` holds as many
/// replies in all as the last id.
fn request_ids(
    r: &Raw,
    ep: sys::ucp_ep_h,
    key: ServedKey,
    buf: &PageBuf,
    length: u64,
    ids: std::ops::RangeInclusive<u64>,
) {
    let count = *ids.end();
    for id in ids {
        let request = ReadRequest {
            request_id: id,
            key,
            address: buf.addr() as u64,
            length,
        };
        r.send_wait(
            ep,
            READ_REQUEST_AM_ID,
            &request.encode(),
            &[],
            sys::UCP_AM_SEND_FLAG_REPLY,
        );
    }
    r.progress_until(Duration::from_secs(10), |r| {
        r.messages(READ_REPLY_AM_ID).len() as u64 >= count
    });
}

/// Most replies one consumer connection may hold open at an owner started
/// with the default configuration.
const HELD_REPLIES_BOUND: usize = UcxConfig::DEFAULT_MAX_SERVED_REPLIES_PER_CONNECTION as usize;

/// Replies `r` received that it holds (rendezvous kept, not taken).
fn held_replies(r: &Raw) -> usize {
    r.messages(READ_REPLY_AM_ID)
        .iter()
        .filter(|m| !m.desc.is_null())
        .count()
}

/// Replies `r` received refused as `refusal`.
fn refused_as(r: &Raw, refusal: Refusal) -> usize {
    r.messages(READ_REPLY_AM_ID)
        .iter()
        .filter(|m| {
            ReadReply::decode(&m.header)
                .is_ok_and(|reply| reply.status == ReplyStatus::Refused(refusal))
        })
        .count()
}

/// This process's resident set, KiB (0 where /proc does not say).
fn resident_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("VmRSS:"))
                .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// Polls `done` every 10 ms while `r` (if any) progresses, up to `within`.
fn wait_until(r: Option<&Raw>, within: Duration, mut done: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < within {
        if done() {
            return true;
        }
        match r {
            Some(r) => r.progress_for(Duration::from_millis(10)),
            None => std::thread::sleep(Duration::from_millis(10)),
        }
    }
    done()
}

/// An owner engine on tcp with at most `bound` unfinished replies per
/// consumer connection.
fn bounded_owner(bound: u32) -> UcxEngine {
    init_tracing();
    UcxEngine::start(config(Transport::Tcp).with_max_served_replies_per_connection(bound))
        .expect("engine starts")
}

/// A consumer that asks for many large reads and never takes their bytes
/// would hold one owner lease and one UCX send per reply, growing the
/// owner's memory without limit. The owner serves up to its bound per
/// connection and refuses the rest as busy: the consumer holds exactly the
/// bound, and everything is released when it goes away.
#[test]
fn one_consumer_cannot_hold_an_unbounded_number_of_served_replies_open() {
    let rt = runtime();
    let owner = tcp_engine();
    let ob = owner.backend();
    let buf = PageBuf::filled(8 << 20, pattern);
    let region = rt.block_on(map(&ob, &buf));
    let key = ServedKey::decode(&region.packed_key).unwrap();
    let r = Raw::new(true);
    let ep = r.connect(&owner.worker_address());
    let asked = 4 * HELD_REPLIES_BOUND as u64;
    let resident_before = resident_kib();
    // Large enough that UCX sends every reply by rendezvous over tcp.
    request_many(&r, ep, key, &buf, 8 << 20, asked);
    let held = held_replies(&r);
    let busy = refused_as(&r, Refusal::Busy);
    let in_flight = owner.served_replies_in_flight();
    let resident_growth = resident_kib().saturating_sub(resident_before);
    eprintln!(
        "{asked} large reads asked: {held} replies held open, {busy} refused as busy; \
         owner counts {in_flight} in flight; process grew {resident_growth} KiB"
    );
    drop(r);
    let released = wait_until(None, Duration::from_secs(8), || {
        owner.served_replies_in_flight() == 0
    });
    let unmapped = rt.block_on(ob.unmap(region.backend_region_id));
    rt.block_on(owner.shutdown());
    drop(buf);
    assert_eq!(unmapped, Ok(()));
    assert!(
        held <= HELD_REPLIES_BOUND,
        "one consumer holds {held} served replies open (bound {HELD_REPLIES_BOUND})"
    );
    assert_eq!(held, HELD_REPLIES_BOUND, "reads up to the bound are served");
    assert_eq!(
        busy as u64,
        asked - held as u64,
        "every read past it is refused as busy"
    );
    assert_eq!(in_flight, held, "the owner's own count");
    assert!(
        released,
        "the owner's count went back to zero once the consumer left"
    );
}

/// The deepest an honest consumer of this workspace goes — `rdmareg bench`'s
/// largest window, 1024 reads, posted as one batch of rendezvous-sized reads
/// to one owner with the default bound, and its scatter list, 1000 reads of
/// 4 KiB (which travel gathered) — is never refused, and leaves nothing
/// counted at the owner.
#[test]
fn an_honest_deep_batch_is_never_refused() {
    let rt = runtime();
    let (owner, consumer) = engines(Transport::Tcp);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let mut outcomes = Vec::new();
    for (entries, entry) in [(1024usize, 64usize << 10), (1000, 4 << 10)] {
        let src = PageBuf::filled(entry, pattern);
        let dst = PageBuf::zeroed(entries * entry);
        let src_region = rt.block_on(map(&ob, &src));
        let dst_region = rt.block_on(map(&cb, &dst));
        let source = describe(&src, &src_region);
        let requests = (0..entries)
            .map(|i| get_request(OWNER, &source, &dst_region, (i * entry) as u64, None))
            .collect();
        let answers = rt.block_on(cb.get_batch_into_test_memory(requests));
        let refused: Vec<_> = answers.into_iter().filter(Result::is_err).collect();
        let landed = dst
            .snapshot()
            .chunks(entry)
            .all(|chunk| chunk == &src.snapshot()[..]);
        let left = owner.served_replies_in_flight();
        eprintln!(
            "{entries} reads of {entry} B: {} refused; owner count after {left}",
            refused.len()
        );
        assert_eq!(rt.block_on(cb.unmap(dst_region.backend_region_id)), Ok(()));
        assert_eq!(rt.block_on(ob.unmap(src_region.backend_region_id)), Ok(()));
        outcomes.push((entries, entry, refused, landed, left));
    }
    rt.block_on(consumer.shutdown());
    rt.block_on(owner.shutdown());
    for (entries, entry, refused, landed, left) in outcomes {
        assert!(refused.is_empty(), "{entries} × {entry} B: {refused:?}");
        assert!(landed, "{entries} × {entry} B");
        assert_eq!(left, 0, "{entries} × {entry} B");
    }
}

/// A consumer holding replies at the bound dies — with and without peer
/// error handling on its endpoint: the owner's count of its unfinished
/// replies goes back to zero, as do the region's leases (the unmap answers).
#[test]
fn counts_are_released_when_the_consumers_endpoint_dies() {
    let rt = runtime();
    let owner = bounded_owner(3);
    let ob = owner.backend();
    let buf = PageBuf::filled(8 << 20, pattern);
    let region = rt.block_on(map(&ob, &buf));
    let key = ServedKey::decode(&region.packed_key).unwrap();
    let mut outcomes = Vec::new();
    for peer_errors in [true, false] {
        let r = Raw::new(true);
        let ep = r.connect_mode(&owner.worker_address(), peer_errors);
        request_ids(&r, ep, key, &buf, 8 << 20, 1..=4);
        let counted = owner.served_replies_in_flight();
        let busy = refused_as(&r, Refusal::Busy);
        drop(r);
        let released = wait_until(None, Duration::from_secs(8), || {
            owner.served_replies_in_flight() == 0
        });
        eprintln!("peer errors {peer_errors}: counted {counted}, busy {busy}, released {released}");
        outcomes.push((peer_errors, counted, busy, released));
    }
    let unmapped = rt.block_on(ob.unmap(region.backend_region_id));
    rt.block_on(owner.shutdown());
    drop(buf);
    for (peer_errors, counted, busy, released) in outcomes {
        assert_eq!((counted, busy), (3, 1), "peer errors {peer_errors}");
        assert!(
            released,
            "peer errors {peer_errors}: the count was not released"
        );
    }
    assert_eq!(unmapped, Ok(()));
    assert_eq!(owner.live_registrations(), Some(0));
}

/// A live consumer holds a large reply open and never lets it go. The
/// owner's shutdown must still end within its teardown timeout, answer the
/// unmap parked behind that reply, and leave nothing registered: a hostile
/// consumer can delay an owner's unmap, not its teardown.
#[test]
fn a_consumer_holding_a_reply_open_cannot_stall_the_owners_teardown() {
    let rt = runtime();
    init_tracing();
    let teardown = Duration::from_secs(2);
    let owner =
        UcxEngine::start(config(Transport::Tcp).with_teardown_timeout(teardown)).expect("starts");
    let ob = owner.backend();
    let buf = PageBuf::filled(8 << 20, pattern);
    let region = rt.block_on(map(&ob, &buf));
    let key = ServedKey::decode(&region.packed_key).unwrap();
    let r = Raw::new(true);
    let ep = r.connect(&owner.worker_address());
    request_many(&r, ep, key, &buf, 8 << 20, 1);
    let held = r
        .messages(READ_REPLY_AM_ID)
        .iter()
        .any(|m| !m.desc.is_null());
    let unmap = {
        let ob = ob.clone();
        let id = region.backend_region_id;
        rt.spawn(async move { ob.unmap(id).await })
    };
    // Let the unmap reach the engine and park behind the held reply before
    // the shutdown begins (an unmap submitted after it is another case).
    r.progress_for(Duration::from_millis(300));
    let parked = !unmap.is_finished();
    // The consumer keeps progressing (it is alive) while the owner shuts
    // down on another thread.
    let shutdown = {
        let started = Instant::now();
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = std::sync::Arc::clone(&done);
        let owner = &owner;
        std::thread::scope(|scope| {
            scope.spawn(move || {
                owner.shutdown_blocking();
                flag.store(true, std::sync::atomic::Ordering::SeqCst);
            });
            while !done.load(std::sync::atomic::Ordering::SeqCst)
                && started.elapsed() < teardown * 4
            {
                r.progress_for(Duration::from_millis(5));
            }
        });
        started.elapsed()
    };
    let unmapped = rt.block_on(unmap).unwrap();
    let live = owner.live_registrations();
    eprintln!(
        "held {held}; parked {parked}; teardown took {shutdown:?}; unmap {unmapped:?}; live {live:?}"
    );
    drop(r);
    drop(buf);
    assert!(held, "the consumer held a rendezvous reply");
    assert!(parked, "the unmap answered while the reply was held");
    assert!(
        shutdown <= teardown + Duration::from_secs(1),
        "teardown took {shutdown:?} (timeout {teardown:?})"
    );
    assert_eq!(unmapped, Ok(()), "the parked unmap after teardown");
    assert_eq!(live, Some(0));
}

/// An owner's registry describes a pool buffer, a live consumer starts the
/// buffer's large reply and keeps it, and the owner drops the buffer. Its
/// granules must not serve another buffer while UCX may still read them for
/// that reply (the new owner's bytes would leave in it); they come back
/// once the reply is let go and the buffer's own registration is unmapped.
#[test]
fn a_freed_described_buffer_is_not_reused_while_a_consumer_holds_its_reply() {
    use rdmareg_registry::{RdmaConfig, RdmaRegistry};

    let rt = runtime();
    let owner = tcp_engine();
    let registry = RdmaRegistry::new(owner.backend(), RdmaConfig::default(), rt.handle().clone())
        .expect("registry");
    let len = 4 << 20;
    let (buf, descriptor) = rt.block_on(async {
        let mut buf = registry.alloc_pinned(len).await.expect("allocates");
        buf.fill(0x11);
        let buf = buf.describe().await.expect("describes");
        let descriptor = buf.descriptor();
        (buf, descriptor)
    });
    let old = buf.as_ptr() as usize;
    let key = ServedKey::decode(descriptor.packed_key()).unwrap();
    let r = Raw::new(true);
    let ep = r.connect(&owner.worker_address());
    let request = ReadRequest {
        request_id: 1,
        key,
        address: descriptor.addr(),
        length: len as u64,
    };
    r.send_wait(
        ep,
        READ_REQUEST_AM_ID,
        &request.encode(),
        &[],
        sys::UCP_AM_SEND_FLAG_REPLY,
    );
    r.progress_until(Duration::from_secs(5), |r| {
        !r.messages(READ_REPLY_AM_ID).is_empty()
    });
    let desc = r.messages(READ_REPLY_AM_ID).first().map(|m| m.desc);
    let held = desc.is_some_and(|d| !d.is_null());
    drop(buf);
    r.progress_for(Duration::from_millis(300));
    let overlaps = |new: usize| new < old + len && old < new + len;
    let while_held = rt.block_on(registry.alloc_pinned(len)).expect("allocates");
    let reused_while_held = overlaps(while_held.as_ptr() as usize);
    drop(while_held);

    r.release_held();
    r.progress_for(Duration::from_millis(300));
    let after = rt.block_on(registry.alloc_pinned(len)).expect("allocates");
    let reused_after = overlaps(after.as_ptr() as usize);
    drop(after);
    let leaked = registry.stats().leaked_bytes;
    drop(r);
    let swept = rt.block_on(registry.shutdown(Duration::from_secs(5)));
    rt.block_on(owner.shutdown());
    let report = swept.finish_after_backend_teardown();
    eprintln!(
        "held {held}; reused while held: {reused_while_held}, after: {reused_after}; leaked {leaked}; {report:?}"
    );
    assert!(held, "the consumer held the buffer's rendezvous reply");
    assert!(
        !reused_while_held,
        "the freed buffer's granules served a new buffer while its reply was held"
    );
    assert!(
        reused_after,
        "the granules came back to the pool once the reply was let go"
    );
    assert_eq!(leaked, 0, "nothing was leaked once the reply was let go");
    assert_eq!(owner.live_registrations(), Some(0));
}
