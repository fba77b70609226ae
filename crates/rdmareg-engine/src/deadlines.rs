//! The queue of reads' deadlines, earliest first ([`DeadlineQueue`]).
//!
//! Every read enters its deadline here when it is posted, and the loop takes
//! entries off the front as they expire or turn out stale (their read
//! finished: entries are never removed early; the op table's generation
//! tells a stale one apart).
//!
//! # Why not one binary heap
//!
//! Deadlines almost always arrive in order: a read's deadline is the clock
//! when it is posted plus its caller's timeout, and callers mostly use one
//! timeout (the registry passes its configured one with every read), so a
//! list of 1000 reads pushes 1000 equal deadlines. A binary heap takes each
//! of those off in about ten steps through an array the list's own bytes
//! have just pushed out of the cache, on the thread the list waits on. So
//! deadlines that come in order go to a FIFO, whose front is the earliest
//! of them; only a deadline earlier than the FIFO's last goes to a heap.
//! The front of the queue is the earlier of the two fronts.
//!
//! The order among equal deadlines is by `(slot, generation)`, as in a heap
//! of the whole tuples, except that equal deadlines in the FIFO keep their
//! arrival order; nothing depends on the order among equal deadlines, but
//! `pop` must take exactly the entry `peek` showed (the op table's
//! `expired` peeks, checks, then pops).
//!
//! One read with a longer timeout than the rest stays at the FIFO's back,
//! and reads posted after it go to the heap until their deadlines pass it:
//! no worse than one heap for everything.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::Instant;

/// One read's deadline: `(deadline, op slot, op generation)`.
pub type Deadline = (Instant, u32, u64);

/// Deadlines, earliest first (see the module docs).
#[derive(Debug, Default)]
pub struct DeadlineQueue {
    /// Deadlines pushed in non-decreasing order of time.
    in_order: VecDeque<Deadline>,
    /// Deadlines earlier than the FIFO's last when they came.
    out_of_order: BinaryHeap<Reverse<Deadline>>,
}

impl DeadlineQueue {
    /// Adds `deadline`.
    pub fn push(&mut self, deadline: Deadline) {
        match self.in_order.back() {
            Some(last) if deadline.0 < last.0 => self.out_of_order.push(Reverse(deadline)),
            _ => self.in_order.push_back(deadline),
        }
    }

    /// The earliest deadline, if any.
    pub fn peek(&self) -> Option<Deadline> {
        match (self.in_order.front(), self.out_of_order.peek()) {
            (Some(&fifo), Some(&Reverse(heap))) => Some(fifo.min(heap)),
            (Some(&fifo), None) => Some(fifo),
            (None, Some(&Reverse(heap))) => Some(heap),
            (None, None) => None,
        }
    }

    /// Takes the earliest deadline off the queue.
    pub fn pop(&mut self) -> Option<Deadline> {
        let from_fifo = match (self.in_order.front(), self.out_of_order.peek()) {
            (Some(fifo), Some(Reverse(heap))) => fifo <= heap,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (None, None) => return None,
        };
        if from_fifo {
            self.in_order.pop_front()
        } else {
            self.out_of_order.pop().map(|Reverse(deadline)| deadline)
        }
    }

    /// Deadlines in the queue, stale ones included.
    pub fn len(&self) -> usize {
        self.in_order.len() + self.out_of_order.len()
    }

    /// Whether the queue holds no deadline at all.
    pub fn is_empty(&self) -> bool {
        self.in_order.is_empty() && self.out_of_order.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn deadlines_pushed_in_order_come_out_in_order() {
        let start = Instant::now();
        let mut queue = DeadlineQueue::default();
        for n in 0..5u32 {
            queue.push((start + Duration::from_millis(u64::from(n)), n, 0));
        }
        let order: Vec<u32> = std::iter::from_fn(|| queue.pop()).map(|d| d.1).collect();
        assert_eq!(order, [0, 1, 2, 3, 4]);
        assert_eq!(queue.len(), 0);
    }

    #[test]
    fn an_earlier_deadline_pushed_late_comes_out_first() {
        let start = Instant::now();
        let mut queue = DeadlineQueue::default();
        queue.push((start + Duration::from_secs(30), 1, 1));
        queue.push((start + Duration::from_secs(30), 2, 2));
        queue.push((start + Duration::from_millis(5), 3, 3));
        assert_eq!(queue.peek().map(|d| d.1), Some(3));
        let order: Vec<u32> = std::iter::from_fn(|| queue.pop()).map(|d| d.1).collect();
        assert_eq!(order, [3, 1, 2]);
    }

    #[test]
    fn pop_takes_the_entry_peek_showed_when_both_halves_hold_the_same_time() {
        let start = Instant::now();
        let soon = start + Duration::from_secs(30);
        let mut queue = DeadlineQueue::default();
        queue.push((soon, 5, 1));
        queue.push((start + Duration::from_secs(60), 6, 2));
        // Earlier than the FIFO's last: to the heap, at the same time as
        // the FIFO's front.
        queue.push((soon, 2, 3));
        queue.push((soon, 9, 4));
        while let Some(front) = queue.peek() {
            assert_eq!(queue.pop(), Some(front));
        }
        assert_eq!(queue.len(), 0);
    }

    #[test]
    fn an_empty_queue_has_no_front() {
        let mut queue = DeadlineQueue::default();
        assert_eq!(queue.peek(), None);
        assert_eq!(queue.pop(), None);
    }

    /// An operation on the queue and on the model.
    #[derive(Debug, Clone)]
    enum Step {
        Push { millis: u64, slot: u32 },
        Pop,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            // Mostly in order, as callers with one timeout push them.
            3 => (0..40u64, 0..8u32).prop_map(|(millis, slot)| Step::Push { millis, slot }),
            2 => Just(Step::Pop),
        ]
    }

    proptest! {
        /// Against a binary heap of the whole tuples: every pop gives a
        /// deadline no later than anything left, and the two hold the same
        /// deadlines throughout.
        #[test]
        fn the_queue_pops_what_a_heap_of_the_same_deadlines_pops(
            steps in proptest::collection::vec(step(), 0..200),
            drift in proptest::collection::vec(0..3u64, 200),
        ) {
            let start = Instant::now();
            let mut queue = DeadlineQueue::default();
            let mut model: BinaryHeap<Reverse<Deadline>> = BinaryHeap::new();
            let mut clock = 0u64;
            for (n, step) in steps.into_iter().enumerate() {
                match step {
                    Step::Push { millis, slot } => {
                        // A clock that only moves on, plus a timeout that
                        // is usually the same and sometimes shorter.
                        clock += drift[n];
                        let timeout = if millis % 4 == 0 { millis } else { 40 };
                        let at = start + Duration::from_millis(clock + timeout);
                        let deadline = (at, slot, n as u64);
                        queue.push(deadline);
                        model.push(Reverse(deadline));
                    }
                    Step::Pop => {
                        let front = queue.peek();
                        let popped = queue.pop();
                        prop_assert_eq!(popped, front, "pop took another entry than peek showed");
                        let expected = model.pop().map(|Reverse(d)| d);
                        prop_assert_eq!(popped.map(|d| d.0), expected.map(|d| d.0));
                        if let Some(popped) = popped {
                            // The same deadline, maybe another of equal
                            // time: put the model's back and take ours out.
                            if Some(popped) != expected {
                                model.push(Reverse(expected.unwrap()));
                                let mut rest: Vec<_> = model.drain().map(|Reverse(d)| d).collect();
                                let at = rest.iter().position(|d| *d == popped);
                                prop_assert!(at.is_some(), "popped {:?} the model never held", popped);
                                rest.swap_remove(at.unwrap());
                                model.extend(rest.into_iter().map(Reverse));
                            }
                        }
                    }
                }
                prop_assert_eq!(queue.len(), model.len());
                prop_assert_eq!(queue.peek().map(|d| d.0), model.peek().map(|Reverse(d)| d.0));
            }
        }
    }
}
