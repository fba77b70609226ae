//! The owner's side of a served read: check, lease, send or refuse.
//!
//! Each request is checked against the live registrations, the region is
//! leased while its bytes are being sent, and everything else is refused.
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
//! - **One consumer connection holds a bounded number of replies.** A
//!   served reply holds its lease and its UCX send until the consumer takes
//!   the bytes; a consumer that asks for large reads and never takes them
//!   would otherwise grow the owner's requests, leases and stalled unmaps
//!   without limit (`tests/ucx/adversarial_replies.rs`). So each connection (the `reply_ep` a request came on) may have
//!   at most `UcxConfig::max_served_replies_per_connection` served replies
//!   unfinished; a valid read beyond that gets the `Busy` refusal, which
//!   the consumer's caller sees as a transient error. Refusal sends are
//!   bounded the same way, separately: a connection with that many refusals
//!   unsent has further requests dropped unanswered (its reads run into
//!   their deadlines). A count drops when UCX completes or fails the send —
//!   also when the connection dies, as UCX then fails its sends — and
//!   teardown clears what is left once the worker is gone.
//! - The handler runs inside the worker's progress and sends from there.
//!   It holds no `RefCell` borrow across the send: with a loopback transport
//!   the reply handler can run inside that very send.

use rustc_hash::FxHashMap as HashMap;
use std::cell::{Cell, RefCell};
use std::ffi::c_void;
use std::ptr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

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
/// [`SendMode::Small`]), which completes sooner. Above one page the hint
/// makes UCX fragment the copy and costs more than it saves, so the bound
/// stays well below tcp's 8 KiB segment.
pub(super) const SMALL_UP_TO: u64 = 4 * 1024;

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

/// Reply sends one consumer connection has unfinished at this owner.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ConnectionLoad {
    /// Served replies: each holds a read lease and a UCX send.
    pub(crate) served: u32,
    /// Refusals whose send UCX has not finished.
    pub(crate) refusals: u32,
}

/// The per-connection bound on unfinished replies, and the counts it is
/// checked against.
///
/// Connections are keyed by the address of the endpoint UCX hands the
/// request handler. An entry is removed when both its counts are back at
/// zero, which happens before UCX frees a failed or closed endpoint (it
/// fails the endpoint's sends first), so a later endpoint at the same
/// address starts from nothing.
#[derive(Debug)]
pub(crate) struct ReplyBudget {
    /// Most served replies (and, separately, most refusals) one connection
    /// may have unfinished.
    pub(crate) bound: Cell<u32>,
    by_endpoint: RefCell<HashMap<usize, ConnectionLoad>>,
    /// Served replies unfinished over every connection, for other threads
    /// (`UcxEngine::served_replies_in_flight`).
    pub(crate) gauge: Arc<AtomicUsize>,
}

impl Default for ReplyBudget {
    fn default() -> Self {
        ReplyBudget {
            bound: Cell::new(crate::UcxConfig::DEFAULT_MAX_SERVED_REPLIES_PER_CONNECTION),
            by_endpoint: RefCell::default(),
            gauge: Arc::default(),
        }
    }
}

impl ReplyBudget {
    /// What `endpoint` has unfinished.
    #[cfg(test)]
    fn load(&self, endpoint: usize) -> ConnectionLoad {
        self.by_endpoint
            .borrow()
            .get(&endpoint)
            .copied()
            .unwrap_or_default()
    }

    /// Counts one more served reply on `endpoint`, unless it is at the bound.
    fn take_served(&self, endpoint: usize) -> bool {
        let mut loads = self.by_endpoint.borrow_mut();
        let load = loads.entry(endpoint).or_default();
        if load.served >= self.bound.get() {
            return false;
        }
        load.served += 1;
        self.gauge.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Counts one more refusal on `endpoint`, unless it is at the bound.
    pub(super) fn take_refusal(&self, endpoint: usize) -> bool {
        let mut loads = self.by_endpoint.borrow_mut();
        let load = loads.entry(endpoint).or_default();
        if load.refusals >= self.bound.get() {
            return false;
        }
        load.refusals += 1;
        true
    }

    /// A reply send on `endpoint` ended (`served`: it carried bytes).
    pub(super) fn release(&self, endpoint: usize, served: bool) {
        let mut loads = self.by_endpoint.borrow_mut();
        let Some(load) = loads.get_mut(&endpoint) else {
            return;
        };
        if served {
            if load.served > 0 {
                load.served -= 1;
                self.gauge.fetch_sub(1, Ordering::Relaxed);
            }
        } else {
            load.refusals = load.refusals.saturating_sub(1);
        }
        if *load == ConnectionLoad::default() {
            loads.remove(&endpoint);
        }
    }

    /// Connections with something unfinished.
    #[cfg(test)]
    fn connections(&self) -> usize {
        self.by_endpoint.borrow().len()
    }

    /// Forgets every count: the worker is destroyed, no send is left.
    fn clear(&self) {
        self.by_endpoint.borrow_mut().clear();
        self.gauge.store(0, Ordering::Relaxed);
    }
}

/// What a reply send's completion needs: which connection's count, and for
/// a served reply which region's lease, ended.
struct Lease {
    events: *const Events,
    /// The region read from; `None` for a refusal.
    region_id: Option<u64>,
    endpoint: usize,
}

impl Lease {
    /// The send this record belongs to ended: release what it counted.
    fn end(&self, events: &Events) {
        match self.region_id {
            Some(region_id) => end_served(events, self.endpoint, &[region_id]),
            None => events.replies.release(self.endpoint, false),
        }
    }
}

/// A send on `endpoint` that served `region_ids` (one entry each) ended:
/// their leases end and their places under the connection's bound free up.
pub(super) fn end_served(events: &Events, endpoint: usize, region_ids: &[u64]) {
    events
        .ended_leases
        .borrow_mut()
        .extend_from_slice(region_ids);
    for _ in region_ids {
        events.replies.release(endpoint, true);
    }
}

/// Checks `request`, arriving on the connection `endpoint`, against
/// `served` and, on success, counts the reply against the connection's
/// bound, takes a lease and returns what to send. A read that is wrong in
/// itself is refused for that, whatever the connection's load.
pub(super) fn admit(
    events: &Events,
    request: &ReadRequest,
    endpoint: usize,
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
    if !events.replies.take_served(endpoint) {
        return Err(RemoteRefusal::Busy);
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
        events.dropped_message();
        return sys::UCS_OK;
    }
    let endpoint = param.reply_ep as usize;
    // SAFETY: what UCX passed this handler, used only during it.
    let header = unsafe { handler_header(header, header_length) };
    let decision = match ReadRequest::decode(header) {
        Ok(request) => match admit(events, &request, endpoint) {
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
    // Whatever goes back, the consumer moves next.
    events.handed_off();
    match decision {
        Ok((request, address, memh)) => {
            let reply = ReadReply {
                request_id: request.request_id,
                status: ReplyStatus::Served,
                length: request.length,
            };
            let lease = Box::into_raw(Box::new(Lease {
                events,
                region_id: Some(request.key.region_id),
                endpoint,
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
                lease.end(events);
            }
        }
        Err((request_id, refusal)) => {
            events
                .refused_requests
                .set(events.refused_requests.get() + 1);
            if refusal == RemoteRefusal::Busy {
                tracing::debug!(
                    bound = events.replies.bound.get(),
                    "a consumer connection is at its bound of unfinished replies; refusing a read as busy"
                );
            }
            if !events.replies.take_refusal(endpoint) {
                // This connection does not take its refusals either: answer
                // nothing more until it does.
                events.dropped_message();
                return sys::UCS_OK;
            }
            let reply = ReadReply {
                request_id,
                status: ReplyStatus::Refused(refusal),
                length: 0,
            };
            let record = Box::into_raw(Box::new(Lease {
                events,
                region_id: None,
                endpoint,
            }));
            // SAFETY: as above; no payload, and `record` lives until the
            // send ends.
            let status = unsafe {
                send_active_message(
                    param.reply_ep,
                    READ_REPLY_AM_ID,
                    &reply.encode(),
                    ptr::null(),
                    0,
                    SendMode::Small,
                    true,
                    on_reply_sent,
                    record.cast::<c_void>(),
                )
            };
            if matches!(status, crate::status::PtrStatus::Pending(_)) {
                events.lease_records.borrow_mut().insert(record as usize);
            } else {
                // SAFETY: made by Box::into_raw above; no callback will run.
                let record = unsafe { Box::from_raw(record) };
                record.end(events);
            }
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
    // No send is left to end: forget what the connections had unfinished.
    events.replies.clear();
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
    records: &std::cell::RefCell<rustc_hash::FxHashSet<usize>>,
) -> usize {
    let records: Vec<usize> = records.borrow_mut().drain().collect();
    for &record in &records {
        // SAFETY: the caller's contract: a `Box<T>` address, reclaimed once.
        drop(unsafe { Box::from_raw(record as *mut T) });
    }
    records.len()
}

/// A reply's send ended (served or refused): release what it counted and
/// return the request.
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
    lease.end(events);
    // SAFETY: a completed request of this worker, returned once; UCX allows
    // freeing a request from its own completion callback.
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
        assert!(admit(&events, &request(3, [7; 16], 0x10_000, 0x1000), 1).is_ok());
        assert_eq!(events.served.borrow()[&3].leases, 1);
        assert_eq!(events.replies.load(1).served, 1);
        assert_eq!(events.replies.gauge.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_connection_at_its_bound_is_refused_as_busy_and_others_are_not() {
        let events = events_with_region();
        events.replies.bound.set(2);
        let read = request(3, [7; 16], 0x10_000, 16);
        assert!(admit(&events, &read, 1).is_ok());
        assert!(admit(&events, &read, 1).is_ok());
        assert_eq!(admit(&events, &read, 1).err(), Some(RemoteRefusal::Busy));
        assert_eq!(
            events.served.borrow()[&3].leases,
            2,
            "no lease for a busy refusal"
        );
        assert!(
            admit(&events, &read, 2).is_ok(),
            "another connection has its own bound"
        );
        assert_eq!(events.replies.gauge.load(Ordering::Relaxed), 3);
        // A wrong read is refused for what is wrong with it, busy or not.
        assert_eq!(
            admit(&events, &request(3, [8; 16], 0x10_000, 16), 1).err(),
            Some(RemoteRefusal::CapabilityMismatch)
        );
    }

    #[test]
    fn an_ended_reply_frees_its_place_and_an_idle_connection_is_forgotten() {
        let events = events_with_region();
        events.replies.bound.set(1);
        let read = request(3, [7; 16], 0x10_000, 16);
        assert!(admit(&events, &read, 5).is_ok());
        assert_eq!(admit(&events, &read, 5).err(), Some(RemoteRefusal::Busy));
        let lease = Lease {
            events: &events,
            region_id: Some(3),
            endpoint: 5,
        };
        lease.end(&events);
        assert_eq!(events.ended_leases.borrow().as_slice(), &[3]);
        assert_eq!(events.replies.connections(), 0);
        assert_eq!(events.replies.gauge.load(Ordering::Relaxed), 0);
        assert!(admit(&events, &read, 5).is_ok(), "the place is free again");
    }

    #[test]
    fn refusals_are_bounded_apart_from_served_replies() {
        let events = events_with_region();
        events.replies.bound.set(2);
        assert!(events.replies.take_refusal(9));
        assert!(events.replies.take_refusal(9));
        assert!(!events.replies.take_refusal(9));
        assert!(
            events.replies.take_served(9),
            "refusals do not use up served places"
        );
        let refusal = Lease {
            events: &events,
            region_id: None,
            endpoint: 9,
        };
        refusal.end(&events);
        assert!(events.replies.take_refusal(9));
        assert!(
            events.ended_leases.borrow().is_empty(),
            "a refusal holds no lease"
        );
        assert_eq!(
            events.replies.load(9),
            ConnectionLoad {
                served: 1,
                refusals: 2
            }
        );
        events.replies.clear();
        assert_eq!(events.replies.connections(), 0);
        assert_eq!(events.replies.gauge.load(Ordering::Relaxed), 0);
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
        let refused = |r: ReadRequest| admit(&events, &r, 1).err();
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
