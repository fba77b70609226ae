//! The owner's side of a served read, driven by the engine kit's owner.
//!
//! UCX's request handlers feed the [`Owner`](rdmareg_engine::served::Owner)
//! each request, and its actions become active-message replies. Admission,
//! read leases, the reply bound per connection and unmaps that wait for
//! leases are the kit's (`rdmareg_engine::served::owner`). What is UCX's:
//!
//! - A connection is the address of the endpoint UCX hands the request
//!   handler (`reply_ep`). The reply goes back on it with the reply flag, so
//!   the owner needs no endpoint of its own. UCX fails an endpoint's sends
//!   before it frees it, so an address names a later connection only once
//!   the earlier one's replies ended.
//! - Actions run inside the handler that caused them, while its `reply_ep`
//!   is valid. Each is taken out before it runs and no `RefCell` borrow is
//!   held across a send, because over loopback UCX can run another handler
//!   inside the send.
//! - A send's end is reported to the owner, which only then ends its
//!   lease. `Action::Unmapped` is left to the loop (`Events::unmapped`).

use std::ffi::c_void;
use std::ptr;

use rdmareg_engine::served::{Action, Payload, SendId};
use ucx_sys as sys;

use super::events::Events;
use super::read_lists::copied_on_this_lane;
use super::ucp::{MemHandle, SendMode, handler_header, send_active_message, send_gathered};
use crate::read_list::READ_LIST_REPLY_AM_ID;
use crate::read_protocol::{READ_REPLY_AM_ID, WRITE_LIST_REPLY_AM_ID};
use crate::status::PtrStatus;

/// Replies from this size on name their registration, so UCX can send them
/// zero-copy (rendezvous) without registering them again; smaller ones are
/// copied into the send (eager), where naming it only costs time.
pub(super) const ZERO_COPY_FROM: u64 = 16 * 1024;

/// Replies up to this size also ask UCX for fast completion, which copies
/// them into one short send (see [`SendMode::Small`]); above one page the
/// hint makes UCX fragment the copy.
pub(super) const SMALL_UP_TO: u64 = 4 * 1024;

/// How a served reply of `length` bytes inside `memh` is sent.
fn reply_mode(length: u64, memh: Option<MemHandle>) -> SendMode {
    match memh {
        Some(memh) if length >= ZERO_COPY_FROM => SendMode::Registered(memh),
        _ if length <= SMALL_UP_TO => SendMode::Small,
        _ => SendMode::Eager,
    }
}

/// What a reply send holds until it ends: the owner's name for it, and for
/// a list reply the vector UCX reads the payload through.
struct ReplySend {
    events: *const Events,
    send: SendId,
    iov: Vec<sys::ucp_dt_iov_t>,
}

/// The endpoint to reply to a request on, or `None` for a request sent
/// without the reply flag.
pub(super) fn reply_endpoint(param: &sys::ucp_am_recv_param_t) -> Option<sys::ucp_ep_h> {
    let has_reply_ep = param.recv_attr & u64::from(sys::UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0;
    (has_reply_ep && !param.reply_ep.is_null()).then_some(param.reply_ep)
}

/// Whether list replies are cut to one tcp fragment each (`read_lists`).
///
/// Decided once per engine from its settings, never by asking UCX about the
/// endpoint a request came on: see `UcxSettings::every_lane_is_tcp`.
pub(super) fn one_fragment_each(events: &Events) -> bool {
    events.fragment_sized_replies.get() && events.every_lane_is_tcp.get()
}

/// UCX's handler for a read request (`READ_REQUEST_AM_ID`).
///
/// # Safety
/// Installed with `arg` = the engine's `Events`, which outlives the worker.
pub(super) unsafe extern "C" fn on_read_request(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    _data: *mut c_void,
    _length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: `arg` is the engine's boxed `Events` (see `Engine::start`),
    // alive until after the worker is destroyed.
    let events = unsafe { &*arg.cast::<Events>() };
    // SAFETY: UCX passes a valid parameter record for the call's duration.
    let Some(reply_ep) = reply_endpoint(unsafe { &*param }) else {
        events.dropped_message();
        return sys::UCS_OK;
    };
    // SAFETY: what UCX passed this handler, used only during it.
    let header = unsafe { handler_header(header, header_length) };
    // Whatever goes back, the consumer moves next.
    events.handed_off();
    super::leases::give_time(events);
    events
        .owner
        .borrow_mut()
        .handle_request(reply_ep as usize, header);
    // SAFETY: inside the handler that handed over `reply_ep`, on the
    // worker's thread.
    unsafe { perform_actions(events) };
    sys::UCS_OK
}

/// Performs every action the owner has queued: replies are sent, unmaps
/// left to the loop.
///
/// # Safety
/// On the worker's thread. Every reply the owner has queued names the
/// `reply_ep` of a request handler that is still running (handlers perform
/// their actions before they return, so outside one none is queued).
pub(super) unsafe fn perform_actions(events: &Events) {
    // The owner counted the leases of the queued replies when it decided
    // them; publish that before any goes out, so a peer that already holds
    // a reply never reads a gauge that misses it.
    events.publish_served_gauge();
    loop {
        // The borrow ends before anything is sent.
        let action = events.owner.borrow_mut().poll_action();
        let Some(action) = action else { break };
        match action {
            Action::Receive {
                receive,
                address,
                length,
                payload_offset,
                ..
            } => {
                // SAFETY: a receive is admitted only by a write handler,
                // which performs its actions before it returns (the
                // caller's contract), with its payload still at hand; the
                // owner checked the range inside its registration.
                unsafe {
                    super::serve_writes::receive_payload(
                        events,
                        receive,
                        address,
                        length,
                        payload_offset,
                    )
                };
            }
            Action::AcknowledgeList { endpoint, send, .. } => {
                let header = action.list_reply_header().unwrap_or_default();
                // SAFETY: `endpoint` is a live `reply_ep` (the caller's
                // contract); the reply carries no payload.
                unsafe {
                    send_reply(
                        events,
                        endpoint as sys::ucp_ep_h,
                        send,
                        WRITE_LIST_REPLY_AM_ID,
                        &header,
                        Shape::One {
                            mode: SendMode::Small,
                            payload: ptr::null(),
                            len: 0,
                        },
                        Vec::new(),
                    );
                }
            }
            Action::Serve { endpoint, send, .. }
            | Action::Refuse { endpoint, send, .. }
            | Action::Acknowledge { endpoint, send, .. } => {
                let header = action.reply_header().unwrap_or_default();
                let shape = match action {
                    Action::Serve { payload, .. } => Shape::One {
                        mode: reply_mode(
                            payload.length,
                            events.served_memh.borrow().get(&payload.region).copied(),
                        ),
                        payload: payload.address as *const u8,
                        len: payload.length as usize,
                    },
                    _ => Shape::One {
                        mode: SendMode::Small,
                        payload: ptr::null(),
                        len: 0,
                    },
                };
                // SAFETY: `endpoint` is a live `reply_ep` (the caller's
                // contract). A served payload lies inside the registration
                // the owner admitted it against, which stays mapped while
                // the owner holds the send's lease: the loop unmaps only
                // after `Action::Unmapped`, which comes after this send
                // ended. A refusal carries no payload.
                unsafe {
                    send_reply(
                        events,
                        endpoint as sys::ucp_ep_h,
                        send,
                        READ_REPLY_AM_ID,
                        &header,
                        shape,
                        Vec::new(),
                    );
                }
            }
            Action::ServeList {
                endpoint,
                send,
                ref entry_replies,
            } => {
                let ep = endpoint as sys::ucp_ep_h;
                let header = action.list_reply_header().unwrap_or_default();
                let served: Vec<Payload> = entry_replies
                    .iter()
                    .filter_map(|a| a.outcome.ok())
                    .collect();
                let payload: u64 = served.iter().map(|p| p.length).sum();
                let copied =
                    copied_on_this_lane(events, header.len() as u64, payload, served.len());
                // SAFETY: as for a single reply, for every range.
                unsafe {
                    send_reply(
                        events,
                        ep,
                        send,
                        READ_LIST_REPLY_AM_ID,
                        &header,
                        Shape::Vector { copied },
                        payload_ranges(&served),
                    );
                }
            }
            Action::Unmapped { region } => events.unmapped.borrow_mut().push(region),
            _ => {}
        }
    }
    events.publish_served_gauge();
}

/// The ranges a reply's payload is read from.
fn payload_ranges(served: &[Payload]) -> Vec<sys::ucp_dt_iov_t> {
    served
        .iter()
        .map(|p| sys::ucp_dt_iov_t {
            buffer: p.address as *mut c_void,
            length: p.length as usize,
        })
        .collect()
}

/// How a reply's payload goes.
enum Shape {
    /// One range (`len` may be 0), with the protocols `mode` allows.
    One {
        mode: SendMode,
        payload: *const u8,
        len: usize,
    },
    /// The record's vector (`send_gathered`), copied into UCX's segments
    /// or not.
    Vector { copied: bool },
}

/// Sends one reply and reports its end to the owner: at once when UCX
/// ended it inside the call, else from its callback.
///
/// # Safety
/// On the worker's thread; `ep` is a live endpoint of the worker; every
/// range `shape` and `iov` name stays readable (registered by the handle
/// `shape` names, if any) until the owner is told the send `send` ended.
unsafe fn send_reply(
    events: &Events,
    ep: sys::ucp_ep_h,
    send: SendId,
    am_id: u32,
    header: &[u8],
    shape: Shape,
    iov: Vec<sys::ucp_dt_iov_t>,
) {
    let record = Box::into_raw(Box::new(ReplySend { events, send, iov }));
    // SAFETY: the caller's contract; a vector lives in `record`, which
    // lives until the send ends.
    let status = unsafe {
        match shape {
            Shape::Vector { copied } => send_gathered(
                ep,
                am_id,
                header,
                &(*record).iov,
                copied,
                on_reply_sent,
                record.cast::<c_void>(),
            ),
            Shape::One { mode, payload, len } => send_active_message(
                ep,
                am_id,
                header,
                payload,
                len,
                mode,
                true,
                on_reply_sent,
                record.cast::<c_void>(),
            ),
        }
    };
    match status {
        PtrStatus::Pending(_) => {
            events.reply_records.borrow_mut().insert(record as usize);
        }
        ended => {
            // No callback will run.
            // SAFETY: made by Box::into_raw above and not handed to UCX any
            // more.
            drop(unsafe { Box::from_raw(record) });
            let mut owner = events.owner.borrow_mut();
            match ended {
                PtrStatus::Failed(_) => owner.send_failed(send),
                _ => owner.send_completed(send),
            };
        }
    }
}

/// A reply's send ended: tell the owner, perform what follows (an unmap
/// it finished) and return the request.
unsafe extern "C" fn on_reply_sent(
    request: *mut c_void,
    status: sys::ucs_status_t,
    user_data: *mut c_void,
) {
    // SAFETY: `user_data` is the `ReplySend` boxed for this very send; this
    // callback runs once per send, so it is reclaimed once.
    let record = unsafe { Box::from_raw(user_data.cast::<ReplySend>()) };
    // SAFETY: the events record outlives the worker.
    let events = unsafe { &*record.events };
    events
        .reply_records
        .borrow_mut()
        .remove(&(user_data as usize));
    {
        let mut owner = events.owner.borrow_mut();
        if status == sys::UCS_OK {
            owner.send_completed(record.send);
        } else {
            owner.send_failed(record.send);
        }
    }
    // SAFETY: on the worker's thread; only replies of handlers still
    // running can be queued.
    unsafe { perform_actions(events) };
    // SAFETY: a completed request of this worker, returned once; UCX allows
    // freeing a request from its own completion callback.
    unsafe { sys::ucp_request_free(request) };
}

/// Frees the records of reply sends UCX never completed and tells the
/// owner the transport is gone. Returns how many there were.
///
/// # Safety
/// The worker the sends were posted on is destroyed: no callback of it can
/// run any more, so nothing else reclaims these records.
pub(super) unsafe fn close_owner(events: &Events) -> usize {
    events.owner.borrow_mut().transport_closed();
    events.publish_served_gauge();
    let records: Vec<usize> = events.reply_records.borrow_mut().drain().collect();
    for &record in &records {
        // SAFETY: every address in the set was made by `Box::into_raw` of a
        // `ReplySend` for a send whose callback never ran (a callback
        // removes its record before it reclaims it), and the worker is gone
        // (the caller's contract): reclaimed once, here.
        drop(unsafe { Box::from_raw(record as *mut ReplySend) });
    }
    records.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_replies_are_copied_mid_sized_left_to_ucx_large_ones_named() {
        let memh = Some(MemHandle::dangling_for_tests());
        assert!(matches!(reply_mode(8, memh), SendMode::Small));
        assert!(matches!(reply_mode(SMALL_UP_TO, memh), SendMode::Small));
        assert!(matches!(reply_mode(SMALL_UP_TO + 1, memh), SendMode::Eager));
        assert!(matches!(
            reply_mode(ZERO_COPY_FROM - 1, memh),
            SendMode::Eager
        ));
        assert!(matches!(
            reply_mode(ZERO_COPY_FROM, memh),
            SendMode::Registered(_)
        ));
        assert!(matches!(reply_mode(ZERO_COPY_FROM, None), SendMode::Eager));
    }
}
