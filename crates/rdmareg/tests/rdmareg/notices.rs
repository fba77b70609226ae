//! Notices through the facade over real UCX engines: an owner frees each
//! range as soon as its reader says it is done, over tcp and over the
//! same-host direct lane, where the reads are one-sided and the notice is
//! the only message the owner gets.

use std::time::Duration;

use futures::StreamExt;
use rdmareg::registry::RdmaConfig;
use rdmareg::{Config, PeerId, Rdma, Transport};

const OWNER: PeerId = PeerId(1);

fn config(transport: Transport) -> Config {
    Config::new()
        .with_transport(transport)
        .with_net_devices("lo")
        .with_registry(RdmaConfig::default().with_shutdown_budget(Duration::from_secs(5)))
}

/// Three ranges, each read by the consumer with a notice naming it; the
/// owner unregisters each when its notice arrives and ends with nothing
/// registered, every byte read as written.
async fn readers_release_what_they_read(transport: Transport) {
    let owner = Rdma::start(config(transport.clone())).expect("owner starts");
    let consumer = Rdma::start(config(transport)).expect("consumer starts");
    consumer
        .add_peer(OWNER, owner.worker_address())
        .expect("consumer knows the owner");
    let mut notices = owner.notices().expect("the owner's notices");
    let mut ranges = Vec::new();
    for index in 0..3u8 {
        let bytes = vec![index + 1; 64 << 10].into_boxed_slice();
        ranges.push(Some(owner.register_owned(bytes).await.expect("registers")));
    }
    for (index, range) in ranges.iter().enumerate() {
        let descriptor = range.as_ref().unwrap().descriptor().unwrap();
        let mut buf = consumer.alloc_pinned(64 << 10).await.unwrap();
        consumer
            .get_with_notice(OWNER, &descriptor, &mut buf, vec![index as u8])
            .await
            .expect("a read with its notice");
        assert!(buf.iter().all(|&b| b == index as u8 + 1));
    }
    for _ in 0..3 {
        let notice = tokio::time::timeout(Duration::from_secs(10), notices.next())
            .await
            .expect("a notice arrives")
            .expect("the stream is open");
        assert_eq!(Some(notice.from), consumer.notice_sender());
        let range = ranges[notice.bytes[0] as usize]
            .take()
            .expect("each range is released once");
        range
            .unregister(Duration::from_secs(5))
            .await
            .expect("unregisters");
    }
    assert_eq!(owner.stats().live_regions, 0);
    assert_eq!(owner.notice_drops().map(|d| d.total()), Some(0));
    assert!(consumer.shutdown().await.is_clean());
    assert!(owner.shutdown().await.is_clean());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tcp_readers_release_what_they_read() {
    readers_release_what_they_read(Transport::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_same_host_readers_release_what_they_read() {
    readers_release_what_they_read(Transport::SameHost).await;
}
