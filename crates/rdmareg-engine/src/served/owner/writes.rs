//! Served writes: a peer sends bytes and the owner puts them into one of
//! its registrations, after checking the write as it checks a read.
//!
//! # The contract
//!
//! 1. **A write is accepted only if** it names a registration the owner
//!    holds, carries its capability (a descriptor lease's capability
//!    grants reads only), the registration allows writes, it is not being
//!    unmapped, `[address, address + length)` is non-empty and inside the
//!    registration, the payload that came with it is exactly `length`
//!    bytes, and the endpoint is under its bound of unfinished replies —
//!    checked in that order, capability first, so a peer without the
//!    capability learns nothing. Anything else is refused with a typed
//!    [`Refusal`] and no [`Action::Receive`]: a refused write changes no
//!    byte.
//! 2. **An accepted write holds its region** from the [`Action::Receive`]
//!    until the driver reports the receive's end
//!    ([`Owner::receive_completed`] or [`Owner::receive_failed`]), under
//!    the same count an unmap waits for: [`Action::Unmapped`] comes only
//!    after every receive into the region ended, so no byte arrives in
//!    memory its caller got back.
//! 3. **The reply says the bytes are in.** Only after
//!    [`Owner::receive_completed`] does the owner send
//!    [`Action::Acknowledge`]; a failed receive is answered
//!    [`Refusal::ReceiveFailed`]. A write occupies one place under the
//!    endpoint's bound of served replies from its acceptance until its
//!    reply's send ended, so a peer that writes and never takes its
//!    replies cannot grow the owner's receives and sends.
//! 4. **Endpoints and teardown** are as for reads: a failed endpoint's
//!    writes are dropped, its receives end when the transport reports
//!    them (their replies are not sent); [`Owner::shutdown`] unmaps every
//!    region once its receives ended; [`Owner::transport_closed`] ends
//!    every receive, unanswered, since the transport writes no more.
//! 5. **The owner logs which ranges writes filled.** Each registration
//!    keeps a [`WrittenLog`](rdmareg_core::WrittenLog): a write's range is listed when its receive
//!    completed — whether or not its endpoint failed meanwhile, since the
//!    bytes are in — and taken out of the list when a receive into it
//!    failed (some of its bytes may have arrived), as it is out of every
//!    receive over it still running then (they may have arrived after
//!    that receive's).
//!    [`Owner::take_written`] hands the log over and starts it afresh;
//!    the log ends with the registration. It is bounded
//!    ([`OwnerConfig::max_written_ranges`](super::OwnerConfig::max_written_ranges)
//!    disjoint ranges) and past the bound says it is incomplete rather
//!    than list a byte no write filled. It is per registration, not per
//!    writer: the owner's endpoints are the driver's ids, reused once an
//!    endpoint ended, and name no peer a caller knows, so a writer's
//!    identity is not something the owner can give for every driver.

use std::fmt;
use std::hash::Hash;
use std::ops::Range;

use super::write_lists::ListSlot;
use super::{Action, Leases, Owner, Payload, Read, Refusal, Stage, wire};
use rdmareg_backend::leases::capabilities_match;
use rdmareg_core::WrittenRanges;

/// A write as a consumer asks it: the fields of its request header,
/// decoded. The bytes to write travel as the request's payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Write {
    /// Chosen by the consumer; echoed in the reply.
    pub request_id: u64,
    /// The registration's id, from the consumer's descriptor.
    pub region: u64,
    /// The registration's capability, from the consumer's descriptor.
    pub capability: [u8; 16],
    /// First byte to write, as an address in the owner's process.
    pub address: u64,
    /// How many bytes.
    pub length: u64,
}

impl Write {
    /// The read request with the same fields (the wire layout is shared).
    pub(crate) fn as_read(&self) -> Read {
        Read {
            request_id: self.request_id,
            region: self.region,
            capability: self.capability,
            address: self.address,
            length: self.length,
        }
    }

    pub(crate) fn from_read(read: Read) -> Write {
        Write {
            request_id: read.request_id,
            region: read.region,
            capability: read.capability,
            address: read.address,
            length: read.length,
        }
    }
}

/// Names one receive of a write's payload, until the driver reports its
/// end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReceiveId(pub u64);

/// An accepted write whose bytes are being received.
#[derive(Debug)]
pub(super) struct Receive<E> {
    endpoint: E,
    region: u64,
    /// First byte written, as an offset from the registration's start.
    offset: u64,
    /// Parts of its range a receive that failed while this one ran may
    /// have written after it: never listed, even once this one completed.
    spoiled: Vec<Range<u64>>,
    request_id: u64,
    length: u64,
    /// Whether it holds its region (always, but for a test-only defect).
    holds: bool,
    /// Already acknowledged (the test-only defect
    /// `Defects::acknowledge_before_receive`).
    acknowledged: bool,
    /// The write list it is an entry of, answered with the list.
    list: Option<ListSlot>,
}

impl<E: Copy + Eq + Hash + fmt::Debug> Owner<E> {
    /// A write arrived on `endpoint` as the UCX engine encodes it: the
    /// header `bytes` ([`wire::decode_write_request`]) and a payload of
    /// `payload_length` bytes. A header that does not decode is refused
    /// [`Refusal::Malformed`] under the id it seems to carry.
    pub fn handle_write_request(&mut self, endpoint: E, bytes: &[u8], payload_length: u64) {
        match wire::decode_write_request(bytes) {
            Ok(write) => self.handle_write(endpoint, write, payload_length),
            Err(err) => {
                tracing::debug!(error = %err, "a malformed write request");
                self.handle_malformed(endpoint, wire::request_id_of_malformed(bytes));
            }
        }
    }

    /// A decoded write arrived on `endpoint` with a payload of
    /// `payload_length` bytes: accept it ([`Action::Receive`]) or refuse
    /// it (module docs, point 1).
    pub fn handle_write(&mut self, endpoint: E, write: Write, payload_length: u64) {
        if !self.may_reply(endpoint) {
            return;
        }
        let target = match self.check_write(&write, payload_length) {
            Ok(target) => target,
            Err(refusal) => return self.refuse(endpoint, write.request_id, refusal),
        };
        if let Err(refusal) = self.take_served_places(endpoint, 1, "write") {
            return self.refuse(endpoint, write.request_id, refusal);
        }
        let receive = self.start_receive(endpoint, write.request_id, target, 0, None);
        #[cfg(test)]
        if self.defects.acknowledge_before_receive {
            self.acknowledge(receive);
        }
        #[cfg(not(test))]
        let _ = receive;
    }

    /// Starts the receive of a checked write into `target`, whose place
    /// under the endpoint's bound is taken: a hold on its region and the
    /// [`Action::Receive`] of its bytes, found `payload_offset` bytes into
    /// the message's payload.
    pub(super) fn start_receive(
        &mut self,
        endpoint: E,
        request_id: u64,
        target: Payload,
        payload_offset: u64,
        list: Option<ListSlot>,
    ) -> ReceiveId {
        #[cfg(test)]
        let holds = !self.defects.unmap_ignores_receives;
        #[cfg(not(test))]
        let holds = true;
        let mut offset = 0;
        if let Some(region) = self.regions.get_mut(&target.region) {
            offset = target.address - region.start;
            if holds {
                region.leases += 1;
            }
        }
        let receive = ReceiveId(self.next_receive);
        self.next_receive += 1;
        self.receives.insert(
            receive,
            Receive {
                endpoint,
                region: target.region,
                offset,
                spoiled: Vec::new(),
                request_id,
                length: target.length,
                holds,
                acknowledged: false,
                list,
            },
        );
        tracing::trace!(
            request = request_id,
            len = target.length,
            "receiving a write"
        );
        self.actions.push_back(Action::Receive {
            endpoint,
            receive,
            request_id,
            region: target.region,
            address: target.address,
            length: target.length,
            payload_offset,
        });
        receive
    }

    /// Judges `write` with a payload of `payload_length` bytes as
    /// [`Owner::handle_write`] does, but for the endpoint's bound, and
    /// takes no hold: the range the write would go to, or why not.
    pub fn check_write(&self, write: &Write, payload_length: u64) -> Result<Payload, Refusal> {
        let region = self
            .regions
            .get(&write.region)
            .ok_or(Refusal::RegionUnknown)?;
        if !capabilities_match(&region.capability, &write.capability) {
            return Err(Refusal::CapabilityMismatch);
        }
        #[cfg(test)]
        let allowed = region.access.allows_write() || self.defects.write_access_unchecked;
        #[cfg(not(test))]
        let allowed = region.access.allows_write();
        if !allowed {
            return Err(Refusal::AccessDenied);
        }
        if region.unmapping || self.stage == Stage::Closed {
            return Err(Refusal::Deregistering);
        }
        if !self.inside(region, write.address, write.length) {
            return Err(Refusal::OutOfRange);
        }
        if payload_length != write.length {
            return Err(Refusal::Malformed);
        }
        Ok(Payload {
            region: write.region,
            address: write.address,
            length: write.length,
        })
    }

    /// The transport received the whole payload of `receive` into the
    /// registration: the hold ends and the write is acknowledged (unless
    /// its endpoint failed meanwhile). Returns whether the owner knew it.
    pub fn receive_completed(&mut self, receive: ReceiveId) -> bool {
        self.end_receive(receive, true)
    }

    /// The transport ended `receive` in error and writes no more of it:
    /// the hold ends and the write is refused [`Refusal::ReceiveFailed`]
    /// (unless its endpoint failed meanwhile). Returns whether the owner
    /// knew it.
    pub fn receive_failed(&mut self, receive: ReceiveId) -> bool {
        self.end_receive(receive, false)
    }

    /// The ranges of `region` that writes filled since the last take, as
    /// offsets from the registration's start, and a fresh log (module
    /// docs, point 5); `None` for a region the owner does not hold.
    pub fn take_written(&mut self, region: u64) -> Option<WrittenRanges> {
        self.regions
            .get_mut(&region)
            .map(|entry| entry.written.take())
    }

    /// The log of `region` as it stands, not taken.
    #[cfg(test)]
    pub(crate) fn peek_written(&self, region: u64) -> Option<WrittenRanges> {
        self.regions
            .get(&region)
            .map(|entry| entry.written.clone().take())
    }

    /// Writes accepted whose receive did not end.
    pub fn receives_in_flight(&self) -> usize {
        self.receives.len()
    }

    /// Ends every receive, unanswered: the transport is gone.
    pub(super) fn end_every_receive(&mut self) {
        let mut ids: Vec<ReceiveId> = self.receives.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            self.end_receive(id, false);
        }
    }

    fn end_receive(&mut self, id: ReceiveId, completed: bool) -> bool {
        let Some(receive) = self.receives.get(&id) else {
            return false;
        };
        let (endpoint, region, holds) = (receive.endpoint, receive.region, receive.holds);
        let range = receive.offset..receive.offset + receive.length;
        #[cfg(test)]
        let listed = completed || self.defects.failed_receives_listed;
        #[cfg(not(test))]
        let listed = completed;
        self.log_written(id, region, range, listed);
        let Some(receive) = self.receives.get(&id) else {
            return false;
        };
        let failed = self.endpoints.get(&endpoint).is_some_and(|e| e.failed);
        if let Some(slot) = receive.list {
            self.end_list_entry(slot, completed);
        } else if receive.acknowledged {
            // Answered at its acceptance (a test-only defect).
        } else if self.stage == Stage::Closed || failed {
            tracing::debug!("a write's receive ended on a failed endpoint; no reply");
            self.end_served_place(endpoint);
        } else if completed {
            self.acknowledge(id);
        } else {
            let request_id = receive.request_id;
            let send = self.start_send_of(endpoint, Leases::None, 1);
            tracing::debug!(request = request_id, "a write's receive failed");
            self.actions.push_back(Action::Refuse {
                endpoint,
                send,
                request_id,
                refusal: Refusal::ReceiveFailed,
            });
        }
        self.receives.remove(&id);
        if holds {
            self.end_hold(region);
        }
        self.report_drained();
        true
    }

    /// Logs the end of receive `id` into `range` of `region`: listed if
    /// `listed`, but for the parts a failed receive spoiled; otherwise
    /// taken out of the log, and out of every receive into the region
    /// still running (its bytes may land after theirs).
    fn log_written(&mut self, id: ReceiveId, region: u64, range: Range<u64>, listed: bool) {
        if listed {
            let spoiled = self
                .receives
                .get_mut(&id)
                .map(|receive| std::mem::take(&mut receive.spoiled))
                .unwrap_or_default();
            if let Some(entry) = self.regions.get_mut(&region) {
                entry.written.record(range);
                for part in spoiled {
                    entry.written.forget(part);
                }
            }
            return;
        }
        if let Some(entry) = self.regions.get_mut(&region) {
            entry.written.forget(range.clone());
        }
        for (&other, receive) in self.receives.iter_mut() {
            let start = receive.offset.max(range.start);
            let end = (receive.offset + receive.length).min(range.end);
            if other != id && receive.region == region && start < end {
                receive.spoiled.push(start..end);
            }
        }
    }

    /// Sends the reply that says `receive`'s bytes are in.
    fn acknowledge(&mut self, id: ReceiveId) {
        let Some(receive) = self.receives.get_mut(&id) else {
            return;
        };
        receive.acknowledged = true;
        let (endpoint, request_id, length) = (receive.endpoint, receive.request_id, receive.length);
        let send = self.start_send_of(endpoint, Leases::None, 1);
        self.actions.push_back(Action::Acknowledge {
            endpoint,
            send,
            request_id,
            length,
        });
    }
}

#[cfg(test)]
mod tests {
    use rdmareg_core::Access;

    use super::super::{OwnerConfig, UnmapStatus};
    use super::*;

    const CAP: [u8; 16] = [7; 16];
    const BASE: u64 = 0x10_000;
    const LEN: u64 = 0x1000;
    /// Registered read-write, write-only and read-only.
    const RW: u64 = 1;
    const WO: u64 = 2;
    const RO: u64 = 3;

    fn owner(bound: u32) -> Owner<u64> {
        let mut owner = Owner::new(OwnerConfig {
            max_replies_per_endpoint: bound,
            ..OwnerConfig::default()
        });
        owner
            .register_with_access(RW, CAP, BASE, LEN, Access::ReadWrite)
            .unwrap();
        owner
            .register_with_access(WO, CAP, BASE + LEN, LEN, Access::Write)
            .unwrap();
        owner.register(RO, CAP, BASE + 2 * LEN, LEN).unwrap();
        owner
    }

    fn write(region: u64, address: u64, length: u64) -> Write {
        Write {
            request_id: 9,
            region,
            capability: CAP,
            address,
            length,
        }
    }

    fn base(region: u64) -> u64 {
        BASE + (region - 1) * LEN
    }

    fn actions(owner: &mut Owner<u64>) -> Vec<Action<u64>> {
        std::iter::from_fn(|| owner.poll_action()).collect()
    }

    /// The receive an accepted write asks for.
    fn accepted(owner: &mut Owner<u64>, endpoint: u64, write: Write) -> ReceiveId {
        owner.handle_write(endpoint, write, write.length);
        match actions(owner)[..] {
            [
                Action::Receive {
                    endpoint: to,
                    receive,
                    request_id,
                    region,
                    address,
                    length,
                    payload_offset: 0,
                },
            ] => {
                assert_eq!((to, request_id), (endpoint, write.request_id));
                assert_eq!(
                    (region, address, length),
                    (write.region, write.address, write.length)
                );
                receive
            }
            ref other => panic!("a receive expected, got {other:?}"),
        }
    }

    fn refusal_of(owner: &mut Owner<u64>, write: Write, payload_length: u64) -> Refusal {
        owner.handle_write(1, write, payload_length);
        match actions(owner)[..] {
            [Action::Refuse { refusal, send, .. }] => {
                owner.send_completed(send);
                refusal
            }
            ref other => panic!("a refusal expected, got {other:?}"),
        }
    }

    /// An accepted write holds its region while its bytes are received;
    /// the acknowledgement follows the receive, and its send holds the
    /// endpoint's place, not the region.
    #[test]
    fn a_write_is_acknowledged_after_its_receive() {
        let mut owner = owner(4);
        let receive = accepted(&mut owner, 5, write(RW, BASE + 8, 16));
        assert_eq!(owner.region_leases(RW), Some(1));
        assert_eq!(owner.receives_in_flight(), 1);
        assert_eq!(owner.load(5).served, 1);
        assert!(owner.receive_completed(receive));
        assert!(!owner.receive_completed(receive), "a receive ends once");
        let [
            Action::Acknowledge {
                endpoint: 5,
                send,
                request_id: 9,
                length: 16,
            },
        ] = actions(&mut owner)[..]
        else {
            panic!("acknowledged");
        };
        assert_eq!(owner.region_leases(RW), Some(0));
        assert_eq!(owner.load(5).served, 1, "the reply holds the place");
        owner.send_completed(send);
        assert_eq!(owner.endpoints(), 0);
    }

    /// Each wrong write gets its refusal and no receive: the capability is
    /// judged before access, access before state and range, the payload's
    /// length last.
    #[test]
    fn a_wrong_write_is_refused_and_receives_nothing() {
        let mut owner = owner(4);
        let mut forged = write(RO, base(RO), 1);
        forged.capability[0] ^= 1;
        for (write, payload, refusal) in [
            (write(9, BASE, 1), 1, Refusal::RegionUnknown),
            (forged, 1, Refusal::CapabilityMismatch),
            (write(RO, base(RO), 1), 1, Refusal::AccessDenied),
            (write(RO, 0, u64::MAX), 7, Refusal::AccessDenied),
            (write(RW, BASE + LEN - 1, 2), 2, Refusal::OutOfRange),
            (write(RW, BASE, 0), 0, Refusal::OutOfRange),
            (write(RW, u64::MAX, 2), 2, Refusal::OutOfRange),
            (write(WO, base(WO), 8), 7, Refusal::Malformed),
            (write(WO, base(WO), 8), 9, Refusal::Malformed),
        ] {
            assert_eq!(refusal_of(&mut owner, write, payload), refusal, "{write:?}");
        }
        assert_eq!(owner.receives_in_flight(), 0);
        assert_eq!(owner.region_leases(RO), Some(0));
        let mut bytes = wire::encode_write_request(&write(RW, BASE, 1));
        bytes[0] = 7;
        owner.handle_write_request(1, &bytes, 1);
        assert!(matches!(
            actions(&mut owner)[..],
            [Action::Refuse {
                refusal: Refusal::Malformed,
                request_id: 9,
                ..
            }]
        ));
    }

    /// A write-only registration refuses reads as access denied, but only
    /// to a peer that holds its capability.
    #[test]
    fn a_write_only_region_refuses_reads() {
        let owner = owner(4);
        let read = write(WO, base(WO), 4).as_read();
        assert_eq!(owner.check_read(&read), Err(Refusal::AccessDenied));
        let forged = Read {
            capability: [0; 16],
            ..read
        };
        assert_eq!(owner.check_read(&forged), Err(Refusal::CapabilityMismatch));
        let read = Read {
            region: RW,
            address: BASE,
            ..read
        };
        assert!(owner.check_read(&read).is_ok(), "read-write serves reads");
    }

    /// An unmap waits for a write's receive; writes after it started are
    /// refused; a failed receive ends the hold too, answered as failed.
    #[test]
    fn an_unmap_waits_for_every_receive() {
        let mut owner = owner(4);
        let first = accepted(&mut owner, 1, write(RW, BASE, 8));
        let second = accepted(&mut owner, 2, write(RW, BASE + 8, 8));
        assert_eq!(owner.unmap(RW), UnmapStatus::Waiting);
        assert_eq!(
            refusal_of(&mut owner, write(RW, BASE, 8), 8),
            Refusal::Deregistering
        );
        owner.receive_completed(first);
        assert!(matches!(
            actions(&mut owner)[..],
            [Action::Acknowledge { .. }]
        ));
        owner.receive_failed(second);
        assert!(matches!(
            actions(&mut owner)[..],
            [
                Action::Refuse {
                    endpoint: 2,
                    refusal: Refusal::ReceiveFailed,
                    ..
                },
                Action::Unmapped { region: RW }
            ]
        ));
    }

    /// Accepted writes count under the endpoint's bound until their reply
    /// ended: past it a write is busy, and another endpoint is not.
    #[test]
    fn writes_count_under_the_bound() {
        let mut owner = owner(1);
        let receive = accepted(&mut owner, 1, write(RW, BASE, 8));
        assert_eq!(refusal_of(&mut owner, write(RW, BASE, 8), 8), Refusal::Busy);
        accepted(&mut owner, 2, write(RW, BASE, 8));
        owner.receive_completed(receive);
        let [Action::Acknowledge { send, .. }] = actions(&mut owner)[..] else {
            panic!("acknowledged");
        };
        assert_eq!(refusal_of(&mut owner, write(RW, BASE, 8), 8), Refusal::Busy);
        owner.send_completed(send);
        accepted(&mut owner, 1, write(RW, BASE, 8));
    }

    /// A failed endpoint's receive still holds its region until the
    /// transport ends it, and is then not answered.
    #[test]
    fn a_failed_endpoints_receive_ends_unanswered() {
        let mut owner = owner(4);
        let receive = accepted(&mut owner, 1, write(RW, BASE, 8));
        owner.endpoint_failed(1);
        owner.handle_write(1, write(RW, BASE, 8), 8);
        assert_eq!(actions(&mut owner), [], "dropped");
        owner.unmap(RW);
        assert_eq!(actions(&mut owner), [], "the receive still writes");
        owner.receive_failed(receive);
        assert_eq!(actions(&mut owner), [Action::Unmapped { region: RW }]);
        assert_eq!(owner.endpoints(), 0);
    }

    /// Shutdown waits for receives; the transport's close ends them,
    /// unanswered, and the owner drains.
    #[test]
    fn a_closed_transport_ends_every_receive() {
        let mut owner = owner(4);
        accepted(&mut owner, 1, write(RW, BASE, 8));
        owner.shutdown();
        let unmapped = actions(&mut owner);
        assert_eq!(
            unmapped,
            [
                Action::Unmapped { region: WO },
                Action::Unmapped { region: RO }
            ]
        );
        owner.transport_closed();
        assert_eq!(
            actions(&mut owner),
            [Action::Unmapped { region: RW }, Action::Drained]
        );
        assert_eq!(owner.receives_in_flight(), 0);
        assert_eq!(owner.endpoints(), 0);
    }

    /// A completed receive lists its range, coalesced with its neighbours,
    /// even when its endpoint failed meanwhile; a refused write lists
    /// nothing, a failed receive takes its range out; a take empties the
    /// log, and the log ends with the registration.
    #[test]
    fn completed_receives_are_listed_and_nothing_else() {
        let mut owner = owner(8);
        let first = accepted(&mut owner, 1, write(RW, BASE, 8));
        let second = accepted(&mut owner, 1, write(RW, BASE + 8, 8));
        let third = accepted(&mut owner, 2, write(RW, BASE + 32, 8));
        let failed = accepted(&mut owner, 3, write(RW, BASE + 100, 8));
        assert_eq!(
            refusal_of(&mut owner, write(RO, base(RO), 8), 8),
            Refusal::AccessDenied
        );
        assert_eq!(
            refusal_of(&mut owner, write(RW, BASE + LEN - 4, 8), 8),
            Refusal::OutOfRange
        );
        owner.receive_completed(first);
        owner.endpoint_failed(1);
        owner.receive_completed(second);
        owner.receive_completed(third);
        owner.receive_failed(failed);
        actions(&mut owner);
        let taken = owner.take_written(RW).unwrap();
        assert_eq!(taken.ranges, [0..16, 32..40]);
        assert!(!taken.incomplete);
        assert!(owner.take_written(RW).unwrap().is_empty());
        assert!(owner.take_written(RO).unwrap().is_empty());
        let overwritten = accepted(&mut owner, 2, write(RW, BASE, 16));
        owner.receive_completed(overwritten);
        actions(&mut owner);
        let failed = accepted(&mut owner, 2, write(RW, BASE + 4, 4));
        owner.receive_failed(failed);
        assert_eq!(owner.take_written(RW).unwrap().ranges, [0..4, 8..16]);
        owner.unmap(RW);
        assert_eq!(owner.take_written(RW), None);
    }

    /// Past its bound of disjoint ranges the log leaves a write out and
    /// says it is incomplete; it never lists a gap.
    #[test]
    fn a_full_written_log_says_it_is_incomplete() {
        let mut owner = Owner::new(OwnerConfig {
            max_replies_per_endpoint: 8,
            max_written_ranges: 2,
        });
        owner
            .register_with_access(RW, CAP, BASE, LEN, Access::Write)
            .unwrap();
        for offset in [0, 16, 32, 8] {
            let receive = accepted(&mut owner, 1, write(RW, BASE + offset, 8));
            owner.receive_completed(receive);
            let [Action::Acknowledge { send, .. }] = actions(&mut owner)[..] else {
                panic!("acknowledged");
            };
            owner.send_completed(send);
        }
        let taken = owner.take_written(RW).unwrap();
        assert_eq!((taken.ranges.len(), taken.covers(0..24)), (1, true));
        assert!(taken.incomplete);
    }

    /// The acknowledgement's UCX header is a served reply header of the
    /// written length, with no payload to follow.
    #[test]
    fn an_acknowledgement_has_a_served_reply_header() {
        let mut owner = owner(4);
        let receive = accepted(&mut owner, 1, write(RW, BASE, 8));
        owner.receive_completed(receive);
        let action = actions(&mut owner).remove(0);
        let header = action.reply_header().expect("a header");
        assert_eq!(
            wire::Reply::decode(&header),
            Ok(wire::Reply {
                request_id: 9,
                outcome: Ok(8)
            })
        );
    }
}
