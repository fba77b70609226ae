//! A transfer list posted again through the registry: into the same
//! buffers it reuses its requests, so a same-host list is copied by the
//! engine's copy plan; into other buffers it lands there and nowhere else.

use rdmareg_registry::PinnedBuf;
use rdmareg_tests::{Engine, OWNER, Pair, registry_config};
use rdmareg_ucx::Transport;

const BLOCKS: u64 = 64;
const BLOCK: u64 = 4096;

/// Block `i` of the destination comes from source block `i * 7 mod BLOCKS`.
fn source_block(i: u64) -> u64 {
    i * 7 % BLOCKS
}

fn copied_by_plan(pair: &Pair) -> u64 {
    match &pair.consumer.engine {
        Engine::Ucx(engine) => engine.lists_copied_by_plan(),
        Engine::Ofi(_) => unreachable!("a UCX pair"),
    }
}

fn assert_landed(buffer: &PinnedBuf, source: &[u8], what: &str) {
    for i in 0..BLOCKS {
        let (at, from) = ((i * BLOCK) as usize, (source_block(i) * BLOCK) as usize);
        assert!(
            buffer[at..at + BLOCK as usize] == source[from..from + BLOCK as usize],
            "{what}: block {i} is not its source's"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_posted_again_into_the_same_buffer_is_copied_by_its_plan_and_into_another_lands_there()
 {
    let pair = Pair::start(Transport::SameHost, registry_config());
    let source = rdmareg_tests::patterned((BLOCKS * BLOCK) as usize, 3);
    let guard = pair
        .owner
        .registry
        .register_owned(source.clone())
        .await
        .unwrap();
    let mut list = pair.consumer.registry.transfer_list(OWNER);
    for i in 0..BLOCKS {
        let block = guard
            .descriptor_range(source_block(i) * BLOCK, BLOCK)
            .unwrap();
        list.push(&block, 0, (i * BLOCK) as usize).unwrap();
    }
    let len = (BLOCKS * BLOCK) as usize;
    let mut first = vec![pair.consumer.registry.alloc_pinned(len).await.unwrap()];
    let mut second = vec![pair.consumer.registry.alloc_pinned(len).await.unwrap()];
    second[0].fill(0xEE);
    let before = copied_by_plan(&pair);
    for post in 1..=3 {
        first[0].fill(0);
        let answers = pair
            .consumer
            .registry
            .post(&list, &mut first)
            .await
            .unwrap();
        assert_eq!(answers, vec![Ok(()); BLOCKS as usize], "post {post}");
        assert_landed(&first[0], &source, &format!("post {post}"));
    }
    assert_eq!(
        copied_by_plan(&pair) - before,
        3,
        "posts into the same buffer were not copied by one plan"
    );
    // Into another buffer: the requests are built again for it.
    first[0].fill(0xDD);
    let answers = pair
        .consumer
        .registry
        .post(&list, &mut second)
        .await
        .unwrap();
    assert_eq!(answers, vec![Ok(()); BLOCKS as usize]);
    assert_landed(&second[0], &source, "the post into another buffer");
    assert!(
        first[0].iter().all(|&b| b == 0xDD),
        "a post into another buffer wrote into the last post's buffer"
    );
    drop((first, second));
    guard
        .unregister_owned(std::time::Duration::from_secs(5))
        .await
        .unwrap();
    pair.shut_down(std::time::Duration::from_secs(10)).await;
}
