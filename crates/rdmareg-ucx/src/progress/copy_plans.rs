//! Copy plans: same-host lists posted again, copied by a plan worked out once.
//!
//! A transfer list posted many times comes as the same shared requests
//! (`Command::GetSharedBatch`). When every entry is a same-host read this
//! thread copies from one owner process (`vectored`), the thread keeps a
//! **copy plan**: each entry's destination and source range, in the owner's
//! address order. A later post runs the plan's one vectored copy and
//! completes every entry `Ok`, skipping the per-entry work, which for a
//! thousand blocks outweighs the copy.
//!
//! # Rules
//!
//! - **What can change is checked again at every post.** A registration's
//!   pointer and length never change under its id, nor does what a key
//!   decodes to. Before the copy: each destination is still mapped and not
//!   being unmapped, and the peer's reads still come from the plan's
//!   process. Before and after: each source's release slot still holds its
//!   region id (`release_table`); if not, every destination is zeroed and
//!   the list takes the ordinary path.
//! - **Anything else takes the ordinary path** (`post_batch`, a fresh
//!   batch): a list with an entry that is not such a copy gets no plan, and
//!   a post whose checks or copy fail runs as if no plan existed. So a plan
//!   never completes a list differently, only sooner.
//! - **Plans are few and forget dead lists.** A plan is found by the address
//!   of its list's shared requests and holds a `Weak` to them, so the
//!   address cannot be reused meanwhile; at most [`MAX_PLANS`], oldest
//!   dropped first, and plans of lists nobody holds are dropped on insert.

use std::collections::VecDeque;
use std::sync::{Arc, Weak};

use rdmareg_core::{BackendGet, PeerId, RdmaError};

use super::Engine;
use super::results::BatchReply;
use super::ucp::MemHandle;
use super::vectored::{self, CopyEntry};
use crate::owner_process::{OwnerProcess, SameHostSource};
use crate::read_protocol::ReadKey;

/// Copy plans kept at once: a consumer reposts a handful of lists (one per
/// layer or per block table), not hundreds.
pub(super) const MAX_PLANS: usize = 8;

/// One list's copy, worked out.
#[derive(Debug)]
pub(super) struct CopyPlan {
    /// The list it was made for.
    list: Weak<[BackendGet]>,
    /// The peer every entry reads from, and the process its reads were
    /// copied from when the plan was made.
    peer: PeerId,
    owner: Arc<OwnerProcess>,
    /// The destination registrations the entries write into, each once.
    destinations: Vec<u64>,
    /// Every entry's copy, in the owner's address order.
    entries: Vec<CopyEntry>,
    /// The release slots of the registrations the entries read, each
    /// once, with the region id each holds while live.
    releases: Vec<(u32, u64)>,
}

/// The plans this thread keeps, newest last.
#[derive(Debug, Default)]
pub(super) struct CopyPlans(VecDeque<CopyPlan>);

impl CopyPlans {
    fn position(&self, list: &Arc<[BackendGet]>) -> Option<usize> {
        self.0
            .iter()
            .position(|plan| std::ptr::eq(plan.list.as_ptr(), Arc::as_ptr(list)))
    }

    fn keep(&mut self, plan: CopyPlan) {
        self.0.retain(|kept| kept.list.strong_count() > 0);
        if self.0.len() >= MAX_PLANS {
            self.0.pop_front();
        }
        self.0.push_back(plan);
    }
}

impl Engine {
    /// `Command::GetSharedBatch`: by the list's copy plan when it has (or
    /// can make) one and the plan's checks hold, else as a fresh batch.
    pub(super) fn post_shared_batch(&mut self, requests: Arc<[BackendGet]>, reply: BatchReply) {
        if reply.is_canceled() {
            return; // Nobody waits and nothing was transferred: skip it.
        }
        let copied = self.copy_by_plan(&requests);
        self.copy_source_memo = None;
        if copied {
            self.signals
                .lists_copied_by_plan
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let _ = reply.send(vec![Ok(()); requests.len()]);
        } else {
            self.post_batch(requests.to_vec(), reply);
        }
    }

    /// Copies every entry of `requests` by its plan; true if each was
    /// written. False, with nothing completed, if there is no plan to follow
    /// or its checks or its copy failed (the plan is then dropped).
    fn copy_by_plan(&mut self, requests: &Arc<[BackendGet]>) -> bool {
        let index = match self.copy_plans.position(requests) {
            Some(index) => index,
            None => match self.make_copy_plan(requests) {
                Some(plan) => {
                    self.copy_plans.keep(plan);
                    self.copy_plans.0.len() - 1
                }
                None => return false,
            },
        };
        let plan = &self.copy_plans.0[index];
        let (peer, owner) = (plan.peer, Arc::clone(&plan.owner));
        let destinations_held = plan.destinations.iter().all(|id| {
            self.regions
                .get(id)
                .is_some_and(|region| !region.is_unmapping())
        });
        let same_source = destinations_held
            && matches!(self.copy_source(peer),
                SameHostSource::Copy(now) if Arc::ptr_eq(&now, &owner));
        let written = same_source && {
            let plan = &self.copy_plans.0[index];
            let live = |after_copy: bool| {
                owner.release().is_some_and(|table| {
                    plan.releases.iter().all(|&(slot, region)| {
                        if after_copy {
                            table.still_live_after_copy(slot, region)
                        } else {
                            table.is_live(slot, region)
                        }
                    })
                })
            };
            live(false) && {
                // SAFETY: every destination lies inside a registration this
                // engine mapped (checked when the plan was made: a
                // registration's pointer and length never change under its
                // id) that is still mapped and not being unmapped (checked
                // just now), and unmaps run on this thread only, after this
                // returns; the caller holds the destinations until the
                // reply, sent after the copy.
                let outcomes = unsafe { vectored::copy_from_process(&owner, &plan.entries) };
                let copied = outcomes.iter().all(Result::is_ok);
                // The check that decides, after the copy returned.
                if copied && !live(true) {
                    for entry in &plan.entries {
                        // SAFETY: as above; the copy has returned.
                        unsafe { std::ptr::write_bytes(entry.dest, 0, entry.len) };
                    }
                    false
                } else {
                    copied
                }
            }
        };
        if !written {
            self.copy_plans.0.remove(index);
        }
        written
    }

    /// The copy plan of `requests`, if every entry is a same-host read
    /// this thread would copy from one peer's process (the checks of
    /// `prepare_get`, all passed).
    fn make_copy_plan(&mut self, requests: &Arc<[BackendGet]>) -> Option<CopyPlan> {
        let peer = requests.first()?.peer;
        let mut owner = None;
        let mut destinations = Vec::new();
        let mut entries = Vec::with_capacity(requests.len());
        let mut releases: Vec<(u32, u64)> = Vec::new();
        for request in requests.iter() {
            if request.peer != peer {
                return None;
            }
            let (dest, len, _) = self
                .checked_destination(
                    request.local_region_id,
                    request.local_offset,
                    request.len,
                    request.remote_addr,
                )
                .ok()?;
            let decoded = self.decoded_key(&request.packed_key)?;
            let ReadKey::SameHost(same_host) = &*decoded.key else {
                return None;
            };
            if !decoded.direct_well_formed
                || !same_host.access.allows_read()
                || !same_host.covers(request.remote_addr, len as u64)
            {
                return None;
            }
            if owner.is_none() {
                // Asked only for a same-host key, as `prepare_get` does.
                let SameHostSource::Copy(process) = self.copy_source(peer) else {
                    return None;
                };
                owner = Some(process);
            }
            let release = (same_host.release_slot, same_host.release_tag());
            if releases.last() != Some(&release) && !releases.contains(&release) {
                releases.push(release);
            }
            if destinations.last() != Some(&request.local_region_id)
                && !destinations.contains(&request.local_region_id)
            {
                destinations.push(request.local_region_id);
            }
            entries.push(CopyEntry {
                remote_addr: request.remote_addr,
                dest,
                len,
            });
        }
        entries.sort_by_key(|entry| entry.remote_addr);
        Some(CopyPlan {
            list: Arc::downgrade(requests),
            peer,
            owner: owner?,
            destinations,
            entries,
            releases,
        })
    }

    /// The destination of a read of `len` bytes at `local_offset` of
    /// registration `local_region_id`, from `remote_addr`: its pointer,
    /// length and the registration's memory handle, if the registration is
    /// mapped and not being unmapped, and the range lies inside the mapped
    /// pointer and length (and the source range does not wrap).
    pub(super) fn checked_destination(
        &self,
        local_region_id: u64,
        local_offset: u64,
        len: u64,
        remote_addr: u64,
    ) -> Result<(*mut u8, usize, MemHandle), RdmaError> {
        let region = self
            .regions
            .get(&local_region_id)
            .filter(|region| !region.is_unmapping())
            .ok_or(RdmaError::RegionNotFound)?;
        let in_bounds = len > 0
            && local_offset
                .checked_add(len)
                .is_some_and(|end| end <= region.len as u64)
            && remote_addr.checked_add(len).is_some();
        let len = usize::try_from(len)
            .ok()
            .filter(|_| in_bounds)
            .ok_or(RdmaError::OutOfRange)?;
        Ok((
            (region.ptr + local_offset as usize) as *mut u8,
            len,
            region.memh,
        ))
    }
}
