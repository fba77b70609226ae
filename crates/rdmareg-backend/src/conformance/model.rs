//! Model-based property test: random sequences of map, unmap, repeated
//! unmap, unknown-id unmap, dropped unmap, cancelled map and GETs (valid and
//! not), each checked against a model of what the backend must hold. After
//! every step the owner's and the consumer's own live counts equal the
//! model's (contract point 5).

use std::future::Future;
use std::task::Poll;
use std::time::Duration;

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use rdmareg_core::RdmaError;

use super::buffer::{KitBuffer, Mapped};
use super::support::{
    FILL, assert_live_now, get_request, kit_get, kit_map, live, plus, poll_once, poll_then_drop,
    settle_live, settle_live_and_hold, source_byte,
};
use super::{BackendPair, kit_runtime};
use crate::RdmaBackend;

/// Default number of cases [`conformance_tests!`](crate::conformance_tests)
/// runs; each case builds a fresh pair.
pub const MODEL_CASES: u32 = 64;
/// Longest step sequence of one case.
const MAX_STEPS: usize = 24;
/// Buffer sizes the model registers: byte, odd, page, page plus one, larger.
const SIZES: [usize; 5] = [1, 100, 4096, 4097, 65536];
/// Pause between hand polls of a cancelled map.
const POLL_GAP: Duration = Duration::from_micros(100);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Owner,
    Consumer,
}

#[derive(Debug, Clone, Copy)]
enum GetShape {
    Valid,
    LocalOutOfRange,
    RemoteOutOfRange,
    ZeroLength,
}

#[derive(Debug, Clone)]
enum Step {
    Map {
        side: Side,
        size: Index,
    },
    CancelledMap {
        side: Side,
        size: Index,
        polls: u8,
    },
    Unmap {
        side: Side,
        which: Index,
    },
    UnmapAgain {
        side: Side,
        which: Index,
    },
    UnmapUnknown {
        side: Side,
        id: u64,
    },
    DroppedUnmap {
        side: Side,
        which: Index,
    },
    Get {
        shape: GetShape,
        src: Index,
        dst: Index,
        len: Index,
        remote: Index,
        local: Index,
    },
}

fn side() -> impl Strategy<Value = Side> {
    prop_oneof![Just(Side::Owner), Just(Side::Consumer)]
}

fn step() -> impl Strategy<Value = Step> {
    let shape = prop_oneof![
        6 => Just(GetShape::Valid),
        2 => Just(GetShape::LocalOutOfRange),
        2 => Just(GetShape::RemoteOutOfRange),
        1 => Just(GetShape::ZeroLength),
    ];
    prop_oneof![
        4 => (side(), any::<Index>()).prop_map(|(side, size)| Step::Map { side, size }),
        2 => (side(), any::<Index>(), 0u8..4)
            .prop_map(|(side, size, polls)| Step::CancelledMap { side, size, polls }),
        3 => (side(), any::<Index>()).prop_map(|(side, which)| Step::Unmap { side, which }),
        1 => (side(), any::<Index>()).prop_map(|(side, which)| Step::UnmapAgain { side, which }),
        1 => (side(), (u64::MAX - 1000)..=u64::MAX)
            .prop_map(|(side, id)| Step::UnmapUnknown { side, id }),
        1 => (side(), any::<Index>()).prop_map(|(side, which)| Step::DroppedUnmap { side, which }),
        5 => (shape, any::<Index>(), any::<Index>(), any::<Index>(), any::<Index>(), any::<Index>())
            .prop_map(|(shape, src, dst, len, remote, local)| Step::Get {
                shape, src, dst, len, remote, local,
            }),
    ]
}

/// Run `cases` random step sequences and check them against a model.
///
/// Each sequence runs on a fresh pair from `factory`, checking every result
/// and, after every step, both live counts against the model. Panics with
/// the smallest failing sequence proptest finds.
///
/// Builds its own runtime: call it from a plain `#[test]`, not from inside an
/// async runtime.
pub fn model_based<F, Fut>(factory: F, cases: u32)
where
    F: Fn() -> Fut,
    Fut: Future<Output = BackendPair>,
{
    let runtime = kit_runtime();
    let config = Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: 256,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let steps = prop::collection::vec(step(), 1..=MAX_STEPS);
    let result = runner.run(&steps, |steps| {
        runtime.block_on(async {
            let pair = factory().await;
            run_case(&pair, &steps).await?;
            pair.teardown().await;
            Ok(())
        })
    });
    if let Err(failure) = result {
        panic!("model-based conformance failed: {failure}");
    }
}

/// What the backends must hold for one case.
struct Model<'p> {
    pair: &'p BackendPair,
    owner: Vec<Mapped>,
    consumer: Vec<Mapped>,
    /// Ids this case unmapped with an `Ok` result, per side.
    retired: Vec<(Side, u64)>,
    owner_baseline: Option<usize>,
    consumer_baseline: Option<usize>,
}

impl<'p> Model<'p> {
    fn backend(&self, side: Side) -> &'p dyn RdmaBackend {
        match side {
            Side::Owner => &*self.pair.owner,
            Side::Consumer => &*self.pair.consumer,
        }
    }

    fn regions(&mut self, side: Side) -> &mut Vec<Mapped> {
        match side {
            Side::Owner => &mut self.owner,
            Side::Consumer => &mut self.consumer,
        }
    }

    fn expected(&self, side: Side) -> Option<usize> {
        match side {
            Side::Owner => plus(self.owner_baseline, self.owner.len()),
            Side::Consumer => plus(self.consumer_baseline, self.consumer.len()),
        }
    }

    fn assert_counts(&self, what: &str) {
        for side in [Side::Owner, Side::Consumer] {
            assert_live_now(
                self.backend(side),
                self.expected(side),
                &format!("{side:?} {what}"),
            );
        }
    }

    fn is_known(&self, side: Side, id: u64) -> bool {
        let live = match side {
            Side::Owner => &self.owner,
            Side::Consumer => &self.consumer,
        };
        live.iter().any(|m| m.id() == id) || self.retired.contains(&(side, id))
    }
}

async fn run_case(pair: &BackendPair, steps: &[Step]) -> Result<(), TestCaseError> {
    let mut model = Model {
        pair,
        owner: Vec::new(),
        consumer: Vec::new(),
        retired: Vec::new(),
        owner_baseline: live(&*pair.owner),
        consumer_baseline: live(&*pair.consumer),
    };
    for (n, step) in steps.iter().enumerate() {
        run_step(&mut model, step).await?;
        model.assert_counts(&format!("after step {n} ({step:?})"));
    }
    for side in [Side::Owner, Side::Consumer] {
        let backend = model.backend(side);
        for mapped in std::mem::take(model.regions(side)) {
            mapped.release(backend).await;
        }
    }
    model.assert_counts("after unmapping everything");
    Ok(())
}

async fn run_step(model: &mut Model<'_>, step: &Step) -> Result<(), TestCaseError> {
    match *step {
        Step::Map { side, size } => {
            let fill = fill_for(side);
            let mapped = Mapped::filled(model.backend(side), *size.get(&SIZES), fill).await;
            model.regions(side).push(mapped);
        }
        Step::CancelledMap { side, size, polls } => {
            cancelled_map(model, side, *size.get(&SIZES), polls).await;
        }
        Step::Unmap { side, which } => {
            let regions = model.regions(side);
            if !regions.is_empty() {
                let mapped = regions.remove(which.index(regions.len()));
                let id = mapped.id();
                let backend = model.backend(side);
                mapped.release(backend).await;
                model.retired.push((side, id));
            }
        }
        Step::UnmapAgain { side, which } => {
            let retired: Vec<u64> = model
                .retired
                .iter()
                .filter(|(s, _)| *s == side)
                .map(|(_, id)| *id)
                .collect();
            if !retired.is_empty() {
                let id = *which.get(&retired);
                prop_assert_eq!(
                    model.backend(side).unmap(id).await,
                    Ok(()),
                    "repeated unmap"
                );
            }
        }
        Step::UnmapUnknown { side, id } => {
            if !model.is_known(side, id) {
                prop_assert_eq!(
                    model.backend(side).unmap(id).await,
                    Ok(()),
                    "unknown-id unmap"
                );
            }
        }
        Step::DroppedUnmap { side, which } => {
            let regions = model.regions(side);
            if !regions.is_empty() {
                let mapped = regions.remove(which.index(regions.len()));
                let id = mapped.id();
                let backend = model.backend(side);
                let mut unmap = backend.unmap(id);
                let first = poll_once(unmap.as_mut());
                drop(unmap);
                if let Poll::Ready(outcome) = first {
                    prop_assert_eq!(outcome, Ok(()), "unmap completing on its first poll");
                }
                let within = model.pair.capabilities.rollback_within;
                settle_live(
                    backend,
                    model.expected(side),
                    within,
                    "after a dropped unmap",
                )
                .await;
                // The confirming unmap is what allows freeing the memory.
                mapped.release(backend).await;
                model.retired.push((side, id));
            }
        }
        Step::Get {
            shape,
            src,
            dst,
            len,
            remote,
            local,
        } => {
            run_get(model, shape, [src, dst, len, remote, local]).await?;
        }
    }
    Ok(())
}

fn fill_for(side: Side) -> fn(usize) -> u8 {
    match side {
        Side::Owner => source_byte,
        Side::Consumer => |_| FILL,
    }
}

async fn cancelled_map(model: &mut Model<'_>, side: Side, size: usize, polls: u8) {
    let backend = model.backend(side);
    let mut buf = KitBuffer::filled(size, fill_for(side));
    buf.mark_registered();
    let map = kit_map(backend, buf.addr(), buf.len());
    let outcome = poll_then_drop(map, usize::from(polls), POLL_GAP).await;
    match outcome {
        Some(Ok(region)) => model.regions(side).push(Mapped { buf, region }),
        Some(Err(e)) => panic!("map of a valid buffer failed: {e}"),
        None => {
            let within = model.pair.capabilities.rollback_within;
            if settle_live_and_hold(
                backend,
                model.expected(side),
                within,
                "after a cancelled map",
            )
            .await
            {
                buf.mark_unregistered();
            }
        }
    }
}

async fn run_get(
    model: &Model<'_>,
    shape: GetShape,
    picks: [Index; 5],
) -> Result<(), TestCaseError> {
    let [src, dst, len, remote, local] = picks;
    if model.owner.is_empty() || model.consumer.is_empty() {
        return Ok(());
    }
    let src = src.get(&model.owner);
    let dst = dst.get(&model.consumer);
    let (src_len, dst_len) = (src.buf.len(), dst.buf.len());
    let shape = match shape {
        GetShape::RemoteOutOfRange if !model.pair.capabilities.remote_bounds_enforced => {
            GetShape::Valid
        }
        other => other,
    };
    let before = dst.buf.snapshot();
    let len = 1 + len.index(src_len.min(dst_len));
    let (remote_off, local_off, bytes, expected) = match shape {
        GetShape::Valid => (
            remote.index(src_len - len + 1),
            local.index(dst_len - len + 1),
            len,
            Ok(()),
        ),
        GetShape::ZeroLength => (
            remote.index(src_len),
            local.index(dst_len),
            0,
            Err(RdmaError::OutOfRange),
        ),
        GetShape::LocalOutOfRange => (
            remote.index(src_len - len + 1),
            dst_len - len + 1 + local.index(3),
            len,
            Err(RdmaError::OutOfRange),
        ),
        GetShape::RemoteOutOfRange => (
            src_len - len + 1 + remote.index(3),
            local.index(dst_len - len + 1),
            len,
            Err(RdmaError::OutOfRange),
        ),
    };
    let request = get_request(
        model.pair,
        src,
        remote_off as u64,
        dst,
        local_off as u64,
        bytes as u64,
    );
    let outcome = kit_get(&*model.pair.consumer, request).await;
    prop_assert_eq!(
        &outcome,
        &expected,
        "GET {:?} of {} B, {} -> {}",
        shape,
        bytes,
        remote_off,
        local_off
    );
    let after = dst.buf.snapshot();
    if outcome.is_ok() {
        let mut want = before;
        for i in 0..bytes {
            want[local_off + i] = source_byte(remote_off + i);
        }
        prop_assert!(after == want, "destination after a valid GET");
    } else {
        prop_assert!(after == before, "destination changed by a refused GET");
    }
    Ok(())
}
