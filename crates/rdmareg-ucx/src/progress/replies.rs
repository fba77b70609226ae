//! UCX's callbacks for a read on the consumer: the reply handler, the
//! rendezvous receive's completion and the request send's completion.
//!
//! A reply lands only in a read whose request went out on the endpoint the
//! reply arrived on (`take_awaiting`), and only with the read's own length;
//! once the handler took an op out of the waiting table no later reply can
//! reach it. A rendezvous receive answers its read from its completion, so
//! the answer comes only once UCX let go of the destination.

use std::ffi::c_void;

use rdmareg_core::RdmaError;
use ucx_sys as sys;

use super::events::Events;
use super::ops::{GetOp, Phase};
use super::ucp::{handler_header, receive_rendezvous};
use crate::read_protocol::{ReadReply, ReplyStatus};
use crate::status::{PtrStatus, status_text};

/// The error a read gets when UCX ended it with `status`.
pub(super) fn failure(op: &GetOp, events: &Events, status: sys::ucs_status_t) -> RdmaError {
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
    // SAFETY: UCX's arguments to this handler, installed with the engine's
    // `Events` as `arg`.
    let ArrivedReply {
        events,
        rendezvous,
        arrived_on,
        header,
    } = unsafe { ArrivedReply::read(arg, header, header_length, param) };
    let Ok(reply) = ReadReply::decode(header) else {
        events.dropped_message();
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

/// What a reply handler (single or list) reads first from UCX's arguments.
pub(super) struct ArrivedReply<'a> {
    pub(super) events: &'a Events,
    /// The payload waits for a rendezvous receive (else it is at hand).
    pub(super) rendezvous: bool,
    /// The endpoint it came in on ([`reply_endpoint`]).
    pub(super) arrived_on: sys::ucp_ep_h,
    pub(super) header: &'a [u8],
}

impl ArrivedReply<'_> {
    /// # Safety
    /// Inside an active-message handler installed with `arg` = the engine's
    /// `Events` (which outlives the worker); the other arguments are what
    /// UCX passed it, and the result is used only during that call.
    pub(super) unsafe fn read<'a>(
        arg: *mut c_void,
        header: *const c_void,
        header_length: usize,
        param: *const sys::ucp_am_recv_param_t,
    ) -> ArrivedReply<'a> {
        // SAFETY: `arg` is the engine's boxed `Events`, alive until after
        // the worker is destroyed.
        let events = unsafe { &*arg.cast::<Events>() };
        // SAFETY: UCX passes a valid parameter record for the call's
        // duration.
        let param = unsafe { &*param };
        ArrivedReply {
            events,
            rendezvous: param.recv_attr & u64::from(sys::UCP_AM_RECV_ATTR_FLAG_RNDV) != 0,
            arrived_on: reply_endpoint(param),
            // SAFETY: what UCX passed this handler, used only during it.
            header: unsafe { handler_header(header, header_length) },
        }
    }
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
            events.dropped_message();
            None
        }
        None => None,
    }
}

/// A rendezvous receive into a destination ended.
pub(super) unsafe extern "C" fn on_receive_done(
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
