//! Write lists from writers that do not play by the rules: a raw UCX peer
//! sends `WRITE_LIST_REQUEST_AM_ID` messages to a real owner with payloads
//! that do not add up, lengths that overflow together, forged and
//! misdirected entries, overlapping entries and duplicate ids, no entries
//! or too many, headers cut short or of another version, no reply flag,
//! and payloads by rendezvous.
//!
//! The owner's contract (`rdmareg_engine::served::owner::write_lists`):
//! each entry is judged as a single write at its place in the payload; a
//! payload that does not add up has every entry refused `Malformed`; a
//! list whose header does not decode, that is empty, or that is longer
//! than its reply's header bound allows is dropped; a rendezvous list has
//! every entry refused unreceived. Each answered list gets one reply with
//! every entry's status in order. No refused entry changes a byte, the
//! owner's written log lists exactly the accepted entries, and the owner
//! goes on serving others and answers its unmaps.

use crate::common;

use std::time::Duration;

use common::raw_am::Raw;
use common::write_lists::*;
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::Access;
use rdmareg_engine::served::{Refusal, Write};
use rdmareg_ucx::read_protocol::WRITE_LIST_REQUEST_AM_ID;
use rdmareg_ucx::{Transport, UcxEngine};
use ucx_sys as sys;

const KIB: usize = 1024;
const PAGE: usize = 4096;
const EAGER: u32 = sys::UCP_AM_SEND_FLAG_REPLY | sys::UCP_AM_SEND_FLAG_EAGER;
const RNDV: u32 = sys::UCP_AM_SEND_FLAG_REPLY | sys::UCP_AM_SEND_FLAG_RNDV;

/// What the owner must answer a list.
#[derive(Debug, Clone, PartialEq)]
enum Expect {
    /// One reply, these outcomes in entry order; the `Ok` entries land.
    Each(Vec<Result<u64, Refusal>>),
    /// One reply refusing every entry so.
    All(Refusal),
    /// No reply, nothing written.
    Dropped,
}

/// One hostile list: its header, payload, send flags, entries (for what
/// an accepted one writes) and what the owner must answer.
struct Case {
    name: &'static str,
    header: Vec<u8>,
    payload: Vec<u8>,
    flags: u32,
    entries: Vec<Write>,
    expect: Expect,
}

impl Case {
    /// A list of `entries` whose payload is each entry's `length` bytes of
    /// its own value, back to back (`extra` bytes more, or fewer if
    /// negative).
    fn new(name: &'static str, entries: Vec<Write>, extra: isize, expect: Expect) -> Case {
        let mut payload = Vec::new();
        for write in &entries {
            // An entry no payload could carry gets none.
            let len = usize::try_from(write.length)
                .ok()
                .filter(|&len| len <= 2 << 20)
                .unwrap_or(0);
            payload.extend(std::iter::repeat_n(own_byte(write), len));
        }
        let len = payload.len().saturating_add_signed(extra);
        payload.resize(len, 0xEE);
        Case {
            name,
            header: raw_list_header(entries.len() as u16, &entries),
            payload,
            flags: EAGER,
            entries,
            expect,
        }
    }

    /// The ids of its entries.
    fn ids(&self) -> Vec<u64> {
        self.entries.iter().map(|w| w.request_id).collect()
    }
}

/// The byte entry `write` carries: from its id, never the owner's own.
fn own_byte(write: &Write) -> u8 {
    (write.request_id as u8 % 100) + 0x80
}

/// Sends every case from `raw` on `ep`, then an honest fence list whose
/// reply comes after theirs; returns the fence's reply.
fn send_all(raw: &Raw, ep: sys::ucp_ep_h, cases: &[Case], fence: &Case) -> bool {
    for case in cases.iter().chain([fence]) {
        raw.send_wait(
            ep,
            WRITE_LIST_REQUEST_AM_ID,
            &case.header,
            &case.payload,
            case.flags,
        );
    }
    let fence_id = fence.entries[0].request_id;
    let answered = raw.progress_until(Duration::from_secs(10), |raw| {
        list_replies(raw)
            .iter()
            .flatten()
            .any(|entries| entries.first().is_some_and(|e| e.0 == fence_id))
    });
    raw.progress_for(Duration::from_millis(100));
    answered
}

/// Hostile lists against a tcp owner: see the module docs.
#[test]
fn hostile_write_lists_are_answered_by_the_contract() {
    init_tracing();
    let rt = runtime();
    let owner = UcxEngine::start(config(Transport::Tcp)).expect("owner starts");
    let ob = owner.backend();
    // [guard][rw: 512 KiB][guard][ro: 8 KiB][guard]
    let buf = PageBuf::filled(512 * KIB + 8 * KIB + 3 * PAGE, pattern);
    let rw = rt.block_on(map_part(&ob, &buf, PAGE, 512 * KIB, Access::ReadWrite));
    let ro = rt.block_on(map_part(&ob, &buf, 516 * KIB + PAGE, 8 * KIB, Access::Read));
    let before = buf.snapshot();
    let raw = Raw::new(false);
    let ep = raw.connect(&serving(&owner));

    // Write ids: case `c`'s entries are `c * 100 + j`.
    let w = |c: u64, j: u64, part: &Part, at: u64, len: u64| part.write(c * 100 + j, at, len);
    let forged = |mut write: Write| {
        write.capability[3] ^= 0x10;
        write
    };
    let unknown = |mut write: Write| {
        write.region += 1_000_000;
        write
    };
    let ok = |len: u64| Ok(len);
    let mut cases = vec![
        Case::new(
            "an honest list",
            vec![
                w(1, 0, &rw, 0, 100),
                w(1, 1, &rw, 300, 1),
                w(1, 2, &rw, 400, 4096),
            ],
            0,
            Expect::Each(vec![ok(100), ok(1), ok(4096)]),
        ),
        Case::new(
            "refused entries between accepted ones",
            vec![
                w(2, 0, &rw, 8192, 700),
                forged(w(2, 1, &rw, 9000, 300)),
                w(2, 2, &ro, 0, 200),
                w(2, 3, &rw, 512 * 1024 - 10, 20),
                unknown(w(2, 4, &rw, 9500, 50)),
                w(2, 5, &rw, 9800, 0),
                w(2, 6, &rw, 10_000, 900),
            ],
            0,
            Expect::Each(vec![
                ok(700),
                Err(Refusal::CapabilityMismatch),
                Err(Refusal::AccessDenied),
                Err(Refusal::OutOfRange),
                Err(Refusal::RegionUnknown),
                Err(Refusal::OutOfRange),
                ok(900),
            ]),
        ),
        Case::new(
            "a payload one byte short",
            vec![w(3, 0, &rw, 16_384, 64), w(3, 1, &rw, 16_500, 64)],
            -1,
            Expect::All(Refusal::Malformed),
        ),
        Case::new(
            "a payload one byte long",
            vec![w(4, 0, &rw, 16_384, 64), w(4, 1, &rw, 16_500, 64)],
            1,
            Expect::All(Refusal::Malformed),
        ),
        Case::new(
            "lengths that overflow together to the payload's",
            vec![w(5, 0, &rw, 20_000, 16), w(5, 1, &rw, 20_100, u64::MAX - 7)],
            0,
            Expect::All(Refusal::Malformed),
        ),
        Case::new(
            "overlapping entries",
            vec![w(6, 0, &rw, 24_000, 100), w(6, 1, &rw, 24_050, 100)],
            0,
            Expect::Each(vec![ok(100), ok(100)]),
        ),
        Case::new(
            "an entry longer than a list carries",
            vec![w(7, 0, &rw, 0, (1 << 20) + 1)],
            0,
            Expect::All(Refusal::Malformed),
        ),
    ];
    // The overflowing case's payload: 8 bytes, what the lengths wrap to.
    cases[4].payload.truncate(8);
    // Duplicate ids: two entries of one id, each judged and answered.
    let mut twins = vec![w(8, 0, &rw, 28_000, 50), w(8, 1, &rw, 28_100, 50)];
    twins[1].request_id = twins[0].request_id;
    cases.push(Case::new(
        "duplicate ids",
        twins,
        0,
        Expect::Each(vec![ok(50), ok(50)]),
    ));
    let honest = |c: u64| vec![w(c, 0, &rw, 32_000 + c * 100, 16)];
    let dropped = |name, header: Vec<u8>, payload_len: usize| Case {
        name,
        header,
        payload: vec![0xEE; payload_len],
        flags: EAGER,
        entries: Vec::new(),
        expect: Expect::Dropped,
    };
    let mut version = list_header(&honest(13));
    version[0] = 2;
    let mut reserved = list_header(&honest(14));
    reserved[7] = 1;
    let too_many: Vec<Write> = (0..65)
        .map(|j| w(10, j, &rw, 40_000 + j * 16, 16))
        .collect();
    let truncated = list_header(&honest(12));
    cases.extend([
        dropped("no entries", raw_list_header(0, &[]), 0),
        dropped("no entries, with bytes", raw_list_header(0, &[]), 16),
        dropped("65 entries", raw_list_header(65, &too_many), 65 * 16),
        dropped(
            "a count past the entries",
            raw_list_header(3, &too_many[..2]),
            32,
        ),
        dropped(
            "a truncated header",
            truncated[..truncated.len() - 1].to_vec(),
            16,
        ),
        dropped("an unknown version", version, 16),
        dropped("a reserved byte set", reserved, 16),
        dropped("an empty header", Vec::new(), 16),
    ]);
    let mut no_reply_flag = Case::new("no reply flag", honest(15), 0, Expect::Dropped);
    no_reply_flag.flags = sys::UCP_AM_SEND_FLAG_EAGER;
    cases.push(no_reply_flag);
    // Rendezvous: refused whole, unreceived, whatever the entries.
    let rendezvous = [
        (
            "an honest list by rendezvous",
            (0..16)
                .map(|j| w(16, j, &rw, 65_536 + j * 16_384, 16_384))
                .collect(),
        ),
        (
            "a small list by rendezvous",
            vec![w(17, 0, &rw, 48_000, 64), w(17, 1, &ro, 0, 64)],
        ),
    ];
    for (name, entries) in rendezvous {
        let mut case = Case::new(name, entries, 0, Expect::All(Refusal::Malformed));
        case.flags = RNDV;
        cases.push(case);
    }
    let fence = Case::new("the fence", honest(99), 0, Expect::Each(vec![ok(16)]));
    let fenced = send_all(&raw, ep, &cases, &fence);
    let replies = list_replies(&raw);
    let payload_bytes = list_reply_payload_bytes(&raw);
    let after = buf.snapshot();
    let taken = rt.block_on(ob.take_written(rw.id));

    // What the accepted entries write, in the order the owner copies them.
    let mut want = before.clone();
    let mut written = Vec::new();
    let mut wrong = Vec::new();
    for case in cases.iter().chain([&fence]) {
        let answers: Vec<_> = replies
            .iter()
            .flatten()
            .filter(|entries| {
                entries
                    .first()
                    .is_some_and(|e| case.ids().first() == Some(&e.0))
            })
            .collect();
        let ids_answered: Vec<u64> = answers.iter().flat_map(|e| e.iter().map(|e| e.0)).collect();
        let outcomes: Vec<Result<u64, Refusal>> =
            answers.iter().flat_map(|e| e.iter().map(|e| e.1)).collect();
        let fine = match &case.expect {
            Expect::Dropped => answers.is_empty(),
            Expect::All(refusal) => {
                answers.len() == 1
                    && ids_answered == case.ids()
                    && outcomes.iter().all(|o| *o == Err(*refusal))
            }
            Expect::Each(each) => {
                answers.len() == 1 && ids_answered == case.ids() && outcomes == *each
            }
        };
        if !fine {
            wrong.push(format!(
                "{}: expected {:?}, got {answers:?}",
                case.name, case.expect
            ));
        }
        if let Expect::Each(each) = &case.expect {
            for (write, outcome) in case.entries.iter().zip(each) {
                if outcome.is_ok() {
                    let from = (write.address - buf.addr() as u64) as usize;
                    want[from..from + write.length as usize].fill(own_byte(write));
                    written.push(write.address - rw.start..write.address - rw.start + write.length);
                }
            }
        }
    }
    let unknown: Vec<_> = replies
        .iter()
        .flatten()
        .flatten()
        .filter(|(id, _)| !cases.iter().chain([&fence]).any(|c| c.ids().contains(id)))
        .collect();
    let undecodable = replies.iter().filter(|r| r.is_none()).count();

    // The owner goes on serving others: a writer engine's PUT lands.
    let writer = UcxEngine::start(config(Transport::Tcp)).expect("writer starts");
    writer.add_peer(OWNER, owner.worker_address()).unwrap();
    let wb = writer.backend();
    let src = PageBuf::filled(KIB, |i| pattern(i + 3));
    let src_region = rt.block_on(map(&wb, &src));
    let at = rw.start + 200 * KIB as u64;
    let later = rt.block_on(put(
        &wb,
        put_request(&src_region, 0, at, rw.packed.clone(), KIB),
    ));
    let later_landed = buf.snapshot()[PAGE + 200 * KIB..PAGE + 201 * KIB] == src.snapshot()[..];
    assert_eq!(rt.block_on(wb.unmap(src_region.backend_region_id)), Ok(()));
    rt.block_on(writer.shutdown());
    drop(raw);
    let in_flight = owner.served_replies_in_flight();
    let unmapped = (rt.block_on(ob.unmap(rw.id)), rt.block_on(ob.unmap(ro.id)));
    rt.block_on(owner.shutdown());
    let live = owner.live_registrations();
    drop(buf);

    assert!(fenced, "the fence list was answered");
    assert!(wrong.is_empty(), "wrong answers:\n{}", wrong.join("\n"));
    assert!(unknown.is_empty(), "replies to ids never sent: {unknown:?}");
    assert_eq!(undecodable, 0, "replies that do not decode");
    assert_eq!(payload_bytes, 0, "write list replies carry no payload");
    // Overlapping entries are copied in entry order: the later one's
    // bytes are over the earlier's.
    assert_eq!(
        differences(&after, &want),
        None,
        "bytes not as the accepted entries wrote them (first, last, count)"
    );
    assert_eq!(
        taken.map(|t| (t.ranges, t.incomplete)),
        Ok((listed(written).ranges, false)),
        "the written log lists exactly the accepted entries"
    );
    assert_eq!(later, Ok(()), "a PUT after the hostile lists");
    assert!(later_landed, "its bytes landed");
    assert_eq!(in_flight, 0, "replies left in flight");
    assert_eq!(unmapped, (Ok(()), Ok(())));
    assert_eq!(live, Some(0));
}

/// An owner whose transport segments are too small for a 64-entry reply
/// header answers a raw writer's list of 64 honest entries in several
/// replies, in entry order, each within its bound, every entry `Ok` and
/// its bytes in; a list of 8 that fits gets one reply.
#[test]
fn a_list_past_the_owners_reply_bound_is_answered_in_parts() {
    init_tracing();
    let rt = runtime();
    let small = config(Transport::Tcp).with_ucx_setting("TCP_TX_SEG_SIZE", "1024");
    let owner = UcxEngine::start(small).expect("owner starts");
    let ob = owner.backend();
    let buf = PageBuf::filled(16 * KIB, pattern);
    let rw = rt.block_on(map_part(&ob, &buf, 0, 16 * KIB, Access::Write));
    let before = buf.snapshot();
    let raw = Raw::new(false);
    let ep = raw.connect(&serving(&owner));
    let long: Vec<Write> = (0..64).map(|j| rw.write(100 + j, j * 32, 16)).collect();
    let fits: Vec<Write> = (0..8)
        .map(|j| rw.write(200 + j, 8 * KIB as u64 + j * 32, 16))
        .collect();
    for entries in [&long, &fits] {
        let payload: Vec<u8> = entries.iter().flat_map(|w| [own_byte(w); 16]).collect();
        raw.send_wait(
            ep,
            WRITE_LIST_REQUEST_AM_ID,
            &list_header(entries),
            &payload,
            EAGER,
        );
    }
    let answered = |raw: &Raw| {
        list_replies(raw)
            .iter()
            .flatten()
            .map(Vec::len)
            .sum::<usize>()
    };
    raw.progress_until(Duration::from_secs(10), |raw| answered(raw) >= 72);
    raw.progress_for(Duration::from_millis(100));
    let replies = list_replies(&raw);
    let after = buf.snapshot();
    drop(raw);
    let unmapped = rt.block_on(ob.unmap(rw.id));
    rt.block_on(owner.shutdown());
    let mut want = before.clone();
    for write in long.iter().chain(&fits) {
        let at = (write.address - rw.start) as usize;
        want[at..at + 16].fill(own_byte(write));
    }
    let parts: Vec<Vec<(u64, Result<u64, Refusal>)>> = replies
        .into_iter()
        .map(|reply| reply.expect("a reply decodes"))
        .collect();
    let every: Vec<(u64, Result<u64, Refusal>)> = parts.iter().flatten().copied().collect();
    let want_every: Vec<(u64, Result<u64, Refusal>)> = long
        .iter()
        .chain(&fits)
        .map(|w| (w.request_id, Ok(16)))
        .collect();
    assert_eq!(every, want_every, "every entry answered once, in order");
    assert!(
        parts.len() > 2,
        "the long list in several replies: {}",
        parts.len()
    );
    let longest = parts.iter().map(Vec::len).max().unwrap_or(0);
    assert!(longest < 64, "each reply within the bound: {longest}");
    assert_eq!(parts.last().map(Vec::len), Some(8), "the short list in one");
    assert_eq!(
        differences(&after, &want),
        None,
        "bytes (first, last, count)"
    );
    assert_eq!(unmapped, Ok(()));
    assert_eq!(owner.live_registrations(), Some(0));
}
