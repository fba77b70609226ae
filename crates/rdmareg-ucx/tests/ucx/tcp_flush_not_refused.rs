//! An honest consumer's graceful endpoint close over [`Transport::Tcp`] is
//! not mistaken for a write by the owner's UCX.
//!
//! UCX's tcp transport flushes an endpoint that sent anything by sending a
//! PUT request of length 0 and waiting for its acknowledgement. The UCX the
//! workspace builds refuses PUT requests on interfaces with PUT off (the
//! engine's setting; see `crates/rdmareg-ucx-src/patches/0001-…`), and in
//! its first form it refused that flush marker too: every graceful close of
//! a consumer that had read something made the owner log the refusal and
//! reset the connection. Reads, then `remove_peer` (a graceful close), a
//! few times over, must leave no refusal in UCX's log.
//!
//! UCX opens its log when the library loads, so the cycles run in a child
//! process (this binary, re-executed for the one test) started with
//! `UCX_LOG_FILE` naming a file the parent then reads.

use crate::common;

use std::process::Command;

use common::child_process::test_path;
use common::*;
use rdmareg_core::PeerId;
use rdmareg_ucx::Transport;

/// Set in the child to the name of the test it runs.
const CHILD: &str = "RDMAREG_TCP_FLUSH_CHILD";
/// Read-then-close cycles.
const CYCLES: u64 = 16;
/// The text of the refusal in UCX's log.
const REFUSAL: &str = "PUT is disabled on this interface";

#[test]
fn graceful_closes_after_reads_over_tcp_are_not_refused_as_puts() {
    let name = "graceful_closes_after_reads_over_tcp_are_not_refused_as_puts";
    if std::env::var(CHILD).as_deref() == Ok(name) {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a Tokio runtime")
            .block_on(read_and_close_cycles());
        return;
    }
    let dir = std::env::temp_dir().join(format!("rdmareg-tcp-flush-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    let log_file = dir.join("ucx.log");
    let output = Command::new(std::env::current_exe().expect("the test binary's path"))
        .args([
            test_path(module_path!(), name).as_str(),
            "--exact",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(CHILD, name)
        .env("UCX_LOG_FILE", &log_file)
        .env_remove("UCX_LOG_LEVEL")
        .output()
        .expect("the child test process starts");
    let log = std::fs::read_to_string(&log_file);
    let _ = std::fs::remove_dir_all(&dir);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.contains("test result: ok. 1 passed"),
        "the child ended with {}\n--- stdout ---\n{stdout}\n--- stderr ---\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let log = log.expect("UCX opened the log file it was given");
    assert!(
        !log.contains(REFUSAL),
        "the owner refused a consumer's flush as a PUT:\n{log}"
    );
}

async fn read_and_close_cycles() {
    let (owner, consumer) = engines(Transport::Tcp);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let src = PageBuf::filled(4096, pattern);
    let dst = PageBuf::zeroed(4096);
    let src_region = map(&ob, &src).await;
    let dst_region = map(&cb, &dst).await;
    let descriptor = describe(&src, &src_region);
    consumer
        .remove_peer(OWNER)
        .expect("the consumer forgets the first id");
    for cycle in 0..CYCLES {
        // The only id naming the owner: removing it closes the endpoint,
        // gracefully, after the read's request went out on it.
        let peer = PeerId(100 + cycle);
        consumer
            .add_peer(peer, owner.worker_address())
            .expect("the consumer records the owner");
        dst.fill(0);
        let read = get_request(peer, &descriptor, &dst_region, 0, None);
        assert_eq!(cb.get_into_test_memory(read).await, Ok(()), "cycle {cycle}");
        assert_eq!(dst.snapshot(), src.snapshot(), "cycle {cycle}");
        consumer
            .remove_peer(peer)
            .expect("the consumer forgets the owner");
        // Let both progress threads run the close and the owner see it.
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    consumer.shutdown().await;
    owner.shutdown().await;
    assert_eq!(consumer.live_registrations(), Some(0));
    assert_eq!(owner.live_registrations(), Some(0));
}
