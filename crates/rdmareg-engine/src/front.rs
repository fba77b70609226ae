//! The backend seam's methods over the command lanes: what a driver's
//! `RdmaBackend` implementation delegates to.
//!
//! Each method turns into one command for the progress thread and awaits its
//! one-shot reply. What this layer adds is cancellation safety:
//!
//! - `map` mints the region id *before* it pushes the command. If its future
//!   is dropped before the result was taken, a guard pushes a compensating
//!   unmap of that id on the control lane (idempotent: harmless if the map
//!   never ran); the thread, for its part, skips a map whose caller is gone
//!   and rolls back one whose result could not be delivered. A dropped map
//!   leaves no registration behind.
//! - `unmap` is pushed onto the ring when it is *called*, in order with the
//!   caller's earlier GETs (which it must wait for) and later ones (which it
//!   must refuse). Only if the ring is full does the future wait for room;
//!   dropped meanwhile, it diverts the unmap to the control lane, so an unmap
//!   proceeds whether or not its future is ever polled. A diverted unmap
//!   runs ahead of the ring, so earlier reads into the region that were
//!   still queued are refused rather than waited for
//!   ([`lanes`](crate::lanes)).
//! - `get`, `put` and batches leave everything to the thread once pushed:
//!   the destination (or a write's source) stays held until the transport
//!   released it, whether or not anyone awaits the result.
//!
//! A driver whose reads can sometimes be copied on the caller's own thread
//! (same-host memory it may read directly) plugs that in as
//! [`CallerCopies`]; the front tries it first and falls back to the thread.

use std::ops::Deref;
use std::sync::Arc;

use bytes::Bytes;
use futures::channel::oneshot;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use rdmareg_backend::BackendLease;
use rdmareg_core::{
    Access, BackendGet, BackendPut, BackendRegion, LeaseTerms, MAX_NOTICE_BYTES, Notice,
    NoticeDrops, NoticeSender, PeerId, RdmaError, WrittenRanges,
};

use crate::command::{BatchReply, Command, Reply};
use crate::lanes::{Overflow, Submitter};
use crate::notices::NoticeSource;

/// Reads a driver can complete on the caller's thread, without the
/// progress thread.
pub trait CallerCopies: Send + Sync + 'static {
    /// Copies `request` now if this driver may; true if it did (the read is
    /// then complete and `Ok`). False leaves the request to the thread.
    ///
    /// # Safety
    /// [`RdmaBackend::get`](rdmareg_backend::RdmaBackend::get)'s contract
    /// for `request`.
    unsafe fn try_copy(&self, request: &BackendGet) -> bool;

    /// As [`try_copy`](Self::try_copy) for a whole batch: all or nothing.
    ///
    /// # Safety
    /// [`RdmaBackend::get_batch`](rdmareg_backend::RdmaBackend::get_batch)'s
    /// contract for `requests`.
    unsafe fn try_copy_batch(&self, requests: &[BackendGet]) -> bool;

    /// Writes `request` now if this driver may; true if it did (the write
    /// is then complete and `Ok`). False leaves the request to the thread.
    /// None by default.
    ///
    /// # Safety
    /// [`RdmaBackend::put`](rdmareg_backend::RdmaBackend::put)'s contract
    /// for `request`.
    unsafe fn try_write(&self, request: &BackendPut) -> bool {
        let _ = request;
        false
    }

    /// Called when an unmap of `region_id` is submitted: later reads into it
    /// (and writes from it) must go to the thread, and a copy into or out
    /// of it still running ends first.
    fn withdraw_destination(&self, region_id: u64);

    /// Whether the caller should give its executor a turn after a copy (a
    /// long run of copies must not starve other tasks).
    fn yield_due(&self) -> bool;
}

/// The driver has no reads it completes on the caller's thread.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoCallerCopies;

impl CallerCopies for NoCallerCopies {
    unsafe fn try_copy(&self, _: &BackendGet) -> bool {
        false
    }

    unsafe fn try_copy_batch(&self, _: &[BackendGet]) -> bool {
        false
    }

    fn withdraw_destination(&self, _: u64) {}

    fn yield_due(&self) -> bool {
        false
    }
}

/// The backend methods of one engine; see the module docs.
#[derive(Debug)]
pub struct Front<P, C = NoCallerCopies> {
    submitter: Arc<Submitter<P>>,
    caller_copies: Arc<C>,
    /// The engine's notice board and the number its own notices carry, if
    /// its driver sends and receives notices.
    notices: Option<(Arc<dyn NoticeSource>, NoticeSender)>,
}

impl<P, C> Clone for Front<P, C> {
    fn clone(&self) -> Self {
        Front {
            submitter: Arc::clone(&self.submitter),
            caller_copies: Arc::clone(&self.caller_copies),
            notices: self.notices.clone(),
        }
    }
}

/// Owns a map's reply channel and, until the result has been taken, the
/// duty to undo the map.
struct PendingMap<'a, P> {
    submitter: &'a Submitter<P>,
    id: u64,
    result: Option<oneshot::Receiver<Result<BackendRegion, RdmaError>>>,
    armed: bool,
}

impl<P> Drop for PendingMap<'_, P> {
    fn drop(&mut self) {
        // Close the reply channel first: a map the thread has not reached
        // yet then sees its caller gone and is skipped, and one it is
        // running cannot deliver its result and is rolled back.
        drop(self.result.take());
        if self.armed {
            let _ = self.submitter.send_control(Command::Unmap {
                id: self.id,
                reply: None,
            });
        }
    }
}

impl<P: Send + 'static, C: CallerCopies> Front<P, C> {
    /// The front of the engine `submitter` feeds, trying `caller_copies`
    /// before the thread.
    pub fn new(submitter: Arc<Submitter<P>>, caller_copies: Arc<C>) -> Front<P, C> {
        Front {
            submitter,
            caller_copies,
            notices: None,
        }
    }

    /// This front with notices: `board` receives the engine's, and the
    /// engine's own carry `sender`.
    pub fn with_notices(mut self, board: Arc<dyn NoticeSource>, sender: NoticeSender) -> Self {
        self.notices = Some((board, sender));
        self
    }

    /// The lanes this front submits to.
    pub fn submitter(&self) -> &Submitter<P> {
        &self.submitter
    }

    /// `RdmaBackend::map`. Null, empty and overflowing ranges are refused
    /// with [`RdmaError::OutOfRange`] before anything is submitted.
    ///
    /// # Safety
    /// [`RdmaBackend::map`](rdmareg_backend::RdmaBackend::map)'s contract.
    pub unsafe fn map(
        &self,
        ptr: usize,
        len: usize,
    ) -> BoxFuture<'_, Result<BackendRegion, RdmaError>> {
        // SAFETY: this method's contract is `map_with_access`'s for reads.
        unsafe { self.map_with_access(ptr, len, Access::Read) }
    }

    /// `RdmaBackend::map_with_access`, for a driver that grants `access`
    /// (the caller checks [`Driver::WRITES`](crate::backend::Driver::WRITES)).
    ///
    /// # Safety
    /// [`RdmaBackend::map_with_access`](rdmareg_backend::RdmaBackend::map_with_access)'s
    /// contract.
    pub unsafe fn map_with_access(
        &self,
        ptr: usize,
        len: usize,
        access: Access,
    ) -> BoxFuture<'_, Result<BackendRegion, RdmaError>> {
        Box::pin(async move {
            if ptr == 0 || len == 0 || ptr.checked_add(len).is_none() {
                return Err(RdmaError::OutOfRange);
            }
            let (reply, result) = oneshot::channel();
            let id = self.submitter.mint_region_id();
            let mut pending = PendingMap {
                submitter: &self.submitter,
                id,
                result: Some(result),
                armed: false,
            };
            self.submitter
                .submit(
                    Command::Map {
                        id,
                        ptr,
                        len,
                        access,
                        reply,
                    },
                    Overflow::Abandon,
                )
                .await?;
            pending.armed = true;
            let result = match pending.result.as_mut() {
                Some(result) => result.await,
                None => return Err(RdmaError::ShuttingDown),
            };
            // The result is in hand (or the thread dropped the command at
            // teardown, which releases everything): nothing left to undo.
            pending.armed = false;
            result.unwrap_or(Err(RdmaError::ShuttingDown))
        })
    }

    /// `RdmaBackend::unmap`: submitted when called; the future only waits
    /// for the result.
    pub fn unmap(&self, region_id: u64) -> BoxFuture<'_, Result<(), RdmaError>> {
        if let Some(result) = self.submitter.lifecycle().unmap_after_teardown(region_id) {
            return Box::pin(std::future::ready(result));
        }
        self.caller_copies.withdraw_destination(region_id);
        let (reply, result) = oneshot::channel();
        let mut submit = self.submitter.submit(
            Command::Unmap {
                id: region_id,
                reply: Some(reply),
            },
            Overflow::ToControlLane,
        );
        let first = submit.try_now();
        Box::pin(async move {
            match first {
                Some(submitted) => submitted?,
                None => submit.await?,
            }
            result.await.unwrap_or(Err(RdmaError::ShuttingDown))
        })
    }

    /// `RdmaBackend::get`. An empty read is refused with
    /// [`RdmaError::OutOfRange`].
    ///
    /// # Safety
    /// [`RdmaBackend::get`](rdmareg_backend::RdmaBackend::get)'s contract.
    pub unsafe fn get(&self, request: BackendGet) -> BoxFuture<'_, Result<(), RdmaError>> {
        Box::pin(async move {
            if request.len == 0 {
                return Err(RdmaError::OutOfRange);
            }
            // SAFETY: this method's contract is `copied_here`'s.
            if unsafe { self.copied_here(&request) } {
                if self.caller_copies.yield_due() {
                    yield_once().await;
                }
                return Ok(());
            }
            self.ask(|reply| Command::Get { request, reply }).await
        })
    }

    /// `RdmaBackend::put`, for a driver that writes. An empty write is
    /// refused with [`RdmaError::OutOfRange`].
    ///
    /// # Safety
    /// [`RdmaBackend::put`](rdmareg_backend::RdmaBackend::put)'s contract.
    pub unsafe fn put(&self, request: BackendPut) -> BoxFuture<'_, Result<(), RdmaError>> {
        Box::pin(async move {
            if request.len == 0 {
                return Err(RdmaError::OutOfRange);
            }
            // SAFETY: this method's contract is `try_write`'s.
            if !self.submitter.is_closed() && unsafe { self.caller_copies.try_write(&request) } {
                if self.caller_copies.yield_due() {
                    yield_once().await;
                }
                return Ok(());
            }
            self.ask(|reply| Command::Put { request, reply }).await
        })
    }

    /// `RdmaBackend::put_batch`: one command for the whole batch.
    ///
    /// # Safety
    /// [`RdmaBackend::put_batch`](rdmareg_backend::RdmaBackend::put_batch)'s
    /// contract.
    pub unsafe fn put_batch(
        &self,
        requests: Vec<BackendPut>,
    ) -> BoxFuture<'_, Vec<Result<(), RdmaError>>> {
        Box::pin(async move {
            let entries = requests.len();
            if entries == 0 {
                return Vec::new();
            }
            let (reply, result) = oneshot::channel();
            let command = Command::PutBatch { requests, reply };
            if let Err(err) = self.submitter.submit(command, Overflow::Abandon).await {
                return vec![Err(err); entries];
            }
            result
                .await
                .unwrap_or_else(|_| vec![Err(RdmaError::ShuttingDown); entries])
        })
    }

    /// `RdmaBackend::get_batch`: one command for the whole batch.
    ///
    /// # Safety
    /// [`RdmaBackend::get_batch`](rdmareg_backend::RdmaBackend::get_batch)'s
    /// contract.
    pub unsafe fn get_batch(
        &self,
        requests: Vec<BackendGet>,
    ) -> BoxFuture<'_, Vec<Result<(), RdmaError>>> {
        // SAFETY: this method's contract is `batch`'s.
        unsafe {
            self.batch(requests, |requests, reply| Command::GetBatch {
                requests,
                reply,
            })
        }
    }

    /// `RdmaBackend::get_shared_batch`: as [`get_batch`](Self::get_batch),
    /// as a command that keeps the shared list.
    ///
    /// # Safety
    /// [`RdmaBackend::get_batch`](rdmareg_backend::RdmaBackend::get_batch)'s
    /// contract.
    pub unsafe fn get_shared_batch(
        &self,
        requests: Arc<[BackendGet]>,
    ) -> BoxFuture<'_, Vec<Result<(), RdmaError>>> {
        // SAFETY: this method's contract is `batch`'s.
        unsafe {
            self.batch(requests, |requests, reply| Command::GetSharedBatch {
                requests,
                reply,
            })
        }
    }

    /// `RdmaBackend::lease`: terms checked here, the lease made by the
    /// thread.
    pub fn lease(
        &self,
        region: u64,
        terms: LeaseTerms,
    ) -> BoxFuture<'_, Result<BackendLease, RdmaError>> {
        Box::pin(async move {
            terms.check(std::time::Instant::now())?;
            self.ask(|reply| Command::Lease {
                region,
                terms,
                reply,
            })
            .await
        })
    }

    /// `RdmaBackend::take_written`: answered by the thread, from its
    /// owner's log.
    pub fn take_written(&self, region: u64) -> BoxFuture<'_, Result<WrittenRanges, RdmaError>> {
        Box::pin(async move {
            self.ask(|reply| Command::TakeWritten { region, reply })
                .await
        })
    }

    /// `RdmaBackend::release_lease`: sent by the thread.
    pub fn release_lease(
        &self,
        peer: PeerId,
        packed_key: Bytes,
    ) -> BoxFuture<'_, Result<(), RdmaError>> {
        Box::pin(async move {
            self.ask(|reply| Command::ReleaseLease {
                peer,
                packed_key,
                reply,
            })
            .await
        })
    }

    /// `RdmaBackend::send_notice`: checked here, sent by the thread.
    pub fn send_notice(&self, peer: PeerId, notice: Bytes) -> BoxFuture<'_, Result<(), RdmaError>> {
        Box::pin(async move {
            self.check_notice(&notice)?;
            self.ask(|reply| Command::Notice {
                peer,
                notice,
                reply,
            })
            .await
        })
    }

    /// `RdmaBackend::get_with_notice` for a thread that sends the notice
    /// itself: one command. A read copied on the caller's thread is
    /// followed by the notice as a command of its own, which this does not
    /// wait for.
    ///
    /// # Safety
    /// [`RdmaBackend::get`](rdmareg_backend::RdmaBackend::get)'s contract.
    pub unsafe fn get_with_notice(
        &self,
        request: BackendGet,
        notice: Bytes,
    ) -> BoxFuture<'_, Result<(), RdmaError>> {
        Box::pin(async move {
            self.check_notice(&notice)?;
            if request.len == 0 {
                return Err(RdmaError::OutOfRange);
            }
            let peer = request.peer;
            // SAFETY: this method's contract is `copied_here`'s.
            if unsafe { self.copied_here(&request) } {
                // The owner's engine just answered this read's peer, so
                // only the transport can still lose the notice, which no
                // notice reports (they are not acknowledged): hand it to
                // the thread and return, without waiting for the thread,
                // which is often parked between reads copied here.
                let (reply, _not_awaited) = oneshot::channel();
                self.submitter
                    .submit(
                        Command::Notice {
                            peer,
                            notice,
                            reply,
                        },
                        Overflow::Abandon,
                    )
                    .await?;
                if self.caller_copies.yield_due() {
                    yield_once().await;
                }
                return Ok(());
            }
            self.ask(|reply| Command::GetWithNotice {
                request,
                notice,
                reply,
            })
            .await
        })
    }

    /// `RdmaBackend::get_with_notice` as two commands: the read, then,
    /// after a read that succeeded, the notice.
    ///
    /// # Safety
    /// [`RdmaBackend::get`](rdmareg_backend::RdmaBackend::get)'s contract.
    pub unsafe fn get_then_notice(
        &self,
        request: BackendGet,
        notice: Bytes,
    ) -> BoxFuture<'_, Result<(), RdmaError>> {
        Box::pin(async move {
            self.check_notice(&notice)?;
            let peer = request.peer;
            // SAFETY: this method's contract is `get`'s.
            unsafe { self.get(request) }.await?;
            self.send_notice(peer, notice).await
        })
    }

    /// Copies `request` on the caller's thread if the driver can (never
    /// once teardown began).
    ///
    /// # Safety
    /// [`RdmaBackend::get`](rdmareg_backend::RdmaBackend::get)'s contract.
    unsafe fn copied_here(&self, request: &BackendGet) -> bool {
        // SAFETY: this method's contract is `try_copy`'s.
        !self.submitter.is_closed() && unsafe { self.caller_copies.try_copy(request) }
    }

    /// Submits the command `command` makes of a reply channel, and waits
    /// for the thread's reply (a dropped one means teardown ended it).
    async fn ask<T>(&self, command: impl FnOnce(Reply<T>) -> Command<P>) -> Result<T, RdmaError> {
        let (reply, result) = oneshot::channel();
        self.submitter
            .submit(command(reply), Overflow::Abandon)
            .await?;
        result.await.unwrap_or(Err(RdmaError::ShuttingDown))
    }

    /// Refuses a notice this front cannot send.
    fn check_notice(&self, notice: &[u8]) -> Result<(), RdmaError> {
        if self.notices.is_none() {
            return Err(RdmaError::Unsupported {
                operation: "notices",
            });
        }
        if notice.len() > MAX_NOTICE_BYTES {
            return Err(RdmaError::NoticeTooLarge {
                length: notice.len() as u64,
            });
        }
        Ok(())
    }

    /// `RdmaBackend::notices`.
    pub fn notices(&self) -> Result<BoxStream<'static, Notice>, RdmaError> {
        match &self.notices {
            Some((board, _)) => Ok(Arc::clone(board).boxed_stream()),
            None => Err(RdmaError::Unsupported {
                operation: "notices",
            }),
        }
    }

    /// `RdmaBackend::notice_drops`.
    pub fn notice_drops(&self) -> Option<NoticeDrops> {
        self.notices.as_ref().map(|(board, _)| board.drops())
    }

    /// `RdmaBackend::notice_sender`.
    pub fn notice_sender(&self) -> Option<NoticeSender> {
        self.notices.as_ref().map(|&(_, sender)| sender)
    }

    /// `RdmaBackend::live_registrations`: the thread's own count.
    pub fn live_registrations(&self) -> Option<usize> {
        Some(self.submitter.lifecycle().live_registrations())
    }

    /// A batch, owned or shared: copied on the caller's thread if it may
    /// be, otherwise sent to the thread as the command `command` makes of
    /// it and its reply channel.
    ///
    /// # Safety
    /// [`RdmaBackend::get_batch`](rdmareg_backend::RdmaBackend::get_batch)'s
    /// contract, for `requests`.
    unsafe fn batch<R>(
        &self,
        requests: R,
        command: impl FnOnce(R, BatchReply) -> Command<P> + Send + 'static,
    ) -> BoxFuture<'_, Vec<Result<(), RdmaError>>>
    where
        R: Deref<Target = [BackendGet]> + Send + 'static,
    {
        Box::pin(async move {
            if requests.is_empty() {
                return Vec::new();
            }
            let entries = requests.len();
            let copied = !self.submitter.is_closed() && {
                // SAFETY: this method's contract is `try_copy_batch`'s.
                unsafe { self.caller_copies.try_copy_batch(&requests) }
            };
            if copied {
                if self.caller_copies.yield_due() {
                    yield_once().await;
                }
                return vec![Ok(()); entries];
            }
            let (reply, result) = oneshot::channel();
            if let Err(err) = self
                .submitter
                .submit(command(requests, reply), Overflow::Abandon)
                .await
            {
                return vec![Err(err); entries];
            }
            result
                .await
                .unwrap_or_else(|_| vec![Err(RdmaError::ShuttingDown); entries])
        })
    }
}

/// Returns `Pending` once (waking its task at once), then `Ready`: gives
/// the executor a turn without waiting for anything.
async fn yield_once() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            std::task::Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            std::task::Poll::Pending
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::{Context, Poll};

    use futures::FutureExt;
    use rdmareg_core::PeerId;

    use super::*;
    use crate::doorbell::Doorbell;
    use crate::lanes::{Receivers, lanes};
    use crate::lifecycle::Lifecycle;

    fn front_with<C: CallerCopies>(copies: C) -> (Front<(), C>, Receivers<()>) {
        let (submitter, receivers) = lanes(4, Arc::new(Lifecycle::new(Doorbell::new().unwrap())));
        (Front::new(Arc::new(submitter), Arc::new(copies)), receivers)
    }

    fn read(len: u64) -> BackendGet {
        BackendGet {
            peer: PeerId(1),
            remote_addr: 0x1000,
            packed_key: bytes::Bytes::from_static(b"key"),
            local_region_id: 1,
            local_offset: 0,
            len,
            deadline: None,
        }
    }

    fn poll_once<F: std::future::Future + Unpin>(future: &mut F) -> Poll<F::Output> {
        future.poll_unpin(&mut Context::from_waker(futures::task::noop_waker_ref()))
    }

    #[test]
    fn a_null_or_empty_map_is_refused_before_submission() {
        let (front, receivers) = front_with(NoCallerCopies);
        for (ptr, len) in [(0, 8), (0x1000, 0), (usize::MAX, 2)] {
            // SAFETY: refused before anything touches the range.
            let result = futures::executor::block_on(unsafe { front.map(ptr, len) });
            assert_eq!(result, Err(RdmaError::OutOfRange));
        }
        assert!(receivers.is_empty());
    }

    #[test]
    fn a_dropped_map_pushes_a_compensating_unmap() {
        let (front, receivers) = front_with(NoCallerCopies);
        let buffer = [0u8; 64];
        // SAFETY: the map is never performed: no thread serves the lanes.
        let mut map = unsafe { front.map(buffer.as_ptr() as usize, buffer.len()) };
        assert!(
            poll_once(&mut map).is_pending(),
            "waits for the thread's result"
        );
        drop(map);
        let Ok(Command::Map { id, reply, .. }) = receivers.ring.try_recv() else {
            panic!("the map was submitted");
        };
        assert!(reply.is_canceled(), "the thread sees the caller gone");
        match receivers.control.try_recv() {
            Ok(Command::Unmap {
                id: undone,
                reply: None,
            }) => assert_eq!(undone, id),
            other => panic!("expected a compensating unmap, got {other:?}"),
        }
    }

    #[test]
    fn an_unmap_is_submitted_when_called_not_when_polled() {
        let (front, receivers) = front_with(NoCallerCopies);
        let unmap = front.unmap(9);
        assert!(matches!(
            receivers.ring.try_recv(),
            Ok(Command::Unmap { id: 9, .. })
        ));
        drop(unmap);
    }

    #[test]
    fn after_teardown_unmaps_need_no_thread() {
        let (front, receivers) = front_with(NoCallerCopies);
        front.submitter().lifecycle().close();
        front.submitter().lifecycle().finish_teardown([5]);
        assert_eq!(futures::executor::block_on(front.unmap(4)), Ok(()));
        assert_eq!(
            futures::executor::block_on(front.unmap(5)),
            Err(RdmaError::ShuttingDown)
        );
        assert!(receivers.is_empty());
    }

    #[test]
    fn an_empty_read_is_refused() {
        let (front, receivers) = front_with(NoCallerCopies);
        // SAFETY: refused before anything touches the destination.
        let result = futures::executor::block_on(unsafe { front.get(read(0)) });
        assert_eq!(result, Err(RdmaError::OutOfRange));
        assert!(receivers.is_empty());
    }

    /// Copies everything; counts what it was asked.
    #[derive(Default)]
    struct CopiesAll {
        copies: AtomicUsize,
        withdrawn: AtomicUsize,
    }

    impl CallerCopies for CopiesAll {
        unsafe fn try_copy(&self, _: &BackendGet) -> bool {
            self.copies.fetch_add(1, Ordering::SeqCst);
            true
        }

        unsafe fn try_copy_batch(&self, requests: &[BackendGet]) -> bool {
            self.copies.fetch_add(requests.len(), Ordering::SeqCst);
            true
        }

        fn withdraw_destination(&self, _: u64) {
            self.withdrawn.fetch_add(1, Ordering::SeqCst);
        }

        fn yield_due(&self) -> bool {
            true
        }
    }

    #[test]
    fn reads_copied_on_the_callers_thread_skip_the_thread() {
        let (front, receivers) = front_with(CopiesAll::default());
        // SAFETY: the fake copier touches no memory.
        let single = futures::executor::block_on(unsafe { front.get(read(8)) });
        // SAFETY: as above.
        let batch = futures::executor::block_on(unsafe { front.get_batch(vec![read(8), read(8)]) });
        assert_eq!(single, Ok(()));
        assert_eq!(batch, vec![Ok(()), Ok(())]);
        assert_eq!(front.caller_copies.copies.load(Ordering::SeqCst), 3);
        assert!(receivers.is_empty());
        drop(front.unmap(1));
        assert_eq!(front.caller_copies.withdrawn.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_closed_engine_copies_nothing_on_the_callers_thread() {
        let (front, _receivers) = front_with(CopiesAll::default());
        front.submitter().lifecycle().close();
        // SAFETY: refused before anything touches the destination.
        let result = futures::executor::block_on(unsafe { front.get(read(8)) });
        assert_eq!(result, Err(RdmaError::ShuttingDown));
        assert_eq!(front.caller_copies.copies.load(Ordering::SeqCst), 0);
    }
}
