//! [`LoopbackBackend`]: a real in-process backend, with fault injection.
//!
//! Instances live on a [`LoopbackFabric`] and name each other by [`PeerId`];
//! a GET is a copy from a peer's registered range into one of this
//! instance's. It honours the whole [`RdmaBackend`] contract and passes the
//! conformance kit, so the layers above test against it deterministically.
//!
//! - Ranges are checked against the mapped pointer and length on both sides.
//! - A GET pins both regions until its copy is done or abandoned; an unmap
//!   of either waits, and refuses new GETs from its submission.
//! - A PUT is the same copy the other way; the owner lists its range in
//!   the region's log of written ranges once the copy is done.
//! - The copy is synchronous, after every check and injected delay, so a
//!   dropped GET never leaves a half-done copy.
//! - Faults ([`FaultInjector`]) belong to the instance running the operation.
//! - [`LoopbackBackend::shutdown`] is the teardown.

mod fault;
mod key;
mod leases;
mod ops;
mod table;
mod transfer;

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use parking_lot::Mutex;
use rdmareg_core::{
    Access, BackendGet, BackendPut, BackendRegion, LeaseTerms, MAX_NOTICE_BYTES, Notice,
    NoticeDrops, NoticeSender, PeerId, RdmaError, WrittenRanges,
};
use tokio::sync::watch;

pub use fault::{FaultInjector, FaultOp, HangGate};

use crate::notices::{self, NoticeBoard, NoticeLimits, NoticeSource};
use crate::{BackendLease, RdmaBackend};
use table::RegionTable;

/// The wire name of the loopback backend, carried in its descriptors.
pub const LOOPBACK_BACKEND_KEY: &str = "loopback";

/// Page size assumed where the platform cannot be asked.
const FALLBACK_PAGE_SIZE: u64 = 4096;

/// The page size of this machine, to which effective ranges are rounded.
pub fn page_size() -> u64 {
    static PAGE_SIZE: OnceLock<u64> = OnceLock::new();
    *PAGE_SIZE.get_or_init(query_page_size)
}

#[cfg(unix)]
fn query_page_size() -> u64 {
    // SAFETY: sysconf only reads a system configuration value; it takes no
    // pointers and has no preconditions.
    let raw = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(raw)
        .ok()
        .filter(|size| size.is_power_of_two())
        .unwrap_or(FALLBACK_PAGE_SIZE)
}

#[cfg(not(unix))]
fn query_page_size() -> u64 {
    FALLBACK_PAGE_SIZE
}

/// Settings of one loopback instance.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LoopbackConfig {
    /// Deadline of a GET whose request carries none.
    pub default_get_deadline: Duration,
    /// The bounds of this instance's queue of received notices.
    pub notice_limits: NoticeLimits,
}

impl Default for LoopbackConfig {
    fn default() -> Self {
        Self {
            default_get_deadline: Duration::from_secs(30),
            notice_limits: NoticeLimits::default(),
        }
    }
}

impl LoopbackConfig {
    /// Set [`default_get_deadline`](Self::default_get_deadline).
    pub fn with_default_get_deadline(mut self, deadline: Duration) -> Self {
        self.default_get_deadline = deadline;
        self
    }

    /// Set [`notice_limits`](Self::notice_limits).
    pub fn with_notice_limits(mut self, limits: NoticeLimits) -> Self {
        self.notice_limits = limits;
        self
    }
}

/// Counters of one instance since it was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LoopbackStats {
    /// Maps that returned `Ok`.
    pub maps: u64,
    /// Regions removed, by unmap or by shutdown.
    pub unmaps: u64,
    /// GETs issued by this instance that copied their bytes and returned `Ok`.
    pub gets_completed: u64,
    /// GETs issued by this instance that failed (or were dropped).
    pub gets_failed: u64,
    /// PUTs issued by this instance that copied their bytes and returned `Ok`.
    pub puts_completed: u64,
    /// PUTs issued by this instance that failed (or were dropped).
    pub puts_failed: u64,
    /// Bytes copied by this instance's GETs and PUTs.
    pub bytes_copied: u64,
}

#[derive(Debug, Default)]
struct Counters {
    maps: AtomicU64,
    /// Detached maps in progress, counted live so a count never understates.
    maps_pending: std::sync::atomic::AtomicUsize,
    gets_completed: AtomicU64,
    gets_failed: AtomicU64,
    puts_completed: AtomicU64,
    puts_failed: AtomicU64,
    bytes_copied: AtomicU64,
}

/// The network loopback instances share; clones are the same fabric.
#[derive(Clone, Default)]
pub struct LoopbackFabric {
    inner: Arc<FabricInner>,
}

#[derive(Default)]
struct FabricInner {
    peers: Mutex<HashMap<PeerId, Weak<LoopbackBackend>>>,
    next_instance: AtomicU64,
}

impl fmt::Debug for LoopbackFabric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut peers: Vec<PeerId> = self.inner.peers.lock().keys().copied().collect();
        peers.sort();
        f.debug_struct("LoopbackFabric")
            .field("peers", &peers)
            .finish()
    }
}

impl LoopbackFabric {
    /// An empty fabric.
    pub fn new() -> Self {
        Self::default()
    }

    /// Create an instance addressed by peers as `id`. A reused `id` takes the
    /// name over (a restarted peer): the old instance's keys are stale.
    pub fn backend(&self, id: PeerId) -> Arc<LoopbackBackend> {
        self.backend_with_config(id, LoopbackConfig::default())
    }

    /// [`backend`](Self::backend) with explicit settings.
    pub fn backend_with_config(&self, id: PeerId, config: LoopbackConfig) -> Arc<LoopbackBackend> {
        let instance = self.inner.next_instance.fetch_add(1, Ordering::Relaxed) + 1;
        let backend = Arc::new_cyclic(|me| LoopbackBackend {
            me: me.clone(),
            peer_id: id,
            instance,
            fabric: self.clone(),
            notices: NoticeBoard::new(config.notice_limits),
            notices_sent: Mutex::new(0),
            leases: Mutex::new(leases::LeaseBook::new()),
            config,
            table: RegionTable::new(),
            faults: FaultInjector::default(),
            shutdown: watch::Sender::new(false),
            counters: Counters::default(),
        });
        let previous = self.inner.peers.lock().insert(id, Arc::downgrade(&backend));
        if previous.is_some_and(|old| old.strong_count() > 0) {
            tracing::debug!(%id, "loopback instance replaces a live instance of the same peer id");
        }
        backend
    }

    /// The live instance `id` names, if any.
    fn lookup(&self, id: PeerId) -> Option<Arc<LoopbackBackend>> {
        let mut peers = self.inner.peers.lock();
        let found = peers.get(&id).and_then(Weak::upgrade);
        if found.is_none() {
            peers.remove(&id);
        }
        found
    }
}

/// One loopback instance on a [`LoopbackFabric`], with fault knobs.
pub struct LoopbackBackend {
    /// This instance, for work that outlives a borrow of it (a detached map).
    me: Weak<LoopbackBackend>,
    peer_id: PeerId,
    /// Fabric-unique number; what packed keys name.
    instance: u64,
    fabric: LoopbackFabric,
    config: LoopbackConfig,
    table: RegionTable,
    faults: FaultInjector,
    /// `true` once teardown began. A watch so waiting GETs can complete.
    shutdown: watch::Sender<bool>,
    counters: Counters,
    /// Notices peers sent this instance, by the sending instance's number.
    notices: Arc<NoticeBoard<u64>>,
    /// The last sequence number this instance's notices carried. Held
    /// while a notice is numbered and delivered, so notices sent from
    /// several threads arrive in the order they were numbered.
    notices_sent: Mutex<u64>,
    /// Descriptor leases this instance handed out, by region.
    leases: Mutex<leases::LeaseBook>,
}

impl fmt::Debug for LoopbackBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoopbackBackend")
            .field("peer_id", &self.peer_id)
            .field("live_registrations", &self.table.live())
            .field("shutting_down", &self.is_shutting_down())
            .finish_non_exhaustive()
    }
}

impl LoopbackBackend {
    /// The id peers address this instance by.
    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }

    /// The fault knobs of this instance.
    pub fn faults(&self) -> &FaultInjector {
        &self.faults
    }

    /// The settings this instance was created with.
    pub fn config(&self) -> &LoopbackConfig {
        &self.config
    }

    /// A snapshot of this instance's counters.
    pub fn stats(&self) -> LoopbackStats {
        let c = &self.counters;
        LoopbackStats {
            maps: c.maps.load(Ordering::Relaxed),
            unmaps: self.table.removed(),
            gets_completed: c.gets_completed.load(Ordering::Relaxed),
            gets_failed: c.gets_failed.load(Ordering::Relaxed),
            puts_completed: c.puts_completed.load(Ordering::Relaxed),
            puts_failed: c.puts_failed.load(Ordering::Relaxed),
            bytes_copied: c.bytes_copied.load(Ordering::Relaxed),
        }
    }

    /// Whether teardown has begun.
    pub fn is_shutting_down(&self) -> bool {
        *self.shutdown.borrow()
    }

    /// Tear this instance down: refuse new work with
    /// [`RdmaError::ShuttingDown`], complete waiting GETs that touch it, wait
    /// for transfers still pinning its regions, then force-unmap every
    /// region. Idempotent.
    ///
    /// While fault injection refuses unmaps, regions not already unmapping
    /// stay registered (a wedged backend); calling it again after
    /// `faults().refuse_unmaps(false)` releases them.
    ///
    /// # Cancel safety
    /// The instance keeps refusing new work; call it again to finish.
    pub async fn shutdown(&self) {
        self.shutdown.send_replace(true);
        self.notices.close();
        self.leases.lock().clear();
        self.table.close();
        self.table.wait_unpinned().await;
        let refused = self.faults.unmaps_refused();
        let remaining = self.table.force_release(!refused);
        if remaining > 0 {
            tracing::warn!(
                peer = %self.peer_id,
                remaining,
                "loopback shutdown left regions registered: unmaps are refused"
            );
        } else {
            tracing::debug!(peer = %self.peer_id, "loopback instance shut down");
        }
    }

    fn shutdown_signal(&self) -> watch::Receiver<bool> {
        self.shutdown.subscribe()
    }
}

/// Resolve once `signal` reports teardown.
async fn shut_down(mut signal: watch::Receiver<bool>) {
    // The sender lives as long as the backend; gone, it is shut down too.
    let _ = signal.wait_for(|down| *down).await;
}

// SAFETY: the loopback keeps contract points 1, 3, 4, 8 and 12 (the kit
// checks it): a cancelled map rolls back before anything observes it,
// `unmap` returns `Ok(())` only once no copy uses the region, a GET or PUT
// completes after its copy, and a PUT copies only into a registration
// mapped with write access.
unsafe impl RdmaBackend for LoopbackBackend {
    fn key(&self) -> &str {
        LOOPBACK_BACKEND_KEY
    }

    unsafe fn map(
        &self,
        ptr: usize,
        len: usize,
    ) -> BoxFuture<'_, Result<BackendRegion, RdmaError>> {
        // The caller's promise (its memory, allocated until the unmap)
        // makes `run_get`'s copies sound.
        Box::pin(self.run_map(ptr, len, Access::Read))
    }

    unsafe fn map_with_access(
        &self,
        ptr: usize,
        len: usize,
        access: Access,
    ) -> BoxFuture<'_, Result<BackendRegion, RdmaError>> {
        // As `map`; with write access the caller also accepted peers'
        // writes into the range.
        Box::pin(self.run_map(ptr, len, access))
    }

    fn unmap(&self, backend_region_id: u64) -> BoxFuture<'_, Result<(), RdmaError>> {
        Box::pin(self.run_unmap(backend_region_id))
    }

    unsafe fn get(&self, request: BackendGet) -> BoxFuture<'_, Result<(), RdmaError>> {
        // The caller's promise (the destination is untouched until the GET
        // completes) lets the copy write it.
        Box::pin(self.run_get(request))
    }

    unsafe fn put(&self, request: BackendPut) -> BoxFuture<'_, Result<(), RdmaError>> {
        // The caller's promise (the source is not written until the PUT
        // completes) lets the copy read it.
        Box::pin(self.run_put(request))
    }

    fn live_registrations(&self) -> Option<usize> {
        // Pending first: a map registering in between counts twice, not 0.
        let pending = self.counters.maps_pending.load(Ordering::SeqCst);
        Some(self.table.live() + pending)
    }

    fn transfers_in_flight(&self, backend_region_id: u64) -> Option<usize> {
        Some(self.table.pins(backend_region_id))
    }

    /// A PUT is listed once its copy is done, before it completes.
    fn take_written(
        &self,
        backend_region_id: u64,
    ) -> BoxFuture<'_, Result<WrittenRanges, RdmaError>> {
        let taken = self
            .table
            .take_written(backend_region_id)
            .ok_or(RdmaError::RegionNotFound);
        Box::pin(async move { taken })
    }

    fn send_notice(&self, peer: PeerId, notice: Bytes) -> BoxFuture<'_, Result<(), RdmaError>> {
        Box::pin(async move { self.deliver_notice(peer, &notice) })
    }

    fn notices(&self) -> Result<BoxStream<'static, Notice>, RdmaError> {
        Ok(Arc::clone(&self.notices).boxed_stream())
    }

    fn notice_drops(&self) -> Option<NoticeDrops> {
        Some(self.notices.drops())
    }

    fn notice_sender(&self) -> Option<NoticeSender> {
        Some(self.notice_sender())
    }

    fn lease(
        &self,
        backend_region_id: u64,
        terms: LeaseTerms,
    ) -> BoxFuture<'_, Result<BackendLease, RdmaError>> {
        Box::pin(async move { self.make_lease(backend_region_id, terms) })
    }

    fn release_lease(
        &self,
        peer: PeerId,
        packed_key: Bytes,
    ) -> BoxFuture<'_, Result<(), RdmaError>> {
        Box::pin(async move { self.send_release(peer, &packed_key) })
    }
}

impl LoopbackBackend {
    /// The sender number of this instance's notices: its fabric-unique
    /// instance number.
    fn notice_sender(&self) -> NoticeSender {
        NoticeSender(self.instance)
    }

    /// Hands `notice` to `peer`'s board at once: the fabric is reliable and
    /// in order, so this is the whole transport.
    fn deliver_notice(&self, peer: PeerId, notice: &[u8]) -> Result<(), RdmaError> {
        if notice.len() > MAX_NOTICE_BYTES {
            return Err(RdmaError::NoticeTooLarge {
                length: notice.len() as u64,
            });
        }
        if self.is_shutting_down() {
            return Err(RdmaError::ShuttingDown);
        }
        let owner = self.fabric.lookup(peer).ok_or(RdmaError::NotConfigured)?;
        let mut sent = self.notices_sent.lock();
        let message = notices::wire::encode(self.instance, *sent + 1, notice)?;
        *sent += 1;
        // A drop is the owner's to count, as over a real transport.
        let _ = owner.notices.receive(self.instance, &message);
        Ok(())
    }
}
