//! Memory regions this engine registered: map, unmap, and what holds an
//! unmap back.
//!
//! Every registration is also registered with the owner machine
//! (`Engine::owner`), which keeps the read leases of replies sent from it.
//! An unmap marks the region unmapping at once (new requests for it and
//! this engine's own reads into it are refused) and deregisters it once the
//! owner machine finished its unmap (`Action::Unmapped`) and no read of
//! this engine is in flight into it (`in_flight`); the later of the two
//! deregisters and completes the unmap.

use rdmareg_core::{Access, BackendRegion, RdmaError};
use rdmareg_engine::command::{NewRegion, Registrations};
use rdmareg_engine::served::UnmapStatus;

use crate::engine::Reply;
use crate::fabric::ADDR_NOTAVAIL;
use crate::key::PackedKey;

use super::*;

impl Registrations for Engine {
    fn map_region(&mut self, new: NewRegion, reply: Reply<BackendRegion>) {
        let (id, ptr, len, capability) = (new.id, new.ptr, new.len, new.capability);
        if new.access == Access::Write && !self.owner_served() {
            // A one-sided key is read with `fi_read`, which no owner judges:
            // a write-only registration could not refuse its reads.
            let _ = reply.send(Err(RdmaError::Unsupported {
                operation: "write-only registrations on the one-sided read path",
            }));
            return;
        }
        let mut requested_key = id;
        if self.owner_served() {
            // No peer is told this key; a random one is not guessable from
            // the region ids peers see.
            requested_key = u64::from_le_bytes(capability[..8].try_into().unwrap_or([1; 8]))
                ^ u64::from_le_bytes(capability[8..].try_into().unwrap_or([2; 8]));
        }
        // SAFETY: the caller of `map` guarantees the range stays allocated
        // until an unmap of `id` returns Ok; the engine deregisters before it
        // returns Ok to any unmap of `id`.
        let mr = match unsafe { self.fabric.register(ptr, len, requested_key) } {
            Ok(mr) => mr,
            Err(err) => {
                let _ = reply.send(Err(err));
                return;
            }
        };
        let registered = self
            .owner
            .register_with_access(id, capability, ptr as u64, len as u64, new.access);
        if let Err(err) = registered {
            if let Err(undone) = self.fabric.deregister(&mr) {
                tracing::warn!(id, error = %undone, "a registration the owner refused stays");
            }
            let _ = reply.send(Err(err));
            return;
        }
        self.signals.lifecycle.registered();
        let served = self.owner_served();
        let key = PackedKey {
            owner_served: served,
            virt_addr: !served && self.fabric.virt_addr(),
            region_id: id,
            capability,
            mr_key: if served { 0 } else { mr.key },
            base: ptr as u64,
            len: len as u64,
            owner: self.fabric.address.clone(),
        };
        let page = self.page_size;
        let start = (ptr as u64) & !(page - 1);
        let end = (ptr as u64 + len as u64).div_ceil(page) * page;
        self.regions.insert(
            id,
            Region {
                ptr,
                len,
                mr,
                in_flight: 0,
                served: true,
                unmapping: false,
                waiters: Vec::new(),
            },
        );
        let region = BackendRegion {
            backend_region_id: id,
            effective_addr: start,
            effective_len: end - start,
            packed_key: key.encode(),
        };
        if reply.send(Ok(region)).is_err() {
            tracing::debug!(id, "map's caller left: rolling it back");
            self.unmap_region(id, None);
        }
    }

    fn unmap_region(&mut self, id: u64, reply: Option<Reply<()>>) {
        let Some(region) = self.regions.get_mut(&id) else {
            if let Some(reply) = reply {
                let _ = reply.send(Ok(()));
            }
            return;
        };
        region.unmapping = true;
        region.waiters.extend(reply);
        if self.owner.unmap(id) == UnmapStatus::NotRegistered {
            // Its deregistration failed before: try again.
            region.served = false;
        }
        self.run_owner_actions(ADDR_NOTAVAIL);
        self.deregister_if_idle(id);
    }
}

impl Engine {
    /// Deregisters `id` once it is being unmapped (or torn down), the owner
    /// machine let go of it and no read is in flight into it.
    pub(super) fn deregister_if_idle(&mut self, id: u64) {
        let closing = self.closing;
        let idle = self.regions.get(&id).is_some_and(|region| {
            (region.unmapping || closing) && !region.served && region.in_flight == 0
        });
        if idle {
            self.deregister(id);
        }
    }

    /// A read of this engine into `id` ended.
    pub(super) fn release_hold(&mut self, id: u64) {
        if let Some(region) = self.regions.get_mut(&id) {
            region.in_flight -= 1;
        }
        self.deregister_if_idle(id);
    }

    /// Deregisters a region with no reads in flight and replies to its
    /// waiters. On failure the region stays (still registered, still
    /// counted) and the waiters hear the error.
    pub(super) fn deregister(&mut self, id: u64) {
        let Some(region) = self.regions.get_mut(&id) else {
            return;
        };
        let waiters = std::mem::take(&mut region.waiters);
        match self.fabric.deregister(&region.mr) {
            Ok(()) => {
                self.regions.remove(&id);
                self.signals.lifecycle.deregistered();
                for waiter in waiters {
                    let _ = waiter.send(Ok(()));
                }
            }
            Err(err) => {
                tracing::warn!(id, error = %err, "deregistration failed; the region stays registered");
                for waiter in waiters {
                    let _ = waiter.send(Err(err.clone()));
                }
            }
        }
    }
}
