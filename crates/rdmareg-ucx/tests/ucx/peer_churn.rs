//! Peers come and go: `add_peer` → read → `remove_peer` under a new peer id
//! each time must not pile up connections.
//!
//! - While another peer id keeps the owner's address, ids naming the same
//!   worker address share one endpoint, so a thousand cycles cost no
//!   connection — even with the process limited to 256 open descriptors,
//!   where UCX used to abort after about a hundred cycles.
//! - With no other peer id on the address, every cycle opens a connection
//!   and removing the last id must close both of its ends: 300 cycles
//!   leave the process where it started within [`CLOSE_BOUND`].
//!
//! Both count the descriptors of the whole process (owner and consumer
//! engines live in it), so each runs in a process of its own
//! ([`in_own_process`]), under `cargo test` as under nextest.

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use rdmareg_backend::own_process::in_own_process;
use rdmareg_core::PeerId;
use rdmareg_ucx::{Transport, UcxConfig, UcxEngine};

const CYCLES: u64 = 1000;
/// Open descriptors a churned process may hold above where it started.
const FD_SLACK: usize = 16;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd is readable")
        .count()
}

fn limit_open_descriptors(limit: u64) {
    let rlimit = libc::rlimit {
        rlim_cur: limit,
        rlim_max: limit,
    };
    // SAFETY: a valid rlimit record; lowering our own limit is always
    // permitted.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &rlimit) };
    assert_eq!(rc, 0, "setrlimit(RLIMIT_NOFILE, {limit})");
}

#[test]
fn a_thousand_peer_cycles_keep_open_descriptors_flat() {
    in_own_process(|| {
        runtime().block_on(thousand_cycles_under_a_small_limit());
    });
}

async fn thousand_cycles_under_a_small_limit() {
    // This process lives with the limit a small service might have.
    limit_open_descriptors(256);
    for transport in [Transport::Tcp, Transport::SameHost] {
        let (owner, consumer) = engines(transport.clone());
        let (ob, cb) = (owner.backend(), consumer.backend());
        let src = PageBuf::filled(4096, pattern);
        let dst = PageBuf::zeroed(4096);
        let src_region = map(&ob, &src).await;
        let dst_region = map(&cb, &dst).await;
        let desc = describe(&src, &src_region);
        // One warm cycle: the engines' own listening sockets and the first
        // connection are part of the baseline.
        let request = get_request(OWNER, &desc, &dst_region, 0, None);
        assert_eq!(cb.get_into_test_memory(request).await, Ok(()));
        let baseline = open_fds();

        for cycle in 0..CYCLES {
            let peer = PeerId(1000 + cycle);
            consumer
                .add_peer(peer, owner.worker_address())
                .expect("add_peer");
            let request = get_request(peer, &desc, &dst_region, 0, None);
            assert_eq!(
                cb.get_into_test_memory(request).await,
                Ok(()),
                "cycle {cycle}"
            );
            consumer.remove_peer(peer).expect("remove_peer");
        }
        // Closes finish asynchronously; give them a moment, bounded.
        let settle = Instant::now();
        while open_fds() > baseline + FD_SLACK && settle.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let after = open_fds();
        assert!(
            after <= baseline + FD_SLACK,
            "{transport:?}: open descriptors grew from {baseline} to {after} over {CYCLES} cycles"
        );
        assert_eq!(dst.snapshot(), src.snapshot());
        consumer.shutdown().await;
        owner.shutdown().await;
    }
}

/// Cycles of the churn to one address.
const ONE_ADDRESS_CYCLES: u64 = 300;
/// Descriptors the process may hold above where it started once the
/// churn to one address is over: each worker's keepalive timer, which UCX
/// opens with the worker's first endpoint and keeps.
const ONE_ADDRESS_SLACK: usize = 4;
/// How long after the last cycle the process may take to close the last
/// connections: two of the engine's keepalive intervals (the owner's
/// side closes at its next keepalive round, see `docs/operations.md`),
/// plus a second for a slow machine.
const CLOSE_BOUND: Duration = Duration::from_secs(3);

/// A consumer adds the owner under a new peer id, reads once and removes
/// the id, 300 times, and no other peer id ever names the owner's address:
/// each cycle connects afresh, and removing the last id must close the
/// endpoint and both ends of its connection. Over tcp, over the same-host
/// served lane (tcp for requests, cma for 256 KiB replies) and over the
/// same-host direct-read lane, the process's open descriptors are back to
/// within [`ONE_ADDRESS_SLACK`] of where they started within
/// [`CLOSE_BOUND`] of the last cycle.
#[test]
fn churn_to_one_address_leaves_descriptors_flat() {
    in_own_process(|| {
        runtime().block_on(async {
            churn_to_one_address("tcp", config(Transport::Tcp), 4096).await;
            let same_host = config(Transport::SameHost);
            churn_to_one_address(
                "same-host served",
                same_host.clone().with_same_host_direct_reads(false),
                256 * 1024,
            )
            .await;
            churn_to_one_address("same-host direct", same_host, 256 * 1024).await;
        });
    });
}

async fn churn_to_one_address(lane: &str, config: UcxConfig, len: usize) {
    init_tracing();
    let owner = UcxEngine::start(config.clone()).expect("owner engine starts");
    let consumer = UcxEngine::start(config).expect("consumer engine starts");
    let (ob, cb) = (owner.backend(), consumer.backend());
    let src = PageBuf::filled(len, pattern);
    let dst = PageBuf::zeroed(len);
    let src_region = map(&ob, &src).await;
    let dst_region = map(&cb, &dst).await;
    let desc = describe(&src, &src_region);
    let baseline = open_fds();
    let mut peak = baseline;
    for cycle in 0..ONE_ADDRESS_CYCLES {
        let peer = PeerId(1000 + cycle);
        consumer
            .add_peer(peer, owner.worker_address())
            .expect("add_peer");
        dst.fill(0);
        let request = get_request(peer, &desc, &dst_region, 0, None);
        assert_eq!(
            cb.get_into_test_memory(request).await,
            Ok(()),
            "{lane}: cycle {cycle}"
        );
        assert!(dst.snapshot() == src.snapshot(), "{lane}: cycle {cycle}");
        consumer.remove_peer(peer).expect("remove_peer");
        peak = peak.max(open_fds());
    }
    let last_cycle = Instant::now();
    while open_fds() > baseline + ONE_ADDRESS_SLACK && last_cycle.elapsed() < CLOSE_BOUND {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let after = open_fds();
    let settled = last_cycle.elapsed();
    println!(
        "{lane}: {baseline} descriptors before {ONE_ADDRESS_CYCLES} cycles, at most {peak} during, {after} {settled:.1?} after"
    );
    assert!(
        after <= baseline + ONE_ADDRESS_SLACK,
        "{lane}: {ONE_ADDRESS_CYCLES} cycles to one address took the process from \
         {baseline} open descriptors to {peak} at most, and {after} {settled:.1?} after the last"
    );
    consumer.shutdown().await;
    owner.shutdown().await;
}
