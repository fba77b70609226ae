//! A backend `map` whose memory is freed only once the registration is known
//! to be gone — also when the caller stops waiting for it.
//!
//! A backend may roll a cancelled map back asynchronously: over UCX the map
//! is a command on the progress thread, and dropping its future pushes a
//! compensating unmap that runs later. Freeing the memory when the future is
//! dropped would, for that window, leave freed pages registered (readable and
//! writable by peers, pinned in the NIC). So the registry never drops a map
//! it started: [`MapInFlight`] owns the backend's map future *and* the memory
//! being registered, and if it is dropped unfinished it hands both to a task
//! on the registry's runtime, which lets the map finish, unmaps what it
//! registered, and frees the memory only after that unmap returned `Ok(())`
//! (contract point 3). An unmap that fails leaves the memory leaked and
//! counted — the rule arena pages always followed. A caller's external range
//! cannot be leaked by the registry, so there the rollback keeps retrying
//! the unmap until the backend lets the range go, or its teardown is
//! confirmed to hold nothing; the caller learns the range is free only then.
//!
//! The rollback task holds an admission ticket until its first unmap
//! completes, so shutdown's drain waits for it (a rollback still retrying
//! after that does not hold shutdown up: the backend's teardown is what
//! ends it), and it is counted in
//! [`RegistryStats::map_rollbacks_in_flight`](crate::RegistryStats::map_rollbacks_in_flight);
//! [`RdmaRegistry::map_rollbacks_settled`](crate::RdmaRegistry::map_rollbacks_settled)
//! resolves when none is left (what the owner of an external range waits
//! for before reusing a range whose registration it cancelled).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use rdmareg_core::{BackendRegion, RdmaError};

use crate::pool::memory::PageMemory;
use crate::region::OwnedBuffer;
use crate::registry::Inner;

/// Memory handed to a map: freed when dropped if unregistered, leaked (and
/// counted) by [`leak`](Self::leak).
pub(crate) trait MappedMemory: Send + 'static {
    /// The registration's fate is unknown: keep the memory forever.
    fn leak(self);

    /// Whether this is a range the caller owns, which the registry cannot
    /// keep forever: its registration must be confirmed gone instead.
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

/// An owned buffer, or none for a range the caller owns (an external
/// region: nothing to free or leak here).
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

/// Memory that leaks when dropped, unless [`release`](Self::release)d
/// first: what a rollback task holds, so that a task dropped unfinished (its
/// runtime shut down) never frees memory a backend may still hold.
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
            // Dropping it would free memory that is not yet marked
            // registered (the map had not completed): leak it explicitly.
            memory.leak();
        }
    }
}

/// A backend map in progress and the memory it registers.
///
/// Resolves to the map's result and the memory: on `Err` nothing is registered
/// (the backend said so); on `Ok` the memory is registered and the caller must
/// track it before its next await.
///
/// # Cancel safety
/// Dropping it unfinished hands the map and the memory to a rollback task
/// (see the module documentation): nothing stays registered, and the memory
/// is freed once the backend confirmed that.
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
    /// Ask the backend to map `[ptr, ptr + len)`, which lies inside `memory`
    /// (or inside the caller's own range, for `None`). Call only while holding
    /// an admission ticket.
    ///
    /// # Safety
    ///
    /// `[ptr, ptr + len)` is degenerate (null, empty, wrapping: the backend
    /// refuses it) or meets [`RdmaBackend::map`](rdmareg_backend::RdmaBackend::map)'s
    /// terms: it lies inside `memory`, which this type keeps alive until the
    /// backend confirmed nothing registers it, or inside a range whose owner
    /// gave it to the registry through `register_external`'s contract; and
    /// the registry never names it as a GET destination unless it is a pool
    /// arena, whose bytes safe code reaches only through a `PinnedBuf` the
    /// GET borrows.
    pub(crate) unsafe fn start(inner: &Arc<Inner>, ptr: usize, len: usize, memory: M) -> Self {
        let backend = Arc::clone(&inner.backend);
        Self {
            inner: Arc::clone(inner),
            pending: Some(Pending {
                // SAFETY: the terms this function's caller promised (above).
                map: Box::pin(async move { unsafe { backend.map(ptr, len) }.await }),
                memory,
            }),
        }
    }
}

impl<M: MappedMemory + Unpin> Future for MapInFlight<M> {
    type Output = (Result<BackendRegion, RdmaError>, M);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // Polled again after it resolved: there is nothing left to return.
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

/// Unmap `backend_region_id` again, backing off from 10 ms to once a second,
/// until the backend confirms it, or until the backend's teardown is
/// confirmed to hold nothing.
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
