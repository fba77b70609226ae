//! This engine's puts: the writer side of served writes.
//!
//! A put is checked like a read (peer, key, ranges), holds its source
//! region from then until it completes (an unmap of it waits), and goes as
//! chunks of at most [`WRITE_CHUNK_MAX`] bytes, at most [`WRITE_WINDOW`] of
//! them in flight, each a write of the engine kit's writer machine
//! (`Engine::writer`). A chunk copies its bytes out of the source into its
//! write message, posts an 8-byte reply receive directed at the owner, then
//! sends the message with [`WRITE_TAG`] (`protocol`, "Served writes"). The
//! machine completes a chunk only once its send ended and, for `Ok`, the
//! owner's reply said the bytes are in; a put completes once its last chunk
//! did, with the first error of any (after which no further chunk is sent).
//!
//! The reply receive is the engine's own scratch: a chunk that completes
//! without its reply (past its deadline, its owner unreachable, teardown)
//! has it cancelled and kept with the discard receives until the provider
//! gives it back.

use std::ffi::c_void;
use std::time::Instant;

use rdmareg_core::{BackendPut, RdmaError};
use rdmareg_engine::served::consumer::{Reply as KitReply, ReplyOutcome};
use rdmareg_engine::served::{Operation, WriteTarget, WriteTimeout};

use crate::key::{CAPABILITY_LEN, PackedKey};
use crate::protocol::{
    REPLY_IGNORE, WRITE_CHUNK_MAX, WRITE_REPLY_LEN, WRITE_TAG, WriteRequest, refusal_of_tag,
};

use super::*;

/// Chunks of one put in flight at once.
pub(super) const WRITE_WINDOW: usize = 4;

/// One put, from its check until its last chunk completed.
pub(super) struct Put {
    pub(super) waiter: Option<Waiter>,
    /// The source region, whose `in_flight` counts this put.
    pub(super) region: u64,
    pub(super) fi_addr: u64,
    pub(super) endpoint: u64,
    pub(super) region_id: u64,
    pub(super) capability: [u8; CAPABILITY_LEN],
    /// The target's first byte, as an address in the owner.
    pub(super) remote: u64,
    /// The source's first byte.
    pub(super) source: usize,
    pub(super) len: u64,
    /// Offset of the next chunk to send.
    pub(super) next: u64,
    pub(super) in_flight: usize,
    pub(super) error: Option<RdmaError>,
    pub(super) deadline: Instant,
}

/// One message of writes in flight, a chunk or a write list
/// (`write_lists`): its reply receive and, until sent, its message.
pub(super) struct WriteOp {
    pub(super) context: Box<OpContext>,
    /// The reply receive's buffer: [`WRITE_REPLY_LEN`] bytes for a chunk,
    /// a status byte per entry for a list.
    pub(super) reply: Vec<u8>,
    /// The writes this message carries that have not completed, each with
    /// its put.
    pub(super) writes: Vec<(u64, WriteId)>,
    /// A write list's entries as sent, in the reply's order, with their
    /// lengths; empty for a chunk.
    pub(super) listed: Vec<(WriteId, u64)>,
    pub(super) request_id: u64,
    pub(super) fi_addr: u64,
    pub(super) endpoint: u64,
    /// The message, until its send is queued.
    pub(super) message: Option<Vec<u8>>,
    /// The reply receive is posted and has not ended.
    pub(super) receiving: bool,
}

impl WriteOp {
    /// The writes the message carries: their sends end with its send.
    fn sent(&self) -> Vec<WriteId> {
        if self.listed.is_empty() {
            self.writes.iter().map(|&(_, write)| write).collect()
        } else {
            self.listed.iter().map(|&(write, _)| write).collect()
        }
    }
}

impl Engine {
    /// Checks a put and starts its first chunks, or completes `waiter`
    /// with the error.
    pub(super) fn start_put(&mut self, request: BackendPut, waiter: Waiter) {
        if let Some(id) = self.open_put(&request, waiter) {
            self.send_chunks(id);
            self.complete_writes();
        }
    }

    /// Checks a put and holds what it needs (its source region, its
    /// peer's entry) until it completes; `None` when the check failed and
    /// `waiter` was completed with the error. Nothing is sent yet.
    pub(super) fn open_put(&mut self, request: &BackendPut, waiter: Waiter) -> Option<u64> {
        let put = match self.check_put(request) {
            Ok(put) => put,
            Err(err) => {
                complete(waiter, Err(err));
                return None;
            }
        };
        let (fi_addr, endpoint, region_id, capability, source) = put;
        if let Some(region) = self.regions.get_mut(&request.local_region_id) {
            region.in_flight += 1;
        }
        if let Some(entry) = self.av.get_mut(&fi_addr) {
            entry.ops += 1;
        }
        let deadline = Instant::now()
            + request
                .deadline
                .unwrap_or(self.settings.default_get_deadline);
        let id = self.next_put;
        self.next_put += 1;
        self.puts.insert(
            id,
            Put {
                waiter: Some(waiter),
                region: request.local_region_id,
                fi_addr,
                endpoint,
                region_id,
                capability,
                remote: request.remote_addr,
                source,
                len: request.len,
                next: 0,
                in_flight: 0,
                error: None,
                deadline,
            },
        );
        Some(id)
    }

    /// Everything a put is checked against before anything is sent: the
    /// peer, the key (its owner, and the range inside its registration),
    /// and the source inside a mapped region not being unmapped. Whether
    /// the registration allows writes is the owner's to say.
    #[allow(clippy::type_complexity)]
    fn check_put(
        &self,
        request: &BackendPut,
    ) -> Result<(u64, u64, u64, [u8; CAPABILITY_LEN], usize), RdmaError> {
        if request.len == 0 {
            return Err(RdmaError::OutOfRange);
        }
        let fi_addr = *self
            .peers
            .get(&request.peer)
            .ok_or(RdmaError::NotConfigured)?;
        let (key, _) = PackedKey::decode_any(&request.packed_key)?;
        let entry = self.av.get(&fi_addr).ok_or(RdmaError::NotConfigured)?;
        if entry.address != key.owner {
            return Err(RdmaError::InvalidKey);
        }
        key.target(request.remote_addr, request.len)?;
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
        let source = region.ptr + request.local_offset as usize;
        Ok((
            fi_addr,
            entry.endpoint,
            key.region_id,
            key.capability,
            source,
        ))
    }

    /// Starts chunks of put `id` while it is under its window, has bytes
    /// left and no chunk failed.
    pub(super) fn send_chunks(&mut self, id: u64) {
        loop {
            let Some(put) = self.puts.get_mut(&id) else {
                return;
            };
            if put.in_flight >= WRITE_WINDOW || put.next >= put.len || put.error.is_some() {
                return;
            }
            let offset = put.next;
            let length = (put.len - offset).min(WRITE_CHUNK_MAX);
            put.next += length;
            put.in_flight += 1;
            let (fi_addr, endpoint, deadline) = (put.fi_addr, put.endpoint, put.deadline);
            let target = WriteTarget {
                region: put.region_id,
                capability: put.capability,
                address: put.remote + offset,
                length,
            };
            let source = put.source + offset as usize;
            let request_id = self.mint_request_id();
            let header = WriteRequest {
                request_id,
                region_id: target.region,
                capability: target.capability,
                address: target.address,
                length,
                reply_to: self.fabric.address.to_vec(),
            };
            // SAFETY: `source..source + length` lies inside the put's
            // source region (checked against its mapped pointer and length
            // in `check_put`), which stays registered, and so allocated,
            // while its `in_flight` counts this put; the caller of `put`
            // writes none of it until the put completes. No reference to it
            // outlives this copy.
            let payload =
                unsafe { std::slice::from_raw_parts(source as *const u8, length as usize) };
            let message = header.encode_with(payload);
            let context = Box::new(OpContext {
                space: [std::ptr::null_mut(); 8],
            });
            let at = (&raw const *context) as usize;
            let posted = self.writer.start(endpoint, target, deadline, at);
            self.write_ops.insert(
                at,
                WriteOp {
                    context,
                    reply: vec![0; WRITE_REPLY_LEN],
                    writes: vec![(id, posted.id)],
                    listed: Vec::new(),
                    request_id,
                    fi_addr,
                    endpoint,
                    message: posted.request.map(|_| message),
                    receiving: false,
                },
            );
            self.post_or_queue_write(at);
        }
    }

    /// Posts the message of the op at `at` (if it has one), or queues it
    /// until the provider takes it.
    pub(super) fn post_or_queue_write(&mut self, at: usize) {
        if self
            .write_ops
            .get(&at)
            .is_some_and(|op| op.message.is_some())
            && !self.post_write(at)
        {
            self.unposted_writes.push_back(at);
        }
    }

    /// Posts the reply receive of the message at `at`, then queues the
    /// message; `false` when the provider asks to post later. A receive
    /// that cannot be posted ends its writes' sends in error.
    fn post_write(&mut self, at: usize) -> bool {
        let Some(op) = self.write_ops.get_mut(&at) else {
            return true;
        };
        let context = (&raw mut op.context.space).cast::<c_void>();
        // SAFETY: the reply buffer and the context box live in `write_ops`
        // until the receive's completion is read, or, once the chunk
        // completed, in `discards` until then or until the endpoint is
        // closed; the provider needs no descriptor for this scratch buffer
        // (providers that do are not supported for writes, as for lists).
        let posted = unsafe {
            self.fabric.trecv(
                op.reply.as_mut_ptr() as usize,
                op.reply.len(),
                std::ptr::null_mut(),
                op.fi_addr,
                op.request_id,
                REPLY_IGNORE,
                context,
            )
        };
        match posted {
            Ok(true) => {
                op.receiving = true;
                let (sent, fi_addr) = (op.sent(), op.fi_addr);
                if let Some(message) = op.message.take() {
                    self.queue_send(SendOp {
                        for_writes: sent,
                        ..SendOp::owning(fi_addr, WRITE_TAG, message)
                    });
                }
                true
            }
            Ok(false) => false,
            Err(err) => {
                op.message = None;
                for write in op.sent() {
                    self.writer.send_ended(write, Err(err.clone()));
                }
                self.complete_writes();
                true
            }
        }
    }

    /// Posts the chunks the provider asked to post later, in order.
    pub(super) fn retry_unposted_writes(&mut self) -> bool {
        let mut worked = false;
        while let Some(&at) = self.unposted_writes.front() {
            if !self.post_write(at) {
                break;
            }
            self.unposted_writes.pop_front();
            worked = true;
        }
        worked
    }

    /// The reply receive of the chunk at `at` ended: the owner's answer
    /// (or why none can be read) goes to the writer machine.
    pub(super) fn write_reply_arrived(
        &mut self,
        at: usize,
        result: Result<(usize, u64, u64), (i32, String)>,
    ) {
        let Some(op) = self.write_ops.get_mut(&at) else {
            return;
        };
        if !op.listed.is_empty() {
            return self.write_list_reply_arrived(at, result);
        }
        op.receiving = false;
        let Some(&(_, write)) = op.writes.first() else {
            return;
        };
        let request_id = write.0;
        let (outcome, payload) = match result {
            Ok((len, tag, _)) => match refusal_of_tag(tag) {
                Some(refusal) => (
                    ReplyOutcome::Refused(refusal.error_for(Operation::Write)),
                    len as u64,
                ),
                None if len == WRITE_REPLY_LEN => {
                    let mut raw = [0u8; WRITE_REPLY_LEN];
                    raw.copy_from_slice(&op.reply);
                    (
                        ReplyOutcome::Served {
                            length: u64::from_le_bytes(raw),
                        },
                        0,
                    )
                }
                None => (
                    ReplyOutcome::Refused(RdmaError::backend(format!(
                        "ofi: the owner's write reply was {len} bytes, not \
                         {WRITE_REPLY_LEN}; the write's outcome is unknown"
                    ))),
                    0,
                ),
            },
            Err((_, text)) => (
                ReplyOutcome::Refused(RdmaError::backend(format!(
                    "ofi: the write's reply receive failed: {text}; the write's outcome is unknown"
                ))),
                0,
            ),
        };
        let reply = KitReply {
            request_id,
            outcome,
        };
        if let Err(reason) = self.writer.handle_reply(op.endpoint, &reply, payload) {
            tracing::debug!(?reason, "a write reply was dropped");
        }
        self.complete_writes();
    }

    /// Hands each chunk the writer machine completed to its put, and each
    /// put whose last chunk completed its result.
    pub(super) fn complete_writes(&mut self) {
        if self.completing_writes {
            return;
        }
        self.completing_writes = true;
        while let Some(completion) = self.writer.poll_completion() {
            let at = completion.value;
            let Some(op) = self.write_ops.get_mut(&at) else {
                continue;
            };
            let Some(position) = op
                .writes
                .iter()
                .position(|&(_, write)| write == completion.write)
            else {
                continue;
            };
            let (put_id, _) = op.writes.swap_remove(position);
            if op.writes.is_empty() {
                self.drop_write_op(at);
            }
            let Some(put) = self.puts.get_mut(&put_id) else {
                continue;
            };
            put.in_flight -= 1;
            if let Err(err) = completion.outcome {
                put.error.get_or_insert(err);
            }
            self.send_chunks(put_id);
            self.finish_put_if_done(put_id);
        }
        self.completing_writes = false;
    }

    /// Forgets the message at `at`, whose writes all completed: it is no
    /// longer posted later, and a reply receive still posted is withdrawn
    /// (no reply will be taken) and its buffer kept with the discards
    /// until the provider gives it back.
    fn drop_write_op(&mut self, at: usize) {
        let Some(mut op) = self.write_ops.remove(&at) else {
            return;
        };
        self.unposted_writes.retain(|&queued| queued != at);
        if op.receiving {
            let context = (&raw mut op.context.space).cast::<c_void>();
            self.fabric.cancel(context);
            self.discards.insert(at, (op.context, op.reply));
        }
    }

    fn finish_put_if_done(&mut self, id: u64) {
        let done = self
            .puts
            .get(&id)
            .is_some_and(|put| put.in_flight == 0 && (put.error.is_some() || put.next >= put.len));
        if !done {
            return;
        }
        let Some(mut put) = self.puts.remove(&id) else {
            return;
        };
        self.release_hold(put.region);
        self.release_av(put.fi_addr, |entry| entry.ops -= 1);
        if let Some(waiter) = put.waiter.take() {
            complete(waiter, put.error.map_or(Ok(()), Err));
        }
    }

    /// Writes past their deadline fail with `Timeout`, each alone,
    /// whether their message is waiting for its reply, still being sent
    /// or not yet handed to the provider: it is the engine's own copy (a
    /// send keeps it until the provider lets go), so the caller's source
    /// is no longer read. A message not yet handed to the provider is
    /// dropped once no write in it is waiting any more; one shared with a
    /// write list's live entries still goes, so those keep their own
    /// deadlines, and the expired entry's bytes may land as an expired
    /// chunk's may.
    pub(super) fn expire_writes(&mut self, now: Instant) {
        for WriteTimeout::StopSend { write, .. } in self.writer.handle_timeout(now) {
            self.writer.send_ended(write, Err(RdmaError::Timeout));
            let queued = self.unsent.iter().copied().find(|at| {
                self.sends
                    .get(at)
                    .is_some_and(|s| s.for_writes.contains(&write))
            });
            let Some(at) = queued else {
                continue;
            };
            let waited = self.sends.get(&at).is_some_and(|send| {
                send.for_writes
                    .iter()
                    .any(|&other| self.writer.value(other).is_some())
            });
            if !waited {
                self.unsent.retain(|&queued| queued != at);
                self.send_done(at, Err((0, "past its deadline before it was sent".into())));
            }
        }
        self.complete_writes();
    }

    /// A peer is unreachable: its chunks the provider is still sending end
    /// with `error` now (each message is the engine's own copy, kept by
    /// its send until the provider lets go), so their puts complete
    /// instead of waiting on a connection nothing answers.
    pub(super) fn end_writes_sending_to(&mut self, fi_addr: u64, error: &RdmaError) {
        let sending: Vec<WriteId> = self
            .write_ops
            .values()
            .filter(|op| op.fi_addr == fi_addr && op.message.is_none())
            .flat_map(WriteOp::sent)
            .collect();
        for write in sending {
            self.writer.send_ended(write, Err(error.clone()));
        }
        self.complete_writes();
    }

    /// Renames entry `from` to `to` in the puts and chunks.
    pub(super) fn renumber_writes(&mut self, from: u64, to: u64) {
        for put in self.puts.values_mut() {
            if put.fi_addr == from {
                put.fi_addr = to;
            }
        }
        for op in self.write_ops.values_mut() {
            if op.fi_addr == from {
                op.fi_addr = to;
            }
        }
    }

    /// Teardown: chunks never handed to the provider end, and every chunk
    /// without its reply completes `ShuttingDown`. Each chunk's message is
    /// the engine's own copy, so a chunk still being sent no longer needs
    /// the caller's source: it completes too, and its send is kept (or
    /// ended) with the others.
    pub(super) fn end_writes_at_teardown(&mut self) {
        self.writer.shutdown();
        for at in std::mem::take(&mut self.unposted_writes) {
            if let Some(op) = self.write_ops.get_mut(&at) {
                op.message = None;
                for write in op.sent() {
                    self.writer.send_ended(write, Err(RdmaError::ShuttingDown));
                }
            }
        }
        let sending: Vec<WriteId> = self
            .sends
            .values()
            .flat_map(|send| send.for_writes.iter().copied())
            .collect();
        for write in sending {
            self.writer.send_ended(write, Err(RdmaError::ShuttingDown));
        }
        self.complete_writes();
        // Chunks the machine could not finish (none expected) end with
        // their puts.
        let left: Vec<usize> = self.write_ops.keys().copied().collect();
        for at in left {
            if let Some(op) = self.write_ops.remove(&at) {
                if op.receiving {
                    self.discards.insert(at, (op.context, op.reply));
                }
                for (put_id, _) in op.writes {
                    if let Some(put) = self.puts.get_mut(&put_id) {
                        put.in_flight = put.in_flight.saturating_sub(1);
                        put.error.get_or_insert(RdmaError::ShuttingDown);
                    }
                }
            }
        }
        let puts: Vec<u64> = self.puts.keys().copied().collect();
        for id in puts {
            if let Some(put) = self.puts.get_mut(&id) {
                put.error.get_or_insert(RdmaError::ShuttingDown);
                put.in_flight = 0;
            }
            self.finish_put_if_done(id);
        }
    }
}
