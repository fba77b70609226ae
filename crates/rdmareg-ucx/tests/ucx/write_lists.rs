//! Write lists between a real writer and real owners: a batch's PUTs of at
//! most 64 KiB to one owner travel as one active message (or several, at
//! 64 entries or the worker's header bound) and are answered by one reply
//! each, while every PUT keeps its own result.
//!
//! What these hold the engines to: the batch goes as write lists (seen by
//! a raw owner counting what arrives); through real owners every entry
//! gets the result it would get alone, the bytes of each `Ok` entry land
//! exactly where it says and nothing else changes, and the owner's log of
//! written ranges lists exactly the `Ok` entries. (Unmaps and shutdown
//! around write lists: `write_list_lifecycle`.)

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::raw_am::Raw;
use common::write_lists::*;
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{Access, BackendPut, PeerId, RdmaError};
use rdmareg_engine::served::Write;
use rdmareg_engine::served::wire::{self, WRITE_REQUEST_ID_BIT};
use rdmareg_ucx::read_protocol::WRITE_REQUEST_AM_ID;
use rdmareg_ucx::{Transport, UcxEngine};

const KIB: usize = 1024;
const PAGE: usize = 4096;
/// The longest PUT a write list carries.
const LISTED: usize = 64 * KIB;
/// The length of each owner's read-write part in the mixed batch.
const RW_LEN: usize = 384 * KIB;

/// What a raw owner received of a batch, and how the batch answered.
struct Arrived {
    /// Each write list's entries and payload.
    lists: Vec<(Vec<Write>, Vec<u8>)>,
    /// Each single write's length.
    singles: Vec<u64>,
    answers: Answers,
    /// The PUTs' sources, back to back.
    sources: Vec<u8>,
}

/// A writer engine of `config` whose [`OWNER`] is a raw peer posts a batch
/// of PUTs of `lens` (to made-up addresses); the raw owner takes what
/// arrives, acknowledges it all, and the batch answers.
fn batch_to_a_raw_owner(config: rdmareg_ucx::UcxConfig, lens: &[usize]) -> Arrived {
    init_tracing();
    let rt = runtime();
    let writer = UcxEngine::start(config).expect("writer starts");
    let raw = Raw::new(false);
    writer.add_peer(OWNER, raw.address()).unwrap();
    let backend = writer.backend();
    let total: usize = lens.iter().sum();
    let src = PageBuf::filled(total + 3, pattern);
    let src_region = rt.block_on(map(&backend, &src));
    let key = Bytes::copy_from_slice(
        &rdmareg_ucx::read_protocol::ServedKey {
            region_id: 7,
            capability: [0x77; 16],
        }
        .encode(),
    );
    let mut at = 3;
    let requests: Vec<BackendPut> = lens
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let put = put_of(
                OWNER,
                &src_region,
                at,
                0x10_0000 + (i * 32 * KIB) as u64,
                &key,
                len,
            );
            at += len;
            put
        })
        .collect();
    let batch = rt.spawn({
        let backend = Arc::clone(&backend);
        async move { put_batch(&backend, requests).await }
    });
    let singles_expected = lens.iter().filter(|&&len| len > LISTED).count();
    let listed_expected = lens.len() - singles_expected;
    let all_in = raw.progress_until(Duration::from_secs(10), |raw| {
        entries_received(raw) >= listed_expected
            && raw.messages(WRITE_REQUEST_AM_ID).len() >= singles_expected
    });
    // Anything more the writer sent arrives too.
    raw.progress_for(Duration::from_millis(50));
    assert!(all_in, "not every write reached the raw owner");
    let lists: Vec<(Vec<Write>, Vec<u8>)> = lists_received(&raw)
        .into_iter()
        .map(|(entries, data, _)| (entries, data))
        .collect();
    let singles: Vec<u64> = raw
        .messages(WRITE_REQUEST_AM_ID)
        .iter()
        .map(|m| wire::decode_write_request(&m.header).unwrap().length)
        .collect();
    acknowledge_all(&raw);
    let answers = settle(&rt, &raw, batch);
    let sources = src.snapshot()[3..].to_vec();
    assert_eq!(
        rt.block_on(backend.unmap(src_region.backend_region_id)),
        Ok(())
    );
    rt.block_on(writer.shutdown());
    assert_eq!(writer.live_registrations(), Some(0));
    drop(raw);
    Arrived {
        lists,
        singles,
        answers,
        sources,
    }
}

/// Checks the lists a raw owner received carry the listed PUTs of `lens`
/// in batch order, each entry's bytes at its place in the payload.
fn assert_lists_carry(lists: &[(Vec<Write>, Vec<u8>)], lens: &[usize], sources: &[u8]) {
    let mut at = 0;
    let mut want = Vec::new();
    for (i, &len) in lens.iter().enumerate() {
        if len <= LISTED {
            want.push((i, at, len));
        }
        at += len;
    }
    let got: Vec<&Write> = lists.iter().flat_map(|(entries, _)| entries).collect();
    assert_eq!(got.len(), want.len(), "every listed PUT in a list, once");
    let mut ids = std::collections::HashSet::new();
    for (write, &(i, _, len)) in got.iter().zip(&want) {
        assert_eq!(
            write.address,
            0x10_0000 + (i * 32 * KIB) as u64,
            "entry {i}"
        );
        assert_eq!(write.length, len as u64, "entry {i}");
        assert_eq!((write.region, write.capability), (7, [0x77; 16]));
        assert!(write.request_id & WRITE_REQUEST_ID_BIT != 0, "a write id");
        assert!(ids.insert(write.request_id), "ids are distinct");
    }
    let mut wanted = want.iter();
    for (entries, payload) in lists {
        let mut expected = Vec::new();
        for _ in entries {
            let &(_, from, len) = wanted.next().unwrap();
            expected.extend_from_slice(&sources[from..from + len]);
        }
        assert_eq!(payload.len(), expected.len(), "a list's payload length");
        assert_eq!(differences(payload, &expected), None, "a list's payload");
    }
}

/// A batch of 69 PUTs of 1 KiB and 64 KiB, and one of 64 KiB + 1 byte, to
/// one owner, seen by a raw owner: the 69 arrive as two write lists (64
/// entries, the most one carries, then 5) in batch order, each payload
/// the entries' sources back to back, and the long one alone as a single
/// write; acknowledged, every PUT answers `Ok`.
#[test]
fn a_batch_of_small_puts_arrives_as_write_lists() {
    let mut lens = vec![KIB; 70];
    lens[5] = LISTED + 1;
    lens[6] = LISTED;
    lens[69] = 1;
    let Arrived {
        lists,
        singles,
        answers,
        sources,
    } = batch_to_a_raw_owner(config(Transport::Tcp), &lens);
    let sizes: Vec<usize> = lists.iter().map(|(e, _)| e.len()).collect();
    assert_eq!(sizes, [64, 5], "write lists by entries");
    assert_eq!(singles, [LISTED as u64 + 1], "single writes");
    assert_lists_carry(&lists, &lens, &sources);
    assert!(answers.iter().all(Result::is_ok), "{answers:?}");
}

/// A writer whose transport segments are too small for a 64-entry list
/// header sends its 64 PUTs of 1 KiB as several lists, each header within
/// the segment, together carrying every PUT once in order; all answer
/// `Ok`.
#[test]
fn a_writer_with_small_segments_sends_lists_that_fit() {
    let lens = vec![KIB; 64];
    let small = config(Transport::Tcp).with_ucx_setting("TCP_TX_SEG_SIZE", "1024");
    let Arrived {
        lists,
        singles,
        answers,
        sources,
    } = batch_to_a_raw_owner(small, &lens);
    assert!(lists.len() > 1, "one list could not fit: {}", lists.len());
    for (entries, _) in &lists {
        assert!(8 + entries.len() * 48 < 1024, "{} entries", entries.len());
    }
    assert!(singles.is_empty());
    assert_lists_carry(&lists, &lens, &sources);
    assert!(answers.iter().all(Result::is_ok), "{answers:?}");
}

/// The second owner of [`a_mixed_batch_lands_exactly`].
const SECOND_OWNER: PeerId = PeerId(2);

/// One owner engine with a buffer of guard pages around four parts: read
/// and write (128 KiB), write-only (32 KiB), read-only and unmapped before
/// the batch (8 KiB each).
struct OwnerScene {
    engine: UcxEngine,
    peer: PeerId,
    buf: PageBuf,
    rw: Part,
    wo: Part,
    ro: Part,
    gone: Part,
    original: Vec<u8>,
}

impl OwnerScene {
    fn new(rt: &tokio::runtime::Runtime, transport: Transport, peer: PeerId, seed: usize) -> Self {
        let engine = UcxEngine::start(config(transport)).expect("owner starts");
        let backend = engine.backend();
        let buf = PageBuf::filled(452 * KIB, |i| !pattern(i + seed));
        let rw = rt.block_on(map_part(&backend, &buf, PAGE, RW_LEN, Access::ReadWrite));
        let wo = rt.block_on(map_part(&backend, &buf, 392 * KIB, 32 * KIB, Access::Write));
        let ro = rt.block_on(map_part(&backend, &buf, 428 * KIB, 8 * KIB, Access::Read));
        let gone = rt.block_on(map_part(&backend, &buf, 440 * KIB, 8 * KIB, Access::Write));
        assert_eq!(rt.block_on(backend.unmap(gone.id)), Ok(()));
        let original = buf.snapshot();
        OwnerScene {
            engine,
            peer,
            buf,
            rw,
            wo,
            ro,
            gone,
            original,
        }
    }
}

/// One PUT of the mixed batch: `len` bytes to `at` (an offset, maybe past
/// the end) of a part of an owner, under `key`, and what it must answer.
struct Planned {
    owner: usize,
    part: Part,
    key: Bytes,
    at: u64,
    len: usize,
    expect: Result<(), RdmaError>,
}

/// The mixed batch: to the first owner 64 PUTs of 1 KiB, a write-only
/// target, a read-only one, an unmapped one and a range past the end; to
/// the second owner PUTs of sizes around 64 KiB (one past it), a forged
/// capability, a read-only target and a range at the end. The owners'
/// PUTs interleave.
fn plan(owners: &[OwnerScene]) -> Vec<Planned> {
    let ok = |owner: usize, part: &Part, at: u64, len: usize| Planned {
        owner,
        part: part.clone(),
        key: part.packed.clone(),
        at,
        len,
        expect: Ok(()),
    };
    let refused = |owner: usize, part: &Part, at: u64, len: usize, expect: RdmaError| Planned {
        expect: Err(expect),
        ..ok(owner, part, at, len)
    };
    let denied = RdmaError::AccessDenied { operation: "write" };
    let (a, b) = (&owners[0], &owners[1]);
    let mut first: Vec<Planned> = (0..64).map(|i| ok(0, &a.rw, i * 1536 + 100, KIB)).collect();
    first.push(ok(0, &a.wo, 5, 2 * KIB));
    first.push(refused(0, &a.ro, 0, KIB, denied.clone()));
    first.push(refused(0, &a.gone, 0, KIB, RdmaError::RegionNotFound));
    first.push(refused(
        0,
        &a.rw,
        RW_LEN as u64 - 512,
        KIB,
        RdmaError::OutOfRange,
    ));
    let mut second = Vec::new();
    let mut at = 7;
    for len in [LISTED - 1, LISTED, LISTED + 1, 1, 3000, PAGE, LISTED] {
        second.push(ok(1, &b.rw, at, len));
        at += len as u64 + 11;
    }
    let mut forged = refused(1, &b.rw, at, KIB, RdmaError::RegionNotFound);
    forged.key = forged_capability(&b.rw.packed);
    second.push(forged);
    second.push(refused(1, &b.ro, 0, 512, denied));
    second.push(refused(1, &b.wo, 32 * 1024, 1, RdmaError::OutOfRange));
    let mut plan = Vec::new();
    let mut second = second.into_iter();
    for (i, planned) in first.into_iter().enumerate() {
        plan.push(planned);
        if i % 6 == 0 {
            plan.extend(second.next());
        }
    }
    plan.extend(second);
    plan
}

/// A batch mixing 64 PUTs of 1 KiB, sizes around 64 KiB, two owners,
/// write-only, read-only and unmapped targets, a forged capability and
/// ranges past the end, from a writer engine to two owner engines over
/// `transport` (served keys: each goes through its owner): every PUT
/// answers what it answers when sent alone; each owner's memory holds the
/// source's bytes exactly where a PUT answered `Ok` and its own bytes
/// everywhere else, and its written log lists exactly the `Ok` ranges.
fn mixed_batch_lands_exactly(transport: Transport) {
    init_tracing();
    let rt = runtime();
    let owners = [
        OwnerScene::new(&rt, transport.clone(), OWNER, 0),
        OwnerScene::new(&rt, transport.clone(), SECOND_OWNER, 91),
    ];
    let writer = UcxEngine::start(config(transport.clone())).expect("writer starts");
    for owner in &owners {
        writer
            .add_peer(owner.peer, owner.engine.worker_address())
            .unwrap();
    }
    let backend = writer.backend();
    let plan = plan(&owners);
    let total: usize = plan.iter().map(|p| p.len).sum();
    let src = PageBuf::filled(total + 5, pattern);
    let src_region = rt.block_on(map(&backend, &src));
    let mut at = 5;
    let requests: Vec<BackendPut> = plan
        .iter()
        .map(|p| {
            let owner = &owners[p.owner];
            let put = put_of(
                owner.peer,
                &src_region,
                at,
                p.part.start + p.at,
                &p.key,
                p.len,
            );
            at += p.len;
            put
        })
        .collect();
    let answers = rt.block_on(put_batch(&backend, requests.clone()));
    let sources = src.snapshot();
    let after: Vec<Vec<u8>> = owners.iter().map(|o| o.buf.snapshot()).collect();
    let taken: Vec<_> = owners
        .iter()
        .flat_map(|o| [&o.rw, &o.wo].map(|part| (o, part)))
        .map(|(o, part)| rt.block_on(o.engine.backend().take_written(part.id)))
        .collect();
    // Each PUT alone, after: the same answer (an `Ok` one writes the same
    // bytes again).
    let alone: Answers = requests
        .iter()
        .map(|request| rt.block_on(put(&backend, request.clone())))
        .collect();
    let after_alone: Vec<Vec<u8>> = owners.iter().map(|o| o.buf.snapshot()).collect();

    let mut want: Vec<Vec<u8>> = owners.iter().map(|o| o.original.clone()).collect();
    let mut ranges: Vec<Vec<std::ops::Range<u64>>> = vec![Vec::new(); 4];
    let mut at = 5;
    for (i, (p, answer)) in plan.iter().zip(&answers).enumerate() {
        assert_eq!(
            answer, &p.expect,
            "entry {i} ({} bytes) in the batch",
            p.len
        );
        assert_eq!(alone[i], p.expect, "entry {i} ({} bytes) alone", p.len);
        if answer.is_ok() {
            let from = p.part.offset + p.at as usize;
            want[p.owner][from..from + p.len].copy_from_slice(&sources[at..at + p.len]);
            let part = p.owner * 2 + usize::from(p.part.id == owners[p.owner].wo.id);
            ranges[part].push(p.at..p.at + p.len as u64);
        }
        at += p.len;
    }
    for (o, owner) in owners.iter().enumerate() {
        assert_eq!(differences(&after[o], &want[o]), None, "owner {o}'s bytes");
        assert_eq!(
            differences(&after_alone[o], &want[o]),
            None,
            "owner {o}, alone"
        );
        let _ = owner;
    }
    // A same-host owner's writable registrations may also be written
    // one-sided, unseen by it: their log says it may be incomplete.
    let unseen_writes = matches!(transport, Transport::SameHost);
    for (part, (taken, ranges)) in taken.into_iter().zip(ranges).enumerate() {
        let taken = taken.expect("the owner's log");
        assert_eq!(
            taken.ranges,
            listed(ranges).ranges,
            "written log of part {part}"
        );
        assert_eq!(
            taken.incomplete, unseen_writes,
            "written log of part {part}"
        );
    }
    assert_eq!(
        rt.block_on(backend.unmap(src_region.backend_region_id)),
        Ok(())
    );
    rt.block_on(writer.shutdown());
    for owner in &owners {
        let ob = owner.engine.backend();
        for part in [&owner.rw, &owner.wo, &owner.ro] {
            assert_eq!(rt.block_on(ob.unmap(part.id)), Ok(()));
        }
        rt.block_on(owner.engine.shutdown());
        assert_eq!(owner.engine.live_registrations(), Some(0));
    }
    assert_eq!(writer.live_registrations(), Some(0));
}

/// [`mixed_batch_lands_exactly`] over tcp.
#[test]
fn a_mixed_batch_lands_exactly_over_tcp() {
    mixed_batch_lands_exactly(Transport::Tcp);
}

/// [`mixed_batch_lands_exactly`] on the same-host transport, where the
/// served keys keep the direct lane out of it.
#[test]
fn a_mixed_batch_lands_exactly_same_host() {
    mixed_batch_lands_exactly(Transport::SameHost);
}

/// 64 PUTs of 1 KiB from `writer` to one registration of `owner`: the
/// answers, and whether each PUT's bytes landed.
fn full_list(
    writer: rdmareg_ucx::UcxConfig,
    owner: rdmareg_ucx::UcxConfig,
) -> (Answers, Vec<bool>) {
    init_tracing();
    let rt = runtime();
    let owner = UcxEngine::start(owner).expect("owner starts");
    let writer = UcxEngine::start(writer).expect("writer starts");
    writer.add_peer(OWNER, owner.worker_address()).unwrap();
    let (ob, wb) = (owner.backend(), writer.backend());
    let target = PageBuf::zeroed(128 * KIB);
    let part = rt.block_on(map_part(&ob, &target, 0, 128 * KIB, Access::Write));
    let src = PageBuf::filled(64 * KIB, pattern);
    let src_region = rt.block_on(map(&wb, &src));
    let requests: Vec<BackendPut> = (0..64)
        .map(|i| {
            let mut put = put_of(
                OWNER,
                &src_region,
                i * KIB,
                part.start + (i * 2 * KIB) as u64,
                &part.packed,
                KIB,
            );
            put.deadline = Some(Duration::from_secs(3));
            put
        })
        .collect();
    let answers = rt.block_on(put_batch(&wb, requests));
    let (got, sources) = (target.snapshot(), src.snapshot());
    let landed = (0..64)
        .map(|i| got[i * 2 * KIB..i * 2 * KIB + KIB] == sources[i * KIB..(i + 1) * KIB])
        .collect();
    assert_eq!(rt.block_on(wb.unmap(src_region.backend_region_id)), Ok(()));
    assert_eq!(rt.block_on(ob.unmap(part.id)), Ok(()));
    rt.block_on(writer.shutdown());
    rt.block_on(owner.shutdown());
    (answers, landed)
}

/// A writer sends a full write list (64 entries, its own header bound)
/// to an owner whose transport segments are too small for the list's
/// reply header: every PUT must still land and answer `Ok`, as each does
/// alone. The writer cannot know the owner's bound, so the owner answers
/// in several replies (`WriteListLimits::entries_per_reply`), as it does
/// read lists (`adversarial_list_bounds`).
#[test]
fn a_full_list_lands_at_an_owner_with_small_segments() {
    let small = config(Transport::Tcp).with_ucx_setting("TCP_TX_SEG_SIZE", "1024");
    let (answers, landed) = full_list(config(Transport::Tcp), small);
    assert!(answers.iter().all(Result::is_ok), "{answers:?}");
    assert!(landed.iter().all(|&l| l), "{landed:?}");
}

/// 64 PUTs of 1 KiB to an owner whose bound of unfinished replies per
/// connection is 4: each alone answers `Ok` (an eager write is copied and
/// acknowledged inside its handler), so each in a list must too. The
/// bound counts a list by its replies, not its entries.
#[test]
fn a_full_list_lands_at_an_owner_with_a_small_bound() {
    let bounded = config(Transport::Tcp).with_max_served_replies_per_connection(4);
    let (answers, landed) = full_list(config(Transport::Tcp), bounded);
    assert!(answers.iter().all(Result::is_ok), "{answers:?}");
    assert!(landed.iter().all(|&l| l), "{landed:?}");
}
