//! Registered regions: the owner's [`RegionGuard`] (the one handle that can
//! end a registration, so not `Clone`) and the observers' [`RegionWatch`].

mod leases;
mod owned;
pub(crate) mod state;
mod watch;

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use rdmareg_core::{Descriptor, PageRange, RdmaError, WrittenRanges};

pub use leases::{LeaseOutcome, LeasedDescriptor, ReadersDone};
pub(crate) use owned::OwnedBuffer;
pub use state::UnregisterOutcome;
use state::{RegionState, deregister, spawn_background_deregistration};
pub use watch::{RegionView, RegionWatch};

use crate::latch::wait_owned;
use crate::registry::Inner;

/// The owner's handle on one registered region.
///
/// # The release contract
///
/// [`deregistered`](Self::deregistered) resolves when the backend has
/// confirmed the unmap (or, at the end of shutdown, reported nothing
/// registered) *and* no reader is inside; until then the memory must stay
/// allocated. An [`unregister`](Self::unregister) error means *unknown*.
/// Dropping the guard deregisters in the background with a warning; keep a
/// [`RegionWatch`] to learn when that is done. See `docs/safety.md`.
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
    /// The untouched guard for [`RdmaError::NotOwned`]; `None` when the unmap
    /// failed and the registry kept the buffer.
    pub guard: Option<RegionGuard>,
}

impl UnregisterOwnedError {
    /// The guard, if the region is still registered ([`RdmaError::NotOwned`]).
    pub fn into_guard(self) -> Option<RegionGuard> {
        self.guard
    }
}

/// Lets `?` turn a failed [`RegionGuard::unregister_owned`] into its
/// [`RdmaError`]; a guard handed back is dropped (background deregistration).
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

    /// The registration's generation, carried in its descriptors.
    pub fn generation(&self) -> u64 {
        self.state.generation
    }

    /// The page-rounded range the backend pinned (and the budget charged).
    /// May start below [`addr`](Self::addr); never a base for offsets.
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
    /// be carried in a descriptor (a backend defect).
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

    /// The ranges of this region that peers' writes filled whole since the
    /// last call, as offsets from [`addr`](Self::addr), coalesced; the
    /// backend's log starts over empty.
    ///
    /// After a writer vanished mid-PUT, a listed range holds that writer's
    /// bytes (or a later completed write's) and a failed write's bytes are
    /// never listed. The log is bounded: when
    /// [`WrittenRanges::incomplete`] is set some writes were left out, and
    /// nothing can be concluded about a range the list does not name.
    /// Writes over a same-host direct lane are not in it
    /// (`docs/safety.md`, "Writable registrations").
    ///
    /// # Errors
    /// [`RdmaError::Unsupported`] for a backend without writes;
    /// [`RdmaError::RegionNotFound`] if the backend no longer holds the
    /// region; [`RdmaError::ShuttingDown`] once the backend is torn down.
    ///
    /// # Cancel safety
    /// Dropping the future may lose the ranges taken: a later call does
    /// not list them again.
    pub async fn take_written(&self) -> Result<WrittenRanges, RdmaError> {
        self.inner
            .backend
            .take_written(self.state.backend_region_id)
            .await
    }

    /// Whether the registry has begun shutting down.
    pub fn is_shutting_down(&self) -> bool {
        self.inner.shutdown_started.is_released()
    }

    /// Resolves once shutdown has begun: stop handing descriptors out.
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

    /// Resolves once the region is released and the memory may be reused.
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

    /// Deregister the region, waiting at most `timeout` in all.
    ///
    /// Closes the region to readers, waits for those inside, then unmaps;
    /// the backend's unmap waits for GETs into or from the region. The
    /// [`UnregisterOutcome`] says whether the region is released on return
    /// (`Drained`), once the last reader leaves (`DrainTimedOut`), or once
    /// the unmap still running in the background is confirmed
    /// (`UnmapPending`). An owned region's buffer is freed at release.
    ///
    /// # Errors
    /// The backend's unmap error: the state is *unknown*, the region stays
    /// tracked and charged, and a later unmap (the shutdown sweep) retries.
    ///
    /// # Cancel safety
    /// Dropping the future hands the deregistration to a background task.
    pub async fn unregister(self, timeout: Duration) -> Result<UnregisterOutcome, RdmaError> {
        let (inner, state) = self.disarm();
        state.disown();
        let mut pending = PendingRelease::new(inner, state);
        let result = deregister(&pending.inner, &pending.state, timeout).await;
        pending.done = true;
        result
    }

    /// Deregister an owned region and hand its buffer back: as
    /// [`unregister`](Self::unregister), then wait for the last reader (a
    /// synchronous closure) to leave.
    ///
    /// # Errors
    /// [`RdmaError::NotOwned`] for a region registered from a pointer (the
    /// guard comes back untouched); [`RdmaError::Timeout`] when the unmap was
    /// not confirmed within `drain_timeout` (it goes on, and the registry
    /// frees the buffer at release); or the unmap's error (state *unknown*;
    /// the registry frees the buffer once a later unmap is confirmed).
    ///
    /// # Cancel safety
    /// Dropping the future forfeits the buffer, freed at release.
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
            Ok(UnregisterOutcome::UnmapPending { .. }) => {
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
            // Unreachable: the guard was the only claimant.
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

/// A release taken over from a guard; dropped unfinished, it continues in
/// the background.
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
