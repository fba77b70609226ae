//! [`DescribedBuf`]: a pool buffer lent to peers' reads, and the way back to
//! a writable [`PinnedBuf`].
//!
//! Only a described buffer has descriptors, and they grant that buffer
//! alone (its own registration, dedicated buffers too); it is read-only
//! while lent, and [`withdraw`](DescribedBuf::withdraw) returns it only
//! after its key is dead. The rules and their reasons are in
//! `docs/safety.md` ("Lending pool buffers").

use std::ops::Deref;
use std::sync::Arc;

use rdmareg_core::{Access, Descriptor, RdmaError, page_enclosing_range};

use super::pinned_buf::{LentCount, OwnRegistration, PinnedBuf, Slot, spawn_own_unmap};
use crate::mapping::{LeakUnlessReleased, MapInFlight};
use crate::registry::Inner;

/// A pool buffer whose bytes peers may read through its descriptors.
///
/// Made by [`PinnedBuf::describe`]; derefs to `[u8]` only, since the
/// owner's engine may read the bytes for a peer at any moment.
/// [`withdraw`](Self::withdraw) returns the writable buffer once every
/// descriptor is dead. On RDMA hardware peers holding a descriptor may also
/// write it: hand descriptors only to trusted peers (`docs/safety.md`).
#[derive(Debug)]
pub struct DescribedBuf {
    /// `slot.own` is always `Some`.
    slot: Slot,
    len: usize,
    descriptor: Descriptor,
}

impl DescribedBuf {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: buffers are at least one byte long.
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

    /// Generation of the buffer's own registration (new at each describe).
    pub fn generation(&self) -> u64 {
        self.descriptor.generation()
    }

    /// Make the buffer's descriptors unreadable and give the writable buffer
    /// back: unmaps its own registration, which waits for reads being served.
    ///
    /// # Errors
    /// [`RdmaError::ShuttingDown`] once shutdown has begun; the backend's
    /// unmap error (the key may still be live). The error carries the
    /// described buffer back.
    ///
    /// # Cancel safety
    /// Dropping the future drops the buffer: the unmap finishes in the
    /// background and the memory returns to the pool only once confirmed.
    pub async fn withdraw(self) -> Result<PinnedBuf, WithdrawError> {
        let Some(inner) = self.slot.arena.registry.upgrade() else {
            return Err(WithdrawError::new(RdmaError::ShuttingDown, self));
        };
        // Admitted work: shutdown drains this unmap first.
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
            // Unreceived, the slot drops: its granules go back only after a
            // confirmed unmap.
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
        // SAFETY: `[ptr, ptr + len)` lies inside granules the allocator
        // gave this slot alone, in an arena the slot's `Arc` keeps alive,
        // initialised since allocation. Nothing in this process writes them
        // while described: never a GET destination, no `&mut` handed out,
        // and the engine only reads them. Peers writing by DMA on RDMA
        // hardware are the trust boundary of `docs/safety.md`.
        unsafe { std::slice::from_raw_parts(self.bytes_ptr(), self.len) }
    }
}

impl AsRef<[u8]> for DescribedBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl PinnedBuf {
    /// Lend the buffer to peers' reads: map its bytes as a registration of
    /// their own, so its descriptors grant exactly this buffer.
    ///
    /// Costs one backend map now and one unmap when withdrawn or freed; the
    /// budget is charged the buffer's pages again while it is described.
    ///
    /// # Errors
    /// [`RdmaError::BufferSurrendered`]; [`RdmaError::ShuttingDown`];
    /// [`RdmaError::BudgetExceeded`]; the backend's map error. The error
    /// carries the buffer back unchanged, except for a key no descriptor can
    /// carry: the buffer then comes back surrendered while that registration
    /// is unmapped.
    ///
    /// # Cancel safety
    /// Dropping the future drops the buffer; a started map is rolled back,
    /// and the granules return to the pool once that is confirmed (or are
    /// leaked and counted in
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
                    // Unreachable: `Ok` always carries the registration.
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
            // The slot went with the unmap of an undescribable key.
            Err((error, None)) => Err(DescribeError::new(error, self)),
        }
    }
}

/// Map a slot's `len` bytes as a registration of their own: admission,
/// budget, map, descriptor.
///
/// The map holds the slot itself, so a cancelled caller's rollback keeps the
/// granules taken until the registration is confirmed gone. The error
/// carries the slot back, `None` if the backend's key could not be described
/// (the slot then goes with that registration's unmap).
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
    // slot keeps taken (and its arena allocated) until nothing registers
    // them. This registration is never a GET destination and only a
    // read-only `DescribedBuf` holds it, so no code of this process writes
    // the bytes while it is live (peers on RDMA hardware: `docs/safety.md`).
    let (outcome, mut slot) =
        unsafe { MapInFlight::start(inner, ptr, len, Access::Read, slot) }.await;
    let region = match outcome {
        Ok(region) => region,
        Err(error) => return Err((error, Some(slot))),
    };
    // No await from here on: the slot owns the registration.
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
            // Unmap in the background; the granules stay taken until that
            // is confirmed, so the buffer comes back surrendered.
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

/// [`DescribedBuf::withdraw`] failed; the buffer stays described.
#[derive(Debug, thiserror::Error)]
#[error("withdrawing a described buffer failed: {error}")]
pub struct WithdrawError {
    error: RdmaError,
    /// `None` if the runtime dropped the unmap: the memory is leaked.
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

    /// The buffer, still described. `None` only if the registry's runtime
    /// shut down while the unmap was pending (the memory is then leaked).
    pub fn into_buf(self) -> Option<DescribedBuf> {
        self.buf
    }
}

impl From<WithdrawError> for RdmaError {
    fn from(error: WithdrawError) -> Self {
        error.error
    }
}
