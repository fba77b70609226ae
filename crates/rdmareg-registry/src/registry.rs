//! [`RdmaRegistry`]: the entry point, and the state every handle shares.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::stream::BoxStream;
use parking_lot::Mutex;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{
    Access, Descriptor, Notice, NoticeDrops, NoticeSender, PageRange, PeerId, RdmaError,
    page_enclosing_range,
};
use tokio::runtime::Handle;

use crate::budget::Budget;
use crate::config::{ConfigError, RdmaConfig};
use crate::gate::Gate;
use crate::latch::Latch;
use crate::mapping::MapInFlight;
use crate::metrics::{Counters, RegistryMetrics};
use crate::pool::arena::Arena;
use crate::pool::{self, PinnedBuf, Pool};
use crate::region::state::{NewRegion, RegionState, spawn_background_deregistration};
use crate::region::{OwnedBuffer, RegionGuard};
use crate::shutdown::{self, SweptRegistry};
use crate::stats::RegistryStats;
use crate::transfer;
use crate::transfer_list::{self, TransferList};

/// State shared by the registry handle, guards, buffers and background tasks.
pub(crate) struct Inner {
    pub(crate) backend: Arc<dyn RdmaBackend>,
    pub(crate) backend_key: String,
    pub(crate) config: RdmaConfig,
    pub(crate) handle: Handle,
    pub(crate) budget: Arc<Budget>,
    pub(crate) gate: Arc<Gate>,
    pub(crate) shutdown_started: Latch,
    pub(crate) tables: Mutex<Tables>,
    pub(crate) pool: Pool,
    next_generation: AtomicU64,
    pub(crate) transfers_in_flight: AtomicUsize,
    pub(crate) leaked_bytes: Arc<AtomicU64>,
    pub(crate) map_rollbacks: tokio::sync::watch::Sender<usize>,
    /// Set once the torn-down backend holds nothing: ends retrying rollbacks.
    pub(crate) backend_released_everything: tokio::sync::watch::Sender<bool>,
    pub(crate) lent_registrations: Arc<AtomicUsize>,
    pub(crate) shutdown_serial: tokio::sync::Mutex<()>,
    pub(crate) counters: Counters,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inner")
            .field("backend", &self.backend_key)
            .finish_non_exhaustive()
    }
}

/// Every registration the registry is responsible for.
#[derive(Debug, Default)]
pub(crate) struct Tables {
    /// Set by the shutdown sweep; later registrations release themselves.
    pub(crate) swept: bool,
    pub(crate) regions: HashMap<u64, Arc<RegionState>>,
    pub(crate) arenas: HashMap<u64, Arc<Arena>>,
}

impl Inner {
    pub(crate) fn next_generation(&self) -> u64 {
        self.next_generation.fetch_add(1, Ordering::Relaxed)
    }
}

/// Registers memory with an [`RdmaBackend`], hands out pinned buffers, moves
/// bytes with GETs, and shuts all of it down in order. Clones share one
/// registry.
///
/// # Call order
///
/// 1. [`new`](Self::new), one registry per backend.
/// 2. [`register_owned`](Self::register_owned) /
///    [`register_external`](Self::register_external), or allocate with
///    [`alloc_pinned`](Self::alloc_pinned).
/// 3. Describe with [`RegionGuard::descriptor`] or [`PinnedBuf::describe`]
///    and send the encoding to a trusted peer.
/// 4. [`get`](Self::get) a peer's descriptor into a [`PinnedBuf`].
/// 5. [`RegionGuard::unregister`], drop the buffers.
/// 6. [`shutdown`](Self::shutdown), tear the backend down, then
///    [`SweptRegistry::finish_after_backend_teardown`].
#[derive(Clone, Debug)]
pub struct RdmaRegistry {
    inner: Arc<Inner>,
}

/// The page-enclosing range of `[addr, addr + len)` at the system page
/// size: the least a registration pins. The range must not overflow.
pub(crate) fn system_pages(addr: u64, len: u64) -> PageRange {
    page_enclosing_range(addr, len, rdmareg_backend::page_size())
        .unwrap_or(PageRange { start: addr, len })
}

/// The first byte of a range being registered, carried across an await.
struct Address(std::ptr::NonNull<u8>);

// SAFETY: the pointer is carried, not dereferenced: it is handed to the
// backend as an address and stored in the region state, whose reads follow
// the lease protocol (see `region::watch`).
unsafe impl Send for Address {}

/// Why [`RdmaRegistry::register_owned`] refused; carries the buffer back.
#[derive(thiserror::Error, Debug)]
#[error("{error}")]
pub struct RegisterOwnedError {
    /// What went wrong ([`RdmaError::BudgetExceeded`] is the routine one).
    pub error: RdmaError,
    /// The caller's buffer, untouched.
    pub buffer: Box<[u8]>,
}

impl RegisterOwnedError {
    /// The caller's buffer, untouched, for a fallback path.
    pub fn into_buffer(self) -> Box<[u8]> {
        self.buffer
    }
}

/// Lets `?` turn a refusal into its [`RdmaError`], dropping the buffer.
impl From<RegisterOwnedError> for RdmaError {
    fn from(e: RegisterOwnedError) -> Self {
        e.error
    }
}

impl RdmaRegistry {
    /// A registry over `backend`, spawning its background work on `handle`.
    ///
    /// # Errors
    /// [`ConfigError`] if `config` fails [`RdmaConfig::validate`].
    pub fn new(
        backend: Arc<dyn RdmaBackend>,
        config: RdmaConfig,
        handle: Handle,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        let inner = Inner {
            backend_key: backend.key().to_owned(),
            backend,
            budget: Budget::new(config.budget_bytes),
            pool: Pool::new(config.pool.first_arena_bytes),
            config,
            handle,
            gate: Arc::new(Gate::new()),
            shutdown_started: Latch::new(),
            tables: Mutex::new(Tables::default()),
            next_generation: AtomicU64::new(1),
            transfers_in_flight: AtomicUsize::new(0),
            leaked_bytes: Arc::new(AtomicU64::new(0)),
            map_rollbacks: tokio::sync::watch::Sender::new(0),
            backend_released_everything: tokio::sync::watch::Sender::new(false),
            lent_registrations: Arc::new(AtomicUsize::new(0)),
            shutdown_serial: tokio::sync::Mutex::new(()),
            counters: Counters::default(),
        };
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> &RdmaConfig {
        &self.inner.config
    }

    /// The backend's wire name, as carried in this registry's descriptors.
    pub fn backend_key(&self) -> &str {
        &self.inner.backend_key
    }

    /// Whether [`shutdown`](Self::shutdown) has begun.
    pub fn is_shutting_down(&self) -> bool {
        self.inner.shutdown_started.is_released()
    }

    /// Register memory the caller owns and keeps; the budget is charged
    /// the page-enclosing range. A registration completed after the
    /// shutdown sweep returns its guard already deregistering.
    ///
    /// # Safety
    /// Until the guard's [`deregistered`](RegionGuard::deregistered)
    /// resolves, `[ptr, ptr + len)` stays allocated and valid for reads and
    /// writes, and no Rust reference points into it (peers may write it on
    /// RDMA hardware; read it through [`RegionWatch::read`](crate::RegionWatch::read)).
    ///
    /// # Errors
    /// [`RdmaError::OutOfRange`] for a null, empty or overflowing range;
    /// [`RdmaError::ShuttingDown`]; [`RdmaError::BudgetExceeded`]; the
    /// backend's map error. After an error the range may be reused at once.
    ///
    /// # Cancel safety
    /// Dropping the future returns the charge and rolls a started map back
    /// in the background; the range may be reused once
    /// [`map_rollbacks_settled`](Self::map_rollbacks_settled) resolves.
    pub unsafe fn register_external(
        &self,
        ptr: *mut u8,
        len: usize,
    ) -> impl Future<Output = Result<RegionGuard, RdmaError>> + Send + '_ {
        // SAFETY: this function's caller gives `register_external_with`'s
        // terms, which for `Access::Read` are these.
        unsafe { self.register_external_with(ptr, len, Access::Read) }
    }

    /// [`register_external`](Self::register_external), granting peers
    /// `access`: with [`Access::Write`] or [`Access::ReadWrite`] peers
    /// holding the descriptor may [`put`](Self::put) into the range.
    ///
    /// # Safety
    /// As [`register_external`](Self::register_external). With an access
    /// that allows writes, peers write the range at any moment until the
    /// guard's [`deregistered`](RegionGuard::deregistered) resolves: read it
    /// only through [`RegionWatch::read`](crate::RegionWatch::read) or raw
    /// pointer copies, never through a reference.
    ///
    /// # Errors
    /// As [`register_external`](Self::register_external);
    /// [`RdmaError::Unsupported`] from a backend that cannot grant writes.
    ///
    /// # Cancel safety
    /// As [`register_external`](Self::register_external).
    pub unsafe fn register_external_with(
        &self,
        ptr: *mut u8,
        len: usize,
        access: Access,
    ) -> impl Future<Output = Result<RegionGuard, RdmaError>> + Send + '_ {
        let range = std::ptr::NonNull::new(ptr)
            .filter(|p| (p.as_ptr() as usize).checked_add(len).is_some() && len > 0)
            .map(Address);
        async move {
            let result = match range {
                Some(range) => self
                    .register_range(range, len, access, None)
                    .await
                    .map_err(|(error, _)| error),
                None => Err(RdmaError::OutOfRange),
            };
            self.inner.counters.outcome(&result);
            result
        }
    }

    /// Register a buffer the registry takes ownership of; get it back with
    /// [`RegionGuard::unregister_owned`].
    ///
    /// # Errors
    /// As [`register_external`](Self::register_external); every refusal
    /// hands the buffer back untouched. An empty buffer is
    /// [`RdmaError::OutOfRange`].
    ///
    /// # Cancel safety
    /// Dropping the future returns the charge and forfeits the buffer, which
    /// is freed once the rollback's unmap is confirmed (leaked if it fails).
    pub async fn register_owned(
        &self,
        buffer: Box<[u8]>,
    ) -> Result<RegionGuard, RegisterOwnedError> {
        self.register_owned_with(buffer, Access::Read).await
    }

    /// [`register_owned`](Self::register_owned), granting peers `access`:
    /// with [`Access::Write`] or [`Access::ReadWrite`] peers holding the
    /// descriptor may [`put`](Self::put) into the buffer. Read what they
    /// wrote through [`RegionGuard::watch`] while it is registered, or from
    /// the buffer [`RegionGuard::unregister_owned`] hands back.
    ///
    /// # Errors
    /// As [`register_owned`](Self::register_owned);
    /// [`RdmaError::Unsupported`] from a backend that cannot grant writes.
    ///
    /// # Cancel safety
    /// As [`register_owned`](Self::register_owned).
    pub async fn register_owned_with(
        &self,
        buffer: Box<[u8]>,
        access: Access,
    ) -> Result<RegionGuard, RegisterOwnedError> {
        if buffer.is_empty() {
            self.inner.counters.error(&RdmaError::OutOfRange);
            return Err(RegisterOwnedError {
                error: RdmaError::OutOfRange,
                buffer,
            });
        }
        let owned = OwnedBuffer::from_box(buffer, Arc::clone(&self.inner.leaked_bytes));
        let (start, len) = (Address(owned.as_ptr()), owned.len());
        self.register_range(start, len, access, Some(owned))
            .await
            .map_err(|(error, owned)| {
                self.inner.counters.error(&error);
                RegisterOwnedError {
                    error,
                    // Every refusal precedes the map: the buffer is free.
                    buffer: owned.and_then(OwnedBuffer::into_box).unwrap_or_default(),
                }
            })
    }

    /// Admission, budget, map, track; an error hands the buffer back.
    async fn register_range(
        &self,
        start: Address,
        len: usize,
        access: Access,
        mut owned: Option<OwnedBuffer>,
    ) -> Result<RegionGuard, (RdmaError, Option<OwnedBuffer>)> {
        let inner = &self.inner;
        let addr = start.0.as_ptr() as usize;
        let Some(_ticket) = inner.gate.enter_local() else {
            return Err((RdmaError::ShuttingDown, owned));
        };
        let Some(enclosing) = page_enclosing_range(addr as u64, len as u64, inner.config.page_size)
        else {
            return Err((RdmaError::OutOfRange, owned));
        };
        let mut charge = match inner.budget.reserve(enclosing.len) {
            Ok(charge) => charge,
            Err(error) => return Err((error, owned)),
        };
        // SAFETY: the range is the bytes of `owned`, which `MapInFlight`
        // keeps until nothing registers them, or (for `None`) a range whose
        // owner promised what `register_external` asks; the registry never
        // names either as a GET destination.
        let (outcome, back) = unsafe { MapInFlight::start(inner, addr, len, access, owned) }.await;
        owned = back;
        let mapped = match outcome {
            Ok(mapped) => mapped,
            Err(error) => return Err((error, owned)),
        };
        // No await from here on: a mapped region is tracked before any
        // cancellation point.
        if let Some(owned) = owned.as_mut() {
            owned.mark_registered();
        }
        // Never less than the pages the OS pins (contract point 7).
        let effective = system_pages(addr as u64, len as u64)
            .cover(mapped.effective_addr, mapped.effective_len);
        charge.reconcile(effective.len);
        let generation = inner.next_generation();
        let descriptor = Descriptor::new(
            &inner.backend_key,
            addr as u64,
            len as u64,
            generation,
            mapped.packed_key.clone(),
        )
        .map(|descriptor| descriptor.granting(access))
        .map_err(RdmaError::from);
        let state = Arc::new(RegionState::new(
            NewRegion {
                generation,
                backend_region_id: mapped.backend_region_id,
                ptr: start.0,
                len,
                effective,
                descriptor,
                charge,
                owned,
            },
            Arc::downgrade(inner),
        ));
        inner.counters.registered();
        let late = {
            let mut tables = inner.tables.lock();
            tables.regions.insert(generation, Arc::clone(&state));
            tables.swept
        };
        if late {
            // Past the sweep: release now, but return the guard, whose
            // latch says when the memory is free.
            tracing::warn!(
                generation,
                "registration completed after the shutdown sweep; deregistering it at once"
            );
            spawn_background_deregistration(
                Arc::clone(inner),
                Arc::clone(&state),
                "registered after the shutdown sweep",
            );
        }
        Ok(RegionGuard::new(Arc::clone(inner), state))
    }

    /// Allocate a pinned buffer of exactly `len` bytes from the pool,
    /// mapping a new arena if none has room.
    ///
    /// # Errors
    /// [`RdmaError::OutOfRange`] for `len == 0` or a size the pool cannot
    /// index; [`RdmaError::ShuttingDown`]; [`RdmaError::BudgetExceeded`] if
    /// a needed arena does not fit the budget; the backend's map error.
    ///
    /// # Cancel safety
    /// A dropped arena map is rolled back in the background; a completed
    /// one stays in the pool.
    pub async fn alloc_pinned(&self, len: usize) -> Result<PinnedBuf, RdmaError> {
        let result = pool::alloc_pinned(&self.inner, len).await;
        self.inner.counters.outcome(&result);
        result
    }

    /// Allocate from arenas already mapped, never mapping. `None` if none
    /// has room, `len` is zero or needs its own arena, or shutdown began.
    pub fn try_alloc_pinned(&self, len: usize) -> Option<PinnedBuf> {
        pool::try_alloc_pinned(&self.inner, len)
    }

    /// Read the whole range `src` describes from `peer` into the start of
    /// `dst`.
    ///
    /// # Errors
    /// As [`get_into`](Self::get_into).
    ///
    /// # Cancel safety
    /// As [`get_into`](Self::get_into): a cancelled GET surrenders `dst`.
    pub async fn get(
        &self,
        peer: PeerId,
        src: &Descriptor,
        dst: &mut PinnedBuf,
    ) -> Result<(), RdmaError> {
        transfer::get(&self.inner, peer, src, dst, 0, None).await
    }

    /// [`get`](Self::get), then `notice` to `peer` once the read completed:
    /// the owner receives it from its [`notices`](Self::notices) only after
    /// the bytes are in `dst`, and never after a read that failed. Use it to
    /// tell an owner it may free what was read.
    ///
    /// `Ok(())` means the read completed and the notice was handed on for
    /// sending, in order with this engine's later notices. An error is the
    /// read's (no notice was sent) or, after a read that completed, the
    /// notice's own.
    ///
    /// # Errors
    /// [`RdmaError::NoticeTooLarge`] past
    /// [`MAX_NOTICE_BYTES`](rdmareg_core::MAX_NOTICE_BYTES), before anything
    /// is read; [`RdmaError::Unsupported`] for a backend without notices;
    /// otherwise as [`get_into`](Self::get_into) and
    /// [`notify`](Self::notify).
    ///
    /// # Cancel safety
    /// As [`get_into`](Self::get_into): a cancelled GET surrenders `dst`;
    /// its notice may or may not be sent.
    pub async fn get_with_notice(
        &self,
        peer: PeerId,
        src: &Descriptor,
        dst: &mut PinnedBuf,
        notice: impl Into<Bytes>,
    ) -> Result<(), RdmaError> {
        transfer::get(&self.inner, peer, src, dst, 0, Some(notice.into())).await
    }

    /// Send `notice` to `peer`'s engine on its own, with no read.
    ///
    /// Notices are not acknowledged: `Ok(())` means the transport took it.
    /// A reader's notices reach an owner at most once, in the order sent.
    ///
    /// # Errors
    /// [`RdmaError::NoticeTooLarge`]; [`RdmaError::NotConfigured`] for a
    /// peer the backend does not know; [`RdmaError::ShuttingDown`];
    /// [`RdmaError::Unsupported`] for a backend without notices; the
    /// backend's send error.
    pub async fn notify(&self, peer: PeerId, notice: impl Into<Bytes>) -> Result<(), RdmaError> {
        let _ticket = self.inner.gate.enter().ok_or(RdmaError::ShuttingDown)?;
        let result = self.inner.backend.send_notice(peer, notice.into()).await;
        self.inner.counters.outcome(&result);
        result
    }

    /// Tell `peer`, the owner that leased `descriptor`, that this reader is
    /// done with it (`RegionGuard::lease`). The owner counts one release
    /// per reader; like a notice it is not acknowledged, and a lost one
    /// costs the owner only the wait until the lease's expiry.
    ///
    /// # Errors
    /// [`RdmaError::InvalidKey`] for a descriptor that is not a lease of
    /// this backend (another backend's, or a region's own);
    /// [`RdmaError::NotConfigured`] for a peer the backend does not know;
    /// [`RdmaError::ShuttingDown`]; [`RdmaError::Unsupported`] for a
    /// backend without leases; the backend's send error.
    pub async fn release_lease(
        &self,
        peer: PeerId,
        descriptor: &Descriptor,
    ) -> Result<(), RdmaError> {
        let _ticket = self.inner.gate.enter().ok_or(RdmaError::ShuttingDown)?;
        if descriptor.backend_key() != self.inner.backend_key {
            return Err(RdmaError::InvalidKey);
        }
        let result = self
            .inner
            .backend
            .release_lease(peer, descriptor.packed_key().clone())
            .await;
        self.inner.counters.outcome(&result);
        result
    }

    /// The notices readers send this registry's engine, oldest first. The
    /// queue behind it is bounded by the backend; what does not fit is
    /// dropped and counted in [`notice_drops`](Self::notice_drops). Several
    /// streams share the queue; the streams end when the backend shuts
    /// down.
    ///
    /// # Errors
    /// [`RdmaError::Unsupported`] for a backend without notices.
    pub fn notices(&self) -> Result<BoxStream<'static, Notice>, RdmaError> {
        self.inner.backend.notices()
    }

    /// Notices the engine dropped, by reason; `None` for a backend without
    /// notices.
    pub fn notice_drops(&self) -> Option<NoticeDrops> {
        self.inner.backend.notice_drops()
    }

    /// The sender number this engine's notices carry (what an owner sees
    /// as [`Notice::from`]); `None` for a backend without notices.
    pub fn notice_sender(&self) -> Option<NoticeSender> {
        self.inner.backend.notice_sender()
    }

    /// Read the range `src` describes (cut a sub-range with
    /// [`Descriptor::slice`]) from `peer` into `dst` at `dst_offset`.
    ///
    /// The transfer holds `dst`'s pool slot until the backend has finished
    /// with it, awaited or not; shutdown waits for it.
    ///
    /// # Errors
    /// [`RdmaError::InvalidDescriptor`] if `src` names another backend;
    /// [`RdmaError::DestinationTooSmall`] if `src.len()` bytes do not fit
    /// `dst` at `dst_offset` ([`RdmaError::OutOfRange`] if that sum
    /// overflows); [`RdmaError::BufferSurrendered`] for a surrendered `dst`;
    /// [`RdmaError::ForeignBuffer`] for a `dst` another registry allocated;
    /// [`RdmaError::ShuttingDown`]; the backend's GET error (e.g.
    /// [`RdmaError::Timeout`] past the configured deadline).
    ///
    /// # Cancel safety
    /// Not cancel-safe for `dst`: dropping the future surrenders it (see
    /// [`PinnedBuf::is_surrendered`]), since the backend may still write it;
    /// the memory returns to the pool when the transfer finishes.
    pub async fn get_into(
        &self,
        peer: PeerId,
        src: &Descriptor,
        dst: &mut PinnedBuf,
        dst_offset: usize,
    ) -> Result<(), RdmaError> {
        transfer::get(&self.inner, peer, src, dst, dst_offset, None).await
    }

    /// Write the first `dst.len()` bytes of `src` into the range `dst`
    /// describes on `peer`, which its owner registered with write access.
    ///
    /// `Ok(())` means the bytes are in the owner's registration and the
    /// backend let go of `src`.
    ///
    /// # Errors
    /// As [`put_from`](Self::put_from).
    ///
    /// # Cancel safety
    /// As [`put_from`](Self::put_from): a cancelled PUT surrenders `src`.
    pub async fn put(
        &self,
        peer: PeerId,
        src: &mut PinnedBuf,
        dst: &Descriptor,
    ) -> Result<(), RdmaError> {
        transfer::put(&self.inner, peer, src, 0, dst).await
    }

    /// Write `src[src_offset .. src_offset + dst.len()]` into the range
    /// `dst` describes on `peer`.
    ///
    /// # Errors
    /// [`RdmaError::AccessDenied`] if `dst` does not grant writes (checked
    /// here when the descriptor says so, and by the owner whatever it
    /// says); [`RdmaError::InvalidDescriptor`] if `dst` names another
    /// backend; [`RdmaError::SourceTooSmall`] if `dst.len()` bytes from
    /// `src_offset` leave `src` ([`RdmaError::OutOfRange`] if that sum
    /// overflows); [`RdmaError::BufferSurrendered`] for a surrendered `src`;
    /// [`RdmaError::ForeignBuffer`] for a `src` another registry allocated;
    /// [`RdmaError::ShuttingDown`]; [`RdmaError::Unsupported`] for a backend
    /// without writes; the backend's error (e.g. [`RdmaError::Timeout`] past
    /// the configured deadline, after which the target range holds
    /// unspecified bytes of `src` or its earlier ones).
    ///
    /// # Cancel safety
    /// Not cancel-safe for `src`: dropping the future surrenders it (see
    /// [`PinnedBuf::is_surrendered`]), since the backend may still read it;
    /// the memory returns to the pool when the transfer finishes.
    pub async fn put_from(
        &self,
        peer: PeerId,
        src: &mut PinnedBuf,
        src_offset: usize,
        dst: &Descriptor,
    ) -> Result<(), RdmaError> {
        transfer::put(&self.inner, peer, src, src_offset, dst).await
    }

    /// An empty [`TransferList`] of reads from `peer`, to
    /// [`post`](Self::post) as often as needed.
    pub fn transfer_list(&self, peer: PeerId) -> TransferList {
        TransferList::new(peer, &self.inner.backend_key)
    }

    /// Post every read of `list` as one batch into `buffers` (entries name
    /// buffers by index); one result per entry, in list order.
    ///
    /// Posting a list again into the same buffers is the cheap case: the
    /// backend may reuse what it worked out at the last post.
    ///
    /// # Errors
    /// The outer error means nothing was submitted:
    /// [`RdmaError::MissingBuffers`] for fewer buffers than the entries name,
    /// [`RdmaError::DestinationTooSmall`], [`RdmaError::BufferSurrendered`],
    /// [`RdmaError::ForeignBuffer`], [`RdmaError::InvalidDescriptor`] for a
    /// list built for another backend, [`RdmaError::ShuttingDown`]. Each
    /// inner result is as [`get_into`](Self::get_into) would return it.
    ///
    /// # Cancel safety
    /// Not cancel-safe for `buffers`: dropping the future surrenders every
    /// buffer the list writes (see [`PinnedBuf::is_surrendered`]).
    pub async fn post(
        &self,
        list: &TransferList,
        buffers: &mut [PinnedBuf],
    ) -> Result<Vec<Result<(), RdmaError>>, RdmaError> {
        transfer_list::post(&self.inner, list, buffers).await
    }

    /// [`post`](Self::post) `list`, then send `notice` to the list's peer
    /// once every entry completed successfully (an empty list has nothing
    /// to wait for, so its notice goes at once); if any failed, the notice
    /// is withheld (never sent), as for
    /// [`get_with_notice`](Self::get_with_notice).
    ///
    /// The outer result is `post`'s, or the notice's own error after a
    /// list that read in full; the inner results are each entry's.
    ///
    /// # Errors
    /// [`RdmaError::NoticeTooLarge`], and [`RdmaError::Unsupported`] for a
    /// backend without notices, before anything is read; otherwise as
    /// [`post`](Self::post) and [`notify`](Self::notify).
    ///
    /// # Cancel safety
    /// As [`post`](Self::post); a notice whose list completed may or may
    /// not be sent.
    pub async fn post_with_notice(
        &self,
        list: &TransferList,
        buffers: &mut [PinnedBuf],
        notice: impl Into<Bytes>,
    ) -> Result<Vec<Result<(), RdmaError>>, RdmaError> {
        let notice = notice.into();
        if notice.len() > rdmareg_core::MAX_NOTICE_BYTES {
            return Err(RdmaError::NoticeTooLarge {
                length: notice.len() as u64,
            });
        }
        if self.inner.backend.notice_sender().is_none() {
            // Nothing to send it with: refuse before reading.
            return Err(RdmaError::Unsupported {
                operation: "notices",
            });
        }
        let results = self.post(list, buffers).await?;
        if results.iter().all(Result::is_ok) {
            self.notify(list.peer(), notice).await?;
        }
        Ok(results)
    }

    /// The one-shot form of [`post`](Self::post): read each `(src, buffer,
    /// offset)` from `peer` as one batch.
    ///
    /// # Errors
    /// A malformed entry (another backend's descriptor, an empty range)
    /// fails the call before anything is submitted; otherwise as
    /// [`post`](Self::post).
    ///
    /// # Cancel safety
    /// As [`post`](Self::post).
    pub async fn get_many(
        &self,
        peer: PeerId,
        reads: &[(&Descriptor, usize, usize)],
        buffers: &mut [PinnedBuf],
    ) -> Result<Vec<Result<(), RdmaError>>, RdmaError> {
        let mut list = self.transfer_list(peer);
        for &(src, buffer, offset) in reads {
            if let Err(error) = list.push(src, buffer, offset) {
                self.inner.counters.error(&error);
                return Err(error);
            }
        }
        self.post(&list, buffers).await
    }

    /// Shut down, step one: refuse new work, wait for admitted work (not
    /// buffers merely held), then deregister every region and arena, all
    /// within `budget`. An unmap still waiting for a transfer goes on in the
    /// background and is reported pending, not surviving.
    ///
    /// Then tear the backend down and call
    /// [`SweptRegistry::finish_after_backend_teardown`]. A second call
    /// re-sweeps whatever is left.
    ///
    /// # Cancel safety
    /// Dropping the future leaves the registry closed to new work; unmaps
    /// already submitted proceed. Call it again to complete the sweep.
    pub async fn shutdown(&self, budget: Duration) -> SweptRegistry {
        shutdown::shutdown(&self.inner, budget).await
    }

    /// Resolves once every cancelled registration has been rolled back;
    /// the owner of a cancelled external range waits for this to reuse it.
    ///
    /// A rollback whose unmap the backend refuses keeps retrying (counted
    /// in [`RegistryStats::map_rollbacks_in_flight`](crate::RegistryStats::map_rollbacks_in_flight)),
    /// so this waits until the backend lets the range go or
    /// [`SweptRegistry::finish_after_backend_teardown`] confirms it holds
    /// nothing.
    ///
    /// # Cancel safety
    /// Cancel-safe: it only observes.
    pub async fn map_rollbacks_settled(&self) {
        let mut count = self.inner.map_rollbacks.subscribe();
        let _ = count.wait_for(|n| *n == 0).await;
    }

    /// Current figures.
    pub fn stats(&self) -> RegistryStats {
        RegistryStats::collect(&self.inner)
    }

    /// Cumulative counters and a GET-latency histogram, with the current
    /// [`stats`](Self::stats). Cheap: atomic loads and a table walk.
    pub fn metrics(&self) -> RegistryMetrics {
        self.inner.counters.snapshot(self.stats())
    }
}
