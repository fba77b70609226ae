//! The granule allocator: constant-time allocation and free of runs of 4 KiB
//! granules inside one arena.
//! A two-level segregated fit (TLSF): free runs sit in lists by size class
//! (a level per power of two, split in 16), with a bitmap per level.
//! Allocation rounds up to the next class, so any run found fits, and finds
//! it with two bit scans; free merges with both neighbours through side
//! tables. The allocator only does arithmetic on granule numbers; callers
//! pass back exactly the `(start, len)` they were given.

/// Second-level classes per power of two, as a shift.
const SL_LOG2: u32 = 4;
/// Second-level classes per power of two.
const SL_COUNT: u32 = 1 << SL_LOG2;
/// First-level classes: one for sizes below `SL_COUNT`, then one per power
/// of two from `2^SL_LOG2` to `2^31`.
const FL_COUNT: usize = (32 - SL_LOG2 + 1) as usize;
/// End of a free list.
const NIL: u32 = u32::MAX;

/// Free-run bookkeeping for one arena of `total` granules.
#[derive(Debug)]
pub(crate) struct GranuleAllocator {
    total: u32,
    free: u32,
    fl_bitmap: u32,
    sl_bitmap: [u32; FL_COUNT],
    heads: [[u32; SL_COUNT as usize]; FL_COUNT],
    /// Length of the free run starting at this granule; 0 if none does.
    run_len_at_start: Vec<u32>,
    /// `start + 1` of the free run ending at this granule; 0 if none does.
    run_start_at_end: Vec<u32>,
    /// Free-list links of the run starting at this granule.
    next: Vec<u32>,
    prev: Vec<u32>,
}

/// Size class of a run of `len` granules (`len >= 1`).
fn class_of(len: u64) -> (usize, u32) {
    if len < u64::from(SL_COUNT) {
        return (0, len as u32);
    }
    let log2 = 63 - len.leading_zeros();
    let sl = (len >> (log2 - SL_LOG2)) as u32 - SL_COUNT;
    ((log2 - SL_LOG2 + 1) as usize, sl)
}

/// The smallest class whose every run holds at least `len` granules.
fn class_at_least(len: u64) -> (usize, u32) {
    if len < u64::from(SL_COUNT) {
        return class_of(len);
    }
    let log2 = 63 - len.leading_zeros();
    class_of(len + (1u64 << (log2 - SL_LOG2)) - 1)
}

impl GranuleAllocator {
    /// An allocator with every one of `total` granules free. `total` must be
    /// at least 1 and below `u32::MAX`.
    pub(crate) fn new(total: u32) -> Self {
        assert!(
            total > 0 && total < u32::MAX,
            "arena granule count out of range"
        );
        let n = total as usize;
        let mut allocator = Self {
            total,
            free: 0,
            fl_bitmap: 0,
            sl_bitmap: [0; FL_COUNT],
            heads: [[NIL; SL_COUNT as usize]; FL_COUNT],
            run_len_at_start: vec![0; n],
            run_start_at_end: vec![0; n],
            next: vec![NIL; n],
            prev: vec![NIL; n],
        };
        allocator.file(0, total);
        allocator.free = total;
        allocator
    }

    /// Granules not allocated.
    pub(crate) fn free_granules(&self) -> u32 {
        self.free
    }

    /// Whether nothing is allocated.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.free == self.total
    }

    /// Allocate a run of `len` granules; its first granule, or `None` if no
    /// free run of a large enough class exists.
    pub(crate) fn allocate(&mut self, len: u32) -> Option<u32> {
        if len == 0 || len > self.free {
            return None;
        }
        let (fl, sl) = class_at_least(u64::from(len));
        let start = match self.first_nonempty_from(fl, sl) {
            Some((fl, sl)) => self.heads[fl][sl as usize],
            None => self.head_of_own_class_if_large_enough(len)?,
        };
        let run = self.run_len_at_start[start as usize];
        debug_assert!(run >= len);
        self.unfile(start, run);
        if run > len {
            self.file(start + len, run - len);
        }
        self.free -= len;
        Some(start)
    }

    /// Return a run previously handed out by [`allocate`](Self::allocate).
    pub(crate) fn release(&mut self, start: u32, len: u32) {
        debug_assert!(len > 0 && start.checked_add(len).is_some_and(|e| e <= self.total));
        let (mut run_start, mut run_len) = (start, len);
        let after = start + len;
        if after < self.total {
            let next_len = self.run_len_at_start[after as usize];
            if next_len != 0 {
                self.unfile(after, next_len);
                run_len += next_len;
            }
        }
        if start > 0 {
            let prev_start_plus_one = self.run_start_at_end[(start - 1) as usize];
            if prev_start_plus_one != 0 {
                let prev_start = prev_start_plus_one - 1;
                let prev_len = self.run_len_at_start[prev_start as usize];
                self.unfile(prev_start, prev_len);
                run_start = prev_start;
                run_len += prev_len;
            }
        }
        self.file(run_start, run_len);
        self.free += len;
    }

    /// Rounding up skips the request's own class; its first run may still
    /// fit (always, in an untouched arena), and checking one run is O(1).
    fn head_of_own_class_if_large_enough(&self, len: u32) -> Option<u32> {
        let (fl, sl) = class_of(u64::from(len));
        let head = self.heads[fl][sl as usize];
        (head != NIL && self.run_len_at_start[head as usize] >= len).then_some(head)
    }

    fn first_nonempty_from(&self, fl: usize, sl: u32) -> Option<(usize, u32)> {
        if fl >= FL_COUNT {
            return None;
        }
        let same_level = self.sl_bitmap[fl] & (u32::MAX << sl);
        if same_level != 0 {
            return Some((fl, same_level.trailing_zeros()));
        }
        let higher = self
            .fl_bitmap
            .checked_shr(fl as u32 + 1)
            .map_or(0, |bits| bits << (fl as u32 + 1));
        if higher == 0 {
            return None;
        }
        let fl = higher.trailing_zeros() as usize;
        Some((fl, self.sl_bitmap[fl].trailing_zeros()))
    }

    /// Put the free run `[start, start + len)` on its class list.
    fn file(&mut self, start: u32, len: u32) {
        let (fl, sl) = class_of(u64::from(len));
        let head = self.heads[fl][sl as usize];
        self.next[start as usize] = head;
        self.prev[start as usize] = NIL;
        if head != NIL {
            self.prev[head as usize] = start;
        }
        self.heads[fl][sl as usize] = start;
        self.fl_bitmap |= 1 << fl;
        self.sl_bitmap[fl] |= 1 << sl;
        self.run_len_at_start[start as usize] = len;
        self.run_start_at_end[(start + len - 1) as usize] = start + 1;
    }

    /// Take the free run `[start, start + len)` off its class list.
    fn unfile(&mut self, start: u32, len: u32) {
        let (fl, sl) = class_of(u64::from(len));
        let (next, prev) = (self.next[start as usize], self.prev[start as usize]);
        if prev != NIL {
            self.next[prev as usize] = next;
        } else {
            self.heads[fl][sl as usize] = next;
            if next == NIL {
                self.sl_bitmap[fl] &= !(1 << sl);
                if self.sl_bitmap[fl] == 0 {
                    self.fl_bitmap &= !(1 << fl);
                }
            }
        }
        if next != NIL {
            self.prev[next as usize] = prev;
        }
        self.run_len_at_start[start as usize] = 0;
        self.run_start_at_end[(start + len - 1) as usize] = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    #[test]
    fn classes_are_monotonic_and_rounding_never_undershoots() {
        let mut last = (0, 0);
        for len in 1..5000u64 {
            let class = class_of(len);
            assert!(class >= last, "class_of must not decrease at {len}");
            last = class;
            // Every run in class_at_least(len) is at least `len` long: the
            // smallest member of that class is >= len.
            let target = class_at_least(len);
            let smallest = (1..=len * 2).find(|l| class_of(*l) == target).unwrap();
            assert!(
                smallest >= len,
                "len {len}: class {target:?} admits {smallest}"
            );
        }
    }

    #[test]
    fn whole_arena_allocates_then_nothing_is_left() {
        let mut a = GranuleAllocator::new(100);
        assert_eq!(a.allocate(100), Some(0));
        assert_eq!(a.allocate(1), None);
        a.release(0, 100);
        assert!(a.is_empty());
    }

    #[test]
    fn arena_whose_size_is_not_a_class_boundary_serves_a_whole_arena_request() {
        let mut a = GranuleAllocator::new(39);
        assert_eq!(a.allocate(39), Some(0));
    }

    #[test]
    fn freed_neighbours_coalesce_back_into_one_run() {
        let mut a = GranuleAllocator::new(64);
        let x = a.allocate(16).unwrap();
        let y = a.allocate(16).unwrap();
        let z = a.allocate(32).unwrap();
        a.release(y, 16);
        a.release(x, 16);
        a.release(z, 32);
        assert_eq!(a.allocate(64), Some(0));
    }

    #[test]
    fn space_freed_is_reused() {
        let mut a = GranuleAllocator::new(8);
        let x = a.allocate(8).unwrap();
        a.release(x, 8);
        assert_eq!(a.allocate(8), Some(x));
    }

    #[test]
    fn zero_and_oversized_requests_are_refused() {
        let mut a = GranuleAllocator::new(8);
        assert_eq!(a.allocate(0), None);
        assert_eq!(a.allocate(9), None);
        assert_eq!(a.free_granules(), 8);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u32),
        Free(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1u32..300).prop_map(Op::Alloc),
            any::<usize>().prop_map(Op::Free),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn allocations_never_overlap_and_free_space_is_accounted(
            total in 1u32..2048,
            ops in proptest::collection::vec(op(), 1..200),
        ) {
            let mut a = GranuleAllocator::new(total);
            let mut live: BTreeMap<u32, u32> = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Alloc(len) => {
                        if let Some(start) = a.allocate(len) {
                            prop_assert!(start + len <= total);
                            if let Some((s, l)) = live.range(..start + len).next_back() {
                                prop_assert!(s + l <= start, "overlap with [{s}, {})", s + l);
                            }
                            live.insert(start, len);
                        } else {
                            // Refusal is honest: no free gap of `len` granules
                            // large enough for the rounded class exists.
                            let mut cursor = 0;
                            let mut largest_gap = 0;
                            for (s, l) in &live {
                                largest_gap = largest_gap.max(s - cursor);
                                cursor = s + l;
                            }
                            largest_gap = largest_gap.max(total - cursor);
                            let (fl, sl) = class_at_least(u64::from(len));
                            prop_assert!(class_of(u64::from(largest_gap.max(1))) < (fl, sl) || largest_gap < len);
                        }
                    }
                    Op::Free(pick) => {
                        if !live.is_empty() {
                            let key = *live.keys().nth(pick % live.len()).unwrap();
                            let len = live.remove(&key).unwrap();
                            a.release(key, len);
                        }
                    }
                }
                let used: u32 = live.values().sum();
                prop_assert_eq!(a.free_granules(), total - used);
            }
            for (s, l) in std::mem::take(&mut live) {
                a.release(s, l);
            }
            prop_assert_eq!(a.allocate(total), Some(0));
        }
    }
}
