//! Registered regions on the progress thread: map, unmap, and the hold an
//! in-flight GET keeps on its destination.
//!
//! - A map whose caller left while it ran is rolled back at once: nobody
//!   would ever unmap it. Unmap is idempotent: an unknown id returns
//!   `Ok(())`.
//! - Every registration gets a fresh random capability, and its key
//!   (`read_protocol::ServedKey`) names the never-reused region id and that
//!   capability, so a peer reads only what it was given a descriptor for.
//! - An unmap of a region reads still use is *parked*: the region refuses
//!   new reads into it (`RegionNotFound`) and the owner refuses new reads
//!   of it; `ucp_mem_unmap` runs once the last destination hold ended and
//!   the owner's last reply from it ended (`Action::Unmapped`). Unmaps
//!   submitted meanwhile join the same wait.
//! - A direct-lane registration holds a release-table slot while live; the
//!   slot is emptied when the unmap is submitted, before the unmap returns
//!   (`docs/safety.md`, "The same-host direct lane"). Without a slot the
//!   registration gets a served-only key.
//! - A writable direct-lane registration's unmap also waits until no
//!   same-host writer holds its slot's lock (`release_table`, "Writers"):
//!   a write that checked the slot before it was emptied ends before the
//!   unmap runs. The loop retries such unmaps each turn
//!   ([`Engine::retry_gated_unmaps`]).
//! - The effective range is page-enclosing, as pinned and charged.
//! - The live count moves only on success; a failed unmap leaves the region
//!   counted and refusing GETs, and a later unmap retries it.

use rustc_hash::FxHashMap as HashMap;

use bytes::Bytes;
use rdmareg_core::{Access, BackendRegion, RdmaError, page_enclosing_range};
use rdmareg_engine::command::{NewRegion, Registrations};
use rdmareg_engine::served::UnmapStatus;

use super::Engine;
use super::ucp::MemHandle;
use crate::command::Reply;
use crate::read_protocol::{SameHostKey, ServedKey};

/// One registration the thread holds.
#[derive(Debug)]
pub(crate) struct Region {
    pub(crate) memh: MemHandle,
    /// The direct-read lane's registration of the same range, if the lane
    /// is open.
    pub(crate) direct_memh: Option<MemHandle>,
    /// The registration's slot in the release table while it is live (the
    /// unmap empties it).
    pub(crate) release_slot: Option<u32>,
    /// Whether same-host peers may write the registration one-sided: its
    /// key is a writable same-host key (`direct_writes`).
    pub(crate) direct_writable: bool,
    /// The emptied slot of a writable registration whose same-host writers
    /// have not all let go of it: the unmap waits for them.
    pub(crate) draining_slot: Option<u32>,
    /// The pointer that was mapped: the base of every destination offset.
    pub(crate) ptr: usize,
    /// The length that was mapped: the bound of every destination range.
    pub(crate) len: usize,
    /// GET requests posted into this region that UCX has not released.
    pub(crate) in_flight: u32,
    /// `Some` once an unmap was submitted: the callers waiting for it.
    pub(crate) unmap_waiters: Option<Vec<Reply<()>>>,
}

impl Region {
    /// Whether new GETs into the region are refused.
    pub(crate) fn is_unmapping(&self) -> bool {
        self.unmap_waiters.is_some()
    }
}

/// Region id → registration.
pub(crate) type RegionTable = HashMap<u64, Region>;

impl Registrations for Engine {
    /// `Command::Map`.
    fn map_region(&mut self, region: NewRegion, reply: Reply<BackendRegion>) {
        let NewRegion {
            id,
            ptr,
            len,
            access,
            capability,
        } = region;
        if self.regions.contains_key(&id) {
            let _ = reply.send(Err(RdmaError::backend(format!(
                "ucx: region id {id} is already registered"
            ))));
            return;
        }
        let memh = match self.context.map(ptr, len) {
            Ok(memh) => memh,
            Err(err) => {
                let _ = reply.send(Err(err));
                return;
            }
        };
        let served = ServedKey {
            region_id: id,
            capability,
        };
        // Same-host keys only with a release slot: a direct read or write
        // of a registration no slot vouches for could not tell it was
        // released. The key says what a consumer may copy one-sided: what
        // the registration grants, less writes when this engine takes no
        // direct writes (a registration peers may only write then gets no
        // same-host key at all).
        let key_access = if access.allows_write() && !self.settings.direct_writes {
            access.allows_read().then_some(Access::Read)
        } else {
            Some(access)
        };
        let release_slot = match (&self.direct, &mut self.release, key_access) {
            (Some(_), Some(table), Some(key_access)) => table.publish(SameHostKey::tag_for(
                &served, ptr as u64, len as u64, key_access,
            )),
            _ => None,
        };
        let key_access = key_access.unwrap_or(Access::Read);
        let mapped_direct = match release_slot {
            Some(slot) => self
                .map_direct(ptr, len)
                .map(|mapped| mapped.map(|(direct_memh, ucx_key)| (direct_memh, ucx_key, slot))),
            None => Ok(None),
        };
        let (direct_memh, packed_key) = match mapped_direct {
            Ok(None) => {
                self.retire_release_slot(release_slot);
                (None, Bytes::copy_from_slice(&served.encode()))
            }
            Ok(Some((direct_memh, ucx_key, release_slot))) => {
                let key = SameHostKey {
                    served,
                    region_addr: ptr as u64,
                    region_len: len as u64,
                    release_slot,
                    access: key_access,
                    ucx_key,
                }
                .encode();
                match key {
                    Some(key) => (Some(direct_memh), Bytes::from(key)),
                    None => {
                        // SAFETY: mapped just above, in no table, unmapped
                        // once here.
                        let _ = unsafe { self.unmap_direct(direct_memh) };
                        self.retire_release_slot(Some(release_slot));
                        self.undo_map(id, memh, ptr, len);
                        let _ = reply.send(Err(RdmaError::backend(
                            "ucx: the direct-read lane packed an unusable key",
                        )));
                        return;
                    }
                }
            }
            Err(err) => {
                self.retire_release_slot(release_slot);
                self.undo_map(id, memh, ptr, len);
                let _ = reply.send(Err(err));
                return;
            }
        };
        let release_slot = release_slot.filter(|_| direct_memh.is_some());
        if reply.is_canceled() {
            // The caller left while UCX registered: undo before the range is
            // ever counted.
            if let Some(direct_memh) = direct_memh {
                // SAFETY: mapped above on the lane's context, in no table,
                // unmapped once here.
                if let Err(err) = unsafe { self.unmap_direct(direct_memh) } {
                    tracing::error!(error = %err, region = id, "could not undo the direct-lane half of an abandoned map");
                }
            }
            self.retire_release_slot(release_slot);
            self.undo_map(id, memh, ptr, len);
            return;
        }
        let served = self
            .events
            .owner
            .borrow_mut()
            .register_with_access(id, capability, ptr as u64, len as u64, access);
        if let Err(err) = served {
            if let Some(direct_memh) = direct_memh {
                // SAFETY: mapped above on the lane's context, in no table,
                // unmapped once here.
                let _ = unsafe { self.unmap_direct(direct_memh) };
            }
            self.retire_release_slot(release_slot);
            self.undo_map(id, memh, ptr, len);
            let _ = reply.send(Err(err));
            return;
        }
        self.events.served_memh.borrow_mut().insert(id, memh);
        let (effective_addr, effective_len) = self.effective_range(memh, ptr, len);
        self.regions.insert(
            id,
            Region {
                memh,
                direct_memh,
                release_slot,
                direct_writable: release_slot.is_some() && key_access.allows_write(),
                draining_slot: None,
                ptr,
                len,
                in_flight: 0,
                unmap_waiters: None,
            },
        );
        self.signals.lifecycle.registered();
        self.signals.caller_copies.publish_destination(id, ptr, len);
        let region = BackendRegion {
            backend_region_id: id,
            effective_addr,
            effective_len,
            packed_key,
        };
        if reply.send(Ok(region)).is_err() {
            tracing::debug!(
                region = id,
                "map caller left; rolling the registration back"
            );
            // Nobody had its key: the owner holds no lease and lets it go
            // at once.
            self.stop_serving(id);
            if let Err(err) = self.unmap_now(id) {
                tracing::error!(error = %err, region = id, "rollback of an abandoned map failed; the region stays registered until teardown");
            }
        }
    }

    /// `Command::Unmap`.
    fn unmap_region(&mut self, id: u64, reply: Option<Reply<()>>) {
        // The backend withdrew it when the unmap was submitted; a
        // compensating unmap was not submitted there.
        self.signals.caller_copies.withdraw_destination(id);
        // First, before the unmap can return (module docs).
        if let Some(region) = self.regions.get_mut(&id)
            && let Some(slot) = region.release_slot.take()
        {
            if region.direct_writable {
                region.draining_slot = Some(slot);
                if let Some(table) = self.release.as_mut() {
                    table.retire_writable(slot);
                }
            } else {
                self.retire_release_slot(Some(slot));
            }
        }
        let Some(region) = self.regions.get_mut(&id) else {
            if let Some(reply) = reply {
                let _ = reply.send(Ok(()));
            }
            return;
        };
        region
            .unmap_waiters
            .get_or_insert_with(Vec::new)
            .extend(reply);
        if !self.stop_serving(id) {
            // The owner does not serve it (any more): only holds can wait.
            self.run_parked_unmap_if_idle(id);
        }
    }
}

impl Engine {
    /// Empties a release slot: no same-host read of what it named counts
    /// from now on.
    fn retire_release_slot(&mut self, slot: Option<u32>) {
        if let (Some(slot), Some(table)) = (slot, self.release.as_mut()) {
            table.retire(slot);
        }
    }

    /// Undoes a serving-context map that is in no table yet; a failed undo
    /// keeps the registration counted until teardown.
    fn undo_map(&mut self, id: u64, memh: MemHandle, ptr: usize, len: usize) {
        // SAFETY: `memh` was just mapped on this context and is in no table;
        // it is unmapped once, here.
        if let Err(err) = unsafe { self.context.unmap(memh) } {
            tracing::error!(error = %err, region = id, "could not undo a registration; it stays registered until teardown");
            self.keep_stuck_registration(id, memh, ptr, len);
        }
    }

    /// A registration whose undo (`ucp_mem_unmap`) failed: keep it counted
    /// and in the table, already unmapping so it refuses GETs, so teardown
    /// retries it and the live count stays honest.
    fn keep_stuck_registration(&mut self, id: u64, memh: MemHandle, ptr: usize, len: usize) {
        self.regions.insert(
            id,
            Region {
                memh,
                direct_memh: None,
                release_slot: None,
                direct_writable: false,
                draining_slot: None,
                ptr,
                len,
                in_flight: 0,
                unmap_waiters: Some(Vec::new()),
            },
        );
        self.signals.lifecycle.registered();
    }

    /// The pages enclosing what UCX reports it registered (if that covers
    /// the request) or else the request itself.
    fn effective_range(&self, memh: MemHandle, ptr: usize, len: usize) -> (u64, u64) {
        let (mut start, mut len) = (ptr as u64, len as u64);
        if let Some((addr, mapped)) = self.context.mapped_range(memh) {
            if addr <= start
                && addr
                    .checked_add(mapped)
                    .is_some_and(|end| end >= start + len)
            {
                (start, len) = (addr, mapped);
            }
        }
        page_enclosing_range(start, len, self.page_size)
            .map(|r| (r.start, r.len))
            .unwrap_or((start, len))
    }

    /// Tells the owner `id` is being unmapped: it serves no new read of it,
    /// and finishes (`Action::Unmapped`, which runs the parked unmap) once
    /// the last reply sending from it ended. Returns whether the owner
    /// served the region.
    fn stop_serving(&mut self, id: u64) -> bool {
        let status = self.events.owner.borrow_mut().unmap(id);
        // SAFETY: outside any handler no reply is queued: only
        // `Action::Unmapped` can follow.
        unsafe { super::serve::perform_actions(&self.events) };
        self.drain_events();
        status == UnmapStatus::Waiting
    }

    /// A read into `id` finished: drop its hold, and run a parked unmap if
    /// nothing uses the region any more.
    pub(super) fn release_region_hold(&mut self, id: u64) {
        let Some(region) = self.regions.get_mut(&id) else {
            tracing::error!(
                region = id,
                "a read completed into a region the table no longer holds"
            );
            return;
        };
        region.in_flight = region.in_flight.saturating_sub(1);
        self.run_parked_unmap_if_idle(id);
    }

    /// Runs `id`'s parked unmap if nothing uses the region any more: no
    /// read is written into it and the owner no longer serves it; otherwise
    /// it waits for the later of the two.
    pub(super) fn run_parked_unmap_if_idle(&mut self, id: u64) {
        let Some(region) = self.regions.get_mut(&id) else {
            return;
        };
        if region.in_flight > 0 || !region.is_unmapping() {
            return;
        }
        if self.events.owner.borrow().region_leases(id).is_some() {
            return;
        }
        if let Some(slot) = region.draining_slot {
            let gone = self
                .release
                .as_mut()
                .is_none_or(|table| table.writers_gone(slot));
            if !gone {
                if !self.gated_unmaps.contains(&id) {
                    self.gated_unmaps.push(id);
                }
                return;
            }
        }
        let Some(region) = self.regions.get_mut(&id) else {
            return;
        };
        region.draining_slot = None;
        let waiters = region.unmap_waiters.take().unwrap_or_default();
        let result = self.unmap_now(id);
        if result.is_err() {
            // Keep refusing reads of a region whose unmap failed.
            if let Some(region) = self.regions.get_mut(&id) {
                region.unmap_waiters.get_or_insert_with(Vec::new);
            }
        }
        for waiter in waiters {
            let _ = waiter.send(result.clone());
        }
    }

    /// Runs the parked unmaps that waited for same-host writers, those
    /// whose writers let go since.
    pub(super) fn retry_gated_unmaps(&mut self) {
        for id in std::mem::take(&mut self.gated_unmaps) {
            self.run_parked_unmap_if_idle(id);
        }
    }

    /// `ucp_mem_unmap` for `id`; removes it and decrements the live count on
    /// success only.
    pub(super) fn unmap_now(&mut self, id: u64) -> Result<(), RdmaError> {
        let Some(region) = self.regions.get(&id) else {
            return Ok(());
        };
        if self.events.owner.borrow().region_leases(id).is_some() {
            // A reply may still read it: never unmap under the owner.
            return Err(RdmaError::backend(format!(
                "ucx: region {id} is still served; its unmap waits"
            )));
        }
        if region.draining_slot.is_some() {
            // A same-host writer may still write it.
            return Err(RdmaError::backend(format!(
                "ucx: region {id} may still be written by a same-host writer; its unmap waits"
            )));
        }
        let (memh, direct_memh, release_slot) =
            (region.memh, region.direct_memh, region.release_slot);
        self.signals.caller_copies.withdraw_destination(id);
        if let Some(region) = self.regions.get_mut(&id) {
            region.release_slot = None;
        }
        self.retire_release_slot(release_slot);
        if let Some(direct_memh) = direct_memh {
            // SAFETY: from `map_direct`, still in the table, so not unmapped
            // yet; on success it leaves the region below.
            unsafe { self.unmap_direct(direct_memh) }?;
            if let Some(region) = self.regions.get_mut(&id) {
                region.direct_memh = None;
            }
        }
        // SAFETY: the handle came from `Context::map` on this context and is
        // still in the table, so it has not been unmapped; on success it is
        // removed below and never used again.
        unsafe { self.context.unmap(memh) }?;
        self.regions.remove(&id);
        self.events.served_memh.borrow_mut().remove(&id);
        self.signals.lifecycle.deregistered();
        Ok(())
    }
}
