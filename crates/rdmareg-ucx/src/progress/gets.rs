//! GETs on the progress thread: checks, posting, completion, deadlines.
//!
//! # Completion-owned operations
//!
//! Each posted GET has an op record in a slot of [`OpTable`]; its address is
//! the `user_data` of the UCX request. Whichever of `ucp_get_nbx`'s three
//! exits the call takes, the caller is answered and the record released
//! exactly once:
//!
//! - `UCS_OK` (inline completion — the common case on cma): answered
//!   `Ok(())` right after the call; no callback will run.
//! - an error pointer: answered with the error right after the call.
//! - a request: the completion callback answers the caller directly (so its
//!   future wakes without waiting for the loop) and leaves `(slot, status)`
//!   in [`Events`]; the loop then frees the request, drops the region's hold,
//!   releases the remote key and recycles the slot.
//!
//! Slots are boxed once and reused, so steady-state GETs allocate nothing
//! here. A slot's memory is freed only after the worker is destroyed, so a
//! late callback can never touch freed memory.
//!
//! # Deadlines
//!
//! Every GET carries one (its own or the configured default). Past it the
//! caller is answered [`RdmaError::Timeout`] at once, and the endpoint is
//! force-closed so UCX releases the request (see `peers`); the destination
//! region stays held until the completion callback has run.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::ffi::c_void;
use std::time::Instant;

use rdmareg_core::{BackendGet, PeerId, RdmaError};
use ucx_sys::ucs_status_t;

use super::Engine;
use super::events::Events;
use crate::command::Reply;
use crate::packed_key::copy_for_unpack;
use crate::status::{PtrStatus, status_text};

/// One GET the loop posted. Reached by the completion callback through a raw
/// pointer; the loop touches it only between UCX calls.
#[derive(Debug)]
pub(crate) struct GetOp {
    reply: Option<Reply<()>>,
    events: *const Events,
    slot: u32,
    peer: PeerId,
    request: *mut c_void,
    region_id: u64,
    rkey_id: u64,
    endpoint_serial: u64,
    generation: u64,
    active: bool,
}

/// Reusable op slots plus the deadline queue.
#[derive(Debug)]
pub(crate) struct OpTable {
    slots: Vec<*mut GetOp>,
    free: Vec<u32>,
    active: usize,
    deadlines: BinaryHeap<Reverse<(Instant, u32, u64)>>,
    next_generation: u64,
}

impl OpTable {
    pub(crate) fn new() -> OpTable {
        OpTable {
            slots: Vec::new(),
            free: Vec::new(),
            active: 0,
            deadlines: BinaryHeap::new(),
            next_generation: 0,
        }
    }

    /// GETs posted and not yet released by UCX.
    pub(crate) fn active(&self) -> usize {
        self.active
    }

    fn alloc(&mut self, events: *const Events) -> (u32, *mut GetOp) {
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                let slot = u32::try_from(self.slots.len()).unwrap_or(u32::MAX);
                self.slots.push(Box::into_raw(Box::new(GetOp {
                    reply: None,
                    events,
                    slot,
                    peer: PeerId(0),
                    request: std::ptr::null_mut(),
                    region_id: 0,
                    rkey_id: 0,
                    endpoint_serial: 0,
                    generation: 0,
                    active: false,
                })));
                slot
            }
        };
        self.next_generation += 1;
        let op = self.slots[slot as usize];
        // SAFETY: slot pointers come from Box::into_raw and live until
        // `Drop`; a free slot has no UCX request, so nothing else refers to it.
        unsafe {
            (*op).generation = self.next_generation;
            (*op).active = true;
            (*op).request = std::ptr::null_mut();
        }
        self.active += 1;
        (slot, op)
    }

    /// Whether `slot` is active and still holds the GET of `generation`.
    fn is_current(&self, slot: u32, generation: u64) -> bool {
        self.op(slot)
            // SAFETY: a slot pointer from this table is valid until `Drop`.
            .is_some_and(|op| unsafe { (*op).generation == generation })
    }

    fn op(&self, slot: u32) -> Option<*mut GetOp> {
        let op = *self.slots.get(slot as usize)?;
        // SAFETY: a slot pointer from this table is valid until `Drop`.
        unsafe { (*op).active }.then_some(op)
    }

    fn release(&mut self, slot: u32) {
        if let Some(op) = self.op(slot) {
            // SAFETY: as in `op`; the request is gone, so only the loop
            // refers to the slot now.
            unsafe {
                (*op).active = false;
                (*op).reply = None;
                (*op).request = std::ptr::null_mut();
            }
            self.active -= 1;
            self.free.push(slot);
        }
    }

    /// Active slots whose deadline is not after `now`; stale queue entries
    /// are dropped on the way.
    fn expired(&mut self, now: Instant) -> Vec<u32> {
        let mut out = Vec::new();
        while let Some(Reverse((deadline, slot, generation))) = self.deadlines.peek().copied() {
            let live = self.is_current(slot, generation);
            if live && deadline > now {
                break;
            }
            self.deadlines.pop();
            if live {
                out.push(slot);
            }
        }
        out
    }

    /// The earliest deadline of an active GET.
    pub(crate) fn next_deadline(&mut self) -> Option<Instant> {
        while let Some(Reverse((deadline, slot, generation))) = self.deadlines.peek().copied() {
            if self.is_current(slot, generation) {
                return Some(deadline);
            }
            self.deadlines.pop();
        }
        None
    }

    /// Active GETs posted on the endpoint numbered `serial`.
    pub(crate) fn active_on_endpoint(&self, serial: u64) -> usize {
        (0..self.slots.len() as u32)
            .filter_map(|slot| self.op(slot))
            // SAFETY: as in `op`.
            .filter(|&op| unsafe { (*op).endpoint_serial == serial })
            .count()
    }

    /// Takes every pending answer (teardown).
    pub(crate) fn take_all_replies(&mut self) -> Vec<Reply<()>> {
        let slots: Vec<u32> = (0..self.slots.len() as u32).collect();
        slots
            .into_iter()
            .filter_map(|slot| self.op(slot))
            // SAFETY: as in `op`.
            .filter_map(|op| unsafe { (*op).reply.take() })
            .collect()
    }
}

impl Drop for OpTable {
    fn drop(&mut self) {
        // Runs after the worker is destroyed (field order in `Engine`), so no
        // UCX callback can reach a slot any more.
        for op in self.slots.drain(..) {
            // SAFETY: each pointer came from Box::into_raw and is freed once.
            drop(unsafe { Box::from_raw(op) });
        }
    }
}

/// The answer for a GET request that UCX completed with `status`.
fn get_outcome(status: ucs_status_t, peer: PeerId) -> Result<(), RdmaError> {
    if status == ucx_sys::UCS_OK {
        Ok(())
    } else {
        Err(RdmaError::Backend(format!(
            "ucx: GET from {peer} failed: {}",
            status_text(status)
        )))
    }
}

/// UCX's completion callback for a posted GET.
unsafe extern "C" fn on_get_complete(
    _request: *mut c_void,
    status: ucs_status_t,
    user_data: *mut c_void,
) {
    let op = user_data.cast::<GetOp>();
    // SAFETY: `user_data` is the op slot passed to ucp_get_nbx. Slots are
    // freed only after the worker is destroyed and recycled only after the
    // loop handled this very completion; the loop holds no reference to the
    // slot while UCX runs (it touches ops only between UCX calls).
    let (reply, peer, slot, events) =
        unsafe { ((*op).reply.take(), (*op).peer, (*op).slot, (*op).events) };
    if let Some(reply) = reply {
        let _ = reply.send(get_outcome(status, peer));
    }
    // SAFETY: the events record outlives the worker (see `Engine`).
    let events = unsafe { &*events };
    events.completed_gets.borrow_mut().push((slot, status));
}

impl Engine {
    /// `Command::Get`.
    pub(super) fn post_get(&mut self, request: BackendGet, reply: Reply<()>) {
        if reply.is_canceled() {
            return; // Nobody waits and nothing was transferred: skip it.
        }
        match self.try_post_get(request, reply) {
            Ok(()) => {}
            Err((reply, err)) => {
                let _ = reply.send(Err(err));
            }
        }
    }

    fn try_post_get(
        &mut self,
        request: BackendGet,
        reply: Reply<()>,
    ) -> Result<(), (Reply<()>, RdmaError)> {
        let BackendGet {
            peer,
            remote_addr,
            packed_key,
            local_region_id,
            local_offset,
            len,
            deadline,
        } = request;
        // Destination: mapped, not unmapping, and the range inside the mapped
        // pointer and length.
        let Some(region) = self.regions.get(&local_region_id) else {
            return Err((reply, RdmaError::RegionNotFound));
        };
        if region.is_unmapping() {
            return Err((reply, RdmaError::RegionNotFound));
        }
        let in_bounds = len > 0
            && local_offset
                .checked_add(len)
                .is_some_and(|end| end <= region.len as u64)
            && remote_addr.checked_add(len).is_some();
        let Some(len) = usize::try_from(len).ok().filter(|_| in_bounds) else {
            return Err((reply, RdmaError::OutOfRange));
        };
        let dest = (region.ptr + local_offset as usize) as *mut u8;
        let memh = region.memh;

        let Some(format) = self.key_format else {
            return Err((reply, RdmaError::InvalidKey));
        };
        let (endpoint, serial) = match self.endpoint_for(peer) {
            Ok(found) => found,
            Err(err) => return Err((reply, err)),
        };
        let (rkey_id, rkey) = match self.rkeys.lookup(serial, &packed_key) {
            Some(found) => found,
            None => {
                let buffer = match copy_for_unpack(&format, &packed_key) {
                    Ok(buffer) => buffer,
                    Err(err) => return Err((reply, err.into())),
                };
                // SAFETY: the endpoint is live (just looked up in the peer
                // table) and the buffer is a validated key followed by the
                // unpack padding, so UCX's unbounded parse stays inside it.
                let handle = match unsafe { self.worker.unpack_rkey(endpoint, &buffer) } {
                    Ok(handle) => handle,
                    Err(err) => return Err((reply, err)),
                };
                let (id, evicted) = self.rkeys.insert(serial, packed_key, handle);
                for rkey in evicted {
                    // SAFETY: evicted entries are idle (no posted GET uses
                    // them); the worker is live; each leaves the table once.
                    unsafe { self.worker.destroy_rkey(rkey) };
                }
                (id, handle)
            }
        };

        let deadline = Instant::now() + deadline.unwrap_or(self.settings.default_get_deadline);
        let events: *const Events = &*self.events;
        let (slot, op) = self.ops.alloc(events);
        // SAFETY: `op` is the freshly allocated slot; no UCX request refers to
        // it yet.
        unsafe {
            (*op).reply = Some(reply);
            (*op).peer = peer;
            (*op).region_id = local_region_id;
            (*op).rkey_id = rkey_id;
            (*op).endpoint_serial = serial;
        }
        // SAFETY: endpoint and key are live; `[dest, dest + len)` was checked
        // to lie inside the registration `memh`, which stays registered while
        // the request holds the region (in_flight below); the slot outlives
        // the request (freed only after the worker).
        let status = unsafe {
            self.worker.get(
                endpoint,
                dest,
                len,
                remote_addr,
                rkey,
                memh,
                on_get_complete,
                op.cast::<c_void>(),
            )
        };
        match status {
            PtrStatus::Pending(request) => {
                // SAFETY: the slot is active and owned by this GET.
                unsafe { (*op).request = request };
                if let Some(region) = self.regions.get_mut(&local_region_id) {
                    region.in_flight += 1;
                }
                self.rkeys.acquire(rkey_id);
                // SAFETY: as above.
                let generation = unsafe { (*op).generation };
                self.ops
                    .deadlines
                    .push(Reverse((deadline, slot, generation)));
            }
            PtrStatus::Done | PtrStatus::Failed(_) => {
                let outcome = match status {
                    PtrStatus::Failed(code) => get_outcome(code, peer),
                    _ => Ok(()),
                };
                // SAFETY: no request refers to the slot (UCX completed inline
                // or refused), so the loop owns it.
                if let Some(reply) = unsafe { (*op).reply.take() } {
                    let _ = reply.send(outcome);
                }
                self.ops.release(slot);
                if let Some(rkey) = self.rkeys.discard_if_unused(rkey_id) {
                    // SAFETY: retired and unused; leaves the table once.
                    unsafe { self.worker.destroy_rkey(rkey) };
                }
            }
        }
        Ok(())
    }

    /// A posted GET's request completed (its callback ran).
    pub(super) fn finish_get(&mut self, slot: u32, status: ucs_status_t) {
        let Some(op) = self.ops.op(slot) else {
            tracing::error!(slot, "completion for an op slot that is not active");
            return;
        };
        // SAFETY: the slot is active; its callback has run, so UCX no longer
        // refers to it except through the request freed here.
        let (request, region_id, rkey_id, reply, peer) = unsafe {
            (
                (*op).request,
                (*op).region_id,
                (*op).rkey_id,
                (*op).reply.take(),
                (*op).peer,
            )
        };
        if let Some(reply) = reply {
            let _ = reply.send(get_outcome(status, peer));
        }
        if !request.is_null() {
            // SAFETY: the request came from ucp_get_nbx on this worker, has
            // completed, and is freed once (the slot is released next).
            unsafe { self.worker.free_request(request) };
        }
        self.ops.release(slot);
        if let Some(rkey) = self.rkeys.release(rkey_id) {
            // SAFETY: retired and now unused; leaves the table once.
            unsafe { self.worker.destroy_rkey(rkey) };
        }
        self.release_region_hold(region_id);
    }

    /// Answers GETs past their deadline with `Timeout` and makes UCX let go
    /// of them.
    pub(super) fn expire_gets(&mut self, now: Instant) {
        for slot in self.ops.expired(now) {
            let Some(op) = self.ops.op(slot) else {
                continue;
            };
            // SAFETY: active slot, touched between UCX calls only.
            let (reply, peer, serial) =
                unsafe { ((*op).reply.take(), (*op).peer, (*op).endpoint_serial) };
            if let Some(reply) = reply {
                let _ = reply.send(Err(RdmaError::Timeout));
            }
            self.declare_unresponsive(peer, serial);
        }
    }
}
