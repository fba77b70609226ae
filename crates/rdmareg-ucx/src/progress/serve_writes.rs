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
    // SAFETY: `arg` is the engine's boxed `Events`, alive until after the
    // worker is destroyed.
    let events = unsafe { &*arg.cast::<Events>() };
    // SAFETY: UCX passes a valid parameter record for the call's duration.
    let param = unsafe { &*param };
    let Some(reply_ep) = reply_endpoint(param) else {
        events.dropped_message();
        return sys::UCS_OK;
    };
    // SAFETY: what UCX passed this handler, used only during it.
    let header = unsafe { handler_header(header, header_length) };
    events.handed_off();
    super::leases::give_time(events);
    let rendezvous = param.recv_attr & u64::from(sys::UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    if rendezvous {
        let mut owner = events.owner.borrow_mut();
        match wire::decode_write_request(header) {
            Ok(write) => {
                owner.refuse_request(reply_ep as usize, write.request_id, Refusal::Malformed)
            }
            Err(_) => {
                owner.handle_malformed(reply_ep as usize, wire::request_id_of_malformed(header))
            }
        }
    } else {
        events
            .write_payload
            .set(Some(WritePayload { data, length }));
        events
            .owner
            .borrow_mut()
            .handle_write_request(reply_ep as usize, header, length as u64);
    }
    // SAFETY: inside the handler that handed over `reply_ep` and the
    // payload, on the worker's thread.
    unsafe { perform_actions(events) };
    // A payload not received (a refused write) is dropped by UCX.
    events.write_payload.set(None);
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
    // SAFETY: `arg` is the engine's boxed `Events`, alive until after the
    // worker is destroyed.
    let events = unsafe { &*arg.cast::<Events>() };
    // SAFETY: UCX passes a valid parameter record for the call's duration.
    let param = unsafe { &*param };
    let Some(reply_ep) = reply_endpoint(param) else {
        events.dropped_message();
        return sys::UCS_OK;
    };
    // SAFETY: what UCX passed this handler, used only during it.
    let header = unsafe { handler_header(header, header_length) };
    events.handed_off();
    super::leases::give_time(events);
    let limits = WriteListLimits {
        // Each reply's header must fit this worker's bound on one.
        entries_per_reply: entries_within(events.max_am_header.get(), REPLY_ENTRY_LEN),
        ..WriteListLimits::default()
    };
    let rendezvous = param.recv_attr & u64::from(sys::UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    let endpoint = reply_ep as usize;
    match wire::decode_write_list_request(header) {
        Ok(entries) if rendezvous => {
            events.owner.borrow_mut().refuse_write_list(
                endpoint,
                &entries,
                Refusal::Malformed,
                limits,
            );
        }
        _ => {
            events
                .write_payload
                .set(Some(WritePayload { data, length }));
            events.owner.borrow_mut().handle_write_list_request(
                endpoint,
                header,
                length as u64,
                limits,
            );
        }
    }
    // SAFETY: inside the handler that handed over `reply_ep` and the
    // payload, on the worker's thread.
    unsafe { perform_actions(events) };
    events.write_payload.set(None);
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
