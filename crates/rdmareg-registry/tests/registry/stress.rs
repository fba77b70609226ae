//! Several tasks on a multi-threaded runtime race every operation — register,
//! unregister, drop guards, read, allocate, free, GET, cancel — and then
//! shutdown races them all. Afterwards nothing is registered, nothing is
//! charged, and every region's latch has resolved.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use rdmareg_registry::{Descriptor, RdmaError, RdmaRegistry, RegionWatch};

use crate::common::*;

/// A tiny deterministic generator per task.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

async fn registrar(registry: RdmaRegistry, seed: u64) -> Vec<RegionWatch> {
    let mut rng = Rng(seed);
    let mut watches = Vec::new();
    let mut held = Vec::new();
    loop {
        let len = (1 + rng.below(3) as usize) * page() - rng.below(100) as usize;
        match registry.register_owned(pattern(len, seed as u8)).await {
            Ok(guard) => {
                watches.push(guard.watch());
                held.push((guard, len));
            }
            Err(refused) => match refused.error {
                RdmaError::ShuttingDown => break,
                RdmaError::BudgetExceeded { .. } => {}
                other => panic!("register_owned: {other}"),
            },
        }
        if held.len() > 4 || rng.below(3) == 0 {
            let (guard, len) = held.swap_remove(rng.below(held.len() as u64) as usize);
            match rng.below(3) {
                0 => drop(guard),
                1 => {
                    let outcome = guard.unregister(Duration::from_millis(5)).await;
                    assert!(outcome.is_ok(), "{outcome:?}");
                }
                _ => {
                    let (buffer, _) = guard
                        .unregister_owned(Duration::from_millis(5))
                        .await
                        .expect("owned");
                    assert_eq!(buffer, pattern(len, seed as u8));
                }
            }
        }
        tokio::task::yield_now().await;
    }
    // Shutdown has begun: whatever is still held is swept; drop the guards.
    drop(held);
    watches
}

async fn reader(registry: RdmaRegistry) {
    // Reads its own short-lived regions while others come and go.
    let mut round = 0u8;
    loop {
        round = round.wrapping_add(1);
        let guard = match registry.register_owned(pattern(256, round)).await {
            Ok(guard) => guard,
            Err(refused) if refused.error == RdmaError::ShuttingDown => break,
            Err(_) => {
                tokio::task::yield_now().await;
                continue;
            }
        };
        let watch = guard.watch();
        let copied = tokio::task::spawn_blocking(move || watch.read(|view| view.to_vec()))
            .await
            .unwrap();
        if let Some(bytes) = copied {
            assert_eq!(bytes, pattern(256, round).to_vec());
        }
        drop(guard);
    }
}

async fn allocator(registry: RdmaRegistry, seed: u64) {
    let mut rng = Rng(seed);
    let mut held = Vec::new();
    loop {
        let len = match rng.below(10) {
            0 => 40 * KIB + rng.below(4096) as usize,
            _ => 1 + rng.below(3 * 4096) as usize,
        };
        let got = if rng.below(4) == 0 {
            registry
                .try_alloc_pinned(len)
                .ok_or(RdmaError::RegionNotFound)
        } else {
            registry.alloc_pinned(len).await
        };
        match got {
            Ok(mut buf) => {
                assert_eq!(buf.len(), len);
                buf[len - 1] = seed as u8;
                held.push(buf);
            }
            Err(RdmaError::ShuttingDown) => break,
            Err(RdmaError::BudgetExceeded { .. } | RdmaError::RegionNotFound) => {}
            Err(other) => panic!("alloc_pinned({len}): {other}"),
        }
        if held.len() > 6 || rng.below(2) == 0 && !held.is_empty() {
            held.swap_remove(rng.below(held.len() as u64) as usize);
        }
        tokio::task::yield_now().await;
    }
}

async fn getter(registry: RdmaRegistry, source: Descriptor, seed: u64) {
    let mut rng = Rng(seed);
    let expected = pattern(source.len() as usize, 0x77);
    loop {
        let len = 1 + rng.below(source.len()) as usize;
        let mut buf = match registry.alloc_pinned(len).await {
            Ok(buf) => buf,
            Err(RdmaError::ShuttingDown) => break,
            Err(RdmaError::BudgetExceeded { .. }) => {
                tokio::task::yield_now().await;
                continue;
            }
            Err(other) => panic!("alloc_pinned: {other}"),
        };
        let src = source.slice(0, len as u64).unwrap();
        if rng.below(4) == 0 {
            // Cancel it at whatever point it has reached.
            let limit = Duration::from_micros(rng.below(50));
            let _ = tokio::time::timeout(limit, registry.get(CONSUMER, &src, &mut buf)).await;
            continue;
        }
        match registry.get(CONSUMER, &src, &mut buf).await {
            Ok(()) => assert_eq!(&buf[..], &expected[..len]),
            Err(RdmaError::ShuttingDown) => break,
            Err(other) => panic!("get: {other}"),
        }
    }
}

#[test]
fn racing_operations_then_shutdown_leave_nothing_registered() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let mut config = small_config();
        config.budget_bytes = 768 * KIB as u64;
        config.pool.first_arena_bytes = 32 * KIB as u64;
        config.pool.max_arena_bytes = 128 * KIB as u64;
        config.pool.dedicated_threshold_bytes = 40 * KIB as u64;
        config.pool.reclaim_empty_arenas = true;
        config.pool.retention_floor_bytes = 32 * KIB as u64;
        let (_fabric, owner, consumer) = two_sides(config);
        let source_guard = consumer
            .registry
            .register_owned(pattern(16 * KIB, 0x77))
            .await
            .unwrap();
        let source = source_guard.descriptor().unwrap();

        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(0));
        let monitor = tokio::spawn({
            let (registry, stop, peak) = (owner.registry.clone(), stop.clone(), peak.clone());
            async move {
                while !stop.load(Ordering::SeqCst) {
                    peak.fetch_max(registry.stats().registered_bytes, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                }
            }
        });
        let registrars: Vec<_> = (0..3)
            .map(|i| tokio::spawn(registrar(owner.registry.clone(), 0x9E37 + i)))
            .collect();
        let mut others = vec![tokio::spawn(reader(owner.registry.clone()))];
        for i in 0..3 {
            others.push(tokio::spawn(allocator(
                owner.registry.clone(),
                0xC0FFEE + i,
            )));
        }
        for i in 0..2 {
            others.push(tokio::spawn(getter(
                owner.registry.clone(),
                source.clone(),
                0xBEEF + i,
            )));
        }

        tokio::time::sleep(Duration::from_millis(300)).await;
        let swept = owner.registry.shutdown(Duration::from_secs(10)).await;
        assert!(swept.report().drained, "{:?}", swept.report());

        let mut watches = Vec::new();
        for task in registrars {
            watches.extend(task.await.expect("registrar task"));
        }
        for task in others {
            task.await.expect("worker task");
        }
        stop.store(true, Ordering::SeqCst);
        monitor.await.unwrap();

        owner.backend.shutdown().await;
        let report = swept.finish_after_backend_teardown();
        assert!(
            report.released && report.backend_live == Some(0),
            "{report:?}"
        );
        assert!(peak.load(Ordering::SeqCst) <= owner.registry.stats().budget_bytes);
        assert_eq!(owner.live(), 0);
        let stats = owner.registry.stats();
        assert_eq!(stats.registered_bytes, 0);
        assert_eq!(stats.live_regions, 0);
        assert_eq!(stats.transfers_in_flight, 0);
        assert_eq!(stats.leaked_bytes, 0);
        assert!(!watches.is_empty(), "the registrars did register");
        for watch in &watches {
            within(
                Duration::from_secs(5),
                "every latch resolves",
                watch.deregistered(),
            )
            .await;
        }
        source_guard
            .unregister(Duration::from_secs(60))
            .await
            .unwrap();
    });
}
