//! Registered regions: the owner's [`RegionGuard`] and the observers'
//! [`RegionWatch`].
//!
//! A guard is the one handle that can end a registration, so it is not
//! `Clone`. Anyone else who needs to know when the memory is released, or to
//! read it, gets a [`RegionWatch`] sharing the same release latch. The
//! release contract is documented on [`RegionGuard`].

mod owned;
pub(crate) mod state;
mod watch;

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use rdmareg_core::{Descriptor, PageRange, RdmaError};

pub(crate) use owned::OwnedBuffer;
use state::{RegionState, deregister, spawn_background_deregistration};
pub use state::{StillRunning, UnregisterOutcome};
pub use watch::{RegionView, RegionWatch};

use crate::latch::wait_owned;
use crate::registry::Inner;

/// The owner's handle on one registered region.
///
/// # The release contract
///
/// [`deregistered`](Self::deregistered) (and
/// [`RegionWatch::deregistered`]) resolves when the backend has confirmed
/// the unmap — or, at the end of shutdown, the backend reported nothing
/// registered — *and* no reader is inside the region. Until then the memory
/// must stay allocated. An error from [`unregister`](Self::unregister)
/// means *unknown*: the region stays tracked, readers stay refused, and the
/// latch stays open until a later unmap (the shutdown sweep retries) is
/// confirmed.
///
/// Dropping it without [`unregister`](Self::unregister) starts a
/// deregistration in the background, on the runtime the registry was built
/// with (so it works from any thread), and logs a warning: the memory is
/// still pinned until [`deregistered`](Self::deregistered) resolves, which a
/// dropped guard can no longer tell anyone — keep a [`RegionWatch`] if you
/// need to know.
pub struct RegionGuard {
    inner: Arc<Inner>,
    state: Arc<RegionState>,
    /// Cleared when a consuming method has taken over the release.
    armed: bool,
}

impl fmt::Debug for RegionGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegionGuard")
            .field("addr", &self.addr())
            .field("len", &self.len())
            .field("generation", &self.generation())
            .field("owned", &self.is_owned())
            .field("deregistered", &self.is_deregistered())
            .finish()
    }
}

/// Why [`RegionGuard::unregister_owned`] did not hand the buffer back.
#[derive(thiserror::Error, Debug)]
#[error("{error}")]
pub struct UnregisterOwnedError {
    /// [`RdmaError::NotOwned`] for a region registered from a pointer, or the
    /// unmap's error (the state is then *unknown*).
    pub error: RdmaError,
    /// For [`RdmaError::NotOwned`], the guard, untouched: the region is still
    /// registered. `None` when the unmap failed: the registry keeps the
    /// buffer (it is freed once a later unmap is confirmed, leaked
    /// otherwise).
    pub guard: Option<RegionGuard>,
}

impl UnregisterOwnedError {
    /// The guard, when the region is still registered and the caller's to
    /// keep ([`RdmaError::NotOwned`]); `None` when the registry kept the
    /// buffer after a failed unmap.
    pub fn into_guard(self) -> Option<RegionGuard> {
        self.guard
    }
}

/// Lets `?` turn a failed [`RegionGuard::unregister_owned`] into its
/// [`RdmaError`]. A guard handed back with [`RdmaError::NotOwned`] is
/// dropped, which starts a background deregistration; keep it with
/// [`UnregisterOwnedError::into_guard`] instead when that matters.
impl From<UnregisterOwnedError> for RdmaError {
    fn from(e: UnregisterOwnedError) -> Self {
        e.error
    }
}

impl RegionGuard {
    pub(crate) fn new(inner: Arc<Inner>, state: Arc<RegionState>) -> Self {
        Self {
            inner,
            state,
            armed: true,
        }
    }

    /// Hand the release over to the caller of this method.
    fn disarm(mut self) -> (Arc<Inner>, Arc<RegionState>) {
        self.armed = false;
        (Arc::clone(&self.inner), Arc::clone(&self.state))
    }

    /// First registered byte (the pointer that was registered).
    pub fn addr(&self) -> u64 {
        self.state.ptr().as_ptr() as u64
    }

    /// The registered pointer, for the owner of an external region.
    pub fn as_ptr(&self) -> *mut u8 {
        self.state.ptr().as_ptr()
    }

    /// Registered length in bytes; never zero.
    pub fn len(&self) -> usize {
        self.state.len()
    }

    /// Always `false`: empty registrations are refused.
    pub fn is_empty(&self) -> bool {
        self.state.len() == 0
    }

    /// The registration's generation: distinguishes registrations of the
    /// same address over time, and is carried in its descriptors.
    pub fn generation(&self) -> u64 {
        self.state.generation
    }

    /// The page-rounded range the backend says it pinned (what the budget is
    /// charged for). May start below [`addr`](Self::addr); never a base for
    /// offsets.
    pub fn effective_range(&self) -> PageRange {
        self.state.effective
    }

    /// Whether the region was registered from a `Box<[u8]>` (and
    /// [`unregister_owned`](Self::unregister_owned) can hand it back).
    pub fn is_owned(&self) -> bool {
        self.state.is_owned()
    }

    /// A descriptor of the whole region, to hand to a trusted peer.
    ///
    /// # Errors
    /// [`RdmaError::InvalidDescriptor`] if the backend's key or name cannot
    /// be carried in a descriptor (a backend defect, reported here rather
    /// than by failing a registration that had already pinned memory).
    pub fn descriptor(&self) -> Result<Descriptor, RdmaError> {
        self.state.descriptor.clone()
    }

    /// A descriptor of `[offset, offset + len)` of the region.
    ///
    /// # Errors
    /// [`RdmaError::OutOfRange`] for an empty range or one that leaves the
    /// region; otherwise as [`descriptor`](Self::descriptor).
    pub fn descriptor_range(&self, offset: u64, len: u64) -> Result<Descriptor, RdmaError> {
        self.state
            .descriptor
            .as_ref()
            .map_err(Clone::clone)?
            .slice(offset, len)
            .map_err(RdmaError::from)
    }

    /// Whether the registry has begun shutting down.
    pub fn is_shutting_down(&self) -> bool {
        self.inner.shutdown_started.is_released()
    }

    /// Resolves once the registry has begun shutting down: the moment to
    /// stop handing this region's descriptors out.
    ///
    /// # Cancel safety
    /// Cancel-safe: it only observes.
    pub fn shutdown_initiated(&self) -> impl Future<Output = ()> + Send + 'static {
        wait_owned(Arc::clone(&self.inner), |inner: &Inner| {
            &inner.shutdown_started
        })
    }

    /// Whether the region is released (see the release contract above).
    pub fn is_deregistered(&self) -> bool {
        self.state.latch.is_released()
    }

    /// Resolves once the region is released: after this, the memory may be
    /// freed or reused.
    ///
    /// # Cancel safety
    /// Cancel-safe: it only observes.
    pub fn deregistered(&self) -> impl Future<Output = ()> + Send + 'static {
        wait_owned(Arc::clone(&self.state), |state: &RegionState| &state.latch)
    }

    /// An observer sharing this region's latch; the sanctioned way to read
    /// its bytes.
    pub fn watch(&self) -> RegionWatch {
        RegionWatch::new(Arc::clone(&self.state))
    }

    /// Deregister the region, waiting at most `timeout`.
    ///
    /// Closes the region to readers, waits for those inside to leave, then
    /// unmaps — whether or not they left. `timeout` bounds the whole wait,
    /// including the backend's unmap, which waits for GETs still using the
    /// region (into it or from it).
    ///
    /// With [`UnregisterOutcome::Drained`] the region is released when this
    /// returns. With [`UnregisterOutcome::DrainTimedOut`] it is unmapped,
    /// and [`deregistered`](Self::deregistered) resolves when the last
    /// reader leaves. With [`UnregisterOutcome::UnmapPending`] the unmap was
    /// not confirmed in time — the outcome says which readers and transfers
    /// were still running — and goes on in the background;
    /// [`deregistered`](Self::deregistered) resolves once it is confirmed.
    /// An owned region's buffer is freed at release.
    ///
    /// # Errors
    /// The backend's unmap error. The state is then *unknown*: the region
    /// stays tracked (and charged), readers stay refused, and the latch stays
    /// open until a later unmap — the shutdown sweep retries — is confirmed.
    ///
    /// # Cancel safety
    /// Dropping the future hands the deregistration to a background task
    /// (as dropping the guard would); an unmap already submitted proceeds.
    pub async fn unregister(self, timeout: Duration) -> Result<UnregisterOutcome, RdmaError> {
        let (inner, state) = self.disarm();
        state.disown();
        let mut pending = PendingRelease::new(inner, state);
        let result = deregister(&pending.inner, &pending.state, timeout).await;
        pending.done = true;
        result
    }

    /// Deregister an owned region and hand its buffer back.
    ///
    /// Fails with [`RdmaError::NotOwned`] (with the guard, untouched) for a
    /// region registered from a pointer, before doing anything else.
    /// Otherwise it proceeds as [`unregister`](Self::unregister), and then —
    /// the buffer cannot be handed back while a reader is still copying out
    /// of it — waits for the last reader to leave. Readers are synchronous
    /// closures, so that wait is as long as the slowest one in progress; the
    /// outcome says whether it overran `drain_timeout`.
    ///
    /// # Errors
    /// [`RdmaError::NotOwned`]; [`RdmaError::Timeout`] when the unmap was not
    /// confirmed within `drain_timeout` (a transfer still uses the region:
    /// the unmap goes on in the background and the registry frees the buffer
    /// at release); or the unmap's error (state *unknown*; the registry keeps
    /// the buffer and frees it once a later unmap is confirmed).
    ///
    /// # Cancel safety
    /// Dropping the future after it started forfeits the buffer: the
    /// deregistration finishes in the background and the buffer is freed at
    /// release.
    pub async fn unregister_owned(
        self,
        drain_timeout: Duration,
    ) -> Result<(Box<[u8]>, UnregisterOutcome), UnregisterOwnedError> {
        if !self.is_owned() {
            return Err(UnregisterOwnedError {
                error: RdmaError::NotOwned,
                guard: Some(self),
            });
        }
        let (inner, state) = self.disarm();
        let mut pending = PendingRelease::new(inner, state);
        let outcome = match deregister(&pending.inner, &pending.state, drain_timeout).await {
            Ok(UnregisterOutcome::UnmapPending(_)) => {
                pending.done = true;
                pending.state.disown();
                return Err(UnregisterOwnedError {
                    error: RdmaError::Timeout,
                    guard: None,
                });
            }
            Ok(outcome) => outcome,
            Err(error) => {
                pending.done = true;
                pending.state.disown();
                return Err(UnregisterOwnedError { error, guard: None });
            }
        };
        pending.state.latch.wait().await;
        pending.done = true;
        match pending.state.take_owned() {
            Some(buffer) => Ok((buffer, outcome)),
            // Unreachable while the guard was the only claimant; returned as
            // an error rather than asserted.
            None => Err(UnregisterOwnedError {
                error: RdmaError::RegionNotFound,
                guard: None,
            }),
        }
    }
}

impl Drop for RegionGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.state.disown();
        if self.state.is_finalized() {
            return;
        }
        tracing::warn!(
            generation = self.state.generation,
            addr = self.addr(),
            len = self.len(),
            "RegionGuard dropped without unregister: deregistering in the background"
        );
        spawn_background_deregistration(
            Arc::clone(&self.inner),
            Arc::clone(&self.state),
            "guard dropped",
        );
    }
}

/// A release taken over from a guard; if dropped before it finished, the
/// release continues in the background.
struct PendingRelease {
    inner: Arc<Inner>,
    state: Arc<RegionState>,
    done: bool,
}

impl PendingRelease {
    fn new(inner: Arc<Inner>, state: Arc<RegionState>) -> Self {
        Self {
            inner,
            state,
            done: false,
        }
    }
}

impl Drop for PendingRelease {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        self.state.disown();
        if self.state.is_finalized() {
            return;
        }
        tracing::warn!(
            generation = self.state.generation,
            "unregister cancelled: deregistering in the background"
        );
        spawn_background_deregistration(
            Arc::clone(&self.inner),
            Arc::clone(&self.state),
            "unregister cancelled",
        );
    }
}
