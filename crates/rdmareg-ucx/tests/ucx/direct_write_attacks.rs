//! Attacks on the same-host direct lane for writes: PUTs copied into the
//! owner's process under its release table's lock, raced against the
//! owner's unmaps, re-registrations of the same memory (which reuse the
//! release slot), peer churn and shutdowns, and keys altered to name
//! memory or access the owner never granted.
//!
//! The promise under attack: once an unmap answered `Ok`, no byte lands in
//! the memory by any path (the progress thread's PUT, a batch, a PUT
//! written on the caller's thread), and a key the owner did not issue as
//! it is never writes. Each race test overwrites the memory with a
//! sentinel right after the unmap's `Ok` and keeps PUTting with the old
//! key; a single byte of the pattern found afterwards is a write that
//! outlived its unmap.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::write_races::*;
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{Access, BackendPut, BackendRegion, RdmaError};
use rdmareg_ucx::read_protocol::SameHostKey;
use rdmareg_ucx::{Transport, UcxBackend, UcxEngine};

/// Whether `buf` holds nothing but the sentinel; panics naming the first
/// byte that is not, with what the test was doing.
fn assert_untouched(buf: &PageBuf, what: &str) {
    let snapshot = buf.snapshot();
    if let Some(at) = snapshot.iter().position(|&b| b != SENTINEL) {
        let written = snapshot.iter().filter(|&&b| b != SENTINEL).count();
        panic!(
            "{what}: {written} bytes written after the unmap answered, the first at offset {at} ({:#04x})",
            snapshot[at]
        );
    }
}

/// PUT tasks looping on one key until told to stop; what they saw.
struct Writers {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    landed: Arc<AtomicU64>,
    refused: Arc<AtomicU64>,
}

impl Writers {
    fn new() -> Writers {
        Writers {
            stop: Arc::new(AtomicBool::new(false)),
            tasks: Vec::new(),
            landed: Arc::new(AtomicU64::new(0)),
            refused: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Starts a task PUTting `request` again and again on `backend`;
    /// `allowed` says which errors it may meet (anything else fails the
    /// test).
    fn spawn(
        &mut self,
        backend: Arc<UcxBackend>,
        request: BackendPut,
        allowed: fn(&RdmaError) -> bool,
    ) {
        let (stop, landed, refused) = (
            Arc::clone(&self.stop),
            Arc::clone(&self.landed),
            Arc::clone(&self.refused),
        );
        self.tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                match put(&backend, request.clone()).await {
                    Ok(()) => {
                        landed.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(err) if allowed(&err) => {
                        refused.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(err) => panic!("a PUT failed with {err:?}"),
                }
                // PUTs written on this thread complete at once: let the
                // task that unmaps run.
                tokio::task::yield_now().await;
            }
        }));
    }

    /// Waits until every task made at least a few more PUTs: the stale
    /// key was tried after the unmap.
    async fn let_stale_puts_run(&self) {
        let seen = self.landed.load(Ordering::Relaxed) + self.refused.load(Ordering::Relaxed);
        let until = Instant::now() + Duration::from_secs(2);
        while self.landed.load(Ordering::Relaxed) + self.refused.load(Ordering::Relaxed)
            < seen + 4 * self.tasks.len() as u64
            && Instant::now() < until
        {
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    }

    /// Waits until `count` PUTs landed: the unmap then races running ones.
    async fn until_landed(&self, count: u64) {
        let until = Instant::now() + UNMAP_BOUND;
        while self.landed.load(Ordering::Relaxed) < count {
            assert!(
                Instant::now() < until,
                "PUTs into a live registration never landed"
            );
            tokio::task::yield_now().await;
        }
    }

    async fn stop(self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            task.await.expect("a PUT task ended cleanly");
        }
        (
            self.landed.load(Ordering::Relaxed),
            self.refused.load(Ordering::Relaxed),
        )
    }
}

fn only_released(err: &RdmaError) -> bool {
    *err == RdmaError::RegionNotFound
}

/// The race at the heart of the lane, over sizes on both sides of the
/// caller-thread limit (64 KiB: at or below it a PUT is written on the
/// caller's thread, above it on the progress thread): two tasks PUT the
/// pattern into a registration in a loop while the owner unmaps it at a
/// varying moment, overwrites the memory with a sentinel the instant the
/// unmap answers, and registers the same memory again, which takes the
/// same release slot back. The old key keeps writing into a slot that
/// names a new registration; not one byte may reach the sentinel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_put_lands_after_its_unmap_answered_even_when_the_slot_is_reused() {
    let (owner, consumer) = engines(Transport::SameHost);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let sizes = [4096, 65535, 65536, 65537, 256 << 10];
    let src = PageBuf::filled(256 << 10, pattern);
    let src_region = map(&cb, &src).await;
    let mut reused = 0;
    let mut landed_total = 0;
    for (iteration, &size) in sizes.iter().cycle().take(100).enumerate() {
        let target = PageBuf::zeroed(size);
        let region = map_writable(&ob, &target, Access::Write).await;
        let key = region.packed_key.clone();
        let mut writers = Writers::new();
        for task in 0..2u64 {
            // The second task writes the last half, the first all of it.
            let (offset, len) = if task == 0 {
                (0, size)
            } else {
                (size as u64 / 2, size - size / 2)
            };
            let request = put_request(
                &src_region,
                offset,
                target.addr() as u64 + offset,
                key.clone(),
                len,
            );
            writers.spawn(Arc::clone(&cb), request, only_released);
        }
        // Some PUTs land before the unmap, so that it races running ones.
        writers.until_landed(2).await;
        pause_for(iteration).await;
        unmap_bounded(&ob, &region).await;
        target.fill(SENTINEL);
        let again = map_writable(&ob, &target, Access::Write).await;
        if same_host_key(&again.packed_key).release_slot == same_host_key(&key).release_slot {
            reused += 1;
        }
        writers.let_stale_puts_run().await;
        let (landed, refused) = writers.stop().await;
        landed_total += landed;
        assert!(refused > 0, "size {size}: the stale key was refused");
        assert_untouched(&target, &format!("iteration {iteration}, size {size}"));
        unmap_bounded(&ob, &again).await;
    }
    assert!(reused > 0, "no re-registration took the old slot back");
    assert!(landed_total > 0);
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

/// Two consumer engines in the owner's own process, each with its own view
/// of the release table (so locks of two open file descriptions), PUT into
/// two registrations side by side while a plain thread, not an async
/// task, unmaps them in turns; the caller-thread and progress-thread
/// paths of both run at once. Each region is overwritten with the sentinel
/// as soon as its unmap answered.
#[test]
fn writers_of_two_consumer_engines_never_outlive_an_unmap() {
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
    let src = PageBuf::filled(128 << 10, pattern);
    let src_regions: Vec<BackendRegion> = consumers
        .iter()
        .map(|consumer| runtime.block_on(map(&consumer.backend(), &src)))
        .collect();
    for (iteration, size) in [8192usize, 65536, 128 << 10]
        .into_iter()
        .cycle()
        .take(40)
        .enumerate()
    {
        let targets = [PageBuf::zeroed(size), PageBuf::zeroed(size)];
        let regions: Vec<BackendRegion> = targets
            .iter()
            .map(|target| runtime.block_on(map_writable(&ob, target, Access::ReadWrite)))
            .collect();
        let writers = runtime.block_on(async {
            let mut writers = Writers::new();
            for (consumer, src_region) in consumers.iter().zip(&src_regions) {
                for (target, region) in targets.iter().zip(&regions) {
                    let request = put_request(
                        src_region,
                        0,
                        target.addr() as u64,
                        region.packed_key.clone(),
                        size,
                    );
                    writers.spawn(consumer.backend(), request, only_released);
                }
            }
            writers.until_landed(4).await;
            writers
        });
        for (target, region) in targets.iter().zip(&regions) {
            if iteration % 2 == 1 {
                std::thread::sleep(Duration::from_micros(100));
            }
            runtime.block_on(unmap_bounded(&ob, region));
            target.fill(SENTINEL);
        }
        runtime.block_on(async {
            writers.let_stale_puts_run().await;
            writers.stop().await
        });
        for (at, target) in targets.iter().enumerate() {
            assert_untouched(target, &format!("iteration {iteration}, target {at}"));
        }
    }
    runtime.block_on(async {
        for (consumer, src_region) in consumers.iter().zip(&src_regions) {
            assert_eq!(
                consumer.backend().unmap(src_region.backend_region_id).await,
                Ok(())
            );
            consumer.shutdown().await;
            assert_eq!(consumer.live_registrations(), Some(0));
        }
        owner.shutdown().await;
    });
    assert_eq!(owner.live_registrations(), Some(0));
}

/// Batches that mix a live registration and stale ones, three times over
/// (so one batch locks the same slot for several PUTs), raced against the
/// live one's unmap: every PUT of a stale key fails `RegionNotFound`, the
/// memory of the stale ones (holding the sentinel since their unmap)
/// never changes, and neither does the live one's once its own unmap
/// answered. Batches of at most 64 KiB in all and larger ones both run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_mixing_live_and_stale_keys_never_write_a_released_registration() {
    let (owner, consumer) = engines(Transport::SameHost);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let src = PageBuf::filled(96 << 10, pattern);
    let src_region = map(&cb, &src).await;
    // Registrations unmapped before any batch: their keys are stale.
    let stale: Vec<PageBuf> = (0..2).map(|_| PageBuf::zeroed(8192)).collect();
    let mut stale_keys = Vec::new();
    for buf in &stale {
        let region = map_writable(&ob, buf, Access::Write).await;
        stale_keys.push((buf.addr() as u64, region.packed_key.clone()));
        unmap_bounded(&ob, &region).await;
        buf.fill(SENTINEL);
    }
    for (iteration, piece) in [4096usize, 16 << 10, 32 << 10]
        .into_iter()
        .cycle()
        .take(48)
        .enumerate()
    {
        let live = PageBuf::zeroed(3 * piece);
        let region = map_writable(&ob, &live, Access::Write).await;
        let mut requests = Vec::new();
        for block in 0..3u64 {
            requests.push(put_request(
                &src_region,
                block * piece as u64,
                live.addr() as u64 + block * piece as u64,
                region.packed_key.clone(),
                piece,
            ));
            let (addr, key) = &stale_keys[block as usize % stale_keys.len()];
            requests.push(put_request(&src_region, 0, *addr, key.clone(), 4096));
        }
        // SAFETY: the sources are `src`, alive until the race stopped.
        let race = unsafe { BatchRace::start(&cb, requests) };
        until(|| race.batches() >= 1, "a first batch").await;
        pause_for(iteration).await;
        unmap_bounded(&ob, &region).await;
        live.fill(SENTINEL);
        race.wait_for(3, "batches after the unmap").await;
        race.stop().await;
        assert_untouched(&live, &format!("iteration {iteration}, pieces of {piece}"));
        for buf in &stale {
            assert_untouched(buf, "a registration unmapped before every batch");
        }
    }
    assert_eq!(cb.unmap(src_region.backend_region_id).await, Ok(()));
    consumer.shutdown().await;
    owner.shutdown().await;
    assert_eq!(owner.live_registrations(), Some(0));
    assert_eq!(consumer.live_registrations(), Some(0));
}

/// The consumer forgets the owner and learns it again in a loop (each time
/// withdrawing and republishing the owner's process, and with it the
/// release-table view its writers lock), while PUTs run and the owner
/// unmaps: PUTs may fail for the missing peer, but none lands after the
/// unmap answered, and nothing hangs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_churn_never_lets_a_put_outlive_its_unmap() {
    let (owner, consumer) = engines(Transport::SameHost);
    let consumer = Arc::new(consumer);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let address = owner.worker_address();
    let src = PageBuf::filled(128 << 10, pattern);
    let src_region = map(&cb, &src).await;
    for (iteration, size) in [4096usize, 65536, 128 << 10]
        .into_iter()
        .cycle()
        .take(40)
        .enumerate()
    {
        let target = PageBuf::zeroed(size);
        let region = map_writable(&ob, &target, Access::Write).await;
        let mut writers = Writers::new();
        for _ in 0..2 {
            let request = put_request(
                &src_region,
                0,
                target.addr() as u64,
                region.packed_key.clone(),
                size,
            );
            // Any typed error while the peer is away; the bytes decide.
            writers.spawn(Arc::clone(&cb), request, |_| true);
        }
        let churn_stop = Arc::new(AtomicBool::new(false));
        let churn = {
            let (consumer, address, stop) = (
                Arc::clone(&consumer),
                address.clone(),
                Arc::clone(&churn_stop),
            );
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    consumer.remove_peer(OWNER).expect("removed");
                    tokio::task::yield_now().await;
                    consumer.add_peer(OWNER, address.clone()).expect("added");
                    tokio::time::sleep(Duration::from_micros(200)).await;
                }
            })
        };
        pause_for(iteration).await;
        tokio::time::sleep(Duration::from_millis(1)).await;
        unmap_bounded(&ob, &region).await;
        target.fill(SENTINEL);
        writers.let_stale_puts_run().await;
        churn_stop.store(true, Ordering::Relaxed);
        churn.await.expect("the churn task ended cleanly");
        writers.stop().await;
        assert_untouched(&target, &format!("iteration {iteration}, size {size}"));
    }
    assert_eq!(cb.unmap(src_region.backend_region_id).await, Ok(()));
    consumer.shutdown().await;
    owner.shutdown().await;
    assert_eq!(owner.live_registrations(), Some(0));
    assert_eq!(consumer.live_registrations(), Some(0));
}

/// The owner's engine shuts down while PUTs into two of its registrations
/// (one at most 64 KiB, one larger) run; its teardown is their unmap.
/// Once `shutdown` returned the memory holds the sentinel, and PUTs with
/// the old keys (now to an engine that is gone) never change it. Every
/// registration is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_shutting_down_mid_put_lets_no_write_through_after_it() {
    for round in 0..4 {
        let (owner, consumer) = engines(Transport::SameHost);
        let (ob, cb) = (owner.backend(), consumer.backend());
        let src = PageBuf::filled(192 << 10, pattern);
        let src_region = map(&cb, &src).await;
        let targets = [PageBuf::zeroed(64 << 10), PageBuf::zeroed(192 << 10)];
        let mut writers = Writers::new();
        for target in &targets {
            let region = map_writable(&ob, target, Access::Write).await;
            for _ in 0..2 {
                let request = put_request(
                    &src_region,
                    0,
                    target.addr() as u64,
                    region.packed_key.clone(),
                    target.len(),
                );
                writers.spawn(Arc::clone(&cb), request, |_| true);
            }
        }
        writers.until_landed(4).await;
        pause_for(round).await;
        tokio::time::timeout(UNMAP_BOUND, owner.shutdown())
            .await
            .expect("the owner's shutdown answers");
        for target in &targets {
            target.fill(SENTINEL);
        }
        assert_eq!(owner.live_registrations(), Some(0));
        writers.let_stale_puts_run().await;
        writers.stop().await;
        for target in &targets {
            assert_untouched(target, &format!("round {round}, {} bytes", target.len()));
        }
        assert_eq!(cb.unmap(src_region.backend_region_id).await, Ok(()));
        consumer.shutdown().await;
        assert_eq!(consumer.live_registrations(), Some(0));
    }
}

/// The consumer's engine shuts down while its PUTs run; afterwards the
/// owner unmaps at once (no writer is left to wait for), and nothing of
/// the consumer's reaches the sentinel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_shutting_down_mid_put_holds_no_unmap_up() {
    for round in 0..4 {
        let (owner, consumer) = engines(Transport::SameHost);
        let (ob, cb) = (owner.backend(), consumer.backend());
        let src = PageBuf::filled(128 << 10, pattern);
        let src_region = map(&cb, &src).await;
        let targets = [PageBuf::zeroed(32 << 10), PageBuf::zeroed(128 << 10)];
        let mut regions = Vec::new();
        let mut writers = Writers::new();
        for target in &targets {
            let region = map_writable(&ob, target, Access::Write).await;
            let request = put_request(
                &src_region,
                0,
                target.addr() as u64,
                region.packed_key.clone(),
                target.len(),
            );
            writers.spawn(Arc::clone(&cb), request, |_| true);
            regions.push(region);
        }
        writers.until_landed(2).await;
        pause_for(round).await;
        consumer.shutdown().await;
        assert_eq!(consumer.live_registrations(), Some(0));
        for (target, region) in targets.iter().zip(&regions) {
            unmap_bounded(&ob, region).await;
            target.fill(SENTINEL);
        }
        writers.let_stale_puts_run().await;
        writers.stop().await;
        for target in &targets {
            assert_untouched(target, &format!("round {round}, {} bytes", target.len()));
        }
        drop(src_region);
        owner.shutdown().await;
        assert_eq!(owner.live_registrations(), Some(0));
    }
}

/// splitmix64's finaliser, as an earlier release tag mixed a writable
/// key's fields: tag = mix(mix(mix(base ^ addr) ^ len) ^ access).
fn mix(mut word: u64) -> u64 {
    word = (word ^ (word >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    word = (word ^ (word >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    word ^ (word >> 31)
}

/// The inverse of `x ^= x >> shift`.
fn unshift(mut word: u64, shift: u32) -> u64 {
    let mut result = word;
    for _ in 0..64 / shift {
        word >>= shift;
        result ^= word;
    }
    result
}

/// The inverse of multiplying by an odd `factor` modulo 2^64 (Newton's
/// iteration, each step doubling the correct low bits).
fn inverse(factor: u64) -> u64 {
    let mut x = factor;
    for _ in 0..6 {
        x = x.wrapping_mul(2u64.wrapping_sub(factor.wrapping_mul(x)));
    }
    x
}

/// The inverse of [`mix`].
fn unmix(mut word: u64) -> u64 {
    word = unshift(word, 31);
    word = unshift(word.wrapping_mul(inverse(0x94d0_49bb_1331_11eb)), 27);
    unshift(word.wrapping_mul(inverse(0xbf58_476d_1ce4_e5b9)), 30)
}

/// `key` moved to claim the range starting at `region_addr` with
/// `access`, and as long as it takes to keep the key's release tag under
/// the mix above (which the tag of a lane-2 key, its served part's, is
/// kept under too); `None` if that range does not fit the address space.
fn forged_to_keep_the_tag(
    key: &SameHostKey,
    region_addr: u64,
    access: Access,
) -> Option<SameHostKey> {
    let (tag, base) = (key.release_tag(), key.served.release_tag());
    // Undo the last two rounds from the tag the slot holds, then pick the
    // length that lands the chosen start on it.
    let before_access = unmix(tag) ^ u64::from(access.to_bits());
    let region_len = unmix(before_access) ^ mix(base ^ region_addr);
    region_addr.checked_add(region_len)?;
    let mut forged = key.clone();
    forged.region_addr = region_addr;
    forged.region_len = region_len;
    forged.access = access;
    Some(forged)
}

/// A key altered on purpose, not by accident: its range moved onto memory
/// beside the registration, or a read-only key turned writable, with the
/// length solved for so that the release tag stays what the slot holds
/// (as it did while the tag was an invertible mix of the fields: whoever
/// holds a key knows every input). Such a key was never issued; a PUT
/// through it must write nothing, on the caller's thread (4 KiB) or the
/// progress thread (128 KiB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_forged_to_keep_its_release_tag_writes_nothing() {
    let (owner, consumer) = engines(Transport::SameHost);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let beside = PageBuf::zeroed(128 << 10);
    beside.fill(SENTINEL);
    let writable = PageBuf::zeroed(4096);
    let readable = PageBuf::zeroed(128 << 10);
    readable.fill(SENTINEL);
    let src = PageBuf::filled(128 << 10, pattern);
    let src_region = map(&cb, &src).await;
    let writable_region = map_writable(&ob, &writable, Access::Write).await;
    let readable_region = map_writable(&ob, &readable, Access::Read).await;
    // A first PUT through the live key publishes the owner's process, so
    // that small PUTs are written on the caller's thread.
    let honest = put_request(
        &src_region,
        0,
        writable.addr() as u64,
        writable_region.packed_key.clone(),
        4096,
    );
    assert_eq!(put(&cb, honest).await, Ok(()));
    let cases = [
        (
            "a writable key moved beside its registration",
            same_host_key(&writable_region.packed_key),
            beside.addr() as u64,
            Access::Write,
        ),
        (
            "a read-only key made writable",
            same_host_key(&readable_region.packed_key),
            readable.addr() as u64,
            Access::ReadWrite,
        ),
    ];
    let mut answered = Vec::new();
    for (what, key, target, access) in cases {
        let forged = (0..64)
            .find_map(|step| forged_to_keep_the_tag(&key, target - step * 4096, access))
            .expect("a range keeping the tag");
        let packed = bytes::Bytes::from(forged.encode().expect("encodes"));
        for len in [4096, 128 << 10] {
            assert!(forged.covers(target, len as u64));
            let request = put_request(&src_region, 0, target, packed.clone(), len);
            let result = put(&cb, request).await;
            if result.is_ok() {
                answered.push(format!("{what}: a PUT of {len} bytes answered Ok"));
            }
        }
    }
    assert!(answered.is_empty(), "{answered:#?}");
    assert_untouched(&beside, "memory beside a writable registration");
    assert_untouched(&readable, "a read-only registration");
    assert_eq!(ob.unmap(writable_region.backend_region_id).await, Ok(()));
    assert_eq!(ob.unmap(readable_region.backend_region_id).await, Ok(()));
    assert_eq!(cb.unmap(src_region.backend_region_id).await, Ok(()));
    consumer.shutdown().await;
    owner.shutdown().await;
    assert_eq!(owner.live_registrations(), Some(0));
    assert_eq!(consumer.live_registrations(), Some(0));
}

/// One engine that knows itself as a peer PUTs into its own registrations:
/// its progress thread is both the writer (for PUTs above 64 KiB) and the
/// owner that waits for writers, and its callers write the small ones
/// while that thread unmaps. Its view of its own table is a second open
/// file description, so its writes' locks still hold its unmaps up; no
/// write lands after an unmap answered, and none deadlocks the thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_writing_into_its_own_registrations_never_outlives_an_unmap() {
    init_tracing();
    let engine = UcxEngine::start(config(Transport::SameHost)).expect("engine starts");
    engine
        .add_peer(OWNER, engine.worker_address())
        .expect("the engine knows itself");
    let backend = engine.backend();
    let src = PageBuf::filled(128 << 10, pattern);
    let src_region = map(&backend, &src).await;
    for (iteration, size) in [4096usize, 65536, 65537, 128 << 10]
        .into_iter()
        .cycle()
        .take(40)
        .enumerate()
    {
        let target = PageBuf::zeroed(size);
        let region = map_writable(&backend, &target, Access::ReadWrite).await;
        let mut writers = Writers::new();
        for _ in 0..2 {
            let request = put_request(
                &src_region,
                0,
                target.addr() as u64,
                region.packed_key.clone(),
                size,
            );
            writers.spawn(Arc::clone(&backend), request, only_released);
        }
        writers.until_landed(2).await;
        pause_for(iteration).await;
        unmap_bounded(&backend, &region).await;
        target.fill(SENTINEL);
        writers.let_stale_puts_run().await;
        let (_, refused) = writers.stop().await;
        assert!(refused > 0, "size {size}: the stale key was refused");
        assert_untouched(&target, &format!("iteration {iteration}, size {size}"));
    }
    assert!(
        engine.writes_made_on_caller_threads() > 0,
        "no PUT went over the direct lane"
    );
    assert_eq!(backend.unmap(src_region.backend_region_id).await, Ok(()));
    engine.shutdown().await;
    assert_eq!(engine.live_registrations(), Some(0));
}

/// Bytes one `process_vm_writev` writes at most (Linux's `MAX_RW_COUNT`,
/// 2 GiB less a page): the kernel stops a call there without an error.
const MOST_BYTES_PER_CALL: usize = (1 << 31) - 4096;

/// A PUT larger than one system call can write: the kernel writes the
/// first 2 GiB less a page and returns a short count, as if it had met an
/// unmapped byte. The rest must be written by a next call, not reported
/// as "not mapped in the owner" with most of the range already written.
/// Needs about 2 GiB of memory (the source's pages are never touched but
/// the last), so it runs only when asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "writes 2 GiB; run with --ignored"]
async fn a_put_larger_than_one_system_call_lands_whole() {
    let (owner, consumer) = engines(Transport::SameHost);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let size = MOST_BYTES_PER_CALL + 3 * 4096;
    let target = PageBuf::zeroed(size);
    // Zero pages but the last, which the first call cannot reach.
    let src = PageBuf::zeroed(size);
    let tail = size - 4096;
    // SAFETY: the last page of `src`, which nothing else refers to yet.
    unsafe { std::ptr::write_bytes((src.addr() + tail) as *mut u8, 0xA5, 4096) };
    let region = map_writable(&ob, &target, Access::Write).await;
    let src_region = map(&cb, &src).await;
    let request = put_request(
        &src_region,
        0,
        target.addr() as u64,
        region.packed_key.clone(),
        size,
    );
    assert_eq!(put(&cb, request).await, Ok(()));
    // SAFETY: the PUT answered; nothing writes `target` any more.
    let last_page =
        unsafe { std::slice::from_raw_parts((target.addr() + tail) as *const u8, 4096) };
    assert!(last_page.iter().all(|&b| b == 0xA5), "the last page landed");
    assert_eq!(ob.unmap(region.backend_region_id).await, Ok(()));
    assert_eq!(cb.unmap(src_region.backend_region_id).await, Ok(()));
    consumer.shutdown().await;
    owner.shutdown().await;
}
