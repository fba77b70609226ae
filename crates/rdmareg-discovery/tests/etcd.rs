//! Discovery against a real etcd, one server per test.

use std::time::{Duration, Instant};

use bytes::Bytes;
use rdmareg_core::Descriptor;
use rdmareg_discovery::test_support::{EtcdServer, free_port};
use rdmareg_discovery::{
    Directory, DirectoryEvent, DirectoryWatch, DiscoveryError, EtcdConfig, Publisher,
    PublisherStatus,
};

const TTL: Duration = Duration::from_secs(2);
/// etcd checks lease expiry on a timer of its own: allow a little past the TTL.
const EXPIRY_SLACK: Duration = Duration::from_secs(2);

fn config(etcd: &EtcdServer) -> EtcdConfig {
    EtcdConfig::new(etcd.url())
        .with_prefix("/rdmareg/test")
        .with_ttl(TTL)
}

fn descriptor(addr: u64, generation: u64) -> Descriptor {
    Descriptor::new("ucx", addr, 4096, generation, Bytes::from_static(b"packed")).unwrap()
}

async fn publisher(etcd: &EtcdServer, node: &str) -> Publisher {
    Publisher::start(
        &config(etcd),
        node,
        "ucx",
        Bytes::from(format!("address of {node}")),
    )
    .await
    .unwrap()
}

/// The next event satisfying `want`, failing after `within`.
async fn wait_for(
    watch: &mut DirectoryWatch,
    within: Duration,
    want: impl Fn(&DirectoryEvent) -> bool,
) -> DirectoryEvent {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, watch.next()).await {
            Ok(Some(event)) if want(&event) => return event,
            Ok(Some(_)) => {}
            Ok(None) => panic!("the watch stopped"),
            Err(_) => panic!("no matching event within {within:?}"),
        }
    }
}

#[tokio::test]
async fn a_published_descriptor_resolves_to_its_node_and_address() {
    let etcd = EtcdServer::start().unwrap();
    let owner = publisher(&etcd, "owner-a").await;
    owner
        .publish("block-1", &descriptor(0x1000, 1))
        .await
        .unwrap();

    let directory = Directory::connect(&config(&etcd)).await.unwrap();
    let resolved = directory.resolve("block-1").await.unwrap();
    assert_eq!(resolved.descriptor, descriptor(0x1000, 1));
    assert_eq!(resolved.peer.node, "owner-a");
    assert_eq!(
        &resolved.peer.record.worker_address[..],
        b"address of owner-a"
    );
    assert_eq!(resolved.peer.record.incarnation, owner.incarnation());
    assert!(matches!(
        directory.resolve("block-2").await,
        Err(DiscoveryError::NotFound(name)) if name == "block-2"
    ));
}

#[tokio::test]
async fn a_stopped_publisher_disappears_within_the_ttl() {
    let etcd = EtcdServer::start().unwrap();
    let owner = publisher(&etcd, "owner-a").await;
    owner
        .publish("block-1", &descriptor(0x1000, 1))
        .await
        .unwrap();
    let directory = Directory::connect(&config(&etcd)).await.unwrap();
    let mut watch = directory.watch();
    wait_for(
        &mut watch,
        Duration::from_secs(5),
        |e| matches!(e, DirectoryEvent::Published { name, .. } if name == "block-1"),
    )
    .await;

    // Dropping the publisher stops its keep-alive, as a crash would.
    let stopped = Instant::now();
    drop(owner);
    wait_for(
        &mut watch,
        TTL + EXPIRY_SLACK,
        |e| matches!(e, DirectoryEvent::NodeGone { node, .. } if node == "owner-a"),
    )
    .await;
    assert!(stopped.elapsed() <= TTL + EXPIRY_SLACK);
    assert!(matches!(
        directory.resolve("block-1").await,
        Err(DiscoveryError::NotFound(_))
    ));
}

#[tokio::test]
async fn a_withdrawn_descriptor_is_reported_and_no_longer_resolves() {
    let etcd = EtcdServer::start().unwrap();
    let owner = publisher(&etcd, "owner-a").await;
    owner
        .publish("block-1", &descriptor(0x1000, 1))
        .await
        .unwrap();
    owner
        .publish("block-2", &descriptor(0x2000, 2))
        .await
        .unwrap();
    let directory = Directory::connect(&config(&etcd)).await.unwrap();
    let mut watch = directory.watch();
    wait_for(
        &mut watch,
        Duration::from_secs(5),
        |e| matches!(e, DirectoryEvent::Published { name, .. } if name == "block-2"),
    )
    .await;

    owner.withdraw("block-1").await.unwrap();
    wait_for(
        &mut watch,
        Duration::from_secs(5),
        |e| matches!(e, DirectoryEvent::Withdrawn { name } if name == "block-1"),
    )
    .await;
    assert!(matches!(
        directory.resolve("block-1").await,
        Err(DiscoveryError::NotFound(_))
    ));
    assert_eq!(
        directory.resolve("block-2").await.unwrap().descriptor,
        descriptor(0x2000, 2)
    );
    // Withdrawing again, or a name never published, is fine.
    owner.withdraw("block-1").await.unwrap();
    owner.withdraw("never").await.unwrap();
}

#[tokio::test]
async fn a_re_registered_region_replaces_its_entry() {
    let etcd = EtcdServer::start().unwrap();
    let owner = publisher(&etcd, "owner-a").await;
    let directory = Directory::connect(&config(&etcd)).await.unwrap();
    owner
        .publish("block-1", &descriptor(0x1000, 1))
        .await
        .unwrap();
    let first = directory.resolve("block-1").await.unwrap();
    let mut watch = directory.watch();

    owner
        .publish("block-1", &descriptor(0x5000, 2))
        .await
        .unwrap();
    let event = wait_for(&mut watch, Duration::from_secs(5), |e| {
        matches!(e, DirectoryEvent::Published { descriptor, .. } if descriptor.generation() == 2)
    })
    .await;
    let DirectoryEvent::Published { revision, .. } = event else {
        unreachable!()
    };
    assert!(revision > first.revision);
    let second = directory.resolve("block-1").await.unwrap();
    assert_eq!(second.descriptor, descriptor(0x5000, 2));
}

#[tokio::test]
async fn a_descriptor_older_than_one_already_seen_is_refused() {
    let etcd = EtcdServer::start().unwrap();
    let owner = publisher(&etcd, "owner-a").await;
    let directory = Directory::connect(&config(&etcd)).await.unwrap();
    owner
        .publish("block-1", &descriptor(0x1000, 5))
        .await
        .unwrap();
    assert_eq!(
        directory
            .resolve("block-1")
            .await
            .unwrap()
            .descriptor
            .generation(),
        5
    );

    // The same node puts back an older registration's descriptor.
    owner
        .publish("block-1", &descriptor(0x1000, 3))
        .await
        .unwrap();
    let refused = directory.resolve("block-1").await;
    assert!(
        matches!(
            refused,
            Err(DiscoveryError::Stale {
                seen_generation: 5,
                got_generation: 3,
                ..
            })
        ),
        "{refused:?}"
    );
    // A newer generation is accepted again.
    owner
        .publish("block-1", &descriptor(0x1000, 6))
        .await
        .unwrap();
    assert_eq!(
        directory
            .resolve("block-1")
            .await
            .unwrap()
            .descriptor
            .generation(),
        6
    );
}

#[tokio::test]
async fn a_restarted_node_is_accepted_with_generations_counted_from_the_start() {
    let etcd = EtcdServer::start().unwrap();
    let directory = Directory::connect(&config(&etcd)).await.unwrap();
    let first = publisher(&etcd, "owner-a").await;
    first
        .publish("block-1", &descriptor(0x1000, 9))
        .await
        .unwrap();
    assert_eq!(
        directory
            .resolve("block-1")
            .await
            .unwrap()
            .descriptor
            .generation(),
        9
    );
    first.shutdown().await.unwrap();

    let second = publisher(&etcd, "owner-a").await;
    second
        .publish("block-1", &descriptor(0x1000, 1))
        .await
        .unwrap();
    let resolved = directory.resolve("block-1").await.unwrap();
    assert_eq!(resolved.descriptor.generation(), 1);
    assert_eq!(resolved.peer.record.incarnation, second.incarnation());
}

#[tokio::test]
async fn shutdown_withdraws_the_node_and_every_name_at_once() {
    let etcd = EtcdServer::start().unwrap();
    let owner = publisher(&etcd, "owner-a").await;
    owner
        .publish("block-1", &descriptor(0x1000, 1))
        .await
        .unwrap();
    let directory = Directory::connect(&config(&etcd)).await.unwrap();
    let mut watch = directory.watch();
    wait_for(&mut watch, Duration::from_secs(5), |e| {
        matches!(e, DirectoryEvent::Published { .. })
    })
    .await;
    owner.shutdown().await.unwrap();
    // Far sooner than the TTL: the lease is revoked, not left to expire.
    wait_for(&mut watch, Duration::from_millis(1500), |e| {
        matches!(e, DirectoryEvent::NodeGone { .. })
    })
    .await;
    assert!(matches!(
        directory.resolve("block-1").await,
        Err(DiscoveryError::NotFound(_))
    ));
}

#[tokio::test]
async fn withdraw_leaves_another_nodes_newer_entry_alone() {
    let etcd = EtcdServer::start().unwrap();
    let a = publisher(&etcd, "owner-a").await;
    let b = publisher(&etcd, "owner-b").await;
    a.publish("block-1", &descriptor(0x1000, 1)).await.unwrap();
    b.publish("block-1", &descriptor(0x9000, 1)).await.unwrap();
    a.withdraw("block-1").await.unwrap();
    let directory = Directory::connect(&config(&etcd)).await.unwrap();
    let resolved = directory.resolve("block-1").await.unwrap();
    assert_eq!(resolved.peer.node, "owner-b");
}

#[tokio::test]
async fn publishing_resumes_after_etcd_restarts() {
    let mut etcd = EtcdServer::start().unwrap();
    let owner = publisher(&etcd, "owner-a").await;
    owner
        .publish("block-1", &descriptor(0x1000, 1))
        .await
        .unwrap();
    let mut status = owner.status();

    etcd.stop();
    tokio::time::timeout(
        Duration::from_secs(10),
        status.wait_for(|s| matches!(s, PublisherStatus::Reconnecting { .. })),
    )
    .await
    .expect("the loss is reported")
    .unwrap();
    etcd.restart().unwrap();
    let live = tokio::time::timeout(
        Duration::from_secs(15),
        status.wait_for(|s| matches!(s, PublisherStatus::Live { .. })),
    )
    .await
    .expect("the publisher reconnects")
    .unwrap()
    .clone();
    assert!(matches!(live, PublisherStatus::Live { .. }));

    owner
        .publish("block-2", &descriptor(0x2000, 2))
        .await
        .unwrap();
    let directory = Directory::connect(&config(&etcd)).await.unwrap();
    assert_eq!(
        directory.resolve("block-1").await.unwrap().peer.node,
        "owner-a"
    );
    assert_eq!(
        directory
            .resolve("block-2")
            .await
            .unwrap()
            .descriptor
            .generation(),
        2
    );
    // Past the old lease's TTL, the entries are still there: they were
    // written again under the new lease.
    tokio::time::sleep(TTL + EXPIRY_SLACK).await;
    assert_eq!(
        directory.resolve("block-1").await.unwrap().peer.node,
        "owner-a"
    );
}

#[tokio::test]
async fn a_watch_reports_the_loss_and_the_resync_across_an_etcd_restart() {
    let mut etcd = EtcdServer::start().unwrap();
    let owner = publisher(&etcd, "owner-a").await;
    owner
        .publish("block-1", &descriptor(0x1000, 1))
        .await
        .unwrap();
    let directory = Directory::connect(&config(&etcd)).await.unwrap();
    let mut watch = directory.watch();
    let mut status = owner.status();
    let PublisherStatus::Live { lease: first_lease } = status.borrow().clone() else {
        panic!("a started publisher is live");
    };
    wait_for(&mut watch, Duration::from_secs(5), |e| {
        matches!(e, DirectoryEvent::Published { .. })
    })
    .await;
    etcd.stop();
    wait_for(&mut watch, Duration::from_secs(10), |e| {
        matches!(e, DirectoryEvent::Disconnected { .. })
    })
    .await;
    etcd.restart().unwrap();
    wait_for(&mut watch, Duration::from_secs(15), |e| {
        matches!(e, DirectoryEvent::Resynced { .. })
    })
    .await;
    // The publisher reconnects on its own schedule (with a new lease);
    // publish once it is live again.
    tokio::time::timeout(
        Duration::from_secs(15),
        status.wait_for(|s| matches!(s, PublisherStatus::Live { lease } if *lease != first_lease)),
    )
    .await
    .expect("the publisher reconnects")
    .unwrap();
    owner
        .publish("block-2", &descriptor(0x2000, 2))
        .await
        .unwrap();
    wait_for(
        &mut watch,
        Duration::from_secs(5),
        |e| matches!(e, DirectoryEvent::Published { name, .. } if name == "block-2"),
    )
    .await;
}

#[tokio::test]
async fn an_unreachable_etcd_is_one_clear_error() {
    let port = free_port().unwrap();
    let config = EtcdConfig::new(format!("http://127.0.0.1:{port}"))
        .with_connect_timeout(Duration::from_millis(500));
    let started = Instant::now();
    let error = Directory::connect(&config).await.unwrap_err();
    assert!(
        matches!(error, DiscoveryError::Unreachable { .. }),
        "{error}"
    );
    assert!(error.is_transient());
    assert!(error.to_string().contains(&port.to_string()));
    assert!(started.elapsed() < Duration::from_secs(3));
}

#[tokio::test]
async fn a_malformed_endpoint_is_refused_before_connecting() {
    let error = Publisher::start(
        &EtcdConfig::new("https://etcd:2379"),
        "n",
        "ucx",
        Bytes::from_static(b"a"),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(error, DiscoveryError::InvalidEndpoint { .. }),
        "{error}"
    );
    assert!(!error.is_transient());
}

/// etcd loses its data (killed, restarted on an empty directory) and the
/// owner restarts with it. The new store counts revisions from 1 again, so
/// everything the owner publishes there is at a lower revision than what was
/// seen before; the watch must report the replaced store and follow it, not
/// refuse its entries as stale, and so must `resolve` on a directory that
/// never watched.
#[tokio::test]
async fn a_watch_follows_an_owner_across_a_wiped_etcd() {
    let mut etcd = EtcdServer::start().unwrap();
    etcd.age(300).unwrap();
    let first = publisher(&etcd, "owner-a").await;
    first
        .publish("block-1", &descriptor(0x1000, 1))
        .await
        .unwrap();
    let directory = Directory::connect(&config(&etcd)).await.unwrap();
    let resolver = Directory::connect(&config(&etcd)).await.unwrap();
    assert!(resolver.resolve("block-1").await.unwrap().revision > 300);
    let mut watch = directory.watch();
    wait_for(&mut watch, Duration::from_secs(5), |e| {
        matches!(e, DirectoryEvent::Published { .. })
    })
    .await;

    drop(first);
    etcd.wipe().unwrap();
    let second = publisher(&etcd, "owner-a").await;
    second
        .publish("block-1", &descriptor(0x5000, 1))
        .await
        .unwrap();
    let replaced = wait_for(&mut watch, Duration::from_secs(15), |e| {
        matches!(e, DirectoryEvent::StoreReplaced { .. })
    })
    .await;
    assert!(
        matches!(&replaced, DirectoryEvent::StoreReplaced { reason } if reason.contains("revision went back")),
        "{replaced:?}"
    );
    wait_for(&mut watch, Duration::from_secs(5), |e| {
        matches!(e, DirectoryEvent::Published { descriptor: d, .. } if *d == descriptor(0x5000, 1))
    })
    .await;
    let resolved = directory.resolve("block-1").await.unwrap();
    assert_eq!(resolved.descriptor, descriptor(0x5000, 1));
    assert_eq!(resolved.peer.record.incarnation, second.incarnation());
    let resolved = resolver.resolve("block-1").await.unwrap();
    assert_eq!(resolved.descriptor, descriptor(0x5000, 1));
}

/// An owner keeps running while etcd is wiped: it republishes into the new
/// store on its own, as a new incarnation of that store, and the watch
/// reports it back. When it restarts later, the new process (a later
/// incarnation of the new store) is followed too.
#[tokio::test]
async fn an_owner_that_outlives_a_wiped_etcd_may_restart_later() {
    let mut etcd = EtcdServer::start().unwrap();
    etcd.age(300).unwrap();
    let first = publisher(&etcd, "owner-a").await;
    first
        .publish("block-1", &descriptor(0x1000, 1))
        .await
        .unwrap();
    let directory = Directory::connect(&config(&etcd)).await.unwrap();
    let mut watch = directory.watch();
    // The first snapshot: the name, then the node (keys in order).
    wait_for(&mut watch, Duration::from_secs(5), |e| {
        matches!(e, DirectoryEvent::NodeUp(_))
    })
    .await;
    let old_incarnation = first.incarnation();
    let mut status = first.status();

    etcd.wipe().unwrap();
    tokio::time::timeout(
        Duration::from_secs(15),
        status.wait_for(|s| matches!(s, PublisherStatus::Reconnecting { .. })),
    )
    .await
    .expect("the loss is reported")
    .unwrap();
    tokio::time::timeout(
        Duration::from_secs(15),
        status.wait_for(|s| matches!(s, PublisherStatus::Live { .. })),
    )
    .await
    .expect("the publisher republishes into the new store")
    .unwrap();
    // The owner is a new incarnation of the new store now.
    assert!(
        first.incarnation() < old_incarnation,
        "{} after {old_incarnation}",
        first.incarnation()
    );
    // The republished entry and node are reported again, from the new
    // store. (Whether the node is reported gone first depends on whether
    // the watch saw the new store before the owner republished.)
    let mut since_wipe = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let republished = |e: &DirectoryEvent| matches!(e, DirectoryEvent::Published { descriptor: d, .. } if *d == descriptor(0x1000, 1));
    let back = |e: &DirectoryEvent| matches!(e, DirectoryEvent::NodeUp(peer) if peer.record.incarnation == first.incarnation());
    while !(since_wipe.iter().any(republished) && since_wipe.iter().any(back)) {
        let event = tokio::time::timeout_at(deadline, watch.next())
            .await
            .unwrap_or_else(|_| panic!("not republished; saw {since_wipe:?}"))
            .expect("the watch runs");
        since_wipe.push(event);
    }
    assert!(
        since_wipe
            .iter()
            .any(|e| matches!(e, DirectoryEvent::StoreReplaced { .. })),
        "{since_wipe:?}"
    );
    assert_eq!(
        directory.resolve("block-1").await.unwrap().descriptor,
        descriptor(0x1000, 1)
    );

    first.shutdown().await.unwrap();
    let second = publisher(&etcd, "owner-a").await;
    second
        .publish("block-1", &descriptor(0x5000, 1))
        .await
        .unwrap();
    wait_for(&mut watch, Duration::from_secs(10), |e| {
        matches!(e, DirectoryEvent::Published { descriptor: d, .. } if *d == descriptor(0x5000, 1))
    })
    .await;
    let resolved = directory.resolve("block-1").await.unwrap();
    assert_eq!(resolved.peer.record.incarnation, second.incarnation());
}
