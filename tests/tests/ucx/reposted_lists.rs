//! A transfer list posted again through the registry: into the same
//! buffers it reuses its requests, so a same-host list is copied by the
//! engine's copy plan; into other buffers, or once the list grew, its
//! requests are built again, so every post lands exactly where its entries
//! say (a buffer that took a freed buffer's slot included).

use rdmareg_registry::{PinnedBuf, TransferList};
use rdmareg_tests::{Engine, OWNER, Pair, registry_config};
use rdmareg_ucx::Transport;

const BLOCKS: u64 = 64;
const BLOCK: u64 = 4096;
const LEN: usize = (BLOCKS * BLOCK) as usize;

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

/// A same-host pair, the owner's patterned source, and a list of
/// [`BLOCKS`] blocks into buffer 0 (the guard must be unregistered by the
/// caller).
async fn scene() -> (Pair, Box<[u8]>, rdmareg_registry::RegionGuard, TransferList) {
    let pair = Pair::start(Transport::SameHost, registry_config());
    let source = rdmareg_tests::patterned(LEN, 5);
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
    (pair, source, guard, list)
}

async fn finish(pair: Pair, guard: rdmareg_registry::RegionGuard) {
    guard
        .unregister_owned(std::time::Duration::from_secs(5))
        .await
        .unwrap();
    pair.shut_down(std::time::Duration::from_secs(10)).await;
}

/// A list posted three times into the same buffer is copied by one plan
/// each time; posted into another buffer it lands there and writes nothing
/// into the last post's buffer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_posted_again_into_the_same_buffer_is_copied_by_its_plan_and_into_another_lands_there()
 {
    let (pair, source, guard, list) = scene().await;
    let mut first = vec![pair.consumer.registry.alloc_pinned(LEN).await.unwrap()];
    let mut second = vec![pair.consumer.registry.alloc_pinned(LEN).await.unwrap()];
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
    finish(pair, guard).await;
}

/// A list posted, then pushed another entry (into a second buffer), then
/// posted again into the same buffers answers every entry, the new one
/// included, and lands the new entry: the requests kept from the first
/// post are not reused for a list that grew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_pushed_to_after_a_post_lands_its_new_entry_when_posted_into_the_same_buffers() {
    let (pair, source, guard, mut list) = scene().await;
    let registry = &pair.consumer.registry;
    let mut buffers = vec![
        registry.alloc_pinned(LEN).await.unwrap(),
        registry.alloc_pinned(LEN).await.unwrap(),
    ];
    // The second buffer is named only by the entry pushed later; the
    // first post already writes the first.
    let extra = guard.descriptor_range(0, BLOCK).unwrap();
    list.push(&extra, 1, 0).unwrap();
    let answers = registry.post(&list, &mut buffers).await.unwrap();
    assert_eq!(answers, vec![Ok(()); BLOCKS as usize + 1]);
    // Grown by one more entry, into the same (already named) buffers.
    let grown = guard.descriptor_range(BLOCK, BLOCK).unwrap();
    let index = list.push(&grown, 1, BLOCK as usize).unwrap();
    assert_eq!(index, BLOCKS as usize + 1);
    buffers[0].fill(0);
    buffers[1].fill(0);
    let answers = registry.post(&list, &mut buffers).await.unwrap();
    assert_eq!(
        answers,
        vec![Ok(()); BLOCKS as usize + 2],
        "a grown list was answered for its old entries"
    );
    assert_landed(&buffers[0], &source, "the first buffer");
    assert!(
        buffers[1][..2 * BLOCK as usize] == source[..2 * BLOCK as usize],
        "the entry pushed after the first post did not land"
    );
    assert_eq!(copied_by_plan(&pair), 2, "each post was one planned copy");
    drop(buffers);
    finish(pair, guard).await;
}

/// A list posted into a buffer that is then dropped, and posted again into
/// a new buffer that took the freed buffer's slot (the same arena and
/// offset, so the same requests), lands in the new buffer, answers `Ok`,
/// and is copied by the list's plan: a slot reused by another buffer is
/// that buffer's, and the kept requests name exactly its bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_posted_into_a_buffer_that_took_a_freed_buffers_slot_lands_there() {
    let (pair, source, guard, list) = scene().await;
    let registry = &pair.consumer.registry;
    let mut first = vec![registry.alloc_pinned(LEN).await.unwrap()];
    let answers = registry.post(&list, &mut first).await.unwrap();
    assert_eq!(answers, vec![Ok(()); BLOCKS as usize]);
    let slot_at = first[0].as_ptr();
    drop(first);
    let mut second = vec![registry.alloc_pinned(LEN).await.unwrap()];
    assert_eq!(
        second[0].as_ptr(),
        slot_at,
        "the new buffer did not take the freed buffer's slot"
    );
    second[0].fill(0);
    let answers = registry.post(&list, &mut second).await.unwrap();
    assert_eq!(answers, vec![Ok(()); BLOCKS as usize]);
    assert_landed(&second[0], &source, "the buffer in the reused slot");
    assert_eq!(copied_by_plan(&pair), 2);
    drop(second);
    finish(pair, guard).await;
}
