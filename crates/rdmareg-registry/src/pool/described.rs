//! [`DescribedBuf`]: a pool buffer lent to peers' reads, and the way back to
//! a writable [`PinnedBuf`].
//!
//! # Contract
//!
//! - **Only a described buffer has descriptors.** [`PinnedBuf::describe`]
//!   consumes the buffer, maps its bytes as a registration of their own and
//!   returns a [`DescribedBuf`]. A `PinnedBuf` has no descriptor at all.
//! - **A described buffer is read-only.** While its key lives, the owner's
//!   engine may read the bytes for a peer at any moment — on its progress
//!   thread (owner-served lanes copy or send them), or through the NIC. A
//!   write through `&mut [u8]` meanwhile would be a data race with that
//!   reader, so `DescribedBuf` derefs to `&[u8]` only.
//! - **[`withdraw`](DescribedBuf::withdraw) gives the buffer back only after
//!   the key is dead.** It unmaps the buffer's own registration; the
//!   backend's unmap waits for the reads it is serving (an owner-served read
//!   holds a lease on the region until its reply is sent). Only on `Ok` does
//!   the caller get a writable `PinnedBuf`; every descriptor handed out
//!   before is dead from then on, and a read of one gets a typed error.
//! - **Every buffer is described the same way**, dedicated ones included: a
//!   dedicated arena's key is also what GETs into it use, so it cannot be
//!   withdrawn while the buffer lives; a registration of the buffer's own
//!   can.
//! - **A typed error loses nothing.** [`DescribeError`] carries the
//!   `PinnedBuf` back, [`WithdrawError`] the `DescribedBuf`.
//!
//! Dropping a `DescribedBuf` frees it as dropping a `PinnedBuf` does, after
//! the own registration's unmap is confirmed (see `pinned_buf.rs`).

use std::ops::Deref;
use std::sync::Arc;

use rdmareg_core::{Descriptor, RdmaError, page_enclosing_range};

use super::pinned_buf::{LentCount, OwnRegistration, PinnedBuf, Slot, spawn_own_unmap};
use crate::mapping::{LeakUnlessReleased, MapInFlight};
use crate::registry::Inner;

/// A pool buffer whose bytes peers may read through its descriptors.
///
/// Made by [`PinnedBuf::describe`]. Derefs to `[u8]` (never mutably: the
/// owner's engine may be reading the bytes for a peer at any moment). Get
/// the writable buffer back with [`withdraw`](Self::withdraw), which first
/// makes every descriptor of it unreadable.
///
/// On backends whose keys grant writes (RDMA hardware), a peer holding a
/// descriptor can also write these bytes: hand descriptors only to peers
/// your protocol trusts (see `docs/safety.md`).
#[derive(Debug)]
pub struct DescribedBuf {
    /// Holds the own registration (`slot.own` is always `Some`).
    slot: Slot,
    len: usize,
    descriptor: Descriptor,
}

impl DescribedBuf {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no bytes (never: buffers are at least one
    /// byte long).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the buffer has an arena of its own.
    pub fn is_dedicated(&self) -> bool {
        !self.slot.arena.is_pooled()
    }

    /// A descriptor of the whole buffer.
    pub fn descriptor(&self) -> Descriptor {
        self.descriptor.clone()
    }

    /// A descriptor of `[offset, offset + len)` of the buffer.
    ///
    /// # Errors
    /// [`RdmaError::OutOfRange`] for an empty range or one that leaves the
    /// buffer.
    pub fn descriptor_range(&self, offset: u64, len: u64) -> Result<Descriptor, RdmaError> {
        let end = offset.checked_add(len).ok_or(RdmaError::OutOfRange)?;
        if len == 0 || end > self.len as u64 {
            return Err(RdmaError::OutOfRange);
        }
        self.descriptor.slice(offset, len).map_err(RdmaError::from)
    }

    /// Generation of the buffer's own registration: a later description of
    /// the same bytes gets a new one, so a stale descriptor is told apart.
    pub fn generation(&self) -> u64 {
        self.descriptor.generation()
    }

    /// Make the buffer's descriptors unreadable and give the writable buffer
    /// back: unmaps the buffer's own registration, which waits for the reads
    /// being served from it.
    ///
    /// # Errors
    /// [`RdmaError::ShuttingDown`] once the registry's shutdown has begun
    /// (the backend's teardown revokes the key; the buffer stays described);
    /// the backend's unmap error, with the key possibly still live. Either
    /// way the error carries the described buffer back.
    ///
    /// # Cancel safety
    /// Dropping the future drops the buffer: the unmap runs to its end in
    /// the background and the buffer's memory goes back to the pool only
    /// once it is confirmed (never, if it fails).
    pub async fn withdraw(self) -> Result<PinnedBuf, WithdrawError> {
        let Some(inner) = self.slot.arena.registry.upgrade() else {
            return Err(WithdrawError::new(RdmaError::ShuttingDown, self));
        };
        // Admitted work: a shutdown drains this unmap before tearing the
        // backend down.
        let Some(ticket) = inner.gate.enter() else {
            return Err(WithdrawError::new(RdmaError::ShuttingDown, self));
        };
        let DescribedBuf {
            slot,
            len,
            descriptor,
        } = self;
        let (sender, receiver) = tokio::sync::oneshot::channel();
        spawn_own_unmap(&inner, slot, Some(ticket), move |outcome| {
            if let Err((error, _)) = &outcome {
                tracing::warn!(%error, "withdrawing a described buffer: its unmap failed, the buffer stays described");
            }
            // Not received (the caller went away), the slot is dropped: its
            // granules go back after a confirmed unmap; after a failed one
            // its registration is unmapped again, or leaked.
            let _ = sender.send(outcome);
        });
        match receiver.await {
            Ok(Ok(slot)) => Ok(PinnedBuf::new(slot, len)),
            Ok(Err((error, slot))) => Err(WithdrawError {
                error,
                buf: Some(DescribedBuf {
                    slot,
                    len,
                    descriptor,
                }),
            }),
            // The registry's runtime dropped the task: the slot was leaked.
            Err(_) => Err(WithdrawError {
                error: RdmaError::ShuttingDown,
                buf: None,
            }),
        }
    }

    fn bytes_ptr(&self) -> *const u8 {
        self.slot.bytes_ptr()
    }
}

impl Deref for DescribedBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `[ptr, ptr + len)` lies inside the slot's granules, which
        // the allocator handed to this slot alone, in an arena kept alive by
        // the slot's `Arc` and initialised since its allocation. Nothing in
        // this process writes them while the buffer is described: it is
        // never a GET destination (GETs take a `&mut PinnedBuf`), safe code
        // gets no `&mut` to them, and the engine serving peers only reads
        // them. The one writer left is outside the process: on RDMA hardware
        // a peer holding the key may write them by DMA, which is the trust
        // boundary the type's documentation and `docs/safety.md` state.
        unsafe { std::slice::from_raw_parts(self.bytes_ptr(), self.len) }
    }
}

impl AsRef<[u8]> for DescribedBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl PinnedBuf {
    /// Lend the buffer to peers' reads.
    ///
    /// Maps its bytes as a registration of their own, so that its
    /// descriptors grant exactly this buffer, and returns the read-only
    /// [`DescribedBuf`] that hands them out.
    ///
    /// Costs one backend map now and one unmap at
    /// [`withdraw`](DescribedBuf::withdraw) or when the buffer is freed
    /// (figures in `docs/benchmarks/history/safety-measurements.md`); the
    /// budget is charged for the buffer's pages once more while it is
    /// described.
    ///
    /// # Errors
    /// [`RdmaError::BufferSurrendered`] for a surrendered buffer;
    /// [`RdmaError::ShuttingDown`]; [`RdmaError::BudgetExceeded`]; the
    /// backend's map error. The error carries the buffer back, unchanged —
    /// except when the backend returns a key no descriptor can carry: that
    /// registration is unmapped in the background and the buffer comes back
    /// surrendered, its granules returning to the pool once the unmap is
    /// confirmed.
    ///
    /// # Cancel safety
    /// Dropping the future drops the buffer; a map already started is rolled
    /// back in the background, and its key was never handed out. The
    /// buffer's granules go back to the pool only once that unmap is
    /// confirmed (never, if it fails: they are leaked and counted in
    /// [`RegistryStats::leaked_bytes`](crate::RegistryStats::leaked_bytes)).
    pub async fn describe(mut self) -> Result<DescribedBuf, DescribeError> {
        let len = self.len();
        let Some(slot) = self.take_slot() else {
            return Err(DescribeError::new(RdmaError::BufferSurrendered, self));
        };
        let Some(inner) = slot.arena.registry.upgrade() else {
            self.restore(slot);
            return Err(DescribeError::new(RdmaError::ShuttingDown, self));
        };
        match describe_slot(&inner, slot, len).await {
            Ok(slot) => {
                let Some(descriptor) = slot.own.as_ref().map(|own| own.descriptor.clone()) else {
                    // Unreachable: `describe_slot` returns `Ok` only with the
                    // registration in the slot.
                    self.restore(slot);
                    return Err(DescribeError::new(RdmaError::RegionNotFound, self));
                };
                Ok(DescribedBuf {
                    slot,
                    len,
                    descriptor,
                })
            }
            Err((error, Some(slot))) => {
                self.restore(slot);
                Err(DescribeError::new(error, self))
            }
            // The slot went with the unmap of a registration it could not
            // describe: the buffer comes back surrendered.
            Err((error, None)) => Err(DescribeError::new(error, self)),
        }
    }
}

/// Map a slot's `len` bytes as a registration of their own.
///
/// Admission, budget, map (rolled back if cancelled), descriptor. Returns the
/// slot with the registration in it, or the error and the slot as it was
/// (`None` only if the backend's key could not be described: the slot then goes
/// with the unmap of that registration, see below).
///
/// The slot itself — not just its arena — is what the map holds while it
/// runs: if the caller is cancelled, the rollback task keeps the granules
/// taken until the backend confirmed the registration gone, so they cannot
/// serve another (writable) buffer under a live key; if that unmap fails,
/// they are leaked and counted.
async fn describe_slot(
    inner: &Arc<Inner>,
    slot: Slot,
    len: usize,
) -> Result<Slot, (RdmaError, Option<Slot>)> {
    let ptr = slot.bytes_ptr() as usize;
    let Some(_ticket) = inner.gate.enter_local() else {
        return Err((RdmaError::ShuttingDown, Some(slot)));
    };
    let Some(pages) = page_enclosing_range(ptr as u64, len as u64, inner.config.page_size) else {
        return Err((RdmaError::OutOfRange, Some(slot)));
    };
    let mut charge = match inner.budget.reserve(pages.len) {
        Ok(charge) => charge,
        Err(error) => return Err((error, Some(slot))),
    };
    // SAFETY: `[ptr, ptr + len)` lies inside the slot's granules, which the
    // slot passed along keeps taken (and its arena allocated) until nothing
    // registers them. The registry never names this registration as a GET
    // destination, so the backend only reads these bytes for peers, and no
    // code of this process writes them while it is live, since only a
    // `DescribedBuf` (read-only) holds it (on RDMA hardware a peer holding
    // the key may write them: the trust boundary `docs/safety.md` states).
    let (outcome, mut slot) = unsafe { MapInFlight::start(inner, ptr, len, slot) }.await;
    let region = match outcome {
        Ok(region) => region,
        Err(error) => return Err((error, Some(slot))),
    };
    // No await from here on: the registration is owned by the slot (and
    // unmapped when it drops) before anyone can cancel us.
    let pinned = crate::registry::system_pages(ptr as u64, len as u64)
        .cover(region.effective_addr, region.effective_len);
    charge.reconcile(pinned.len);
    let descriptor = Descriptor::new(
        &inner.backend_key,
        ptr as u64,
        len as u64,
        inner.next_generation(),
        region.packed_key,
    );
    match descriptor {
        Ok(descriptor) => {
            slot.own = Some(OwnRegistration {
                backend_region_id: region.backend_region_id,
                descriptor,
                _charge: charge,
                _counted: LentCount::new(&inner.lent_registrations),
            });
            Ok(slot)
        }
        Err(error) => {
            // Undo the registration in the background; the granules stay
            // taken until it is confirmed gone (leaked, and counted, if the
            // unmap fails), so the buffer is surrendered.
            let id = region.backend_region_id;
            let backend = Arc::clone(&inner.backend);
            let kept = LeakUnlessReleased::new(slot);
            inner.handle.spawn(async move {
                let outcome = backend.unmap(id).await;
                drop(charge);
                match outcome {
                    Ok(()) => drop(kept.release()),
                    Err(_) => drop(kept), // leaks
                }
            });
            Err((error.into(), None))
        }
    }
}

/// [`PinnedBuf::describe`] failed; the buffer comes back unchanged.
#[derive(Debug, thiserror::Error)]
#[error("describing a pool buffer failed: {error}")]
pub struct DescribeError {
    error: RdmaError,
    buf: PinnedBuf,
}

impl DescribeError {
    fn new(error: RdmaError, buf: PinnedBuf) -> Self {
        Self { error, buf }
    }

    /// Why the buffer was not described.
    pub fn error(&self) -> &RdmaError {
        &self.error
    }

    /// The buffer, as it was before the call.
    pub fn into_buf(self) -> PinnedBuf {
        self.buf
    }

    /// The error and the buffer.
    pub fn into_parts(self) -> (RdmaError, PinnedBuf) {
        (self.error, self.buf)
    }
}

impl From<DescribeError> for RdmaError {
    fn from(error: DescribeError) -> Self {
        error.error
    }
}

/// [`DescribedBuf::withdraw`] failed; the buffer stays described and comes
/// back with the error.
#[derive(Debug, thiserror::Error)]
#[error("withdrawing a described buffer failed: {error}")]
pub struct WithdrawError {
    error: RdmaError,
    /// `None` only if the registry's runtime dropped the unmap before it
    /// completed: the buffer's memory is then leaked, never reused.
    buf: Option<DescribedBuf>,
}

impl WithdrawError {
    fn new(error: RdmaError, buf: DescribedBuf) -> Self {
        Self {
            error,
            buf: Some(buf),
        }
    }

    /// Why the buffer was not withdrawn.
    pub fn error(&self) -> &RdmaError {
        &self.error
    }

    /// The buffer, still described: its descriptors may still be read.
    /// `None` only if the registry's runtime shut down while the unmap was
    /// pending (the memory is then leaked, and counted in
    /// [`RegistryStats::leaked_bytes`](crate::RegistryStats::leaked_bytes)).
    pub fn into_buf(self) -> Option<DescribedBuf> {
        self.buf
    }
}

impl From<WithdrawError> for RdmaError {
    fn from(error: WithdrawError) -> Self {
        error.error
    }
}
