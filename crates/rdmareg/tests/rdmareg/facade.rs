//! The facade over real UCX engines on the loopback interface: a one-call
//! start, the refusals it makes before starting anything, a one-call
//! shutdown whose summary matches what was registered (over tcp), and the
//! switches of the same-host direct-read lane.

use std::time::Duration;

use rdmareg::registry::{ConfigError, RdmaConfig};
use rdmareg::{Config, PeerId, Rdma, StartError, Transport};

fn config() -> Config {
    Config::new()
        .with_transport(Transport::Tcp)
        .with_net_devices("lo")
        .with_registry(
            RdmaConfig::default()
                .with_budget_bytes(256 << 20)
                .with_shutdown_budget(Duration::from_secs(5)),
        )
}

#[test]
fn start_outside_a_tokio_runtime_is_refused_with_no_runtime() {
    assert!(matches!(Rdma::start(config()), Err(StartError::NoRuntime)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_get_deadline_is_refused_before_anything_starts() {
    let refused = Rdma::start(config().with_get_deadline(Duration::ZERO));
    assert!(
        matches!(
            refused,
            Err(StartError::Config(ConfigError::ZeroGetDeadline))
        ),
        "{refused:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_releases_what_was_left_registered_and_says_so() {
    let rdma = Rdma::start(config()).expect("starts");
    let first = rdma
        .register_owned(vec![1u8; 10_000].into_boxed_slice())
        .await
        .expect("registers");
    let second = rdma
        .register_owned(vec![2u8; 4096].into_boxed_slice())
        .await
        .expect("registers");
    let (watch_a, watch_b) = (first.watch(), second.watch());
    let buffer = rdma.alloc_pinned(8192).await.expect("allocates");
    drop(buffer);
    let before = rdma.stats();
    assert!(before.registered_bytes > 0);
    // The guards are kept: the shutdown, not their drop, releases them.
    let summary = rdma.shutdown().await;
    assert!(summary.is_clean(), "{summary:?}");
    assert_eq!(summary.regions_released, 2, "{summary:?}");
    assert_eq!(summary.arenas_released, before.pooled_arenas, "{summary:?}");
    assert_eq!(summary.bytes_released, before.registered_bytes);
    assert_eq!(summary.bytes_still_registered, 0);
    assert_eq!(summary.report.backend_live, Some(0));
    assert!(summary.total_time >= summary.sweep_time + summary.teardown_time);
    assert!(watch_a.is_deregistered() && watch_b.is_deregistered());
    assert_eq!(summary.regions_swept, 2, "{summary:?}");
    let line = summary.to_string();
    assert!(line.starts_with("shutdown clean in "), "{line}");
    assert!(
        line.contains("2 left registered by the caller and swept"),
        "{line}"
    );
    assert!(line.ends_with("the engine holds 0 registrations"), "{line}");
    assert!(!line.contains('\n'), "{line}");
    drop((first, second));
}

/// A region the caller unregisters before shutdown is not counted as
/// swept, and the one-line summary does not mention sweeping.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regions_unregistered_by_the_caller_are_not_swept() {
    let rdma = Rdma::start(config()).expect("starts");
    let region = rdma
        .register_owned(vec![3u8; 4096].into_boxed_slice())
        .await
        .expect("registers");
    region
        .unregister_owned(Duration::from_secs(5))
        .await
        .expect("unregisters");
    let summary = rdma.shutdown().await;
    assert!(summary.is_clean(), "{summary:?}");
    assert_eq!(summary.regions_swept, 0, "{summary:?}");
    assert!(!summary.to_string().contains("swept"), "{summary}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_facades_move_bytes_and_both_shut_down_clean() {
    let (owner, consumer) = (
        Rdma::start(config()).expect("owner starts"),
        Rdma::start(config()).expect("consumer starts"),
    );
    let payload: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let region = owner
        .register_owned(payload.clone().into_boxed_slice())
        .await
        .expect("registers");
    consumer
        .add_peer(PeerId(7), owner.worker_address())
        .expect("peer");
    let descriptor = region.descriptor().expect("descriptor");
    let mut buffer = consumer
        .alloc_pinned(payload.len())
        .await
        .expect("allocates");
    consumer
        .get(PeerId(7), &descriptor, &mut buffer)
        .await
        .expect("GET");
    assert_eq!(&buffer[..], &payload[..]);
    drop(buffer);
    let (back, _) = region
        .unregister_owned(Duration::from_secs(5))
        .await
        .expect("unregisters");
    assert_eq!(&back[..], &payload[..]);
    for side in [consumer, owner] {
        let summary = side.shutdown().await;
        assert!(summary.is_clean(), "{summary:?}");
    }
}

/// Reads `count` times a 4 KiB region of `owner` registered on `SameHost`
/// from `consumer`, which names the owner as `add` says; answers how many
/// the consumer copied itself on the direct lane, and what a read answers
/// once the owner unregistered the region.
async fn same_host_reads(
    owner: &Rdma,
    consumer: &Rdma,
    add: impl FnOnce(PeerId, bytes::Bytes) -> Result<(), rdmareg::RdmaError>,
    count: usize,
) -> (u64, Result<(), rdmareg::RdmaError>) {
    let peer = PeerId(3);
    add(peer, owner.worker_address()).expect("peer");
    let region = owner
        .register_owned(vec![0x5A; 4096].into_boxed_slice())
        .await
        .expect("registers");
    let descriptor = region.descriptor().expect("descriptor");
    let mut buffer = consumer.alloc_pinned(4096).await.expect("allocates");
    for _ in 0..count {
        consumer
            .get(peer, &descriptor, &mut buffer)
            .await
            .expect("GET");
        assert!(buffer.iter().all(|&b| b == 0x5A));
    }
    drop(
        region
            .unregister_owned(Duration::from_secs(5))
            .await
            .expect("unregisters"),
    );
    let stale = consumer.get(peer, &descriptor, &mut buffer).await;
    (consumer.engine().reads_copied_on_caller_threads(), stale)
}

fn same_host() -> Config {
    config().with_transport(Transport::SameHost)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_direct_lane_is_switched_off_from_the_facade() {
    // On by default on SameHost: the consumer copies reads itself.
    let (owner, consumer) = (
        Rdma::start(same_host()).unwrap(),
        Rdma::start(same_host()).unwrap(),
    );
    let (copied, stale) =
        same_host_reads(&owner, &consumer, |p, a| consumer.add_peer(p, a), 8).await;
    assert!(copied > 0, "the direct lane was not used");
    assert_eq!(stale, Err(rdmareg::RdmaError::RegionNotFound));
    for side in [consumer, owner] {
        assert!(side.shutdown().await.is_clean());
    }
    // Off on the owner: its keys are served-only, every read is its own.
    let off = same_host().with_same_host_direct_reads(false);
    let (owner, consumer) = (Rdma::start(off).unwrap(), Rdma::start(same_host()).unwrap());
    let (copied, stale) =
        same_host_reads(&owner, &consumer, |p, a| consumer.add_peer(p, a), 8).await;
    assert_eq!(copied, 0, "a read of an owner without the lane was copied");
    assert_eq!(stale, Err(rdmareg::RdmaError::RegionNotFound));
    for side in [consumer, owner] {
        assert!(side.shutdown().await.is_clean());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_added_served_only_is_read_through_its_owner() {
    let (owner, consumer) = (
        Rdma::start(same_host()).unwrap(),
        Rdma::start(same_host()).unwrap(),
    );
    let (copied, stale) = same_host_reads(
        &owner,
        &consumer,
        |p, a| consumer.add_peer_served_only(p, a),
        8,
    )
    .await;
    assert_eq!(copied, 0, "a served-only peer's read was copied");
    assert_eq!(stale, Err(rdmareg::RdmaError::RegionNotFound));
    for side in [consumer, owner] {
        assert!(side.shutdown().await.is_clean());
    }
}
