//! Serving reads on the owner-served path: keeping request receives
//! posted, checking each request or list entry against the live regions
//! (exists, not unmapping, capability, range), naming the sender over
//! `tcp;ofi_rxm`, and answering with the region's bytes under a lease or
//! with a typed refusal — within the per-consumer bounds of unfinished
//! replies and refusals (see "Serving reads" in the parent module).

use std::ffi::c_void;
use std::sync::atomic::Ordering;

use bytes::Bytes;

use crate::fabric::{ADDR_NOTAVAIL, ADDR_UNSPEC};
use crate::protocol::{
    LIST_VERSION, ListEntry, ListRequest, PROBE, RECEIVE_MAX, REQUEST_TAG, ReadRequest, Refusal,
    capability_matches, refusal_tag,
};

use super::*;

impl Engine {
    /// Posts the request receives of the owner-served path.
    pub(super) fn post_request_receives(&mut self) {
        if !self.owner_served() {
            return;
        }
        for _ in 0..REQUEST_RECEIVES {
            let buffer = RequestBuffer {
                context: Box::new(OpContext {
                    space: [std::ptr::null_mut(); 8],
                }),
                data: Box::new([0u8; RECEIVE_MAX]),
                posted: false,
            };
            let at = (&raw const *buffer.context) as usize;
            self.request_buffers.insert(at, buffer);
            self.repost_request(at);
        }
    }

    /// (Re)posts one request receive; it stays unposted (retried each
    /// turn) while the provider asks to wait.
    pub(super) fn repost_request(&mut self, at: usize) {
        if self.closing {
            return;
        }
        let Some(buffer) = self.request_buffers.get_mut(&at) else {
            return;
        };
        if buffer.posted {
            return;
        }
        let context = (&raw mut buffer.context.space).cast::<c_void>();
        let data = buffer.data.as_mut_ptr() as usize;
        // SAFETY: the buffer and its context are boxed in
        // `request_buffers`, which keeps them until the endpoint is closed
        // (teardown forgets them if it cannot close it).
        let posted = unsafe {
            self.fabric.trecv(
                data,
                RECEIVE_MAX,
                std::ptr::null_mut(),
                ADDR_UNSPEC,
                REQUEST_TAG,
                0,
                context,
            )
        };
        match posted {
            Ok(true) => buffer.posted = true,
            Ok(false) => {}
            Err(err) => tracing::warn!(error = %err, "could not post a request receive"),
        }
    }

    pub(super) fn retry_request_receives(&mut self) {
        if self.request_buffers.values().all(|b| b.posted) {
            return;
        }
        let waiting: Vec<usize> = self
            .request_buffers
            .iter()
            .filter(|(_, b)| !b.posted)
            .map(|(&at, _)| at)
            .collect();
        for at in waiting {
            self.repost_request(at);
        }
    }

    /// A request receive completed: take the request, post the receive
    /// again, answer the request.
    pub(super) fn request_arrived(
        &mut self,
        at: usize,
        result: Result<(usize, Option<Bytes>), (i32, String)>,
    ) {
        let mut source = None;
        let bytes = match (result, self.request_buffers.get_mut(&at)) {
            (Ok((len, from)), Some(buffer)) => {
                buffer.posted = false;
                source = from;
                Some(buffer.data[..len.min(RECEIVE_MAX)].to_vec())
            }
            (Err((_, text)), Some(buffer)) => {
                buffer.posted = false;
                tracing::debug!(error = %text, "a request receive failed");
                None
            }
            (_, None) => None,
        };
        self.repost_request(at);
        if let Some(bytes) = bytes {
            self.serve_request(&bytes, source);
        }
    }

    /// Checks a peer's request against the live registrations, and sends
    /// the bytes under a read lease or a refusal. `source` is the address
    /// of the entry the provider named the request's sender by, as it was
    /// when the request's completion was read (`None`: not named).
    pub(super) fn serve_request(&mut self, bytes: &[u8], source: Option<Bytes>) {
        if bytes == PROBE {
            tracing::trace!("a liveness probe arrived");
            return;
        }
        if bytes.first() == Some(&LIST_VERSION) {
            self.serve_list(bytes);
            return;
        }
        let Some(request) = ReadRequest::decode(bytes) else {
            tracing::debug!(len = bytes.len(), "a malformed read request was dropped");
            return;
        };
        let Some(dest) = self.served_peer(&request.reply_to) else {
            return;
        };
        if self.fabric.reports_source {
            // Compared by address, not entry number: `served_peer` may have
            // just forgotten the sender's entry and given its number to the
            // reply address.
            let confirmed = source
                .as_ref()
                .is_some_and(|address| self.av.get(&dest).is_some_and(|e| e.address == *address));
            if !confirmed {
                // The sender's entry now, if it is still in the vector.
                let sender = source
                    .and_then(|address| self.by_address.get(&address).copied())
                    .unwrap_or(ADDR_NOTAVAIL);
                self.refuse_unconfirmed(request.request_id, sender, dest);
                return;
            }
        }
        tracing::trace!(
            request = request.request_id,
            len = request.length,
            "serving a read request"
        );
        let load = self.reply_loads.entry(dest).or_default();
        let verdict = match self.regions.get_mut(&request.region_id) {
            None => Err(Refusal::RegionUnknown),
            Some(region) if region.unmapping => Err(Refusal::Deregistering),
            Some(region) if !capability_matches(&region.capability, &request.capability) => {
                Err(Refusal::CapabilityMismatch)
            }
            Some(region) => {
                let start = region.ptr as u64;
                let end = start + region.len as u64;
                match request.address.checked_add(request.length) {
                    Some(last) if request.address >= start && last <= end => {
                        if load.served >= self.reply_bound {
                            Err(Refusal::Busy)
                        } else {
                            load.served += 1;
                            region.in_flight += 1;
                            Ok((request.address as usize, region.mr.desc))
                        }
                    }
                    _ => Err(Refusal::OutOfRange),
                }
            }
        };
        if verdict.is_err() {
            if load.refusals >= self.reply_bound {
                // This consumer does not take its refusals either: answer
                // nothing more until it does.
                tracing::debug!(
                    request = request.request_id,
                    "a consumer holds too many refusals; a read request was dropped"
                );
                if *load == PeerLoad::default() {
                    self.reply_loads.remove(&dest);
                }
                return;
            }
            load.refusals += 1;
        }
        let send = match verdict {
            Ok((ptr, desc)) => SendOp {
                context: Box::new(OpContext {
                    space: [std::ptr::null_mut(); 8],
                }),
                _bytes: None,
                ptr,
                len: request.length as usize,
                desc,
                dest,
                tag: request.request_id,
                lease: Some(request.region_id),
                counted: Some((dest, ReplyKind::Bytes)),
                for_read: None,
                probe: false,
                connection: None,
            },
            Err(refusal) => {
                tracing::debug!(
                    region = request.region_id,
                    ?refusal,
                    "refused a read request"
                );
                SendOp::refusal(dest, refusal_tag(request.request_id, refusal))
            }
        };
        self.queue_send(send);
    }

    /// A request whose sender the provider named as another endpoint than
    /// its reply address (`dest`), or could not name (`source` is
    /// [`ADDR_NOTAVAIL`]): no bytes go out and no lease is taken. A named
    /// sender is refused [`Refusal::NotTheRequester`]; otherwise the reply
    /// address, inserted by now, is answered [`Refusal::Unverified`], and
    /// asks again if it did ask (over `tcp;ofi_rxm` the provider then names
    /// it). Either refusal counts against its receiver's refusal bound.
    pub(super) fn refuse_unconfirmed(&mut self, request_id: u64, source: u64, dest: u64) {
        self.signals
            .unconfirmed_requests
            .fetch_add(1, Ordering::Relaxed);
        let (to, refusal) = if source == ADDR_NOTAVAIL {
            (dest, Refusal::Unverified)
        } else {
            (source, Refusal::NotTheRequester)
        };
        tracing::debug!(
            request = request_id,
            source,
            dest,
            ?refusal,
            "a read request's sender is not confirmed as its reply address"
        );
        let load = self.reply_loads.entry(to).or_default();
        if load.refusals >= self.reply_bound {
            if *load == PeerLoad::default() {
                self.reply_loads.remove(&to);
            }
            return;
        }
        load.refusals += 1;
        self.queue_send(SendOp::refusal(to, refusal_tag(request_id, refusal)));
    }

    /// Serves a list request: checks each entry as a single read is
    /// checked, copies the bytes of every entry it serves into one reply
    /// (so no lease outlives this call) and sends it; refuses the whole
    /// list as busy past the consumer's bound of gathered replies.
    pub(super) fn serve_list(&mut self, bytes: &[u8]) {
        let Some(list) = ListRequest::decode(bytes) else {
            tracing::debug!(len = bytes.len(), "a malformed list request was dropped");
            return;
        };
        if self.fabric.needs_local_desc() {
            // A gathered reply would need a registration of its own.
            tracing::debug!("a list request was dropped: this provider needs local descriptors");
            return;
        }
        let Some(dest) = self.served_peer(&list.reply_to) else {
            return;
        };
        let bound = self.reply_bound;
        let held = self.gathered_bytes;
        let load = self.reply_loads.entry(dest).or_default();
        // Past the total, a consumer with no gathered reply unfinished is
        // still served one: the total bounds memory (to it plus one reply
        // per consumer address), and peers that hold replies without
        // taking them cannot starve the consumers that do take theirs.
        if load.gathered >= GATHERED_PER_PEER.min(bound)
            || (load.gathered > 0 && held + list.reply_len() > GATHERED_BYTES_MAX)
        {
            if load.refusals >= bound {
                tracing::debug!(
                    request = list.request_id,
                    "a consumer holds too many refusals; a list request was dropped"
                );
                return;
            }
            load.refusals += 1;
            self.queue_send(SendOp::refusal(
                dest,
                refusal_tag(list.request_id, Refusal::Busy),
            ));
            return;
        }
        load.gathered += 1;
        let mut reply = vec![0u8; list.entries.len()];
        reply.reserve_exact(list.reply_len() - list.entries.len());
        for (index, entry) in list.entries.iter().enumerate() {
            match self.check_entry(entry) {
                Ok(source) => {
                    let start = reply.len();
                    let len = entry.length as usize;
                    reply.resize(start + len, 0);
                    // SAFETY: `source..source + len` lies inside a live
                    // registration that is not being unmapped (checked just
                    // now, and no unmap runs until this call returns), whose
                    // owner keeps it allocated until an unmap of it answers
                    // `Ok`; the destination is the `len` bytes just added to
                    // `reply`. The bytes are copied as the provider copies a
                    // region it sends from: no reference to them is made.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            source as *const u8,
                            reply.as_mut_ptr().add(start),
                            len,
                        );
                    }
                }
                Err(refusal) => reply[index] = refusal.status(),
            }
        }
        // Released by the send's end, by this same length.
        self.gathered_bytes += reply.len();
        tracing::trace!(
            request = list.request_id,
            entries = list.entries.len(),
            len = reply.len(),
            "serving a list request"
        );
        self.queue_send(SendOp {
            context: Box::new(OpContext {
                space: [std::ptr::null_mut(); 8],
            }),
            ptr: reply.as_ptr() as usize,
            len: reply.len(),
            _bytes: Some(reply),
            desc: std::ptr::null_mut(),
            dest,
            tag: list.request_id,
            lease: None,
            counted: Some((dest, ReplyKind::Gathered)),
            for_read: None,
            probe: false,
            connection: None,
        });
    }

    /// Where a list entry's bytes start in this process, or why it is
    /// refused: the checks of a single read.
    pub(super) fn check_entry(&self, entry: &ListEntry) -> Result<usize, Refusal> {
        let region = self
            .regions
            .get(&entry.region_id)
            .ok_or(Refusal::RegionUnknown)?;
        if region.unmapping {
            return Err(Refusal::Deregistering);
        }
        if !capability_matches(&region.capability, &entry.capability) {
            return Err(Refusal::CapabilityMismatch);
        }
        let start = region.ptr as u64;
        let end = start + region.len as u64;
        match entry.address.checked_add(entry.length) {
            Some(last) if entry.address >= start && last <= end => Ok(entry.address as usize),
            _ => Err(Refusal::OutOfRange),
        }
    }
}
