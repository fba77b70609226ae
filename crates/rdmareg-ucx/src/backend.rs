//! [`UcxBackend`]: the [`RdmaBackend`] seam over a [`UcxEngine`](crate::UcxEngine).
//!
//! Each method turns into one command for the progress thread and awaits its
//! one-shot answer. What this layer adds is cancellation safety:
//!
//! - `map` mints the region id *before* it pushes the command. If its future
//!   is dropped before the answer was taken, a guard pushes a compensating
//!   unmap of that id on the control lane (idempotent: harmless if the map
//!   never ran); the thread, for its part, skips a map whose caller is gone
//!   and rolls back one whose answer could not be delivered.
//! - `unmap` is pushed onto the ring when it is called, in order with the
//!   caller's earlier GETs (which it must wait for) and later ones (which it
//!   must refuse). Only if the ring is full does the future wait for room;
//!   dropped meanwhile, it diverts the unmap to the control lane, so an unmap
//!   proceeds whether or not its future is ever polled.
//! - `get` leaves everything to the thread once pushed: the destination stays
//!   held until UCX has released the request, whether or not anyone awaits.

use std::sync::Arc;

use futures::channel::oneshot;
use futures::future::BoxFuture;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, BackendRegion, RdmaError};

use crate::command::Command;
use crate::engine::{EngineShared, Overflow};

/// The UCX implementation of [`RdmaBackend`]; obtained from
/// [`UcxEngine::backend`](crate::UcxEngine::backend).
///
/// Its backend key is `"ucx"`; see the crate documentation for the safety
/// model.
///
/// # Cancellation
///
/// - `map` mints the region id before it submits the command; if its future
///   is dropped before the answer was taken, a compensating unmap of that id
///   follows (harmless if the map never ran), and the progress thread skips a
///   map whose caller is gone or rolls back one whose answer it could not
///   deliver. A dropped map leaves no registration behind.
/// - `unmap` is submitted when it is called, in order with the caller's
///   earlier and later GETs; if the ring is full and the future is dropped
///   before there was room, the unmap is diverted to the control lane. It
///   proceeds whether or not the future is ever polled.
/// - `get`, once submitted, runs to its end whether or not anyone awaits it;
///   the destination stays held until UCX has released the request.
#[derive(Debug)]
pub struct UcxBackend {
    shared: Arc<EngineShared>,
}

impl UcxBackend {
    pub(crate) fn new(shared: Arc<EngineShared>) -> UcxBackend {
        UcxBackend { shared }
    }
}

/// Owns a map's answer channel and, until the answer has been taken, the
/// duty to undo the map.
struct PendingMap<'a> {
    shared: &'a EngineShared,
    id: u64,
    answer: Option<oneshot::Receiver<Result<BackendRegion, RdmaError>>>,
    armed: bool,
}

impl Drop for PendingMap<'_> {
    fn drop(&mut self) {
        // Close the answer channel first: a map the thread has not reached yet
        // then sees its caller gone and is skipped, and one it is running
        // cannot deliver its answer and is rolled back.
        drop(self.answer.take());
        if self.armed {
            let _ = self.shared.send_control(Command::Unmap {
                id: self.id,
                reply: None,
            });
        }
    }
}

// SAFETY: the engine keeps contract points 1, 3, 4 and 8 (the conformance
// kit runs against it on tcp and same-host lanes): see `progress::regions`
// for unmaps and `progress::gets` for answers only after UCX let go.
unsafe impl RdmaBackend for UcxBackend {
    fn key(&self) -> &str {
        "ucx"
    }

    /// # Cancel safety
    /// Dropping the future leaves no registration behind: see
    /// [`UcxBackend`]'s cancellation rules.
    unsafe fn map(
        &self,
        ptr: usize,
        len: usize,
    ) -> BoxFuture<'_, Result<BackendRegion, RdmaError>> {
        Box::pin(async move {
            if ptr == 0 || len == 0 || ptr.checked_add(len).is_none() {
                return Err(RdmaError::OutOfRange);
            }
            let (reply, answer) = oneshot::channel();
            let id = self.shared.mint_region_id();
            let mut pending = PendingMap {
                shared: &self.shared,
                id,
                answer: Some(answer),
                armed: false,
            };
            self.shared
                .submit(
                    Command::Map {
                        id,
                        ptr,
                        len,
                        reply,
                    },
                    Overflow::Abandon,
                )
                .await?;
            pending.armed = true;
            let answer = match pending.answer.as_mut() {
                Some(answer) => answer.await,
                None => return Err(RdmaError::ShuttingDown),
            };
            // The answer is in hand (or the thread dropped the command at
            // teardown, which unmaps everything): nothing left to undo.
            pending.armed = false;
            answer.unwrap_or(Err(RdmaError::ShuttingDown))
        })
    }

    /// # Cancel safety
    /// The unmap is submitted when this method is called; dropping the
    /// future abandons only the answer.
    fn unmap(&self, backend_region_id: u64) -> BoxFuture<'_, Result<(), RdmaError>> {
        // After teardown nothing is registered but what teardown reported it
        // could not unmap: answer as for any id that names nothing.
        if let Some(answer) = self.shared.unmap_after_teardown(backend_region_id) {
            return Box::pin(std::future::ready(answer));
        }
        // Reads submitted from here on go to the thread, which refuses
        // them; a copy into the region still running ends first.
        self.shared
            .caller_copies()
            .withdraw_destination(backend_region_id);
        let (reply, answer) = oneshot::channel();
        let mut submit = self.shared.submit(
            Command::Unmap {
                id: backend_region_id,
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
            answer.await.unwrap_or(Err(RdmaError::ShuttingDown))
        })
    }

    /// # Cancel safety
    /// Once submitted, dropping the future does not stop the transfer; the
    /// destination region stays held until UCX has released it. Dropped
    /// before it was submitted, nothing happens.
    unsafe fn get(&self, request: BackendGet) -> BoxFuture<'_, Result<(), RdmaError>> {
        Box::pin(async move {
            if request.len == 0 {
                return Err(RdmaError::OutOfRange);
            }
            let copied = !self.shared.is_closed() && {
                // SAFETY: this method's contract is `try_copy`'s.
                unsafe { self.shared.caller_copies().try_copy(&request) }
            };
            if copied {
                if crate::caller_copies::yield_due() {
                    yield_once().await;
                }
                return Ok(());
            }
            let (reply, answer) = oneshot::channel();
            self.shared
                .submit(Command::Get { request, reply }, Overflow::Abandon)
                .await?;
            answer.await.unwrap_or(Err(RdmaError::ShuttingDown))
        })
    }

    /// One command for the whole batch: every entry is posted in one turn
    /// of the progress thread and the answers come back together.
    unsafe fn get_batch(
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

    /// As `get_batch`, and a same-host list the progress thread copies
    /// keeps its copy worked out for the next post of the same `Arc`
    /// (`progress::copy_plans`).
    unsafe fn get_shared_batch(
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

    /// The progress thread's own count: moved only by successful
    /// `ucp_mem_map` / `ucp_mem_unmap` calls, so `Some(0)` after teardown
    /// means every region was really unmapped.
    fn live_registrations(&self) -> Option<usize> {
        Some(self.shared.live_registrations())
    }
}

impl UcxBackend {
    /// A batch (`requests`, owned or shared): copied on the caller's thread
    /// if it may be, otherwise sent to the progress thread as the command
    /// `command` makes of it and its answer channel.
    ///
    /// # Safety
    /// [`RdmaBackend::get_batch`]'s contract, for `requests`.
    unsafe fn batch<R>(
        &self,
        requests: R,
        command: impl FnOnce(R, oneshot::Sender<Vec<Result<(), RdmaError>>>) -> Command + Send + 'static,
    ) -> BoxFuture<'_, Vec<Result<(), RdmaError>>>
    where
        R: std::ops::Deref<Target = [BackendGet]> + Send + 'static,
    {
        Box::pin(async move {
            if requests.is_empty() {
                return Vec::new();
            }
            let entries = requests.len();
            let copied = !self.shared.is_closed() && {
                // SAFETY: this method's contract is `try_copy_batch`'s.
                unsafe { self.shared.caller_copies().try_copy_batch(&requests) }
            };
            if copied {
                if crate::caller_copies::yield_due() {
                    yield_once().await;
                }
                return vec![Ok(()); entries];
            }
            let (reply, answer) = oneshot::channel();
            if let Err(err) = self
                .shared
                .submit(command(requests, reply), Overflow::Abandon)
                .await
            {
                return vec![Err(err); entries];
            }
            answer
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
