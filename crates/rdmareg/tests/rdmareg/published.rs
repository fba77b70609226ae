//! Regions published by name on a real etcd: the name resolves while the
//! region is registered, and is withdrawn before it is unregistered —
//! explicitly, or when the published region is dropped.

use std::sync::Arc;
use std::time::Duration;

use rdmareg::discovery::test_support::EtcdServer;
use rdmareg::discovery::{Directory, DiscoveryError, EtcdConfig, Publisher};
use rdmareg::registry::RdmaConfig;
use rdmareg::{Config, PublishFailure, PublishedRegion, Rdma, Transport};

fn config() -> Config {
    Config::new()
        .with_transport(Transport::Tcp)
        .with_net_devices("lo")
        .with_registry(RdmaConfig::default().with_budget_bytes(64 << 20))
}

async fn setup(etcd: &EtcdServer) -> (Rdma, Arc<Publisher>, Directory) {
    let etcd_config = EtcdConfig::new(etcd.url()).with_prefix("/published-test");
    let rdma = Rdma::start(config()).expect("starts");
    let publisher = Publisher::start(&etcd_config, "owner", "ucx", rdma.worker_address())
        .await
        .expect("publisher starts");
    let directory = Directory::connect(&etcd_config).await.expect("directory");
    (rdma, Arc::new(publisher), directory)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unregistering_withdraws_the_name_before_the_region_goes() {
    let etcd = EtcdServer::start().expect("etcd starts");
    let (rdma, publisher, directory) = setup(&etcd).await;
    let guard = rdma
        .register_owned(vec![7u8; 8192].into_boxed_slice())
        .await
        .expect("registers");
    let descriptor = guard.descriptor().unwrap();
    let published = PublishedRegion::publish(Arc::clone(&publisher), "weights.0", guard)
        .await
        .expect("publishes");
    let resolved = directory.resolve("weights.0").await.expect("resolves");
    assert_eq!(resolved.descriptor, descriptor);
    let watch = published.guard().watch();
    let (buffer, _) = published
        .unregister_owned(Duration::from_secs(5))
        .await
        .expect("withdrawn")
        .expect("unregistered");
    assert_eq!(buffer.len(), 8192);
    assert!(watch.is_deregistered());
    assert!(matches!(
        directory.resolve("weights.0").await,
        Err(DiscoveryError::NotFound(_))
    ));
    let summary = rdma.shutdown().await;
    assert!(summary.is_clean(), "{summary:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_published_region_is_withdrawn_and_then_released() {
    let etcd = EtcdServer::start().expect("etcd starts");
    let (rdma, publisher, directory) = setup(&etcd).await;
    let guard = rdma
        .register_owned(vec![1u8; 4096].into_boxed_slice())
        .await
        .expect("registers");
    let watch = guard.watch();
    let published = PublishedRegion::publish(Arc::clone(&publisher), "kv.1", guard)
        .await
        .expect("publishes");
    assert!(directory.resolve("kv.1").await.is_ok());
    drop(published);
    tokio::time::timeout(Duration::from_secs(10), watch.deregistered())
        .await
        .expect("released in the background");
    assert!(matches!(
        directory.resolve("kv.1").await,
        Err(DiscoveryError::NotFound(_))
    ));
    let summary = rdma.shutdown().await;
    assert!(summary.is_clean(), "{summary:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_that_fails_hands_the_region_back_registered() {
    let etcd = EtcdServer::start().expect("etcd starts");
    let (rdma, publisher, directory) = setup(&etcd).await;
    let guard = rdma
        .register_owned(vec![3u8; 4096].into_boxed_slice())
        .await
        .expect("registers");
    // A name the publisher refuses: nothing is written, the guard returns.
    let refused = PublishedRegion::publish(Arc::clone(&publisher), "", guard)
        .await
        .expect_err("an empty name is refused");
    assert!(
        matches!(refused.error, PublishFailure::Discovery(_)),
        "{refused}"
    );
    let guard = refused.region;
    assert!(!guard.watch().is_deregistered());
    assert!(directory.resolve("").await.is_err());
    guard
        .unregister(Duration::from_secs(5))
        .await
        .expect("unregisters");
    let summary = rdma.shutdown().await;
    assert!(summary.is_clean(), "{summary:?}");
}
