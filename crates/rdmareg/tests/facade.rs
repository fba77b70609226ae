//! The facade over real UCX engines (tcp on the loopback interface): a
//! one-call start, the refusals it makes before starting anything, and a
//! one-call shutdown whose summary matches what was registered.

use std::time::Duration;

use rdmareg::{Config, ConfigError, PeerId, Rdma, RdmaConfig, StartError, Transport};

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
    assert_eq!(summary.backend_live, Some(0));
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
