//! Serving reads on the owner-served path, and reads under descriptor
//! leases on either path (`leases`).
//!
//! Keeps request receives posted, names the sender over `tcp;ofi_rxm`,
//! hands each request to the owner machine (`Engine::owner`) and turns its
//! actions into tagged sends: the region's bytes under a lease, or a typed
//! refusal. List entries are judged by the machine and copied into one
//! reply at once (see "Serving reads" in the parent module).

use std::ffi::c_void;
use std::sync::atomic::Ordering;

use bytes::Bytes;

use rdmareg_engine::served::{self, Action, Read};

use crate::fabric::{ADDR_NOTAVAIL, ADDR_UNSPEC};
use crate::protocol::{
    LIST_VERSION, ListRequest, PROBE, RECEIVE_MAX, REQUEST_TAG, ReadRequest, refusal_code,
    refusal_tag,
};

use super::*;

impl Engine {
    /// Posts the request receives of the owner-served path. The one-sided
    /// path serves requests only for descriptor leases, and posts them when
    /// it makes its first (`leases`).
    pub(super) fn post_request_receives(&mut self) {
        if self.owner_served() {
            self.open_request_receives();
        }
        // Writes are served on either path (`serve_writes`).
        self.open_write_receives();
    }

    /// Posts the request receives unless they are posted already (or kept
    /// for reposting).
    pub(super) fn open_request_receives(&mut self) {
        if self
            .request_buffers
            .values()
            .any(|buffer| buffer.tag == REQUEST_TAG)
        {
            return;
        }
        for _ in 0..REQUEST_RECEIVES {
            let buffer = RequestBuffer {
                context: Box::new(OpContext {
                    space: [std::ptr::null_mut(); 8],
                }),
                data: vec![0u8; RECEIVE_MAX].into_boxed_slice(),
                tag: REQUEST_TAG,
                posted: false,
            };
            let at = (&raw const *buffer.context) as usize;
            self.request_buffers.insert(at, buffer);
            self.repost_request(at);
        }
    }

    /// (Re)posts one request (or notice) receive; it stays unposted
    /// (retried each turn) while the provider asks to wait.
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
        let (data, len, tag) = (
            buffer.data.as_mut_ptr() as usize,
            buffer.data.len(),
            buffer.tag,
        );
        // SAFETY: the buffer and its context are boxed in
        // `request_buffers`, which keeps them until the endpoint is closed
        // (teardown forgets them if it cannot close it).
        let posted = unsafe {
            self.fabric.trecv(
                data,
                len,
                std::ptr::null_mut(),
                ADDR_UNSPEC,
                tag,
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
    /// again, serve the request.
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
        let endpoint = self.endpoint_of(dest);
        self.give_owner_time();
        self.owner.handle_read(
            endpoint,
            Read {
                request_id: request.request_id,
                region: request.region_id,
                capability: request.capability,
                address: request.address,
                length: request.length,
            },
        );
        self.run_owner_actions(dest);
    }

    /// The `AvEntry::endpoint` serial of entry `fi_addr` (0: none).
    pub(super) fn endpoint_of(&self, fi_addr: u64) -> u64 {
        self.av.get(&fi_addr).map_or(0, |entry| entry.endpoint)
    }

    /// Performs what the owner machine asks for, in order: a reply is a
    /// tagged send of the region's bytes (tag: the request id), a refusal a
    /// zero-length send whose tag carries the reason, both to `reply_at`,
    /// the consumer just fed to the machine (at most one send per input); a
    /// finished unmap deregisters once no read of this engine writes into
    /// the region.
    pub(super) fn run_owner_actions(&mut self, reply_at: u64) {
        while let Some(action) = self.owner.poll_action() {
            match action {
                Action::Serve {
                    endpoint,
                    send,
                    request_id,
                    payload,
                } => {
                    debug_assert_eq!(endpoint, self.endpoint_of(reply_at));
                    let desc = self
                        .regions
                        .get(&payload.region)
                        .map_or(std::ptr::null_mut(), |region| region.mr.desc);
                    self.queue_send(SendOp {
                        owner_send: Some(send),
                        ..SendOp::new(
                            reply_at,
                            request_id,
                            payload.address as usize,
                            payload.length as usize,
                            desc,
                        )
                    });
                }
                Action::Refuse {
                    endpoint,
                    send,
                    request_id,
                    refusal,
                } => {
                    debug_assert_eq!(endpoint, self.endpoint_of(reply_at));
                    let tag = refusal_tag(request_id, refusal);
                    self.queue_send(SendOp {
                        owner_send: Some(send),
                        ..SendOp::new(reply_at, tag, 0, 0, std::ptr::null_mut())
                    });
                }
                Action::Receive {
                    endpoint,
                    receive,
                    address,
                    length,
                    payload_offset,
                    ..
                } => {
                    debug_assert_eq!(endpoint, self.endpoint_of(reply_at));
                    self.receive_write(receive, address, length, payload_offset);
                }
                Action::Acknowledge {
                    endpoint,
                    send,
                    request_id,
                    length,
                } => {
                    debug_assert_eq!(endpoint, self.endpoint_of(reply_at));
                    self.acknowledge_write(reply_at, send, request_id, length);
                }
                Action::AcknowledgeList {
                    endpoint,
                    send,
                    entry_replies,
                } => {
                    debug_assert_eq!(endpoint, self.endpoint_of(reply_at));
                    self.acknowledge_write_list(reply_at, send, &entry_replies);
                }
                Action::Unmapped { region } => {
                    if let Some(held) = self.regions.get_mut(&region) {
                        held.served = false;
                    }
                    self.deregister_if_idle(region);
                }
                // Lists are copied at once (`serve_list`), and teardown
                // does not wait for `Drained`.
                _ => {}
            }
        }
    }

    /// A request whose sender the provider named as another endpoint than
    /// its reply address (`dest`), or could not name (`source` is
    /// [`ADDR_NOTAVAIL`]): no bytes and no lease. A named sender gets
    /// [`served::Refusal::NotTheRequester`]; otherwise the reply address gets
    /// [`served::Refusal::Unverified`] and asks again. Either refusal counts against
    /// its receiver's refusal bound.
    pub(super) fn refuse_unconfirmed(&mut self, request_id: u64, source: u64, dest: u64) {
        self.signals
            .unconfirmed_requests
            .fetch_add(1, Ordering::Relaxed);
        let (to, refusal) = if source == ADDR_NOTAVAIL {
            (dest, served::Refusal::Unverified)
        } else {
            (source, served::Refusal::NotTheRequester)
        };
        tracing::debug!(
            request = request_id,
            source,
            dest,
            ?refusal,
            "a read request's sender is not confirmed as its reply address"
        );
        let endpoint = self.endpoint_of(to);
        self.owner.refuse_request(endpoint, request_id, refusal);
        self.run_owner_actions(to);
    }

    /// Serves a list request: checks each entry as a single read, copies
    /// the bytes of every entry it serves into one reply (so no lease
    /// outlives this call) and sends it; refuses the whole list as busy past
    /// the consumer's bound of list replies.
    pub(super) fn serve_list(&mut self, bytes: &[u8]) {
        let Some(list) = ListRequest::decode(bytes) else {
            tracing::debug!(len = bytes.len(), "a malformed list request was dropped");
            return;
        };
        if self.fabric.needs_local_desc() {
            // A list reply would need a registration of its own.
            tracing::debug!("a list request was dropped: this provider needs local descriptors");
            return;
        }
        let Some(dest) = self.served_peer(&list.reply_to) else {
            return;
        };
        let unfinished = self.gathered.get(&dest).copied().unwrap_or(0);
        // Past the total, a consumer with no list reply unfinished is still
        // served one, so consumers that never take replies cannot starve
        // those that do.
        if unfinished >= GATHERED_PER_PEER.min(self.reply_bound)
            || (unfinished > 0 && self.gathered_bytes + list.reply_len() > GATHERED_BYTES_MAX)
        {
            // Under the consumer's refusal bound, like any refusal.
            let endpoint = self.endpoint_of(dest);
            self.owner
                .refuse_request(endpoint, list.request_id, served::Refusal::Busy);
            self.run_owner_actions(dest);
            return;
        }
        *self.gathered.entry(dest).or_default() += 1;
        // Every entry is judged at this one time.
        self.give_owner_time();
        let mut reply = vec![0u8; list.entries.len()];
        reply.reserve_exact(list.reply_len() - list.entries.len());
        for (index, entry) in list.entries.iter().enumerate() {
            // Judged as a single read, without a lease: the bytes are
            // copied before the owner machine is fed anything else.
            let read = Read {
                request_id: list.request_id,
                region: entry.region_id,
                capability: entry.capability,
                address: entry.address,
                length: entry.length,
            };
            match self.owner.check_read(&read) {
                Ok(payload) => {
                    let source = payload.address as usize;
                    let start = reply.len();
                    let len = entry.length as usize;
                    reply.resize(start + len, 0);
                    // SAFETY: `source..source + len` lies inside a live
                    // registration not being unmapped (checked just now by
                    // the owner machine; no unmap runs until this returns),
                    // which its owner keeps allocated until an unmap of it
                    // returns `Ok`; the destination is the `len` bytes just
                    // added to `reply`. No reference to the source is made.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            source as *const u8,
                            reply.as_mut_ptr().add(start),
                            len,
                        );
                    }
                }
                Err(refusal) => reply[index] = refusal_code(refusal),
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
            gathered: true,
            ..SendOp::owning(dest, list.request_id, reply)
        });
    }
}
