//! The owner's side of a served write, driven by the engine kit's owner.
//!
//! A write request is an active message whose header is the kit's write
//! request and whose payload is the bytes to write. The kit's owner admits
//! it (`rdmareg_engine::served::owner::writes`): registration, capability,
//! write access, not unmapping, range, payload length, the connection's
//! bound. What is UCX's:
//!
//! - The payload is at hand only during the handler: an eager one is
//!   copied into the registration there; a rendezvous one is received
//!   straight into the registration (`ucp_am_recv_data_nbx`, with the
//!   registration's memory handle). A refused write's payload is never
//!   touched: the handler returns and UCX drops it (for a rendezvous, UCX
//!   tells the sender).
//! - The write holds its region from its admission until the receive ended
//!   (the owner's count an unmap waits for), and its reply, sent only after
//!   the bytes are in, goes back on the endpoint the request came on.
//! - A rendezvous receive that fails ends the endpoint's place at the owner
//!   without a reply: UCX fails it when the connection is gone, and nothing
//!   more is sent on such an endpoint.

use std::cell::Cell;
use std::ffi::c_void;

use rdmareg_engine::served::ReceiveId;
use ucx_sys as sys;

use super::events::Events;
use super::serve::{perform_actions, reply_endpoint};
use super::ucp::{handler_header, receive_rendezvous};
use crate::status::PtrStatus;

/// The payload of the write request whose handler is running.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WritePayload {
    data: *mut c_void,
    length: usize,
    rendezvous: bool,
}

/// What a rendezvous receive of a write holds until it ends.
struct WriteReceive {
    events: *const Events,
    receive: ReceiveId,
    endpoint: usize,
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
    let payload = WritePayload {
        data,
        length,
        rendezvous: param.recv_attr & u64::from(sys::UCP_AM_RECV_ATTR_FLAG_RNDV) != 0,
    };
    events.write_payload.set(Some(payload));
    events
        .owner
        .borrow_mut()
        .handle_write_request(reply_ep as usize, header, length as u64);
    // SAFETY: inside the handler that handed over `reply_ep` and the
    // payload, on the worker's thread.
    unsafe { perform_actions(events) };
    // A payload not received (a refused write) is dropped by UCX.
    events.write_payload.set(None);
    sys::UCS_OK
}

/// Performs `Action::Receive`: puts the running handler's payload into
/// `[address, address + length)` of `region`, or starts receiving it there.
///
/// # Safety
/// On the worker's thread, inside the write handler whose payload
/// `events.write_payload` holds; the owner admitted the write, so the
/// range lies inside `region`, which stays mapped while the receive holds
/// it (the loop unmaps only after `Action::Unmapped`, which comes after the
/// receive ended).
pub(super) unsafe fn receive_payload(
    events: &Events,
    endpoint: usize,
    receive: ReceiveId,
    region: u64,
    address: u64,
    length: u64,
) {
    let payload = take_payload(&events.write_payload);
    let Some(payload) = payload.filter(|payload| payload.length as u64 == length) else {
        // Only a write handler admits writes, with its payload at hand.
        tracing::error!(
            receive = receive.0,
            "a write was admitted without its payload"
        );
        events.owner.borrow_mut().receive_failed(receive);
        return;
    };
    let dest = address as *mut u8;
    if !payload.rendezvous {
        if length > 0 {
            // SAFETY: eager data: `length` readable bytes at `data` for the
            // handler's duration; the destination is inside the admitted
            // registration (the caller's contract), which no other write
            // reaches meanwhile but through its own receive.
            unsafe {
                std::ptr::copy_nonoverlapping(payload.data.cast::<u8>(), dest, payload.length)
            };
        }
        events.owner.borrow_mut().receive_completed(receive);
        return;
    }
    let memh = events.served_memh.borrow().get(&region).copied();
    let worker = events.worker.get();
    let Some(memh) = memh.filter(|_| !worker.is_null()) else {
        events.owner.borrow_mut().receive_failed(receive);
        return;
    };
    let record = Box::into_raw(Box::new(WriteReceive {
        events,
        receive,
        endpoint,
    }));
    // SAFETY: inside the worker's progress; `data` is the rendezvous
    // descriptor of exactly `length` bytes (the owner checked the length);
    // the destination lies inside the registration `memh`, held until this
    // receive ends; `record` lives until the callback or teardown.
    let status = unsafe {
        receive_rendezvous(
            worker,
            payload.data,
            dest,
            payload.length,
            memh,
            on_write_received,
            record.cast::<c_void>(),
        )
    };
    match status {
        PtrStatus::Pending(_) => {
            events.write_receives.borrow_mut().insert(record as usize);
        }
        ended => {
            // SAFETY: made by Box::into_raw above; no callback will run.
            drop(unsafe { Box::from_raw(record) });
            let mut owner = events.owner.borrow_mut();
            match ended {
                PtrStatus::Failed(_) => {
                    owner.endpoint_failed(endpoint);
                    owner.receive_failed(receive);
                }
                _ => {
                    owner.receive_completed(receive);
                }
            }
        }
    }
}

fn take_payload(slot: &Cell<Option<WritePayload>>) -> Option<WritePayload> {
    slot.take()
}

/// A write's rendezvous receive ended: the owner answers the write (after
/// a failed receive it sends nothing on that endpoint again).
unsafe extern "C" fn on_write_received(
    request: *mut c_void,
    status: sys::ucs_status_t,
    _length: usize,
    user_data: *mut c_void,
) {
    // SAFETY: `user_data` is the `WriteReceive` boxed for this receive;
    // this callback runs once per receive, so it is reclaimed once.
    let record = unsafe { Box::from_raw(user_data.cast::<WriteReceive>()) };
    // SAFETY: the events record outlives the worker.
    let events = unsafe { &*record.events };
    events
        .write_receives
        .borrow_mut()
        .remove(&(user_data as usize));
    {
        let mut owner = events.owner.borrow_mut();
        if status == sys::UCS_OK {
            owner.receive_completed(record.receive);
        } else {
            owner.endpoint_failed(record.endpoint);
            owner.receive_failed(record.receive);
        }
    }
    // SAFETY: on the worker's thread. The acknowledgement goes on the
    // endpoint this receive completed on, inside the same progress call;
    // after a failed receive the owner queues nothing for it.
    unsafe { perform_actions(events) };
    if !request.is_null() {
        // SAFETY: a completed request of this worker, returned once.
        unsafe { sys::ucp_request_free(request) };
    }
}

/// Frees the records of write receives UCX never completed. Returns how
/// many there were.
///
/// # Safety
/// The worker is destroyed: no callback of it can run any more.
pub(super) unsafe fn close_write_receives(events: &Events) -> usize {
    let records = std::mem::take(&mut *events.write_receives.borrow_mut());
    for &record in &records {
        // SAFETY: each address is a `WriteReceive` from Box::into_raw whose
        // callback never ran (it removes its own address first).
        drop(unsafe { Box::from_raw(record as *mut WriteReceive) });
    }
    records.len()
}
