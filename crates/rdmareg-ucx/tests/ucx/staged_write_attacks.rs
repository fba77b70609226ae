//! Attacks on staged same-host PUTs: an entry of at least a page whose
//! source and target differ in page offset is first copied into the
//! writing thread's staging buffer at the target's page offset, and the
//! kernel copies from there (`progress::process_writes`, "Staging").
//!
//! The races of `direct_write_attacks` write page-aligned targets from
//! sources at the same page offset, so none of them stages. Here every
//! target or source is off by a few bytes within its page, over sizes
//! that fit one stage, overflow it by a byte, and span many stages; on
//! the caller's thread (64 KiB and less) and on the progress thread. What
//! must hold: the bytes land exactly where asked and nowhere else, from
//! several threads and engines at once, and none lands once an unmap
//! answered.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use common::write_races::*;
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{Access, BackendPut, RdmaError};
use rdmareg_ucx::{Transport, UcxBackend, UcxEngine};

/// Byte `i` of writer `seed`'s source: differs between writers and along
/// a source (no period divides a page), so a byte from the wrong place of
/// a stage, or from another thread's stage, shows.
fn seeded(seed: u8) -> impl Fn(usize) -> u8 {
    move |i| (i.wrapping_mul(31) ^ (i >> 9) ^ (seed as usize * 0x5B)) as u8 | 1
}

/// Panics naming the first byte of `buf` that differs from `want`.
fn assert_holds(buf: &PageBuf, want: &[u8], what: &str) {
    let got = buf.snapshot();
    if let Some(at) = got.iter().zip(want).position(|(g, w)| g != w) {
        panic!(
            "{what}: {} bytes differ, the first at offset {at} ({:#04x}, want {:#04x})",
            differing_bytes(&got, want),
            got[at],
            want[at]
        );
    }
}

/// Single PUTs from a source at one page offset into a target at another,
/// on both sides of the caller-thread limit and of the stage's 64 KiB
/// (4 KiB, 64 KiB, 64 KiB + 1, 200 KiB, 1 MiB + 17, several stages from
/// a source off by 4095). Each first lands exactly, the page around it
/// untouched; then two tasks PUT it in a loop while the owner unmaps the
/// target, overwrites it with a sentinel the instant the unmap answers
/// and registers it again (taking the release slot back). The old key
/// keeps writing through the stage; not one byte may reach the sentinel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_puts_land_exactly_and_never_after_an_unmap() {
    let (owner, consumer) = engines(Transport::SameHost);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let src = PageBuf::filled((1 << 20) + 3 * 4096, seeded(1));
    let src_region = map(&cb, &src).await;
    // (source offset, target offset, length)
    let cases = [
        (0, 16, 4096),
        (0, 100, 64 << 10),
        (0, 16, (64 << 10) + 1),
        (100, 0, 200 << 10),
        (0, 100, (1 << 20) + 17),
        (4095, 1, 5 * (68 << 10) + 5),
    ];
    for (iteration, &(src_off, tgt_off, len)) in cases.iter().cycle().take(18).enumerate() {
        let target = PageBuf::zeroed(tgt_off + len + 4096);
        let region = map_writable(&ob, &target, Access::Write).await;
        let key = region.packed_key.clone();
        let request = put_request(
            &src_region,
            src_off as u64,
            (target.addr() + tgt_off) as u64,
            key,
            len,
        );
        assert_eq!(put(&cb, request.clone()).await, Ok(()));
        let mut want = vec![0u8; target.len()];
        want[tgt_off..tgt_off + len].copy_from_slice(&src.snapshot()[src_off..src_off + len]);
        let what = format!("source +{src_off}, target +{tgt_off}, {len} bytes");
        assert_holds(&target, &want, &what);

        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicU64::new(0));
        let tasks: Vec<_> = (0..2)
            .map(|_| {
                let (cb, request) = (Arc::clone(&cb), request.clone());
                let (stop, done) = (Arc::clone(&stop), Arc::clone(&done));
                tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        let result = put(&cb, request.clone()).await;
                        assert!(
                            matches!(result, Ok(()) | Err(RdmaError::RegionNotFound)),
                            "{result:?}"
                        );
                        done.fetch_add(1, Ordering::Relaxed);
                        tokio::task::yield_now().await;
                    }
                })
            })
            .collect();
        until(
            || done.load(Ordering::Relaxed) >= 2,
            "PUTs before the unmap",
        )
        .await;
        pause_for(iteration).await;
        unmap_bounded(&ob, &region).await;
        target.fill(SENTINEL);
        let again = map_writable(&ob, &target, Access::Write).await;
        let seen = done.load(Ordering::Relaxed);
        until(
            || done.load(Ordering::Relaxed) >= seen + 8,
            "PUTs after the unmap",
        )
        .await;
        stop.store(true, Ordering::Relaxed);
        for task in tasks {
            task.await.expect("a PUT task ended cleanly");
        }
        assert_holds(&target, &vec![SENTINEL; target.len()], &what);
        unmap_bounded(&ob, &again).await;
    }
    assert!(
        consumer.writes_made_on_caller_threads() > 0,
        "no PUT was written on a caller's thread"
    );
    assert_eq!(cb.unmap(src_region.backend_region_id).await, Ok(()));
    consumer.shutdown().await;
    owner.shutdown().await;
    assert_eq!(owner.live_registrations(), Some(0));
    assert_eq!(consumer.live_registrations(), Some(0));
}

/// One range of the shared target: where it starts in the target, how
/// long it is, and where its bytes start in its writer's source.
#[derive(Clone, Copy)]
struct Range {
    at: usize,
    len: usize,
    src_off: usize,
}

/// Adjacent ranges from target offset 100 on, of sizes both sides of the
/// caller-thread limit and of a page, each from a source offset at another
/// page offset than its target's.
fn adjacent_ranges() -> Vec<Range> {
    let lens = [
        4096,
        65536,
        5000,
        (64 << 10) + 1,
        200 << 10,
        17,
        4096 + 3,
        60000,
        (1 << 20) + 17,
        12288,
        65535,
        9000,
    ];
    let mut at = 100;
    lens.iter()
        .enumerate()
        .map(|(i, &len)| {
            let range = Range {
                at,
                len,
                src_off: (at + 8 * i + 1) % 4096,
            };
            at += len;
            range
        })
        .collect()
}

/// Two consumer engines in the owner's process, and several tasks of
/// each, PUT adjacent ranges of one target at once, every range from a
/// source of its own pattern at a page offset other than its target's:
/// each range is staged, small ones on the tasks' threads (whose stages
/// are their own) and large ones on each engine's progress thread, over
/// and over. Every range must hold exactly its source's bytes, and the
/// bytes before the first and after the last must stay zero.
#[test]
fn concurrent_staged_puts_land_exactly_side_by_side() {
    init_tracing();
    let owner = UcxEngine::start(config(Transport::SameHost)).expect("owner starts");
    let consumers: Vec<UcxEngine> = (0..2)
        .map(|_| {
            let consumer = UcxEngine::start(config(Transport::SameHost)).expect("consumer starts");
            consumer
                .add_peer(OWNER, owner.worker_address())
                .expect("the owner is known");
            consumer
        })
        .collect();
    let runtime = runtime();
    let ob = owner.backend();
    let ranges = adjacent_ranges();
    let end = ranges.last().map_or(0, |r| r.at + r.len);
    let target = PageBuf::zeroed(end + 4096);
    let region = runtime.block_on(map_writable(&ob, &target, Access::Write));
    // One source per range, so that a byte from another range's stage
    // shows.
    let sources: Vec<PageBuf> = ranges
        .iter()
        .enumerate()
        .map(|(i, r)| PageBuf::filled(r.src_off + r.len, seeded(i as u8 + 2)))
        .collect();
    let mut want = vec![0u8; target.len()];
    for (range, source) in ranges.iter().zip(&sources) {
        want[range.at..range.at + range.len]
            .copy_from_slice(&source.snapshot()[range.src_off..range.src_off + range.len]);
    }
    runtime.block_on(async {
        let mut tasks = Vec::new();
        let mut source_regions = Vec::new();
        for (i, (range, source)) in ranges.iter().zip(&sources).enumerate() {
            let backend = consumers[i % 2].backend();
            let source_region = map(&backend, source).await;
            let request = put_request(
                &source_region,
                range.src_off as u64,
                (target.addr() + range.at) as u64,
                region.packed_key.clone(),
                range.len,
            );
            source_regions.push((Arc::clone(&backend), source_region));
            tasks.push(tokio::spawn(async move {
                for _ in 0..12 {
                    assert_eq!(put(&backend, request.clone()).await, Ok(()));
                    tokio::task::yield_now().await;
                }
            }));
        }
        // A plain thread PUTs the small ranges too, outside the runtime.
        let small: Vec<(Arc<UcxBackend>, BackendPut)> = ranges
            .iter()
            .zip(&source_regions)
            .filter(|(range, _)| range.len <= 64 << 10)
            .map(|(range, (backend, source_region))| {
                let request = put_request(
                    source_region,
                    range.src_off as u64,
                    (target.addr() + range.at) as u64,
                    region.packed_key.clone(),
                    range.len,
                );
                (Arc::clone(backend), request)
            })
            .collect();
        let handle = tokio::runtime::Handle::current();
        let thread = std::thread::spawn(move || {
            for _ in 0..12 {
                for (backend, request) in &small {
                    assert_eq!(handle.block_on(put(backend, request.clone())), Ok(()));
                }
            }
        });
        for task in tasks {
            task.await.expect("a PUT task ended cleanly");
        }
        thread.join().expect("the PUT thread ended cleanly");
        for (backend, source_region) in source_regions {
            assert_eq!(backend.unmap(source_region.backend_region_id).await, Ok(()));
        }
    });
    assert_holds(&target, &want, "adjacent staged ranges");
    assert!(
        consumers
            .iter()
            .all(|consumer| consumer.writes_made_on_caller_threads() > 0),
        "each engine wrote on a caller's thread"
    );
    runtime.block_on(async {
        unmap_bounded(&ob, &region).await;
        for consumer in &consumers {
            consumer.shutdown().await;
            assert_eq!(consumer.live_registrations(), Some(0));
        }
        owner.shutdown().await;
    });
    assert_eq!(owner.live_registrations(), Some(0));
}

/// Batches whose live entries are each staged (every target at its own
/// page offset, the source page-aligned), several to a stage and more
/// than a stage in all, between entries of stale keys: a batch first
/// lands its live entries exactly and refuses the stale ones; then, raced
/// against the live registration's unmap, no byte lands in it once the
/// unmap answered, and the stale ones never change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_batches_skip_stale_keys_and_stop_at_the_unmap() {
    let (owner, consumer) = engines(Transport::SameHost);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let src = PageBuf::filled(256 << 10, seeded(9));
    let src_region = map(&cb, &src).await;
    let stale: Vec<PageBuf> = (0..2).map(|_| PageBuf::zeroed(3 * 4096)).collect();
    let mut stale_keys = Vec::new();
    for buf in &stale {
        let region = map_writable(&ob, buf, Access::Write).await;
        stale_keys.push((buf.addr() as u64, region.packed_key.clone()));
        unmap_bounded(&ob, &region).await;
        buf.fill(SENTINEL);
    }
    // Entry lengths of one batch: a few fit one stage together, the last
    // two need a stage each.
    let batches: [&[usize]; 3] = [
        &[5000, 4096, 20000, 9000, 30000],
        &[4097, 70000, 6000, 65536],
        &[12345, 4096, 4096, 4096, 4096, 4096, 4096, 40000, 100_000],
    ];
    for (iteration, lens) in batches.iter().cycle().take(24).enumerate() {
        let total: usize = lens.iter().map(|len| len + 4096).sum();
        let live = PageBuf::zeroed(total);
        let region = map_writable(&ob, &live, Access::Write).await;
        let mut want = vec![0u8; live.len()];
        let mut requests = Vec::new();
        let (mut at, mut from) = (0, 0);
        for (i, &len) in lens.iter().enumerate() {
            // Each target 37 bytes further into its page than the last;
            // each source page-aligned.
            let tgt = at + 16 + 37 * i;
            requests.push(put_request(
                &src_region,
                from as u64,
                (live.addr() + tgt) as u64,
                region.packed_key.clone(),
                len,
            ));
            want[tgt..tgt + len].copy_from_slice(&src.snapshot()[from..from + len]);
            let (addr, key) = &stale_keys[i % stale_keys.len()];
            requests.push(put_request(&src_region, 0, addr + 100, key.clone(), 8000));
            at += len + 4096;
            from = (from + len).next_multiple_of(4096) % (128 << 10);
        }
        // SAFETY: as in `put`: the sources are `src`, alive until the
        // batch answered.
        let results = unsafe { cb.put_batch(requests.clone()) }.await;
        for (at, result) in results.iter().enumerate() {
            let expected = if at % 2 == 0 {
                Ok(())
            } else {
                Err(RdmaError::RegionNotFound)
            };
            assert_eq!(*result, expected, "entry {at} of the first batch");
        }
        assert_holds(&live, &want, &format!("batch {lens:?}"));

        // SAFETY: the sources lie in `src`, which outlives the race.
        let race = unsafe { BatchRace::start(&cb, requests.clone()) };
        until(|| race.batches() >= 1, "a racing batch").await;
        pause_for(iteration).await;
        unmap_bounded(&ob, &region).await;
        live.fill(SENTINEL);
        race.wait_for(3, "batches after the unmap").await;
        race.stop().await;
        assert_holds(
            &live,
            &vec![SENTINEL; live.len()],
            &format!("batch {lens:?}"),
        );
        for buf in &stale {
            assert_holds(buf, &vec![SENTINEL; buf.len()], "a stale registration");
        }
    }
    assert_eq!(cb.unmap(src_region.backend_region_id).await, Ok(()));
    consumer.shutdown().await;
    owner.shutdown().await;
    assert_eq!(owner.live_registrations(), Some(0));
    assert_eq!(consumer.live_registrations(), Some(0));
}
