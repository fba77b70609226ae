//! Served writes against writers that do not play by the rules: raw peers
//! sending forged, misdirected, out-of-range, mis-sized and undecodable
//! write requests, eager and by rendezvous, vanishing in the middle of a
//! large write, or flooding one connection; and an honest writer whose
//! writes race an unmap of their target. The owner refuses each wrong write
//! with its status and changes no byte for it, answers an unmap only once
//! every write it acknowledged is in, keeps serving everyone else, and
//! after a writer vanished says which of its chunks landed.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::raw_am::{Raw, is_err};
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{Access, BackendPut, BackendRegion, RdmaError, WrittenLog};
use rdmareg_engine::served::wire::{self, WRITE_REQUEST_ID_BIT};
use rdmareg_engine::served::{Refusal, Write};
use rdmareg_ucx::read_protocol::{
    READ_REPLY_AM_ID, READ_REQUEST_AM_ID, ReadKey, ServedKey, WRITE_REQUEST_AM_ID,
};
use rdmareg_ucx::{EngineAddress, Transport, UcxBackend, UcxEngine};
use ucx_sys as sys;

const PAGE: usize = 4096;
const MIB: usize = 1 << 20;

/// The UCX status byte of `refusal`.
fn code(refusal: Refusal) -> u8 {
    wire::refusal_code(refusal)
}

/// A registration of part of a test buffer at an owner, as a writer that
/// holds its descriptor knows it.
#[derive(Debug, Clone)]
struct Target {
    id: u64,
    /// The packed key the owner hands out.
    packed: bytes::Bytes,
    key: ServedKey,
    start: u64,
    len: u64,
}

impl Target {
    fn end(&self) -> u64 {
        self.start + self.len
    }
}

/// Maps `[buf + offset, buf + offset + len)` on `backend` with `access`
/// (`Access::Read` through `map`, as an owner registers read-only memory).
fn map_part(
    rt: &tokio::runtime::Runtime,
    backend: &UcxBackend,
    buf: &PageBuf,
    offset: usize,
    len: usize,
    access: Access,
) -> Target {
    assert!(offset + len <= buf.len());
    let ptr = buf.addr() + offset;
    let region: BackendRegion = if access == Access::Read {
        rt.block_on(backend.map_test_memory(ptr, len))
    } else {
        // SAFETY: the range is inside a `PageBuf` the test keeps alive until
        // the registration's unmap answered `Ok` or the engine shut down,
        // and the test reads it only by copying through its raw pointer.
        rt.block_on(unsafe { backend.map_with_access(ptr, len, access) })
    }
    .expect("map succeeds");
    Target {
        id: region.backend_region_id,
        packed: region.packed_key.clone(),
        key: ReadKey::decode(&region.packed_key)
            .expect("an engine key")
            .served(),
        start: ptr as u64,
        len: len as u64,
    }
}

/// The packed key an owner hands out for `target`.
fn packed_key(target: &Target) -> bytes::Bytes {
    target.packed.clone()
}

/// A write request header (the kit's encoding) under write id `n`.
fn header(n: u64, region: u64, capability: [u8; 16], address: u64, length: u64) -> Vec<u8> {
    wire::encode_write_request(&Write {
        request_id: WRITE_REQUEST_ID_BIT | n,
        region,
        capability,
        address,
        length,
    })
    .to_vec()
}

/// An honest header for `target` under write id `n`.
fn honest(n: u64, target: &Target, address: u64, length: u64) -> Vec<u8> {
    header(
        n,
        target.key.region_id,
        target.key.capability,
        address,
        length,
    )
}

const EAGER: u32 = sys::UCP_AM_SEND_FLAG_REPLY | sys::UCP_AM_SEND_FLAG_EAGER;
const RNDV: u32 = sys::UCP_AM_SEND_FLAG_REPLY | sys::UCP_AM_SEND_FLAG_RNDV;
/// What an engine's writer asks: UCX picks the protocol by size.
const DEFAULT: u32 = sys::UCP_AM_SEND_FLAG_REPLY;

/// Every reply `raw` received, by request id: `Some(outcome)`, or `None`
/// for a header that did not decode.
fn replies(raw: &Raw) -> Vec<(u64, Option<Result<u64, Refusal>>)> {
    raw.messages(READ_REPLY_AM_ID)
        .iter()
        .map(|m| match wire::Reply::decode(&m.header) {
            Ok(reply) => (reply.request_id, Some(reply.outcome)),
            Err(_) => (u64::MAX, None),
        })
        .collect()
}

/// The outcome of the reply to write id `n`, once `raw` has it (within 5 s).
fn reply_to(raw: &Raw, n: u64) -> Option<Result<u64, Refusal>> {
    let id = WRITE_REQUEST_ID_BIT | n;
    raw.progress_until(Duration::from_secs(5), |raw| {
        replies(raw).iter().any(|(got, _)| *got == id)
    });
    replies(raw)
        .into_iter()
        .find(|(got, _)| *got == id)
        .and_then(|(_, outcome)| outcome)
}

/// The owner's serving worker address, as a raw UCX peer connects to it
/// (the same-host transport wraps it in an engine address envelope).
fn serving(engine: &UcxEngine) -> bytes::Bytes {
    EngineAddress::decode(&engine.worker_address())
        .expect("an engine address")
        .serving
}

/// Sends `payload` as a write with `header` on `ep` and waits until the
/// send ended.
fn send_write(raw: &Raw, ep: sys::ucp_ep_h, header: &[u8], payload: &[u8], flags: u32) {
    raw.send_wait(ep, WRITE_REQUEST_AM_ID, header, payload, flags);
}

/// Indices where `a` and `b` differ, as `(first, last, count)`.
fn differences(a: &[u8], b: &[u8]) -> Option<(usize, usize, usize)> {
    let mut found: Option<(usize, usize, usize)> = None;
    for (i, _) in a.iter().zip(b).enumerate().filter(|(_, (x, y))| x != y) {
        found = Some(match found {
            None => (i, i, 1),
            Some((first, _, count)) => (first, i, count + 1),
        });
    }
    found
}

/// What the owner must answer a hostile write.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Expect {
    /// This refusal status.
    Status(u8),
    /// An undecodable header: refused malformed under the id it seems to
    /// carry, or dropped without a reply.
    MalformedOrDropped,
}

/// Runs the hostile-write battery against an owner of `transport`.
fn hostile_writes_change_no_byte(transport: Transport) {
    let rt = runtime();
    init_tracing();
    let owner = UcxEngine::start(config(transport)).expect("owner engine starts");
    let ob = owner.backend();
    // Three registrations, each two pages, with an unregistered page
    // before, between and after them: every byte of it is checked.
    let buf = PageBuf::filled(10 * PAGE, pattern);
    let rw = map_part(&rt, &ob, &buf, PAGE, 2 * PAGE, Access::ReadWrite);
    let wo = map_part(&rt, &ob, &buf, 4 * PAGE, 2 * PAGE, Access::Write);
    let ro = map_part(&rt, &ob, &buf, 7 * PAGE, 2 * PAGE, Access::Read);
    let raw = Raw::new(false);
    let ep = raw.connect(&serving(&owner));

    // Honest writes land: the checks below are not vacuous.
    let original = buf.snapshot();
    send_write(
        &raw,
        ep,
        &honest(1, &rw, rw.start + 100, 64),
        &[0x5A; 64],
        EAGER,
    );
    send_write(&raw, ep, &honest(2, &wo, wo.start, 32), &[0xA5; 32], EAGER);
    assert_eq!(reply_to(&raw, 1), Some(Ok(64)), "an honest write to rw");
    assert_eq!(reply_to(&raw, 2), Some(Ok(32)), "an honest write to wo");
    let mut want = original.clone();
    want[PAGE + 100..PAGE + 164].fill(0x5A);
    want[4 * PAGE..4 * PAGE + 32].fill(0xA5);
    assert_eq!(differences(&buf.snapshot(), &want), None, "honest bytes");

    let before = buf.snapshot();
    let forged = {
        let mut capability = rw.key.capability;
        capability[15] ^= 1;
        capability
    };
    let truncated = honest(16, &rw, rw.start, 8)[..51].to_vec();
    let mut trailing = honest(17, &rw, rw.start, 8);
    trailing.push(0);
    let mut version = honest(18, &rw, rw.start, 8);
    version[0] = 2;
    let mut reserved = honest(19, &rw, rw.start, 8);
    reserved[2] = 1;
    let cases: Vec<(&str, Vec<u8>, usize, Expect)> = vec![
        (
            "forged capability",
            header(3, rw.key.region_id, forged, rw.start, 16),
            16,
            Expect::Status(code(Refusal::CapabilityMismatch)),
        ),
        (
            "forged capability to a read-only region",
            header(4, ro.key.region_id, [0xAB; 16], ro.start, 16),
            16,
            Expect::Status(code(Refusal::CapabilityMismatch)),
        ),
        (
            "one region's capability for another",
            header(5, wo.key.region_id, rw.key.capability, wo.start, 16),
            16,
            Expect::Status(code(Refusal::CapabilityMismatch)),
        ),
        (
            "an unknown region id",
            header(
                6,
                rw.key.region_id + 1_000_000,
                rw.key.capability,
                rw.start,
                16,
            ),
            16,
            Expect::Status(code(Refusal::RegionUnknown)),
        ),
        (
            "a read-only region",
            honest(7, &ro, ro.start, 16),
            16,
            Expect::Status(code(Refusal::AccessDenied)),
        ),
        (
            "a read-only region, all of memory",
            honest(8, &ro, 0, u64::MAX),
            7,
            Expect::Status(code(Refusal::AccessDenied)),
        ),
        (
            "past the end",
            honest(9, &rw, rw.end() - 4, 8),
            8,
            Expect::Status(code(Refusal::OutOfRange)),
        ),
        (
            "before the start",
            honest(10, &rw, rw.start - 8, 8),
            8,
            Expect::Status(code(Refusal::OutOfRange)),
        ),
        (
            "at the end of a write-only region",
            honest(11, &wo, wo.end(), 1),
            1,
            Expect::Status(code(Refusal::OutOfRange)),
        ),
        (
            "zero length",
            honest(12, &rw, rw.start, 0),
            0,
            Expect::Status(code(Refusal::OutOfRange)),
        ),
        (
            "an address near the top of memory",
            honest(13, &rw, u64::MAX - 3, 8),
            8,
            Expect::Status(code(Refusal::OutOfRange)),
        ),
        (
            "address + length wraps",
            honest(14, &rw, rw.start + 8, u64::MAX - 7),
            16,
            Expect::Status(code(Refusal::OutOfRange)),
        ),
        (
            "a payload one byte short",
            honest(15, &wo, wo.start + 64, 16),
            15,
            Expect::Status(code(Refusal::Malformed)),
        ),
        (
            "a truncated header",
            truncated,
            8,
            Expect::MalformedOrDropped,
        ),
        (
            "a header with a trailing byte",
            trailing,
            8,
            Expect::MalformedOrDropped,
        ),
        ("an unknown version", version, 8, Expect::MalformedOrDropped),
        (
            "a reserved byte set",
            reserved,
            8,
            Expect::MalformedOrDropped,
        ),
        (
            "a payload one byte long",
            honest(20, &wo, wo.start + 64, 16),
            17,
            Expect::Status(code(Refusal::Malformed)),
        ),
        (
            "no payload",
            honest(21, &rw, rw.start, 16),
            0,
            Expect::Status(code(Refusal::Malformed)),
        ),
        (
            "a payload by rendezvous one byte short",
            honest(22, &rw, rw.start, 4096),
            4095,
            Expect::Status(code(Refusal::Malformed)),
        ),
    ];
    for (name, header, payload_len, _) in &cases {
        let flags = if name.contains("rendezvous") {
            RNDV
        } else {
            EAGER
        };
        send_write(&raw, ep, header, &vec![0xEE; *payload_len], flags);
    }
    // An honest write without the reply flag: no connection to answer on,
    // dropped.
    send_write(
        &raw,
        ep,
        &honest(23, &rw, rw.start, 16),
        &[0xEE; 16],
        sys::UCP_AM_SEND_FLAG_EAGER,
    );
    // An empty header: no id to trust.
    send_write(&raw, ep, &[], &[0xEE; 8], EAGER);
    // A fence: an honest write of the bytes already there, answered after
    // every refusal before it.
    let fence_at = 2 * PAGE;
    send_write(
        &raw,
        ep,
        &honest(24, &rw, (buf.addr() + fence_at) as u64, 16),
        &before[fence_at..fence_at + 16],
        EAGER,
    );
    assert_eq!(reply_to(&raw, 24), Some(Ok(16)), "the fence");
    raw.progress_for(Duration::from_millis(100));

    let after = buf.snapshot();
    let got = replies(&raw);
    let outcome_of = |n: u64| -> Vec<Option<Result<u64, Refusal>>> {
        got.iter()
            .filter(|(id, _)| *id == WRITE_REQUEST_ID_BIT | n)
            .map(|(_, outcome)| *outcome)
            .collect()
    };
    let mut wrong = Vec::new();
    for (name, header, _, expect) in &cases {
        let n = wire::request_id_of_malformed(header) & !WRITE_REQUEST_ID_BIT;
        let outcomes = outcome_of(n);
        let status: Vec<Option<u8>> = outcomes
            .iter()
            .map(|o| match o {
                Some(Ok(_)) => Some(0),
                Some(Err(refusal)) => Some(code(*refusal)),
                None => None,
            })
            .collect();
        let fine = match expect {
            Expect::Status(want) => status == [Some(*want)],
            Expect::MalformedOrDropped => {
                status.is_empty() || status == [Some(code(Refusal::Malformed))]
            }
        };
        if !fine {
            wrong.push(format!("{name}: expected {expect:?}, got {status:?}"));
        }
    }
    let empty_header: Vec<_> = got.iter().filter(|(id, _)| *id == 0).collect();
    if empty_header
        .iter()
        .any(|(_, outcome)| *outcome != Some(Err(Refusal::Malformed)))
        || empty_header.len() > 1
    {
        wrong.push(format!("an empty header: answered {empty_header:?}"));
    }
    if !outcome_of(23).is_empty() {
        wrong.push(format!("no reply flag: answered {:?}", outcome_of(23)));
    }
    let unknown: Vec<_> = got
        .iter()
        .filter(|(id, _)| *id != 0 && !(1..=24).any(|n: u64| *id == WRITE_REQUEST_ID_BIT | n))
        .collect();
    eprintln!("replies: {got:?}");
    let changed = differences(&after, &before);

    // The owner keeps serving.
    send_write(
        &raw,
        ep,
        &honest(25, &wo, wo.end() - 8, 8),
        &[0x77; 8],
        EAGER,
    );
    let served_after = reply_to(&raw, 25);
    drop(raw);
    let unmapped: Vec<_> = [&rw, &wo, &ro]
        .iter()
        .map(|t| rt.block_on(ob.unmap(t.id)))
        .collect();
    rt.block_on(owner.shutdown());
    let live = owner.live_registrations();
    drop(buf);
    assert!(wrong.is_empty(), "wrong answers:\n{}", wrong.join("\n"));
    assert!(unknown.is_empty(), "replies to nothing sent: {unknown:?}");
    assert_eq!(
        changed, None,
        "hostile writes changed bytes (first, last, count)"
    );
    assert_eq!(served_after, Some(Ok(8)), "an honest write after them");
    assert!(unmapped.iter().all(Result::is_ok), "{unmapped:?}");
    assert_eq!(live, Some(0));
}

/// A raw writer sends forged capabilities, unknown regions, writes to a
/// region registered read-only, ranges outside, empty or wrapping, payloads
/// of the wrong length, headers of the wrong size or version, and a write
/// without the reply flag, over tcp: each is refused with its status (an
/// undecodable header may be dropped), and not one byte of the owner's
/// buffer changes; honest writes before and after land.
#[test]
fn hostile_writes_over_tcp_change_no_byte() {
    hostile_writes_change_no_byte(Transport::Tcp);
}

/// The same hostile writes against an owner on the same-host transport
/// (tcp beside cma): refused alike, nothing written.
#[test]
fn hostile_writes_same_host_change_no_byte() {
    hostile_writes_change_no_byte(Transport::SameHost);
}

/// A 1 MiB active message between two raw tcp workers with UCX's default
/// thresholds arrives by rendezvous: what the writes below rely on.
fn default_protocol_of_one_mib_is_rendezvous() -> bool {
    let (sender, receiver) = (Raw::new(false), Raw::new(false));
    let ep = sender.connect(&receiver.address());
    let payload = vec![1u8; MIB];
    let req = sender.send(ep, READ_REQUEST_AM_ID, &[0; 4], &payload, DEFAULT);
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(5)
        && receiver.messages(READ_REQUEST_AM_ID).is_empty()
    {
        sender.progress_for(Duration::from_millis(1));
        receiver.progress_for(Duration::from_millis(1));
    }
    if !req.is_null() && !is_err(req) {
        while start.elapsed() < Duration::from_secs(5)
            // SAFETY: a live request of `sender`'s worker, freed below once.
            && unsafe { sys::ucp_request_check_status(req.cast()) } == sys::UCS_INPROGRESS
        {
            sender.progress_for(Duration::from_millis(1));
            receiver.progress_for(Duration::from_millis(1));
        }
        // SAFETY: as above.
        unsafe { sys::ucp_request_free(req.cast()) };
    }
    let msgs = receiver.messages(READ_REQUEST_AM_ID);
    msgs.len() == 1 && msgs[0].rndv_len == MIB
}

/// Rendezvous writes (1 MiB, by UCX's default choice and forced) are
/// refused `Malformed` before a byte is received, whatever else is wrong
/// with them (a read-only region, a forged capability, out of range, a
/// payload one byte short) and also when nothing else is: the owner never
/// leaves a receive pending on a writer. The owner's memory is unchanged,
/// and an honest 1 MiB write sent eager after them lands.
#[test]
fn rendezvous_writes_are_refused_unreceived() {
    assert!(
        default_protocol_of_one_mib_is_rendezvous(),
        "UCX's defaults send 1 MiB by rendezvous over tcp"
    );
    let rt = runtime();
    let owner = tcp_engine();
    let ob = owner.backend();
    // [guard][ro: 1 MiB][guard][rw: 1 MiB][guard]
    let buf = PageBuf::filled(2 * MIB + 3 * PAGE, pattern);
    let ro = map_part(&rt, &ob, &buf, PAGE, MIB, Access::Read);
    let rw = map_part(&rt, &ob, &buf, MIB + 2 * PAGE, MIB, Access::ReadWrite);
    let raw = Raw::new(false);
    let ep = raw.connect(&serving(&owner));
    let before = buf.snapshot();
    let payload = vec![0xEEu8; MIB];
    let mut forged = rw.key.capability;
    forged[0] ^= 0x80;
    let cases = [
        (1, honest(1, &ro, ro.start, MIB as u64), MIB, DEFAULT),
        (2, honest(2, &ro, ro.start, MIB as u64), MIB, RNDV),
        (
            3,
            header(3, rw.key.region_id, forged, rw.start, MIB as u64),
            MIB,
            RNDV,
        ),
        (4, honest(4, &rw, rw.start + 1, MIB as u64), MIB, RNDV),
        (5, honest(5, &rw, rw.start, MIB as u64), MIB - 1, RNDV),
        (6, honest(6, &rw, rw.start, MIB as u64 - 1), MIB, DEFAULT),
        (7, honest(7, &rw, rw.start, MIB as u64), MIB, DEFAULT),
        (8, honest(8, &rw, rw.start, MIB as u64), MIB, RNDV),
    ];
    for (_, header, len, flags) in &cases {
        send_write(&raw, ep, header, &payload[..*len], *flags);
    }
    let answers: Vec<_> = cases.iter().map(|(n, ..)| reply_to(&raw, *n)).collect();
    let changed = differences(&buf.snapshot(), &before);
    // The owner keeps serving: an honest write sent eager lands.
    send_write(
        &raw,
        ep,
        &honest(9, &rw, rw.start, MIB as u64),
        &payload,
        EAGER,
    );
    let honest_answer = reply_to(&raw, 9);
    let mut want = before.clone();
    want[MIB + 2 * PAGE..2 * MIB + 2 * PAGE].fill(0xEE);
    let honest_changed = differences(&buf.snapshot(), &want);
    drop(raw);
    let unmapped = (rt.block_on(ob.unmap(ro.id)), rt.block_on(ob.unmap(rw.id)));
    rt.block_on(owner.shutdown());
    let live = owner.live_registrations();
    drop(buf);
    for ((n, ..), answer) in cases.iter().zip(&answers) {
        assert_eq!(*answer, Some(Err(Refusal::Malformed)), "case {n}");
    }
    assert_eq!(changed, None, "refused rendezvous writes wrote");
    assert_eq!(honest_answer, Some(Ok(MIB as u64)));
    assert_eq!(honest_changed, None, "the honest write landed, only it");
    assert_eq!(unmapped, (Ok(()), Ok(())));
    assert_eq!(live, Some(0));
}

/// How long an unmap may take once a writer vanished.
const VANISHED_UNMAP_WITHIN: Duration = Duration::from_secs(10);

/// A raw writer, connected with or without `peer_errors` handling, sends a
/// 32 MiB write into a read-write region, eager (in many fragments) or as
/// a rendezvous, and vanishes: at once, or after progressing a moment.
/// Checks the owner survives each: the unmap answers `Ok` within
/// [`VANISHED_UNMAP_WITHIN`], the written range holds all its old bytes or
/// all the new ones (the owner copies a write whole in its handler, and
/// refuses a rendezvous one unreceived), no byte outside it changed; then
/// that a new writer is served, and the engine shuts down with nothing
/// registered.
fn vanishing_writers(peer_errors: bool) {
    let rt = runtime();
    let owner = tcp_engine();
    let ob = owner.backend();
    let address = serving(&owner);
    let len = 32 * MIB;
    // [guard][region: len + 2 pages][guard]; the write starts a page in.
    let buf = PageBuf::filled(len + 4 * PAGE, pattern);
    let mut outcomes = Vec::new();
    for (flags, progress) in [
        (EAGER, Duration::ZERO),
        (EAGER, Duration::from_millis(2)),
        (RNDV, Duration::ZERO),
        (RNDV, Duration::from_millis(2)),
    ] {
        let target = map_part(&rt, &ob, &buf, PAGE, len + 2 * PAGE, Access::ReadWrite);
        let at = 2 * PAGE;
        let before = buf.snapshot();
        let payload: Vec<u8> = before[at..at + len].iter().map(|b| !b).collect();
        let raw = Raw::new(false);
        let ep = raw.connect_mode(&address, peer_errors);
        // Wire the connection up first, so the write goes out at once.
        send_write(
            &raw,
            ep,
            &honest(1, &target, target.start, 1),
            &before[PAGE..PAGE + 1],
            EAGER,
        );
        let warmed = reply_to(&raw, 1);
        let req = raw.send(
            ep,
            WRITE_REQUEST_AM_ID,
            &honest(2, &target, (buf.addr() + at) as u64, len as u64),
            &payload,
            flags,
        );
        assert!(!is_err(req), "the send started");
        raw.progress_for(progress);
        // Vanish: the request is never completed nor freed; destroying the
        // worker ends it.
        drop(raw);
        let started = Instant::now();
        let unmapped = rt.block_on(async {
            tokio::time::timeout(VANISHED_UNMAP_WITHIN, ob.unmap(target.id)).await
        });
        let took = started.elapsed();
        let after = buf.snapshot();
        let outside = differences(&after[..at], &before[..at])
            .or(differences(&after[at + len..], &before[at + len..]));
        let new = (at..at + len).filter(|&i| after[i] != before[i]).count();
        let whole_or_nothing = new == 0 || differences(&after[at..at + len], &payload).is_none();
        eprintln!(
            "peer errors {peer_errors}, flags {flags:#x}, progressed {progress:?}: \
             {new} of {len} bytes new; unmap {unmapped:?} after {took:?}"
        );
        let case = format!("peer errors {peer_errors}, flags {flags:#x}, progressed {progress:?}");
        outcomes.push((case, warmed, unmapped, outside, whole_or_nothing));
    }
    // The owner still serves: a new writer's honest write lands.
    let other = PageBuf::filled(PAGE, pattern);
    let target = map_part(&rt, &ob, &other, 0, PAGE, Access::ReadWrite);
    let raw = Raw::new(false);
    let ep = raw.connect(&address);
    send_write(
        &raw,
        ep,
        &honest(3, &target, target.start, 8),
        &[0x42; 8],
        EAGER,
    );
    let served = reply_to(&raw, 3);
    let landed = other.snapshot()[..8] == [0x42; 8];
    drop(raw);
    let unmapped_other = rt.block_on(ob.unmap(target.id));
    let shut = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(20), owner.shutdown()).await });
    let live = owner.live_registrations();
    if shut.is_err() {
        // The engine may still hold the buffers: do not free them under it.
        std::mem::forget(buf);
        std::mem::forget(other);
    }
    for (case, warmed, unmapped, outside, whole_or_nothing) in outcomes {
        assert_eq!(warmed, Some(Ok(1)), "{case}");
        assert!(
            matches!(unmapped, Ok(Ok(()))),
            "{case}: the unmap answered {unmapped:?} (Err = not within {VANISHED_UNMAP_WITHIN:?})"
        );
        assert_eq!(outside, None, "{case}: bytes outside the range changed");
        assert!(
            whole_or_nothing,
            "{case}: the range holds part of the write"
        );
    }
    assert_eq!(served, Some(Ok(8)), "a new writer after");
    assert!(landed, "its bytes landed");
    assert_eq!(unmapped_other, Ok(()));
    assert!(shut.is_ok(), "shutdown within 20 s");
    assert_eq!(live, Some(0));
}

/// A raw writer with peer error handling vanishes mid-write, eager or
/// rendezvous: the unmap of the region answers `Ok` within seconds, the
/// range holds the whole write or none of it, nothing outside it changed,
/// and a new writer is served.
#[test]
fn a_writer_vanishing_mid_write_frees_the_region() {
    vanishing_writers(true);
}

/// As above, from a writer whose endpoint has no peer error handling (UCX
/// then reports no failure on its connection): the owner still lets go of
/// the region at once, since it never leaves a receive pending on a
/// writer.
#[test]
fn a_vanishing_writer_without_error_handling_frees_the_region() {
    vanishing_writers(false);
}

/// A raw writer writes a region of four 1 MiB chunks as an engine's PUT
/// would, one eager write per chunk: chunks 0 and 1 acknowledged, chunk 3
/// sent without waiting, chunk 2 never; then it vanishes. Once the
/// owner's memory and log have settled, `take_written` has listed exactly
/// the chunks whose bytes are the new ones — 0 and 1, and 3 if it arrived
/// — every other chunk holds its old bytes, no chunk holds part of a
/// write, and a last take lists nothing.
#[test]
fn a_vanished_writers_target_lists_exactly_the_chunks_that_landed() {
    /// The UCX engine's write chunk.
    const CHUNK: usize = MIB;
    let rt = runtime();
    init_tracing();
    let owner = tcp_engine();
    let ob = owner.backend();
    let address = serving(&owner);
    let len = 4 * CHUNK;
    let buf = PageBuf::filled(len, pattern);
    let target = map_part(&rt, &ob, &buf, 0, len, Access::Write);
    let before = buf.snapshot();
    let payload: Vec<u8> = before.iter().map(|b| !b).collect();
    let chunk = |index: usize| index * CHUNK..(index + 1) * CHUNK;
    let write = |n: u64, index: usize| {
        let at = chunk(index).start;
        honest(n, &target, target.start + at as u64, CHUNK as u64)
    };
    let raw = Raw::new(false);
    let ep = raw.connect(&address);
    for (n, index) in [(1, 0), (2, 1)] {
        send_write(&raw, ep, &write(n, index), &payload[chunk(index)], EAGER);
        assert_eq!(reply_to(&raw, n), Some(Ok(CHUNK as u64)), "chunk {index}");
    }
    let last = raw.send(
        ep,
        WRITE_REQUEST_AM_ID,
        &write(4, 3),
        &payload[chunk(3)],
        EAGER,
    );
    assert!(!is_err(last), "the last chunk's send started");
    // Vanish: the last send is never completed; destroying the worker
    // ends it.
    drop(raw);

    // Take until a take finds nothing and the memory did not change
    // since the take before: every chunk that landed by then is listed.
    let mut taken = WrittenLog::default();
    let mut seen = buf.snapshot();
    let settled_by = Instant::now() + Duration::from_secs(10);
    let at_rest = loop {
        std::thread::sleep(Duration::from_millis(50));
        let listed = rt
            .block_on(ob.take_written(target.id))
            .expect("the owner's log");
        assert!(!listed.incomplete, "four chunks fit the log");
        let now = buf.snapshot();
        let quiet = listed.ranges.is_empty() && now == seen;
        for range in listed.ranges {
            taken.record(range);
        }
        seen = now;
        if quiet {
            break seen;
        }
        assert!(Instant::now() < settled_by, "the owner never settled");
    };
    let written = taken.take();
    let mut landed = Vec::new();
    for index in 0..4 {
        let new = at_rest[chunk(index)] == payload[chunk(index)];
        let old = at_rest[chunk(index)] == before[chunk(index)];
        assert!(new || old, "chunk {index} holds part of a write");
        let range = chunk(index);
        assert_eq!(
            written.covers(range.start as u64..range.end as u64),
            new,
            "chunk {index}: listed exactly when its bytes are the new ones"
        );
        landed.push(new);
    }
    assert_eq!(
        written.listed_bytes(),
        (landed.iter().filter(|&&new| new).count() * CHUNK) as u64,
        "nothing but whole chunks listed: {written:?}"
    );
    assert_eq!(landed[..3], [true, true, false], "{written:?}");
    eprintln!("the vanished writer's last chunk landed: {}", landed[3]);
    let unmapped = rt.block_on(ob.unmap(target.id));
    let shut = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(20), owner.shutdown()).await });
    if shut.is_err() {
        // The engine may still hold the buffer: do not free it under it.
        std::mem::forget(buf);
    }
    assert_eq!(unmapped, Ok(()));
    assert!(shut.is_ok(), "shutdown within 20 s");
    assert_eq!(owner.live_registrations(), Some(0));
}

/// The puts of one round: which ranges they write and what they answered.
struct Round {
    delay: Duration,
    results: Vec<Result<(), RdmaError>>,
    unmapped: Result<(), RdmaError>,
    at_unmap: Vec<u8>,
    at_end: Vec<u8>,
    late: Result<(), RdmaError>,
}

/// An unmap racing honest writes from an engine consumer.
fn unmap_racing_honest_writes(transport: Transport) {
    let rt = runtime();
    // Where active messages go over tcp (`Tcp`, and `SameHost`'s tcp
    // beside cma) a 1 MiB PUT goes in chunks of 60 KiB, each written whole
    // or not at all; elsewhere in one.
    let chunk = match transport {
        Transport::Tcp | Transport::SameHost => 60 * 1024,
        _ => MIB,
    };
    let (owner, consumer) = served_engines(transport);
    let (ob, cb) = (owner.backend(), consumer.backend());
    const PUTS: usize = 8;
    let piece = MIB;
    let src = PageBuf::filled(PUTS * piece, pattern);
    let src_region = rt.block_on(map(&cb, &src));
    // [guard][target: PUTS pieces][guard], zeroed: the source is never 0.
    let dst = PageBuf::zeroed(PUTS * piece + 2 * PAGE);
    let mut rounds = Vec::new();
    for delay_ms in [0u64, 1, 2, 5, 10, 30] {
        dst.fill(0);
        let target = map_part(&rt, &ob, &dst, PAGE, PUTS * piece, Access::ReadWrite);
        let key = packed_key(&target);
        let put = |i: usize, backend: Arc<UcxBackend>, key: bytes::Bytes| {
            let request = BackendPut {
                peer: OWNER,
                remote_addr: target.start + (i * piece) as u64,
                packed_key: key,
                local_region_id: src_region.backend_region_id,
                local_offset: (i * piece) as u64,
                len: piece as u64,
                deadline: Some(Duration::from_secs(20)),
            };
            async move {
                // SAFETY: the source is a `PageBuf` mapped on the consumer
                // and alive until after every put answered; nothing writes
                // it.
                unsafe { backend.put(request) }.await
            }
        };
        let handles: Vec<_> = (0..PUTS)
            .map(|i| rt.spawn(put(i, Arc::clone(&cb), key.clone())))
            .collect();
        std::thread::sleep(Duration::from_millis(delay_ms));
        let unmapped = rt
            .block_on(async {
                tokio::time::timeout(Duration::from_secs(20), ob.unmap(target.id)).await
            })
            .expect("the unmap answered within 20 s");
        let at_unmap = dst.snapshot();
        let results: Vec<_> = handles
            .into_iter()
            .map(|h| rt.block_on(h).expect("the put task"))
            .collect();
        // A write after the unmap, with the old key.
        let late = rt.block_on(put(0, Arc::clone(&cb), key.clone()));
        std::thread::sleep(Duration::from_millis(50));
        let at_end = dst.snapshot();
        rounds.push(Round {
            delay: Duration::from_millis(delay_ms),
            results,
            unmapped,
            at_unmap,
            at_end,
            late,
        });
    }
    let src_bytes = src.snapshot();
    assert_eq!(rt.block_on(cb.unmap(src_region.backend_region_id)), Ok(()));
    rt.block_on(consumer.shutdown());
    rt.block_on(owner.shutdown());
    assert_eq!(consumer.live_registrations(), Some(0));
    assert_eq!(owner.live_registrations(), Some(0));
    drop((src, dst));
    let (mut ok, mut refused) = (0, 0);
    for round in &rounds {
        let r = format!("delay {:?}", round.delay);
        assert_eq!(round.unmapped, Ok(()), "{r}");
        assert_eq!(
            differences(&round.at_end, &round.at_unmap),
            None,
            "{r}: bytes landed after the unmap answered"
        );
        assert!(
            matches!(round.late, Err(RdmaError::RegionNotFound)),
            "{r}: a put after the unmap answered {:?}",
            round.late
        );
        let guards = [
            &round.at_unmap[..PAGE],
            &round.at_unmap[PAGE + PUTS * piece..],
        ];
        assert!(
            guards.iter().all(|g| g.iter().all(|&b| b == 0)),
            "{r}: guard bytes changed"
        );
        for (i, result) in round.results.iter().enumerate() {
            let range = PAGE + i * piece..PAGE + (i + 1) * piece;
            let got = &round.at_unmap[range];
            let want = &src_bytes[i * piece..(i + 1) * piece];
            match result {
                Ok(()) => {
                    ok += 1;
                    assert_eq!(
                        differences(got, want),
                        None,
                        "{r}: put {i} answered Ok but its bytes were not in at the unmap"
                    );
                }
                Err(RdmaError::RegionNotFound) => {
                    refused += 1;
                    let whole_or_untouched = got
                        .chunks(chunk)
                        .zip(want.chunks(chunk))
                        .all(|(got, want)| got.iter().all(|&b| b == 0) || got == want);
                    assert!(
                        whole_or_untouched,
                        "{r}: put {i} refused but a chunk holds neither the old bytes nor its own"
                    );
                }
                Err(other) => panic!("{r}: put {i} answered {other}"),
            }
        }
    }
    eprintln!("{ok} puts landed before the unmap, {refused} refused");
}

/// Several 1 MiB puts from an engine consumer race an unmap of their
/// target, over tcp, the unmap issued after 0 to 30 ms: the unmap answers
/// only once every put answered `Ok` is in, each 60 KiB chunk of a put
/// refused (`RegionNotFound`) holds the old bytes or the put's own, no
/// byte lands after the unmap answered, and a put with the old key after
/// it is refused.
#[test]
fn an_unmap_racing_puts_over_tcp_waits_for_them() {
    unmap_racing_honest_writes(Transport::Tcp);
}

/// As above, on the same-host transport (every put goes through the
/// owner there too).
#[test]
fn an_unmap_racing_puts_same_host_waits_for_them() {
    unmap_racing_honest_writes(Transport::SameHost);
}

/// A raw writer floods one connection with 64 eager writes and does not
/// progress for a while: an engine consumer on another connection writes
/// and reads the same region meanwhile. Once the flooder progresses, each
/// flooded write was answered `Ok` (its bytes in) or refused busy by the
/// connection's bound of 4 unanswered writes (nothing written), and the
/// unmap answers. (Eager acknowledgements leave at once, so the bound is
/// seldom reached here; it is the kit's, simulated in `served::sim`.)
#[test]
fn a_write_flood_leaves_others_writing_and_reading() {
    let rt = runtime();
    const BOUND: u32 = 4;
    const FLOOD: usize = 64;
    let piece = 64 * 1024;
    let (owner, consumer) = engines_with(
        config(Transport::Tcp)
            .with_max_served_replies_per_connection(BOUND)
            .with_same_host_direct_reads(false),
    );
    let (ob, cb) = (owner.backend(), consumer.backend());
    // [guard][flooded: FLOOD pieces][honest: 1 piece][guard]
    let buf = PageBuf::filled((FLOOD + 1) * piece + 2 * PAGE, pattern);
    let target = map_part(&rt, &ob, &buf, PAGE, (FLOOD + 1) * piece, Access::ReadWrite);
    let raw = Raw::new(false);
    let ep = raw.connect(&serving(&owner));
    send_write(
        &raw,
        ep,
        &honest(1, &target, target.start, 1),
        &buf.snapshot()[PAGE..PAGE + 1],
        EAGER,
    );
    assert_eq!(reply_to(&raw, 1), Some(Ok(1)), "the warm-up write");
    let before = buf.snapshot();
    let payloads: Vec<Vec<u8>> = (0..FLOOD)
        .map(|i| {
            before[PAGE + i * piece..PAGE + (i + 1) * piece]
                .iter()
                .map(|b| !b)
                .collect()
        })
        .collect();
    let requests: Vec<_> = payloads
        .iter()
        .enumerate()
        .map(|(i, payload)| {
            let at = target.start + (i * piece) as u64;
            raw.send(
                ep,
                WRITE_REQUEST_AM_ID,
                &honest(100 + i as u64, &target, at, piece as u64),
                payload,
                EAGER,
            )
        })
        .collect();

    // The flooder does not progress. Another consumer writes and reads.
    std::thread::sleep(Duration::from_millis(200));
    let src = PageBuf::filled(piece, |i| pattern(i + 7));
    let dst = PageBuf::zeroed(piece);
    let src_region = rt.block_on(map(&cb, &src));
    let dst_region = rt.block_on(map(&cb, &dst));
    let honest_at = target.start + (FLOOD * piece) as u64;
    let request = BackendPut {
        peer: OWNER,
        remote_addr: honest_at,
        packed_key: packed_key(&target),
        local_region_id: src_region.backend_region_id,
        local_offset: 0,
        len: piece as u64,
        deadline: Some(Duration::from_secs(10)),
    };
    // SAFETY: the source is a `PageBuf` mapped on the consumer, alive until
    // after the put answered; nothing writes it.
    let put = rt.block_on(unsafe { cb.put(request) });
    let descriptor = rdmareg_core::Descriptor::new(
        "ucx",
        honest_at,
        piece as u64,
        target.id,
        packed_key(&target),
    )
    .unwrap();
    let get = rt.block_on(cb.get_into_test_memory(get_request(
        OWNER,
        &descriptor,
        &dst_region,
        0,
        Some(Duration::from_secs(10)),
    )));
    let read_back = dst.snapshot() == src.snapshot();

    // Now the flooder progresses: its accepted writes go through.
    let start = Instant::now();
    let mut pending: Vec<_> = requests
        .iter()
        .copied()
        .filter(|r| !r.is_null() && !is_err(*r))
        .collect();
    while !pending.is_empty() && start.elapsed() < Duration::from_secs(20) {
        raw.progress_for(Duration::from_millis(1));
        pending.retain(|&r| {
            // SAFETY: a live request of `raw`'s worker, freed once when it
            // is no longer in progress.
            unsafe {
                if sys::ucp_request_check_status(r.cast()) == sys::UCS_INPROGRESS {
                    true
                } else {
                    sys::ucp_request_free(r.cast());
                    false
                }
            }
        });
    }
    let sends_unended = pending.len();
    raw.progress_for(Duration::from_millis(300));
    let got = replies(&raw);
    let after = buf.snapshot();
    drop(raw);
    let unmapped = rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(10), ob.unmap(target.id)).await
    });
    let cleanup = (
        rt.block_on(cb.unmap(src_region.backend_region_id)),
        rt.block_on(cb.unmap(dst_region.backend_region_id)),
    );
    rt.block_on(consumer.shutdown());
    rt.block_on(owner.shutdown());
    let live = (consumer.live_registrations(), owner.live_registrations());
    drop((buf, src, dst));

    let (mut ok, mut busy, mut other) = (Vec::new(), Vec::new(), Vec::new());
    for (id, outcome) in &got {
        let i = (id & !WRITE_REQUEST_ID_BIT).wrapping_sub(100) as usize;
        match outcome {
            _ if *id == WRITE_REQUEST_ID_BIT | 1 => {}
            Some(Ok(len)) if i < FLOOD && *len == piece as u64 => ok.push(i),
            Some(Err(Refusal::Busy)) if i < FLOOD => busy.push(i),
            _ => other.push((*id, *outcome)),
        }
    }
    eprintln!(
        "{FLOOD} flooded writes: {} Ok, {} busy, {} unanswered, {sends_unended} sends unended; other {other:?}",
        ok.len(),
        busy.len(),
        FLOOD - ok.len() - busy.len()
    );
    assert_eq!(put, Ok(()), "the other consumer's put during the flood");
    assert_eq!(get, Ok(()), "the other consumer's get during the flood");
    assert!(read_back, "it read back what it wrote");
    assert!(other.is_empty(), "unexpected replies {other:?}");
    assert_eq!(
        ok.len() + busy.len(),
        FLOOD,
        "every flooded write is answered Ok or busy"
    );
    assert!(
        ok.len() >= BOUND as usize,
        "the first writes of the flood are served"
    );
    for (i, payload) in payloads.iter().enumerate() {
        let range = PAGE + i * piece..PAGE + (i + 1) * piece;
        if ok.contains(&i) {
            assert_eq!(differences(&after[range], payload), None, "write {i}: Ok");
        } else {
            assert_eq!(
                differences(&after[range.clone()], &before[range]),
                None,
                "write {i}: not acknowledged but written"
            );
        }
    }
    assert!(matches!(unmapped, Ok(Ok(()))), "{unmapped:?}");
    assert_eq!(cleanup, (Ok(()), Ok(())));
    assert_eq!(live, (Some(0), Some(0)));
}
