//! Peers and their address-vector entries, and peers that stop replying.
//!
//! Covers adding and removing peers, the consumer addresses an owner
//! inserts for its replies (one spelling each, bounded, idle ones forgotten
//! when the table is full), naming a request's sender, and probes,
//! unreachable peers and connection resets. An entry is removed once no
//! peer id, read or reply refers to it (`Engine::release_av`). Where the
//! provider names senders by entry number, a number removed while connected
//! is remembered as stale, because the provider may still name the old
//! connection by it after a later insert reuses it (`Engine::sender_of`).

use std::ffi::c_void;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rdmareg_core::{PeerId, RdmaError};
use rdmareg_engine::served::EndpointLoad;

use crate::fabric::Completion;
use crate::key::validate_address;
use crate::protocol::{PROBE, REQUEST_TAG};

use super::*;

impl Engine {
    pub(super) fn add_peer(&mut self, peer: PeerId, address: Bytes) -> Result<(), RdmaError> {
        validate_address(self.fabric.address_format, &address)?;
        let fi_addr = match self.by_address.get(&address) {
            Some(&fi_addr) => fi_addr,
            None => self.insert_address(address, false)?,
        };
        if let Some(entry) = self.av.get_mut(&fi_addr) {
            entry.peers += 1;
        }
        if let Some(previous) = self.peers.insert(peer, fi_addr) {
            self.release_av(previous, |entry| entry.peers -= 1);
        }
        Ok(())
    }

    pub(super) fn remove_peer(&mut self, peer: PeerId) {
        if let Some(fi_addr) = self.peers.remove(&peer) {
            self.release_av(fi_addr, |entry| entry.peers -= 1);
        }
    }

    /// Applies `change` to an entry and removes it once nobody uses it.
    pub(super) fn release_av(&mut self, fi_addr: u64, change: impl FnOnce(&mut AvEntry)) {
        let Some(entry) = self.av.get_mut(&fi_addr) else {
            return;
        };
        change(entry);
        if entry.peers == 0 && entry.ops == 0 && !entry.served {
            if let Some(entry) = self.av.remove(&fi_addr) {
                self.by_address.remove(&entry.address);
                if entry.connected && self.fabric.reports_source && !self.fabric.av_remove_closes {
                    self.mark_stale(fi_addr, entry.address);
                }
            }
            self.watch.remove(&fi_addr);
            self.fabric.remove_peer(fi_addr);
        }
    }

    /// The address of the entry a request's completion names its sender
    /// by, as the address vector is now (`None`: not a request, not named,
    /// a provider that names no senders, or a number that may name a
    /// forgotten peer as well: see `stale_numbers`).
    pub(super) fn sender_of(&self, completion: &Completion) -> Option<Bytes> {
        match completion {
            Completion::Done(context, _, _, source)
                if self.fabric.reports_source
                    && self.request_buffers.contains_key(&(*context as usize))
                    && !self.stale_numbers.contains_key(source) =>
            {
                self.av.get(source).map(|entry| entry.address.clone())
            }
            _ => None,
        }
    }

    /// Records that the provider may go on naming `address`'s connection
    /// by `number`, removed from the address vector.
    pub(super) fn mark_stale(&mut self, number: u64, address: Bytes) {
        self.unmark_stale(&address);
        self.stale_addresses.insert(address.clone(), number);
        self.stale_numbers
            .entry(number)
            .or_default()
            .push(address.clone());
        self.stale_order.push_back(address);
        if self.stale_order.len() > self.served_peers_bound {
            if let Some(oldest) = self.stale_order.front().cloned() {
                self.unmark_stale(&oldest);
            }
        }
    }

    /// `address` is no longer named by a removed number; returns whether
    /// it was.
    pub(super) fn unmark_stale(&mut self, address: &Bytes) -> bool {
        let Some(old) = self.stale_addresses.remove(address) else {
            return false;
        };
        self.stale_order.retain(|held| held != address);
        if let Some(holders) = self.stale_numbers.get_mut(&old) {
            holders.retain(|held| held != address);
            if holders.is_empty() {
                self.stale_numbers.remove(&old);
            }
        }
        true
    }

    /// The completions of a batch name some senders by numbers that may
    /// also name forgotten peers: those requests get "ask again" (no
    /// lease), and the forgotten peers are inserted again, which renames
    /// their connections so the requests asked again are named right.
    pub(super) fn rename_stale_senders(&mut self, completions: &[Completion]) {
        let named: Vec<u64> = completions
            .iter()
            .filter_map(|completion| match completion {
                Completion::Done(context, _, _, source)
                    if self.request_buffers.contains_key(&(*context as usize))
                        && self.stale_numbers.contains_key(source) =>
                {
                    Some(*source)
                }
                _ => None,
            })
            .collect();
        for number in named {
            for address in self.stale_numbers.get(&number).cloned().unwrap_or_default() {
                if self.by_address.contains_key(&address) {
                    self.unmark_stale(&address);
                    continue;
                }
                tracing::debug!(
                    number,
                    "a request was named by the number of a forgotten peer; inserting that peer again"
                );
                match self.insert_address(address.clone(), true) {
                    Ok(_) => self.served_peers += 1,
                    Err(err) => {
                        self.unmark_stale(&address);
                        tracing::debug!(error = %err, "could not insert a forgotten peer again");
                    }
                }
            }
        }
    }

    /// Reads every completion the provider has ready, resolving request
    /// senders now, for the next `reap`: done before entries are removed
    /// from the address vector, whose numbers later inserts reuse, so that
    /// no completion written before the removal is read after it.
    pub(super) fn read_ahead_of_forgetting(&mut self) {
        if !self.fabric.reports_source {
            return;
        }
        let mut read = Vec::new();
        loop {
            let before = read.len();
            self.fabric
                .poll_completions(&mut read, before + COMPLETION_BATCH);
            if read.len() - before < COMPLETION_BATCH {
                break;
            }
        }
        for completion in read {
            let sender = self.sender_of(&completion);
            self.read_ahead.push((completion, sender));
        }
    }

    /// Probes peers this engine waits on and hears nothing from, and
    /// declares unreachable those no send could be posted to, and nothing
    /// completed with, for `unreachable_after`. Returns whether anything
    /// happened.
    pub(super) fn watch_peers(&mut self, now: Instant) -> bool {
        let waiting = self.consumer.in_flight() > 0 || self.writer.in_flight() > 0;
        if (self.owner_served() || self.writer.in_flight() > 0) && waiting {
            let waited_on: Vec<u64> = self
                .av
                .iter()
                .filter(|(_, entry)| entry.ops > 0)
                .map(|(&fi_addr, _)| fi_addr)
                .collect();
            for fi_addr in waited_on {
                let watch = self
                    .watch
                    .entry(fi_addr)
                    .or_insert_with(|| PeerWatch::new(now));
                let quiet = now.duration_since(watch.last_heard) >= PROBE_INTERVAL;
                let due = watch
                    .last_probe
                    .is_none_or(|at| now.duration_since(at) >= PROBE_INTERVAL);
                if quiet && due && !watch.probing {
                    watch.probing = true;
                    watch.last_probe = Some(now);
                    self.queue_send(SendOp {
                        probe: true,
                        ..SendOp::new(
                            fi_addr,
                            REQUEST_TAG,
                            PROBE.as_ptr() as usize,
                            PROBE.len(),
                            std::ptr::null_mut(),
                        )
                    });
                }
            }
        }
        let gone: Vec<(u64, Duration)> = self
            .watch
            .iter()
            .filter_map(|(&fi_addr, watch)| {
                // Blocked sends alone are not enough: under load a live
                // peer's sends wait for earlier ones (a full transmit
                // queue) while those complete.
                let since = watch.blocked_since?;
                let waited = now.duration_since(since);
                let quiet = now.duration_since(watch.last_heard);
                (waited >= self.unreachable_after && quiet >= self.unreachable_after)
                    .then_some((fi_addr, waited))
            })
            .collect();
        let worked = !gone.is_empty();
        for (fi_addr, waited) in gone {
            self.declare_unreachable(fi_addr, waited);
        }
        worked
    }

    /// Ends everything that waits on a peer no send could reach for
    /// `waited`: its queued sends (a reply's lease with it) and unposted
    /// reads; its posted reads are cancelled and fail once the provider
    /// reports the cancellation (or at their deadline or teardown).
    pub(super) fn declare_unreachable(&mut self, fi_addr: u64, waited: Duration) {
        let error = RdmaError::backend(format!(
            "ofi: the peer is unreachable: nothing could be sent to it for {} ms (its process \
             died, or its connection was lost and cannot be made again)",
            waited.as_millis()
        ));
        tracing::warn!(fi_addr, ?waited, "a peer is unreachable; its reads end");
        // (Not `Owner::endpoint_failed`: the entry outlives the peer's
        // process, and a peer restarted at the same address must be
        // served while replies to the old one are still unfinished.)
        let endpoint = self.endpoint_of(fi_addr);
        let stuck: Vec<usize> = self
            .unsent
            .iter()
            .copied()
            .filter(|at| self.sends.get(at).is_some_and(|send| send.dest == fi_addr))
            .collect();
        self.unsent.retain(|at| !stuck.contains(at));
        for at in stuck {
            self.send_done(at, Err((0, "the peer is unreachable".into())));
        }
        for read in self.consumer.endpoint_failed(endpoint, error.clone()) {
            let Some(&slot) = self.consumer.payload(read) else {
                continue;
            };
            let Some(op) = self.ops[slot].as_mut() else {
                continue;
            };
            op.failure = Some(error.clone());
            op.unreachable = true;
            if op.posted {
                let context = (&raw mut op.context.space).cast::<c_void>();
                self.fabric.cancel(context);
            } else {
                self.unposted.retain(|&s| s != slot);
                self.provider_released(slot, Err(error.clone()));
            }
        }
        // Writes to it fail now: those whose send ended, the queued ones
        // (above), and those the provider is still sending.
        self.writer.endpoint_failed(endpoint, error.clone());
        self.end_writes_sending_to(fi_addr, &error);
        self.watch.insert(fi_addr, PeerWatch::new(Instant::now()));
    }

    /// Inserts a validated address the table does not hold yet into the
    /// address vector and the table.
    pub(super) fn insert_address(
        &mut self,
        address: Bytes,
        served: bool,
    ) -> Result<u64, RdmaError> {
        let fi_addr = self.fabric.insert_peer(&address)?;
        self.next_endpoint += 1;
        // Inserted again, a connected address's record is renamed: the
        // number it was removed from no longer names it. It stays known as
        // connected, so that forgetting it again is recorded again.
        let connected = self.unmark_stale(&address);
        self.by_address.insert(address.clone(), fi_addr);
        self.av.insert(
            fi_addr,
            AvEntry {
                address,
                peers: 0,
                ops: 0,
                served,
                connected,
                connection: 0,
                endpoint: self.next_endpoint,
            },
        );
        Ok(fi_addr)
    }

    /// The address-vector entry to reply to a consumer at, inserted on first
    /// use (validated first; bounded by [`MAX_SERVED_PEERS`]).
    pub(super) fn served_peer(&mut self, claimed: &[u8]) -> Option<u64> {
        if let Err(err) = validate_address(self.fabric.address_format, claimed) {
            tracing::debug!(error = %err, "a read request with a malformed reply address was dropped");
            return None;
        }
        let address = canonical_address(self.fabric.address_format, claimed);
        if let Some(&fi_addr) = self.by_address.get(address.as_slice()) {
            if let Some(entry) = self.av.get_mut(&fi_addr) {
                if !entry.served {
                    entry.served = true;
                    self.served_peers += 1;
                }
            }
            return Some(fi_addr);
        }
        if self.served_peers >= self.served_peers_bound {
            self.forget_idle_consumers();
        }
        if self.served_peers >= self.served_peers_bound {
            tracing::warn!("too many consumer addresses; a read request was dropped");
            return None;
        }
        match self.insert_address(Bytes::from(address), true) {
            Ok(fi_addr) => {
                self.served_peers += 1;
                Some(fi_addr)
            }
            Err(err) => {
                tracing::debug!(error = %err, "could not insert a consumer's address");
                None
            }
        }
    }

    /// Forgets the consumer addresses no reply is unfinished to (entries
    /// also used as peers or by this engine's reads stay). Without this, the
    /// first [`MAX_SERVED_PEERS`] addresses named in requests, made-up ones
    /// included, would lock every later consumer out.
    ///
    /// Addresses no send ever completed to (made-up ones never do) go
    /// first, connected consumers only if the table is still full, because
    /// forgetting one disturbs its next requests over `tcp;ofi_rxm`:
    /// libfabric 1.17 keeps naming its connection by the removed number
    /// (`rxm_av_add_peers`), so such numbers are kept in `stale_numbers`
    /// and name nobody (`Engine::rename_stale_senders`). With
    /// `FI_AV_REMOVE_CLEANUP` the removal closes the connection instead: a
    /// request on its way is lost and its read fails at its deadline, and
    /// the consumer's next request is resent on a new connection
    /// (`Engine::resend_on_new_connection`). See `docs/ofi.md`, "Hostile
    /// peers".
    pub(super) fn forget_idle_consumers(&mut self) {
        self.read_ahead_of_forgetting();
        for connected in [false, true] {
            if self.served_peers < self.served_peers_bound {
                break;
            }
            let forgotten: Vec<u64> = self
                .av
                .iter()
                .filter(|(fi_addr, entry)| {
                    entry.served
                        && entry.connected == connected
                        && self.owner.load(entry.endpoint) == EndpointLoad::default()
                        && !self.gathered.contains_key(fi_addr)
                })
                .map(|(&fi_addr, _)| fi_addr)
                .collect();
            tracing::debug!(
                idle = forgotten.len(),
                connected,
                "the consumer address table is full: forgetting idle ones"
            );
            for fi_addr in forgotten {
                self.served_peers -= 1;
                self.release_av(fi_addr, |entry| entry.served = false);
            }
        }
    }

    /// A read from `fi_addr` is held past its deadline although its
    /// cancellation was asked: the provider matched its receive (over
    /// `tcp;ofi_rxm`, a stalled rendezvous reply). libfabric 1.17 withdraws
    /// a matched receive only with its connection, which `fi_av_remove`
    /// closes when `FI_AV_REMOVE_CLEANUP` is set; the read then fails with
    /// `Timeout`, the peer's other reads in flight fail, and the next read
    /// connects anew.
    pub(super) fn reset_connection(&mut self, fi_addr: u64) {
        for op in self.ops.iter_mut().flatten() {
            if op.fi_addr == fi_addr {
                op.connection_reset = true;
            }
        }
        if self.av.contains_key(&fi_addr) {
            tracing::debug!(
                fi_addr,
                "a read is held past its deadline; resetting its owner's connection"
            );
        }
        self.reconnect(fi_addr);
    }

    /// Removes entry `fi_addr` from the address vector and inserts its
    /// address again: with `FI_AV_REMOVE_CLEANUP` set the removal closes
    /// the peer's connection, ending what ran on it, and the next send to
    /// the address connects anew. Counts the reset in the entry's
    /// `connection`.
    pub(super) fn reconnect(&mut self, fi_addr: u64) {
        let Some(entry) = self.av.get_mut(&fi_addr) else {
            return;
        };
        entry.connection += 1;
        let address = entry.address.clone();
        self.fabric.remove_peer(fi_addr);
        match self.fabric.insert_peer(&address) {
            Ok(again) if again == fi_addr => {}
            Ok(again) => self.renumber_peer(fi_addr, again),
            Err(err) => {
                // The entry is gone: reads naming it fail from now on (a
                // post to a removed entry is refused), and it is never
                // removed a second time.
                tracing::warn!(error = %err, "could not insert a reset peer's address again");
                if let Some(entry) = self.av.remove(&fi_addr) {
                    self.by_address.remove(&entry.address);
                }
                self.watch.remove(&fi_addr);
            }
        }
    }

    /// Every table that names address-vector entry `from` names `to` now.
    pub(super) fn renumber_peer(&mut self, from: u64, to: u64) {
        tracing::debug!(from, to, "a reset peer's address got another entry");
        for value in self.peers.values_mut() {
            if *value == from {
                *value = to;
            }
        }
        if let Some(entry) = self.av.remove(&from) {
            self.by_address.insert(entry.address.clone(), to);
            self.av.insert(to, entry);
        }
        if let Some(watch) = self.watch.remove(&from) {
            self.watch.insert(to, watch);
        }
        if let Some(count) = self.gathered.remove(&from) {
            self.gathered.insert(to, count);
        }
        if let Some(bytes) = self.discard_bytes.remove(&from) {
            self.discard_bytes.insert(to, bytes);
        }
        for owner in self.discard_owners.values_mut() {
            if owner.0 == from {
                owner.0 = to;
            }
        }
        for op in self.ops.iter_mut().flatten() {
            if op.fi_addr == from {
                op.fi_addr = to;
            }
        }
        for send in self.sends.values_mut() {
            if send.dest == from {
                send.dest = to;
            }
        }
        self.renumber_writes(from, to);
    }
}
