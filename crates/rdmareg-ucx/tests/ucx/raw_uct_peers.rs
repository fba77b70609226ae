//! A peer driving UCX's tcp transport directly (UCT, below UCP) cannot write
//! into an owner.
//!
//! Two frames of UCX 1.22.0's tcp transport write where the peer says:
//!
//! - A transport-level PUT request frame: its payload is copied to whatever
//!   address the frame names, for any connected socket, whatever the UCP
//!   features of the receiving context. rdmareg's engine turns tcp PUT off
//!   (`TCP_PUT_ENABLE=n`), and the UCX that `cargo xtask ucx --from-source`
//!   builds carries a patch (`crates/rdmareg-ucx-src/patches/0001-…`) under
//!   which an interface with PUT off refuses such a frame and closes the
//!   connection.
//! - Any frame whose length field says it is longer than the receive
//!   segment: UCX checks the length only with an assertion, which release
//!   builds leave out, and receives the whole frame into the segment's
//!   buffer and the heap after it (AddressSanitizer: a heap-buffer-overflow
//!   write in `recv`). The patched UCX (`0004-…`) refuses such a frame and
//!   closes the connection in every build.
//!
//! Each test starts an owner and a consumer engine, finds the tcp ports the
//! owner listens on, and runs `tests/fixtures/raw_uct_peer/raw_uct_peer.c`
//! (compiled here with `cc` against the linked UCX's headers) against every
//! one of them: a raw UCT tcp endpoint sending PUT zcopy frames of `0xEE`
//! aimed at a registered region and at memory the owner never registered,
//! or an active message of 4 MiB followed by a flush. It then checks that
//! the owner acknowledged neither, that both memories still hold their
//! bytes, and that the owner still serves its real consumer.
//!
//! Against an unpatched UCX (the `libucx-cu12` wheel, a site UCX) the PUT
//! tests fail: the bytes are overwritten. The oversized frame is received
//! there, past the buffer; what that overwrites is the heap's layout, so
//! outside AddressSanitizer the test may fail in any way or pass, while
//! under it (`cargo xtask asan`) the overflow is reported.
//!
//! Not built over the vendored static UCX (`ucx_vendored`): the attacker is
//! compiled against a shared `libuct`, which that build does not make. The
//! patch it tests is the same file in both builds
//! (`rdmareg-ucx-src/patches/`).
#![cfg(not(ucx_vendored))]

use crate::common;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use common::attacked_memory::AttackedMemory;
use common::sockets::own_listening_ports;
use common::*;
use rdmareg_ucx::Transport;

/// The engines of one test are told apart from another's by the listening
/// sockets that appear while they start, so the tests of this binary run
/// one at a time even under `cargo test`.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Compiles the attacker once per test process and returns its path.
///
/// Each test runs in a process of its own under nextest, and they run at
/// the same time: each compiles to a name of its own and renames the result
/// into place, so no process ever executes a file another is still writing
/// ("text file busy").
fn attacker() -> &'static PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        c_fixtures::compile(
            &c_fixtures::fixture("raw_uct_peer/raw_uct_peer.c"),
            "raw_uct_peer",
            &c_fixtures::against_ucx(&["uct", "ucs"]),
        )
    })
}

/// Runs the attacker with `args`; returns its exit code and output.
fn run_attacker(args: &[String]) -> (i32, String) {
    let output = Command::new(attacker())
        .args(args)
        .output()
        .expect("the attacker runs");
    let code = output.status.code().unwrap_or(-1);
    (code, String::from_utf8_lossy(&output.stderr).into_owned())
}

/// Runs the attacker against `port`, writing `len` bytes of `0xEE` at
/// `addr`; returns its exit code and output.
fn put(port: u16, addr: usize, len: usize) -> (i32, String) {
    run_attacker(&[
        "put".into(),
        port.to_string(),
        format!("{addr:x}"),
        len.to_string(),
    ])
}

/// Runs the attacker against `port`, sending an active message of `len`
/// bytes and then a flush; returns its exit code and output.
fn oversized_frame(port: u16, len: usize) -> (i32, String) {
    run_attacker(&["oversized-am".into(), port.to_string(), len.to_string()])
}

/// Which frames the attacker sends.
#[derive(Debug, Clone, Copy)]
enum Frames {
    /// PUT requests with data, at a registered region and at unregistered
    /// memory.
    Put,
    /// One active message longer than the owner's receive segment (UCX's
    /// default 64 KiB), then a flush.
    Oversized,
}

/// Bytes in the oversized frame: far past the 128 KiB receive buffer.
const OVERSIZED_FRAME: usize = 4 << 20;

/// Asserts that the owner refused what the attacker sent (exit 1: no
/// acknowledgement) and that neither memory changed.
fn check_refused(
    what: &str,
    code: i32,
    log: &str,
    transport: &Transport,
    registered: &PageBuf,
    unregistered: &PageBuf,
) {
    let want = PageBuf::filled(registered.len(), pattern).snapshot();
    // 0: acknowledged; 1: not (refused). Anything else means the attack
    // never got going.
    assert!(
        code == 0 || code == 1,
        "the attacker failed to set up (exit {code}):\n{log}"
    );
    assert!(
        registered.snapshot() == want,
        "{what} changed a registered region of a {transport:?} owner (attacker exit {code}):\n{log}"
    );
    assert!(
        unregistered.snapshot() == want,
        "{what} changed unregistered memory of a {transport:?} owner (attacker exit {code}):\n{log}"
    );
    assert_eq!(
        code, 1,
        "a {transport:?} owner acknowledged {what} instead of closing the connection:\n{log}"
    );
}

async fn attack(transport: Transport, frames: Frames) {
    let _serial = ONE_AT_A_TIME.lock().await;
    let before = own_listening_ports();
    let (owner, consumer) = {
        init_tracing();
        let owner =
            rdmareg_ucx::UcxEngine::start(config(transport.clone())).expect("owner engine starts");
        let owner_ports: BTreeSet<u16> =
            own_listening_ports().difference(&before).copied().collect();
        let consumer =
            rdmareg_ucx::UcxEngine::start(config(transport.clone())).expect("consumer starts");
        consumer
            .add_peer(OWNER, owner.worker_address())
            .expect("consumer records the owner");
        ((owner, owner_ports), consumer)
    };
    let (owner, owner_ports) = owner;
    assert!(
        !owner_ports.is_empty(),
        "a {transport:?} owner listens on no tcp port"
    );
    let len = 64 * 1024;
    let memory = AttackedMemory::map_on(&owner, len).await;
    let (registered, unregistered) = (&memory.registered, &memory.unregistered);

    for &port in &owner_ports {
        match frames {
            Frames::Put => {
                // Small frames land in the receive buffer with their
                // header; large ones are read straight into the named
                // address afterwards. Try both, at both targets.
                for (target, size) in [
                    (registered.addr(), 64),
                    (unregistered.addr(), 64),
                    (registered.addr(), len),
                    (unregistered.addr(), len),
                ] {
                    let (code, log) = tokio::task::spawn_blocking(move || put(port, target, size))
                        .await
                        .expect("the attacker thread");
                    let what = format!("a raw UCT PUT of {size} B to port {port}");
                    check_refused(&what, code, &log, &transport, registered, unregistered);
                }
            }
            Frames::Oversized => {
                let size = OVERSIZED_FRAME;
                let (code, log) = tokio::task::spawn_blocking(move || oversized_frame(port, size))
                    .await
                    .expect("the attacker thread");
                let what = format!("a raw UCT frame of {size} B to port {port}");
                check_refused(&what, code, &log, &transport, registered, unregistered);
            }
        }
    }

    // The owner still serves its real consumer.
    memory
        .assert_owner_still_serves_then_shut_down(owner, consumer, &transport)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_uct_put_frames_do_not_write_into_a_tcp_owner() {
    attack(Transport::Tcp, Frames::Put).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_uct_put_frames_do_not_write_into_a_same_host_owner() {
    attack(Transport::SameHost, Frames::Put).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_uct_put_frames_do_not_write_into_an_auto_owner() {
    attack(Transport::Auto, Frames::Put).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_uct_frame_longer_than_the_receive_segment_is_refused_by_a_tcp_owner() {
    attack(Transport::Tcp, Frames::Oversized).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_uct_frame_longer_than_the_receive_segment_is_refused_by_a_same_host_owner() {
    attack(Transport::SameHost, Frames::Oversized).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_uct_frame_longer_than_the_receive_segment_is_refused_by_an_auto_owner() {
    attack(Transport::Auto, Frames::Oversized).await;
}
