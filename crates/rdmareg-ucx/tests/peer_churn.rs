//! Peers come and go: `add_peer` → read → `remove_peer` under a new peer id
//! each time, a thousand times, must not pile up connections: ids naming
//! the same worker address share one endpoint, so the churn costs none —
//! even with the process limited to 256 open descriptors, where UCX used to
//! abort after about a hundred cycles.

mod common;

use std::time::{Duration, Instant};

use common::*;
use rdmareg_core::PeerId;
use rdmareg_ucx::Transport;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_peer_cycles_keep_open_descriptors_flat() {
    // Each test runs in its own process under nextest; this one lives with
    // the limit a small service might have.
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
