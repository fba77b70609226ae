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
//! Teardown withdraws the write receives first
//! ([`Engine::withdraw_write_receives`]) and waits, within its timeout,
//! until none is posted: over `tcp;ofi_rxm` a write's bytes arrive after
//! its receive matched (the provider reads them from the writer), and
//! libfabric 1.17's `tcp` completes the read a response is arriving for
//! twice when its endpoint closes, the second time with a freed context,
//! on which `ofi_rxm` crashes (`tcpx_ep_flush_all_queues` reports the
//! entry from the read queue and again as `cur_rx.entry`).

use std::ffi::c_void;

use rdmareg_engine::served::Write;

use crate::protocol::{WRITE_RECEIVE_MAX, WRITE_RECEIVES, WRITE_TAG, WriteRequest};

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
        let endpoint = self.endpoint_of(dest);
        self.give_owner_time();
        self.write_payload = Some((payload.as_ptr() as usize, payload.len()));
        self.owner.handle_write(
            endpoint,
            Write {
                request_id: header.request_id,
                region: header.region_id,
                capability: header.capability,
                address: header.address,
                length: header.length,
            },
            payload.len() as u64,
        );
        self.run_owner_actions(dest);
        self.write_payload = None;
    }

    /// Performs `Action::Receive`: copies the payload of the write being
    /// served into `[address, address + length)`, which the owner machine
    /// admitted, and tells the machine the bytes are in.
    pub(super) fn receive_write(
        &mut self,
        receive: rdmareg_engine::served::ReceiveId,
        address: u64,
        length: u64,
    ) {
        let payload = self
            .write_payload
            .take()
            .filter(|&(_, len)| len as u64 == length);
        let Some((source, len)) = payload else {
            // Only `serve_write` admits writes, with its payload at hand.
            tracing::error!(
                receive = receive.0,
                "a write was admitted without its payload"
            );
            self.owner.receive_failed(receive);
            return;
        };
        // SAFETY: the source is `len` bytes of the write receive buffer
        // `serve_write` is serving from (out of the provider's hands: its
        // completion was read and it is not posted again until this
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
}
