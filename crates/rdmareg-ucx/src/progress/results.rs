//! Where a read's result goes: the caller of one GET, one entry of a batch,
//! or one chunk of a chunked read.
//!
//! A batch's entries and a read's chunks each finish on their own (own
//! error, deadline and destination hold); the last one to finish completes
//! the caller. Everything here lives on the progress thread.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use bytes::Bytes;
use rdmareg_core::{PeerId, RdmaError};

use crate::command::Reply;

pub(crate) use rdmareg_engine::command::BatchReply;
pub(crate) use rdmareg_engine::results::BatchResults;

/// The result of one read asked as several chunks (see `chunks`): the read
/// completes once its last chunk does, with the first error a chunk met (a
/// deadline before a transport failure; see `record`), or `Ok` when every
/// chunk was written.
#[derive(Debug)]
pub(crate) struct ChunkResults {
    whole: RefCell<Option<Waiter>>,
    remaining: Cell<usize>,
    first_error: RefCell<Option<RdmaError>>,
}

impl ChunkResults {
    /// A read of `chunks` chunks whose result goes to `whole`.
    pub(crate) fn new(chunks: usize, whole: Waiter) -> Rc<ChunkResults> {
        Rc::new(ChunkResults {
            whole: RefCell::new(Some(whole)),
            remaining: Cell::new(chunks),
            first_error: RefCell::new(None),
        })
    }

    /// Records one chunk's outcome; true if that completed a caller.
    ///
    /// The first error is the read's, except that a chunk's deadline beats a
    /// transport failure: one chunk's deadline can force-close the endpoint
    /// (`gets`) and fail its siblings, which for the caller is this read's
    /// own deadline.
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

/// Who waits for one read's result, and takes it once.
///
/// A read in flight holds its waiter until it completes; then
/// [`Waiter::send`] consumes it.
#[derive(Debug)]
pub(crate) enum Waiter {
    /// The caller of one GET.
    Single(Reply<()>),
    /// Entry `index` of a batch.
    Entry {
        batch: Rc<BatchResults>,
        index: usize,
    },
    /// One chunk of a chunked read.
    Chunk(Rc<ChunkResults>),
    /// The caller of one GET with a notice: after a read that succeeded,
    /// the notice joins `due` and the thread sends it and then completes
    /// the caller (`notices`); after a failed read the caller gets the
    /// read's error and the notice is dropped.
    ThenNotice {
        notice: NoticeAfterRead,
        due: NoticesDue,
    },
}

/// A notice the thread sends once the read it follows succeeded.
#[derive(Debug)]
pub(crate) struct NoticeAfterRead {
    pub(crate) peer: PeerId,
    pub(crate) notice: Bytes,
    pub(crate) reply: Reply<()>,
}

/// Notices whose reads succeeded, for the thread to send.
pub(crate) type NoticesDue = Rc<RefCell<Vec<NoticeAfterRead>>>;

impl Waiter {
    /// Delivers `outcome`. True if a caller was completed: always for a
    /// single GET, and for a batch's entry or a chunk only when it was the
    /// last.
    pub(crate) fn send(self, outcome: Result<(), RdmaError>) -> bool {
        match self {
            Waiter::Single(reply) => {
                let _ = reply.send(outcome);
                true
            }
            Waiter::Entry { batch, index } => batch.record(index, outcome),
            Waiter::Chunk(whole) => whole.record(outcome),
            Waiter::ThenNotice { notice, due } => {
                match outcome {
                    Ok(()) => due.borrow_mut().push(notice),
                    Err(err) => {
                        let _ = notice.reply.send(Err(err));
                    }
                }
                true
            }
        }
    }

    /// Whether nobody waits for the outcome any more.
    pub(crate) fn is_abandoned(&self) -> bool {
        match self {
            Waiter::Single(reply) => reply.is_canceled(),
            Waiter::Entry { batch, .. } => batch.is_abandoned(),
            Waiter::Chunk(whole) => whole.is_abandoned(),
            Waiter::ThenNotice { notice, .. } => notice.reply.is_canceled(),
        }
    }
}

#[cfg(test)]
mod tests {
    use futures::channel::oneshot;

    use super::*;

    /// A read that succeeded leaves its notice for the thread to send and
    /// its caller waiting for that send; a failed one answers the caller
    /// with the read's error and leaves nothing to send.
    #[test]
    fn a_notice_waits_for_a_read_that_succeeded_only() {
        let due = NoticesDue::default();
        let noticed = |reply| Waiter::ThenNotice {
            notice: NoticeAfterRead {
                peer: PeerId(1),
                notice: Bytes::from_static(b"done"),
                reply,
            },
            due: Rc::clone(&due),
        };
        let (reply, mut result) = oneshot::channel();
        noticed(reply).send(Ok(()));
        assert_eq!(
            result.try_recv(),
            Ok(None),
            "the caller waits for the notice"
        );
        assert_eq!(due.borrow().len(), 1);
        let (reply, mut result) = oneshot::channel();
        noticed(reply).send(Err(RdmaError::Timeout));
        assert_eq!(result.try_recv(), Ok(Some(Err(RdmaError::Timeout))));
        assert_eq!(due.borrow().len(), 1, "no notice after a failed read");
    }

    #[test]
    fn a_batch_completes_once_in_entry_order_after_its_last_entry() {
        let (reply, mut result) = oneshot::channel();
        let batch = BatchResults::new(3, reply);
        let entry = |index| Waiter::Entry {
            batch: Rc::clone(&batch),
            index,
        };
        assert!(!entry(2).send(Err(RdmaError::Timeout)));
        assert!(!entry(0).send(Ok(())));
        assert_eq!(result.try_recv(), Ok(None), "not before the last entry");
        // A second result is ignored.
        assert!(!entry(0).send(Err(RdmaError::OutOfRange)));
        assert!(
            entry(1).send(Err(RdmaError::InvalidKey)),
            "the last entry completes the caller"
        );
        assert_eq!(
            result.try_recv(),
            Ok(Some(vec![
                Ok(()),
                Err(RdmaError::InvalidKey),
                Err(RdmaError::Timeout)
            ]))
        );
    }

    #[test]
    fn a_batch_whose_caller_left_is_abandoned() {
        let (reply, result) = oneshot::channel();
        let batch = BatchResults::new(1, reply);
        let entry = Waiter::Entry { batch, index: 0 };
        assert!(!entry.is_abandoned());
        drop(result);
        assert!(entry.is_abandoned());
    }

    #[test]
    fn a_chunked_read_completes_once_with_the_first_error() {
        let (reply, mut result) = oneshot::channel();
        let whole = ChunkResults::new(3, Waiter::Single(reply));
        let chunk = || Waiter::Chunk(Rc::clone(&whole));
        assert!(!chunk().send(Ok(())));
        assert!(!chunk().send(Err(RdmaError::OutOfRange)));
        assert_eq!(result.try_recv(), Ok(None), "not before the last chunk");
        assert!(
            chunk().send(Err(RdmaError::Timeout)),
            "the last chunk completes the read"
        );
        assert_eq!(result.try_recv(), Ok(Some(Err(RdmaError::OutOfRange))));
    }

    #[test]
    fn a_chunked_read_written_whole_is_ok_inside_a_batch() {
        let (reply, mut result) = oneshot::channel();
        let batch = BatchResults::new(1, reply);
        let whole = ChunkResults::new(
            2,
            Waiter::Entry {
                batch: Rc::clone(&batch),
                index: 0,
            },
        );
        assert!(!Waiter::Chunk(Rc::clone(&whole)).send(Ok(())));
        assert!(Waiter::Chunk(Rc::clone(&whole)).send(Ok(())));
        assert_eq!(result.try_recv(), Ok(Some(vec![Ok(())])));
    }

    #[test]
    fn a_chunked_read_whose_caller_left_is_abandoned() {
        let (reply, result) = oneshot::channel();
        let whole = ChunkResults::new(2, Waiter::Single(reply));
        let chunk = Waiter::Chunk(whole);
        assert!(!chunk.is_abandoned());
        drop(result);
        assert!(chunk.is_abandoned());
    }

    #[test]
    fn a_chunks_deadline_is_the_reads_error_after_a_sibling_failed() {
        let (reply, mut result) = oneshot::channel();
        let whole = ChunkResults::new(3, Waiter::Single(reply));
        let chunk = || Waiter::Chunk(Rc::clone(&whole));
        assert!(!chunk().send(Err(RdmaError::backend(
            "force-closed after another read's deadline"
        ))));
        assert!(!chunk().send(Err(RdmaError::Timeout)));
        assert!(chunk().send(Err(RdmaError::OutOfRange)));
        assert_eq!(result.try_recv(), Ok(Some(Err(RdmaError::Timeout))));
    }
}
