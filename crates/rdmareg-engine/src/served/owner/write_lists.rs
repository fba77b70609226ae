//! Write lists: several served writes in one message, answered by one
//! reply.
//!
//! A write list carries up to [`wire::MAX_LIST_ENTRIES`] writes' headers
//! and their bytes back to back as one payload, so that a batch of small
//! writes costs the owner one message and one reply instead of one of
//! each per write (the read lists' gathering, turned around).
//!
//! # The contract
//!
//! 1. **Each entry is judged as a single write is** ([`writes`], point 1),
//!    with its own bytes: the entry's place in the payload is the sum of
//!    the lengths of the entries before it. A refused entry changes no
//!    byte, and refusing one does not refuse the others.
//! 2. **The payload must add up.** When the entries' lengths do not add
//!    up to the payload's length, or pass [`WriteListLimits::max_total`],
//!    no entry's bytes can be trusted to be its own, so every entry is
//!    refused [`Refusal::Malformed`]; an entry longer than
//!    [`WriteListLimits::max_entry`] is refused so alone.
//! 3. **One reply, once every receive ended.** Accepted entries hold their
//!    region and a place under the endpoint's bound of served replies, as
//!    single writes do; the list's [`Action::AcknowledgeList`] goes out
//!    only after the last accepted entry's receive ended, so every `Ok` in
//!    it means those bytes are in. The reply's send holds every accepted
//!    entry's place until it ended. A list with no entry accepted is
//!    answered at once, under the endpoint's refusal bound, as a read list
//!    that serves nothing is.
//! 4. **A failed endpoint's list is not answered**: its receives still end
//!    when the transport reports them, and their places are given back
//!    then.
//!
//! [`writes`]: super::writes

use std::fmt;
use std::hash::Hash;

use super::{Action, ListEntryReply, Owner, Refusal, Stage, Write, wire};
use crate::served::owner::Leases;

/// The bounds of a write list, as the owner enforces them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteListLimits {
    /// Longest entry; a longer one is refused [`Refusal::Malformed`].
    pub max_entry: u64,
    /// Most bytes a list's payload carries; past it every entry is
    /// refused [`Refusal::Malformed`].
    pub max_total: u64,
    /// Most entries a list may have: its reply header has one entry per
    /// write, and must fit the transport's bound on a header (UCX writes a
    /// longer one past its fragment buffer). A longer list is dropped, as
    /// no reply to it can be sent.
    pub max_entries: usize,
}

impl Default for WriteListLimits {
    /// The UCX engine's: 1 MiB a list, as much as one single write
    /// carries, any entry within that, and [`wire::MAX_LIST_ENTRIES`]
    /// entries.
    fn default() -> Self {
        WriteListLimits {
            max_entry: 1 << 20,
            max_total: 1 << 20,
            max_entries: wire::MAX_LIST_ENTRIES,
        }
    }
}

/// Which entry of which write list a receive is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ListSlot {
    list: u64,
    index: usize,
}

/// A write list with receives still running.
#[derive(Debug)]
pub(super) struct WriteList<E> {
    endpoint: E,
    entry_replies: Vec<ListEntryReply>,
    /// Accepted entries whose receive did not end.
    pending: usize,
    /// Entries accepted: each holds a place under the endpoint's bound.
    accepted: u32,
}

impl<E: Copy + Eq + Hash + fmt::Debug> Owner<E> {
    /// A write list arrived on `endpoint` as the UCX engine encodes it: the
    /// header `bytes` ([`wire::decode_write_list_request`]) and a payload
    /// of `payload_length` bytes. A header that does not decode is
    /// dropped, as there are no request ids to trust in it.
    pub fn handle_write_list_request(
        &mut self,
        endpoint: E,
        bytes: &[u8],
        payload_length: u64,
        limits: WriteListLimits,
    ) {
        match wire::decode_write_list_request(bytes) {
            Ok(entries) => self.handle_write_list(endpoint, &entries, payload_length, limits),
            Err(err) => {
                tracing::debug!(error = %err, "a malformed write list was dropped");
                self.dropped += 1;
            }
        }
    }

    /// A decoded write list arrived on `endpoint` with a payload of
    /// `payload_length` bytes: each entry accepted
    /// ([`Action::Receive`] at its place in the payload) or refused, and
    /// one [`Action::AcknowledgeList`] once every accepted entry's receive
    /// ended (module docs). An empty list, or one of more than
    /// [`WriteListLimits::max_entries`] or [`wire::MAX_LIST_ENTRIES`]
    /// entries, is dropped.
    pub fn handle_write_list(
        &mut self,
        endpoint: E,
        entries: &[Write],
        payload_length: u64,
        limits: WriteListLimits,
    ) {
        if !self.may_reply(endpoint) {
            return;
        }
        if entries.is_empty() || entries.len() > limits.max_entries.min(wire::MAX_LIST_ENTRIES) {
            tracing::debug!(
                entries = entries.len(),
                "a write list of no entries or too many was dropped"
            );
            self.dropped += 1;
            return;
        }
        let declared = entries
            .iter()
            .try_fold(0u64, |sum, write| sum.checked_add(write.length));
        let whole = declared.is_some_and(|sum| sum == payload_length && sum <= limits.max_total);
        let list = self.next_write_list;
        self.next_write_list += 1;
        let mut entry_replies = Vec::with_capacity(entries.len());
        let mut accepted = 0u32;
        let mut payload_offset = 0u64;
        for (index, write) in entries.iter().enumerate() {
            let outcome = if whole && write.length <= limits.max_entry {
                self.check_write(write, write.length)
            } else {
                Err(Refusal::Malformed)
            };
            let slot = ListSlot { list, index };
            let outcome = outcome.and_then(|target| {
                self.accept_write(
                    endpoint,
                    write.request_id,
                    target,
                    payload_offset,
                    Some(slot),
                )
                .map(|_| target)
            });
            match outcome {
                Ok(_) => accepted += 1,
                Err(refusal) => {
                    tracing::debug!(request = write.request_id, %refusal, "refused a write list entry");
                    self.refused += 1;
                }
            }
            entry_replies.push(ListEntryReply {
                request_id: write.request_id,
                outcome,
            });
            // Only used while `whole`, where the lengths add up without
            // overflow.
            payload_offset = payload_offset.wrapping_add(write.length);
        }
        if accepted == 0 {
            return self.answer_refused_list(endpoint, entry_replies);
        }
        self.write_lists.insert(
            list,
            WriteList {
                endpoint,
                entry_replies,
                pending: accepted as usize,
                accepted,
            },
        );
    }

    /// Refuses every entry of a write list on `endpoint` for a reason the
    /// driver decided itself (such as a payload the transport did not
    /// hand over the way the list's writer promised), in one reply under
    /// the endpoint's refusal bound; nothing is received. A list the owner
    /// would drop (empty, too long) is dropped.
    pub fn refuse_write_list(
        &mut self,
        endpoint: E,
        entries: &[Write],
        refusal: Refusal,
        limits: WriteListLimits,
    ) {
        if !self.may_reply(endpoint) {
            return;
        }
        if entries.is_empty() || entries.len() > limits.max_entries.min(wire::MAX_LIST_ENTRIES) {
            self.dropped += 1;
            return;
        }
        self.refused += entries.len() as u64;
        let entry_replies = entries
            .iter()
            .map(|write| ListEntryReply {
                request_id: write.request_id,
                outcome: Err(refusal),
            })
            .collect();
        self.answer_refused_list(endpoint, entry_replies);
    }

    /// Write lists whose reply waits for a receive.
    pub fn write_lists_in_flight(&self) -> usize {
        self.write_lists.len()
    }

    /// The receive of the entry `slot` ended: once it is the list's last,
    /// the list is answered (module docs, points 3 and 4).
    pub(super) fn end_list_entry(&mut self, slot: ListSlot, completed: bool) {
        let Some(list) = self.write_lists.get_mut(&slot.list) else {
            return;
        };
        if !completed {
            if let Some(entry) = list.entry_replies.get_mut(slot.index) {
                entry.outcome = Err(Refusal::ReceiveFailed);
            }
        }
        list.pending = list.pending.saturating_sub(1);
        #[cfg(test)]
        let waits = list.pending > 0 && !self.defects.answer_list_before_last_receive;
        #[cfg(not(test))]
        let waits = list.pending > 0;
        if waits {
            return;
        }
        let Some(list) = self.write_lists.remove(&slot.list) else {
            return;
        };
        let failed = self
            .endpoints
            .get(&list.endpoint)
            .is_some_and(|entry| entry.failed);
        if self.stage == Stage::Closed || failed {
            tracing::debug!("a write list's receives ended on a failed endpoint; no reply");
            for _ in 0..list.accepted {
                self.end_served_place(list.endpoint);
            }
            return;
        }
        let send = self.start_send_of(list.endpoint, Leases::None, list.accepted);
        self.actions.push_back(Action::AcknowledgeList {
            endpoint: list.endpoint,
            send,
            entry_replies: list.entry_replies,
        });
    }

    /// Answers a list none of whose entries was accepted, under the
    /// endpoint's refusal bound.
    fn answer_refused_list(&mut self, endpoint: E, entry_replies: Vec<ListEntryReply>) {
        let entry = self.endpoints.entry(endpoint).or_default();
        if entry.load.refusals >= self.bound {
            tracing::debug!("an endpoint holds too many refusals; a write list reply was dropped");
            self.dropped += 1;
            return;
        }
        entry.load.refusals += 1;
        let send = self.start_send(endpoint, Leases::None);
        self.actions.push_back(Action::AcknowledgeList {
            endpoint,
            send,
            entry_replies,
        });
    }
}

#[cfg(test)]
mod tests;
