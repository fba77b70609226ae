//! Batched lists on the served lane: a batch's small reads of one owner go
//! out as one list request and come back as one eager reply, or several in
//! order (formats and reasons in [`read_list`](crate::read_list)).
//!
//! - **Consumer.** Every read of the list keeps its own op (destination
//!   hold, deadline, result). Only the request send is shared, owned by the
//!   list's first op (the leader); if it fails, every read of the list still
//!   waiting fails with it. The reply handler copies each served entry out
//!   of the eager payload, so no UCX receive ever holds a list's destination.
//! - **Owner.** The engine kit's owner judges each entry exactly as a single
//!   read (`serve`), within `rdmareg_engine::served::ListLimits`. Over a
//!   tcp-only connection it cuts its replies to one fragment's payload each,
//!   unless the operator shapes UCX's protocols (as for chunked reads).
//! - **Headers fit the worker.** UCX (built without its parameter checks)
//!   writes a header longer than the worker's `max_am_header` past its
//!   fragment buffer, so a list request carries at most as many entries as
//!   that bound allows, and an owner whose bound is below a reply header
//!   sends several replies; the consumer matches entries by request id.
//! - **Hostile replies write nothing.** An entry is written only into a read
//!   sent on the endpoint the reply arrived on, only with the read's own
//!   length, and only if the entries' lengths add up to the payload; a
//!   rendezvous where eager was promised fails the reads it names.

use std::ffi::c_void;

use rdmareg_core::RdmaError;
use ucx_sys as sys;

use super::Engine;
use super::events::Events;
use super::gets::PreparedRead;
use super::ops::GetOp;
use rdmareg_engine::served::consumer::{DropReason, ReadId, Reply, ReplyOutcome, ReplyVerdict};

use super::replies::{ArrivedReply, machine_reply};
use super::serve::{SMALL_UP_TO, one_fragment_each, perform_actions, reply_endpoint};
use super::ucp::{SendMode, handler_header, send_active_message};
use crate::read_list::{
    ListReply, ListReplyEntry, ListRequest, MAX_GATHERED_BYTES, MAX_GATHERED_ENTRY,
    READ_LIST_REQUEST_AM_ID, REPLY_ENTRY_LEN, REQUEST_ENTRY_LEN, entries_within,
};
use crate::read_protocol::ReplyStatus;
use crate::status::PtrStatus;
use rdmareg_engine::served::ListLimits;

/// Whether a prepared read may travel in a list: small enough to come back
/// eager.
pub(super) fn fits_a_list(read: &PreparedRead) -> bool {
    read.request.length <= MAX_GATHERED_ENTRY
}

impl Engine {
    /// Sends prepared reads: runs of list-sized reads to one endpoint go as
    /// list requests (within the bounds of `read_list`), the rest alone.
    pub(super) fn send_prepared(&mut self, mut prepared: Vec<PreparedRead>) {
        // Stable: each owner's reads keep their order.
        prepared.sort_by_key(|read| (!fits_a_list(read), read.endpoint as usize));
        // The request header must fit the worker's largest one.
        let most = entries_within(self.events.max_am_header.get(), REQUEST_ENTRY_LEN);
        let mut reads = prepared.into_iter().peekable();
        while let Some(first) = reads.next() {
            if !fits_a_list(&first) {
                self.send_read_request(first);
                continue;
            }
            let mut bytes = first.request.length;
            let mut list = vec![first];
            while let Some(next) = reads.peek() {
                let fits = fits_a_list(next)
                    && next.endpoint == list[0].endpoint
                    && list.len() < most
                    && bytes + next.request.length <= MAX_GATHERED_BYTES;
                if !fits {
                    break;
                }
                bytes += next.request.length;
                list.extend(reads.next());
            }
            if list.len() == 1 {
                self.send_read_request(list.remove(0));
            } else {
                self.send_read_list(list);
            }
        }
    }

    /// Sends one list request for `list` (two or more reads to one
    /// endpoint, within the bounds), owned by the first read's op.
    fn send_read_list(&mut self, list: Vec<PreparedRead>) {
        // An earlier send of this turn may have closed the endpoint (see
        // `send_read_request`), completing these reads: each then goes its
        // own way, and none uses the closed handle.
        let completed = |read: &PreparedRead| {
            // SAFETY: active slots of this turn, touched between UCX calls.
            unsafe { (*read.op).phase != super::ops::Phase::AwaitingReply }
        };
        if list.iter().any(completed) {
            for read in list {
                self.send_read_request(read);
            }
            return;
        }
        let request = ListRequest {
            entries: list.iter().map(|read| read.request).collect(),
        };
        let Some(header) = request.encode() else {
            // Out of bounds cannot happen (checked by the caller); send
            // each alone rather than fail them.
            for read in list {
                self.send_read_request(read);
            }
            return;
        };
        let leader = &list[0];
        let (leader_slot, leader_op, endpoint) = (leader.slot, leader.op, leader.endpoint);
        let mut members = Vec::with_capacity(list.len() - 1);
        for read in &list[1..] {
            // SAFETY: active slots of this list, touched between UCX calls
            // only. A member's request travels in the leader's send, so its
            // own slot waits for no send.
            let generation = unsafe {
                (*read.op).send_pending = false;
                (*read.op).generation
            };
            members.push((read.slot, generation));
        }
        // SAFETY: as above.
        unsafe { (*leader_op).list_members = members.clone() };
        // The header (at most 3080 bytes) fits one short send.
        // SAFETY: the endpoint is live (looked up this turn); no payload;
        // the leader's slot outlives the send (freed only after the
        // worker). The whole exchange can complete inside this call, so
        // every op was entered already and no borrow is held across it.
        let status = unsafe {
            send_active_message(
                endpoint,
                READ_LIST_REQUEST_AM_ID,
                &header,
                std::ptr::null(),
                0,
                SendMode::Small,
                true,
                super::replies::on_request_sent,
                leader_op.cast::<c_void>(),
            )
        };
        // The owner moves next.
        self.events.handed_off();
        match status {
            // SAFETY: the leader's slot is active and owns this send.
            PtrStatus::Pending(request) => unsafe { (*leader_op).send_request = request },
            PtrStatus::Done => self.request_sent(leader_slot, sys::UCS_OK),
            PtrStatus::Failed(code) => self.request_sent(leader_slot, code),
        }
        // Members that finished already (their reply came inside the send)
        // can be recycled now that no send is pending for them.
        for (slot, generation) in members {
            if self.ops.is_current(slot, generation) {
                self.settle_op(slot);
            }
        }
        self.drain_events();
    }
}

/// UCX's handler for a list request (`READ_LIST_REQUEST_AM_ID`), on the
/// owner: the owner judges each entry (`serve`).
///
/// # Safety
/// Installed with `arg` = the engine's `Events`, which outlives the worker.
pub(super) unsafe extern "C" fn on_read_list_request(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    _data: *mut c_void,
    _length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: `arg` is the engine's boxed `Events`, alive until after the
    // worker is destroyed.
    let events = unsafe { &*arg.cast::<Events>() };
    // SAFETY: UCX passes a valid parameter record for the call's duration.
    let Some(reply_ep) = reply_endpoint(unsafe { &*param }) else {
        // Nobody to reply to.
        events.dropped_message();
        return sys::UCS_OK;
    };
    // SAFETY: what UCX passed this handler, used only during it.
    let header = unsafe { handler_header(header, header_length) };
    let one_fragment_each = one_fragment_each(events);
    let limits = ListLimits {
        max_entry: MAX_GATHERED_ENTRY,
        max_total: MAX_GATHERED_BYTES,
        // A reply header longer than the worker's largest is split in
        // several; the consumer matches every entry by its id.
        entries_per_reply: entries_within(events.max_am_header.get(), REPLY_ENTRY_LEN),
        payload_per_reply: if one_fragment_each {
            super::chunks::CHUNK as u64
        } else {
            MAX_GATHERED_BYTES
        },
    };
    super::leases::give_time(events);
    events
        .owner
        .borrow_mut()
        .handle_list_request(reply_ep as usize, header, limits);
    // SAFETY: inside the handler that handed over `reply_ep`, on the
    // worker's thread.
    unsafe { perform_actions(events) };
    sys::UCS_OK
}

/// A list reply whose ranges are on average shorter than this is copied
/// into UCX's send segments rather than sent zero-copy.
///
/// UCX's tcp transport puts at most `UCX_TCP_MAX_IOV` entries (6 by
/// default, one of them its trailer) in one zero-copy fragment, so short
/// ranges would leave in many small fragments; copying them costs less.
/// From 8 KiB a range fills enough of a fragment that zero-copy costs no
/// more. Only replies of more ranges than one fragment carries are copied
/// (see [`copied_into_segments`]).
const COPY_RANGES_SHORTER_THAN: u64 = 8 * 1024;

/// Ranges UCX's tcp transport carries in one zero-copy fragment with its
/// default `UCX_TCP_MAX_IOV`: the assumption for every connection whose
/// replies are not cut to fragments. On a tcp-only connection with
/// fragment-sized replies the engine's own bound applies instead
/// (`Events::tcp_ranges_per_zero_copy_fragment`).
pub(super) const ZERO_COPY_RANGES_PER_FRAGMENT: usize = 5;

/// Whether a list reply with a header of `header` bytes and `payload`
/// bytes in `ranges` ranges asks UCX to copy it (fast completion) rather
/// than let UCX pick zero-copy: when header and payload fit one short send
/// (as single replies do, see `serve::SMALL_UP_TO`), and when the ranges
/// are more than one zero-copy fragment carries (`per_fragment`, see
/// [`ZERO_COPY_RANGES_PER_FRAGMENT`]) and short on average (see
/// [`COPY_RANGES_SHORTER_THAN`]).
pub(super) fn copied_into_segments(
    header: u64,
    payload: u64,
    ranges: usize,
    per_fragment: usize,
) -> bool {
    let fits_one_send = header.saturating_add(payload) <= SMALL_UP_TO;
    let short_ranges =
        ranges > per_fragment && payload < COPY_RANGES_SHORTER_THAN.saturating_mul(ranges as u64);
    fits_one_send || short_ranges
}

/// [`copied_into_segments`] with the bound of ranges per zero-copy
/// fragment that holds for this engine's connections.
pub(super) fn copied_on_this_lane(
    events: &Events,
    header: u64,
    payload: u64,
    ranges: usize,
) -> bool {
    let per_fragment = if one_fragment_each(events) {
        events.tcp_ranges_per_zero_copy_fragment.get()
    } else {
        ZERO_COPY_RANGES_PER_FRAGMENT
    };
    copied_into_segments(header, payload, ranges, per_fragment)
}

/// UCX's handler for a list reply (`READ_LIST_REPLY_AM_ID`), on the
/// consumer.
///
/// # Safety
/// Installed with `arg` = the engine's `Events`, which outlives the worker.
pub(super) unsafe extern "C" fn on_read_list_reply(
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
    let Ok(reply) = ListReply::decode(header) else {
        events.dropped_message();
        return sys::UCS_OK;
    };
    // The payload can be attributed to entries only if it is here (eager)
    // and the entries' lengths add up to it.
    let payload_whole = !rendezvous
        && (length == 0 || !data.is_null())
        && reply.payload_len() == Some(length as u64);
    // Every entry through the consumer machine first, then the copies, so
    // the lookups' cache misses overlap. Nothing runs between the two
    // passes, so an entry accepted here is written below.
    let accepted: Vec<Option<(ReadId, *mut GetOp)>> = {
        let mut consumer = events.consumer.borrow_mut();
        reply
            .entries
            .iter()
            .map(|entry| {
                let reply = entry_reply(entry, payload_whole);
                match consumer.handle_reply(arrived_on as usize, &reply, entry.length) {
                    ReplyVerdict::Write(read) => consumer.payload(read).map(|&op| (read, op)),
                    ReplyVerdict::Drop(DropReason::WrongEndpoint) => {
                        events.dropped_message();
                        None
                    }
                    ReplyVerdict::Drop(DropReason::NotAwaited) | ReplyVerdict::Refused(_) => None,
                }
            })
            .collect()
    };
    let mut offset = 0usize;
    for (entry, accepted) in reply.entries.iter().zip(accepted) {
        if let Some((read, op)) = accepted {
            // SAFETY: held by the machine, which accepted this entry for it
            // above (the only reply that reaches it), and nothing ran
            // since: an active slot. Accepted means served with exactly the
            // read's length, inside a payload the entries add up to
            // (`payload_whole`).
            let op_ref = unsafe { &*op };
            if op_ref.len > 0 {
                // SAFETY: `[offset, offset + op.len)` lies inside the
                // `length` readable bytes at `data` for the handler's
                // duration (the entries' lengths add up to the payload);
                // the destination was checked inside its mapped region when
                // the read was posted and is held (an unmap waits) until the
                // loop sees the op finished, and nothing else writes it while
                // the machine holds the read.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        data.cast::<u8>().add(offset),
                        op_ref.dest,
                        op_ref.len,
                    );
                }
            }
            events.consumer.borrow_mut().released(read, Ok(()));
        }
        if payload_whole {
            offset += entry.length as usize;
        }
    }
    events.complete_reads();
    sys::UCS_OK
}

/// One entry of a list reply as the consumer machine takes it. A served
/// entry of a reply whose payload does not add up to its entries (or is
/// not at hand) cannot be attributed: it is refused with that reason.
fn entry_reply(entry: &ListReplyEntry, payload_whole: bool) -> Reply {
    match entry.status {
        ReplyStatus::Served if !payload_whole => Reply {
            request_id: entry.request_id,
            outcome: ReplyOutcome::Refused(RdmaError::backend(
                "ucx: a list reply's payload does not match its entries; refused",
            )),
        },
        status => machine_reply(entry.request_id, status, entry.length),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// UCX's default tcp vector bound, the rule on every lane but tcp-only
    /// connections of an engine that sets its own.
    const RANGES: usize = ZERO_COPY_RANGES_PER_FRAGMENT;

    #[test]
    fn replies_that_fit_one_short_send_are_copied_whatever_their_ranges() {
        assert!(copied_into_segments(8 + 24, 8, 1, RANGES));
        assert!(copied_into_segments(8 + 24, SMALL_UP_TO - 32, 1, RANGES));
        assert!(copied_into_segments(8 + 64 * 24, 64 * 8, 64, RANGES));
        assert!(
            copied_into_segments(8 + 24, 0, 0, RANGES),
            "a refusal alone is copied"
        );
    }

    #[test]
    fn replies_of_many_short_ranges_are_copied_and_of_long_ranges_left_to_ucx() {
        // 64 × 4 KiB: the bench's scatter list.
        assert!(copied_into_segments(1544, 64 * 4096, 64, RANGES));
        let below = 16 * (COPY_RANGES_SHORTER_THAN - 1);
        assert!(copied_into_segments(392, below, 16, RANGES));
        assert!(!copied_into_segments(
            392,
            16 * COPY_RANGES_SHORTER_THAN,
            16,
            RANGES
        ));
        assert!(!copied_into_segments(392, 16 * 16 * 1024, 16, RANGES));
        // Long ranges among short ones: the mean decides.
        assert!(!copied_into_segments(200, 7 * 8 + 64 * 1024, 8, RANGES));
        assert!(copied_into_segments(200, 7 * 4096 + 8192, 8, RANGES));
    }

    #[test]
    fn replies_of_as_few_ranges_as_one_zero_copy_fragment_carries_are_left_to_ucx() {
        let fragment = ZERO_COPY_RANGES_PER_FRAGMENT;
        assert!(!copied_into_segments(32, SMALL_UP_TO, 1, RANGES));
        assert!(!copied_into_segments(
            152,
            fragment as u64 * 4096,
            fragment,
            RANGES
        ));
        let one_more = fragment + 1;
        assert!(copied_into_segments(
            176,
            one_more as u64 * 4096,
            one_more,
            RANGES
        ));
    }

    #[test]
    fn with_the_engines_tcp_bound_a_fragment_of_4_kib_ranges_leaves_zero_copy() {
        let tcp = crate::UcxConfig::default().tcp_ranges_per_zero_copy_fragment(|_| None);
        // A fragment-sized reply of the scatter list: 15 × 4 KiB.
        let ranges = super::super::chunks::CHUNK / 4096;
        let header = 8 + 24 * ranges as u64;
        let payload = (ranges * 4096) as u64;
        assert!(!copied_into_segments(header, payload, ranges, tcp));
        assert!(
            copied_into_segments(header, payload, ranges, RANGES),
            "with UCX's default bound the same reply is copied"
        );
        // 64 × 4 KiB in one reply (a lane that is not cut to fragments).
        assert!(copied_into_segments(1544, 64 * 4096, 64, tcp));
    }
}
