//! A backend `map` whose memory is freed only once the registration is known
//! to be gone — also when the caller stops waiting for it.
//!
//! Over UCX a cancelled map is a command the progress thread still runs, so
//! freeing its memory on drop would leave freed pages registered. The
//! registry never drops a map it started: [`MapInFlight`] owns the map and
//! its memory, and a rollback task lets it finish, unmaps it, and frees the
//! memory only after `Ok(())` (leaked and counted on failure; a caller's
//! range is retried instead, see `docs/safety.md`). The task holds an
//! admission ticket until its first unmap completes, and is counted in
//! [`RegistryStats::map_rollbacks_in_flight`](crate::RegistryStats::map_rollbacks_in_flight).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use rdmareg_core::{Access, BackendRegion, RdmaError};

use crate::pool::memory::PageMemory;
use crate::region::OwnedBuffer;
use crate::registry::Inner;

/// Memory handed to a map: freed when dropped if unregistered, leaked (and
/// counted) by [`leak`](Self::leak).
pub(crate) trait MappedMemory: Send + 'static {
    /// The registration's fate is unknown: keep the memory forever.
    fn leak(self);

    /// Whether this is the caller's range, which cannot be leaked: its
    /// registration must be confirmed gone instead.
    fn is_callers(&self) -> bool {
        false
    }
}

impl MappedMemory for OwnedBuffer {
    fn leak(mut self) {
        // Dropping a registered buffer leaks and counts it.
        self.mark_registered();
    }
}

impl MappedMemory for PageMemory {
    fn leak(self) {
        // Dropping registered pages leaks and counts them.
        self.mark_registered();
    }
}

/// An owned buffer, or `None` for the caller's own range.
impl<T: MappedMemory> MappedMemory for Option<T> {
    fn leak(self) {
        if let Some(memory) = self {
            memory.leak();
        }
    }

    fn is_callers(&self) -> bool {
        self.is_none()
    }
}

/// Memory that leaks when dropped unless [`release`](Self::release)d: a
/// rollback task dropped with its runtime never frees what a backend holds.
pub(crate) struct LeakUnlessReleased<M: MappedMemory>(Option<M>);

impl<M: MappedMemory> LeakUnlessReleased<M> {
    pub(crate) fn new(memory: M) -> Self {
        Self(Some(memory))
    }

    /// The registration is known to be gone: hand the memory back.
    pub(crate) fn release(mut self) -> Option<M> {
        self.0.take()
    }

    /// Whether the memory is a range the caller owns.
    pub(crate) fn is_callers(&self) -> bool {
        self.0.as_ref().is_some_and(M::is_callers)
    }
}

impl<M: MappedMemory> Drop for LeakUnlessReleased<M> {
    fn drop(&mut self) {
        if let Some(memory) = self.0.take() {
            // Not yet marked registered, so a drop would free it: leak.
            memory.leak();
        }
    }
}

/// A backend map in progress and the memory it registers.
///
/// Resolves to the map's result and the memory: on `Ok` the caller must
/// track the registration before its next await.
///
/// # Cancel safety
/// Dropped unfinished, it hands both to a rollback task (module docs).
pub(crate) struct MapInFlight<M: MappedMemory> {
    inner: Arc<Inner>,
    /// `None` once it resolved.
    pending: Option<Pending<M>>,
}

struct Pending<M> {
    map: BoxFuture<'static, Result<BackendRegion, RdmaError>>,
    memory: M,
}

impl<M: MappedMemory> MapInFlight<M> {
    /// Ask the backend to map `[ptr, ptr + len)`, inside `memory` (or the
    /// caller's own range, for `None`), while holding an admission ticket.
    ///
    /// # Safety
    /// The range is degenerate (the backend refuses it) or meets
    /// [`RdmaBackend::map`](rdmareg_backend::RdmaBackend::map)'s terms: it
    /// lies inside `memory`, kept alive until nothing registers it, or in a
    /// range given under `register_external`'s contract; and it is never a
    /// GET destination unless it is a pool arena, reached only through a
    /// `PinnedBuf` the GET borrows. With an `access` that allows writes,
    /// no Rust reference reaches the range while it is registered (peers
    /// write it).
    pub(crate) unsafe fn start(
        inner: &Arc<Inner>,
        ptr: usize,
        len: usize,
        access: Access,
        memory: M,
    ) -> Self {
        let backend = Arc::clone(&inner.backend);
        Self {
            inner: Arc::clone(inner),
            pending: Some(Pending {
                map: Box::pin(async move {
                    // SAFETY: the terms this function's caller promised
                    // (above).
                    unsafe { backend.map_with_access(ptr, len, access) }.await
                }),
                memory,
            }),
        }
    }
}

impl<M: MappedMemory + Unpin> Future for MapInFlight<M> {
    type Output = (Result<BackendRegion, RdmaError>, M);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(mut pending) = self.pending.take() else {
            return Poll::Pending;
        };
        match pending.map.as_mut().poll(cx) {
            Poll::Ready(outcome) => Poll::Ready((outcome, pending.memory)),
            Poll::Pending => {
                self.pending = Some(pending);
                Poll::Pending
            }
        }
    }
}

impl<M: MappedMemory> Drop for MapInFlight<M> {
    fn drop(&mut self) {
        let Some(Pending { map, memory }) = self.pending.take() else {
            return;
        };
        let inner = Arc::clone(&self.inner);
        let ticket = inner.gate.admitted();
        inner.map_rollbacks.send_modify(|n| *n += 1);
        let memory = LeakUnlessReleased::new(memory);
        let handle = inner.handle.clone();
        handle.spawn(async move {
            roll_back(&inner, map, memory, ticket).await;
            inner.map_rollbacks.send_modify(|n| *n -= 1);
        });
    }
}

/// Let a map nobody awaits finish, undo it, and free its memory once the
/// undo is confirmed.
async fn roll_back<M: MappedMemory>(
    inner: &Inner,
    map: BoxFuture<'static, Result<BackendRegion, RdmaError>>,
    memory: LeakUnlessReleased<M>,
    ticket: crate::gate::Ticket,
) {
    let region = match map.await {
        // Nothing was registered: the memory may go.
        Err(_) => return drop(memory.release()),
        Ok(region) => region,
    };
    match inner.backend.unmap(region.backend_region_id).await {
        Ok(()) => {
            tracing::debug!(
                backend_region = region.backend_region_id,
                "cancelled registration rolled back; its memory is free"
            );
            drop(memory.release());
        }
        Err(error) if memory.is_callers() => {
            tracing::error!(
                backend_region = region.backend_region_id,
                %error,
                "the unmap rolling back a cancelled external registration failed: the caller's range stays registered, retrying"
            );
            drop(ticket);
            retry_until_released(inner, region.backend_region_id).await;
            drop(memory.release());
        }
        Err(error) => {
            tracing::error!(
                backend_region = region.backend_region_id,
                %error,
                "the unmap rolling back a cancelled registration failed: its memory is leaked, and the backend may still hold it"
            );
            drop(memory); // leaks
        }
    }
}

/// Unmap again, backing off from 10 ms to 1 s, until the backend confirms
/// it or its teardown is confirmed to hold nothing.
async fn retry_until_released(inner: &Inner, backend_region_id: u64) {
    let mut released = inner.backend_released_everything.subscribe();
    let mut delay = std::time::Duration::from_millis(10);
    loop {
        tokio::select! {
            _ = released.wait_for(|released| *released) => {
                tracing::info!(backend_region_id, "the backend's teardown released the caller's range");
                return;
            }
            () = tokio::time::sleep(delay) => {}
        }
        match inner.backend.unmap(backend_region_id).await {
            Ok(()) => {
                tracing::info!(backend_region_id, "the caller's range is unmapped at last");
                return;
            }
            Err(error) => {
                tracing::debug!(backend_region_id, %error, "retried unmap refused");
                delay = (delay * 2).min(std::time::Duration::from_secs(1));
            }
        }
    }
}
