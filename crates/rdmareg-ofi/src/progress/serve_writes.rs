//! The owner's side of served writes, driven by the engine kit's owner.
//!
//! The engine keeps [`WRITE_RECEIVES`] receives of [`WRITE_RECEIVE_MAX`]
//! bytes posted on [`WRITE_TAG`], on either read path. A write message is
//! header and bytes in one tagged message, so its receive must be posted
//! before the owner knows where the bytes go: posting it into a
//! registration before the kit admitted the write would let a refused
//! write change bytes. So it lands in one of these bounce buffers, and the
//! kit's owner (`rdmareg_engine::served::owner::writes`) judges it:
//! registration, capability, write access, not unmapping, range, payload
//! length, the consumer's bound. An accepted write is copied into the
//! registration at once, in the same loop turn (`Action::Receive`), so its
//! hold on the region never spans a turn and an unmap never waits for a
//! peer; only then is the reply sent (`Action::Acknowledge`). A refused
//! write changes no byte. Replies go to the address the message names
//! (the provider is not asked who sent it, as for lists and on `shm`): a
//! forged address gets an 8-byte reply its owner has no receive for.
//!
//! A write list (`protocol`, "Write lists") lands in the same receives
//! and goes to the kit's owner whole (`Owner::handle_write_list`): each
//! accepted entry is copied from its place in the payload in the same
//! loop turn, and the list's one reply, a status byte per entry, is sent
//! only after the last copy (`Action::AcknowledgeList`).
//!
//! Teardown withdraws the write receives first
//! ([`Engine::withdraw_write_receives`]) and waits, within its timeout,
//! until none is posted: over `tcp;ofi_rxm` a write's bytes arrive after
//! its receive matched (the provider reads them from the writer), and
//! libfabric 1.17's `tcp` completes the read a response is arriving for
//! twice when its endpoint closes, the second time with a freed context,
//! on which `ofi_rxm` crashes (`tcpx_ep_flush_all_queues` reports the
//! entry from the read queue and again as `cur_rx.entry`).

use std::ffi::c_void;

use rdmareg_engine::served::{ListEntryReply, Write, WriteListLimits};

use crate::protocol::{
    MAX_LIST_ENTRIES, WRITE_LIST_ENTRY_MAX, WRITE_LIST_TOTAL_MAX, WRITE_LIST_VERSION,
    WRITE_RECEIVE_MAX, WRITE_RECEIVES, WRITE_TAG, WriteListRequest, WriteRequest,
    encode_write_list_reply,
};

/// A write message or write list being judged: where its payload lies in
/// the receive buffer being served, and, for a list, the tag its reply
/// goes with. Set only while `Engine::judge_write` runs.
#[derive(Clone, Copy)]
pub(super) struct ServingWrite {
    payload: usize,
    len: usize,
    list_reply: Option<u64>,
}

/// The bounds this engine's owner holds write lists to: one reply each,
/// since a tagged message has no header bound.
const WRITE_LIST_LIMITS: WriteListLimits = WriteListLimits {
    max_entry: WRITE_LIST_ENTRY_MAX,
    max_total: WRITE_LIST_TOTAL_MAX,
    entries_per_reply: MAX_LIST_ENTRIES,
};

use super::*;

impl Engine {
    /// Posts the write receives unless they are posted already.
    pub(super) fn open_write_receives(&mut self) {
        if self
            .request_buffers
            .values()
            .any(|buffer| buffer.tag == WRITE_TAG)
        {
            return;
        }
        for _ in 0..WRITE_RECEIVES {
            let buffer = RequestBuffer {
                context: Box::new(OpContext {
                    space: [std::ptr::null_mut(); 8],
                }),
                data: vec![0u8; WRITE_RECEIVE_MAX].into_boxed_slice(),
                tag: WRITE_TAG,
                posted: false,
            };
            let at = (&raw const *buffer.context) as usize;
            self.request_buffers.insert(at, buffer);
            self.repost_request(at);
        }
    }

    /// At teardown: asks the provider to withdraw every write receive
    /// still posted. One not yet matched ends at once (over `tcp;ofi_rxm`
    /// and `shm`); one matched ends when its write's bytes are in. None is
    /// posted again once teardown began (`repost_request`).
    pub(super) fn withdraw_write_receives(&mut self) {
        for buffer in self.request_buffers.values_mut() {
            if buffer.tag == WRITE_TAG && buffer.posted {
                let context = (&raw mut buffer.context.space).cast::<c_void>();
                self.fabric.cancel(context);
            }
        }
    }

    /// Whether a write receive is still posted.
    pub(super) fn write_receives_posted(&self) -> bool {
        self.request_buffers
            .values()
            .any(|buffer| buffer.tag == WRITE_TAG && buffer.posted)
    }

    /// A write receive completed with `len` bytes (or failed): the write
    /// is judged and, if accepted, copied into its registration before the
    /// receive is posted again.
    pub(super) fn write_arrived(&mut self, at: usize, result: Result<usize, (i32, String)>) {
        let len = match result {
            Ok(len) => len,
            Err((_, text)) => {
                tracing::debug!(error = %text, "a write receive failed");
                if let Some(buffer) = self.request_buffers.get_mut(&at) {
                    buffer.posted = false;
                }
                self.repost_request(at);
                return;
            }
        };
        // Taken out while the write is served: the provider is done with
        // it (its completion was read) until it is posted again.
        let Some(mut buffer) = self.request_buffers.remove(&at) else {
            return;
        };
        buffer.posted = false;
        self.serve_write(&buffer.data[..len.min(buffer.data.len())]);
        self.request_buffers.insert(at, buffer);
        self.repost_request(at);
    }

    /// Judges one write message and performs what the owner machine asks.
    fn serve_write(&mut self, bytes: &[u8]) {
        if bytes.first() == Some(&WRITE_LIST_VERSION) {
            return self.serve_write_list(bytes);
        }
        let Some((header, payload)) = WriteRequest::decode(bytes) else {
            tracing::debug!(len = bytes.len(), "a malformed write message was dropped");
            return;
        };
        let Some(dest) = self.served_peer(&header.reply_to) else {
            return;
        };
        tracing::trace!(
            request = header.request_id,
            len = header.length,
            "serving a write"
        );
        let write = Write {
            request_id: header.request_id,
            region: header.region_id,
            capability: header.capability,
            address: header.address,
            length: header.length,
        };
        self.judge_write(dest, payload, None, |owner, endpoint| {
            owner.handle_write(endpoint, write, payload.len() as u64);
        });
    }

    /// Judges one write list and performs what the owner machine asks:
    /// every accepted entry's copy, then the list's reply.
    fn serve_write_list(&mut self, bytes: &[u8]) {
        let Some((header, payload)) = WriteListRequest::decode(bytes) else {
            tracing::debug!(len = bytes.len(), "a malformed write list was dropped");
            return;
        };
        let Some(dest) = self.served_peer(&header.reply_to) else {
            return;
        };
        tracing::trace!(
            request = header.request_id,
            entries = header.entries.len(),
            len = payload.len(),
            "serving a write list"
        );
        let writes: Vec<Write> = header
            .entries
            .iter()
            .map(|entry| Write {
                request_id: header.request_id,
                region: entry.region_id,
                capability: entry.capability,
                address: entry.address,
                length: entry.length,
            })
            .collect();
        let list_reply = Some(header.request_id);
        self.judge_write(dest, payload, list_reply, |owner, endpoint| {
            owner.handle_write_list(endpoint, &writes, payload.len() as u64, WRITE_LIST_LIMITS);
        });
    }

    /// Hands a write or write list from `dest` to the owner machine
    /// (`judge`, given the endpoint) and performs what it asks, with
    /// `payload` at hand for its receives (and `list_reply` for a list's
    /// answer) until then.
    fn judge_write(
        &mut self,
        dest: u64,
        payload: &[u8],
        list_reply: Option<u64>,
        judge: impl FnOnce(&mut Owner<u64>, u64),
    ) {
        let endpoint = self.endpoint_of(dest);
        self.give_owner_time();
        self.serving_write = Some(ServingWrite {
            payload: payload.as_ptr() as usize,
            len: payload.len(),
            list_reply,
        });
        judge(&mut self.owner, endpoint);
        self.run_owner_actions(dest);
        self.serving_write = None;
    }

    /// Performs `Action::Receive`: copies `length` bytes at
    /// `payload_offset` of the payload being served into
    /// `[address, address + length)`, which the owner machine admitted,
    /// and tells the machine the bytes are in.
    pub(super) fn receive_write(
        &mut self,
        receive: rdmareg_engine::served::ReceiveId,
        address: u64,
        length: u64,
        payload_offset: u64,
    ) {
        let within = |serving: &ServingWrite| {
            payload_offset
                .checked_add(length)
                .is_some_and(|end| end <= serving.len as u64)
        };
        let Some(ServingWrite { payload, .. }) = self.serving_write.filter(within) else {
            // Only `serve_write` and `serve_write_list` admit writes, with
            // their payload at hand, and the owner machine admits only
            // places inside it.
            tracing::error!(
                receive = receive.0,
                "a write was admitted without its payload"
            );
            self.owner.receive_failed(receive);
            return;
        };
        let (source, len) = (payload + payload_offset as usize, length as usize);
        // SAFETY: the source is `len` bytes inside the payload of the
        // write receive buffer `serve_write` or `serve_write_list` is
        // serving from (checked just above; out of the provider's hands:
        // its completion was read and it is not posted again until this
        // returns). The destination lies inside a live registration that
        // allows writes and is not being unmapped (the owner machine
        // checked it just now; no unmap runs before this returns), which
        // its owner keeps allocated until an unmap of it returns `Ok` and
        // mapped accepting that peers write it at any time. No reference
        // is made to either.
        unsafe {
            std::ptr::copy_nonoverlapping(source as *const u8, address as *mut u8, len);
        }
        self.owner.receive_completed(receive);
    }

    /// Performs `Action::Acknowledge`: the 8-byte reply saying `length`
    /// bytes are in, with tag `request_id`, to `reply_at`.
    pub(super) fn acknowledge_write(
        &mut self,
        reply_at: u64,
        send: SendId,
        request_id: u64,
        length: u64,
    ) {
        self.queue_send(SendOp {
            owner_send: Some(send),
            ..SendOp::owning(reply_at, request_id, length.to_le_bytes().to_vec())
        });
    }

    /// Performs `Action::AcknowledgeList`: the write list's reply, a
    /// status byte per entry, with the list's tag, to `reply_at`. Every
    /// receive of a list ends in the turn it arrived in, so its answer
    /// comes while `serve_write_list` still knows its tag.
    pub(super) fn acknowledge_write_list(
        &mut self,
        reply_at: u64,
        send: SendId,
        entry_replies: &[ListEntryReply],
    ) {
        let Some(request_id) = self.serving_write.and_then(|serving| serving.list_reply) else {
            tracing::error!("a write list was answered outside the turn it arrived in");
            self.owner.send_failed(send);
            return;
        };
        let reply =
            encode_write_list_reply(entry_replies.iter().map(|entry| entry.outcome.map(|_| ())));
        self.queue_send(SendOp {
            owner_send: Some(send),
            ..SendOp::owning(reply_at, request_id, reply)
        });
    }
}
