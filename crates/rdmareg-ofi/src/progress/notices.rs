//! Notices over libfabric (see `rdmareg_backend::notices`).
//!
//! A reader sends each notice as one tagged message with
//! [`NOTICE_TAG`] to the owner's address-vector entry, in order with its
//! other sends to that owner, whatever path its reads took. An owner keeps
//! [`NOTICE_RECEIVES`] receives of [`NOTICE_RECEIVE_MAX`] bytes posted for
//! that tag, on either read path, and hands what arrives to the engine's
//! notice board under the sender's entry as the provider reported it
//! (`FI_ADDR_NOTAVAIL` for every sender it does not name: the notice's own
//! sender number still tells them apart). A message longer than the
//! receive is truncated by the provider and counted as malformed.

use bytes::Bytes;
use rdmareg_backend::notices::wire;
use rdmareg_core::{PeerId, RdmaError};

use crate::fabric::{ADDR_NOTAVAIL, ERR_TRUNCATED};
use crate::protocol::NOTICE_TAG;

use super::*;

/// Notice receives kept posted.
const NOTICE_RECEIVES: usize = 8;

/// The longest notice message: the fixed part and the largest notice.
pub(super) const NOTICE_RECEIVE_MAX: usize = wire::HEADER_LEN + wire::MAX_NOTICE_BYTES;

impl Engine {
    /// Posts the notice receives.
    pub(super) fn post_notice_receives(&mut self) {
        for _ in 0..NOTICE_RECEIVES {
            let buffer = RequestBuffer {
                context: Box::new(OpContext {
                    space: [std::ptr::null_mut(); 8],
                }),
                data: vec![0u8; NOTICE_RECEIVE_MAX].into_boxed_slice(),
                tag: NOTICE_TAG,
                posted: false,
            };
            let at = (&raw const *buffer.context) as usize;
            self.request_buffers.insert(at, buffer);
            self.repost_request(at);
        }
    }

    /// A notice receive ended: post it again and hand the message to the
    /// board.
    pub(super) fn notice_arrived(
        &mut self,
        at: usize,
        result: Result<(usize, u64, u64), (i32, String)>,
    ) {
        let Some(buffer) = self.request_buffers.get_mut(&at) else {
            return;
        };
        buffer.posted = false;
        let arrived = match result {
            Ok((len, _, source)) => {
                Some((source, buffer.data[..len.min(buffer.data.len())].to_vec()))
            }
            // Longer than any notice: counted as malformed below.
            Err((ERR_TRUNCATED, _)) => Some((ADDR_NOTAVAIL, Vec::new())),
            Err((_, text)) => {
                tracing::debug!(error = %text, "a notice receive failed");
                None
            }
        };
        self.repost_request(at);
        if let Some((source, message)) = arrived {
            let _ = self.signals.notices.receive(source, &message);
        }
    }

    /// Sends `notice` (within the bound: the front checked it) to `peer`;
    /// `reply` learns when the provider completed the send.
    pub(super) fn send_notice(&mut self, peer: PeerId, notice: Bytes, reply: Reply<()>) {
        if self.closing {
            let _ = reply.send(Err(RdmaError::ShuttingDown));
            return;
        }
        let Some(&fi_addr) = self.peers.get(&peer) else {
            let _ = reply.send(Err(RdmaError::NotConfigured));
            return;
        };
        self.notices_sent += 1;
        let message = match wire::encode(self.signals.notice_sender.0, self.notices_sent, &notice) {
            Ok(message) => message,
            Err(_) => {
                let _ = reply.send(Err(RdmaError::NoticeTooLarge {
                    length: notice.len() as u64,
                }));
                return;
            }
        };
        let mut send = SendOp::owning(fi_addr, NOTICE_TAG, message);
        send.notice_reply = Some(reply);
        self.queue_send(send);
    }
}
