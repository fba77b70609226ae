//! The owner's side of a read: check each request against the live
//! registrations, lease the region while its bytes are being sent, refuse
//! everything else.
//!
//! # Rules
//!
//! - A request is served only if it names a registration this engine holds
//!   (region id), proves it was given that registration's descriptor (the
//!   capability), the registration is not being unmapped, and
//!   `[address, address + length)` lies inside the pointer and length that
//!   were mapped. Anything else gets a typed refusal and not one byte. The
//!   reason: the key bytes and addresses come from peers, and UCX itself
//!   checks nothing on these lanes.
//! - Serving takes a **read lease** on the region before the reply send
//!   starts; the lease ends when UCX reports the send complete or failed.
//!   An unmap waits for the region's leases (see `regions`), so
//!   `ucp_mem_unmap` — and with it the caller's permission to free — comes
//!   only after UCX stopped reading the bytes.
//! - The reply goes back on the endpoint UCX hands the handler
//!   (`reply_ep`), so an owner needs no endpoint of its own to its
//!   consumers and learns nothing but what they send. The reply carries
//!   the reply flag itself, so the consumer learns which of its endpoints
//!   it came in on and accepts it only for a read sent there.
//! - The handler runs inside the worker's progress and sends from there.
//!   It holds no `RefCell` borrow across the send: with a loopback transport
//!   the reply handler can run inside that very send.

use std::ffi::c_void;
use std::ptr;

use ucx_sys as sys;

use super::events::Events;
use super::ucp::{MemHandle, SendMode, handler_header, send_active_message};
use crate::read_protocol::{
    READ_REPLY_AM_ID, ReadReply, ReadRequest, RemoteRefusal, ReplyStatus, capabilities_match,
};

/// Replies from this size on name their registration, so UCX can send them
/// zero-copy (rendezvous) without registering them again; smaller ones are
/// copied into the send (eager), where naming it only costs time.
const ZERO_COPY_FROM: u64 = 16 * 1024;

/// Replies up to this size also ask UCX for fast completion, which makes it
/// copy them into one short send instead of picking zero-copy (see
/// [`SendMode::Small`]). Measured over tcp on loopback, interleaving the two
/// per read: 0.4–1.4 µs faster at 8 B–4 KiB; at 12 KiB, where the hint
/// makes UCX fragment the copy, 12 µs slower — hence the margin below tcp's
/// 8 KiB segment.
const SMALL_UP_TO: u64 = 4 * 1024;

/// How a served reply of `length` bytes inside `memh` is sent.
fn reply_mode(length: u64, memh: MemHandle) -> SendMode {
    if length >= ZERO_COPY_FROM {
        SendMode::Registered(memh)
    } else if length <= SMALL_UP_TO {
        SendMode::Small
    } else {
        SendMode::Eager
    }
}

/// A registration as the request handler sees it.
#[derive(Debug)]
pub(crate) struct ServedRegion {
    pub(crate) ptr: usize,
    pub(crate) len: usize,
    pub(crate) memh: MemHandle,
    pub(crate) capability: [u8; 16],
    /// Reply sends reading from the region that UCX has not finished.
    pub(crate) leases: u32,
    /// Set when an unmap was submitted: new reads are refused.
    pub(crate) closing: bool,
}

/// What a reply send's completion needs: where to report which lease ended.
struct Lease {
    events: *const Events,
    region_id: u64,
}

/// Checks `request` against `served` and, on success, takes a lease and
/// returns what to send.
pub(super) fn admit(
    events: &Events,
    request: &ReadRequest,
) -> Result<(usize, MemHandle), RemoteRefusal> {
    let mut served = events.served.borrow_mut();
    let region = served
        .get_mut(&request.key.region_id)
        .ok_or(RemoteRefusal::RegionUnknown)?;
    if !capabilities_match(&region.capability, &request.key.capability) {
        return Err(RemoteRefusal::CapabilityMismatch);
    }
    if region.closing {
        return Err(RemoteRefusal::Deregistering);
    }
    let start = region.ptr as u64;
    let end = start + region.len as u64;
    let inside = request.length > 0
        && request.address >= start
        && request
            .address
            .checked_add(request.length)
            .is_some_and(|last| last <= end);
    if !inside {
        return Err(RemoteRefusal::OutOfRange);
    }
    region.leases += 1;
    Ok((request.address as usize, region.memh))
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
    let param = unsafe { &*param };
    let has_reply_ep = param.recv_attr & u64::from(sys::UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0;
    if !has_reply_ep || param.reply_ep.is_null() {
        // Nobody to answer: a request sent without the reply flag.
        events
            .dropped_messages
            .set(events.dropped_messages.get() + 1);
        return sys::UCS_OK;
    }
    // SAFETY: what UCX passed this handler, used only during it.
    let header = unsafe { handler_header(header, header_length) };
    let decision = match ReadRequest::decode(header) {
        Ok(request) => match admit(events, &request) {
            Ok((address, memh)) => Ok((request, address, memh)),
            Err(refusal) => Err((request.request_id, refusal)),
        },
        // Echo what looks like the id so the consumer can fail the right
        // read; a consumer that sent garbage gets what it sent.
        Err(_) => Err((
            header
                .get(4..12)
                .and_then(|b| b.try_into().ok())
                .map(u64::from_le_bytes)
                .unwrap_or(0),
            RemoteRefusal::Malformed,
        )),
    };
    match decision {
        Ok((request, address, memh)) => {
            let reply = ReadReply {
                request_id: request.request_id,
                status: ReplyStatus::Served,
                length: request.length,
            };
            let lease = Box::into_raw(Box::new(Lease {
                events,
                region_id: request.key.region_id,
            }));
            // SAFETY: on this worker's thread, inside its progress;
            // `reply_ep` is the live endpoint UCX just handed us. The
            // payload lies inside the registration `memh` (checked by
            // `admit`) and stays registered while the lease taken there is
            // held: an unmap waits for it, and the lease ends only when this
            // send completes. `lease` lives until then.
            let status = unsafe {
                send_active_message(
                    param.reply_ep,
                    READ_REPLY_AM_ID,
                    &reply.encode(),
                    address as *const u8,
                    request.length as usize,
                    reply_mode(request.length, memh),
                    true,
                    on_reply_sent,
                    lease.cast::<c_void>(),
                )
            };
            if matches!(status, crate::status::PtrStatus::Pending(_)) {
                events.lease_records.borrow_mut().insert(lease as usize);
            } else {
                // Completed or failed inside the call: no callback will run.
                // SAFETY: made by Box::into_raw above and not handed to UCX
                // any more.
                let lease = unsafe { Box::from_raw(lease) };
                events.ended_leases.borrow_mut().push(lease.region_id);
            }
        }
        Err((request_id, refusal)) => {
            events
                .refused_requests
                .set(events.refused_requests.get() + 1);
            let reply = ReadReply {
                request_id,
                status: ReplyStatus::Refused(refusal),
                length: 0,
            };
            // SAFETY: as above; no payload, and the callback needs no data.
            unsafe {
                send_active_message(
                    param.reply_ep,
                    READ_REPLY_AM_ID,
                    &reply.encode(),
                    ptr::null(),
                    0,
                    SendMode::Small,
                    true,
                    on_refusal_sent,
                    ptr::null_mut(),
                )
            };
        }
    }
    sys::UCS_OK
}

/// Frees the lease records of reply sends UCX never completed. Returns how
/// many there were.
///
/// # Safety
/// The worker the sends were posted on is destroyed: no callback of it can
/// run any more, so nothing else reclaims these records.
pub(super) unsafe fn free_unfinished_lease_records(events: &Events) -> usize {
    // SAFETY: every address in the set was made by `Box::into_raw` of a
    // `Lease`, and the worker is gone (the caller's contract).
    unsafe { free_records::<Lease>(&events.lease_records) }
}

/// Frees every record in `records` as a `Box<T>`; returns how many.
///
/// # Safety
/// Every address in the set was made by `Box::into_raw` of a `T` for a
/// send whose callback never ran (a callback removes its record before it
/// reclaims it), and the worker of those sends is destroyed, so no callback
/// can reclaim them any more.
pub(super) unsafe fn free_records<T>(
    records: &std::cell::RefCell<std::collections::HashSet<usize>>,
) -> usize {
    let records: Vec<usize> = records.borrow_mut().drain().collect();
    for &record in &records {
        // SAFETY: the caller's contract: a `Box<T>` address, reclaimed once.
        drop(unsafe { Box::from_raw(record as *mut T) });
    }
    records.len()
}

/// A served reply's send ended: report the lease and return the request.
unsafe extern "C" fn on_reply_sent(
    request: *mut c_void,
    _status: sys::ucs_status_t,
    user_data: *mut c_void,
) {
    // SAFETY: `user_data` is the `Lease` boxed for this very send; this
    // callback runs once per send, so it is reclaimed once.
    let lease = unsafe { Box::from_raw(user_data.cast::<Lease>()) };
    // SAFETY: the events record outlives the worker.
    let events = unsafe { &*lease.events };
    events
        .lease_records
        .borrow_mut()
        .remove(&(user_data as usize));
    events.ended_leases.borrow_mut().push(lease.region_id);
    // SAFETY: a completed request of this worker, returned once; UCX allows
    // freeing a request from its own completion callback.
    unsafe { sys::ucp_request_free(request) };
}

/// A refusal's send ended: return the request.
unsafe extern "C" fn on_refusal_sent(
    request: *mut c_void,
    _status: sys::ucs_status_t,
    _user_data: *mut c_void,
) {
    // SAFETY: as in `on_reply_sent`.
    unsafe { sys::ucp_request_free(request) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::read_protocol::ServedKey;

    fn events_with_region() -> Events {
        let events = Events::default();
        events.served.borrow_mut().insert(
            3,
            ServedRegion {
                ptr: 0x10_000,
                len: 0x1000,
                memh: MemHandle::dangling_for_tests(),
                capability: [7; 16],
                leases: 0,
                closing: false,
            },
        );
        events
    }

    fn request(region_id: u64, capability: [u8; 16], address: u64, length: u64) -> ReadRequest {
        ReadRequest {
            request_id: 1,
            key: ServedKey {
                region_id,
                capability,
            },
            address,
            length,
        }
    }

    #[test]
    fn a_read_inside_a_live_registration_is_admitted_with_a_lease() {
        let events = events_with_region();
        assert!(admit(&events, &request(3, [7; 16], 0x10_000, 0x1000)).is_ok());
        assert_eq!(events.served.borrow()[&3].leases, 1);
    }

    #[test]
    fn small_replies_are_copied_mid_sized_left_to_ucx_large_ones_named() {
        let memh = MemHandle::dangling_for_tests();
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
    }

    #[test]
    fn unknown_forged_stale_and_closing_reads_are_refused_without_a_lease() {
        let events = events_with_region();
        let refused = |r: ReadRequest| admit(&events, &r).err();
        assert_eq!(
            refused(request(4, [7; 16], 0x10_000, 1)),
            Some(RemoteRefusal::RegionUnknown)
        );
        assert_eq!(
            refused(request(3, [8; 16], 0x10_000, 1)),
            Some(RemoteRefusal::CapabilityMismatch)
        );
        assert_eq!(
            refused(request(3, [7; 16], 0x1000, 1)),
            Some(RemoteRefusal::OutOfRange),
            "a forged address outside the registration"
        );
        assert_eq!(
            refused(request(3, [7; 16], 0x10_000, 0x1001)),
            Some(RemoteRefusal::OutOfRange),
            "one byte past the end"
        );
        assert_eq!(
            refused(request(3, [7; 16], 0x10_000, 0)),
            Some(RemoteRefusal::OutOfRange)
        );
        assert_eq!(
            refused(request(3, [7; 16], u64::MAX, 2)),
            Some(RemoteRefusal::OutOfRange)
        );
        events.served.borrow_mut().get_mut(&3).unwrap().closing = true;
        assert_eq!(
            refused(request(3, [7; 16], 0x10_000, 1)),
            Some(RemoteRefusal::Deregistering)
        );
        assert_eq!(events.served.borrow()[&3].leases, 0);
    }
}
