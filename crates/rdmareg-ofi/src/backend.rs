//! [`OfiBackend`]: the [`RdmaBackend`] seam over an [`OfiEngine`](crate::OfiEngine).
//!
//! Each method is one command for the progress thread and an await of its
//! one-shot answer; what this layer adds is cancellation safety, the same
//! way as the UCX backend:
//!
//! - `map` mints the region id before it pushes the command; dropped before
//!   the answer was taken, it pushes a compensating unmap of that id on the
//!   control lane (harmless if the map never ran), and the thread skips a
//!   map whose caller is gone or rolls back one it could not answer.
//! - `unmap` is pushed when it is called, in order with the caller's GETs;
//!   if the ring is full and the future is dropped, it goes onto the control
//!   lane instead. It proceeds whether or not the future is polled.
//! - `get` and `get_batch` leave everything to the thread once pushed: the
//!   destination stays held until the provider let go of the read.

use std::sync::Arc;

use futures::channel::oneshot;
use futures::future::BoxFuture;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, BackendRegion, RdmaError};

use crate::engine::{Command, EngineShared, Overflow};

/// The libfabric implementation of [`RdmaBackend`]; obtained from
/// [`OfiEngine::backend`](crate::OfiEngine::backend). Its backend key is
/// `"ofi"`.
#[derive(Debug, Clone)]
pub struct OfiBackend {
    shared: Arc<EngineShared>,
}

impl OfiBackend {
    pub(crate) fn new(shared: Arc<EngineShared>) -> OfiBackend {
        OfiBackend { shared }
    }
}

/// A map's answer channel and, until the answer was taken, the duty to undo
/// the map.
struct PendingMap<'a> {
    shared: &'a EngineShared,
    id: u64,
    answer: Option<oneshot::Receiver<Result<BackendRegion, RdmaError>>>,
    armed: bool,
}

impl Drop for PendingMap<'_> {
    fn drop(&mut self) {
        // Close the answer channel first, so the thread sees the caller gone.
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
// kit runs against it over tcp and shm): see `engine` and `progress`.
unsafe impl RdmaBackend for OfiBackend {
    fn key(&self) -> &str {
        "ofi"
    }

    /// # Cancel safety
    /// Dropping the future leaves no registration behind.
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
            pending.armed = false;
            answer.unwrap_or(Err(RdmaError::ShuttingDown))
        })
    }

    /// # Cancel safety
    /// The unmap is submitted when this method is called; dropping the
    /// future abandons only the answer.
    fn unmap(&self, backend_region_id: u64) -> BoxFuture<'_, Result<(), RdmaError>> {
        // After teardown nothing is registered but what teardown could not
        // deregister: any other id names nothing, and its unmap is `Ok`.
        if let Some(still) = self.shared.signals.still_registered_after_teardown.get() {
            let answer = if still.contains(&backend_region_id) {
                Err(RdmaError::ShuttingDown)
            } else {
                Ok(())
            };
            return Box::pin(std::future::ready(answer));
        }
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
    /// Once submitted, dropping the future does not stop the read; the
    /// destination stays held until the provider let go of it.
    unsafe fn get(&self, request: BackendGet) -> BoxFuture<'_, Result<(), RdmaError>> {
        Box::pin(async move {
            if request.len == 0 {
                return Err(RdmaError::OutOfRange);
            }
            let (reply, answer) = oneshot::channel();
            self.shared
                .submit(Command::Get { request, reply }, Overflow::Abandon)
                .await?;
            answer.await.unwrap_or(Err(RdmaError::ShuttingDown))
        })
    }

    /// One command for the whole batch: every entry is posted in one turn
    /// of the progress thread, the answers come back together.
    unsafe fn get_batch(
        &self,
        requests: Vec<BackendGet>,
    ) -> BoxFuture<'_, Vec<Result<(), RdmaError>>> {
        Box::pin(async move {
            if requests.is_empty() {
                return Vec::new();
            }
            let entries = requests.len();
            let (reply, answer) = oneshot::channel();
            if let Err(err) = self
                .shared
                .submit(Command::GetBatch { requests, reply }, Overflow::Abandon)
                .await
            {
                return vec![Err(err); entries];
            }
            answer
                .await
                .unwrap_or_else(|_| vec![Err(RdmaError::ShuttingDown); entries])
        })
    }

    /// The progress thread's own count: moved only by successful
    /// `fi_mr_reg` and `fi_close` of a region.
    fn live_registrations(&self) -> Option<usize> {
        Some(self.shared.live_registrations())
    }
}
