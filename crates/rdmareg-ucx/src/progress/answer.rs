//! Where a read's outcome goes: to the caller of one GET, or into one entry
//! of a batch whose caller is answered once, when its last entry is.
//!
//! A read asked in pieces (`pieces`) is answered the same way: each piece
//! finishes on its own, and the last one answers the read.
//!
//! A batch arrives as one command and leaves as one answer: its entries are
//! posted in one turn of the loop, each finishes on its own (its own error,
//! deadline and destination hold, exactly as a single read), and the entry
//! that finishes last sends the whole list. Everything here lives on the
//! progress thread.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use rdmareg_core::RdmaError;

use crate::command::Reply;

pub(crate) use rdmareg_engine::command::BatchReply;
pub(crate) use rdmareg_engine::results::BatchResults;

/// The outcome of one read asked as several pieces (see `pieces`): the
/// read is answered once its last piece is, with the first error a piece
/// met (a deadline before a transport failure; see `record`), or `Ok` when
/// every piece landed.
#[derive(Debug)]
pub(crate) struct PieceAnswers {
    whole: RefCell<Option<Answer>>,
    remaining: Cell<usize>,
    first_error: RefCell<Option<RdmaError>>,
}

impl PieceAnswers {
    /// A read of `pieces` pieces whose outcome goes to `whole`.
    pub(crate) fn new(pieces: usize, whole: Answer) -> Rc<PieceAnswers> {
        Rc::new(PieceAnswers {
            whole: RefCell::new(Some(whole)),
            remaining: Cell::new(pieces),
            first_error: RefCell::new(None),
        })
    }

    /// Records one piece's outcome; true if that answered a caller.
    ///
    /// The first error a piece met is the read's, with one exception: a
    /// piece's deadline beats a transport failure, because the deadline of
    /// one piece can force-close the endpoint (`gets`) and fail its
    /// siblings with "force-closed after another read's deadline", which
    /// for the caller is this read's own deadline.
    fn record(&self, outcome: Result<(), RdmaError>) -> bool {
        if let Err(err) = outcome {
            let mut first = self.first_error.borrow_mut();
            match (&*first, &err) {
                (None, _) | (Some(RdmaError::Backend(_)), RdmaError::Timeout) => *first = Some(err),
                _ => {}
            }
        }
        let remaining = self.remaining.get().saturating_sub(1);
        self.remaining.set(remaining);
        if remaining > 0 {
            return false;
        }
        let Some(whole) = self.whole.borrow_mut().take() else {
            return false;
        };
        match self.first_error.borrow_mut().take() {
            Some(err) => whole.send(Err(err)),
            None => whole.send(Ok(())),
        }
    }

    fn is_abandoned(&self) -> bool {
        self.whole
            .borrow()
            .as_ref()
            .is_none_or(|whole| whole.is_abandoned())
    }
}

/// Where one read's outcome goes.
#[derive(Debug)]
pub(crate) enum Answer {
    /// The caller of one GET.
    Single(Reply<()>),
    /// Entry `index` of a batch.
    Entry {
        batch: Rc<BatchResults>,
        index: usize,
    },
    /// One piece of a read asked in pieces.
    Piece(Rc<PieceAnswers>),
}

impl Answer {
    /// Delivers `outcome` (once: the answer is consumed). True if a caller
    /// was answered: always for a single GET, and for a batch's entry only
    /// when it was the batch's last.
    pub(crate) fn send(self, outcome: Result<(), RdmaError>) -> bool {
        match self {
            Answer::Single(reply) => {
                let _ = reply.send(outcome);
                true
            }
            Answer::Entry { batch, index } => batch.record(index, outcome),
            Answer::Piece(whole) => whole.record(outcome),
        }
    }

    /// Whether nobody waits for the outcome any more.
    pub(crate) fn is_abandoned(&self) -> bool {
        match self {
            Answer::Single(reply) => reply.is_canceled(),
            Answer::Entry { batch, .. } => batch.is_abandoned(),
            Answer::Piece(whole) => whole.is_abandoned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use futures::channel::oneshot;

    use super::*;

    #[test]
    fn a_batch_is_answered_once_in_entry_order_when_its_last_entry_finishes() {
        let (reply, mut answered) = oneshot::channel();
        let batch = BatchResults::new(3, reply);
        let entry = |index| Answer::Entry {
            batch: Rc::clone(&batch),
            index,
        };
        assert!(!entry(2).send(Err(RdmaError::Timeout)));
        assert!(!entry(0).send(Ok(())));
        assert_eq!(answered.try_recv(), Ok(None), "not before the last entry");
        // A second answer is ignored.
        assert!(!entry(0).send(Err(RdmaError::OutOfRange)));
        assert!(
            entry(1).send(Err(RdmaError::InvalidKey)),
            "the last entry answers the caller"
        );
        assert_eq!(
            answered.try_recv(),
            Ok(Some(vec![
                Ok(()),
                Err(RdmaError::InvalidKey),
                Err(RdmaError::Timeout)
            ]))
        );
    }

    #[test]
    fn a_batch_whose_caller_left_is_abandoned() {
        let (reply, answered) = oneshot::channel();
        let batch = BatchResults::new(1, reply);
        let entry = Answer::Entry { batch, index: 0 };
        assert!(!entry.is_abandoned());
        drop(answered);
        assert!(entry.is_abandoned());
    }

    #[test]
    fn a_read_in_pieces_is_answered_once_when_its_last_piece_is_with_the_first_error() {
        let (reply, mut answered) = oneshot::channel();
        let whole = PieceAnswers::new(3, Answer::Single(reply));
        let piece = || Answer::Piece(Rc::clone(&whole));
        assert!(!piece().send(Ok(())));
        assert!(!piece().send(Err(RdmaError::OutOfRange)));
        assert_eq!(answered.try_recv(), Ok(None), "not before the last piece");
        assert!(
            piece().send(Err(RdmaError::Timeout)),
            "the last piece answers"
        );
        assert_eq!(answered.try_recv(), Ok(Some(Err(RdmaError::OutOfRange))));
    }

    #[test]
    fn a_read_whose_pieces_all_landed_is_answered_ok_even_inside_a_batch() {
        let (reply, mut answered) = oneshot::channel();
        let batch = BatchResults::new(1, reply);
        let whole = PieceAnswers::new(
            2,
            Answer::Entry {
                batch: Rc::clone(&batch),
                index: 0,
            },
        );
        assert!(!Answer::Piece(Rc::clone(&whole)).send(Ok(())));
        assert!(Answer::Piece(Rc::clone(&whole)).send(Ok(())));
        assert_eq!(answered.try_recv(), Ok(Some(vec![Ok(())])));
    }

    #[test]
    fn a_read_in_pieces_whose_caller_left_is_abandoned() {
        let (reply, answered) = oneshot::channel();
        let whole = PieceAnswers::new(2, Answer::Single(reply));
        let piece = Answer::Piece(whole);
        assert!(!piece.is_abandoned());
        drop(answered);
        assert!(piece.is_abandoned());
    }

    #[test]
    fn a_pieces_deadline_is_the_reads_error_even_after_a_sibling_failed_for_it() {
        let (reply, mut answered) = oneshot::channel();
        let whole = PieceAnswers::new(3, Answer::Single(reply));
        let piece = || Answer::Piece(Rc::clone(&whole));
        assert!(!piece().send(Err(RdmaError::backend(
            "force-closed after another read's deadline"
        ))));
        assert!(!piece().send(Err(RdmaError::Timeout)));
        assert!(piece().send(Err(RdmaError::OutOfRange)));
        assert_eq!(answered.try_recv(), Ok(Some(Err(RdmaError::Timeout))));
    }
}
