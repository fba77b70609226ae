//! A batch's results as its entries finish, on the progress thread.
//!
//! A batch arrives as one command and completes with one reply: its entries are
//! posted in one turn of the loop, each finishes on its own (its own error,
//! deadline and destination hold, exactly as a single read), and the entry
//! that finishes last sends the whole list. An entry's outcome is recorded
//! once; a second outcome for it is ignored, so a late or duplicated
//! completion can never overwrite an outcome the caller may already act on.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use rdmareg_core::RdmaError;

use crate::command::BatchReply;

/// The results of one batch.
#[derive(Debug)]
pub struct BatchResults {
    results: RefCell<Vec<Option<Result<(), RdmaError>>>>,
    remaining: Cell<usize>,
    reply: RefCell<Option<BatchReply>>,
}

impl BatchResults {
    /// A batch of `entries` reads whose results are sent on `reply`.
    pub fn new(entries: usize, reply: BatchReply) -> Rc<BatchResults> {
        Rc::new(BatchResults {
            results: RefCell::new(vec![None; entries]),
            remaining: Cell::new(entries),
            reply: RefCell::new(Some(reply)),
        })
    }

    /// Records entry `index`'s outcome; true if that completed the batch for
    /// its caller (it was the last entry). An index out of range or
    /// recorded already changes nothing.
    pub fn record(&self, index: usize, outcome: Result<(), RdmaError>) -> bool {
        {
            let mut results = self.results.borrow_mut();
            let Some(entry) = results.get_mut(index) else {
                return false;
            };
            if entry.is_some() {
                return false;
            }
            *entry = Some(outcome);
        }
        let remaining = self.remaining.get().saturating_sub(1);
        self.remaining.set(remaining);
        if remaining > 0 {
            return false;
        }
        let results = self
            .results
            .take()
            .into_iter()
            .map(|a| a.unwrap_or(Err(RdmaError::ShuttingDown)))
            .collect();
        match self.reply.borrow_mut().take() {
            Some(reply) => {
                let _ = reply.send(results);
                true
            }
            None => false,
        }
    }

    /// Whether nobody waits for the results any more.
    pub fn is_abandoned(&self) -> bool {
        self.reply.borrow().as_ref().is_none_or(|r| r.is_canceled())
    }
}

#[cfg(test)]
mod tests {
    use futures::channel::oneshot;

    use super::*;

    #[test]
    fn the_last_entry_completes_the_whole_batch_in_order() {
        let (reply, mut results) = oneshot::channel();
        let batch = BatchResults::new(3, reply);
        assert!(!batch.record(2, Ok(())));
        assert!(!batch.record(0, Err(RdmaError::Timeout)));
        assert_eq!(results.try_recv(), Ok(None), "not before the last entry");
        assert!(batch.record(1, Ok(())));
        assert_eq!(
            results.try_recv(),
            Ok(Some(vec![Err(RdmaError::Timeout), Ok(()), Ok(())]))
        );
    }

    #[test]
    fn an_entry_is_recorded_once() {
        let (reply, mut results) = oneshot::channel();
        let batch = BatchResults::new(2, reply);
        assert!(!batch.record(0, Ok(())));
        assert!(
            !batch.record(0, Err(RdmaError::Timeout)),
            "a second outcome is ignored"
        );
        assert!(!batch.record(7, Ok(())), "an index out of range is ignored");
        assert!(batch.record(1, Ok(())));
        assert_eq!(results.try_recv(), Ok(Some(vec![Ok(()), Ok(())])));
    }

    #[test]
    fn a_dropped_receiver_abandons_the_batch() {
        let (reply, results) = oneshot::channel();
        let batch = BatchResults::new(1, reply);
        assert!(!batch.is_abandoned());
        drop(results);
        assert!(batch.is_abandoned());
    }
}
