//! The reader's side: a notice waits until the reads it accompanies have
//! completed, and goes out only if all of them succeeded.
//!
//! A driver [`attach`](NoticeGate::attach)es a notice to the operations
//! it names (the reads of one GET or one list, by the driver's own keys)
//! and reports each of them with [`op_finished`](NoticeGate::op_finished)
//! when it completes, which for a read is after the transport released
//! its destination. When the last one is reported the gate says whether
//! to [send](Finished::Send) the notice or [withhold](Finished::Withhold)
//! it: a notice that accompanied a failed read never reaches the owner,
//! so an owner that frees memory on a notice frees it only after reads
//! that succeeded.
//!
//! An operation is watched by at most one notice at a time; the gate holds
//! what its caller attached and nothing more.

use std::hash::Hash;

use rustc_hash::{FxHashMap, FxHashSet};

/// What [`NoticeGate::attach`] did with a notice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attached<N> {
    /// It accompanies no operation: send it now.
    Ready(N),
    /// It waits for its operations.
    Waiting,
    /// An operation it names is already watched, or named twice: it is
    /// given back unattached.
    AlreadyWatched(N),
}

/// A notice whose last operation finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finished<N> {
    /// Every operation succeeded: send it.
    Send(N),
    /// An operation failed: do not send it.
    Withhold(N),
}

/// A notice waiting for operations.
#[derive(Debug)]
struct Waiting<N> {
    remaining: usize,
    failed: bool,
    notice: N,
}

/// Notices waiting for the operations they accompany; see the
/// [module](self).
#[derive(Debug)]
pub struct NoticeGate<K, N> {
    waiting: FxHashMap<u64, Waiting<N>>,
    by_op: FxHashMap<K, u64>,
    next: u64,
    /// Mistakes a gate can make, for the simulator to find.
    #[cfg(test)]
    pub(crate) defects: GateDefects,
}

/// Mistakes the simulator must catch (tests only).
#[cfg(test)]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct GateDefects {
    /// Send a notice whose reads did not all succeed.
    pub(crate) sends_after_a_failure: bool,
    /// Release a notice when its first read finishes.
    pub(crate) releases_at_the_first_read: bool,
}

impl<K, N> Default for NoticeGate<K, N> {
    fn default() -> Self {
        NoticeGate {
            waiting: FxHashMap::default(),
            by_op: FxHashMap::default(),
            next: 0,
            #[cfg(test)]
            defects: GateDefects::default(),
        }
    }
}

impl<K: Copy + Eq + Hash, N> NoticeGate<K, N> {
    /// An empty gate.
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes `notice` wait for every operation in `ops`.
    pub fn attach(&mut self, ops: &[K], notice: N) -> Attached<N> {
        if ops.is_empty() {
            return Attached::Ready(notice);
        }
        let mut named = FxHashSet::default();
        let clash = ops
            .iter()
            .any(|op| self.by_op.contains_key(op) || !named.insert(*op));
        if clash {
            return Attached::AlreadyWatched(notice);
        }
        let id = self.next;
        self.next += 1;
        for op in ops {
            self.by_op.insert(*op, id);
        }
        self.waiting.insert(
            id,
            Waiting {
                remaining: ops.len(),
                failed: false,
                notice,
            },
        );
        Attached::Waiting
    }

    /// Reports that `op` completed, and whether it succeeded. `Some` once
    /// it was the last operation of a notice; `None` for an operation no
    /// notice waits for, or not the last.
    pub fn op_finished(&mut self, op: K, succeeded: bool) -> Option<Finished<N>> {
        let id = self.by_op.remove(&op)?;
        let waiting = self.waiting.get_mut(&id)?;
        waiting.remaining -= 1;
        waiting.failed |= !succeeded;
        #[cfg(test)]
        if self.defects.sends_after_a_failure {
            waiting.failed = false;
        }
        #[cfg(test)]
        let early = self.defects.releases_at_the_first_read;
        #[cfg(not(test))]
        let early = false;
        if waiting.remaining > 0 && !early {
            return None;
        }
        let done = self.waiting.remove(&id)?;
        if early {
            self.by_op.retain(|_, notice| *notice != id);
        }
        Some(if done.failed {
            Finished::Withhold(done.notice)
        } else {
            Finished::Send(done.notice)
        })
    }

    /// Gives back every waiting notice, none to be sent: the reader shuts
    /// down before their operations finished.
    pub fn withhold_all(&mut self) -> Vec<N> {
        self.by_op.clear();
        self.waiting.drain().map(|(_, w)| w.notice).collect()
    }

    /// Notices waiting.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_notice_without_reads_is_ready_at_once() {
        let mut gate = NoticeGate::<u64, &str>::new();
        assert_eq!(gate.attach(&[], "alone"), Attached::Ready("alone"));
        assert_eq!(gate.waiting(), 0);
    }

    #[test]
    fn a_notice_goes_out_after_its_last_read() {
        let mut gate = NoticeGate::new();
        assert_eq!(gate.attach(&[1, 2, 3], "done"), Attached::Waiting);
        assert_eq!(gate.op_finished(2, true), None);
        assert_eq!(gate.op_finished(1, true), None);
        assert_eq!(gate.op_finished(3, true), Some(Finished::Send("done")));
        assert_eq!(gate.waiting(), 0);
    }

    /// The owner must never hear "done" for a read that failed: it would
    /// free memory the reader never got.
    #[test]
    fn one_failed_read_withholds_the_notice() {
        let mut gate = NoticeGate::new();
        gate.attach(&[1, 2], "done");
        assert_eq!(gate.op_finished(1, false), None);
        assert_eq!(gate.op_finished(2, true), Some(Finished::Withhold("done")));
    }

    #[test]
    fn an_operation_is_watched_by_one_notice_only() {
        let mut gate = NoticeGate::new();
        gate.attach(&[1, 2], "first");
        assert_eq!(
            gate.attach(&[2, 3], "second"),
            Attached::AlreadyWatched("second")
        );
        assert_eq!(
            gate.attach(&[4, 4], "twice"),
            Attached::AlreadyWatched("twice")
        );
        assert_eq!(gate.waiting(), 1, "the refused notices hold nothing");
        assert_eq!(gate.op_finished(3, true), None);
        assert_eq!(gate.op_finished(4, true), None);
    }

    #[test]
    fn shutdown_withholds_what_still_waits() {
        let mut gate = NoticeGate::new();
        gate.attach(&[1], "a");
        gate.attach(&[2, 3], "b");
        gate.op_finished(2, true);
        let mut withheld = gate.withhold_all();
        withheld.sort_unstable();
        assert_eq!(withheld, ["a", "b"]);
        assert_eq!(gate.op_finished(3, true), None);
        assert_eq!(gate.waiting(), 0);
    }

    proptest! {
        /// Notices over random sets of reads, finished in a random order
        /// with random outcomes: each comes out exactly once, only after
        /// its last read, and is sent exactly when all its reads succeeded.
        #[test]
        fn every_notice_comes_out_once_after_its_reads(
            groups in proptest::collection::vec(1..6usize, 1..12),
            order_seed: u64,
            failures in proptest::collection::vec(any::<bool>(), 64),
        ) {
            let mut gate = NoticeGate::new();
            let mut ops = Vec::new();
            for (notice, &size) in groups.iter().enumerate() {
                let members: Vec<u64> = (0..size).map(|i| (notice * 8 + i) as u64).collect();
                prop_assert_eq!(gate.attach(&members, notice), Attached::Waiting);
                ops.extend(members.into_iter().map(|op| (op, notice)));
            }
            // A seeded shuffle of the finishing order.
            let mut state = order_seed | 1;
            for i in (1..ops.len()).rev() {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ops.swap(i, (state % (i as u64 + 1)) as usize);
            }
            let mut remaining = groups.clone();
            let mut any_failed = vec![false; groups.len()];
            let mut out = vec![0; groups.len()];
            for (i, (op, notice)) in ops.iter().enumerate() {
                let ok = !failures[i % failures.len()];
                remaining[*notice] -= 1;
                any_failed[*notice] |= !ok;
                match gate.op_finished(*op, ok) {
                    None => prop_assert!(remaining[*notice] > 0),
                    Some(finished) => {
                        prop_assert_eq!(remaining[*notice], 0);
                        let expected = if any_failed[*notice] {
                            Finished::Withhold(*notice)
                        } else {
                            Finished::Send(*notice)
                        };
                        prop_assert_eq!(finished, expected);
                        out[*notice] += 1;
                    }
                }
            }
            prop_assert!(out.iter().all(|&n| n == 1));
            prop_assert_eq!(gate.waiting(), 0);
        }
    }
}
