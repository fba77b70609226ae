//! Transfer lists whose entries overlap in their destination, over real UCX
//! engines (tcp on the loopback interface): the same range read many times
//! into the same bytes, and ranges shifted by one byte. Each entry answers
//! on its own, the buffer comes back whole, and it holds the source's
//! bytes wherever every entry writing it agrees.

use std::time::Duration;

use rdmareg::registry::RdmaConfig;
use rdmareg::{Config, PeerId, Rdma, Transport};

fn config() -> Config {
    Config::new()
        .with_transport(Transport::Tcp)
        .with_net_devices("lo")
        .with_get_deadline(Duration::from_secs(10))
        .with_registry(
            RdmaConfig::default()
                .with_budget_bytes(256 << 20)
                .with_shutdown_budget(Duration::from_secs(5)),
        )
}

const OWNER: PeerId = PeerId(1);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_and_duplicate_entries_each_answer_and_land_the_source_bytes() {
    let owner = Rdma::start(config()).expect("owner starts");
    let consumer = Rdma::start(config()).expect("consumer starts");
    consumer
        .add_peer(OWNER, owner.worker_address())
        .expect("peer");
    let len = 1 << 20;
    // A constant source: any entry writing a byte writes the same value.
    let source = owner
        .register_owned(vec![0x3Cu8; len].into_boxed_slice())
        .await
        .expect("registers");
    let descriptor = source.descriptor().expect("descriptor");
    let mut buffers = vec![consumer.alloc_pinned(len + 8).await.expect("allocates")];
    buffers[0].fill(0);
    let mut list = consumer.transfer_list(OWNER);
    for _ in 0..8 {
        list.push(&descriptor, 0, 0).expect("duplicate entry");
    }
    for shift in 1..=8 {
        let cut = descriptor.slice(0, (len - shift) as u64).expect("slice");
        list.push(&cut, 0, shift).expect("shifted entry");
    }
    let mut rounds = Vec::new();
    for _ in 0..3 {
        let answers = consumer
            .post(&list, &mut buffers)
            .await
            .expect("the post is admitted");
        rounds.push(answers);
    }
    let whole = !buffers[0].is_surrendered() && buffers[0].len() == len + 8;
    let landed = buffers[0][..len].iter().all(|&b| b == 0x3C);
    let tail_untouched = buffers[0][len..].iter().all(|&b| b == 0);
    drop(buffers);
    drop(source);
    let (a, b) = (owner.shutdown().await, consumer.shutdown().await);
    for answers in &rounds {
        assert_eq!(answers.len(), 16);
        assert!(answers.iter().all(Result::is_ok), "{answers:?}");
    }
    assert!(whole, "the buffer came back whole");
    assert!(
        landed,
        "every byte any entry wrote holds the source's value"
    );
    assert!(tail_untouched, "no entry wrote past the end of its range");
    assert!(a.is_clean() && b.is_clean(), "{a:?} {b:?}");
}
