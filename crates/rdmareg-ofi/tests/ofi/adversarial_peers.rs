//! Attacks on the owner-served path through the engines' public API only:
//! races of unmaps with gathered lists, consumers shut down mid-read,
//! peers added and removed while reads run. (Attacks that need a peer
//! speaking the wire format by hand are in `src/adversarial_peers.rs`,
//! where the crate's own endpoint type can stand in for a remote machine.)

use crate::common;

use std::time::Duration;

use common::SeamForTestMemory;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, RdmaError};
use rdmareg_ofi::{OfiEngine, Provider};

/// Two `shm` engines of one process; the consumer shuts down (teardown
/// timeout 1 ms) while a batch of 1000 × 4 KiB reads and one of 64 MiB from
/// the other engine is in flight. Its teardown used to close its endpoint,
/// which unmaps the endpoint's shared region, and the owner engine's
/// provider, still sending replies, then locked that region: SIGSEGV in
/// `pthread_spin_lock` under the owner's `fi_cq_read`/`fi_tsend` (3 of 3
/// runs). Now the endpoint is parked with its reads cancelled, and the
/// owner's replies land in discard receives: every read answers `Ok` or
/// `ShuttingDown`, nothing lands in the destination after the answers, the
/// owner's unmap is not held, and nothing is left
/// registered on either side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shm_consumer_shut_down_mid_read_does_not_crash_an_owner_of_its_process() {
    common::init_tracing();
    let config = common::config(Provider::Shm);
    let owner = OfiEngine::start(config.clone()).expect("owner starts");
    let consumer = OfiEngine::start(config.with_teardown_timeout(Duration::from_millis(1)))
        .expect("consumer starts");
    consumer
        .add_peer(common::OWNER, owner.fabric_address())
        .unwrap();
    let (o, c) = (owner.backend(), consumer.backend());
    let len = 64usize << 20;
    let src = vec![0x21u8; len];
    let mut dst = vec![0u8; len];
    let s = o.map_test_memory(src.as_ptr() as usize, len).await.unwrap();
    let d = c
        .map_test_memory(dst.as_mut_ptr() as usize, len)
        .await
        .unwrap();
    let read = tokio::spawn({
        let c = c.clone();
        let mut requests: Vec<BackendGet> = (0..1000u64)
            .map(|i| BackendGet {
                peer: common::OWNER,
                remote_addr: src.as_ptr() as u64 + i * 4096,
                packed_key: s.packed_key.clone(),
                local_region_id: d.backend_region_id,
                local_offset: i * 4096,
                len: 4096,
                deadline: Some(Duration::from_secs(20)),
            })
            .collect();
        requests.push(BackendGet {
            peer: common::OWNER,
            remote_addr: src.as_ptr() as u64,
            packed_key: s.packed_key.clone(),
            local_region_id: d.backend_region_id,
            local_offset: 0,
            len: len as u64,
            deadline: Some(Duration::from_secs(20)),
        });
        async move { c.get_batch_into_test_memory(requests).await }
    });
    tokio::time::sleep(Duration::from_millis(2)).await;
    consumer.shutdown().await;
    let answer = read.await.unwrap();
    // Every read is answered: the destination is the caller's again. The
    // owner goes on serving its replies to the parked endpoint meanwhile;
    // none may land in it.
    let dst_ptr = dst.as_mut_ptr();
    // SAFETY: `dst` is alive; writing through its pointer while the
    // consumer engine may (wrongly) still write it is what is checked.
    unsafe { std::ptr::write_bytes(dst_ptr, 0x77, len) };
    tokio::time::sleep(Duration::from_millis(500)).await;
    // SAFETY: as above; read back through the same pointer.
    let landed_late = unsafe { std::slice::from_raw_parts(dst_ptr, len) }
        .iter()
        .filter(|&&b| b != 0x77)
        .count();
    let unmapped = o.unmap(s.backend_region_id).await;
    owner.shutdown().await;
    for answer in &answer {
        assert!(
            matches!(answer, Ok(()) | Err(RdmaError::ShuttingDown)),
            "{answer:?}"
        );
    }
    assert_eq!(
        landed_late, 0,
        "bytes written after every read was answered"
    );
    assert_eq!(unmapped, Ok(()));
    assert_eq!(owner.live_registrations(), 0);
    assert_eq!(consumer.live_registrations(), 0);
    drop(dst);
}

/// Guard: a consumer reads gathered lists (64 × 1 KiB) of a 64 KiB source
/// back to back while the owner unmaps the source and, the moment the
/// unmap answered, overwrites it with `0xFF`. No list entry may ever land a
/// `0xFF`: the owner copies a list's bytes within one loop turn, before the
/// unmap is served. Entries answer `Ok` or `RegionNotFound`.
async fn an_unmap_racing_gathered_lists_never_lets_bytes_out_after_it_answered(provider: Provider) {
    let (owner, consumer) = common::engines(provider.clone());
    let (o, c) = (owner.backend(), consumer.backend());
    let len = 64usize << 10;
    // Reached only through its address while registered.
    let src = Box::into_raw(vec![0x11u8; len].into_boxed_slice()) as *mut u8 as usize;
    let mut dst = vec![0u8; len];
    let s = o.map_test_memory(src, len).await.unwrap();
    let d = c
        .map_test_memory(dst.as_mut_ptr() as usize, len)
        .await
        .unwrap();
    let mut unmapper = None;
    let mut outcomes = (0usize, 0usize, Vec::new());
    let mut leaked = false;
    for _ in 0..200 {
        let requests: Vec<BackendGet> = (0..64u64)
            .map(|i| BackendGet {
                peer: common::OWNER,
                remote_addr: src as u64 + i * 1024,
                packed_key: s.packed_key.clone(),
                local_region_id: d.backend_region_id,
                local_offset: i * 1024,
                len: 1024,
                deadline: Some(Duration::from_secs(10)),
            })
            .collect();
        for answer in c.get_batch_into_test_memory(requests).await {
            match answer {
                Ok(()) => outcomes.0 += 1,
                Err(RdmaError::RegionNotFound) => outcomes.1 += 1,
                Err(other) => outcomes.2.push(other),
            }
        }
        leaked |= dst.contains(&0xFF);
        // The unmap starts once a first list was served (the connection
        // is up), 5 ms later.
        if unmapper.is_none() {
            unmapper = Some(tokio::spawn({
                let o = o.clone();
                let id = s.backend_region_id;
                async move {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    let unmapped = o.unmap(id).await;
                    if unmapped.is_ok() {
                        // SAFETY: the registration is gone; nothing else names the
                        // source any more.
                        unsafe { std::ptr::write_bytes(src as *mut u8, 0xFF, len) };
                    }
                    unmapped
                }
            }));
        }
        if unmapper.as_ref().is_some_and(|u| u.is_finished()) && outcomes.1 > 0 {
            break;
        }
    }
    let unmapped = unmapper.expect("started").await.unwrap();
    c.unmap(d.backend_region_id).await.unwrap();
    consumer.shutdown().await;
    owner.shutdown().await;
    if unmapped.is_ok() {
        // SAFETY: made by Box::into_raw above; unregistered.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(src as *mut u8, len)) });
    }
    assert_eq!(unmapped, Ok(()), "{provider:?}");
    assert!(
        !leaked,
        "{provider:?}: a byte written after the unmap answered landed"
    );
    assert!(
        outcomes.0 > 0 && outcomes.1 > 0,
        "{provider:?}: {outcomes:?}"
    );
    assert!(outcomes.2.is_empty(), "{provider:?}: {:?}", outcomes.2);
    assert_eq!(owner.live_registrations(), 0);
    assert_eq!(consumer.live_registrations(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmap_racing_gathered_lists_never_lets_bytes_out_after_it_answered_over_tcp() {
    an_unmap_racing_gathered_lists_never_lets_bytes_out_after_it_answered(Provider::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmap_racing_gathered_lists_never_lets_bytes_out_after_it_answered_over_shm() {
    an_unmap_racing_gathered_lists_never_lets_bytes_out_after_it_answered(Provider::Shm).await;
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |dir| dir.count())
}

/// Guard: a consumer adds the owner under a new peer id, reads 4 KiB and
/// removes the peer, 300 times over tcp: each answer is `Ok`, and the
/// process ends with at most 16 more open descriptors than after the first
/// cycle (connections of removed peers are closed or reused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_added_and_removed_around_reads_do_not_leak_descriptors() {
    let (owner, consumer) = common::engines(Provider::Tcp);
    let (o, c) = (owner.backend(), consumer.backend());
    let src = vec![0x42u8; 4096];
    let mut dst = vec![0u8; 4096];
    let s = o
        .map_test_memory(src.as_ptr() as usize, 4096)
        .await
        .unwrap();
    let d = c
        .map_test_memory(dst.as_mut_ptr() as usize, 4096)
        .await
        .unwrap();
    let mut baseline = 0;
    let mut failures = Vec::new();
    for cycle in 0..300u64 {
        let peer = rdmareg_core::PeerId(1000 + cycle);
        consumer.add_peer(peer, owner.fabric_address()).unwrap();
        let answer = c
            .get_into_test_memory(BackendGet {
                peer,
                remote_addr: src.as_ptr() as u64,
                packed_key: s.packed_key.clone(),
                local_region_id: d.backend_region_id,
                local_offset: 0,
                len: 4096,
                deadline: Some(Duration::from_secs(10)),
            })
            .await;
        if answer.is_err() {
            failures.push((cycle, answer));
        }
        consumer.remove_peer(peer).unwrap();
        if cycle == 0 {
            baseline = open_fds();
        }
    }
    let after = open_fds();
    c.unmap(d.backend_region_id).await.unwrap();
    o.unmap(s.backend_region_id).await.unwrap();
    consumer.shutdown().await;
    owner.shutdown().await;
    assert!(failures.is_empty(), "{failures:?}");
    assert!(after <= baseline + 16, "descriptors {baseline} → {after}");
    assert!(dst.iter().all(|&b| b == 0x42));
    assert_eq!(owner.live_registrations(), 0);
    assert_eq!(consumer.live_registrations(), 0);
}

/// Three `shm` engines of one process read from each other (each reads a
/// batch of 64 × 4 KiB and one 8 MiB read from each of the two others,
/// deadline 3 s) and are shut down mid-read, one after another, in
/// `order`, the first with a 1 ms teardown timeout. Every read answers
/// within 20 s with `Ok` or a typed error (a read from an owner already
/// parked answers `Timeout` at its deadline: the parked endpoint takes
/// requests and answers none); no byte lands in a destination after every read into
/// it answered (checked while the last engine still runs); each engine is
/// left with no registration; and the process does not crash.
async fn shm_engines_shut_down_mid_read_in_any_order_answer_everything(order: [usize; 3]) {
    common::init_tracing();
    let len = 8usize << 20;
    let mut engines = Vec::new();
    for i in 0..3 {
        let timeout = if i == order[0] {
            Duration::from_millis(1)
        } else {
            Duration::from_secs(2)
        };
        let config = common::config(Provider::Shm).with_teardown_timeout(timeout);
        engines.push(OfiEngine::start(config).expect("an shm engine starts"));
    }
    for (i, engine) in engines.iter().enumerate() {
        for (j, other) in engines.iter().enumerate() {
            if i != j {
                engine
                    .add_peer(rdmareg_core::PeerId(j as u64), other.fabric_address())
                    .unwrap();
            }
        }
    }
    let srcs: Vec<Vec<u8>> = (0..3).map(|i| vec![0x10 + i as u8; len]).collect();
    // One destination per (reader, owner) pair.
    let mut dsts: Vec<Vec<u8>> = (0..9).map(|_| vec![0u8; len]).collect();
    let mut src_regions = Vec::new();
    for (i, engine) in engines.iter().enumerate() {
        src_regions.push(
            engine
                .backend()
                .map_test_memory(srcs[i].as_ptr() as usize, len)
                .await
                .unwrap(),
        );
    }
    let mut dst_regions = Vec::new();
    for (k, dst) in dsts.iter_mut().enumerate() {
        let reader = k / 3;
        dst_regions.push(
            engines[reader]
                .backend()
                .map_test_memory(dst.as_mut_ptr() as usize, len)
                .await
                .unwrap(),
        );
    }
    let mut reads = Vec::new();
    for reader in 0..3 {
        for owner in 0..3 {
            if reader == owner {
                continue;
            }
            let d = &dst_regions[reader * 3 + owner];
            let s = &src_regions[owner];
            let mut requests: Vec<BackendGet> = (0..64u64)
                .map(|i| BackendGet {
                    peer: rdmareg_core::PeerId(owner as u64),
                    remote_addr: srcs[owner].as_ptr() as u64 + i * 4096,
                    packed_key: s.packed_key.clone(),
                    local_region_id: d.backend_region_id,
                    local_offset: i * 4096,
                    len: 4096,
                    deadline: Some(Duration::from_secs(3)),
                })
                .collect();
            requests.push(BackendGet {
                peer: rdmareg_core::PeerId(owner as u64),
                remote_addr: srcs[owner].as_ptr() as u64,
                packed_key: s.packed_key.clone(),
                local_region_id: d.backend_region_id,
                local_offset: 0,
                len: len as u64,
                deadline: Some(Duration::from_secs(3)),
            });
            let c = engines[reader].backend();
            reads.push(tokio::spawn(async move {
                c.get_batch_into_test_memory(requests).await
            }));
        }
    }
    let started = std::time::Instant::now();
    tokio::time::sleep(Duration::from_millis(2)).await;
    engines[order[0]].shutdown().await;
    let first_down = started.elapsed();
    tokio::time::sleep(Duration::from_millis(1)).await;
    engines[order[1]].shutdown().await;
    let second_down = started.elapsed();
    let mut answers = Vec::new();
    for read in reads {
        answers.push(
            tokio::time::timeout(Duration::from_secs(20), read)
                .await
                .map(|joined| joined.expect("the read task")),
        );
    }
    // Every read answered: the destinations are the test's again. The last
    // engine still runs (and progresses the parked endpoints).
    for dst in dsts.iter_mut() {
        dst.fill(0x77);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let landed_late: usize = dsts
        .iter()
        .map(|dst| dst.iter().filter(|&&b| b != 0x77).count())
        .sum();
    let answered = started.elapsed();
    engines[order[2]].shutdown().await;
    let mut tally = std::collections::BTreeMap::new();
    for answer in answers.iter().flatten().flatten() {
        *tally.entry(format!("{answer:?}")).or_insert(0usize) += 1;
    }
    eprintln!(
        "{order:?}: shut down after {first_down:?} and {second_down:?}; answered by \
         {answered:?}; last down after {:?}; answers {tally:?}",
        started.elapsed()
    );
    let live: Vec<usize> = engines.iter().map(OfiEngine::live_registrations).collect();
    if live.iter().any(|&n| n != 0) {
        // Something may still be registered: keep the memory for good.
        std::mem::forget(srcs);
        std::mem::forget(dsts);
    }
    for answer in &answers {
        let Ok(answers) = answer else {
            panic!("{order:?}: a read went unanswered for 20 s");
        };
        for answer in answers {
            assert!(
                matches!(
                    answer,
                    Ok(()) | Err(RdmaError::ShuttingDown | RdmaError::Timeout)
                ) || matches!(
                    answer,
                    Err(RdmaError::RegionNotFound | RdmaError::Backend(_))
                ),
                "{order:?}: {answer:?}"
            );
        }
    }
    assert_eq!(landed_late, 0, "{order:?}: bytes landed after the answers");
    assert_eq!(live, vec![0, 0, 0], "{order:?}: registrations left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_engines_shut_down_mid_read_in_any_order_answer_everything_0_1_2() {
    shm_engines_shut_down_mid_read_in_any_order_answer_everything([0, 1, 2]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_engines_shut_down_mid_read_in_any_order_answer_everything_2_1_0() {
    shm_engines_shut_down_mid_read_in_any_order_answer_everything([2, 1, 0]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_engines_shut_down_mid_read_in_any_order_answer_everything_1_2_0() {
    shm_engines_shut_down_mid_read_in_any_order_answer_everything([1, 2, 0]).await;
}

/// Two `shm` engines of one process; the owner is shut down (teardown
/// timeout 1 ms) while it sends replies of 8 MiB to the consumer, which
/// stays open. The owner's endpoint is parked (the consumer may still
/// reach it), and its replies still complete — the consumer's loop takes
/// them — yet the owner used to keep their read leases: its source stayed
/// registered after its shutdown for good (`live_registrations()` 1, the
/// source's unmap `ShuttingDown` for ever, the domain unclosable), where an
/// owner whose endpoint is closed instead releases everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_shm_owner_shut_down_while_replying_to_an_engine_of_its_process_leaves_nothing_registered()
 {
    common::init_tracing();
    let config = common::config(Provider::Shm);
    let owner = OfiEngine::start(
        config
            .clone()
            .with_teardown_timeout(Duration::from_millis(1)),
    )
    .expect("owner starts");
    let consumer = OfiEngine::start(config).expect("consumer starts");
    consumer
        .add_peer(common::OWNER, owner.fabric_address())
        .unwrap();
    let (o, c) = (owner.backend(), consumer.backend());
    let len = 8usize << 20;
    let src = vec![0x21u8; len];
    let mut dst = vec![0u8; len];
    let s = o.map_test_memory(src.as_ptr() as usize, len).await.unwrap();
    let d = c
        .map_test_memory(dst.as_mut_ptr() as usize, len)
        .await
        .unwrap();
    let request = BackendGet {
        peer: common::OWNER,
        remote_addr: src.as_ptr() as u64,
        packed_key: s.packed_key.clone(),
        local_region_id: d.backend_region_id,
        local_offset: 0,
        len: len as u64,
        deadline: Some(Duration::from_secs(5)),
    };
    // A first read: the owner serves.
    assert_eq!(c.get_into_test_memory(request.clone()).await, Ok(()));
    let read = tokio::spawn({
        let c = c.clone();
        let requests = vec![request; 32];
        async move { c.get_batch_into_test_memory(requests).await }
    });
    tokio::time::sleep(Duration::from_millis(5)).await;
    owner.shutdown().await;
    let left = owner.live_registrations();
    let answers = read.await.unwrap();
    let unmapped = o.unmap(s.backend_region_id).await;
    c.unmap(d.backend_region_id).await.unwrap();
    consumer.shutdown().await;
    if left != 0 {
        // Still registered: the test must not free it.
        std::mem::forget(src);
    }
    for answer in &answers {
        assert!(
            matches!(
                answer,
                Ok(()) | Err(RdmaError::ShuttingDown | RdmaError::Timeout)
            ),
            "{answer:?}"
        );
    }
    assert_eq!(left, 0, "the owner's source is still registered");
    assert_eq!(unmapped, Ok(()));
    assert_eq!(consumer.live_registrations(), 0);
}

/// Set in the child processes of
/// [`tcp_consumers_closed_mid_rendezvous_answer_every_get`].
const RENDEZVOUS_CHILD: &str = "RDMAREG_TEST_RENDEZVOUS_CLOSE_CHILD";

/// How a round of [`consumers_closed_mid_rendezvous`] interrupts its
/// consumer.
#[derive(Debug, Clone, Copy)]
enum Interruption {
    /// `shutdown` with a 1 ms teardown timeout: the endpoint is closed
    /// under the receives whose rendezvous reads are under way.
    Shutdown,
    /// The engine dropped (the same teardown, from `Drop`).
    Drop,
    /// The owner's peer id removed, then `shutdown`.
    RemovePeer,
    /// No interruption, but a deadline of 1 ms: the matched receives are
    /// cancelled, and with `FI_AV_REMOVE_CLEANUP` the owner's connection is
    /// reset 100 ms past it, under the transfer.
    Deadline,
}

/// Suspected hole: libfabric 1.17's `tcp` completes a read that a response
/// is arriving for twice when its endpoint closes, the second time with a
/// freed context, on which `ofi_rxm` crashes (`tcpx_ep_flush_all_queues`;
/// see `src/progress/serve_writes.rs`). A consumer's large reply arrives
/// by `ofi_rxm`'s rendezvous: the consumer's provider reads the owner's
/// bytes. So each round starts a consumer (teardown timeout 1 ms) that
/// asks one owner for a 4 MiB GET and a batch of 4 × 1 MiB (rendezvous)
/// and 4 × 100 KiB (segmented) GETs of an 8 MiB source, and interrupts it
/// ([`Interruption`]) 0 µs to 4 ms after posting, while replies stream.
/// 36 rounds per process, in two child processes (one with
/// `FI_AV_REMOVE_CLEANUP=1`), so a crash fails this test instead of
/// taking the runner down.
///
/// Crashes: in 10 of 10 child processes (5 without and 5 with
/// `FI_AV_REMOVE_CLEANUP=1`) the consumer's progress thread took SIGSEGV
/// within the first ten rounds (`Shutdown` or `Drop`, 0 µs to 8 ms after
/// posting), always inside libfabric under the consumer's teardown:
/// `fi_close` of its endpoint (`fabric::close_fid`, from
/// `Fabric::close_endpoint`) in `Engine::close_under_the_rest`, the branch
/// that closes the endpoint under reads still in flight once the teardown
/// timeout passed (libfabric 1.17, stripped: `libfabric.so.1+0xb83f9` ←
/// `+0xad56b` ← `+0xadf52` ← `+0xb0704`). The consumer's reply receives
/// whose rendezvous reads are under way are the owner side's served
/// writes again (`serve_writes`), with nothing to withdraw them first.
/// The `RemovePeer` and `Deadline` rounds were not reached.
///
/// Tried, not a fix: cancelling the reads' receives and letting matched
/// ones end (up to 1 s past the teardown timeout) before the close. The
/// crash went on in 3 of about 12 child processes, and in 2 of 5 runs
/// the owner's unmap of its source then did not answer within 5 s: its
/// rendezvous replies to the vanished consumers did not end.
///
/// Checked once it holds: no signal, every GET answers `Ok`,
/// `ShuttingDown` or `Timeout` (`NotConfigured` for one the engine sees
/// after its peer was removed), nothing lands in a destination after its
/// answers, no consumer leaves a region registered, and the owner serves a
/// last consumer and unmaps its source at once.
#[test]
#[ignore = "reproduces a SIGSEGV in fi_close of a consumer's endpoint under rendezvous replies; fix pending"]
fn tcp_consumers_closed_mid_rendezvous_answer_every_get() {
    if std::env::var_os(RENDEZVOUS_CHILD).is_some() {
        consumers_closed_mid_rendezvous();
        return;
    }
    for cleanup in [false, true] {
        let mut child =
            std::process::Command::new(std::env::current_exe().expect("the test binary"));
        child.args([
            "--exact",
            // Its full name in the test binary: `--exact` compares with that.
            "adversarial_peers::tcp_consumers_closed_mid_rendezvous_answer_every_get",
            // Run here whether or not it is ignored.
            "--include-ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ]);
        child.env(RENDEZVOUS_CHILD, "1");
        if cleanup {
            child.env("FI_AV_REMOVE_CLEANUP", "1");
        } else {
            child.env_remove("FI_AV_REMOVE_CLEANUP");
        }
        let status = child.status().expect("the child test runs");
        assert!(
            status.success(),
            "FI_AV_REMOVE_CLEANUP={cleanup}: the child failed: {status}"
        );
    }
}

/// The rounds of [`tcp_consumers_closed_mid_rendezvous_answer_every_get`],
/// in this process.
fn consumers_closed_mid_rendezvous() {
    use std::time::Instant;

    common::init_tracing();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    let config = common::config(Provider::Tcp);
    let owner = OfiEngine::start(config.clone()).expect("owner starts");
    let o = owner.backend();
    let len = 8usize << 20;
    let src: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let s = rt
        .block_on(o.map_test_memory(src.as_ptr() as usize, len))
        .unwrap();
    let get = |d: u64, remote: usize, offset: usize, n: usize, deadline: Duration| BackendGet {
        peer: common::OWNER,
        remote_addr: (src.as_ptr() as usize + remote) as u64,
        packed_key: s.packed_key.clone(),
        local_region_id: d,
        local_offset: offset as u64,
        len: n as u64,
        deadline: Some(deadline),
    };
    // Destinations a consumer may not have let go of: kept until the end.
    let mut kept: Vec<Vec<u8>> = Vec::new();
    let mut outcomes: std::collections::BTreeMap<String, usize> = Default::default();
    let mut failures = Vec::new();
    for interruption in [
        Interruption::Shutdown,
        Interruption::Drop,
        Interruption::RemovePeer,
        Interruption::Deadline,
    ] {
        for delay_us in [0u64, 50, 200, 500, 1000, 2000, 4000, 8000, 16000] {
            let round = format!("{interruption:?} after {delay_us} µs");
            let consumer = OfiEngine::start(
                config
                    .clone()
                    .with_teardown_timeout(Duration::from_millis(1)),
            )
            .expect("consumer starts");
            consumer
                .add_peer(common::OWNER, owner.fabric_address())
                .unwrap();
            let c = consumer.backend();
            let mut dst = vec![0u8; len];
            let d = rt
                .block_on(c.map_test_memory(dst.as_mut_ptr() as usize, len))
                .unwrap()
                .backend_region_id;
            // Connected and known to the owner first (over tcp an owner
            // asks a new consumer's first request again), so the GETs
            // below go straight to their replies.
            let warm_up = get(d, 0, 0, 4096, Duration::from_secs(20));
            rt.block_on(c.get_into_test_memory(warm_up)).unwrap();
            let deadline = match interruption {
                Interruption::Deadline => Duration::from_millis(1),
                _ => Duration::from_secs(20),
            };
            let single = rt.spawn({
                let c = c.clone();
                let request = get(d, 0, 0, 4 << 20, deadline);
                async move { vec![c.get_into_test_memory(request).await] }
            });
            let mut requests: Vec<BackendGet> = (0..4)
                .map(|i| {
                    get(
                        d,
                        (4 << 20) + (i << 20),
                        (4 << 20) + (i << 20),
                        1 << 20,
                        deadline,
                    )
                })
                .collect();
            requests.extend((0..4).map(|i| get(d, i * 100_000, i << 20, 100_000, deadline)));
            let batch = rt.spawn({
                let c = c.clone();
                async move { c.get_batch_into_test_memory(requests).await }
            });
            let posted = Instant::now();
            while posted.elapsed() < Duration::from_micros(delay_us) {
                std::hint::spin_loop();
            }
            let removed = matches!(interruption, Interruption::RemovePeer);
            match interruption {
                Interruption::Shutdown => consumer.shutdown_blocking(),
                Interruption::Drop => {
                    drop(consumer);
                    let answers = answers_of(&rt, single, batch);
                    check_round(
                        &round,
                        &answers,
                        removed,
                        &mut dst,
                        &mut outcomes,
                        &mut failures,
                    );
                    // Whether it left a region registered is not known.
                    kept.push(dst);
                    continue;
                }
                Interruption::RemovePeer => consumer.remove_peer(common::OWNER).unwrap(),
                Interruption::Deadline => {}
            }
            let answers = answers_of(&rt, single, batch);
            consumer.shutdown_blocking();
            check_round(
                &round,
                &answers,
                removed,
                &mut dst,
                &mut outcomes,
                &mut failures,
            );
            let live = consumer.live_registrations();
            if live == 0 {
                drop(dst);
            } else {
                failures.push(format!("{round}: the consumer left {live} registered"));
                kept.push(dst);
            }
        }
    }
    // The owner still serves, and unmaps its source at once.
    let consumer = OfiEngine::start(config).expect("the last consumer starts");
    consumer
        .add_peer(common::OWNER, owner.fabric_address())
        .unwrap();
    let c = consumer.backend();
    let mut dst = vec![0u8; len];
    let d = rt
        .block_on(c.map_test_memory(dst.as_mut_ptr() as usize, len))
        .unwrap();
    let last = rt.block_on(c.get_into_test_memory(get(
        d.backend_region_id,
        0,
        0,
        len,
        Duration::from_secs(20),
    )));
    rt.block_on(c.unmap(d.backend_region_id)).unwrap();
    consumer.shutdown_blocking();
    let unmapped = rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(5), o.unmap(s.backend_region_id)).await
    });
    owner.shutdown_blocking();
    eprintln!("outcomes: {outcomes:?}");
    assert_eq!(last, Ok(()), "the owner serves a last consumer");
    assert!(dst == src, "the last consumer's bytes");
    assert!(failures.is_empty(), "{failures:#?}");
    assert_eq!(unmapped.ok(), Some(Ok(())), "the owner unmaps its source");
    assert_eq!(owner.live_registrations(), 0);
    drop(kept);
}

/// Every answer of a round, within 20 s.
fn answers_of(
    rt: &tokio::runtime::Runtime,
    single: tokio::task::JoinHandle<Vec<Result<(), RdmaError>>>,
    batch: tokio::task::JoinHandle<Vec<Result<(), RdmaError>>>,
) -> Option<Vec<Result<(), RdmaError>>> {
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(20), async {
            let mut answers = single.await.expect("the single GET's task");
            answers.extend(batch.await.expect("the batch's task"));
            answers
        })
        .await
        .ok()
    })
}

/// Checks a round's answers, and that nothing lands in `dst` after them.
fn check_round(
    round: &str,
    answers: &Option<Vec<Result<(), RdmaError>>>,
    removed: bool,
    dst: &mut [u8],
    outcomes: &mut std::collections::BTreeMap<String, usize>,
    failures: &mut Vec<String>,
) {
    let Some(answers) = answers else {
        failures.push(format!("{round}: GETs unanswered after 20 s"));
        return;
    };
    for answer in answers {
        *outcomes.entry(format!("{answer:?}")).or_default() += 1;
        // A GET of the batch the engine sees after the peer was removed
        // names no peer it knows.
        let unknown_peer = removed && *answer == Err(RdmaError::NotConfigured);
        if !unknown_peer
            && !matches!(
                answer,
                Ok(()) | Err(RdmaError::ShuttingDown) | Err(RdmaError::Timeout)
            )
        {
            failures.push(format!("{round}: {answer:?}"));
        }
    }
    let at = dst.as_mut_ptr();
    // SAFETY: every GET into `dst` answered, so it is the test's again;
    // writing through its pointer while a provider may (wrongly) still
    // write it is what is checked.
    unsafe { std::ptr::write_bytes(at, 0x77, dst.len()) };
    std::thread::sleep(Duration::from_millis(20));
    // SAFETY: as above; read back through the same pointer.
    let late = unsafe { std::slice::from_raw_parts(at, dst.len()) }
        .iter()
        .filter(|&&b| b != 0x77)
        .count();
    if late != 0 {
        failures.push(format!("{round}: {late} bytes landed after the answers"));
    }
}
