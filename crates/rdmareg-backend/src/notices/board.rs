//! The owner's inbox shared between the progress thread, which fills it,
//! and the application's streams, which empty it.
//!
//! The inbox's bound is the only buffer: a stream takes notices straight
//! out of it, so nothing between the transport and the application grows
//! without bound. Any number of streams may read one board; each notice
//! goes to one of them. Once the engine closes the board, streams end
//! after the notices already queued.

use std::hash::Hash;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

use futures::Stream;
use futures::stream::BoxStream;
use rdmareg_core::{Notice, NoticeDrops, NoticeSender};

use super::inbox::{NoticeDrop, NoticeInbox, NoticeLimits};

/// An inbox behind a lock, with the tasks waiting on it.
#[derive(Debug)]
pub struct NoticeBoard<E> {
    shared: Mutex<Board<E>>,
}

impl<E> NoticeBoard<E> {
    fn board(&self) -> MutexGuard<'_, Board<E>> {
        // Nothing in a board is left half-changed by a panic: every
        // critical section is one inbox call or one vector operation.
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A new stream's number.
    fn stream_number(&self) -> u64 {
        let mut board = self.board();
        board.next_stream += 1;
        board.next_stream
    }
}

#[derive(Debug)]
struct Board<E> {
    inbox: NoticeInbox<E>,
    /// The waker of each stream waiting for a notice, by stream: one
    /// slot per live stream, so wakers of dropped streams do not pile up.
    waiting: Vec<(u64, Waker)>,
    /// The next stream's number.
    next_stream: u64,
    closed: bool,
}

impl<E: Copy + Eq + Hash> NoticeBoard<E> {
    /// An open board over an empty inbox.
    pub fn new(limits: NoticeLimits) -> Arc<Self> {
        Arc::new(NoticeBoard {
            shared: Mutex::new(Board {
                inbox: NoticeInbox::new(limits),
                waiting: Vec::new(),
                next_stream: 0,
                closed: false,
            }),
        })
    }

    /// Takes a notice message that arrived on `from`, and wakes the
    /// streams if it was queued.
    ///
    /// # Errors
    /// Why it was dropped (counted in [`drops`](Self::drops)).
    pub fn receive(&self, from: E, message: &[u8]) -> Result<(), NoticeDrop> {
        let waiting = {
            let mut board = self.board();
            board.inbox.receive(from, message)?;
            std::mem::take(&mut board.waiting)
        };
        waiting.into_iter().for_each(|(_, waker)| waker.wake());
        Ok(())
    }

    /// See [`NoticeInbox::connection_closed`].
    pub fn connection_closed(&self, from: E) {
        self.board().inbox.connection_closed(from);
    }

    /// The engine stopped: streams end once the queue is empty.
    pub fn close(&self) {
        let waiting = {
            let mut board = self.board();
            board.closed = true;
            std::mem::take(&mut board.waiting)
        };
        waiting.into_iter().for_each(|(_, waker)| waker.wake());
    }

    /// Drops since the board was made.
    pub fn drops(&self) -> NoticeDrops {
        self.board().inbox.drops()
    }

    /// Notices waiting for a stream.
    pub fn queued(&self) -> usize {
        self.board().inbox.queued()
    }
}

impl<E: Copy + Eq + Hash + Send + 'static> NoticeBoard<E> {
    /// A stream of the board's notices.
    pub fn stream(self: &Arc<Self>) -> NoticeStream<E> {
        NoticeStream {
            number: self.stream_number(),
            board: Arc::clone(self),
        }
    }
}

/// A board as the backend front sees it, whatever a driver names its
/// connections by.
pub trait NoticeSource: Send + Sync + std::fmt::Debug {
    /// A stream of the board's notices.
    fn boxed_stream(self: Arc<Self>) -> BoxStream<'static, Notice>;

    /// Drops since the board was made.
    fn drops(&self) -> NoticeDrops;
}

impl<E> NoticeSource for NoticeBoard<E>
where
    E: Copy + Eq + Hash + Send + std::fmt::Debug + 'static,
{
    fn boxed_stream(self: Arc<Self>) -> BoxStream<'static, Notice> {
        Box::pin(self.stream())
    }

    fn drops(&self) -> NoticeDrops {
        NoticeBoard::drops(self)
    }
}

/// The notices of a [`NoticeBoard`], oldest first; ends once the board is
/// closed and empty.
#[derive(Debug)]
pub struct NoticeStream<E> {
    board: Arc<NoticeBoard<E>>,
    /// Names this stream's slot among the board's waiting wakers.
    number: u64,
}

impl<E> Drop for NoticeStream<E> {
    fn drop(&mut self) {
        let number = self.number;
        self.board.board().waiting.retain(|(n, _)| *n != number);
    }
}

impl<E: Copy + Eq + Hash> Stream for NoticeStream<E> {
    type Item = Notice;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Notice>> {
        let mut board = self.board.board();
        if let Some(notice) = board.inbox.pop() {
            return Poll::Ready(Some(Notice {
                from: NoticeSender(notice.sender),
                bytes: notice.bytes,
            }));
        }
        if board.closed {
            return Poll::Ready(None);
        }
        let number = self.number;
        match board.waiting.iter_mut().find(|(n, _)| *n == number) {
            Some((_, waker)) => waker.clone_from(cx.waker()),
            None => board.waiting.push((number, cx.waker().clone())),
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;
    use futures::executor::block_on;

    use super::super::wire;
    use super::*;

    #[test]
    fn a_waiting_stream_gets_the_next_notice() {
        let board = NoticeBoard::<u32>::new(NoticeLimits::default());
        let mut stream = board.stream();
        let reader = std::thread::spawn(move || block_on(stream.next()));
        std::thread::sleep(std::time::Duration::from_millis(20));
        board
            .receive(1, &wire::encode(42, 1, b"done").unwrap())
            .unwrap();
        let notice = reader.join().unwrap().expect("a notice");
        assert_eq!(notice.from, NoticeSender(42));
        assert_eq!(&notice.bytes[..], b"done");
    }

    #[test]
    fn streams_end_after_the_queue_once_closed() {
        let board = NoticeBoard::<u32>::new(NoticeLimits::default());
        board
            .receive(1, &wire::encode(7, 1, b"last").unwrap())
            .unwrap();
        board.close();
        let notices: Vec<_> = block_on(board.stream().collect());
        assert_eq!(notices.len(), 1);
        assert_eq!(&notices[0].bytes[..], b"last");
    }

    /// A stream polled and dropped leaves no waker behind, however many
    /// come and go before a notice arrives; one polled again and again
    /// keeps one.
    #[test]
    fn dropped_streams_leave_no_waker_on_the_board() {
        let board = NoticeBoard::<u32>::new(NoticeLimits::default());
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        for _ in 0..1000 {
            let mut stream = board.stream();
            assert!(Pin::new(&mut stream).poll_next(&mut cx).is_pending());
        }
        assert_eq!(board.board().waiting.len(), 0);
        let mut kept = board.stream();
        for _ in 0..10 {
            assert!(Pin::new(&mut kept).poll_next(&mut cx).is_pending());
        }
        assert_eq!(board.board().waiting.len(), 1);
    }

    #[test]
    fn two_streams_share_the_notices() {
        let board = NoticeBoard::<u32>::new(NoticeLimits::default());
        for sequence in 1..=4 {
            board
                .receive(1, &wire::encode(7, sequence, &[sequence as u8]).unwrap())
                .unwrap();
        }
        board.close();
        let (mut first, mut second) = (board.stream(), board.stream());
        let mut got = Vec::new();
        while let Some(notice) = block_on(first.next()) {
            got.push(notice.bytes[0]);
            if let Some(other) = block_on(second.next()) {
                got.push(other.bytes[0]);
            }
        }
        assert_eq!(got, [1, 2, 3, 4]);
    }
}
