//! Lists posted again (`get_shared_batch`): a same-host list is copied by
//! the plan worked out at its first post, and every post still answers as
//! a fresh batch of the same requests would.

use crate::common;

use std::sync::Arc;

use common::*;
use rdmareg_backend::BackendGet;
use rdmareg_core::RdmaError;
use rdmareg_ucx::{Transport, UcxConfig, UcxEngine};

const ENTRIES: usize = 256;
const BLOCK: usize = 4096;

/// Entry `i` reads source block `i * 7 mod ENTRIES` (7 is coprime with
/// `ENTRIES`) into destination block `i`: the list is in neither side's
/// order.
fn source_block(i: usize) -> usize {
    i * 7 % ENTRIES
}

struct Setup {
    owner: UcxEngine,
    consumer: UcxEngine,
    src: PageBuf,
    dst: PageBuf,
    requests: Arc<[BackendGet]>,
}

impl Setup {
    /// Two engines of `config` whose consumer copies nothing on its
    /// callers' threads (so the progress thread copies every same-host
    /// list), and a shared list of [`ENTRIES`] blocks.
    async fn new(config: UcxConfig) -> Setup {
        let (owner, consumer) = engines_with(config.with_caller_copy_limit(0));
        let src = PageBuf::filled(ENTRIES * BLOCK, pattern);
        let dst = PageBuf::zeroed(ENTRIES * BLOCK);
        let src_region = map(&owner.backend(), &src).await;
        let dst_region = map(&consumer.backend(), &dst).await;
        let descriptor = describe(&src, &src_region);
        let requests = (0..ENTRIES)
            .map(|i| {
                let block = descriptor
                    .slice((source_block(i) * BLOCK) as u64, BLOCK as u64)
                    .expect("inside the descriptor");
                get_request(OWNER, &block, &dst_region, (i * BLOCK) as u64, None)
            })
            .collect();
        Setup {
            owner,
            consumer,
            src,
            dst,
            requests,
        }
    }

    /// Posts the list into a zeroed destination; its answers.
    async fn post(&self) -> Vec<Result<(), RdmaError>> {
        self.dst.fill(0);
        self.consumer
            .backend()
            .get_shared_batch_into_test_memory(Arc::clone(&self.requests))
            .await
    }

    /// Whether every destination block holds its source block.
    fn landed(&self) -> bool {
        let (got, want) = (self.dst.snapshot(), self.src.snapshot());
        (0..ENTRIES).all(|i| {
            let from = source_block(i) * BLOCK;
            got[i * BLOCK..(i + 1) * BLOCK] == want[from..from + BLOCK]
        })
    }

    async fn finish(self) {
        self.consumer.shutdown().await;
        self.owner.shutdown().await;
        assert_eq!(self.consumer.live_registrations(), Some(0));
        assert_eq!(self.owner.live_registrations(), Some(0));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_host_list_posted_again_is_copied_by_its_plan_and_lands_every_time() {
    let setup = Setup::new(config(Transport::SameHost)).await;
    for post in 1..=3 {
        assert_eq!(setup.post().await, vec![Ok(()); ENTRIES], "post {post}");
        assert!(setup.landed(), "post {post}: a block is not its source's");
        assert_eq!(
            setup.consumer.lists_copied_by_plan(),
            post,
            "post {post} was not copied by the list's plan"
        );
    }
    setup.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planned_list_from_a_removed_peer_fails_as_a_fresh_batch_would_and_is_planned_again_once_readded()
 {
    let setup = Setup::new(config(Transport::SameHost)).await;
    assert_eq!(setup.post().await, vec![Ok(()); ENTRIES]);
    assert_eq!(setup.consumer.lists_copied_by_plan(), 1);

    setup.consumer.remove_peer(OWNER).unwrap();
    let fresh = setup
        .consumer
        .backend()
        .get_batch_into_test_memory(setup.requests.to_vec())
        .await;
    assert_eq!(fresh, vec![Err(RdmaError::NotConfigured); ENTRIES]);
    assert_eq!(
        setup.post().await,
        fresh,
        "a planned list answered otherwise than a fresh batch"
    );
    assert_eq!(
        setup.dst.snapshot(),
        vec![0; ENTRIES * BLOCK],
        "a list from a removed peer landed bytes"
    );
    assert_eq!(setup.consumer.lists_copied_by_plan(), 1);

    setup
        .consumer
        .add_peer(OWNER, setup.owner.worker_address())
        .unwrap();
    assert_eq!(setup.post().await, vec![Ok(()); ENTRIES]);
    assert!(setup.landed(), "after the peer was added again");
    assert_eq!(
        setup.consumer.lists_copied_by_plan(),
        2,
        "the list was not planned again for the peer added again"
    );
    setup.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_the_owner_serves_have_no_plan_and_land_as_batches() {
    for (lane, config) in [
        ("tcp", config(Transport::Tcp)),
        (
            "same host, served",
            config(Transport::SameHost).with_same_host_direct_reads(false),
        ),
    ] {
        let setup = Setup::new(config).await;
        for post in 1..=2 {
            assert_eq!(
                setup.post().await,
                vec![Ok(()); ENTRIES],
                "{lane} post {post}"
            );
            assert!(setup.landed(), "{lane} post {post}");
        }
        assert_eq!(setup.consumer.lists_copied_by_plan(), 0, "{lane}");
        setup.finish().await;
    }
}
