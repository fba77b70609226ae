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
//!
//! The release of a descriptor lease travels the same way, as a message of
//! the same series (`notices::wire`'s kind 1: the lease key's region and
//! capability) sent by the same path ([`Engine::send_message`]); the owner's
//! notice receive hands it to the owner machine, which counts it once per
//! reader (`leases`), and never to the notice board.

use bytes::Bytes;
use rdmareg_backend::notices::wire;
use rdmareg_core::{PeerId, RdmaError};

use crate::fabric::{ADDR_NOTAVAIL, ERR_TRUNCATED};
use crate::key::PackedKey;
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
    /// owner machine if it is a lease release, else to the board.
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
        match arrived {
            Some((_, message)) if wire::is_release(&message) => self.receive_release(&message),
            Some((source, message)) => {
                let _ = self.signals.notices.receive(source, &message);
            }
            None => {}
        }
    }

    /// Sends `notice` (within the bound: the front checked it) to `peer`;
    /// `reply` learns when the provider completed the send.
    pub(super) fn send_notice(&mut self, peer: PeerId, notice: Bytes, reply: Reply<()>) {
        let sender = self.signals.notice_sender.0;
        self.send_message(peer, reply, |sequence| {
            wire::encode(sender, sequence, &notice)
        });
    }

    /// Sends the release of the lease whose key is `packed_key` to `peer`,
    /// as a message of the notice series (`leases`); `reply` learns when
    /// the provider completed the send. A key that is no lease key of that
    /// peer is refused [`RdmaError::InvalidKey`] before anything is sent.
    pub(super) fn send_release(&mut self, peer: PeerId, packed_key: Bytes, reply: Reply<()>) {
        let key = match PackedKey::decode_lease(&packed_key) {
            Ok(key) => key,
            Err(err) => {
                let _ = reply.send(Err(err));
                return;
            }
        };
        let sender = self.signals.notice_sender.0;
        let owner = self
            .peers
            .get(&peer)
            .and_then(|fi_addr| self.av.get(fi_addr))
            .map(|entry| entry.address.clone());
        self.send_message(peer, reply, |sequence| {
            if owner.as_ref() != Some(&key.owner) {
                // A lease of another owner than the peer named.
                return Err(RdmaError::InvalidKey);
            }
            Ok(wire::encode_release(
                sender,
                sequence,
                key.region_id,
                &key.capability,
            ))
        });
    }

    /// Sends the message `encode` makes from the next number of this
    /// engine's notice series to `peer`, as one tagged message with
    /// [`NOTICE_TAG`]; the number is spent only if `encode` made one.
    fn send_message(
        &mut self,
        peer: PeerId,
        reply: Reply<()>,
        encode: impl FnOnce(u64) -> Result<Vec<u8>, RdmaError>,
    ) {
        if self.closing {
            let _ = reply.send(Err(RdmaError::ShuttingDown));
            return;
        }
        let Some(&fi_addr) = self.peers.get(&peer) else {
            let _ = reply.send(Err(RdmaError::NotConfigured));
            return;
        };
        let sequence = self.notices_sent + 1;
        let message = match encode(sequence) {
            Ok(message) => message,
            Err(err) => {
                let _ = reply.send(Err(err));
                return;
            }
        };
        self.notices_sent = sequence;
        let mut send = SendOp::owning(fi_addr, NOTICE_TAG, message);
        send.notice_reply = Some(reply);
        self.queue_send(send);
    }
}
