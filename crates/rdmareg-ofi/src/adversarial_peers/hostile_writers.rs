//! Hostile writers: write messages sent by hand. The owner drops what does
//! not parse, refuses what its owner machine refuses with a typed code and
//! changes no byte, and keeps serving honest writes. A writer killed
//! partway through a PUT leaves whole chunks, and an owner's written log
//! that lists exactly them.

use std::ops::Range;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, ExitStatus, Stdio};

use rdmareg_core::{Access, WrittenLog, WrittenRanges};

use super::*;
use crate::protocol::{
    REFUSAL_BIT, WRITE_CHUNK_MAX, WRITE_REPLY_LEN, WRITE_TAG, WriteRequest, refusal_code,
};
use rdmareg_engine::served::Refusal;

const LEN: usize = 8192;

/// The reply code a write got: `Ok(length written)` or the refusal code;
/// `None` when nothing came within half a second.
fn write_answer(
    peer: &mut RawPeer,
    to_owner: u64,
    id: u64,
    wire: Vec<u8>,
) -> Option<Result<u64, u8>> {
    write_answer_within(peer, to_owner, id, wire, Duration::from_millis(500))
}

/// As [`write_answer`], waiting up to `within`.
fn write_answer_within(
    peer: &mut RawPeer,
    to_owner: u64,
    id: u64,
    wire: Vec<u8>,
    within: Duration,
) -> Option<Result<u64, u8>> {
    let (answer, index) = peer.receive(to_owner, id, REPLY_IGNORE, WRITE_REPLY_LEN);
    peer.send(to_owner, WRITE_TAG, wire);
    let until = Instant::now() + within;
    while Instant::now() < until {
        peer.poll();
        if let Some(ended) = peer.ended.get(&answer) {
            return match ended.clone() {
                Ended::Done { len, tag } if tag & REFUSAL_BIT != 0 => {
                    assert_eq!(len, 0, "a refusal carries no bytes");
                    Some(Err(((tag >> 48) & 0xFF) as u8))
                }
                Ended::Done { len, .. } => {
                    assert_eq!(len, WRITE_REPLY_LEN);
                    let mut raw = [0u8; 8];
                    raw.copy_from_slice(&peer.buffers[index][..8]);
                    Some(Ok(u64::from_le_bytes(raw)))
                }
                Ended::Failed(text) => panic!("the reply receive failed: {text}"),
            };
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    None
}

fn garbage_and_wrong_writes_change_nothing(provider: Provider) {
    let rt = runtime();
    let config = config(provider);
    let owner = OfiEngine::start(config.clone()).expect("owner starts");
    let o = owner.backend();
    let writable = Memory::filled(LEN, 0xAA);
    let read_only = Memory::filled(LEN, 0xBB);
    // SAFETY: the range is this test's own allocation, reached only through
    // its address while registered (`snapshot` copies once no write is in
    // flight), freed only once unregistered.
    let w_region = rt
        .block_on(unsafe { o.map_with_access(writable.addr(), LEN, Access::ReadWrite) })
        .expect("maps writable");
    let r_region = read_only.map(&rt, &o);
    let w_key = PackedKey::decode(&w_region.packed_key).unwrap();
    let r_key = PackedKey::decode(&r_region.packed_key).unwrap();
    let mut peer = RawPeer::open(&config);
    let to_owner = peer.insert(&owner.fabric_address());
    let me = peer.address().to_vec();
    let header = |id: u64, key: &PackedKey, address: u64, length: u64| WriteRequest {
        request_id: id,
        region_id: key.region_id,
        capability: key.capability,
        address,
        length,
        reply_to: me.clone(),
    };
    let base = writable.addr() as u64;
    let honest = header(1, &w_key, base + 8, 16).encode_with(&[0x5A; 16]);
    // Frames that do not parse are dropped: no reply.
    let mut wrong_version = honest.clone();
    wrong_version[0] = 1;
    let mut nonzero = honest.clone();
    nonzero[2] = 7;
    for (what, id, wire) in [
        ("empty", 2, Vec::new()),
        ("a truncated header", 3, honest[..40].to_vec()),
        ("a read's version", 4, wrong_version),
        ("non-zero reserved bytes", 5, nonzero),
        (
            "zero length",
            6,
            header(6, &w_key, base, 0).encode_with(&[]),
        ),
        (
            "a length over the chunk",
            7,
            header(7, &w_key, base, WRITE_CHUNK_MAX + 1).encode_with(&[1; 64]),
        ),
        (
            "request id 0",
            0,
            header(0, &w_key, base, 4).encode_with(&[1; 4]),
        ),
    ] {
        assert_eq!(
            write_answer(&mut peer, to_owner, id.max(1) + 100, wire),
            None,
            "{what}"
        );
    }
    // Frames that parse but the owner must refuse, each with its code.
    let mut forged = w_key.clone();
    forged.capability[3] ^= 1;
    let cases = [
        (
            "a short payload",
            header(11, &w_key, base, 16).encode_with(&[1; 15]),
            Refusal::RegionUnknown,
        ),
        (
            "a long payload",
            header(12, &w_key, base, 16).encode_with(&[1; 17]),
            Refusal::RegionUnknown,
        ),
        (
            "a forged capability",
            header(13, &forged, base, 16).encode_with(&[1; 16]),
            Refusal::CapabilityMismatch,
        ),
        (
            "a read-only registration",
            header(14, &r_key, read_only.addr() as u64, 16).encode_with(&[1; 16]),
            Refusal::AccessDenied,
        ),
        (
            "a range past the end",
            header(15, &w_key, base + LEN as u64 - 8, 16).encode_with(&[1; 16]),
            Refusal::OutOfRange,
        ),
        (
            "a range below the base",
            header(16, &w_key, base - 8, 16).encode_with(&[1; 16]),
            Refusal::OutOfRange,
        ),
        (
            "a wrapping range",
            header(17, &w_key, u64::MAX - 4, 16).encode_with(&[1; 16]),
            Refusal::OutOfRange,
        ),
        (
            "an unknown registration",
            WriteRequest {
                region_id: u64::MAX,
                ..header(18, &w_key, base, 16)
            }
            .encode_with(&[1; 16]),
            Refusal::RegionUnknown,
        ),
    ];
    for (what, wire, refusal) in cases {
        let id = u64::from_le_bytes(wire[4..12].try_into().unwrap());
        assert_eq!(
            write_answer(&mut peer, to_owner, id, wire),
            Some(Err(refusal_code(refusal))),
            "{what}"
        );
    }
    assert!(
        writable.snapshot().iter().all(|&b| b == 0xAA),
        "no refused write changed a byte"
    );
    assert!(read_only.snapshot().iter().all(|&b| b == 0xBB));
    // The owner still serves an honest write.
    assert_eq!(write_answer(&mut peer, to_owner, 1, honest), Some(Ok(16)));
    let after = writable.snapshot();
    assert!(after[8..24].iter().all(|&b| b == 0x5A));
    assert!(after[..8].iter().chain(&after[24..]).all(|&b| b == 0xAA));
    let unmapped = [
        rt.block_on(o.unmap(w_region.backend_region_id)),
        rt.block_on(o.unmap(r_region.backend_region_id)),
    ];
    drop(peer);
    rt.block_on(owner.shutdown());
    assert_eq!(unmapped, [Ok(()), Ok(())]);
    assert_eq!(owner.live_registrations(), 0);
    writable.free_after(true);
    read_only.free_after(true);
}

#[test]
fn garbage_and_wrong_writes_change_nothing_over_tcp() {
    garbage_and_wrong_writes_change_nothing(Provider::Tcp);
}

#[test]
fn garbage_and_wrong_writes_change_nothing_over_shm() {
    garbage_and_wrong_writes_change_nothing(Provider::Shm);
}

/// Makes a test process the killed writer of round `round` of
/// [`written_log_of_a_killed_writer_is_exact`]: the provider, the round,
/// the owner's fabric address (hex), the registration's id, capability
/// (hex) and first byte, and how many microseconds the writer progresses
/// after its last send before it is killed.
const KILLED_WRITER: &str = "RDMAREG_OFI_KILLED_WRITER";
/// One served write: what an engine's PUT sends per message.
const CHUNK: usize = WRITE_CHUNK_MAX as usize;
/// Chunks of a killed writer's PUT.
const CHUNKS: usize = 4;
/// Bytes of the registration on either side of the PUT's range.
const GUARD: usize = 4096;
/// The registration: a guard, the PUT's range, a guard.
const TARGET_LEN: usize = GUARD + CHUNKS * CHUNK + GUARD;
/// How long each round's writer progresses after its unwaited chunk's
/// send before it is killed, in microseconds: more rounds than the owner
/// has write receives, so one a killed writer kept would show.
const PROGRESS_BEFORE_THE_KILL_US: [u64; 8] = [0, 50, 100, 200, 300, 500, 1_000, 10_000];
/// How long an owner's log must stay empty before it is taken as settled.
const QUIET: Duration = Duration::from_millis(200);

/// The registration's bytes before the first round, by offset.
fn old_byte(offset: usize) -> u8 {
    (offset % 251) as u8
}

/// What round `round`'s PUT writes at `offset`: never the old byte, nor
/// what another round writes there.
fn new_byte(round: usize, offset: usize) -> u8 {
    old_byte(offset) ^ (0x11 * (round as u8 + 1))
}

/// Chunk `index` of the PUT, as offsets in the registration.
fn chunk(index: usize) -> Range<usize> {
    GUARD + index * CHUNK..GUARD + (index + 1) * CHUNK
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex"))
        .collect()
}

/// The killed writer, in a child process: a bare endpoint writes chunks 0
/// and 1 of its round's PUT and waits for each reply, skips chunk 2, posts
/// chunk 3's reply receive and sends it without waiting, progresses for
/// the time it was given, and is SIGKILLed with its endpoint open and its
/// send and receive posted, as a killed writer process would be. It
/// panics (exit code 101, not the signal) if chunk 0 or 1 was not
/// acknowledged.
fn write_then_die(spec: &str) -> ! {
    let fields: Vec<&str> = spec.split(' ').collect();
    let [
        provider,
        round,
        owner,
        region,
        capability,
        base,
        progress_us,
    ] = fields[..]
    else {
        panic!("a killed writer's spec: {spec:?}");
    };
    let provider = match provider {
        "tcp" => Provider::Tcp,
        "shm" => Provider::Shm,
        other => panic!("unknown provider {other:?}"),
    };
    let round: usize = round.parse().expect("a round");
    let region: u64 = region.parse().expect("a region id");
    let capability: [u8; CAPABILITY_LEN] = unhex(capability).try_into().expect("a capability");
    let base: u64 = base.parse().expect("a base address");
    let progress = Duration::from_micros(progress_us.parse().expect("microseconds"));
    let mut peer = RawPeer::open(&config(provider));
    let to_owner = peer.insert(&unhex(owner));
    let me = peer.address().to_vec();
    let message = |request_id: u64, index: usize| {
        let range = chunk(index);
        let payload: Vec<u8> = range.clone().map(|at| new_byte(round, at)).collect();
        WriteRequest {
            request_id,
            region_id: region,
            capability,
            address: base + range.start as u64,
            length: CHUNK as u64,
            reply_to: me.clone(),
        }
        .encode_with(&payload)
    };
    for (request_id, index) in [(1, 0), (2, 1)] {
        let wire = message(request_id, index);
        let answer = write_answer_within(
            &mut peer,
            to_owner,
            request_id,
            wire,
            Duration::from_secs(10),
        );
        assert_eq!(answer, Some(Ok(CHUNK as u64)), "chunk {index} acknowledged");
    }
    peer.receive(to_owner, 4, REPLY_IGNORE, WRITE_REPLY_LEN);
    peer.send(to_owner, WRITE_TAG, message(4, 3));
    peer.progress_for(progress);
    // SAFETY: `raise` takes no pointer; SIGKILL ends the process here,
    // with nothing closed, freed or flushed.
    unsafe { libc::raise(libc::SIGKILL) };
    unreachable!("SIGKILL returned")
}

/// Runs test `exact` (its full path) as the killed writer of `spec`, and
/// answers how it ended (within 30 s, else it is killed and the test
/// fails).
fn killed_writer(exact: &str, spec: String) -> ExitStatus {
    let mut child = Command::new(std::env::current_exe().expect("the test binary"))
        .args(["--exact", exact, "--nocapture", "--test-threads", "1"])
        .env(KILLED_WRITER, spec)
        .stdout(Stdio::null())
        .spawn()
        .expect("the writer process starts");
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.try_wait().expect("the writer's status") {
            return status;
        }
        if Instant::now() >= until {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the writer process did not end within 30 s");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Takes the owner's log of `region` until a take finds nothing `QUIET`
/// after the last one that found something (within 10 s), and answers
/// every range taken. The owner lists a write in the loop turn that
/// copies it, so a settled log has listed every byte that landed.
fn settled_log(
    rt: &tokio::runtime::Runtime,
    backend: &crate::OfiBackend,
    region: u64,
) -> WrittenRanges {
    let mut taken = WrittenLog::default();
    let mut quiet_since = Instant::now();
    let settled_by = Instant::now() + Duration::from_secs(10);
    while quiet_since.elapsed() < QUIET {
        std::thread::sleep(Duration::from_millis(20));
        let listed = rt
            .block_on(backend.take_written(region))
            .expect("the owner's log");
        assert!(!listed.incomplete, "{CHUNKS} chunks fit the log");
        if !listed.ranges.is_empty() {
            quiet_since = Instant::now();
        }
        for range in listed.ranges {
            taken.record(range);
        }
        assert!(Instant::now() < settled_by, "the owner's log never settled");
    }
    taken.take()
}

/// Checks what round `round`'s killed writer left: `before` is the
/// registration at the round's start, `after` once the owner's log
/// settled, `written` what the log listed meanwhile. Answers which chunks
/// landed.
fn check_killed_round(
    round: usize,
    progress: Duration,
    before: &[u8],
    after: &[u8],
    written: &WrittenRanges,
) -> Vec<bool> {
    let case = format!("round {round} (killed {progress:?} after its last send)");
    let outside = (0..chunk(0).start).chain(chunk(CHUNKS - 1).end..TARGET_LEN);
    assert!(
        outside.clone().all(|i| after[i] == old_byte(i)),
        "{case}: bytes outside the PUT's range changed"
    );
    let mut landed = Vec::new();
    for index in 0..CHUNKS {
        let range = chunk(index);
        let new = range.clone().all(|i| after[i] == new_byte(round, i));
        let old = after[range.clone()] == before[range.clone()];
        assert!(new || old, "{case}: chunk {index} holds part of a write");
        assert_eq!(
            written.covers(range.start as u64..range.end as u64),
            new,
            "{case}: chunk {index} listed exactly when its bytes are the new ones: {written:?}"
        );
        landed.push(new);
    }
    assert_eq!(
        written.listed_bytes(),
        (landed.iter().filter(|&&new| new).count() * CHUNK) as u64,
        "{case}: nothing but whole chunks listed: {written:?}"
    );
    assert_eq!(
        landed[..2],
        [true, true],
        "{case}: chunks 0 and 1 were acknowledged"
    );
    assert!(
        chunk(2).all(|i| after[i] == old_byte(i)),
        "{case}: chunk 2 was never sent"
    );
    landed
}

/// Writers killed partway through a PUT, one a round, into one read-write
/// registration of an owner engine (or, in the child process
/// `KILLED_WRITER` names, that round's writer). The registration holds
/// old bytes, with guards around the PUT's four chunks; each round's
/// writer, a bare endpoint speaking the write wire format in a process of
/// its own, writes bytes of its own: it gets chunks 0 and 1 acknowledged,
/// never sends chunk 2, sends chunk 3 without waiting for its reply, and
/// is SIGKILLed after progressing for a while (from not at all to 10 ms,
/// so chunk 3's receive fails, or its bytes land unacknowledged). Once
/// the owner's log stayed empty for a while: the log the owner handed
/// over (`take_written`) lists exactly the chunks holding the round's
/// bytes (0 and 1, and 3 if it landed); every other chunk holds what it
/// held before the round, all of it; no byte outside the PUT changed. The
/// owner serves each next writer (more rounds than it has write
/// receives; one registration for all, so a write message a failed
/// receive left behind, served again, would show as an earlier round's
/// bytes). Then the unmap answers `Ok` within 5 s, nothing lands after
/// it, nothing is left registered, and the owner shuts down within 20 s.
fn written_log_of_a_killed_writer_is_exact(provider: Provider, exact: &str) {
    if let Ok(spec) = std::env::var(KILLED_WRITER) {
        write_then_die(&spec);
    }
    let name = match provider {
        Provider::Tcp => "tcp",
        Provider::Shm => "shm",
        _ => unreachable!("tested over tcp and shm"),
    };
    let rt = runtime();
    let owner = OfiEngine::start(config(provider)).expect("owner starts");
    let o = owner.backend();
    let target = Memory::holding((0..TARGET_LEN).map(old_byte).collect());
    // SAFETY: the range is this test's own allocation, reached only through
    // its address while registered (read only while no writer is alive and
    // the owner's log has settled), freed only once unregistered.
    let region = rt
        .block_on(unsafe { o.map_with_access(target.addr(), TARGET_LEN, Access::ReadWrite) })
        .expect("maps writable");
    let id = region.backend_region_id;
    let key = PackedKey::decode(&region.packed_key).expect("its key");
    let mut before = target.snapshot();
    for (round, &progress_us) in PROGRESS_BEFORE_THE_KILL_US.iter().enumerate() {
        let spec = format!(
            "{name} {round} {} {} {} {} {progress_us}",
            hex(&owner.fabric_address()),
            key.region_id,
            hex(&key.capability),
            target.addr()
        );
        let status = killed_writer(exact, spec);
        assert_eq!(
            status.signal(),
            Some(libc::SIGKILL),
            "round {round}: the writer had chunks 0 and 1 acknowledged, then was killed: {status}"
        );
        let written = settled_log(&rt, &o, id);
        // The writer is dead and the owner's log settled: no write is
        // being copied into the registration.
        let after = target.snapshot();
        let progress = Duration::from_micros(progress_us);
        let landed = check_killed_round(round, progress, &before, &after, &written);
        eprintln!("{name}: killed {progress:?} after its last send; chunks landed: {landed:?}");
        before = after;
    }
    let started = Instant::now();
    let unmapped =
        rt.block_on(async { tokio::time::timeout(Duration::from_secs(5), o.unmap(id)).await });
    let took = started.elapsed();
    let live = owner.live_registrations();
    let unregistered = matches!(unmapped, Ok(Ok(())));
    let after = target.snapshot();
    let shut = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(20), owner.shutdown()).await });
    target.free_after(unregistered);
    assert!(
        unregistered,
        "the unmap answered {unmapped:?} after {took:?} (Err = not within 5 s)"
    );
    assert_eq!(live, 0, "nothing left registered");
    assert!(after == before, "bytes landed after the last round settled");
    assert!(shut.is_ok(), "shutdown within 20 s");
    assert_eq!(owner.live_registrations(), 0);
}

#[test]
fn written_log_of_a_writer_killed_mid_put_is_exact_over_tcp() {
    written_log_of_a_killed_writer_is_exact(
        Provider::Tcp,
        "adversarial_peers::hostile_writers::written_log_of_a_writer_killed_mid_put_is_exact_over_tcp",
    );
}

#[test]
fn written_log_of_a_writer_killed_mid_put_is_exact_over_shm() {
    written_log_of_a_killed_writer_is_exact(
        Provider::Shm,
        "adversarial_peers::hostile_writers::written_log_of_a_writer_killed_mid_put_is_exact_over_shm",
    );
}
