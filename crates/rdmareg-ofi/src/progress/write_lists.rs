//! Write lists on this engine: a batch's small puts to one owner go as one
//! message, answered by one reply (`protocol`, "Write lists").
//!
//! A served put sent alone costs a message, a reply receive and a reply;
//! over `tcp;ofi_rxm` that is what bounds a batch of small ones. So a
//! batch's puts of at most [`WRITE_LIST_ENTRY_MAX`] bytes to one owner
//! travel together, up to [`MAX_LIST_ENTRIES`] and
//! [`WRITE_LIST_TOTAL_MAX`] bytes a list, the whole message within
//! [`WRITE_RECEIVE_MAX`] (what every owner's write receive takes).
//!
//! - **Each put stays its own.** Every entry is its own write of the
//!   writer machine, with its own deadline, source hold and result; only
//!   the message and the reply receive are shared, so the message's send
//!   ending is every entry's send ending, and a refused entry fails alone.
//! - **Replies are taken as single ones are.** The reply's status byte for
//!   an entry goes to the writer machine as that write's reply, so an `Ok`
//!   completes a write only once its send ended too. A reply that is not
//!   one status byte per entry, a refusal tag, or a failed receive leaves
//!   each entry's outcome unknown, and each fails.
//! - **The owner's half** is `serve_writes`: the engine kit judges each
//!   entry as a single write at its place in the payload.

use rdmareg_core::{BackendPut, RdmaError};
use rdmareg_engine::served::consumer::{Reply as KitReply, ReplyOutcome};
use rdmareg_engine::served::{Operation, WriteTarget};

use crate::protocol::{
    ListEntry, MAX_LIST_ENTRIES, WRITE_LIST_ENTRY_MAX, WRITE_LIST_TOTAL_MAX, WRITE_RECEIVE_MAX,
    WriteListRequest, parse_write_list_reply, refusal_of_tag, write_list_message_len,
};

use super::writes::WriteOp;
use super::*;

/// Whether a put may travel in a write list.
fn fits_a_write_list(request: &BackendPut) -> bool {
    request.len > 0 && request.len <= WRITE_LIST_ENTRY_MAX
}

impl Engine {
    /// Starts a batch of puts: each small one to an owner joins that
    /// owner's write lists, each other one goes as its own chunks.
    pub(super) fn start_put_batch(&mut self, requests: Vec<BackendPut>, reply: BatchReply) {
        if requests.is_empty() {
            let _ = reply.send(Vec::new());
            return;
        }
        let batch = BatchResults::new(requests.len(), reply);
        let mut listed = Vec::new();
        for (index, request) in requests.into_iter().enumerate() {
            let waiter = Waiter::Batch(Rc::clone(&batch), index);
            if !fits_a_write_list(&request) {
                self.start_put(request, waiter);
                continue;
            }
            if let Some(id) = self.open_put(&request, waiter) {
                listed.push(id);
            }
        }
        self.send_write_lists(listed);
        self.complete_writes();
    }

    /// Sends the opened puts `ids` as runs to one owner within a list's
    /// bounds: a run of one alone, a longer one as a write list.
    fn send_write_lists(&mut self, mut ids: Vec<u64>) {
        // Stable: each owner's puts keep their order.
        ids.sort_by_key(|id| self.puts.get(id).map(|put| put.fi_addr));
        let mut run: Vec<u64> = Vec::new();
        let mut run_bytes = 0u64;
        let mut run_owner = None;
        let address_len = self.fabric.address.len();
        for id in ids {
            let Some((fi_addr, len)) = self.puts.get(&id).map(|put| (put.fi_addr, put.len)) else {
                continue;
            };
            let joins = run_owner == Some(fi_addr)
                && run.len() < MAX_LIST_ENTRIES
                && run_bytes + len <= WRITE_LIST_TOTAL_MAX
                && write_list_message_len(run.len() + 1, address_len, run_bytes + len)
                    <= WRITE_RECEIVE_MAX as u64;
            if !joins {
                self.send_run(std::mem::take(&mut run));
                run_bytes = 0;
                run_owner = Some(fi_addr);
            }
            run_bytes += len;
            run.push(id);
        }
        self.send_run(run);
    }

    fn send_run(&mut self, run: Vec<u64>) {
        match run.as_slice() {
            [] => {}
            [id] => self.send_chunks(*id),
            _ => self.send_write_list(&run),
        }
    }

    /// Starts every put of `run` (opened, one owner, within a list's
    /// bounds) as one write of the writer machine and sends them as one
    /// write list.
    fn send_write_list(&mut self, run: &[u64]) {
        let Some((fi_addr, endpoint)) = run
            .first()
            .and_then(|id| self.puts.get(id))
            .map(|put| (put.fi_addr, put.endpoint))
        else {
            return;
        };
        let context = Box::new(OpContext {
            space: [std::ptr::null_mut(); 8],
        });
        let at = (&raw const *context) as usize;
        let mut writes = Vec::with_capacity(run.len());
        let mut listed = Vec::with_capacity(run.len());
        let mut entries = Vec::with_capacity(run.len());
        let mut payload = Vec::new();
        for &id in run {
            let Some(put) = self.puts.get_mut(&id) else {
                continue;
            };
            put.next = put.len;
            put.in_flight = 1;
            let target = WriteTarget {
                region: put.region_id,
                capability: put.capability,
                address: put.remote,
                length: put.len,
            };
            let (source, len) = (put.source, put.len as usize);
            let posted = self.writer.start(endpoint, target, put.deadline, at);
            writes.push((id, posted.id));
            // `None`: completed at once (teardown began); nothing is sent
            // for it.
            if posted.request.is_none() {
                continue;
            }
            listed.push((posted.id, target.length));
            entries.push(ListEntry {
                region_id: target.region,
                capability: target.capability,
                address: target.address,
                length: target.length,
            });
            // SAFETY: `source..source + len` lies inside the put's source
            // region (checked against its mapped pointer and length in
            // `check_put`), which stays registered, and so allocated,
            // while its `in_flight` counts this put; the caller of
            // `put_batch` writes none of it until the put completes. No
            // reference to it outlives this copy.
            payload
                .extend_from_slice(unsafe { std::slice::from_raw_parts(source as *const u8, len) });
        }
        let request_id = self.mint_request_id();
        let message = (!entries.is_empty()).then(|| {
            WriteListRequest {
                request_id,
                entries,
                reply_to: self.fabric.address.to_vec(),
            }
            .encode_with(&payload)
        });
        self.write_ops.insert(
            at,
            WriteOp {
                context,
                reply: vec![0; listed.len().max(1)],
                writes,
                listed,
                request_id,
                fi_addr,
                endpoint,
                message,
                receiving: false,
            },
        );
        self.post_or_queue_write(at);
    }

    /// The reply receive of the write list at `at` ended: each entry's
    /// status goes to the writer machine as that write's reply.
    pub(super) fn write_list_reply_arrived(
        &mut self,
        at: usize,
        result: Result<(usize, u64, u64), (i32, String)>,
    ) {
        let Some(op) = self.write_ops.get_mut(&at) else {
            return;
        };
        op.receiving = false;
        let endpoint = op.endpoint;
        let listed = op.listed.clone();
        let unknown = |why: String| {
            vec![
                ReplyOutcome::Refused(RdmaError::backend(format!(
                    "ofi: {why}; the write's outcome is unknown"
                )));
                listed.len()
            ]
        };
        let (outcomes, payload) = match result {
            Ok((len, tag, _)) => match refusal_of_tag(tag) {
                // An owner answers a list only with its status bytes.
                Some(refusal) => (
                    unknown(format!(
                        "the owner answered the write list with a refusal tag ({refusal})"
                    )),
                    len as u64,
                ),
                None => match op
                    .reply
                    .get(..len)
                    .and_then(|reply| parse_write_list_reply(reply, listed.len()))
                {
                    Some(statuses) => (
                        statuses
                            .into_iter()
                            .zip(&listed)
                            .map(|(status, &(_, length))| match status {
                                Ok(()) => ReplyOutcome::Served { length },
                                Err(refusal) => {
                                    ReplyOutcome::Refused(refusal.error_for(Operation::Write))
                                }
                            })
                            .collect(),
                        0,
                    ),
                    None => (
                        unknown(format!(
                            "the owner's write list reply was {len} bytes, not one per entry ({})",
                            listed.len()
                        )),
                        0,
                    ),
                },
            },
            Err((_, text)) => (
                unknown(format!("the write list's reply receive failed: {text}")),
                0,
            ),
        };
        for ((write, _), outcome) in listed.iter().zip(outcomes) {
            let reply = KitReply {
                request_id: write.0,
                outcome,
            };
            if let Err(reason) = self.writer.handle_reply(endpoint, &reply, payload) {
                tracing::debug!(?reason, "an entry of a write list's reply was dropped");
            }
        }
        self.complete_writes();
    }
}
