//! Tagged sends: replies, refusals, read requests and probes.
//!
//! Sends are queued in order per peer when the provider asks to retry
//! (`-FI_EAGAIN`). A request's bytes live in its `SendOp`, and a reply's
//! region keeps its lease, until the provider reports the send's
//! completion, so an unmap never deregisters bytes still being sent.

use std::collections::VecDeque;
use std::ffi::c_void;
use std::time::Instant;

use rdmareg_core::RdmaError;

use crate::fabric::{ADDR_NOTAVAIL, ERR_NOT_CONNECTED};

use super::*;

impl Engine {
    /// Posts a send now, or queues it when the provider asks to wait.
    pub(super) fn queue_send(&mut self, send: SendOp) {
        let at = (&raw const *send.context) as usize;
        let dest = send.dest;
        self.sends.insert(at, send);
        // Sends to one peer keep their order; a peer that cannot be reached
        // holds up only its own.
        let waiting = self
            .unsent
            .iter()
            .any(|queued| self.sends.get(queued).is_some_and(|s| s.dest == dest));
        if waiting || !self.post_send(at) {
            self.unsent.push_back(at);
        }
    }

    /// Posts one queued send; `false` to retry later. A send that fails to
    /// post ends as if its completion had failed.
    pub(super) fn post_send(&mut self, at: usize) -> bool {
        let Some(send) = self.sends.get_mut(&at) else {
            return true;
        };
        let context = (&raw mut send.context.space).cast::<c_void>();
        // SAFETY: a reply's bytes lie inside a registered region held by
        // its lease until this send's completion is read; a request's
        // bytes are owned by the entry; the entry (and its boxed context)
        // stays in `sends` until then, or until the endpoint is closed.
        let posted = unsafe {
            self.fabric
                .tsend(send.ptr, send.len, send.desc, send.dest, send.tag, context)
        };
        let dest = send.dest;
        match posted {
            Ok(true) => {
                send.connection = self.av.get(&dest).map(|entry| entry.connection);
                if let Some(watch) = self.watch.get_mut(&dest) {
                    watch.blocked_since = None;
                }
                true
            }
            Ok(false) => {
                let now = Instant::now();
                let watch = self
                    .watch
                    .entry(dest)
                    .or_insert_with(|| PeerWatch::new(now));
                watch.blocked_since.get_or_insert(now);
                false
            }
            Err(err) => {
                self.send_done(at, Err((0, err.to_string())));
                true
            }
        }
    }

    /// Retries queued sends in order; a peer whose send must wait holds up
    /// only its own later sends.
    pub(super) fn retry_unsent(&mut self) -> bool {
        let mut worked = false;
        let mut waiting: Vec<u64> = Vec::new();
        let mut left = VecDeque::with_capacity(self.unsent.len());
        while let Some(at) = self.unsent.pop_front() {
            let Some(dest) = self.sends.get(&at).map(|send| send.dest) else {
                continue;
            };
            if waiting.contains(&dest) {
                left.push_back(at);
            } else if self.post_send(at) {
                worked = true;
            } else {
                waiting.push(dest);
                left.push_back(at);
            }
        }
        self.unsent = left;
        worked
    }

    /// A send ended: release its lease; a failed request fails its read
    /// (whose receive is cancelled, and completes when that is reported).
    pub(super) fn send_done(&mut self, at: usize, result: Result<(), (i32, String)>) {
        let Some(send) = self.sends.remove(&at) else {
            return;
        };
        let mut send = send;
        if let Some(reply) = send.notice_reply.take() {
            let _ = reply.send(match &result {
                Ok(()) => Ok(()),
                // Ended by teardown, not by the provider.
                Err(_) if self.closing => Err(RdmaError::ShuttingDown),
                Err((_, text)) => Err(RdmaError::backend(format!(
                    "ofi: sending a notice failed: {text}"
                ))),
            });
        }
        tracing::trace!(tag = format_args!("{:#x}", send.tag), ok = result.is_ok(), owner_send = ?send.owner_send, "a send ended");
        if let Some(id) = send.owner_send {
            if result.is_ok() {
                self.owner.send_completed(id);
            } else {
                self.owner.send_failed(id);
            }
            self.run_owner_actions(ADDR_NOTAVAIL);
        }
        if send.gathered {
            self.gathered_bytes = self.gathered_bytes.saturating_sub(send.len);
            if let Some(count) = self.gathered.get_mut(&send.dest) {
                *count = count.saturating_sub(1);
                if *count == 0 {
                    self.gathered.remove(&send.dest);
                }
            }
        }
        if result.is_ok() {
            if let Some(entry) = self.av.get_mut(&send.dest) {
                entry.connected = true;
            }
        }
        if let Some(watch) = self.watch.get_mut(&send.dest) {
            if send.probe {
                watch.probing = false;
            }
            if result.is_ok() {
                watch.last_heard = Instant::now();
            }
        }
        if !send.for_writes.is_empty() {
            let ended = match &result {
                Ok(()) => Ok(()),
                Err(_) if self.closing => Err(RdmaError::ShuttingDown),
                Err((_, text)) => Err(RdmaError::backend(format!(
                    "ofi: sending the write failed: {text}"
                ))),
            };
            for &write in &send.for_writes {
                self.writer.send_ended(write, ended.clone());
            }
            self.complete_writes();
        }
        if let Err((code, text)) = result {
            tracing::debug!(tag = format_args!("{:#x}", send.tag), error = %text, "a tagged send failed");
            if let Some((read, request_id)) = send.for_read {
                let slot = self.by_context.get(&read).copied().filter(|&slot| {
                    self.ops[slot]
                        .as_ref()
                        .is_some_and(|op| op.request_id == request_id)
                });
                let Some(slot) = slot else {
                    return;
                };
                if self.resend_on_new_connection(slot, code, send) {
                    return;
                }
                if let Some(op) = self.ops[slot].as_mut() {
                    op.request_failed = true;
                    // (A request that teardown ended fails `ShuttingDown`:
                    // the machine's rule.)
                    let error = if code == ERR_NOT_CONNECTED && op.resends_left < RESENDS {
                        RdmaError::backend(format!(
                            "ofi: sending the read request failed: {text}; it was sent again \
                             on a new connection {} times",
                            RESENDS - op.resends_left
                        ))
                    } else {
                        RdmaError::backend(format!("ofi: sending the read request failed: {text}"))
                    };
                    // The receive is posted: it completes once given back.
                    if self.consumer.request_failed(op.read, error) {
                        self.fabric.cancel(read as *mut c_void);
                    }
                }
            }
        }
    }
}
