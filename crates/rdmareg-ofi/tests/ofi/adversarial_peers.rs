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
