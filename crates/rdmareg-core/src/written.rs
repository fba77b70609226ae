//! Which byte ranges of a registration served writes filled whole: what an
//! owner can tell about the writes of a writer that vanished mid-transfer.
//!
//! An owner's backend keeps one [`WrittenLog`] per registration that
//! allows writes. A write is recorded when its receive completed, so
//! exactly the ranges whose bytes are in are listed; a write that was
//! refused, or whose receive failed, never is. [`WrittenLog::take`] hands
//! the log over as [`WrittenRanges`] and starts an empty one; the log ends
//! with the registration.
//!
//! # Bounded, never over-approximated
//!
//! Overlapping and adjacent ranges are coalesced, and the log keeps at most
//! a fixed number of disjoint ranges ([`MAX_WRITTEN_RANGES`] unless its
//! owner chose another). A write that would need one more is left out and
//! the log marked incomplete ([`WrittenRanges::incomplete`]): a listed
//! range is always one whose bytes landed, and a caller told the list is
//! complete can trust that nothing else landed. A failed write over a
//! listed range takes its overlap out of the list (its receive may have
//! changed some of those bytes); should that split a range past the bound,
//! a piece is left out, and the log marked incomplete too.

use std::collections::BTreeMap;
use std::ops::Range;

/// Most disjoint ranges one registration's [`WrittenLog`] keeps by default.
///
/// At 16 bytes a range, at most 64 KiB per registration; a writer that
/// writes every other byte of a region cannot grow the owner past it.
pub const MAX_WRITTEN_RANGES: usize = 4096;

/// The ranges of a registration that served writes filled whole since the
/// log was last taken, as offsets from the registration's first byte.
///
/// `ranges` is sorted, and no two of its ranges overlap or touch (they
/// were coalesced); none is empty.
///
/// # What a caller may conclude
///
/// - Every byte of a listed range was written by a write whose bytes all
///   arrived, and no write that failed overlapped it since. A write still
///   in flight when the log was taken, or one after, may change it again.
/// - If `incomplete` is false, a byte outside the list was not written by
///   a completed served write since the last take. If it is true, some
///   were left out (the log was at its bound): nothing can be concluded
///   about a byte outside the list.
/// - Writes the owner's engine does not serve (a same-host direct lane)
///   are never listed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WrittenRanges {
    /// Offsets from the registration's start, sorted, disjoint, not
    /// touching.
    pub ranges: Vec<Range<u64>>,
    /// Writes landed that the list leaves out: the log was at its bound.
    pub incomplete: bool,
}

impl WrittenRanges {
    /// Whether every byte of `range` lies in a listed range. An empty
    /// `range` is not covered.
    pub fn covers(&self, range: Range<u64>) -> bool {
        if range.is_empty() {
            return false;
        }
        let at = self.ranges.partition_point(|r| r.end <= range.start);
        self.ranges
            .get(at)
            .is_some_and(|r| r.start <= range.start && range.end <= r.end)
    }

    /// Bytes the list holds, over every range.
    pub fn listed_bytes(&self) -> u64 {
        self.ranges.iter().map(|r| r.end - r.start).sum()
    }

    /// Nothing listed and nothing left out: no served write landed since
    /// the last take.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty() && !self.incomplete
    }
}

/// A registration's bounded log of the ranges served writes filled whole
/// (module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrittenLog {
    /// Start to end of each range; disjoint and not touching.
    ranges: BTreeMap<u64, u64>,
    limit: usize,
    incomplete: bool,
}

impl Default for WrittenLog {
    /// An empty log of at most [`MAX_WRITTEN_RANGES`] ranges.
    fn default() -> Self {
        WrittenLog::with_limit(MAX_WRITTEN_RANGES)
    }
}

impl WrittenLog {
    /// An empty log of at most `limit` disjoint ranges (at least 1).
    pub fn with_limit(limit: usize) -> Self {
        WrittenLog {
            ranges: BTreeMap::new(),
            limit: limit.max(1),
            incomplete: false,
        }
    }

    /// A write's bytes all arrived in `range` (offsets from the
    /// registration's start): it is listed, joined with every range it
    /// overlaps or touches; past the bound it is left out and the log
    /// turns incomplete. An empty range changes nothing.
    pub fn record(&mut self, range: Range<u64>) {
        if range.is_empty() {
            return;
        }
        let (mut start, mut end) = (range.start, range.end);
        let joined: Vec<(u64, u64)> = self
            .ranges
            .range(..=end)
            .rev()
            .take_while(|&(_, &e)| e >= start)
            .map(|(&s, &e)| (s, e))
            .collect();
        if joined.is_empty() && self.ranges.len() >= self.limit {
            self.incomplete = true;
            return;
        }
        for (s, e) in joined {
            self.ranges.remove(&s);
            start = start.min(s);
            end = end.max(e);
        }
        self.ranges.insert(start, end);
    }

    /// A write into `range` failed: some of its bytes may have arrived, so
    /// no byte of `range` stays listed. A listed range it cuts in two
    /// keeps both pieces while the bound allows; else one is left out and
    /// the log turns incomplete.
    pub fn forget(&mut self, range: Range<u64>) {
        if range.is_empty() {
            return;
        }
        let cut: Vec<(u64, u64)> = self
            .ranges
            .range(..range.end)
            .rev()
            .take_while(|&(_, &e)| e > range.start)
            .map(|(&s, &e)| (s, e))
            .collect();
        for (s, e) in cut {
            self.ranges.remove(&s);
            for (from, to) in [(s, range.start), (range.end, e)] {
                if from >= to {
                    continue;
                }
                if self.ranges.len() >= self.limit {
                    self.incomplete = true;
                } else {
                    self.ranges.insert(from, to);
                }
            }
        }
    }

    /// Hands the log over and starts an empty one, of the same bound.
    pub fn take(&mut self) -> WrittenRanges {
        let ranges = std::mem::take(&mut self.ranges);
        WrittenRanges {
            ranges: ranges.into_iter().map(|(s, e)| s..e).collect(),
            incomplete: std::mem::take(&mut self.incomplete),
        }
    }

    /// Disjoint ranges listed now.
    pub fn len(&self) -> usize {
        self.ranges.len()
    }

    /// Nothing listed and nothing left out.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty() && !self.incomplete
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Overlapping and touching ranges join; a gap keeps them apart.
    #[test]
    fn touching_and_overlapping_writes_are_coalesced() {
        let mut log = WrittenLog::default();
        for range in [10..20, 30..40, 20..25, 35..50, 0..5, 5..8] {
            log.record(range);
        }
        let taken = log.take();
        assert_eq!(taken.ranges, [0..8, 10..25, 30..50]);
        assert!(!taken.incomplete);
        assert!(taken.covers(12..25) && !taken.covers(8..11) && !taken.covers(3..3));
        assert_eq!(taken.listed_bytes(), 8 + 15 + 20);
        assert!(log.take().is_empty(), "a second take is empty");
    }

    /// Past the bound a write that needs a range of its own is left out
    /// and the log says so; a write that joins a listed range still
    /// counts, and a take starts over.
    #[test]
    fn a_full_log_leaves_writes_out_and_says_so() {
        let mut log = WrittenLog::with_limit(2);
        log.record(0..4);
        log.record(10..14);
        log.record(20..24);
        log.record(4..6);
        let taken = log.take();
        assert_eq!(taken.ranges, [0..6, 10..14]);
        assert!(taken.incomplete);
        log.record(20..24);
        let taken = log.take();
        assert_eq!((taken.ranges.len(), taken.covers(20..24)), (1, true));
    }

    /// A failed write takes its overlap out of the list; a cut past the
    /// bound leaves a piece out and marks the log incomplete.
    #[test]
    fn a_failed_write_is_taken_out_of_the_list() {
        let mut log = WrittenLog::with_limit(2);
        log.record(0..10);
        log.forget(3..5);
        assert_eq!(log.len(), 2);
        log.forget(8..20);
        let taken = log.take();
        assert_eq!(taken.ranges, [0..3, 5..8]);
        assert!(!taken.incomplete);
        log.record(0..10);
        log.record(20..30);
        log.forget(24..26);
        let taken = log.take();
        assert!(taken.incomplete);
        assert_eq!(taken.ranges.len(), 2);
        assert!(taken.covers(0..10));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Record(u64, u64),
        Forget(u64, u64),
        Take,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0u64..96, 0u64..12).prop_map(|(s, l)| Op::Record(s, s + l)),
            2 => (0u64..96, 0u64..12).prop_map(|(s, l)| Op::Forget(s, s + l)),
            1 => Just(Op::Take),
        ]
    }

    proptest! {
        /// Against a byte map of what landed: a listed byte landed; a
        /// complete list lists every byte that landed; ranges are sorted,
        /// non-empty, disjoint, not touching and within the bound.
        #[test]
        fn the_log_lists_only_what_landed(
            ops in proptest::collection::vec(op(), 1..60),
            limit in 1usize..6,
        ) {
            let mut log = WrittenLog::with_limit(limit);
            let mut landed = [false; 128];
            let check = |taken: &WrittenRanges, landed: &[bool; 128]| {
                let mut listed = [false; 128];
                for pair in taken.ranges.windows(2) {
                    prop_assert!(pair[0].end < pair[1].start, "{:?}", taken.ranges);
                }
                prop_assert!(taken.ranges.len() <= limit);
                for r in &taken.ranges {
                    prop_assert!(!r.is_empty());
                    for b in r.clone() {
                        listed[b as usize] = true;
                    }
                }
                for b in 0..128 {
                    prop_assert!(!listed[b] || landed[b], "byte {b} listed, not landed");
                    if !taken.incomplete {
                        prop_assert!(!landed[b] || listed[b], "byte {b} landed, not listed");
                    }
                }
                Ok(())
            };
            for op in ops {
                match op {
                    Op::Record(s, e) => {
                        log.record(s..e);
                        landed[s as usize..e as usize].fill(true);
                    }
                    Op::Forget(s, e) => {
                        log.forget(s..e);
                        landed[s as usize..e as usize].fill(false);
                    }
                    Op::Take => {
                        check(&log.take(), &landed)?;
                        landed = [false; 128];
                    }
                }
            }
            check(&log.take(), &landed)?;
        }
    }
}
