//! UCX's callbacks for a consumer's read: reply, rendezvous and send done.
//!
//! Which reply may write a read's destination, and when the read completes,
//! is the engine kit's consumer machine's to decide
//! (`rdmareg_engine::served::consumer`): a reply counts only from the
//! endpoint its request went out on, once, with the read's own length; a
//! read completes only once UCX let go of its destination. These callbacks
//! feed it what UCX reports and do what it decides.

use std::ffi::c_void;

use rdmareg_core::RdmaError;
use ucx_sys as sys;

use rdmareg_engine::served::Operation;
use rdmareg_engine::served::consumer::{DropReason, ReadId, Reply, ReplyOutcome, ReplyVerdict};
use rdmareg_engine::served::wire::is_write_request_id;

use super::events::Events;
use super::ops::{GetOp, Phase};
use super::ucp::{handler_header, receive_rendezvous};
use crate::read_protocol::{ReadReply, ReplyStatus};
use crate::status::{PtrStatus, status_text};

/// The error a read gets when UCX ended it with `status` (the consumer
/// machine turns it into `Timeout` for a read past its deadline).
pub(super) fn failure(op: &GetOp, events: &Events, status: sys::ucs_status_t) -> RdmaError {
    if events.tearing_down.get() {
        RdmaError::ShuttingDown
    } else {
        RdmaError::backend(format!(
            "ucx: read from {} failed: {}",
            op.peer,
            status_text(status)
        ))
    }
}

/// A reply header as the consumer machine takes it.
pub(super) fn machine_reply(request_id: u64, status: ReplyStatus, length: u64) -> Reply {
    let outcome = match status {
        ReplyStatus::Served => ReplyOutcome::Served { length },
        ReplyStatus::Refused(refusal) => {
            tracing::debug!(request_id, %refusal, "the owner refused a read");
            ReplyOutcome::Refused(refusal.into())
        }
    };
    Reply {
        request_id,
        outcome,
    }
}

/// Writes the payload of `read` (whose op is `op`, accepted by the consumer
/// machine) into its destination: copies it (eager), or starts a rendezvous
/// receive straight into the destination; reports the end to the machine.
///
/// # Safety
/// Inside a reply handler on the worker's thread; `op` is active and the
/// machine just accepted the reply for it (so no other reply can reach
/// it); `data`/`length`/`rendezvous` are what UCX passed, and `length` is
/// the read's length (the machine checked it).
unsafe fn write_reply(
    events: &Events,
    read: ReadId,
    op: *mut GetOp,
    data: *mut c_void,
    length: usize,
    rendezvous: bool,
) {
    // SAFETY: the caller's contract: the op is active and only this
    // callback touches it now.
    let op_ref = unsafe { &mut *op };
    let outcome = if rendezvous {
        let worker = events.worker.get();
        let Some(memh) = op_ref.memh.filter(|_| !worker.is_null()) else {
            events
                .consumer
                .borrow_mut()
                .released(read, Err(RdmaError::ShuttingDown));
            return;
        };
        // SAFETY: inside the worker's progress; `data` is the rendezvous
        // descriptor of exactly `op.len` bytes (checked by the machine);
        // `[dest, dest + len)` was checked against the mapped region `memh`
        // when the read was posted and is held (an unmap waits) until the
        // loop sees this op finished; the slot outlives the receive.
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
    } else {
        if length > 0 {
            // SAFETY: eager data: `length` (== op.len) readable bytes at
            // `data` for the handler's duration; the destination is checked
            // and held as above, and nothing else writes it while the
            // machine holds the read.
            unsafe { std::ptr::copy_nonoverlapping(data.cast::<u8>(), op_ref.dest, length) };
        }
        Ok(())
    };
    events.consumer.borrow_mut().released(read, outcome);
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
    if is_write_request_id(reply.request_id) {
        let reply = Reply {
            request_id: reply.request_id,
            outcome: match reply.status {
                ReplyStatus::Served => ReplyOutcome::Served {
                    length: reply.length,
                },
                ReplyStatus::Refused(refusal) => {
                    ReplyOutcome::Refused(refusal.error_for(Operation::Write))
                }
            },
        };
        // A write's reply carries no payload; whatever came with one is
        // dropped (for a rendezvous, UCX tells the sender).
        if let Err(reason) =
            events
                .writer
                .borrow_mut()
                .handle_reply(arrived_on as usize, &reply, length as u64)
        {
            tracing::debug!(?reason, "dropped a write reply");
            events.dropped_message();
        }
        return sys::UCS_OK;
    }
    let reply = machine_reply(reply.request_id, reply.status, reply.length);
    let verdict =
        events
            .consumer
            .borrow_mut()
            .handle_reply(arrived_on as usize, &reply, length as u64);
    match verdict {
        ReplyVerdict::Write(read) => {
            if let Some(op) = events.op_of(read) {
                // SAFETY: the machine holds the read, so its op is active;
                // it just accepted this reply, the only one that reaches it.
                unsafe { write_reply(events, read, op, data, length, rendezvous) };
            }
        }
        ReplyVerdict::Drop(DropReason::WrongEndpoint) => events.dropped_message(),
        // A reply nobody waits for any more (deadline, closed endpoint) is
        // dropped; for a rendezvous, UCX tells the sender to stop.
        ReplyVerdict::Drop(DropReason::NotAwaited) | ReplyVerdict::Refused(_) => {}
    }
    events.complete_reads();
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
    let read = op.read;
    events.consumer.borrow_mut().released(read, outcome);
    events.complete_reads();
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
