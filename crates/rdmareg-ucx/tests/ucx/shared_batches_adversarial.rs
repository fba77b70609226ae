//! Lists posted again (`get_shared_batch`), probed where a copy plan could
//! outlive what it was worked out from: a destination unmapped and mapped
//! again at the same address, a copy that fails for one entry, lists of
//! one shape built and dropped one after another (so an allocation may be
//! reused), two lists into one destination, and an owner engine shut down.
//! Every post must answer as a fresh batch of the same requests would, and
//! land bytes only where its requests say.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use rdmareg_backend::{BackendGet, RdmaBackend};
use rdmareg_core::{BackendRegion, Descriptor, RdmaError};
use rdmareg_ucx::{Transport, UcxEngine};

const ENTRIES: usize = 64;
const BLOCK: usize = 4096;

/// Two same-host engines whose consumer copies nothing on its callers'
/// threads, so the progress thread copies (and plans) every same-host list.
fn same_host_engines() -> (UcxEngine, UcxEngine) {
    engines_with(config(Transport::SameHost).with_caller_copy_limit(0))
}

/// [`same_host_engines`], a patterned source of [`ENTRIES`] blocks mapped
/// by the owner and a zeroed destination of as many mapped by the consumer.
async fn mapped_engines() -> (
    UcxEngine,
    UcxEngine,
    PageBuf,
    PageBuf,
    BackendRegion,
    BackendRegion,
) {
    let (owner, consumer) = same_host_engines();
    let src = PageBuf::filled(ENTRIES * BLOCK, pattern);
    let dst = PageBuf::zeroed(ENTRIES * BLOCK);
    let src_region = map(&owner.backend(), &src).await;
    let dst_region = map(&consumer.backend(), &dst).await;
    (owner, consumer, src, dst, src_region, dst_region)
}

/// A list of [`ENTRIES`] blocks: entry `i` reads source block
/// `i * stride mod ENTRIES` (`stride` odd, so coprime with `ENTRIES`) into
/// block `i` of `dst`.
fn list(source: &Descriptor, dst: &BackendRegion, stride: usize) -> Arc<[BackendGet]> {
    (0..ENTRIES)
        .map(|i| {
            let block = source
                .slice(((i * stride % ENTRIES) * BLOCK) as u64, BLOCK as u64)
                .expect("inside the descriptor");
            get_request(
                OWNER,
                &block,
                dst,
                (i * BLOCK) as u64,
                Some(Duration::from_secs(1)),
            )
        })
        .collect()
}

/// Whether every block of `dst` holds the source block a list of `stride`
/// reads into it.
fn landed(dst: &PageBuf, src: &PageBuf, stride: usize) -> bool {
    let (got, want) = (dst.snapshot(), src.snapshot());
    (0..ENTRIES).all(|i| {
        let from = (i * stride % ENTRIES) * BLOCK;
        got[i * BLOCK..(i + 1) * BLOCK] == want[from..from + BLOCK]
    })
}

async fn post_shared(consumer: &UcxEngine, list: &Arc<[BackendGet]>) -> Vec<Result<(), RdmaError>> {
    consumer
        .backend()
        .get_shared_batch_into_test_memory(Arc::clone(list))
        .await
}

/// Posts `list` shared and checks every entry answered `Ok`.
async fn post_shared_landing_every_entry(
    consumer: &UcxEngine,
    list: &Arc<[BackendGet]>,
    what: &str,
) {
    assert_eq!(
        post_shared(consumer, list).await,
        vec![Ok(()); ENTRIES],
        "{what}"
    );
}

async fn post_fresh(consumer: &UcxEngine, list: &Arc<[BackendGet]>) -> Vec<Result<(), RdmaError>> {
    consumer
        .backend()
        .get_batch_into_test_memory(list.to_vec())
        .await
}

async fn shut_down(owner: UcxEngine, consumer: UcxEngine) {
    consumer.shutdown().await;
    owner.shutdown().await;
    assert_eq!(consumer.live_registrations(), Some(0));
    assert_eq!(owner.live_registrations(), Some(0));
}

/// A planned list whose destination was unmapped and then mapped again
/// over the very same memory (same pointer and length, a new registration
/// id) is refused `RegionNotFound` on every entry, exactly as a fresh batch
/// of its requests is, and writes nothing into that memory: the plan's raw
/// destination pointers are still valid memory, but the registration they
/// were checked against is gone. A list naming the new registration lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planned_list_whose_destination_was_mapped_again_at_the_same_address_is_refused_as_a_fresh_batch_is()
 {
    let (owner, consumer, src, dst, src_region, dst_region) = mapped_engines().await;
    let source = describe(&src, &src_region);
    let requests = list(&source, &dst_region, 7);
    for post in 1..=2 {
        dst.fill(0);
        post_shared_landing_every_entry(&consumer, &requests, &format!("post {post}")).await;
        assert!(landed(&dst, &src, 7), "post {post}");
    }
    assert_eq!(consumer.lists_copied_by_plan(), 2);

    let backend = consumer.backend();
    assert_eq!(backend.unmap(dst_region.backend_region_id).await, Ok(()));
    let again = map(&backend, &dst).await;
    assert_ne!(again.backend_region_id, dst_region.backend_region_id);

    dst.fill(0xAB);
    let planned = post_shared(&consumer, &requests).await;
    assert_eq!(
        dst.snapshot(),
        vec![0xAB; ENTRIES * BLOCK],
        "a planned list wrote into memory its registration no longer covers"
    );
    let fresh = post_fresh(&consumer, &requests).await;
    assert_eq!(fresh, vec![Err(RdmaError::RegionNotFound); ENTRIES]);
    assert_eq!(
        planned, fresh,
        "the planned list answered otherwise than a fresh batch"
    );
    assert_eq!(dst.snapshot(), vec![0xAB; ENTRIES * BLOCK]);
    assert_eq!(consumer.lists_copied_by_plan(), 2);

    let renamed = list(&source, &again, 7);
    post_shared_landing_every_entry(&consumer, &renamed, "the post").await;
    assert!(
        landed(&dst, &src, 7),
        "the list naming the new registration"
    );
    assert_eq!(consumer.lists_copied_by_plan(), 3);
    shut_down(owner, consumer).await;
    drop((src, dst));
}

/// Makes source block `block` of `src` unreadable (`PROT_NONE`) or
/// readable again, so the kernel's copy of it fails with `EFAULT`.
fn set_block_readable(src: &PageBuf, block: usize, readable: bool) {
    let prot = if readable {
        libc::PROT_READ | libc::PROT_WRITE
    } else {
        libc::PROT_NONE
    };
    // SAFETY: the range is one whole page-aligned page inside `src`'s live
    // allocation; while it is `PROT_NONE` nothing in this test reads it
    // (only the kernel's copy, which fails), and it is made readable and
    // writable again before `src` is read or freed.
    let rc = unsafe {
        libc::mprotect(
            (src.addr() + block * BLOCK) as *mut libc::c_void,
            BLOCK,
            prot,
        )
    };
    assert_eq!(rc, 0, "mprotect: {}", std::io::Error::last_os_error());
}

/// A planned list whose copy fails for one entry (its source page made
/// unreadable in the owner) answers exactly as a fresh batch of its
/// requests does: that entry fails, every other entry lands, and the post
/// is not counted as copied by the plan. Once the page reads again, the
/// list is planned and copied by its plan again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planned_list_whose_copy_fails_for_one_entry_answers_as_a_fresh_batch_and_is_planned_again()
 {
    let (owner, consumer, src, dst, src_region, dst_region) = mapped_engines().await;
    let requests = list(&describe(&src, &src_region), &dst_region, 7);
    post_shared_landing_every_entry(&consumer, &requests, "the post").await;
    assert_eq!(consumer.lists_copied_by_plan(), 1);

    // Entry 5 reads source block 35, in the middle of the owner's order.
    let (entry, block) = (5, 5 * 7 % ENTRIES);
    set_block_readable(&src, block, false);
    dst.fill(0);
    let planned = post_shared(&consumer, &requests).await;
    let planned_dst = dst.snapshot();
    dst.fill(0);
    let fresh = post_fresh(&consumer, &requests).await;
    set_block_readable(&src, block, true);
    assert!(
        matches!(&fresh[entry], Err(RdmaError::Backend(message)) if message.contains("not mapped in the owner")),
        "the unreadable entry, fresh: {:?}",
        fresh[entry]
    );
    assert_eq!(
        fresh.iter().filter(|answer| answer.is_ok()).count(),
        ENTRIES - 1,
        "only the unreadable entry fails: {fresh:?}"
    );
    assert_eq!(
        planned, fresh,
        "the planned list answered otherwise than a fresh batch"
    );
    assert_eq!(
        consumer.lists_copied_by_plan(),
        1,
        "a post whose copy failed was counted as copied by its plan"
    );
    let want = src.snapshot();
    for i in (0..ENTRIES).filter(|&i| i != entry) {
        let from = (i * 7 % ENTRIES) * BLOCK;
        assert!(
            planned_dst[i * BLOCK..(i + 1) * BLOCK] == want[from..from + BLOCK],
            "entry {i} answered Ok but its block is not its source's"
        );
    }

    dst.fill(0);
    post_shared_landing_every_entry(&consumer, &requests, "the post").await;
    assert!(landed(&dst, &src, 7));
    assert_eq!(
        consumer.lists_copied_by_plan(),
        2,
        "the list was not planned again"
    );
    shut_down(owner, consumer).await;
    drop((src, dst));
}

/// Lists of one shape, each built after the one before was dropped, that
/// alternate between two destinations: each post lands in its own list's
/// destination and never in the other one, though a new list's allocation
/// may be the one a dropped list (whose plan the engine held) had.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_built_after_another_was_dropped_never_follows_the_dropped_lists_plan() {
    let (owner, consumer) = same_host_engines();
    let src = PageBuf::filled(ENTRIES * BLOCK, pattern);
    let dsts = [
        PageBuf::zeroed(ENTRIES * BLOCK),
        PageBuf::zeroed(ENTRIES * BLOCK),
    ];
    let src_region = map(&owner.backend(), &src).await;
    let dst_regions = [
        map(&consumer.backend(), &dsts[0]).await,
        map(&consumer.backend(), &dsts[1]).await,
    ];
    let source = describe(&src, &src_region);
    // Rounds 0 and 1 go into the first destination, 2 and 3 into the
    // second, and so on: a list's allocation is typically the one of the
    // list two rounds before, which went into the other destination.
    for round in 0..24 {
        let into = round / 2 % 2;
        let other = 1 - into;
        let requests = list(&source, &dst_regions[into], 7);
        dsts[into].fill(0);
        dsts[other].fill(0xCD);
        post_shared_landing_every_entry(&consumer, &requests, &format!("round {round}")).await;
        assert!(
            landed(&dsts[into], &src, 7),
            "round {round}: the list's destination"
        );
        assert_eq!(
            dsts[other].snapshot(),
            vec![0xCD; ENTRIES * BLOCK],
            "round {round}: a list wrote into another (dropped) list's destination"
        );
        drop(requests);
    }
    assert_eq!(consumer.lists_copied_by_plan(), 24);
    shut_down(owner, consumer).await;
    drop((src, dsts));
}

/// Two lists reading the same source into one destination in different
/// orders, posted in turn, each land their own order every time and are
/// each copied by their own plan: a post never follows the other list's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_lists_into_one_destination_posted_in_turn_each_follow_their_own_plan() {
    let (owner, consumer, src, dst, src_region, dst_region) = mapped_engines().await;
    let source = describe(&src, &src_region);
    let lists = [
        (7, list(&source, &dst_region, 7)),
        (3, list(&source, &dst_region, 3)),
    ];
    for round in 0..6 {
        let (stride, requests) = &lists[round % 2];
        dst.fill(0);
        post_shared_landing_every_entry(&consumer, requests, &format!("round {round}")).await;
        assert!(
            landed(&dst, &src, *stride),
            "round {round}: stride {stride}"
        );
    }
    assert_eq!(consumer.lists_copied_by_plan(), 6);
    shut_down(owner, consumer).await;
    drop((src, dst));
}

/// A planned list whose owner engine was shut down (its process, this
/// one, lives on, and so does the source memory) fails every entry and
/// lands nothing: a copy names the owner by its engine's thread, which is
/// gone, and the plan does not answer past that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planned_list_whose_owner_engine_was_shut_down_fails_every_entry_and_lands_nothing() {
    let (owner, consumer, src, dst, src_region, dst_region) = mapped_engines().await;
    let requests = list(&describe(&src, &src_region), &dst_region, 7);
    post_shared_landing_every_entry(&consumer, &requests, "the post").await;
    assert_eq!(consumer.lists_copied_by_plan(), 1);

    owner.shutdown().await;
    assert_eq!(owner.live_registrations(), Some(0));
    dst.fill(0);
    let answers = post_shared(&consumer, &requests).await;
    assert!(
        answers.iter().all(Result::is_err),
        "a list from a shut-down owner engine answered Ok: {:?}",
        answers.iter().find(|answer| answer.is_ok())
    );
    assert_eq!(
        dst.snapshot(),
        vec![0; ENTRIES * BLOCK],
        "a list from a shut-down owner engine landed bytes"
    );
    assert_eq!(consumer.lists_copied_by_plan(), 1);
    consumer.shutdown().await;
    assert_eq!(consumer.live_registrations(), Some(0));
    drop((src, dst));
}
