//! The owner's side of a served write, driven by the engine kit's owner.
//!
//! A write request is an active message whose header is the kit's write
//! request and whose payload is the bytes to write. The kit's owner admits
//! it (`rdmareg_engine::served::owner::writes`): registration, capability,
//! write access, not unmapping, range, payload length, the connection's
//! bound. What is UCX's:
//!
//! - The payload is at hand only during the handler, and is copied into
//!   the registration there: a write is answered and its hold ended
//!   before the handler returns, so no receive is left pending on a
//!   writer. A rendezvous write is refused (`Malformed`) without receiving
//!   a byte: a writer whose endpoint has no peer error handling and that
//!   vanished mid-rendezvous would leave the receive, and the region's
//!   hold, pending until the owner's teardown (UCX cannot cancel it).
//!   This engine's writers send eager chunks (`puts`).
//! - A refused write's payload is never touched: the handler returns and
//!   UCX drops it.
//! - The reply goes back on the endpoint the request came on, inside the
//!   handler.
//! - A write list (`WRITE_LIST_REQUEST_AM_ID`) is handled the same way:
//!   each accepted entry is copied from its place in the payload, and the
//!   list's reply (`WRITE_LIST_REPLY_AM_ID`) goes out once the last copy
//!   ended, still inside the handler: in several replies, in order, when
//!   one header within this worker's bound cannot name every entry.

use std::ffi::c_void;

use rdmareg_engine::served::{ReceiveId, Refusal, WriteListLimits, wire};
use ucx_sys as sys;

use super::events::Events;
use super::serve::{perform_actions, reply_endpoint};
use super::ucp::handler_header;
use crate::read_list::{REPLY_ENTRY_LEN, entries_within};

/// The payload of the write request whose handler is running.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WritePayload {
    data: *mut c_void,
    length: usize,
}

/// What both write handlers read first from UCX's arguments.
struct ArrivedWrite<'a> {
    events: &'a Events,
    /// The endpoint to reply on (`reply_ep`), as the owner names it.
    endpoint: usize,
    header: &'a [u8],
    /// The payload waits for a rendezvous receive (else it is at hand).
    rendezvous: bool,
}

impl<'a> ArrivedWrite<'a> {
    /// Reads a write handler's arguments; `None` (counted as dropped) for a
    /// message without a reply endpoint.
    ///
    /// # Safety
    /// UCX's arguments to a handler installed with `arg` = the engine's
    /// `Events`, which outlives the worker; used only during the handler.
    unsafe fn read(
        arg: *mut c_void,
        header: *const c_void,
        header_length: usize,
        param: *const sys::ucp_am_recv_param_t,
    ) -> Option<ArrivedWrite<'a>> {
        // SAFETY: `arg` is the engine's boxed `Events`, alive until after
        // the worker is destroyed.
        let events = unsafe { &*arg.cast::<Events>() };
        // SAFETY: UCX passes a valid parameter record for the call's
        // duration.
        let param = unsafe { &*param };
        let Some(reply_ep) = reply_endpoint(param) else {
            events.dropped_message();
            return None;
        };
        // SAFETY: what UCX passed this handler, used only during it.
        let header = unsafe { handler_header(header, header_length) };
        events.handed_off();
        super::leases::give_time(events);
        Some(ArrivedWrite {
            events,
            endpoint: reply_ep as usize,
            header,
            rendezvous: param.recv_attr & u64::from(sys::UCP_AM_RECV_ATTR_FLAG_RNDV) != 0,
        })
    }

    /// Hands the eager payload at `data` to the owner's receives for the
    /// duration of `judge`, then performs every action the owner queued.
    ///
    /// # Safety
    /// Inside the handler that read this, on the worker's thread, with
    /// UCX's `data` and `length` of it.
    unsafe fn receive(&self, data: *mut c_void, length: usize, judge: impl FnOnce(&Events)) {
        self.events
            .write_payload
            .set(Some(WritePayload { data, length }));
        judge(self.events);
        // SAFETY: inside the handler that handed over `reply_ep` and the
        // payload, on the worker's thread (the caller's contract).
        unsafe { perform_actions(self.events) };
        // A payload not received (a refused write) is dropped by UCX.
        self.events.write_payload.set(None);
    }

    /// Performs the owner's refusals of a rendezvous write, whose payload
    /// is never received.
    ///
    /// # Safety
    /// As for [`ArrivedWrite::receive`].
    unsafe fn refuse(&self, judge: impl FnOnce(&Events)) {
        judge(self.events);
        // SAFETY: inside the handler that handed over `reply_ep`, on the
        // worker's thread (the caller's contract).
        unsafe { perform_actions(self.events) };
    }
}

/// UCX's handler for a write request (`WRITE_REQUEST_AM_ID`).
///
/// # Safety
/// Installed with `arg` = the engine's `Events`, which outlives the worker.
pub(super) unsafe extern "C" fn on_write_request(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: UCX's arguments to this handler, installed with the engine's
    // `Events` as `arg`.
    let Some(arrived) = (unsafe { ArrivedWrite::read(arg, header, header_length, param) }) else {
        return sys::UCS_OK;
    };
    let (endpoint, header) = (arrived.endpoint, arrived.header);
    if arrived.rendezvous {
        // SAFETY: inside this handler, on the worker's thread.
        unsafe {
            arrived.refuse(|events| {
                let mut owner = events.owner.borrow_mut();
                match wire::decode_write_request(header) {
                    Ok(write) => {
                        owner.refuse_request(endpoint, write.request_id, Refusal::Malformed)
                    }
                    Err(_) => {
                        owner.handle_malformed(endpoint, wire::request_id_of_malformed(header))
                    }
                }
            })
        };
    } else {
        // SAFETY: inside this handler, on the worker's thread, with UCX's
        // eager payload.
        unsafe {
            arrived.receive(data, length, |events| {
                events
                    .owner
                    .borrow_mut()
                    .handle_write_request(endpoint, header, length as u64)
            })
        };
    }
    sys::UCS_OK
}

/// UCX's handler for a write list (`WRITE_LIST_REQUEST_AM_ID`): as a
/// single write's, for every entry, and one reply for the list. A
/// rendezvous list has every entry refused (`Malformed`) without receiving
/// a byte, for the reason a rendezvous write is.
///
/// # Safety
/// Installed with `arg` = the engine's `Events`, which outlives the worker.
pub(super) unsafe extern "C" fn on_write_list_request(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: UCX's arguments to this handler, installed with the engine's
    // `Events` as `arg`.
    let Some(arrived) = (unsafe { ArrivedWrite::read(arg, header, header_length, param) }) else {
        return sys::UCS_OK;
    };
    let (endpoint, header) = (arrived.endpoint, arrived.header);
    let limits = WriteListLimits {
        // Each reply's header must fit this worker's bound on one.
        entries_per_reply: entries_within(arrived.events.max_am_header.get(), REPLY_ENTRY_LEN),
        ..WriteListLimits::default()
    };
    if arrived.rendezvous {
        // SAFETY: inside this handler, on the worker's thread.
        unsafe {
            arrived.refuse(|events| match wire::decode_write_list_request(header) {
                Ok(entries) => events.owner.borrow_mut().refuse_write_list(
                    endpoint,
                    &entries,
                    Refusal::Malformed,
                    limits,
                ),
                // No request ids to trust: the owner drops it (it decodes
                // the header again and receives nothing).
                Err(_) => events
                    .owner
                    .borrow_mut()
                    .handle_write_list_request(endpoint, header, 0, limits),
            })
        };
    } else {
        // SAFETY: inside this handler, on the worker's thread, with UCX's
        // eager payload.
        unsafe {
            arrived.receive(data, length, |events| {
                events.owner.borrow_mut().handle_write_list_request(
                    endpoint,
                    header,
                    length as u64,
                    limits,
                )
            })
        };
    }
    sys::UCS_OK
}

/// Performs `Action::Receive`: copies `length` bytes from `payload_offset`
/// into the running handler's payload to `[address, address + length)`.
///
/// # Safety
/// On the worker's thread, inside the write handler whose payload
/// `events.write_payload` holds; the owner admitted the write, so the
/// range lies inside a registration that stays mapped while the receive
/// holds it (the loop unmaps only after `Action::Unmapped`, which comes
/// after the receive ended).
pub(super) unsafe fn receive_payload(
    events: &Events,
    receive: ReceiveId,
    address: u64,
    length: u64,
    payload_offset: u64,
) {
    let within = |payload: &WritePayload| {
        payload_offset
            .checked_add(length)
            .is_some_and(|end| end <= payload.length as u64)
            && (length == 0 || !payload.data.is_null())
    };
    let Some(payload) = events.write_payload.get().filter(within) else {
        // Only a write handler admits writes, with its payload at hand,
        // and the owner admits only entries inside it.
        tracing::error!(
            receive = receive.0,
            "a write was admitted without its payload"
        );
        events.owner.borrow_mut().receive_failed(receive);
        return;
    };
    if length > 0 {
        // SAFETY: eager data: `payload.length` readable bytes at `data`
        // for the handler's duration, and `[payload_offset, payload_offset
        // + length)` inside them (checked above); the destination is
        // inside the admitted registration (the caller's contract), and
        // peers' bytes never alias the handler's buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(
                payload.data.cast::<u8>().add(payload_offset as usize),
                address as *mut u8,
                length as usize,
            )
        };
    }
    events.owner.borrow_mut().receive_completed(receive);
}
