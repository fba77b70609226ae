//! The consumer's side of a read: post the request, land the reply in the
//! destination, answer only once UCX has let go of it.
//!
//! # A read's life
//!
//! 1. **Posted.** The destination is checked against the mapped pointer and
//!    length and held (an unmap of it waits), the key is decoded (a key that
//!    is not an owner-served key of this format is `InvalidKey`), an op slot
//!    is taken, the op is entered in `Events::awaiting_replies` under its
//!    request id, and the request goes to the owner as an active message with
//!    the reply flag.
//! 2. **Replied.** The reply handler takes the op out of the waiting table
//!    (from then on no later reply can reach it) and either copies the bytes
//!    (eager), starts a rendezvous receive straight into the destination
//!    (large replies: UCX pulls them with zero copy where the lane can), or
//!    turns a refusal into the seam's error for it (`OutOfRange`,
//!    `RegionNotFound`, `InvalidKey`; see `read_protocol::RemoteRefusal`). A reply whose
//!    length is not the requested length is refused before UCX is asked to
//!    receive it: UCX's release build does not check the destination's size.
//! 3. **Finished.** The op is answered — by the callback that finished it,
//!    so the caller wakes without waiting for the loop — and the loop drops
//!    the destination hold and recycles the slot once the request send has
//!    completed too.
//!
//! # An answer means UCX has let go
//!
//! No read is answered while UCX may still write its destination: that
//! would hand safe code a `&mut` to bytes UCX still writes. While an op
//! waits for its reply UCX holds nothing of the destination, so a deadline,
//! a failed endpoint or a teardown answers it at once (and a late reply
//! finds nothing to land in). Once a rendezvous receive runs, only its
//! completion answers: past the deadline the endpoint is force-closed so UCX
//! completes it with an error, and the answer is then `Timeout` — or `Ok`,
//! if the bytes landed after all. Without peer error handling an endpoint
//! cannot be force-closed, and such a receive answers when it ends or when
//! the worker is destroyed.
//!
//! A read with a same-host key whose owner's direct lane this engine can
//! reach skips the request and the reply: it is posted as a one-sided
//! `ucp_get_nbx` on the direct lane (`direct`), held and answered the same
//! way once UCX completes it.
//!
//! Slots are boxed once and reused, so steady-state reads allocate nothing
//! here. A slot's memory is freed only after the worker is destroyed, so a
//! late callback can never touch freed memory.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::ffi::c_void;
use std::sync::Arc;
use std::time::Instant;

use rdmareg_core::{BackendGet, PeerId, RdmaError};
use ucx_sys as sys;

use super::Engine;
use super::answer::{Answer, BatchAnswers, BatchReply};
use super::events::Events;
use super::key_memo::DecodedKey;
use super::ucp::{
    EpHandle, MemHandle, RemoteKey, SendMode, handler_header, receive_rendezvous,
    send_active_message,
};
use super::vectored::{self, CopyEntry};
use crate::command::Reply;
use crate::owner_process::{OwnerProcess, SameHostSource};
use crate::read_protocol::{READ_REQUEST_AM_ID, ReadKey, ReadReply, ReadRequest, ReplyStatus};
use crate::status::{PtrStatus, status_text};

/// Where a read stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// The request is out; UCX holds nothing of the destination.
    AwaitingReply,
    /// A rendezvous receive into the destination is running.
    Receiving,
    /// UCX has let go of the destination; the answer is given.
    Finished,
}

/// One read. Reached by callbacks through a raw pointer; the loop touches it
/// only between UCX calls.
#[derive(Debug)]
pub(crate) struct GetOp {
    pub(super) reply: Option<Answer>,
    events: *const Events,
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
    memh: Option<MemHandle>,
    pub(super) phase: Phase,
    /// The request send, while UCX still owns it.
    pub(super) send_request: *mut c_void,
    pub(super) send_pending: bool,
    /// The rendezvous receive (or the direct read), until the loop frees
    /// it.
    pub(super) receive_request: *mut c_void,
    /// A direct read's unpacked key, destroyed once the read is handled.
    pub(super) direct_key: Option<RemoteKey>,
    /// The deadline passed while the receive ran.
    expired: bool,
    /// The destination hold was dropped.
    pub(super) hold_released: bool,
    /// For a list's leader (the op whose slot owns the list request's
    /// send): the other reads the request carries, by slot and generation,
    /// failed with the leader if the send fails.
    pub(super) list_members: Vec<(u32, u64)>,
    active: bool,
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
            direct_key: None,
            expired: false,
            hold_released: true,
            list_members: Vec::new(),
            active: false,
        }
    }

    /// A direct read's copy ended with `status` (from its completion
    /// callback, or inline when UCX completed it at once).
    pub(super) fn direct_read_ended(&mut self, status: sys::ucs_status_t) {
        // SAFETY: the events record outlives the workers.
        let events = unsafe { &*self.events };
        let outcome = if status == sys::UCS_OK {
            Ok(())
        } else {
            Err(failure(self, events, status))
        };
        self.finish(outcome);
        events.finished_reads.borrow_mut().push(self.slot);
    }

    /// Marks the op finished and answers it with `outcome`, once.
    pub(super) fn finish(&mut self, outcome: Result<(), RdmaError>) {
        self.phase = Phase::Finished;
        if let Some(answer) = self.reply.take() {
            if answer.send(outcome) {
                // A caller was answered: it moves next. A batch's entries
                // count once, when the last one answers the batch.
                // SAFETY: the events record outlives every op slot's use.
                unsafe { &*self.events }.handed_off();
            }
        }
    }
}

/// A same-host read gathered for this turn's vectored copy.
#[derive(Debug)]
pub(super) struct PendingCopy {
    /// The owner's process.
    owner: Arc<OwnerProcess>,
    entry: CopyEntry,
    /// The read as asked, to post through the owner if the kernel refuses.
    request: BackendGet,
    /// Taken when answered.
    answer: Option<Answer>,
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

    /// Enters `slot`'s current read in the deadline queue.
    pub(super) fn schedule_deadline(&mut self, slot: u32, deadline: Instant) {
        if let Some(op) = self.op(slot) {
            // SAFETY: as in `op`.
            let generation = unsafe { (*op).generation };
            self.deadlines.push(Reverse((deadline, slot, generation)));
        }
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

    fn recycle(&mut self, slot: u32) {
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

    /// Active, unfinished slots whose deadline is not after `now`.
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

    /// The earliest deadline of an active read.
    pub(crate) fn next_deadline(&mut self) -> Option<Instant> {
        while let Some(Reverse((deadline, slot, generation))) = self.deadlines.peek().copied() {
            if self.is_current(slot, generation) {
                return Some(deadline);
            }
            self.deadlines.pop();
        }
        None
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

    /// Direct reads on direct endpoint `serial` whose key is not yet
    /// destroyed.
    pub(crate) fn direct_reads_on_endpoint(&self, serial: u64) -> usize {
        self.active_slots()
            .into_iter()
            .filter_map(|slot| self.op(slot))
            // SAFETY: as in `op`.
            .filter(|&op| unsafe { (*op).endpoint_serial == serial && (*op).direct_key.is_some() })
            .count()
    }

    /// Forgets (leaks) the keys of direct reads on endpoint `serial` that
    /// never ended: UCX forbids destroying a key once its endpoint is gone.
    pub(crate) fn forget_direct_keys_on_endpoint(&mut self, serial: u64) {
        for slot in self.active_slots() {
            if let Some(op) = self.op(slot) {
                // SAFETY: as in `op`.
                unsafe {
                    if (*op).endpoint_serial == serial {
                        (*op).direct_key = None;
                    }
                }
            }
        }
    }

    /// Active slots, for sweeps.
    fn active_slots(&self) -> Vec<u32> {
        (0..self.slots.len() as u32)
            .filter(|&slot| self.op(slot).is_some())
            .collect()
    }

    /// Answers every read still unanswered with `ShuttingDown`. Only for
    /// after the worker is destroyed, when UCX holds nothing any more.
    pub(crate) fn answer_all_after_worker_destroyed(&mut self) {
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

/// The error a read gets when UCX ended it with `status`.
/// An owner-served read whose op is set up (waiting for its reply, deadline
/// scheduled) and whose request is still to be sent.
#[derive(Debug)]
pub(super) struct PreparedRead {
    pub(super) slot: u32,
    pub(super) op: *mut GetOp,
    /// The endpoint to the owner, looked up this turn.
    pub(super) endpoint: sys::ucp_ep_h,
    pub(super) request: ReadRequest,
}

fn failure(op: &GetOp, events: &Events, status: sys::ucs_status_t) -> RdmaError {
    if op.expired {
        RdmaError::Timeout
    } else if events.tearing_down.get() {
        RdmaError::ShuttingDown
    } else {
        RdmaError::Backend(format!(
            "ucx: read from {} failed: {}",
            op.peer,
            status_text(status)
        ))
    }
}

/// Lands `reply` for `op` (taken out of the waiting table by the caller).
///
/// # Safety
/// Inside a reply handler on the worker's thread; `op` is active and in
/// `AwaitingReply`; `data`/`length`/`rendezvous` are what UCX passed.
unsafe fn land_reply(
    events: &Events,
    op: *mut GetOp,
    reply: ReadReply,
    data: *mut c_void,
    length: usize,
    rendezvous: bool,
) {
    // SAFETY: the caller's contract: the op is active and only this
    // callback touches it now.
    let op_ref = unsafe { &mut *op };
    let outcome = match reply.status {
        ReplyStatus::Refused(refusal) => {
            tracing::debug!(peer = %op_ref.peer, %refusal, "the owner refused a read");
            Err(refusal.into())
        }
        ReplyStatus::Served if reply.length != op_ref.len as u64 || length != op_ref.len => {
            Err(RdmaError::Backend(format!(
                "ucx: {} answered {} bytes to a {}-byte read; refused",
                op_ref.peer, length, op_ref.len
            )))
        }
        ReplyStatus::Served if rendezvous => {
            let worker = events.worker.get();
            let Some(memh) = op_ref.memh.filter(|_| !worker.is_null()) else {
                op_ref.finish(Err(RdmaError::ShuttingDown));
                events.finished_reads.borrow_mut().push(op_ref.slot);
                return;
            };
            // SAFETY: inside the worker's progress; `data` is the rendezvous
            // descriptor of exactly `op.len` bytes (checked above);
            // `[dest, dest + len)` was checked against the mapped region
            // `memh` when the read was posted and is held (an unmap waits)
            // until the loop sees this op finished; the slot outlives the
            // receive.
            let status = unsafe {
                receive_rendezvous(
                    worker,
                    data,
                    op_ref.dest,
                    op_ref.len,
                    memh,
                    on_receive_done,
                    op.cast::<c_void>(),
                )
            };
            match status {
                PtrStatus::Pending(request) => {
                    op_ref.receive_request = request;
                    op_ref.phase = Phase::Receiving;
                    return;
                }
                PtrStatus::Done => Ok(()),
                PtrStatus::Failed(status) => Err(failure(op_ref, events, status)),
            }
        }
        ReplyStatus::Served => {
            if length > 0 {
                // SAFETY: eager data: `length` (== op.len) readable bytes at
                // `data` for the handler's duration; the destination is
                // checked and held as above, and nothing else writes it
                // while the op waits for this reply.
                unsafe { std::ptr::copy_nonoverlapping(data.cast::<u8>(), op_ref.dest, length) };
            }
            Ok(())
        }
    };
    op_ref.finish(outcome);
    events.finished_reads.borrow_mut().push(op_ref.slot);
}

/// UCX's handler for a read reply (`READ_REPLY_AM_ID`).
///
/// # Safety
/// Installed with `arg` = the engine's `Events`, which outlives the worker.
pub(super) unsafe extern "C" fn on_read_reply(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: `arg` is the engine's boxed `Events`, alive until after the
    // worker is destroyed.
    let events = unsafe { &*arg.cast::<Events>() };
    // SAFETY: UCX passes a valid parameter record for the call's duration.
    let param = unsafe { &*param };
    let rendezvous = param.recv_attr & u64::from(sys::UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    let arrived_on = reply_endpoint(param);
    // SAFETY: what UCX passed this handler, used only during it.
    let header = unsafe { handler_header(header, header_length) };
    let Ok(reply) = ReadReply::decode(header) else {
        events
            .dropped_messages
            .set(events.dropped_messages.get() + 1);
        // UCS_OK drops the message (for a rendezvous, UCX tells the sender).
        return sys::UCS_OK;
    };
    if let Some(op) = take_awaiting(events, reply.request_id, arrived_on) {
        // SAFETY: in the waiting table means active and awaiting its reply;
        // removed above, so this is the only reply that reaches it.
        unsafe { land_reply(events, op, reply, data, length, rendezvous) };
    }
    // A reply nobody waits for any more (deadline, closed endpoint) is
    // dropped; for a rendezvous, UCX tells the sender to stop.
    sys::UCS_OK
}

/// The endpoint a reply came in on: owners reply with the reply flag, so
/// UCX names it (this engine's endpoint to that owner). Null without it.
pub(super) fn reply_endpoint(param: &sys::ucp_am_recv_param_t) -> sys::ucp_ep_h {
    if param.recv_attr & u64::from(sys::UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 {
        param.reply_ep
    } else {
        std::ptr::null_mut()
    }
}

/// Takes the read `request_id` out of the waiting table if its request went
/// out on `arrived_on`. Only the owner the request went to can answer it:
/// request ids are a counter, and another peer guessing one must not land
/// its bytes in this read's destination.
pub(super) fn take_awaiting(
    events: &Events,
    request_id: u64,
    arrived_on: sys::ucp_ep_h,
) -> Option<*mut GetOp> {
    let mut awaiting = events.awaiting_replies.borrow_mut();
    match awaiting.get(&request_id) {
        // SAFETY: ops in the waiting table are active slots.
        Some(&op) if !arrived_on.is_null() && unsafe { (*op).endpoint } == arrived_on => {
            awaiting.remove(&request_id)
        }
        Some(_) => {
            events
                .dropped_messages
                .set(events.dropped_messages.get() + 1);
            None
        }
        None => None,
    }
}

/// A rendezvous receive into a destination ended.
unsafe extern "C" fn on_receive_done(
    _request: *mut c_void,
    status: sys::ucs_status_t,
    _length: usize,
    user_data: *mut c_void,
) {
    let op = user_data.cast::<GetOp>();
    // SAFETY: `user_data` is the op slot this receive was started for;
    // slots outlive the worker and are recycled only after the loop handled
    // this completion; the loop touches ops only between UCX calls.
    let op = unsafe { &mut *op };
    // SAFETY: the events record outlives the worker.
    let events = unsafe { &*op.events };
    let outcome = if status == sys::UCS_OK {
        Ok(())
    } else {
        Err(failure(op, events, status))
    };
    op.finish(outcome);
    events.finished_reads.borrow_mut().push(op.slot);
}

/// A read request's send ended.
pub(super) unsafe extern "C" fn on_request_sent(
    _request: *mut c_void,
    status: sys::ucs_status_t,
    user_data: *mut c_void,
) {
    let op = user_data.cast::<GetOp>();
    // SAFETY: as in `on_receive_done`.
    let (events, slot) = unsafe { ((*op).events, (*op).slot) };
    // SAFETY: the events record outlives the worker.
    unsafe { &*events }
        .sent_requests
        .borrow_mut()
        .push((slot, status));
}

impl Engine {
    /// `Command::Get`.
    pub(super) fn post_get(&mut self, request: BackendGet, reply: Reply<()>) {
        let answer = Answer::Single(reply);
        if answer.is_abandoned() {
            return; // Nobody waits and nothing was transferred: skip it.
        }
        if let Err((answer, err)) = self.try_post_get(request, answer) {
            answer.send(Err(err));
        }
        self.flush_copies();
    }

    /// `Command::GetBatch`: every entry posted in this one turn, each
    /// answered as its own read would be, the list sent once the last one
    /// is (see `answer`).
    pub(super) fn post_batch(&mut self, requests: Vec<BackendGet>, reply: BatchReply) {
        if reply.is_canceled() {
            return; // Nobody waits and nothing was transferred: skip it.
        }
        if requests.is_empty() {
            let _ = reply.send(Vec::new());
            return;
        }
        let batch = BatchAnswers::new(requests.len(), reply);
        let mut served = Vec::new();
        for (index, request) in requests.into_iter().enumerate() {
            let answer = Answer::Entry {
                batch: std::rc::Rc::clone(&batch),
                index,
            };
            match self.prepare_get(request, answer) {
                Ok(Some(prepared)) => served.push(prepared),
                Ok(None) => {}
                Err((answer, err)) => {
                    answer.send(Err(err));
                }
            }
        }
        // Sends below may run callbacks that close endpoints.
        self.endpoint_memo = None;
        // Small owner-served reads of one owner travel as lists.
        self.send_prepared(served);
        self.flush_copies();
    }

    /// `peer`'s served endpoint (`endpoint_for`), remembered for the next
    /// read of the same batch. The memo is sound only while nothing can
    /// close or replace an endpoint: `post_batch` and `try_post_get` clear
    /// it before they send anything, and the direct lane clears it before
    /// it runs.
    fn served_endpoint(&mut self, peer: PeerId) -> Result<(EpHandle, u64), RdmaError> {
        if let Some((memo_peer, endpoint, serial)) = self.endpoint_memo {
            if memo_peer == peer {
                return Ok((endpoint, serial));
            }
        }
        let (endpoint, serial) = self.endpoint_for(peer)?;
        self.endpoint_memo = Some((peer, endpoint, serial));
        Ok((endpoint, serial))
    }

    /// Where `peer`'s same-host reads come from: its process, copied from
    /// here, when it published one in this engine's pid space and UCX
    /// reaches its direct lane (see `vectored`); nothing, once a copy found
    /// that process gone; otherwise UCX.
    fn copy_source(&mut self, peer: PeerId) -> SameHostSource {
        if let Some((memo_peer, source)) = &self.copy_source_memo {
            if *memo_peer == peer {
                return source.clone();
            }
        }
        let source = self.look_up_copy_source(peer);
        self.copy_source_memo = Some((peer, source.clone()));
        source
    }

    fn look_up_copy_source(&mut self, peer: PeerId) -> SameHostSource {
        let Some(connection) = self.peers.connection_mut(peer) else {
            return SameHostSource::ThroughUcx;
        };
        let owner = match &connection.process {
            SameHostSource::Copy(owner) => Arc::clone(owner),
            other => return other.clone(),
        };
        if self.direct_endpoint_for(peer).is_none() {
            return SameHostSource::ThroughUcx;
        }
        self.signals.caller_copies.publish_source(peer, &owner);
        SameHostSource::Copy(owner)
    }

    /// `packed_key` decoded (`None` if it does not decode), from the memo
    /// when this engine decoded the same bytes lately.
    fn decoded_key(&mut self, packed_key: &[u8]) -> Option<DecodedKey> {
        if let Some(decoded) = self.key_memo.get(packed_key) {
            return Some(decoded);
        }
        let key = ReadKey::decode(packed_key).ok()?;
        let direct_well_formed = match &key {
            ReadKey::SameHost(same_host) => self.direct_key_is_well_formed(&same_host.ucx_key),
            ReadKey::Served(_) => false,
        };
        let decoded = DecodedKey {
            key: std::rc::Rc::new(key),
            direct_well_formed,
        };
        self.key_memo.insert(packed_key, decoded.clone());
        Some(decoded)
    }

    /// Copies the same-host reads gathered this turn, one vectored call per
    /// owner process and kernel vector limit, and answers each. A peer the
    /// kernel refuses to let this process read is read through its owner
    /// (never UCX's cma, which would name the process by pid alone) from now
    /// on, these reads included.
    fn flush_copies(&mut self) {
        self.copy_source_memo = None;
        if self.copies.is_empty() {
            return;
        }
        let mut copies = std::mem::take(&mut self.copies);
        // Stable: each owner's reads keep their order. Usually there is one
        // owner, and moving a thousand entries for nothing is not free.
        if !copies.is_sorted_by_key(|copy| copy.owner.pid()) {
            copies.sort_by_key(|copy| copy.owner.pid());
        }
        let mut fallback = Vec::new();
        for group in copies.chunk_by_mut(|a, b| Arc::ptr_eq(&a.owner, &b.owner)) {
            let entries: Vec<CopyEntry> = group.iter().map(|copy| copy.entry).collect();
            // SAFETY: every destination was checked inside a region this
            // engine mapped and that cannot be unmapped before this returns
            // (unmaps run on this thread); the registry holds each
            // destination until its answer, sent below after the copy.
            let outcomes = unsafe { vectored::copy_from_process(&group[0].owner, &entries) };
            for (copy, outcome) in group.iter_mut().zip(outcomes) {
                let Some(answer) = copy.answer.take() else {
                    continue;
                };
                match outcome {
                    Ok(()) => {
                        answer.send(Ok(()));
                    }
                    Err(err) if err.is_refusal() => {
                        tracing::debug!(peer = %copy.request.peer, error = %err, "same-host copies refused; reading through the owner");
                        self.stop_copying_from(copy.request.peer, SameHostSource::ThroughOwner);
                        fallback.push((copy.request.clone(), answer));
                    }
                    Err(err) => {
                        if err.is_gone() {
                            // Its pid may name another process now or later:
                            // never read it again, by a copy (the caller's
                            // included) or through UCX's cma, which names
                            // the owner by pid too.
                            tracing::debug!(peer = %copy.request.peer, "same-host owner process gone; its same-host reads fail from now on");
                            self.stop_copying_from(copy.request.peer, SameHostSource::Gone);
                        }
                        answer.send(Err(RdmaError::Backend(format!(
                            "ucx: same-host copy from {} failed: {err}",
                            copy.request.peer
                        ))));
                    }
                }
            }
        }
        for (request, answer) in fallback {
            if let Err((answer, err)) = self.try_post_get(request, answer) {
                answer.send(Err(err));
            }
        }
        // A fallback never gathers again: its peer's process was cleared.
        debug_assert!(self.copies.is_empty());
        self.copy_source_memo = None;
    }

    /// `peer`'s reads no longer copy from its process, on this thread or
    /// on callers' (whose sources are all withdrawn: rare, and the thread
    /// republishes what still holds); they come from `instead`.
    fn stop_copying_from(&mut self, peer: PeerId, instead: SameHostSource) {
        if let Some(connection) = self.peers.connection_mut(peer) {
            connection.process = instead;
        }
        self.signals.caller_copies.withdraw_all_sources();
    }

    fn try_post_get(
        &mut self,
        request: BackendGet,
        reply: Answer,
    ) -> Result<(), (Answer, RdmaError)> {
        let prepared = self.prepare_get(request, reply);
        self.endpoint_memo = None;
        if let Some(prepared) = prepared? {
            self.send_read_request(prepared);
        }
        Ok(())
    }

    /// Checks a read and starts it, up to its request: a same-host read is
    /// gathered for this turn's copy or posted one-sided, and `None`
    /// returned; an owner-served read gets its op (in the waiting table,
    /// its deadline scheduled) and comes back to be sent, alone or in a
    /// list (`gathered`).
    pub(super) fn prepare_get(
        &mut self,
        request: BackendGet,
        reply: Answer,
    ) -> Result<Option<PreparedRead>, (Answer, RdmaError)> {
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
        let Some(DecodedKey {
            key,
            direct_well_formed,
        }) = self.decoded_key(&packed_key)
        else {
            return Err((reply, RdmaError::InvalidKey));
        };
        let source = match &*key {
            ReadKey::SameHost(_) => self.copy_source(peer),
            ReadKey::Served(_) => SameHostSource::ThroughUcx,
        };
        if let SameHostSource::Gone = source {
            return Err((
                reply,
                RdmaError::Backend(format!(
                    "ucx: the process of {peer} is gone (it exited or replaced its program); its same-host memory with it"
                )),
            ));
        }
        let through_owner = matches!(source, SameHostSource::ThroughOwner);
        if let (ReadKey::SameHost(same_host), SameHostSource::Copy(owner)) = (&*key, source) {
            // The UCX key goes unused on this path, but a key is checked
            // the same whichever way it is read.
            if !direct_well_formed {
                return Err((reply, RdmaError::InvalidKey));
            }
            if !same_host.covers(remote_addr, len as u64) {
                return Err((reply, RdmaError::OutOfRange));
            }
            self.copies.push(PendingCopy {
                owner,
                entry: CopyEntry {
                    remote_addr,
                    dest,
                    len,
                },
                request: BackendGet {
                    peer,
                    remote_addr,
                    packed_key,
                    local_region_id,
                    local_offset,
                    len: len as u64,
                    deadline,
                },
                answer: Some(reply),
            });
            return Ok(None);
        }
        // A copy never waits: only reads that do need a deadline.
        let deadline = Instant::now() + deadline.unwrap_or(self.settings.default_get_deadline);
        let reply = match &*key {
            ReadKey::SameHost(same_host) if !through_owner => {
                // The direct lane may fall back and touch the peer table.
                self.endpoint_memo = None;
                match self.try_post_direct_get(
                    peer,
                    same_host,
                    remote_addr,
                    local_region_id,
                    dest,
                    len,
                    deadline,
                    reply,
                )? {
                    None => return Ok(None),
                    Some(reply) => reply,
                }
            }
            ReadKey::SameHost(_) | ReadKey::Served(_) => reply,
        };
        let key = key.served();
        let (endpoint, serial) = match self.served_endpoint(peer) {
            Ok(found) => found,
            Err(err) => return Err((reply, err)),
        };

        let events: *const Events = &*self.events;
        let (slot, op) = self.ops.alloc(events);
        // SAFETY: the freshly allocated slot; nothing refers to it yet.
        let generation = unsafe {
            (*op).reply = Some(reply);
            (*op).peer = peer;
            (*op).endpoint_serial = serial;
            (*op).endpoint = endpoint.raw();
            (*op).region_id = local_region_id;
            (*op).dest = dest;
            (*op).len = len;
            (*op).memh = Some(memh);
            (*op).phase = Phase::AwaitingReply;
            (*op).hold_released = false;
            // Until its request is sent (alone, or as a list's leader) or
            // handed to a list (`gathered`): the slot is not recycled before.
            (*op).send_pending = true;
            (*op).generation
        };
        if let Some(region) = self.regions.get_mut(&local_region_id) {
            region.in_flight += 1;
        }
        self.events
            .awaiting_replies
            .borrow_mut()
            .insert(generation, op);
        self.ops
            .deadlines
            .push(Reverse((deadline, slot, generation)));
        let request = ReadRequest {
            request_id: generation,
            key,
            address: remote_addr,
            length: len as u64,
        };
        Ok(Some(PreparedRead {
            slot,
            op,
            endpoint: endpoint.raw(),
            request,
        }))
    }

    /// Sends a prepared read's request on its own.
    pub(super) fn send_read_request(&mut self, prepared: PreparedRead) {
        let PreparedRead {
            slot,
            op,
            endpoint,
            request,
        } = prepared;
        // SAFETY: the endpoint is live (looked up this turn, and endpoints
        // close only between commands); no payload; the
        // slot outlives the send (freed only after the worker). With a
        // loopback transport the whole exchange can complete inside this
        // call, which is why the op is entered in the waiting table first
        // and no borrow is held across it.
        let status = unsafe {
            send_active_message(
                endpoint,
                READ_REQUEST_AM_ID,
                &request.encode(),
                std::ptr::null(),
                0,
                SendMode::Small,
                true,
                on_request_sent,
                op.cast::<c_void>(),
            )
        };
        self.events.handed_off();
        match status {
            // SAFETY: the slot is active and owned by this read.
            PtrStatus::Pending(request) => unsafe { (*op).send_request = request },
            PtrStatus::Done => self.request_sent(slot, sys::UCS_OK),
            PtrStatus::Failed(code) => self.request_sent(slot, code),
        }
        self.drain_events();
    }

    /// A read's request send ended with `status`.
    pub(super) fn request_sent(&mut self, slot: u32, status: sys::ucs_status_t) {
        let Some(op) = self.ops.op(slot) else {
            return;
        };
        // SAFETY: active slot, touched between UCX calls only.
        let op_ref = unsafe { &mut *op };
        if !op_ref.send_request.is_null() {
            // SAFETY: the request came from ucp_am_send_nbx on this worker,
            // has completed, and is freed once.
            unsafe { self.worker.free_request(op_ref.send_request) };
            op_ref.send_request = std::ptr::null_mut();
        }
        op_ref.send_pending = false;
        let members = std::mem::take(&mut op_ref.list_members);
        if status != sys::UCS_OK {
            self.fail_unsent(slot, status);
            for (member, generation) in members {
                if self.ops.is_current(member, generation) {
                    self.fail_unsent(member, status);
                }
            }
        }
        self.settle_op(slot);
    }

    /// Answers a read whose request could not be sent, if it still waits
    /// for a reply.
    fn fail_unsent(&mut self, slot: u32, status: sys::ucs_status_t) {
        let Some(op) = self.ops.op(slot) else {
            return;
        };
        // SAFETY: active slot, touched between UCX calls only.
        let op_ref = unsafe { &mut *op };
        if op_ref.phase != Phase::AwaitingReply {
            return;
        }
        self.events
            .awaiting_replies
            .borrow_mut()
            .remove(&op_ref.generation);
        let err = failure(op_ref, &self.events, status);
        op_ref.finish(Err(err));
        self.events.finished_reads.borrow_mut().push(slot);
    }

    /// A read finished (its answer is given): drop its destination hold, and
    /// recycle the slot once its request send is done too.
    pub(super) fn finish_get(&mut self, slot: u32) {
        let Some(op) = self.ops.op(slot) else {
            return;
        };
        // SAFETY: active slot, touched between UCX calls only.
        let op_ref = unsafe { &mut *op };
        if !op_ref.receive_request.is_null() {
            // SAFETY: the receive request completed (its callback ran) and
            // is freed once.
            unsafe { self.worker.free_request(op_ref.receive_request) };
            op_ref.receive_request = std::ptr::null_mut();
        }
        if let Some(key) = op_ref.direct_key.take() {
            // SAFETY: the direct read using it has completed; the reader
            // worker it was unpacked on is alive (it is destroyed only
            // after the loop stops handling completions).
            unsafe { key.destroy() };
        }
        self.settle_op(slot);
    }

    pub(super) fn settle_op(&mut self, slot: u32) {
        let Some(op) = self.ops.op(slot) else {
            return;
        };
        // SAFETY: active slot, touched between UCX calls only.
        let op_ref = unsafe { &mut *op };
        if op_ref.phase != Phase::Finished {
            return;
        }
        if !op_ref.hold_released {
            op_ref.hold_released = true;
            let region_id = op_ref.region_id;
            self.release_region_hold(region_id);
        }
        if !op_ref.send_pending && op_ref.receive_request.is_null() {
            self.ops.recycle(slot);
        }
    }

    /// Answers reads past their deadline: at once if UCX holds nothing of
    /// their destination, else by force-closing the endpoint so UCX ends the
    /// receive (see the module docs).
    pub(super) fn expire_gets(&mut self, now: Instant) {
        for slot in self.ops.expired(now) {
            let Some(op) = self.ops.op(slot) else {
                continue;
            };
            // SAFETY: active slot, touched between UCX calls only.
            let op_ref = unsafe { &mut *op };
            match op_ref.phase {
                Phase::AwaitingReply => {
                    self.events
                        .awaiting_replies
                        .borrow_mut()
                        .remove(&op_ref.generation);
                    op_ref.finish(Err(RdmaError::Timeout));
                    self.events.finished_reads.borrow_mut().push(slot);
                }
                Phase::Receiving if op_ref.direct_key.is_some() => {
                    // The kernel copy needs nothing from the owner and
                    // ends inside UCX's progress; its completion answers.
                    op_ref.expired = true;
                }
                Phase::Receiving => {
                    op_ref.expired = true;
                    let (peer, serial) = (op_ref.peer, op_ref.endpoint_serial);
                    self.declare_unresponsive(peer, serial);
                }
                Phase::Finished => {}
            }
        }
        self.drain_events();
    }

    /// Answers every read still waiting for a reply on endpoint `serial`
    /// with `error`: the endpoint is closing, so no reply will come.
    pub(super) fn fail_awaiting_on_endpoint(&mut self, serial: u64, error: &RdmaError) {
        self.fail_awaiting(error, |op| op.endpoint_serial == serial);
    }

    /// Answers every read still waiting for a reply (teardown, after the
    /// drain): UCX holds none of their destinations.
    pub(super) fn fail_all_awaiting(&mut self, error: &RdmaError) {
        self.fail_awaiting(error, |_| true);
    }

    /// Takes the waiting reads `which` selects out of the waiting table and
    /// answers them with `error`.
    fn fail_awaiting(&mut self, error: &RdmaError, which: impl Fn(&GetOp) -> bool) {
        let mut failed = Vec::new();
        self.events
            .awaiting_replies
            .borrow_mut()
            .retain(|_, &mut op| {
                // SAFETY: ops in the waiting table are active slots, touched
                // between UCX calls only.
                let selected = which(unsafe { &*op });
                if selected {
                    failed.push(op);
                }
                !selected
            });
        for op in failed {
            // SAFETY: as above; out of the waiting table, so no reply can
            // reach it any more.
            let op_ref = unsafe { &mut *op };
            op_ref.finish(Err(error.clone()));
            self.events.finished_reads.borrow_mut().push(op_ref.slot);
        }
    }
}
