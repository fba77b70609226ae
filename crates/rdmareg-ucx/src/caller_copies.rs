//! Same-host reads copied on the caller's own thread.
//!
//! A small same-host read that the progress thread copies
//! (`progress::vectored`) spends most of its time on two thread hand-offs.
//! When everything the read needs is published, the caller copies it
//! itself with one `process_vm_readv`, and the read completes before
//! [`UcxBackend::get`](crate::UcxBackend) returns. See `docs/safety.md`,
//! "Caller copies".
//!
//! # What the progress thread publishes
//!
//! - **The owner's process** per peer, once the thread would copy that
//!   peer's reads itself (`gets::copy_source`), with its token
//!   (`owner_process`) and release table (`release_table`), checked before
//!   and after each copy. Withdrawn when the peer is removed or re-added,
//!   when a copy is refused or finds the owner gone, when a direct endpoint
//!   fails, and at teardown.
//! - **The destination's mapped range** per region: published when a map
//!   succeeds, withdrawn when an unmap is *submitted* and again by the
//!   thread before any unmap.
//! - **The direct lane's key layout**, so a key is checked as the thread
//!   checks it.
//!
//! # Rules
//!
//! - A copy runs under the read lock and a withdrawal takes the write lock,
//!   so once a destination is withdrawn no copy into it runs or starts.
//! - Order as on the ring: a read submitted after an unmap of its
//!   destination, or after a peer change not yet applied, goes to the
//!   thread.
//! - Only reads (or whole batches from one owner) of at most
//!   [`UcxConfig::caller_copy_limit`](crate::UcxConfig::caller_copy_limit)
//!   bytes, because maps, unmaps and peer changes wait for a running copy.
//! - Anything else (nothing published, a malformed key, a range outside the
//!   key or the destination, a failed copy) goes to the thread, which reads
//!   it or returns the typed error. A read whose registration was released
//!   before or during the copy has its destination zeroed and the thread
//!   completes it with `RegionNotFound`.
//! - Every [`COPIES_BETWEEN_YIELDS`]th copy on a thread yields once after
//!   its bytes are written (`yield_due`): a copied read is ready on its first
//!   poll, and a loop of them would otherwise starve its executor.
//!
//! # Writes
//!
//! A PUT of at most the limit to a writable same-host key is written here
//! the same way (`try_write`): its source is a published mapped range, its
//! owner a published process, and the write is the progress thread's own
//! (`progress::direct_writes`): the release slot checked under its lock,
//! the token read, one `process_vm_writev`. Anything short of a whole,
//! successful write goes to the thread, which writes again or refuses.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};

use rdmareg_core::{BackendGet, BackendPut, PeerId};
use rustc_hash::FxHashMap as HashMap;

use crate::owner_process::OwnerProcess;
use crate::packed_key::{PackedKeyFormat, validate_packed_key};
use crate::progress::process_writes::copy_into_process;
use crate::progress::vectored::{CopyEntry, copy_from_process};
use crate::read_protocol::ReadKey;

/// Copies on one thread between two yields: each yield costs one more
/// poll, so it is rare, yet a loop of copied reads lets its executor run.
pub(crate) const COPIES_BETWEEN_YIELDS: u32 = 64;

thread_local! {
    static COPIES_SINCE_YIELD: Cell<u32> = const { Cell::new(0) };
}

/// Counts a copy made on this thread; `true` when the read that made it
/// is to yield once before it completes.
pub(crate) fn yield_due() -> bool {
    COPIES_SINCE_YIELD.with(|copies| {
        let count = copies.get() + 1;
        let due = count >= COPIES_BETWEEN_YIELDS;
        copies.set(if due { 0 } else { count });
        due
    })
}

/// What the progress thread has published for the caller's copies.
#[derive(Debug, Default)]
struct Published {
    /// Region id → the mapped pointer and length.
    destinations: HashMap<u64, (usize, usize)>,
    /// Peer → the owner process its same-host reads are copied from.
    sources: HashMap<PeerId, Arc<OwnerProcess>>,
}

impl Published {
    /// The start of `[offset, offset + len)` of the published region
    /// `region_id`, if the range lies inside its mapping.
    fn local_range(&self, region_id: u64, offset: u64, len: u64) -> Option<*mut u8> {
        let &(ptr, mapped_len) = self.destinations.get(&region_id)?;
        let in_bounds = offset
            .checked_add(len)
            .is_some_and(|end| end <= mapped_len as u64);
        in_bounds.then(|| (ptr + offset as usize) as *mut u8)
    }
}

/// The tables and counters the caller's copies read; one per engine,
/// shared by its thread and every backend.
#[derive(Debug)]
pub(crate) struct CallerCopies {
    /// Largest read copied on the caller's thread; 0 turns the lane off.
    limit: usize,
    published: RwLock<Published>,
    /// The direct lane's key layout; unset while the engine has no lane.
    key_format: OnceLock<PackedKeyFormat>,
    peer_changes_submitted: AtomicU64,
    peer_changes_applied: AtomicU64,
    /// Reads copied on callers' threads so far.
    copied: AtomicU64,
    /// Writes made on callers' threads so far.
    written: AtomicU64,
}

impl CallerCopies {
    pub(crate) fn new(limit: usize) -> CallerCopies {
        CallerCopies {
            limit,
            published: RwLock::default(),
            key_format: OnceLock::new(),
            peer_changes_submitted: AtomicU64::new(0),
            peer_changes_applied: AtomicU64::new(0),
            copied: AtomicU64::new(0),
            written: AtomicU64::new(0),
        }
    }

    /// Writes made on callers' threads so far.
    pub(crate) fn written(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }

    /// Reads copied on callers' threads so far.
    pub(crate) fn copied(&self) -> u64 {
        self.copied.load(Ordering::Relaxed)
    }

    fn read(&self) -> RwLockReadGuard<'_, Published> {
        // A panic while the lock was held cannot leave the tables half
        // updated (each update is one insert or remove), so a poisoned lock
        // is still sound to use.
        self.published.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Published> {
        self.published.write().unwrap_or_else(|e| e.into_inner())
    }

    /// The thread opened a direct lane with this key layout.
    pub(crate) fn set_key_format(&self, format: PackedKeyFormat) {
        let _ = self.key_format.set(format);
    }

    /// A region was mapped at `ptr` for `len` bytes.
    pub(crate) fn publish_destination(&self, region_id: u64, ptr: usize, len: usize) {
        if self.limit > 0 {
            self.write().destinations.insert(region_id, (ptr, len));
        }
    }

    /// No copy into `region_id` runs when this returns, and none starts.
    pub(crate) fn withdraw_destination(&self, region_id: u64) {
        if self.limit > 0 {
            self.write().destinations.remove(&region_id);
        }
    }

    /// `peer`'s same-host reads may be copied out of `owner`.
    pub(crate) fn publish_source(&self, peer: PeerId, owner: &Arc<OwnerProcess>) {
        if self.limit == 0 {
            return;
        }
        if self
            .read()
            .sources
            .get(&peer)
            .is_some_and(|published| Arc::ptr_eq(published, owner))
        {
            return;
        }
        self.write().sources.insert(peer, Arc::clone(owner));
    }

    /// `peer`'s reads go through the thread again.
    pub(crate) fn withdraw_source(&self, peer: PeerId) {
        if self.limit > 0 {
            self.write().sources.remove(&peer);
        }
    }

    /// Every peer's reads go through the thread again (a refused copy, a
    /// failed direct endpoint: rare, and the thread republishes what still
    /// holds on the next read).
    pub(crate) fn withdraw_all_sources(&self) {
        if self.limit > 0 {
            self.write().sources.clear();
        }
    }

    /// Teardown: nothing is copied any more.
    pub(crate) fn withdraw_everything(&self) {
        let mut published = self.write();
        published.destinations.clear();
        published.sources.clear();
    }

    /// A peer change is about to enter the ring.
    pub(crate) fn peer_change_submitted(&self) {
        self.peer_changes_submitted.fetch_add(1, Ordering::SeqCst);
    }

    /// The thread made a peer change.
    pub(crate) fn peer_change_applied(&self) {
        self.peer_changes_applied.fetch_add(1, Ordering::SeqCst);
    }

    /// Writes `request` on this thread if everything it needs is published
    /// (module docs, "Writes"); `true` if every byte was written, `false`
    /// if the write is the thread's.
    ///
    /// # Safety
    /// As [`RdmaBackend::put`](rdmareg_backend::RdmaBackend::put): the
    /// source range is memory of the region it names, which nothing writes
    /// until the write completes.
    pub(crate) unsafe fn try_write(&self, request: &BackendPut) -> bool {
        let Some(format) = self.key_format.get() else {
            return false;
        };
        if request.len == 0 || request.len > self.limit as u64 {
            return false;
        }
        let applied = self.peer_changes_applied.load(Ordering::SeqCst);
        if self.peer_changes_submitted.load(Ordering::SeqCst) != applied {
            return false;
        }
        let Ok(ReadKey::SameHost(key)) = ReadKey::decode(&request.packed_key) else {
            return false;
        };
        if !key.access.allows_write()
            || !key.covers(request.remote_addr, request.len)
            || validate_packed_key(format, &key.ucx_key).is_err()
        {
            return false;
        }
        let published = self.read();
        let Some(owner) = published.sources.get(&request.peer) else {
            return false;
        };
        let Some(source) =
            published.local_range(request.local_region_id, request.local_offset, request.len)
        else {
            return false;
        };
        let Some(table) = owner.release() else {
            return false;
        };
        let Some(lock) = table.lock_for_write(key.release_slot, key.release_tag()) else {
            return false;
        };
        // SAFETY: the source lies inside a region this engine mapped and
        // has not withdrawn, and withdrawing takes the write lock, so it
        // stays mapped while `published` is held; the caller's contract
        // keeps it unwritten until the write completes. The target is
        // inside the key's range of a registration whose slot is live and
        // locked, so the owner's unmap waits for `lock`.
        let written = unsafe {
            copy_into_process(
                owner,
                request.remote_addr,
                source.cast_const(),
                request.len as usize,
            )
        };
        drop(lock);
        drop(published);
        if written.is_ok() {
            self.written.fetch_add(1, Ordering::Relaxed);
        }
        written.is_ok()
    }

    /// Copies `request` on this thread if everything it needs is published;
    /// `true` if the bytes were written, `false` if the read is the thread's.
    ///
    /// # Safety
    /// As [`RdmaBackend::get`](rdmareg_backend::RdmaBackend::get): the
    /// destination range is memory of the region it names, which nothing
    /// else reads or writes until the read completes.
    pub(crate) unsafe fn try_copy(&self, request: &BackendGet) -> bool {
        // SAFETY: this function's contract, for a batch of one.
        unsafe { self.try_copy_batch(std::slice::from_ref(request)) }
    }

    /// Copies every read of a batch on this thread if everything each
    /// needs is published and they add up to at most the limit; `true` if
    /// every read's bytes were written, `false` if the batch is the thread's (a
    /// batch is never split: its reads complete together either way).
    ///
    /// # Safety
    /// As [`RdmaBackend::get_batch`](rdmareg_backend::RdmaBackend::get_batch):
    /// each destination range is memory of the region it names, which
    /// nothing else reads or writes until its read completes.
    pub(crate) unsafe fn try_copy_batch(&self, requests: &[BackendGet]) -> bool {
        let Some(format) = self.key_format.get() else {
            return false;
        };
        let mut total: u64 = 0;
        for request in requests {
            total = total.saturating_add(request.len);
            if request.len == 0 || total > self.limit as u64 {
                return false;
            }
        }
        if requests.is_empty() {
            return false;
        }
        // Applied is read first: it never passes submitted, so equal values
        // mean every change submitted before this read is made.
        let applied = self.peer_changes_applied.load(Ordering::SeqCst);
        if self.peer_changes_submitted.load(Ordering::SeqCst) != applied {
            return false;
        }
        // Every key checked before the lock is taken; a list names few
        // descriptors, so a key equal to the one before is not decoded again.
        let mut checked: Option<(&[u8], ReadKey)> = None;
        // Each read's release slot and the region id it holds while live.
        let mut releases = Vec::with_capacity(requests.len());
        for request in requests {
            let key = match &checked {
                Some((bytes, key)) if *bytes == &request.packed_key[..] => key,
                _ => {
                    let Ok(key) = ReadKey::decode(&request.packed_key) else {
                        return false;
                    };
                    let ReadKey::SameHost(same_host) = &key else {
                        return false;
                    };
                    // A key that grants no read is for the owner to refuse.
                    if !same_host.access.allows_read()
                        || validate_packed_key(format, &same_host.ucx_key).is_err()
                    {
                        return false;
                    }
                    &checked.insert((&request.packed_key[..], key)).1
                }
            };
            let ReadKey::SameHost(key) = key else {
                return false;
            };
            if !key.covers(request.remote_addr, request.len) {
                return false;
            }
            releases.push((key.release_slot, key.release_tag()));
        }
        let published = self.read();
        let mut owner: Option<&Arc<OwnerProcess>> = None;
        let mut entries = Vec::with_capacity(requests.len());
        for request in requests {
            let Some(source) = published.sources.get(&request.peer) else {
                return false;
            };
            // One owner process per batch copied here; a batch across
            // owners is the thread's.
            if !Arc::ptr_eq(owner.get_or_insert(source), source) {
                return false;
            }
            let Some(dest) =
                published.local_range(request.local_region_id, request.local_offset, request.len)
            else {
                return false;
            };
            entries.push(CopyEntry {
                remote_addr: request.remote_addr,
                dest,
                // At most the limit, a `usize`: checked above.
                len: request.len as usize,
            });
        }
        let Some(owner) = owner else {
            return false;
        };
        // The check before the copy (`release_table`): a released
        // registration is the thread's to refuse.
        let Some(table) = owner.release() else {
            return false;
        };
        if !releases
            .iter()
            .all(|&(slot, region)| table.is_live(slot, region))
        {
            return false;
        }
        // SAFETY: every destination lies inside a region this engine mapped
        // and has not withdrawn, and withdrawing takes the write lock, so
        // each stays mapped while `published` is held; the caller's contract
        // gives each read its range alone until it completes, which is
        // after this returns.
        let mut outcomes = unsafe { copy_from_process(owner, &entries) };
        // The check that decides, after the copy returned: a read of a
        // registration released meanwhile keeps none of its bytes.
        for ((outcome, entry), &(slot, region)) in outcomes.iter_mut().zip(&entries).zip(&releases)
        {
            if !table.still_live_after_copy(slot, region) {
                // SAFETY: as above; the copy has returned.
                unsafe { std::ptr::write_bytes(entry.dest, 0, entry.len) };
                *outcome = Err(crate::progress::vectored::CopyError(libc::ESTALE));
            }
        }
        drop(published);
        let copied = outcomes.iter().all(|outcome| outcome.is_ok());
        if copied {
            self.copied
                .fetch_add(requests.len() as u64, Ordering::Relaxed);
        }
        copied
    }
}
