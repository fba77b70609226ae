//! Reading the completion queue and matching each entry to what it ends.
//!
//! An entry ends a read's reply (written, refused, asked again or failed),
//! brings a request to serve, ends a send (a reply's lease, a request, a
//! probe), or gives back a cancelled receive. This is the only place the
//! provider releases an op's destination, so a read completes from here or
//! after teardown closed the endpoint, never earlier (see the parent
//! module).

use std::time::Instant;

use bytes::Bytes;
use rdmareg_core::RdmaError;

use crate::fabric::{Completion, ERR_TRUNCATED};
use crate::protocol::{NOTICE_TAG, WRITE_TAG, is_unverified, reply_outcome};

use super::*;

impl Engine {
    /// Reads completions and completes what they end.
    pub(super) fn reap(&mut self) -> bool {
        let mut completions = std::mem::take(&mut self.completions);
        let mut senders: Vec<Option<Bytes>> = Vec::new();
        for (completion, sender) in std::mem::take(&mut self.read_ahead) {
            completions.push(completion);
            senders.push(sender);
        }
        self.fabric
            .poll_completions(&mut completions, COMPLETION_BATCH);
        let worked = !completions.is_empty();
        // The address-vector entry a request's sender is named by is read
        // now, before any request of this batch is served: serving one may
        // forget idle consumer addresses and give their entry numbers to
        // new ones, after which a number read here would name another peer.
        let polled: Vec<Option<Bytes>> = completions[senders.len()..]
            .iter()
            .map(|completion| self.sender_of(completion))
            .collect();
        senders.extend(polled);
        if !self.stale_numbers.is_empty() {
            self.rename_stale_senders(&completions);
        }
        for (index, completion) in completions.drain(..).enumerate() {
            let (context, result) = match completion {
                Completion::Done(context, len, tag, source) => (context, Ok((len, tag, source))),
                Completion::Failed(context, code, text) => (context, Err((code, text))),
            };
            let at = context as usize;
            if self.sends.contains_key(&at) {
                self.send_done(at, result.map(|_| ()));
                continue;
            }
            if self
                .request_buffers
                .get(&at)
                .is_some_and(|b| b.tag == NOTICE_TAG)
            {
                self.notice_arrived(at, result);
                continue;
            }
            if self
                .request_buffers
                .get(&at)
                .is_some_and(|b| b.tag == WRITE_TAG)
            {
                self.write_arrived(at, result.map(|(len, _, _)| len));
                continue;
            }
            if self.request_buffers.contains_key(&at) {
                let sender = senders.get(index).cloned().flatten();
                self.request_arrived(at, result.map(|(len, _, _)| (len, sender)));
                continue;
            }
            if self.discards.remove(&at).is_some() {
                if let Some((owner, len)) = self.discard_owners.remove(&at) {
                    if let Some(held) = self.discard_bytes.get_mut(&owner) {
                        *held = held.saturating_sub(len);
                        if *held == 0 {
                            self.discard_bytes.remove(&owner);
                        }
                    }
                }
                tracing::trace!(ok = result.is_ok(), "a discard receive ended");
                continue;
            }
            if self.write_ops.contains_key(&at) {
                self.write_reply_arrived(at, result);
                continue;
            }
            let Some(slot) = self.by_context.get(&at).copied() else {
                tracing::warn!(?context, "a completion for no operation of this engine");
                continue;
            };
            self.read_ended(slot, result);
        }
        self.completions = completions;
        worked
    }

    /// The receive (or one-sided read) of the read in `slot` ended: ask
    /// again or send again where the owner or the connection calls for it,
    /// else hand the outcome to the consumer machine.
    fn read_ended(&mut self, slot: usize, result: Result<(usize, u64, u64), (i32, String)>) {
        let Some(op) = self.ops[slot].as_mut() else {
            return;
        };
        // Asked of the owner (a request id is never 0), rather than read
        // with `fi_read`: every read on the owner-served path, and reads
        // under a lease on the one-sided one.
        let served = op.request_id != 0;
        let expired = op.expired_at.is_some();
        let failure = op.failure.take();
        let (expected, request_id, fi_addr) = (op.len, op.request_id, op.fi_addr);
        let no_reply = op.unreachable || op.request_failed;
        let is_list = op.list.is_some();
        if let (Some(request), Err(_)) = (op.resend.take(), &result) {
            // The receive cancelled for a request that found its connection
            // closed was given back: post it again and send the request on
            // the new connection.
            if !expired && !self.closing {
                tracing::debug!(
                    request = request.0,
                    resends_left = op.resends_left,
                    "sending a read request again on a new connection"
                );
                op.request = Some(request);
                op.request_failed = false;
                op.posted = false;
                self.unposted.push_back(slot);
                return;
            }
        }
        if result.is_ok() {
            if let Some(watch) = self.watch.get_mut(&fi_addr) {
                watch.last_heard = Instant::now();
            }
        }
        tracing::trace!(slot, ok = result.is_ok(), expired, "a read's receive ended");
        if let (Ok((_, tag, _)), true) = (&result, served) {
            if is_unverified(*tag) {
                if self.ask_again(slot) {
                    return;
                }
                // Not asked again: past its deadline, or at teardown (the
                // machine fails it `ShuttingDown` then).
                if expired || self.closing {
                    self.provider_released(slot, Err(RdmaError::Timeout));
                    return;
                }
            }
        }
        if let (Ok((len, tag, _)), true) = (&result, is_list) {
            let outcome = self.copy_list_reply(slot, *len, *tag);
            self.provider_released(slot, outcome);
            return;
        }
        let truncated = matches!(result, Err((ERR_TRUNCATED, _)));
        if served && result.is_err() && !no_reply && !truncated {
            // The receive ended (cancelled) without the reply: the owner
            // may still send it, and holds its lease until a receive takes
            // it. (A reply longer than asked did arrive, truncated: nothing
            // is left to take, and a discard receive would stay posted,
            // with its scratch memory, until teardown.)
            self.post_discard(fi_addr, request_id, expected);
        }
        // Only the deadline makes a Timeout (the machine's rule): tcp;ofi_rxm
        // reports an owner's refusal (stale key, range outside the region)
        // as FI_ECANCELED, which is a refusal, not a timeout.
        let outcome =
            match result {
                Ok((len, tag, _)) if served => reply_outcome(tag).and_then(|()| {
                    if len == expected {
                        Ok(())
                    } else {
                        Err(RdmaError::backend(format!(
                            "ofi: read failed: the owner sent {len} bytes for a read of {expected}"
                        )))
                    }
                }),
                Ok(_) => Ok(()),
                Err((_, text)) => Err(failure
                    .unwrap_or_else(|| RdmaError::backend(format!("ofi: read failed: {text}")))),
            };
        self.provider_released(slot, outcome);
    }
}
