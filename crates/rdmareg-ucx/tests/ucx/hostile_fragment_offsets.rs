//! A peer that moves the offsets in the fragments its UCX sends cannot
//! write outside the receiver's buffer.
//!
//! UCX 1.22.0 places two kinds of received fragments at an offset the
//! sender wrote into the fragment's header, and checks it too little:
//!
//! - Rendezvous data fragments (`UCP_AM_ID_RNDV_DATA`: over tcp the
//!   receiver answers a rendezvous with a ready-to-receive and the sender
//!   pushes the bytes as fragments): the unpack check `length - offset <
//!   size` wraps for an offset past the end, so a fragment lands outside
//!   the receive buffer. A consumer engine receives a large read reply this
//!   way straight into its destination (`progress/replies.rs`), so a
//!   hostile owner writes over the consumer's memory around it.
//! - Middle fragments of a multi-fragment eager active message
//!   (`UCP_AM_ID_AM_MIDDLE`): copied into the assembly buffer at the
//!   header's offset with no check against the announced size, so any peer
//!   that can send an active message longer than a segment (a write to an
//!   owner engine, a list reply to a consumer) writes past the heap buffer.
//!
//! The UCX that `cargo xtask ucx --from-source` builds carries a patch
//! (`crates/rdmareg-ucx-src/patches/0006-…`) under which a rendezvous
//! fragment outside the buffer fails its receive as a truncated message and
//! an eager fragment outside its message is dropped.
//!
//! The attacker is a real UCX, unchanged: `tests/fixtures/hostile_fragments/
//! hostile_peer.c`, a plain UCP program over tcp, runs under
//! `offset_shim.c`, an `LD_PRELOAD` shim that follows UCX's tcp framing in
//! what the process writes to its sockets and adds a bias to the offset
//! field of those fragments (both compiled here with `cc` against the linked
//! UCX's headers). The tests:
//!
//! - A hostile owner answers a consumer engine's 4 MiB read with a
//!   rendezvous reply whose fragments point past, or before, the
//!   destination, which lies in the middle of a larger registered buffer:
//!   the read must answer an error and no byte around the destination may
//!   change; the consumer then still reads from a real owner.
//! - A hostile writer sends a 256 KiB eager write request to an owner
//!   engine running in a child process (a heap overflow cannot be watched
//!   from beside the buffer; the test sees the child die), with its middle
//!   fragments 64 TiB past the assembly buffer: the owner process must
//!   survive and still serve a consumer engine.
//!
//! Against a UCX without that patch they fail (measured with the
//! from-source build of patches 0001 to 0005; the `libucx-cu12` wheel and a
//! site UCX 1.22 have the same code): each read answers `Ok` while 4 MiB
//! beside its destination are overwritten, and the owner process is killed
//! by `SIGSEGV`. With the bias at zero (tried by hand on that build) a read
//! answers `Ok` with nothing changed beside it and the owner survives: the
//! shim alone breaks nothing. Each test also checks that the shim rewrote
//! fragments, so a test that passes was attacked.
//!
//! Not built over the vendored static UCX (`ucx_vendored`): the attacker is
//! linked against the shared libraries, which that build does not make. The
//! patch it tests is the same file in both builds
//! (`rdmareg-ucx-src/patches/`).
#![cfg(not(ucx_vendored))]

use crate::common;

use std::fs;
use std::io::{BufRead, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::OnceLock;
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::attacked_memory::AttackedMemory;
use common::child_process::{CHILD_ROLE, is_child, test_path};
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, PeerId};
use rdmareg_ucx::Transport;
use rdmareg_ucx::read_protocol::{ServedKey, WRITE_REQUEST_AM_ID};

/// The tests of this binary run one at a time even under `cargo test`:
/// each moves megabytes through loopback sockets and runs processes of its
/// own, and a loaded two-core machine answers in time only one at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// How the consumer engine names the hostile owner.
const HOSTILE: PeerId = PeerId(2);
/// The hostile owner's rendezvous reply: 64 fragments of 64 KiB.
const READ_LEN: usize = 4 << 20;
/// The hostile writer's eager message: a first fragment and four middle
/// ones of at most 64 KiB.
const EAGER_LEN: usize = 256 << 10;
/// Moves a middle fragment 64 TiB on: past every address a process can map
/// (47 bits), so a receiver that copies it there faults at once.
const EAGER_BIAS: u64 = 1 << 46;

/// Compiles the fixture `source` (warnings as errors) into `name`.
fn compile(source: &str, name: &str, args: &[String]) -> PathBuf {
    let mut all = vec!["-Wall".to_owned(), "-Werror".to_owned()];
    all.extend_from_slice(args);
    c_fixtures::compile(
        &c_fixtures::fixture(&format!("hostile_fragments/{source}")),
        name,
        &all,
    )
}

/// The shim, compiled once per test process.
fn shim() -> &'static PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        compile(
            "offset_shim.c",
            "hostile_fragments_offset_shim.so",
            &["-shared".into(), "-fPIC".into(), "-ldl".into()],
        )
    })
}

/// The hostile peer, compiled once per test process against the linked
/// UCX.
fn hostile_peer() -> &'static PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        let mut args = c_fixtures::against_ucx(&["ucp", "ucs"]);
        args.push("-ldl".into());
        compile("hostile_peer.c", "hostile_fragments_peer", &args)
    })
}

/// A file under the target's temporary directory for a process's stderr.
fn log_file(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "hostile_fragments_{name}.{}.log",
        std::process::id()
    ))
}

/// The end of the file at `path`, for a failure message.
fn tail(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// The hostile peer, started in `role` under the shim, which adds `bias` to
/// the offsets of the fragments of `kinds` (`"rndv"`, `"middle"`).
fn start_hostile(role: &[String], kinds: &str, bias: u64, log: &Path) -> Child {
    Command::new(hostile_peer())
        .args(role)
        .env("LD_PRELOAD", shim())
        .env("HOSTILE_FRAGMENT_KINDS", kinds)
        .env("HOSTILE_FRAGMENT_BIAS", bias.to_string())
        // Every frame with HOSTILE_FRAGMENT_LOG=2 in the test's environment.
        .env(
            "HOSTILE_FRAGMENT_LOG",
            std::env::var("HOSTILE_FRAGMENT_LOG").unwrap_or_else(|_| "1".into()),
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(fs::File::create(log).expect("a log file"))
        .spawn()
        .expect("the hostile peer starts")
}

/// The lines a child process prints, as they come.
fn lines_of(child: &mut Child) -> Receiver<String> {
    let stdout = child.stdout.take().expect("a piped stdout");
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// The first line from `lines` that starts with `word` and a space, within
/// `within`: the rest of it, split at spaces.
fn expect_line(lines: &Receiver<String>, word: &str, within: Duration) -> Option<Vec<String>> {
    let start = Instant::now();
    loop {
        let left = within.checked_sub(start.elapsed())?;
        let line = lines.recv_timeout(left).ok()?;
        if let Some(rest) = line
            .trim()
            .strip_prefix(word)
            .and_then(|r| r.strip_prefix(' '))
        {
            return Some(rest.split(' ').map(str::to_owned).collect());
        }
    }
}

/// The number after `rewritten` in a hostile peer's line.
fn rewritten(fields: &[String]) -> i64 {
    fields
        .iter()
        .position(|f| f == "rewritten")
        .and_then(|i| fields.get(i + 1))
        .and_then(|n| n.parse().ok())
        .expect("a count of rewritten fragments")
}

/// Waits up to `within` for `child` to exit; kills it if it does not.
fn wait_or_kill(child: &mut Child, within: Duration) -> std::process::ExitStatus {
    let start = Instant::now();
    while start.elapsed() < within {
        if let Some(status) = child.try_wait().expect("the child's status") {
            return status;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    child.wait().expect("the killed child's status")
}

// ---------------------------------------------------------------------------
// Rendezvous data fragments: a hostile owner against a consumer engine.
// ---------------------------------------------------------------------------

/// A consumer engine reads [`READ_LEN`] bytes from a hostile owner whose
/// rendezvous data fragments are moved by `bias`, into the second quarter
/// of a registered buffer of `4 * READ_LEN` [`pattern`] bytes; the other
/// three quarters (where a moved fragment lands in an unpatched UCX) must
/// keep their bytes, and the read must answer an error. Then the consumer
/// reads from a real owner engine.
async fn rendezvous_reply_moved_by(bias: u64, what: &str) {
    let _serial = ONE_AT_A_TIME.lock().await;
    let (owner, consumer) = engines(Transport::Tcp);
    let memory = AttackedMemory::map_on(&owner, 64 * 1024).await;
    let cb = consumer.backend();

    let log = log_file("rndv_owner");
    let mut hostile = start_hostile(&["rndv-owner".into()], "rndv", bias, &log);
    let stdin: ChildStdin = hostile.stdin.take().expect("a piped stdin");
    let lines = lines_of(&mut hostile);
    let address = expect_line(&lines, "address", Duration::from_secs(10))
        .unwrap_or_else(|| panic!("the hostile owner printed no address:\n{}", tail(&log)));
    consumer
        .add_peer(HOSTILE, Bytes::from(unhex(&address[0])))
        .expect("the consumer records the hostile owner");

    let dest = PageBuf::filled(4 * READ_LEN, pattern);
    let dest_region = map(&cb, &dest).await;
    let key = ServedKey {
        region_id: 1,
        capability: [0x11; 16],
    };
    let request = BackendGet {
        peer: HOSTILE,
        remote_addr: 0x10_0000,
        packed_key: Bytes::copy_from_slice(&key.encode()),
        local_region_id: dest_region.backend_region_id,
        local_offset: READ_LEN as u64,
        len: READ_LEN as u64,
        deadline: Some(Duration::from_secs(10)),
    };
    let answer = tokio::time::timeout(Duration::from_secs(15), cb.get_into_test_memory(request))
        .await
        .unwrap_or_else(|_| panic!("{what}: the read did not answer within 15 s"));
    let answered = expect_line(&lines, "answered", Duration::from_secs(10))
        .unwrap_or_else(|| panic!("{what}: the hostile owner never replied:\n{}", tail(&log)));
    // Fragments still on their way land now if they land at all.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let after = dest.snapshot();
    let want = PageBuf::filled(4 * READ_LEN, pattern).snapshot();
    let changed_before = differing_bytes(&after[..READ_LEN], &want[..READ_LEN]);
    let changed_after = differing_bytes(&after[2 * READ_LEN..], &want[2 * READ_LEN..]);
    let count = rewritten(&answered);
    eprintln!("{what}: {count} fragments rewritten, the read answered {answer:?}");
    drop(stdin);
    let status = wait_or_kill(&mut hostile, Duration::from_secs(10));

    assert!(
        count > 0,
        "{what}: the shim rewrote no fragment (reply: {answered:?}):\n{}",
        tail(&log)
    );
    assert!(
        changed_before == 0 && changed_after == 0,
        "{what}: the hostile owner's rendezvous reply wrote outside the destination: \
         {changed_before} bytes before it and {changed_after} after it changed \
         (the read answered {answer:?}; {count} fragments rewritten)"
    );
    assert!(
        answer.is_err(),
        "{what}: a reply whose fragments lie outside the destination answered {answer:?}"
    );
    assert!(
        status.success(),
        "the hostile owner ended {status}:\n{}",
        tail(&log)
    );

    let unmapped = tokio::time::timeout(
        Duration::from_secs(5),
        cb.unmap(dest_region.backend_region_id),
    )
    .await;
    assert_eq!(unmapped, Ok(Ok(())), "{what}: the destination unmaps");
    drop(dest);
    memory
        .assert_owner_still_serves_then_shut_down(owner, consumer, &Transport::Tcp)
        .await;
}

/// Fragments moved one destination and a page on land, in an unpatched
/// UCX, past the destination's end (the offset check wraps).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_aimed_past_its_destination_writes_nothing() {
    rendezvous_reply_moved_by(READ_LEN as u64 + 4096, "fragments moved past the end").await;
}

/// Fragments moved back by one destination (the offset wraps below zero)
/// land, in an unpatched UCX, before the destination's start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_aimed_before_its_destination_writes_nothing() {
    rendezvous_reply_moved_by(
        (READ_LEN as u64).wrapping_neg(),
        "fragments moved before the start",
    )
    .await;
}

// ---------------------------------------------------------------------------
// Middle fragments of an eager message: a hostile writer against an owner
// engine in a child process.
// ---------------------------------------------------------------------------

/// In the child: an owner engine over tcp with one registered buffer of
/// [`pattern`] bytes, announced on stdout as `owner <worker address> <buffer
/// address> <length> <packed key>` (hex where bytes); it serves until its
/// stdin closes, then shuts down.
fn child_owner() {
    let rt = runtime();
    let owner = tcp_engine();
    let buf = PageBuf::filled(64 * 1024, pattern);
    let region = rt.block_on(map(&owner.backend(), &buf));
    // On a line of its own: the harness's "test … " has no newline.
    println!(
        "\nowner {} {} {} {}",
        hex(&owner.worker_address()),
        buf.addr(),
        buf.len(),
        hex(&region.packed_key)
    );
    std::io::stdout().flush().unwrap();
    let mut sink = Vec::new();
    let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
    rt.block_on(owner.shutdown());
    drop(buf);
}

/// A writer's eager message whose middle fragments point 64 TiB past the
/// assembly buffer leaves its owner process alive and serving.
#[test]
fn eager_fragments_aimed_past_leave_the_owner_serving() {
    const NAME: &str = "eager_fragments_aimed_past_leave_the_owner_serving";
    if is_child(NAME) {
        child_owner();
        return;
    }
    let rt = runtime();
    let _serial = rt.block_on(ONE_AT_A_TIME.lock());
    let owner_log = log_file("owner");
    let mut owner = Command::new(std::env::current_exe().expect("the test binary"))
        .args([
            test_path(module_path!(), NAME).as_str(),
            "--exact",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(CHILD_ROLE, NAME)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(fs::File::create(&owner_log).expect("a log file"))
        .spawn()
        .expect("the owner process starts");
    let owner_stdin: ChildStdin = owner.stdin.take().expect("a piped stdin");
    let lines = lines_of(&mut owner);
    let fields = expect_line(&lines, "owner", Duration::from_secs(15))
        .unwrap_or_else(|| panic!("the owner process announced nothing:\n{}", tail(&owner_log)));
    let address = unhex(&fields[0]);
    let (addr, len): (u64, u64) = (fields[1].parse().unwrap(), fields[2].parse().unwrap());
    let packed_key = Bytes::from(unhex(&fields[3]));

    // The attack.
    let log = log_file("eager_writer");
    let mut writer = start_hostile(
        &[
            "eager".into(),
            fields[0].clone(),
            WRITE_REQUEST_AM_ID.to_string(),
            EAGER_LEN.to_string(),
        ],
        "middle",
        EAGER_BIAS,
        &log,
    );
    drop(writer.stdin.take());
    let writer_lines = lines_of(&mut writer);
    let sent = expect_line(&writer_lines, "sent", Duration::from_secs(10));
    let writer_status = wait_or_kill(&mut writer, Duration::from_secs(5));
    // The owner's worker handles the fragments as they come.
    std::thread::sleep(Duration::from_millis(300));
    if let Some(status) = owner.try_wait().expect("the owner's status") {
        panic!(
            "the owner process died ({status}) after a writer's eager message with \
             middle fragments 64 TiB past it (writer: {sent:?}, {writer_status}):\n\
             owner:\n{}\nwriter:\n{}",
            tail(&owner_log),
            tail(&log)
        );
    }
    let sent = sent.unwrap_or_else(|| {
        panic!(
            "the writer did not finish its send ({writer_status}):\n{}",
            tail(&log)
        )
    });
    assert!(
        rewritten(&sent) > 0,
        "the shim rewrote no fragment:\n{}",
        tail(&log)
    );

    // The owner still serves a consumer engine.
    let consumer = tcp_engine();
    consumer
        .add_peer(OWNER, Bytes::from(address))
        .expect("the consumer records the owner");
    let cb = consumer.backend();
    let dst = PageBuf::zeroed(len as usize);
    let dst_region = rt.block_on(map(&cb, &dst));
    let request = BackendGet {
        peer: OWNER,
        remote_addr: addr,
        packed_key,
        local_region_id: dst_region.backend_region_id,
        local_offset: 0,
        len,
        deadline: Some(Duration::from_secs(10)),
    };
    assert_eq!(
        rt.block_on(cb.get_into_test_memory(request)),
        Ok(()),
        "the attacked owner serves a read"
    );
    assert!(
        dst.snapshot() == PageBuf::filled(len as usize, pattern).snapshot(),
        "the attacked owner served other bytes"
    );
    rt.block_on(consumer.shutdown());
    drop(dst);

    drop(owner_stdin);
    let status = wait_or_kill(&mut owner, Duration::from_secs(10));
    assert!(
        status.success(),
        "the owner process ended {status}:\n{}",
        tail(&owner_log)
    );
}
