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
//! 3. **A list counts under the endpoint's bound by its replies.** The
//!    bound is on unfinished replies, and a list has one reply per
//!    [`WriteListLimits::entries_per_reply`] entries, whatever it writes:
//!    a list arriving while the endpoint is at its bound has every entry
//!    that would be accepted refused [`Refusal::Busy`]; otherwise it takes
//!    one place per reply it will send, until that reply's send ended. So
//!    a list is accepted or busy as a whole, as one single write is, and
//!    a peer still cannot grow the owner's sends past the bound (nor its
//!    receives past [`wire::MAX_LIST_ENTRIES`] per place).
//! 4. **Answered once every receive ended.** Accepted entries hold their
//!    region as single writes do; the list's [`Action::AcknowledgeList`]
//!    replies go out, in entry order, only after the last accepted
//!    entry's receive ended, so every `Ok` in them means those bytes are
//!    in. A list with no entry accepted is answered at once, under the
//!    endpoint's refusal bound, as a read list that serves nothing is.
//! 5. **A failed endpoint's list is not answered**: its receives still end
//!    when the transport reports them, and its places are given back
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
    /// Most entries one reply carries: a reply header has one entry per
    /// write and must fit the transport's bound on a header (UCX writes a
    /// longer one past its fragment buffer). A list with more is answered
    /// in several replies, in order.
    pub entries_per_reply: usize,
}

impl Default for WriteListLimits {
    /// The UCX engine's: 1 MiB a list, as much as one single write
    /// carries, any entry within that, and [`wire::MAX_LIST_ENTRIES`]
    /// entries a reply.
    fn default() -> Self {
        WriteListLimits {
            max_entry: 1 << 20,
            max_total: 1 << 20,
            entries_per_reply: wire::MAX_LIST_ENTRIES,
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
    /// Entries per reply, from the limits it arrived under.
    entries_per_reply: usize,
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
    /// [`Action::AcknowledgeList`] replies once every accepted entry's
    /// receive ended (module docs). An empty list, or one of more than
    /// [`wire::MAX_LIST_ENTRIES`] entries, is dropped.
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
        if entries.is_empty() || entries.len() > wire::MAX_LIST_ENTRIES {
            tracing::debug!(
                entries = entries.len(),
                "a write list of no entries or too many was dropped"
            );
            self.dropped += 1;
            return;
        }
        let entries_per_reply = limits.entries_per_reply.max(1);
        let declared = entries
            .iter()
            .try_fold(0u64, |sum, write| sum.checked_add(write.length));
        let whole = declared.is_some_and(|sum| sum == payload_length && sum <= limits.max_total);
        let mut entry_replies: Vec<ListEntryReply> = entries
            .iter()
            .map(|write| ListEntryReply {
                request_id: write.request_id,
                outcome: if whole && write.length <= limits.max_entry {
                    self.check_write(write, write.length)
                } else {
                    Err(Refusal::Malformed)
                },
            })
            .collect();
        let accepted = entry_replies
            .iter()
            .filter(|entry| entry.outcome.is_ok())
            .count();
        if accepted > 0 {
            let parts = entries.len().div_ceil(entries_per_reply) as u32;
            if self
                .take_served_places(endpoint, parts, "write list")
                .is_err()
            {
                for entry in &mut entry_replies {
                    if entry.outcome.is_ok() {
                        entry.outcome = Err(Refusal::Busy);
                    }
                }
            }
        }
        let list = self.next_write_list;
        self.next_write_list += 1;
        let mut pending = 0;
        let mut payload_offset = 0u64;
        for (index, (write, entry)) in entries.iter().zip(&entry_replies).enumerate() {
            match entry.outcome {
                Ok(target) => {
                    let slot = ListSlot { list, index };
                    self.start_receive(
                        endpoint,
                        write.request_id,
                        target,
                        payload_offset,
                        Some(slot),
                    );
                    pending += 1;
                }
                Err(refusal) => {
                    tracing::debug!(request = write.request_id, %refusal, "refused a write list entry");
                    self.refused += 1;
                }
            }
            // Only used while `whole`, where the lengths add up without
            // overflow.
            payload_offset = payload_offset.wrapping_add(write.length);
        }
        if pending == 0 {
            return self.answer_refused_list(endpoint, entry_replies, entries_per_reply);
        }
        self.write_lists.insert(
            list,
            WriteList {
                endpoint,
                entry_replies,
                pending,
                entries_per_reply,
            },
        );
    }

    /// Refuses every entry of a write list on `endpoint` for a reason the
    /// driver decided itself (such as a payload the transport did not
    /// hand over the way the list's writer promised), in replies under
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
        if entries.is_empty() || entries.len() > wire::MAX_LIST_ENTRIES {
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
        self.answer_refused_list(endpoint, entry_replies, limits.entries_per_reply.max(1));
    }

    /// Write lists whose reply waits for a receive.
    pub fn write_lists_in_flight(&self) -> usize {
        self.write_lists.len()
    }

    /// The receive of the entry `slot` ended: once it is the list's last,
    /// the list is answered (module docs, points 4 and 5).
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
            for _ in list.entry_replies.chunks(list.entries_per_reply) {
                self.end_served_place(list.endpoint);
            }
            return;
        }
        let parts = list.entry_replies.chunks(list.entries_per_reply);
        #[cfg(test)]
        let parts: Vec<&[ListEntryReply]> = if self.defects.list_replies_out_of_order {
            parts.rev().collect()
        } else {
            parts.collect()
        };
        for part in parts {
            let send = self.start_send_of(list.endpoint, Leases::None, 1);
            self.actions.push_back(Action::AcknowledgeList {
                endpoint: list.endpoint,
                send,
                entry_replies: part.to_vec(),
            });
        }
    }

    /// Answers a list none of whose entries was accepted, in replies of
    /// `entries_per_reply` entries, each under the endpoint's refusal
    /// bound (dropped past it).
    fn answer_refused_list(
        &mut self,
        endpoint: E,
        entry_replies: Vec<ListEntryReply>,
        entries_per_reply: usize,
    ) {
        for part in entry_replies.chunks(entries_per_reply) {
            let entry = self.endpoints.entry(endpoint).or_default();
            if entry.load.refusals >= self.bound {
                tracing::debug!(
                    "an endpoint holds too many refusals; a write list reply was dropped"
                );
                self.dropped += 1;
                continue;
            }
            entry.load.refusals += 1;
            let send = self.start_send(endpoint, Leases::None);
            self.actions.push_back(Action::AcknowledgeList {
                endpoint,
                send,
                entry_replies: part.to_vec(),
            });
        }
    }
}

#[cfg(test)]
mod tests;
