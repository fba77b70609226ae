//! A model of the registry, driven by random interleavings of register /
//! unregister / drop guard / alloc / describe / drop buffer / get / transfer
//! list post / shutdown,
//! with
//! cancellation at every await (with maps that outlive their futures, as over
//! a progress thread) and injected backend faults. After every
//! step: the budget equals the model, the backend's live count equals the
//! model, and no latch has resolved while the backend still holds its region
//! (checked by probing each region with a GET from a second instance).

use std::time::Duration;

use proptest::prelude::*;
use rdmareg_backend::loopback::FaultOp;
use rdmareg_core::page_enclosing_len;
use rdmareg_registry::{
    DescribedBuf, Descriptor, PinnedBuf, RdmaError, RegionGuard, RegionWatch, RegisterOwnedError,
    UnregisterOutcome,
};

use crate::common::*;

#[derive(Debug, Clone)]
enum Op {
    RegisterOwned {
        pages: usize,
        ragged: bool,
        fail_map: bool,
    },
    RegisterExternal {
        pages: usize,
    },
    Unregister {
        pick: usize,
        fail_unmap: bool,
    },
    UnregisterOwned {
        pick: usize,
    },
    DropGuard {
        pick: usize,
    },
    Alloc {
        len: usize,
        fail_map: bool,
    },
    TryAlloc {
        len: usize,
    },
    DropBuf {
        pick: usize,
    },
    Describe {
        pick: usize,
    },
    Withdraw {
        pick: usize,
    },
    DropDescribed {
        pick: usize,
    },
    Get {
        pick: usize,
    },
    CancelRegister {
        polls: usize,
        detached: bool,
    },
    CancelAlloc {
        len: usize,
        polls: usize,
        detached: bool,
    },
    CancelUnregister {
        pick: usize,
    },
    CancelGet {
        pick: usize,
    },
    /// A transfer list with one read into each of up to three buffers.
    Post {
        picks: Vec<usize>,
    },
    CancelPost {
        picks: Vec<usize>,
    },
    Shutdown,
}

fn alloc_len() -> impl Strategy<Value = usize> {
    prop_oneof![
        4 => 1usize..3 * 4096,
        1 => Just(40 * KIB),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (1usize..4, any::<bool>(), prop::bool::weighted(0.15))
            .prop_map(|(pages, ragged, fail_map)| Op::RegisterOwned { pages, ragged, fail_map }),
        4 => (1usize..3).prop_map(|pages| Op::RegisterExternal { pages }),
        6 => (any::<usize>(), prop::bool::weighted(0.2))
            .prop_map(|(pick, fail_unmap)| Op::Unregister { pick, fail_unmap }),
        2 => any::<usize>().prop_map(|pick| Op::UnregisterOwned { pick }),
        4 => any::<usize>().prop_map(|pick| Op::DropGuard { pick }),
        8 => (alloc_len(), prop::bool::weighted(0.15))
            .prop_map(|(len, fail_map)| Op::Alloc { len, fail_map }),
        2 => (1usize..3 * 4096).prop_map(|len| Op::TryAlloc { len }),
        6 => any::<usize>().prop_map(|pick| Op::DropBuf { pick }),
        3 => any::<usize>().prop_map(|pick| Op::Describe { pick }),
        2 => any::<usize>().prop_map(|pick| Op::Withdraw { pick }),
        2 => any::<usize>().prop_map(|pick| Op::DropDescribed { pick }),
        6 => any::<usize>().prop_map(|pick| Op::Get { pick }),
        2 => (0usize..3, any::<bool>())
            .prop_map(|(polls, detached)| Op::CancelRegister { polls, detached }),
        2 => (alloc_len(), 0usize..3, any::<bool>())
            .prop_map(|(len, polls, detached)| Op::CancelAlloc { len, polls, detached }),
        2 => any::<usize>().prop_map(|pick| Op::CancelUnregister { pick }),
        2 => any::<usize>().prop_map(|pick| Op::CancelGet { pick }),
        4 => prop::collection::vec(any::<usize>(), 1..4).prop_map(|picks| Op::Post { picks }),
        2 => prop::collection::vec(any::<usize>(), 1..4)
            .prop_map(|picks| Op::CancelPost { picks }),
        1 => Just(Op::Shutdown),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Held {
    /// Registered, guard in hand.
    Live,
    /// An unmap failed: still registered as far as anyone knows.
    Unknown,
    /// Confirmed released.
    Released,
}

struct ModelRegion {
    guard: Option<RegionGuard>,
    watch: RegionWatch,
    descriptor: Descriptor,
    charge: u64,
    held: Held,
    owned_content: Option<Box<[u8]>>,
    external: Option<External>,
}

struct Harness {
    owner: Side,
    prober: Side,
    source: RegionGuard,
    probe_buf: PinnedBuf,
    regions: Vec<ModelRegion>,
    bufs: Vec<PinnedBuf>,
    /// Buffers lent to peers' reads: each holds a registration of its own.
    described: Vec<DescribedBuf>,
    closed: bool,
    next_seed: u8,
}

const SOURCE_LEN: usize = 3 * 4096;

/// The source range entry `i` of a model list reads into a buffer of
/// `buf_len` bytes: a different offset per entry, as long as both allow.
fn list_range(i: usize, buf_len: usize) -> (usize, usize) {
    let offset = (i * 1000) % SOURCE_LEN;
    (offset, buf_len.min(SOURCE_LEN - offset))
}
const DELAY: Duration = Duration::from_millis(10);

fn model_config() -> rdmareg_registry::RdmaConfig {
    let mut config = small_config();
    config.budget_bytes = 128 * KIB as u64;
    config.pool.first_arena_bytes = 16 * KIB as u64;
    config.pool.max_arena_bytes = 64 * KIB as u64;
    config.pool.dedicated_threshold_bytes = 32 * KIB as u64;
    config
}

impl Harness {
    async fn new() -> Self {
        let fabric = rdmareg_backend::loopback::LoopbackFabric::new();
        let owner = Side::new(&fabric, OWNER, model_config());
        let prober = Side::new(&fabric, CONSUMER, small_config());
        let source = prober
            .registry
            .register_owned(pattern(SOURCE_LEN, 0x5A))
            .await
            .unwrap();
        let probe_buf = prober.registry.alloc_pinned(1).await.unwrap();
        Harness {
            owner,
            prober,
            source,
            probe_buf,
            regions: Vec::new(),
            bufs: Vec::new(),
            described: Vec::new(),
            closed: false,
            next_seed: 1,
        }
    }

    fn seed(&mut self) -> u8 {
        self.next_seed = self.next_seed.wrapping_add(1);
        self.next_seed
    }

    fn charged(&self) -> u64 {
        self.regions
            .iter()
            .filter(|r| r.held != Held::Released)
            .map(|r| r.charge)
            .sum()
    }

    /// Buffers held with a registration of their own, and the bytes those
    /// charge.
    fn described(&self) -> (usize, u64) {
        self.described.iter().fold((0, 0), |(n, bytes), b| {
            let pages = page_enclosing_len(b.as_ptr() as u64, b.len() as u64, 4096).unwrap();
            (n + 1, bytes + pages)
        })
    }

    /// Takes the distinct buffers `picks` name out of the harness.
    fn take_buffers(&mut self, picks: &[usize]) -> Vec<PinnedBuf> {
        let mut taken = Vec::new();
        for &pick in picks {
            if self.bufs.is_empty() {
                break;
            }
            let n = self.bufs.len();
            taken.push(self.bufs.swap_remove(pick % n));
        }
        taken
    }

    /// A list reading [`list_range`] of the source into each buffer.
    fn list_into(&self, buffers: &[PinnedBuf]) -> rdmareg_registry::TransferList {
        let mut list = self.owner.registry.transfer_list(CONSUMER);
        for (i, buf) in buffers.iter().enumerate() {
            let (offset, len) = list_range(i, buf.len());
            let src = self
                .source
                .descriptor_range(offset as u64, len as u64)
                .unwrap();
            assert_eq!(list.push(&src, i, 0), Ok(i));
        }
        list
    }

    fn guard_index(&self, pick: usize) -> Option<usize> {
        let with_guard: Vec<usize> = (0..self.regions.len())
            .filter(|i| self.regions[*i].guard.is_some())
            .collect();
        (!with_guard.is_empty()).then(|| with_guard[pick % with_guard.len()])
    }

    /// What a registration of `charge` bytes must answer, if refused.
    fn expected_refusal(&self, charge: u64, fail_map: bool) -> Option<RdmaError> {
        if self.closed {
            return Some(RdmaError::ShuttingDown);
        }
        let stats = self.owner.registry.stats();
        if stats.registered_bytes + charge > stats.budget_bytes {
            return Some(RdmaError::BudgetExceeded {
                requested: charge,
                registered: stats.registered_bytes,
                budget: stats.budget_bytes,
            });
        }
        fail_map.then(|| RdmaError::backend(String::new()))
    }

    async fn apply(&mut self, op: Op) {
        let backend = std::sync::Arc::clone(&self.owner.backend);
        let faults = backend.faults();
        match op {
            Op::RegisterOwned {
                pages,
                ragged,
                fail_map,
            } => {
                let len = pages * page() - if ragged { 100 } else { 0 };
                let seed = self.seed();
                let buffer = pattern(len, seed);
                let charge =
                    page_enclosing_len(buffer.as_ptr() as u64, len as u64, page() as u64).unwrap();
                let expected = self.expected_refusal(charge, fail_map);
                if fail_map {
                    faults.fail_next(FaultOp::Map, 1);
                }
                let result = self.owner.registry.register_owned(buffer).await;
                faults.fail_next(FaultOp::Map, 0);
                match (result, expected) {
                    (Ok(guard), None) => self.track(guard, charge, Some(pattern(len, seed)), None),
                    (Err(RegisterOwnedError { error, buffer }), Some(want)) => {
                        assert_same_refusal(&error, &want);
                        assert_eq!(buffer, pattern(len, seed), "refusal hands the data back");
                    }
                    (result, expected) => {
                        panic!(
                            "register_owned: got {:?}, expected {expected:?}",
                            result.err()
                        )
                    }
                }
            }
            Op::RegisterExternal { pages } => {
                let memory = External::new(pages * page(), self.seed());
                let charge = (pages * page()) as u64;
                let expected = self.expected_refusal(charge, false);
                // SAFETY: `memory` is kept by the model until the region's
                // latch resolved (and leaked if it never does).
                let result = unsafe {
                    self.owner
                        .registry
                        .register_external(memory.ptr(), memory.len())
                }
                .await;
                match (result, expected) {
                    (Ok(guard), None) => self.track(guard, charge, None, Some(memory)),
                    (Err(error), Some(want)) => assert_same_refusal(&error, &want),
                    (result, expected) => {
                        panic!(
                            "register_external: got {:?}, expected {expected:?}",
                            result.err()
                        )
                    }
                }
            }
            Op::Unregister { pick, fail_unmap } => {
                let Some(i) = self.guard_index(pick) else {
                    return;
                };
                let guard = self.regions[i].guard.take().unwrap();
                let fail = fail_unmap && self.regions[i].held == Held::Live;
                if fail {
                    faults.fail_next(FaultOp::Unmap, 1);
                }
                let result = guard.unregister(Duration::from_secs(60)).await;
                faults.fail_next(FaultOp::Unmap, 0);
                if fail {
                    assert!(matches!(result, Err(RdmaError::Backend(_))), "{result:?}");
                    self.regions[i].held = Held::Unknown;
                } else {
                    assert_eq!(result, Ok(UnregisterOutcome::Drained));
                    self.regions[i].held = Held::Released;
                }
            }
            Op::UnregisterOwned { pick } => {
                let Some(i) = self.guard_index(pick) else {
                    return;
                };
                let guard = self.regions[i].guard.take().unwrap();
                match self.regions[i].owned_content.take() {
                    Some(content) => {
                        let (buffer, outcome) = guard
                            .unregister_owned(Duration::from_secs(60))
                            .await
                            .unwrap();
                        assert_eq!(outcome, UnregisterOutcome::Drained);
                        assert_eq!(buffer, content);
                        self.regions[i].held = Held::Released;
                    }
                    None => {
                        let refused = guard
                            .unregister_owned(Duration::from_secs(60))
                            .await
                            .unwrap_err();
                        assert_eq!(refused.error, RdmaError::NotOwned);
                        self.regions[i].guard = refused.guard;
                        assert!(self.regions[i].guard.is_some());
                    }
                }
            }
            Op::DropGuard { pick } => {
                let Some(i) = self.guard_index(pick) else {
                    return;
                };
                drop(self.regions[i].guard.take());
                // The background deregistration completes while settling.
                self.regions[i].held = Held::Released;
            }
            Op::Alloc { len, fail_map } => {
                if fail_map {
                    faults.fail_next(FaultOp::Map, 1);
                }
                let result = self.owner.registry.alloc_pinned(len).await;
                faults.fail_next(FaultOp::Map, 0);
                self.expect_allocation(result, len, fail_map);
            }
            Op::TryAlloc { len } => {
                let found = self.owner.registry.try_alloc_pinned(len);
                if self.closed {
                    assert!(found.is_none());
                }
                if let Some(buf) = found {
                    assert_eq!(buf.len(), len);
                    self.bufs.push(buf);
                }
            }
            Op::Describe { pick } => {
                if self.bufs.is_empty() {
                    return;
                }
                let n = self.bufs.len();
                let buf = self.bufs.swap_remove(pick % n);
                let (addr, len) = (buf.as_ptr() as u64, buf.len() as u64);
                match buf.describe().await {
                    Ok(described) => {
                        let descriptor = described.descriptor();
                        assert_eq!((descriptor.addr(), descriptor.len()), (addr, len));
                        self.described.push(described);
                    }
                    Err(refused) => {
                        match refused.error() {
                            RdmaError::ShuttingDown => assert!(self.closed),
                            RdmaError::BudgetExceeded { .. } => {}
                            other => panic!("describe: {other}"),
                        }
                        let buf = refused.into_buf();
                        assert_eq!((buf.as_ptr() as u64, buf.len() as u64), (addr, len));
                        self.bufs.push(buf);
                    }
                }
            }
            Op::Withdraw { pick } => {
                if self.described.is_empty() {
                    return;
                }
                let n = self.described.len();
                let described = self.described.swap_remove(pick % n);
                let addr = described.as_ptr() as u64;
                match described.withdraw().await {
                    Ok(buf) => {
                        assert!(!self.closed);
                        assert_eq!(buf.as_ptr() as u64, addr);
                        self.bufs.push(buf);
                    }
                    Err(refused) => {
                        assert_eq!(refused.error(), &RdmaError::ShuttingDown);
                        assert!(self.closed);
                        self.described
                            .push(refused.into_buf().expect("the buffer comes back"));
                    }
                }
            }
            Op::DropDescribed { pick } => {
                if !self.described.is_empty() {
                    let n = self.described.len();
                    drop(self.described.swap_remove(pick % n));
                }
            }
            Op::DropBuf { pick } => {
                if !self.bufs.is_empty() {
                    let n = self.bufs.len();
                    drop(self.bufs.swap_remove(pick % n));
                }
            }
            Op::Get { pick } => {
                if self.bufs.is_empty() {
                    return;
                }
                let n = self.bufs.len();
                let buf = &mut self.bufs[pick % n];
                let len = buf.len().min(SOURCE_LEN);
                let src = self.source.descriptor_range(0, len as u64).unwrap();
                let result = self.owner.registry.get(CONSUMER, &src, buf).await;
                if self.closed {
                    assert_eq!(result, Err(RdmaError::ShuttingDown));
                } else {
                    assert_eq!(result, Ok(()));
                    assert_eq!(&buf[..len], &pattern(SOURCE_LEN, 0x5A)[..len]);
                }
                assert!(!buf.is_surrendered());
            }
            Op::CancelRegister { polls, detached } => {
                // Detached, a dropped map registers anyway and the registry
                // must roll it back (as over UCX's progress thread).
                faults.detach_maps(detached);
                faults.set_delay(FaultOp::Map, DELAY);
                let mut registering = Box::pin(self.owner.registry.register_owned(pattern(100, 0)));
                for _ in 0..polls {
                    if let std::task::Poll::Ready(result) = futures::poll!(&mut registering) {
                        let error = result.expect_err("a delayed map cannot answer at once");
                        assert!(
                            matches!(
                                error.error,
                                RdmaError::ShuttingDown | RdmaError::BudgetExceeded { .. }
                            ),
                            "{error}"
                        );
                        break;
                    }
                }
                drop(registering);
            }
            Op::CancelAlloc {
                len,
                polls,
                detached,
            } => {
                faults.detach_maps(detached);
                faults.set_delay(FaultOp::Map, DELAY);
                let mut allocating = Box::pin(self.owner.registry.alloc_pinned(len));
                let mut answered = None;
                for _ in 0..polls {
                    if let std::task::Poll::Ready(result) = futures::poll!(&mut allocating) {
                        answered = Some(result);
                        break;
                    }
                }
                drop(allocating);
                if let Some(result) = answered {
                    self.expect_allocation(result, len, false);
                }
            }
            Op::CancelUnregister { pick } => {
                let Some(i) = self.guard_index(pick) else {
                    return;
                };
                let guard = self.regions[i].guard.take().unwrap();
                faults.set_delay(FaultOp::Unmap, DELAY);
                let mut unregistering = Box::pin(guard.unregister(Duration::from_secs(60)));
                let first = futures::poll!(&mut unregistering);
                drop(unregistering);
                if let std::task::Poll::Ready(result) = first {
                    assert!(self.closed, "a delayed unmap cannot answer at once");
                    assert_eq!(result, Ok(UnregisterOutcome::Drained));
                }
                self.regions[i].held = Held::Released;
            }
            Op::CancelGet { pick } => {
                if self.bufs.is_empty() {
                    return;
                }
                let n = self.bufs.len();
                let index = pick % n;
                let src = self.source.descriptor_range(0, 1).unwrap();
                faults.set_delay(FaultOp::Get, DELAY);
                let first = {
                    let buf = &mut self.bufs[index];
                    let mut getting = Box::pin(self.owner.registry.get(CONSUMER, &src, buf));
                    futures::poll!(&mut getting)
                };
                match first {
                    std::task::Poll::Pending => {
                        let buf = self.bufs.swap_remove(index);
                        assert!(
                            buf.is_surrendered(),
                            "a cancelled GET surrenders its buffer"
                        );
                    }
                    std::task::Poll::Ready(result) => {
                        assert!(self.closed);
                        assert_eq!(result, Err(RdmaError::ShuttingDown));
                    }
                }
            }
            Op::Post { picks } => {
                let mut buffers = self.take_buffers(&picks);
                if buffers.is_empty() {
                    return;
                }
                let list = self.list_into(&buffers);
                let result = self.owner.registry.post(&list, &mut buffers).await;
                if self.closed {
                    assert_eq!(result, Err(RdmaError::ShuttingDown));
                } else {
                    let answers = result.expect("a list of valid reads posts");
                    assert_eq!(answers, vec![Ok(()); buffers.len()]);
                    let want = pattern(SOURCE_LEN, 0x5A);
                    for (i, buf) in buffers.iter().enumerate() {
                        let (offset, len) = list_range(i, buf.len());
                        assert_eq!(&buf[..len], &want[offset..offset + len], "entry {i}");
                    }
                }
                assert!(buffers.iter().all(|b| !b.is_surrendered()));
                self.bufs.extend(buffers);
            }
            Op::CancelPost { picks } => {
                let mut buffers = self.take_buffers(&picks);
                if buffers.is_empty() {
                    return;
                }
                let list = self.list_into(&buffers);
                faults.set_delay(FaultOp::Get, DELAY);
                let first = {
                    let mut posting = Box::pin(self.owner.registry.post(&list, &mut buffers));
                    futures::poll!(&mut posting)
                };
                match first {
                    std::task::Poll::Pending => assert!(
                        buffers.iter().all(|b| b.is_surrendered()),
                        "a cancelled post surrenders every buffer it writes"
                    ),
                    std::task::Poll::Ready(result) => {
                        assert!(self.closed);
                        assert_eq!(result, Err(RdmaError::ShuttingDown));
                        self.bufs.extend(buffers);
                    }
                }
            }
            Op::Shutdown => {
                let swept = self.owner.registry.shutdown(Duration::from_secs(1)).await;
                assert!(swept.report().drained);
                self.owner.backend.shutdown().await;
                let report = swept.finish_after_backend_teardown();
                assert!(
                    report.released && report.backend_live == Some(0),
                    "{report:?}"
                );
                self.closed = true;
                for region in &mut self.regions {
                    region.held = Held::Released;
                }
            }
        }
    }

    fn track(
        &mut self,
        guard: RegionGuard,
        charge: u64,
        owned_content: Option<Box<[u8]>>,
        external: Option<External>,
    ) {
        assert_eq!(guard.effective_range().len, charge);
        self.regions.push(ModelRegion {
            watch: guard.watch(),
            descriptor: guard.descriptor().unwrap(),
            guard: Some(guard),
            charge,
            held: Held::Live,
            owned_content,
            external,
        });
    }

    fn expect_allocation(
        &mut self,
        result: Result<PinnedBuf, RdmaError>,
        len: usize,
        fail_map: bool,
    ) {
        match result {
            Ok(buf) => {
                assert!(!self.closed);
                assert_eq!(buf.len(), len);
                self.bufs.push(buf);
            }
            Err(RdmaError::ShuttingDown) => assert!(self.closed),
            Err(RdmaError::BudgetExceeded {
                requested,
                registered,
                budget,
            }) => assert!(registered + requested > budget),
            Err(RdmaError::Backend(message)) => {
                assert!(fail_map && message.contains("injected"), "{message}")
            }
            Err(other) => panic!("alloc_pinned({len}): {other}"),
        }
    }

    /// Let background deregistrations, delayed backend work and abandoned
    /// transfers finish, then lift the delays.
    async fn settle(&self) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        self.owner.registry.map_rollbacks_settled().await;
        let faults = self.owner.backend.faults();
        faults.detach_maps(false);
        for op in [FaultOp::Map, FaultOp::Unmap, FaultOp::Get] {
            faults.set_delay(op, Duration::ZERO);
        }
    }

    async fn check(&mut self) {
        let stats = self.owner.registry.stats();
        assert_eq!(stats.transfers_in_flight, 0);
        assert_eq!(stats.map_rollbacks_in_flight, 0);
        let (described, described_bytes) = self.described();
        assert_eq!(
            stats.registered_bytes,
            self.charged()
                + stats.pooled_arena_bytes
                + stats.dedicated_arena_bytes
                + described_bytes,
            "budget = regions in the model + arenas + described pool buffers"
        );
        let held = self
            .regions
            .iter()
            .filter(|r| r.held != Held::Released)
            .count();
        // After shutdown the backend's teardown released described buffers'
        // own registrations too; their charge stays until they are dropped.
        let described_live = if self.closed { 0 } else { described };
        assert_eq!(
            self.owner.live(),
            held + stats.pooled_arenas + stats.dedicated_arenas + described_live,
            "backend live count = regions in the model + arenas + described pool buffers"
        );
        assert_eq!(stats.live_regions, held);
        if !self.closed {
            assert_eq!(
                stats.live_allocations,
                self.bufs.len() + self.described.len()
            );
        }
        assert_eq!(stats.leaked_bytes, 0);
        for region in &self.regions {
            let released = region.held == Held::Released;
            assert_eq!(region.watch.is_deregistered(), released, "latch = model");
            let probe = region.descriptor.slice(0, 1).unwrap();
            let reached = self
                .prober
                .registry
                .get(OWNER, &probe, &mut self.probe_buf)
                .await;
            if released {
                assert!(
                    reached.is_err(),
                    "a released region is no longer registered"
                );
            } else {
                assert_eq!(reached, Ok(()), "a held region is still registered");
            }
        }
    }

    async fn finish(mut self) {
        self.apply(Op::Shutdown).await;
        self.settle().await;
        self.check().await;
        assert_eq!(self.owner.live(), 0);
        // A described buffer keeps its charge until it is dropped.
        self.bufs.clear();
        self.described.clear();
        self.settle().await;
        assert_eq!(self.owner.registered_bytes(), 0);
        for region in std::mem::take(&mut self.regions) {
            if let Some(memory) = region.external {
                if region.watch.is_deregistered() {
                    drop(memory);
                } else {
                    std::mem::forget(memory);
                }
            }
        }
        self.source
            .unregister(Duration::from_secs(60))
            .await
            .unwrap();
    }
}

fn assert_same_refusal(got: &RdmaError, want: &RdmaError) {
    match want {
        RdmaError::Backend(_) => assert!(
            matches!(got, RdmaError::Backend(m) if m.contains("injected")),
            "{got}"
        ),
        other => assert_eq!(got, other),
    }
}

async fn run(ops: Vec<Op>) {
    let mut harness = Harness::new().await;
    for op in ops {
        harness.apply(op).await;
        harness.settle().await;
        harness.check().await;
    }
    harness.finish().await;
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]
    #[test]
    fn registry_matches_its_model_under_random_interleavings(
        ops in proptest::collection::vec(op(), 1..40)
    ) {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap()
            .block_on(run(ops));
    }
}
