//! [`RegionWatch`], the clonable observer of a region, and [`RegionView`], the
//! read access it grants while a region is held open.
//!
//! A view copies bytes out through raw pointers instead of lending `&[u8]`,
//! since peers may write registered memory and a reference would promise
//! the compiler it cannot change. [`RegionWatch::read`] holds a lease for
//! the closure's duration, and the region is not released while one is
//! held; keep closures short, since deregistration waits for them.

use std::future::Future;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::Arc;

use rdmareg_core::RdmaError;

use super::state::RegionState;
use crate::latch::wait_owned;

/// A clonable observer of one region: shares its release latch and can read
/// it while it is held open.
#[derive(Clone)]
pub struct RegionWatch {
    state: Arc<RegionState>,
}

impl std::fmt::Debug for RegionWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionWatch")
            .field("generation", &self.state.generation)
            .field("deregistered", &self.is_deregistered())
            .finish()
    }
}

impl RegionWatch {
    pub(crate) fn new(state: Arc<RegionState>) -> Self {
        Self { state }
    }

    /// Generation of the watched registration.
    pub fn generation(&self) -> u64 {
        self.state.generation
    }

    /// Run `reader` over the region under a lease, or `None` once
    /// deregistration has started.
    pub fn read<R>(&self, reader: impl FnOnce(RegionView<'_>) -> R) -> Option<R> {
        let lease = Lease {
            state: &self.state,
            ticket: Some(self.state.readers.enter_local()?),
        };
        let view = RegionView {
            ptr: self.state.ptr(),
            len: self.state.len(),
            _lease: PhantomData,
        };
        let result = reader(view);
        drop(lease);
        Some(result)
    }

    /// Whether the region is released.
    pub fn is_deregistered(&self) -> bool {
        self.state.latch.is_released()
    }

    /// Resolves once the region is released (as
    /// [`RegionGuard::deregistered`](crate::RegionGuard::deregistered)).
    ///
    /// # Cancel safety
    /// Cancel-safe: it only observes.
    pub fn deregistered(&self) -> impl Future<Output = ()> + Send + 'static {
        wait_owned(Arc::clone(&self.state), |state: &RegionState| &state.latch)
    }
}

/// A held lease; giving it back may be the event that releases the region.
struct Lease<'a> {
    state: &'a Arc<RegionState>,
    ticket: Option<crate::gate::LocalTicket<'a>>,
}

impl Drop for Lease<'_> {
    // Runs on unwind too, so a panicking reader cannot keep a region open.
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket.take()
            && ticket.release()
        {
            self.state.last_reader_left();
        }
    }
}

/// Read access to a region during a [`RegionWatch::read`] closure: copies
/// bytes out, never lends a reference to registered memory.
#[derive(Debug)]
pub struct RegionView<'lease> {
    ptr: NonNull<u8>,
    len: usize,
    _lease: PhantomData<&'lease ()>,
}

impl RegionView<'_> {
    /// Length of the region in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always `false`: regions are never empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copy `dst.len()` bytes starting at `offset` into `dst`.
    ///
    /// # Errors
    /// [`RdmaError::OutOfRange`] if the range leaves the region.
    pub fn copy_to_slice(&self, offset: usize, dst: &mut [u8]) -> Result<(), RdmaError> {
        let end = offset.checked_add(dst.len()).ok_or(RdmaError::OutOfRange)?;
        if end > self.len {
            return Err(RdmaError::OutOfRange);
        }
        // SAFETY: `[offset, end)` lies inside the region (checked above),
        // which stays allocated while this view's lease is held (the latch
        // waits for leases); `dst` is a valid exclusive slice; no reference
        // to the region is created.
        unsafe {
            std::ptr::copy(self.ptr.as_ptr().add(offset), dst.as_mut_ptr(), dst.len());
        }
        Ok(())
    }

    /// The whole region, copied.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len];
        // Cannot fail: the range is exactly the region.
        let _ = self.copy_to_slice(0, &mut out);
        out
    }
}
