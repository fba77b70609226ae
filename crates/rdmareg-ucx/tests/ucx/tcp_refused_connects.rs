//! Reads to an owner that is gone cost the consumer no descriptors over
//! [`Transport::Tcp`], and over [`Transport::SameHost`] (tcp carries its
//! connections).
//!
//! A consumer that keeps a vanished owner's address and reads from it under
//! ever new peer ids makes a new endpoint, and so a new connection attempt,
//! for each read; the kernel refuses each one at once (nothing listens on
//! the owner's port any more). Each attempt must leave nothing open once
//! its read has failed: a service that retries a dead owner for a day must
//! not run out of descriptors.
//!
//! The reads run in a child process (this binary, re-executed for the one
//! test), so no other test's sockets come and go while the descriptors are
//! counted.

use crate::common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::child_process::test_path;
use common::*;
use rdmareg_core::PeerId;
use rdmareg_ucx::{Transport, UcxEngine};

/// Set in the child to the name of the test it runs.
const CHILD: &str = "RDMAREG_TCP_REFUSED_CONNECTS_CHILD";
/// Reads to the vanished owner, each under a fresh peer id.
const READS: u64 = 64;
/// Open descriptors the consumer may hold above where it started.
const FD_SLACK: usize = 8;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd is readable")
        .count()
}

/// Runs `scenario` in a child process (this binary filtered to `name`), or
/// directly when this process is that child.
fn in_child(name: &str, scenario: impl FnOnce()) {
    if std::env::var(CHILD).as_deref() == Ok(name) {
        scenario();
        return;
    }
    let output = Command::new(std::env::current_exe().expect("the test binary's path"))
        .args([
            test_path(module_path!(), name).as_str(),
            "--exact",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(CHILD, name)
        .output()
        .expect("the child test process starts");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.contains("test result: ok. 1 passed"),
        "{name}: the consumer process ended with {}\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}",
        output.status,
    );
}

#[test]
fn reads_to_a_vanished_owner_over_tcp_leave_no_descriptors_open() {
    in_child(
        "reads_to_a_vanished_owner_over_tcp_leave_no_descriptors_open",
        || {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("a Tokio runtime")
                .block_on(async {
                    for transport in [Transport::Tcp, Transport::SameHost] {
                        reads_to_vanished_owner(transport).await;
                    }
                });
        },
    );
}

async fn reads_to_vanished_owner(transport: Transport) {
    init_tracing();
    let consumer = UcxEngine::start(config(transport.clone())).expect("a consumer starts");
    let dst = PageBuf::zeroed(4096);
    let dst_region = map(&consumer.backend(), &dst).await;

    let owner = UcxEngine::start(config(transport.clone())).expect("an owner starts");
    let src = PageBuf::filled(4096, pattern);
    let src_region = map(&owner.backend(), &src).await;
    let descriptor = describe(&src, &src_region);
    let owner_address = owner.worker_address();
    owner.shutdown().await;

    let backend = consumer.backend();
    let read = |peer: PeerId| get_request(peer, &descriptor, &dst_region, 0, None);
    // One read first: whatever the engine keeps for its first connection
    // attempt belongs to the baseline.
    consumer
        .add_peer(PeerId(1), owner_address.clone())
        .expect("the consumer records the owner");
    let first = backend.get_into_test_memory(read(PeerId(1))).await;
    assert!(
        first.as_ref().is_err_and(|err| err.is_transient()),
        "{transport:?}: a read from a vanished owner answered {first:?}"
    );
    consumer
        .remove_peer(PeerId(1))
        .expect("the consumer forgets the owner");
    let baseline = open_fds();

    for n in 0..READS {
        let peer = PeerId(100 + n);
        consumer
            .add_peer(peer, owner_address.clone())
            .expect("the consumer records the owner");
        let answer = backend.get_into_test_memory(read(peer)).await;
        assert!(
            answer.as_ref().is_err_and(|err| err.is_transient()),
            "{transport:?}: read {n} from a vanished owner answered {answer:?}"
        );
        consumer
            .remove_peer(peer)
            .expect("the consumer forgets the owner");
    }
    // Endpoint closes finish on the progress thread; give them a moment.
    let settle = Instant::now();
    while open_fds() > baseline + FD_SLACK && settle.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let after = open_fds();
    assert!(
        after <= baseline + FD_SLACK,
        "{transport:?}: open descriptors grew from {baseline} to {after} over {READS} reads to a vanished owner"
    );
    consumer.shutdown().await;
    assert_eq!(consumer.live_registrations(), Some(0));
}
