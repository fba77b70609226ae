//! A read's record while in flight (`GetOp`), its `Phase`, and the slot table.
//!
//! Which reply may finish a served read, its deadline, and when it
//! completes are the consumer machine's (`Events::consumer`); the op holds
//! what UCX needs. Slots are boxed once and reused, and freed only when the
//! table is dropped after the worker, so a late UCX callback never touches
//! freed memory. A slot is recycled once its op finished and its request
//! send completed; its generation tells a later read apart from the one a
//! stale completion names.

use std::ffi::c_void;

use rdmareg_core::{PeerId, RdmaError};
use ucx_sys as sys;

use super::events::Events;
use super::results::Waiter;
use super::ucp::MemHandle;
use rdmareg_engine::served::consumer::ReadId;

/// Where a read stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// The request is out; UCX holds nothing of the destination.
    AwaitingReply,
    /// A rendezvous receive into the destination is running.
    Receiving,
    /// UCX has let go of the destination; the caller has its result.
    Finished,
}

/// One read. Reached by callbacks through a raw pointer; the loop touches it
/// only between UCX calls.
#[derive(Debug)]
pub(crate) struct GetOp {
    pub(super) reply: Option<Waiter>,
    pub(super) events: *const Events,
    pub(super) slot: u32,
    /// The request id: unique over the engine's life.
    pub(super) generation: u64,
    pub(super) peer: PeerId,
    pub(super) endpoint_serial: u64,
    /// The endpoint the request went out on: only a reply arriving on it
    /// can finish the read.
    pub(super) endpoint: sys::ucp_ep_h,
    pub(super) region_id: u64,
    pub(super) dest: *mut u8,
    pub(super) len: usize,
    pub(super) memh: Option<MemHandle>,
    pub(super) phase: Phase,
    /// The request send, while UCX still owns it.
    pub(super) send_request: *mut c_void,
    pub(super) send_pending: bool,
    /// The rendezvous receive, until the loop frees it.
    pub(super) receive_request: *mut c_void,
    /// The read's id in the consumer machine (`Events::consumer`): its
    /// request id on the wire.
    pub(super) read: ReadId,
    /// The destination hold was dropped.
    pub(super) hold_released: bool,
    /// For a list's leader (the op whose slot owns the list request's
    /// send): the other reads the request carries, by slot and generation,
    /// failed with the leader if the send fails.
    pub(super) list_members: Vec<(u32, u64)>,
    pub(super) active: bool,
}

impl GetOp {
    fn idle(events: *const Events, slot: u32) -> GetOp {
        GetOp {
            reply: None,
            events,
            slot,
            generation: 0,
            peer: PeerId(0),
            endpoint_serial: 0,
            endpoint: std::ptr::null_mut(),
            region_id: 0,
            dest: std::ptr::null_mut(),
            len: 0,
            memh: None,
            phase: Phase::Finished,
            send_request: std::ptr::null_mut(),
            send_pending: false,
            receive_request: std::ptr::null_mut(),
            read: ReadId(0),
            hold_released: true,
            list_members: Vec::new(),
            active: false,
        }
    }

    /// Marks the op finished and sends its caller `outcome`, once.
    pub(super) fn finish(&mut self, outcome: Result<(), RdmaError>) {
        self.phase = Phase::Finished;
        if let Some(reply) = self.reply.take() {
            if reply.send(outcome) {
                // The caller moves next. A batch's entries count once, when
                // the last one completes the batch.
                // SAFETY: the events record outlives every op slot's use.
                unsafe { &*self.events }.handed_off();
            }
        }
    }
}

/// Reusable op slots.
#[derive(Debug)]
pub(crate) struct OpTable {
    slots: Vec<*mut GetOp>,
    free: Vec<u32>,
    active: usize,
    next_generation: u64,
}

impl OpTable {
    pub(crate) fn new() -> OpTable {
        OpTable {
            slots: Vec::new(),
            free: Vec::new(),
            active: 0,
            next_generation: 0,
        }
    }

    /// Reads posted whose slot is not recycled yet.
    pub(crate) fn active(&self) -> usize {
        self.active
    }

    pub(super) fn alloc(&mut self, events: *const Events) -> (u32, *mut GetOp) {
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                let slot = u32::try_from(self.slots.len()).unwrap_or(u32::MAX);
                self.slots
                    .push(Box::into_raw(Box::new(GetOp::idle(events, slot))));
                slot
            }
        };
        self.next_generation += 1;
        let op = self.slots[slot as usize];
        // SAFETY: slot pointers come from Box::into_raw and live until
        // `Drop`; a free slot is in no table and has no UCX request.
        unsafe {
            *op = GetOp::idle(events, slot);
            (*op).generation = self.next_generation;
            (*op).active = true;
        }
        self.active += 1;
        (slot, op)
    }

    pub(super) fn op(&self, slot: u32) -> Option<*mut GetOp> {
        let op = *self.slots.get(slot as usize)?;
        // SAFETY: a slot pointer from this table is valid until `Drop`.
        unsafe { (*op).active }.then_some(op)
    }

    pub(super) fn is_current(&self, slot: u32, generation: u64) -> bool {
        // SAFETY: as in `op`.
        self.op(slot)
            .is_some_and(|op| unsafe { (*op).generation == generation })
    }

    pub(super) fn recycle(&mut self, slot: u32) {
        if let Some(op) = self.op(slot) {
            // SAFETY: as in `op`; UCX holds no request of the slot any more.
            unsafe {
                (*op).active = false;
                (*op).reply = None;
            }
            self.active -= 1;
            self.free.push(slot);
        }
    }

    /// Reads whose rendezvous receive runs on endpoint `serial`: they keep
    /// the endpoint busy until UCX ends them.
    pub(crate) fn receiving_on_endpoint(&self, serial: u64) -> usize {
        self.active_slots()
            .into_iter()
            .filter_map(|slot| self.op(slot))
            // SAFETY: as in `op`.
            .filter(|&op| unsafe {
                (*op).endpoint_serial == serial && (*op).phase == Phase::Receiving
            })
            .count()
    }

    /// Active slots, for sweeps.
    fn active_slots(&self) -> Vec<u32> {
        (0..self.slots.len() as u32)
            .filter(|&slot| self.op(slot).is_some())
            .collect()
    }

    /// Fails every read not yet completed with `ShuttingDown`. Only for
    /// after the worker is destroyed, when UCX holds nothing any more.
    pub(crate) fn fail_all_after_worker_destroyed(&mut self) {
        for slot in self.active_slots() {
            if let Some(op) = self.op(slot) {
                // SAFETY: as in `op`; the worker is gone, so no callback
                // can run concurrently.
                unsafe { (*op).finish(Err(RdmaError::ShuttingDown)) };
            }
        }
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
