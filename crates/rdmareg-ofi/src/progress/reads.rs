//! This engine's own reads, from submission until they complete.
//!
//! A read is checked against its destination region and the owner's key;
//! a batch's small reads of one owner are batched into list requests; the
//! reply receive is posted before the request; a read asks again or sends
//! again on a new connection when the owner says so or the connection was
//! closed; past its deadline its receive is cancelled. The consumer
//! machine (`Engine::consumer`) completes a read only once the provider
//! ended its reply receive ([`Engine::provider_released`]), and a read sent
//! again posts its new receive only then.

use std::ffi::c_void;
use std::rc::Rc;
use std::time::Instant;

use futures::channel::oneshot;
use rdmareg_core::{BackendGet, RdmaError};
use rdmareg_engine::served::consumer::TimeoutAction;

use crate::fabric::ERR_NOT_CONNECTED;
use crate::key::{CAPABILITY_LEN, KeyKind, PackedKey};
use crate::protocol::{
    GATHER_ENTRY_MAX, GATHER_TOTAL_MAX, ListEntry, ListRequest, MAX_LIST_ENTRIES, REPLY_IGNORE,
    REQUEST_ID_MASK, REQUEST_TAG, ReadRequest, parse_gathered, reply_outcome,
};

use super::*;

impl Engine {
    /// Validates and posts one read; on refusal hands the waiter back with
    /// the error.
    pub(super) fn post(
        &mut self,
        request: BackendGet,
        waiter: Waiter,
    ) -> Result<(), (Waiter, RdmaError)> {
        let checked = self.check(&request);
        let (fi_addr, target, key, buf, desc, served) = match checked {
            Ok(found) => found,
            Err(err) => return Err((waiter, err)),
        };
        let request_bytes = served.map(|(region_id, capability)| {
            let request_id = self.mint_request_id();
            let wire = ReadRequest {
                request_id,
                region_id,
                capability,
                address: request.remote_addr,
                length: request.len,
                reply_to: self.fabric.address.to_vec(),
            }
            .encode();
            (request_id, wire)
        });
        let deadline = Instant::now()
            + request
                .deadline
                .unwrap_or(self.settings.default_get_deadline);
        if let Some(region) = self.regions.get_mut(&request.local_region_id) {
            region.in_flight += 1;
        }
        let op = Op {
            region: request.local_region_id,
            waiter: Some(waiter),
            remote: target,
            key,
            request_id: request_bytes.as_ref().map_or(0, |(id, _)| *id),
            // Only an owner whose provider names senders replies "ask
            // again", and both ends use the same provider.
            ask_again: if self.fabric.reports_source {
                request_bytes.clone()
            } else {
                None
            },
            asks_left: ASKS_AGAIN,
            request: request_bytes,
            ..Op::new(fi_addr, buf, request.len as usize, desc)
        };
        self.start_op(op, deadline);
        Ok(())
    }

    /// A request id not in use (below 2⁴⁸, never 0) that no other peer can
    /// guess: the next value of a counter, through a secret permutation.
    /// An owner replies at the address a request names, so with guessable
    /// ids a third peer could ask, in a victim's name, for a read with the
    /// victim's next id, and the victim's receive would take the reply.
    pub(super) fn mint_request_id(&mut self) -> u64 {
        loop {
            let counter = self.next_request_id;
            self.next_request_id = (self.next_request_id + 1) & REQUEST_ID_MASK;
            if self.next_request_id == 0 {
                self.next_request_id = 1;
            }
            // Distinct counters give distinct ids: a permutation.
            let request_id = self.request_ids.permute(counter);
            if request_id != 0 {
                return request_id;
            }
        }
    }

    /// Enters a checked read (or list) into the op table and the consumer
    /// machine (due by `deadline`; the transport holds its destination from
    /// the receive on, so only [`Engine::provider_released`] ends it) and
    /// posts it,
    /// queues it while the provider asks to wait, or ends it.
    pub(super) fn start_op(&mut self, mut op: Op, deadline: Instant) {
        let slot = self.free_slots.pop().unwrap_or_else(|| {
            self.ops.push(None);
            self.ops.len() - 1
        });
        let endpoint = self.av.get(&op.fi_addr).map_or(0, |entry| entry.endpoint);
        op.read = self
            .consumer
            .start_receiving(endpoint, op.len as u64, deadline, slot);
        let context_addr = (&raw const *op.context) as usize;
        let fi_addr = op.fi_addr;
        self.ops[slot] = Some(op);
        self.by_context.insert(context_addr, slot);
        if let Some(entry) = self.av.get_mut(&fi_addr) {
            entry.ops += 1;
        }
        match self.try_post(slot) {
            Ok(true) => {}
            Ok(false) => self.unposted.push_back(slot),
            Err(err) => self.provider_released(slot, Err(err)),
        }
    }

    /// Posts a batch. On the served path its small reads (at most
    /// `GATHER_ENTRY_MAX`) of one owner go as lists of up to
    /// `MAX_LIST_ENTRIES` entries and `GATHER_TOTAL_MAX` bytes, each
    /// returned in one reply; every entry is checked here as a single read
    /// is, and has its own result.
    pub(super) fn post_batch(
        &mut self,
        requests: Vec<BackendGet>,
        reply: oneshot::Sender<Vec<Result<(), RdmaError>>>,
    ) {
        if requests.is_empty() {
            let _ = reply.send(Vec::new());
            return;
        }
        let batch = BatchResults::new(requests.len(), reply);
        // Scratch receives need no registration only where the provider
        // needs no local descriptors.
        let batch_lists = self.owner_served() && !self.fabric.needs_local_desc();
        let mut groups: Vec<(u64, Vec<ListCandidate>)> = Vec::new();
        for (index, request) in requests.into_iter().enumerate() {
            let waiter = Waiter::Batch(Rc::clone(&batch), index);
            // An entry that cannot share a reply with another is not
            // worth a list.
            let small =
                request.len <= GATHER_ENTRY_MAX && (request.len as usize) < self.list_reply_max / 2;
            if batch_lists && small {
                match self.check(&request) {
                    Ok((fi_addr, _, _, buf, _, Some((region_id, capability)))) => {
                        let entry = ListCandidate {
                            request,
                            waiter,
                            buf,
                            region_id,
                            capability,
                        };
                        match groups.iter_mut().find(|(at, _)| *at == fi_addr) {
                            Some((_, group)) => group.push(entry),
                            None => groups.push((fi_addr, vec![entry])),
                        }
                        continue;
                    }
                    Ok(_) => {}
                    Err(err) => {
                        complete(waiter, Err(err));
                        continue;
                    }
                }
            }
            if let Err((waiter, err)) = self.post(request, waiter) {
                complete(waiter, Err(err));
            }
        }
        for (fi_addr, group) in groups {
            let mut list = Vec::new();
            let mut total = 0;
            for entry in group {
                // The reply: a status byte per entry and their bytes.
                let grown = total + entry.request.len as usize;
                if list.len() == MAX_LIST_ENTRIES
                    || grown > GATHER_TOTAL_MAX as usize
                    || list.len() + 1 + grown > self.list_reply_max
                {
                    self.post_list(fi_addr, std::mem::take(&mut list));
                    total = 0;
                }
                total += entry.request.len as usize;
                list.push(entry);
            }
            self.post_list(fi_addr, list);
        }
    }

    /// Posts checked entries of one owner as one list (a lone entry as a
    /// single read).
    pub(super) fn post_list(&mut self, fi_addr: u64, mut entries: Vec<ListCandidate>) {
        if entries.len() <= 1 {
            if let Some(entry) = entries.pop() {
                if let Err((waiter, err)) = self.post(entry.request, entry.waiter) {
                    complete(waiter, Err(err));
                }
            }
            return;
        }
        let request_id = self.mint_request_id();
        let request = ListRequest {
            request_id,
            entries: entries
                .iter()
                .map(|entry| ListEntry {
                    region_id: entry.region_id,
                    capability: entry.capability,
                    address: entry.request.remote_addr,
                    length: entry.request.len,
                })
                .collect(),
            reply_to: self.fabric.address.to_vec(),
        };
        let reply_len = request.reply_len();
        let wire = request.encode();
        let now = Instant::now();
        let default = self.settings.default_get_deadline;
        let deadline = entries
            .iter()
            .map(|entry| now + entry.request.deadline.unwrap_or(default))
            .min()
            .unwrap_or(now + default);
        let mut scratch = vec![0u8; reply_len];
        let buf = scratch.as_mut_ptr() as usize;
        let mut items = Vec::with_capacity(entries.len());
        for entry in entries {
            let region = entry.request.local_region_id;
            if let Some(held) = self.regions.get_mut(&region) {
                held.in_flight += 1;
            }
            items.push(ListItem {
                waiter: Some(entry.waiter),
                region,
                buf: entry.buf,
                len: entry.request.len as usize,
                result: None,
            });
        }
        let op = Op {
            list: Some(Box::new(ListPart {
                entries: items,
                scratch,
            })),
            request_id,
            request: Some((request_id, wire)),
            ..Op::new(fi_addr, buf, reply_len, std::ptr::null_mut())
        };
        self.start_op(op, deadline);
    }

    /// A list's reply arrived (`len` bytes, tag `tag`): checks that it adds
    /// up and copies each served entry into its destination. An error ends
    /// every entry that has no result of its own.
    pub(super) fn copy_list_reply(
        &mut self,
        slot: usize,
        len: usize,
        tag: u64,
    ) -> Result<(), RdmaError> {
        reply_outcome(tag)?;
        let Some(list) = self.ops[slot].as_mut().and_then(|op| op.list.as_mut()) else {
            return Ok(());
        };
        let lengths: Vec<u64> = list.entries.iter().map(|item| item.len as u64).collect();
        let outcomes = list
            .scratch
            .get(..len)
            .and_then(|received| parse_gathered(received, &lengths))
            .ok_or_else(|| {
                RdmaError::backend(format!(
                    "ofi: the owner's list reply of {len} bytes does not add up to its \
                     {} entries; nothing of it was written",
                    lengths.len()
                ))
            })?;
        for (item, outcome) in list.entries.iter_mut().zip(outcomes) {
            item.result = Some(outcome.map(|at| {
                // SAFETY: `parse_gathered` checked `at + item.len` lies
                // within the `len` bytes received into `scratch`; `item.buf`
                // and `item.len` lie inside the item's destination region
                // (checked against the mapped pointer and length), which
                // stays registered while its `in_flight` counts this list,
                // and the caller of `get` leaves it alone until it completes.
                // The provider is done with `scratch`: its receive completed.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        list.scratch.as_ptr().add(at),
                        item.buf as *mut u8,
                        item.len,
                    );
                }
            }));
        }
        Ok(())
    }

    /// Everything a read is checked against before libfabric sees it; for
    /// an owner-served key (a lease key among them, on either path) also
    /// the region id and capability to ask with.
    #[allow(clippy::type_complexity)]
    pub(super) fn check(
        &self,
        request: &BackendGet,
    ) -> Result<
        (
            u64,
            u64,
            u64,
            usize,
            *mut c_void,
            Option<(u64, [u8; CAPABILITY_LEN])>,
        ),
        RdmaError,
    > {
        if request.len == 0 {
            return Err(RdmaError::OutOfRange);
        }
        let fi_addr = *self
            .peers
            .get(&request.peer)
            .ok_or(RdmaError::NotConfigured)?;
        let (key, kind) = PackedKey::decode_any(&request.packed_key)?;
        let owner = self.av.get(&fi_addr).map(|entry| &entry.address);
        if owner != Some(&key.owner) {
            // A key of another owner than the peer named.
            return Err(RdmaError::InvalidKey);
        }
        if kind == KeyKind::Registration && key.owner_served != self.owner_served() {
            // A key of the other read path: this engine cannot use it. (A
            // lease key is owner-served on either path: `leases`.)
            return Err(RdmaError::InvalidKey);
        }
        let target = key.target(request.remote_addr, request.len)?;
        let region = self
            .regions
            .get(&request.local_region_id)
            .filter(|region| !region.unmapping)
            .ok_or(RdmaError::RegionNotFound)?;
        let end = request
            .local_offset
            .checked_add(request.len)
            .ok_or(RdmaError::OutOfRange)?;
        if end > region.len as u64 {
            return Err(RdmaError::OutOfRange);
        }
        let buf = region.ptr + request.local_offset as usize;
        let served = key.owner_served.then_some((key.region_id, key.capability));
        Ok((fi_addr, target, key.mr_key, buf, region.mr.desc, served))
    }

    pub(super) fn try_post(&mut self, slot: usize) -> Result<bool, RdmaError> {
        let Some(op) = self.ops[slot].as_mut() else {
            return Ok(true);
        };
        let context = (&raw mut op.context.space).cast::<c_void>();
        if let Some((request_id, _)) = &op.request {
            // SAFETY: as below: the destination range stays registered
            // while `in_flight` counts this read, and the context box lives
            // in the op table until the receive's completion is read or the
            // endpoint is closed.
            let posted = unsafe {
                self.fabric.trecv(
                    op.buf,
                    op.len,
                    op.desc,
                    op.fi_addr,
                    *request_id,
                    REPLY_IGNORE,
                    context,
                )
            }?;
            op.posted = posted;
            if posted {
                // The receive is posted: now ask.
                let (request_id, wire) = op.request.take().unwrap_or_default();
                let send = SendOp {
                    for_read: Some((context as usize, request_id)),
                    ..SendOp::owning(op.fi_addr, REQUEST_TAG, wire)
                };
                self.queue_send(send);
            }
            return Ok(posted);
        }
        // SAFETY: `buf..buf+len` lies inside the destination region (checked
        // against the mapped pointer and length), which stays registered
        // while `in_flight` counts this read (unmaps wait); the context box
        // lives in the op table until the completion is read or the
        // endpoint is closed.
        let posted = unsafe {
            self.fabric.read(
                op.buf, op.len, op.desc, op.fi_addr, op.remote, op.key, context,
            )
        }?;
        op.posted = posted;
        Ok(posted)
    }

    pub(super) fn retry_unposted(&mut self) -> bool {
        let mut worked = false;
        for _ in 0..self.unposted.len() {
            let Some(slot) = self.unposted.pop_front() else {
                break;
            };
            match self.try_post(slot) {
                Ok(true) => worked = true,
                Ok(false) => {
                    self.unposted.push_front(slot);
                    break;
                }
                Err(err) => {
                    worked = true;
                    self.provider_released(slot, Err(err));
                }
            }
        }
        worked
    }

    /// Posts a receive into scratch memory for the reply (or refusal) of
    /// `request_id`, so the owner's send of it completes and its lease
    /// ends. (A truncating zero-length receive is not enough: measured on
    /// shm, a large send truncated that way never completes.)
    pub(super) fn post_discard(&mut self, fi_addr: u64, request_id: u64, len: usize) {
        if (self.closing && !self.withdrawing) || self.fabric.needs_local_desc() {
            return;
        }
        let held = self.discard_bytes.get(&fi_addr).copied().unwrap_or(0);
        // Withdrawing at teardown, every read in flight gets one: that is
        // bounded by the reads in flight, and an owner of the process waits
        // for its reply to be taken (see `withdraw_for_parking`).
        if !self.withdrawing && held > 0 && held + len > DISCARD_BYTES_PER_PEER {
            tracing::debug!(
                request_id,
                held,
                "this owner's late replies already have their scratch budget; the owner keeps \
                 this reply's lease until the connection ends"
            );
            return;
        }
        let mut context = Box::new(OpContext {
            space: [std::ptr::null_mut(); 8],
        });
        let mut scratch = vec![0u8; len];
        let at = (&raw const *context) as usize;
        let space = (&raw mut context.space).cast::<c_void>();
        // SAFETY: the scratch buffer and the context box stay in `discards`
        // until the receive's completion is read or the endpoint is closed;
        // the provider needs no descriptor for local buffers.
        let posted = unsafe {
            self.fabric.trecv(
                scratch.as_mut_ptr() as usize,
                len,
                std::ptr::null_mut(),
                fi_addr,
                request_id,
                REPLY_IGNORE,
                space,
            )
        };
        match posted {
            Ok(true) => {
                self.discards.insert(at, (context, scratch));
                self.discard_owners.insert(at, (fi_addr, len));
                *self.discard_bytes.entry(fi_addr).or_default() += len;
            }
            Ok(false) | Err(_) => {
                tracing::debug!(
                    request_id,
                    "could not post a discard receive; the owner keeps its lease until teardown"
                );
            }
        }
    }

    /// The provider let go of the destination of the read in `slot` (or
    /// never had it), with `result`: the consumer machine completes it (its
    /// deadline or teardown may turn an error into `Timeout` or
    /// `ShuttingDown`).
    pub(super) fn provider_released(&mut self, slot: usize, result: Result<(), RdmaError>) {
        if let Some(op) = &self.ops[slot] {
            self.consumer.released(op.read, result);
        }
        self.complete_reads();
    }

    /// Completes every read the consumer machine has finished.
    pub(super) fn complete_reads(&mut self) {
        while let Some(completion) = self.consumer.poll_completion() {
            self.finish(completion.payload, completion.outcome);
        }
    }

    /// Ends a completed read: releases its destination and address-vector
    /// hold, and sends its caller the result.
    fn finish(&mut self, slot: usize, result: Result<(), RdmaError>) {
        let Some(op) = self.ops[slot].take() else {
            return;
        };
        self.free_slots.push(slot);
        self.by_context.remove(&((&raw const *op.context) as usize));
        self.release_hold(op.region);
        self.release_av(op.fi_addr, |entry| entry.ops -= 1);
        if let Some(waiter) = op.waiter {
            complete(waiter, result.clone());
        }
        if let Some(list) = op.list {
            for mut item in list.entries {
                self.release_hold(item.region);
                if let Some(waiter) = item.waiter.take() {
                    complete(waiter, item.result.take().unwrap_or_else(|| result.clone()));
                }
            }
        }
    }

    /// The owner could not name the sender of this read's request and
    /// refused it as unverified; its receive ended with that refusal. Posts
    /// the receive and sends the request once more (same id), unless it
    /// asked again [`ASKS_AGAIN`] times already or is past its deadline.
    /// Returns whether it will be.
    pub(super) fn ask_again(&mut self, slot: usize) -> bool {
        let Some(op) = self.ops[slot].as_mut() else {
            return false;
        };
        let ended = op.expired_at.is_some() || op.failure.is_some() || op.request_failed;
        if ended || self.closing || op.asks_left == 0 {
            return false;
        }
        op.asks_left -= 1;
        let request = if op.asks_left == 0 {
            op.ask_again.take()
        } else {
            op.ask_again.clone()
        };
        let Some(request) = request else {
            return false;
        };
        tracing::debug!(
            request = request.0,
            "the owner could not name this engine as the sender; asking again"
        );
        op.request = Some(request);
        op.posted = false;
        self.unposted.push_back(slot);
        true
    }

    /// Reads the consumer machine finds past their deadline have their
    /// receive cancelled (they fail with `Timeout` once the provider gave
    /// it back); a read never posted ends at once. A read held
    /// [`STALLED_AFTER`] past its deadline has its owner's connection
    /// reset where that ends it.
    pub(super) fn expire(&mut self, now: Instant) {
        for TimeoutAction::StopTransfer { read, .. } in self.consumer.handle_timeout(now) {
            let Some(&slot) = self.consumer.payload(read) else {
                continue;
            };
            let Some(op) = self.ops[slot].as_mut() else {
                continue;
            };
            op.expired_at = Some(now);
            if op.posted {
                let context = (&raw mut op.context.space).cast::<c_void>();
                self.fabric.cancel(context);
            } else {
                self.unposted.retain(|&s| s != slot);
                self.provider_released(slot, Err(RdmaError::Timeout));
            }
        }
        if !self.fabric.av_remove_closes {
            return;
        }
        let mut stalled = Vec::new();
        for op in self.ops.iter().flatten() {
            let held = op.expired_at.is_some_and(|at| now >= at + STALLED_AFTER);
            if held && op.posted && !op.connection_reset && !stalled.contains(&op.fi_addr) {
                stalled.push(op.fi_addr);
            }
        }
        for fi_addr in stalled {
            self.reset_connection(fi_addr);
        }
    }

    /// The request of the read in `slot` failed to send (`code`); returns
    /// whether the read will send again (if not, the caller fails it).
    ///
    /// Over `tcp;ofi_rxm` with `FI_AV_REMOVE_CLEANUP`, an owner that forgets
    /// a consumer closes its connection, and the consumer's sends on it fail
    /// with `FI_ENOTCONN` for good. So the owner's address-vector entry is
    /// reset (`Engine::reconnect`), once per connection, and the read sends
    /// its request again ([`RESENDS`] times at most) once its cancelled reply
    /// receive was given back, since the provider may write the destination
    /// until then. A send that failed otherwise on a connection reset since
    /// it was posted is sent again the same way.
    pub(super) fn resend_on_new_connection(
        &mut self,
        slot: usize,
        code: i32,
        send: SendOp,
    ) -> bool {
        if !self.fabric.av_remove_closes || self.closing {
            return false;
        }
        let current = self.av.get(&send.dest).map(|entry| entry.connection);
        let not_connected = code == ERR_NOT_CONNECTED;
        if not_connected && current.is_some() && current == send.connection {
            tracing::debug!(
                fi_addr = send.dest,
                "a read request found its owner's connection closed; resetting it"
            );
            self.reconnect(send.dest);
        }
        let reset_since = matches!(
            (current, send.connection),
            (Some(now), Some(then)) if now > then
        );
        if !not_connected && !reset_since {
            return false;
        }
        let Some(op) = self.ops[slot].as_mut() else {
            return false;
        };
        if op.expired_at.is_some() || op.failure.is_some() || op.resends_left == 0 {
            return false;
        }
        let Some((read, request_id)) = send.for_read else {
            return false;
        };
        let Some(wire) = send._bytes else {
            return false;
        };
        op.resends_left -= 1;
        op.resend = Some((request_id, wire));
        // No reply comes to a request that was not sent: the cancelled
        // receive gets no discard receive.
        op.request_failed = true;
        self.fabric.cancel(read as *mut c_void);
        true
    }
}
