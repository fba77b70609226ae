//! Write lists in the simulator of served writes: a writer posts several
//! writes as one message, the owner judges and receives each entry and
//! answers the list once, in one reply per
//! [`WriteListLimits::entries_per_reply`] entries, and the writer takes
//! each reply ([`Writer::handle_list_reply`]).
//!
//! A list is 1 to 64 of a writer's writes ([`Writer::start`] each), their
//! headers encoded by [`wire::encode_write_list_request`] and their bytes
//! back to back as the payload, sent as one message: one send for them
//! all, which ends once no receive of any entry reads it. Entries are
//! honest and hostile mixed, some over an earlier entry's range; now and
//! then the payload does not add up, or the header does not decode. The
//! network delays, reorders, loses and duplicates the message as any
//! other, and every other hazard of the simulator goes on around it.
//!
//! The model predicts, entry by entry and in order, what the owner must
//! do (as for a single write, within the list's bounds, and busy as a
//! whole when the connection is at its bound), and then the list's one
//! answer: `ceil(n / entries_per_reply)` replies (a quarter of the runs
//! put 1 to 8 entries in one, the others 64, so a list of more comes in
//! parts), each with its part's entries, the parts in entry order. A list
//! with no entry accepted is answered at once, each reply under the
//! refusal bound and the ones past it dropped; else all its replies come
//! together once the last accepted entry's receive ended, with each
//! entry's `Ok`, refusal, or failed receive. An accepted list holds one
//! place per reply under the connection's bound, all from its
//! acceptance, each until its reply's send ended.
//!
//! [`Writer::handle_list_reply`]: crate::served::writer::Writer::handle_list_reply
//! [`WriteListLimits::entries_per_reply`]: crate::served::owner::WriteListLimits::entries_per_reply
//! [`Writer::start`]: crate::served::writer::Writer::start

use std::collections::BTreeSet;
use std::time::Duration;

use super::{
    Checked, FORGER, MAX_LIST_WRITES, OwnerSend, Receiving, Record, ReplyHeader, Request, Sim,
    ToWriter,
};
use crate::served::owner::{Action, ListEntryReply, Payload, ReceiveId, Refusal, Write};
use crate::served::wire;
use crate::served::writer::WriteTarget;
use crate::sim_support::mix;

/// A write list the owner accepted an entry of and has not answered, as
/// the model sees it.
#[derive(Debug)]
pub(super) struct SimList {
    pub(super) conn: u64,
    /// Entries accepted.
    pub(super) accepted: usize,
    /// Places it holds under the endpoint's bound: one per reply it will
    /// send, until that reply's send ended.
    pub(super) places: usize,
    /// Accepted entries whose receive has not ended.
    running: usize,
    /// The reply the model gives each entry so far, in order.
    pub(super) replies: Vec<ListEntryReply>,
}

/// A write list whose last receive ended: the owner's replies to it are
/// due, all of them before it takes any other step.
#[derive(Debug)]
pub(super) struct Due {
    /// The simulation's key of the list.
    key: u64,
    pub(super) list: SimList,
    /// Replies the owner gave so far, the first ones in entry order.
    pub(super) given: usize,
}

/// What the owner must do with a write list that arrived.
#[derive(Debug)]
enum ListExpect {
    /// Nothing: a header that does not decode, a failed connection, a
    /// closed transport, or a reply past the refusal bound.
    Drop,
    /// No entry accepted: these replies (one per part under the refusal
    /// bound), at once, and `dropped` parts past it.
    Refused {
        parts: Vec<Vec<ListEntryReply>>,
        dropped: usize,
    },
    /// Each accepted entry's receive, at this place in the payload; the
    /// replies once they all ended.
    Receive {
        receives: Vec<(Write, u64)>,
        replies: Vec<ListEntryReply>,
    },
}

impl Sim {
    /// A writer posts a write list: mostly a few entries, sometimes up to
    /// 64; in half the lists some entries are hostile, and then now and
    /// then the payload does not add up or the header does not decode.
    pub(super) fn post_list(&mut self) -> Checked {
        let count = match self.rng.below(10) {
            0..=6 => 1 + self.rng.below(4),
            7..=8 => 5 + self.rng.below(12),
            _ => 17 + self.rng.below(48),
        } as usize;
        let Some(at) = self.poster(MAX_LIST_WRITES - count) else {
            return Ok(());
        };
        let hostile = self.rng.chance(50);
        let mut targets: Vec<WriteTarget> = Vec::with_capacity(count);
        for _ in 0..count {
            let target = if !targets.is_empty() && self.rng.chance(15) {
                // Over an earlier entry's range, from its start or later.
                let mut target = targets[self.rng.index(targets.len())];
                let shift = self.rng.below(target.length.max(1));
                target.address = target.address.wrapping_add(shift);
                target.length -= shift.min(target.length);
                target
            } else {
                let hostile = if hostile && self.rng.chance(25) { 6 } else { 0 };
                let Some((target, _, _)) = self.draw_target(hostile) else {
                    return Ok(());
                };
                target
            };
            targets.push(target);
        }
        let deadline = self.now + Duration::from_millis(1 + self.rng.below(40));
        let conn = self.writers[at].conn;
        let batch = self.next_list;
        self.next_list += 1;
        let mut entries = Vec::with_capacity(count);
        let mut members = Vec::with_capacity(count);
        let mut payload = Vec::new();
        for target in targets {
            let posted = self.writers[at].machine.start(conn, target, deadline, ());
            let Some(request) = posted.request else {
                return Err(format!("write {:?} refused before shutdown", posted.id));
            };
            let seed = self.rng.next_u64();
            payload.extend((0..target.length).map(|i| mix(seed ^ i) as u8));
            let origin = (at, posted.id.0);
            self.records.insert(
                origin,
                Record {
                    conn,
                    travelling: true,
                    receiving: 0,
                    stopping: false,
                    send_ended: false,
                    answered: false,
                    received: false,
                    batch: Some(batch),
                },
            );
            members.push(origin);
            entries.push(request);
        }
        let mut header = wire::encode_write_list_request(&entries)
            .ok_or_else(|| format!("a list of {count} writes does not encode"))?;
        if hostile && self.rng.chance(15) {
            if self.rng.chance(50) && !payload.is_empty() {
                let cut = 1 + self.rng.index(payload.len().min(4));
                payload.truncate(payload.len() - cut);
            } else {
                payload.extend(0..1 + self.rng.below(4) as u8);
            }
        } else if hostile && self.rng.chance(10) {
            match self.rng.below(4) {
                0 => header.truncate(self.rng.index(header.len())),
                1 => header[1 + self.rng.index(3)] = 1,
                2 => header[0] = 2,
                _ => header[4] = if self.rng.chance(50) { 0 } else { 65 },
            }
        }
        self.batches.insert(batch, members.clone());
        self.stats.writes += count as u64;
        self.stats.lists += 1;
        self.stats.list_entries += count as u64;
        self.note(|| {
            format!(
                "writer {at} posts a list of {count} on {conn} ({} bytes): {entries:?}",
                payload.len()
            )
        });
        self.to_owner.push(Request {
            conn,
            header,
            payload,
            origin: Some(members[0]),
            of: Some(members[0]),
            list: true,
        });
        Ok(())
    }

    /// The model: what the owner must do with the write list `message`.
    fn expect_list(&self, message: &Request) -> ListExpect {
        let conn = message.conn;
        let entries = match wire::decode_write_list_request(&message.header) {
            Ok(entries) if !self.closed && !self.dropping.contains(&conn) => entries,
            _ => return ListExpect::Drop,
        };
        let limits = self.list_limits;
        let payload_length = message.payload.len() as u64;
        let declared = entries
            .iter()
            .try_fold(0u64, |sum, write| sum.checked_add(write.length));
        let whole = declared.is_some_and(|sum| sum == payload_length && sum <= limits.max_total);
        // A list is busy as a whole: every entry is judged against the
        // places held before it arrived.
        let places = self.places(conn);
        let mut offset = 0u64;
        let mut receives = Vec::new();
        let mut replies = Vec::with_capacity(entries.len());
        for write in entries {
            let verdict = if whole && write.length <= limits.max_entry {
                self.verdict(&write, write.length, places)
            } else {
                Err(Refusal::Malformed)
            };
            let outcome = verdict.map(|()| Payload {
                region: write.region,
                address: write.address,
                length: write.length,
            });
            if outcome.is_ok() {
                receives.push((write, offset));
            }
            replies.push(ListEntryReply {
                request_id: write.request_id,
                outcome,
            });
            offset = offset.wrapping_add(write.length);
        }
        if !receives.is_empty() {
            return ListExpect::Receive { receives, replies };
        }
        // Each reply under the refusal bound, the ones past it dropped.
        let room = (self.bound as usize).saturating_sub(self.refusals(conn));
        let mut parts: Vec<Vec<ListEntryReply>> = replies
            .chunks(self.entries_per_reply())
            .map(<[_]>::to_vec)
            .collect();
        let dropped = parts.len().saturating_sub(room);
        parts.truncate(room);
        if parts.is_empty() {
            ListExpect::Drop
        } else {
            ListExpect::Refused { parts, dropped }
        }
    }

    /// Entries the owner puts in one reply to a write list.
    fn entries_per_reply(&self) -> usize {
        self.list_limits.entries_per_reply.max(1)
    }

    /// Queues the owner's answer to a write list, which must encode.
    fn reply_list(&mut self, conn: u64, kind: OwnerSend, action: &Action<u64>) -> Checked {
        let Action::AcknowledgeList { send, .. } = action else {
            return Err(format!("{action:?} is no write list's answer"));
        };
        if action.list_reply_header().is_none() {
            return Err(format!("a write list's answer does not encode: {action:?}"));
        }
        self.reply(conn, *send, kind, action);
        Ok(())
    }

    /// The owner takes the write list `message`: what it does is checked
    /// against the model, and each receive it asks for starts.
    pub(super) fn deliver_list(&mut self, message: Request) -> Checked {
        let conn = message.conn;
        let expect = self.expect_list(&message);
        self.owner.handle_write_list_request(
            conn,
            &message.header,
            message.payload.len() as u64,
            self.list_limits,
        );
        let mut receives = Vec::new();
        let mut answers = Vec::new();
        while let Some(action) = self.owner.poll_action() {
            match action {
                Action::Receive {
                    endpoint,
                    receive,
                    request_id,
                    region,
                    address,
                    length,
                    payload_offset,
                } if endpoint == conn && answers.is_empty() => {
                    let write = Write {
                        request_id,
                        region,
                        capability: [0; 16],
                        address,
                        length,
                    };
                    receives.push((receive, write, payload_offset));
                }
                Action::AcknowledgeList {
                    endpoint,
                    ref entry_replies,
                    ..
                } if endpoint == conn && receives.is_empty() => {
                    answers.push((entry_replies.clone(), action));
                }
                other => return Err(format!("{other:?} in answer to a write list on {conn}")),
            }
        }
        let got: Vec<(u64, u64, u64, u64, u64)> = receives
            .iter()
            .map(|(_, w, offset)| (w.request_id, w.region, w.address, w.length, *offset))
            .collect();
        let given: Vec<&Vec<ListEntryReply>> = answers.iter().map(|(part, _)| part).collect();
        self.note(|| format!("write list on {conn}: expected {expect:?}, got {got:?} {given:?}"));
        let mismatch = |what: &str| {
            format!("write list on {conn}: expected {expect:?}, the owner chose {what}")
        };
        match &expect {
            ListExpect::Drop if receives.is_empty() && answers.is_empty() => {
                self.stats.lists_dropped += 1;
            }
            ListExpect::Refused { parts, dropped } if receives.is_empty() => {
                // Every reply under the bound, in entry order, at once.
                if !parts.iter().eq(given.iter().copied()) {
                    return Err(mismatch(&format!("the replies {given:?}")));
                }
                let entries = parts.iter().map(Vec::len).sum::<usize>() as u64;
                self.stats.lists_refused += 1;
                self.stats.lists_refused_in_parts += u64::from(parts.len() + dropped >= 2);
                self.stats.list_parts_dropped += *dropped as u64;
                self.stats.refused += entries;
                self.stats.list_entries_refused += entries;
                for (_, action) in &answers {
                    self.reply_list(conn, OwnerSend::Refusal, action)?;
                }
            }
            ListExpect::Receive { receives: want, .. } if answers.is_empty() => {
                let want: Vec<(u64, u64, u64, u64, u64)> = want
                    .iter()
                    .map(|(w, offset)| (w.request_id, w.region, w.address, w.length, *offset))
                    .collect();
                if want != got {
                    return Err(mismatch(&format!("receives {got:?}")));
                }
            }
            _ => return Err(mismatch(&format!("receives {got:?}, replies {given:?}"))),
        }
        if let ListExpect::Receive { replies, .. } = expect {
            self.start_list_receives(&message, receives, replies)?;
        }
        self.remember(message);
        Ok(())
    }

    /// The receives of a write list's accepted entries start, each with its
    /// bytes from the payload at the place the owner named.
    fn start_list_receives(
        &mut self,
        message: &Request,
        receives: Vec<(ReceiveId, Write, u64)>,
        replies: Vec<ListEntryReply>,
    ) -> Checked {
        let key = self.next_list;
        self.next_list += 1;
        let at = message.of.map(|(at, _)| at);
        let accepted = receives.len();
        // One per reply it will send (as many as the model's parts).
        let places = replies.len().div_ceil(self.entries_per_reply());
        if self.places(message.conn) + places > self.bound as usize {
            self.stats.lists_past_bound += 1;
        }
        // In order, one for each accepted entry (checked against the model).
        let indices = replies
            .iter()
            .enumerate()
            .filter(|(_, r)| r.outcome.is_ok())
            .map(|(index, _)| index);
        for ((receive, write, offset), index) in receives.into_iter().zip(indices) {
            let start = offset as usize;
            let bytes = message
                .payload
                .get(start..start + write.length as usize)
                .ok_or("a receive past the payload")?
                .to_vec();
            let entry = at.map(|at| (at, write.request_id));
            let origin = message.origin.and(entry);
            if let Some(record) = origin.and_then(|o| self.records.get_mut(&o)) {
                record.receiving += 1;
            }
            self.receiving.insert(
                receive,
                Receiving {
                    conn: message.conn,
                    address: write.address,
                    bytes,
                    written: 0,
                    origin,
                    of: entry,
                    doomed: false,
                    spoiled: BTreeSet::new(),
                    list: Some((key, index)),
                },
            );
            self.stats.received += 1;
        }
        self.admitted.insert(message.conn, Some(key));
        self.lists.insert(
            key,
            SimList {
                conn: message.conn,
                accepted,
                places,
                running: accepted,
                replies,
            },
        );
        Ok(())
    }

    /// The receive of entry `index` of list `key` ended: once it was the
    /// list's last, the list's answer is due (unless its connection failed
    /// or the transport closed: then it never comes).
    pub(super) fn end_list_entry(&mut self, (key, index): (u64, usize), completed: bool) {
        let Some(list) = self.lists.get_mut(&key) else {
            return;
        };
        if !completed {
            if let Some(reply) = list.replies.get_mut(index) {
                reply.outcome = Err(Refusal::ReceiveFailed);
            }
        }
        list.running -= 1;
        if list.running > 0 {
            return;
        }
        let Some(list) = self.lists.remove(&key) else {
            return;
        };
        if self.closed || self.dropping.contains(&list.conn) {
            self.stats.lists_unanswered += 1;
        } else {
            self.list_due = Some(Due {
                key,
                list,
                given: 0,
            });
        }
    }

    /// The owner answers a write list after a receive ended: only the list
    /// whose last receive that was, with the model's replies, the next of
    /// its parts in entry order, each once.
    pub(super) fn list_answered(&mut self, action: &Action<u64>) -> Checked {
        let Action::AcknowledgeList {
            endpoint,
            entry_replies,
            ..
        } = action
        else {
            return Ok(());
        };
        let per_reply = self.entries_per_reply();
        let Some(due) = self.list_due.as_mut() else {
            let ids: Vec<u64> = entry_replies.iter().map(|r| r.request_id).collect();
            let running = self.lists.values().any(|l| {
                l.conn == *endpoint
                    && l.replies
                        .chunks(per_reply)
                        .any(|part| part.iter().map(|r| r.request_id).eq(ids.iter().copied()))
            });
            return Err(if running {
                format!(
                    "a write list on {endpoint} was answered before its last receive ended: \
                     {entry_replies:?}"
                )
            } else {
                format!("a write list on {endpoint} was answered with none due: {entry_replies:?}")
            });
        };
        let want = due.list.replies.chunks(per_reply).nth(due.given);
        if *endpoint != due.list.conn || want != Some(&entry_replies[..]) {
            return Err(format!(
                "a write list on {} got reply {} of {} on {endpoint} with {entry_replies:?}; \
                 the model says {want:?}",
                due.list.conn,
                due.given + 1,
                due.list.places,
            ));
        }
        due.given += 1;
        let key = due.key;
        if due.given == due.list.places {
            let list = self.list_due.take().map(|due| due.list);
            let list = list.as_ref().ok_or("no list due")?;
            self.stats.lists_answered += 1;
            self.stats.wide_lists += u64::from(list.accepted >= 2);
            self.stats.lists_in_parts += u64::from(list.places >= 2);
        }
        for reply in entry_replies {
            match reply.outcome {
                Ok(_) => self.stats.list_entries_ok += 1,
                Err(Refusal::ReceiveFailed) => self.stats.list_entries_failed += 1,
                Err(_) => {
                    self.stats.list_entries_refused += 1;
                    self.stats.refused += 1;
                }
            }
        }
        self.reply_list(*endpoint, OwnerSend::ListReply(key), action)
    }

    /// Writer `at` takes a list reply: a forged one is never taken, the
    /// owner's always decodes.
    pub(super) fn deliver_list_reply(
        &mut self,
        at: usize,
        message: &ToWriter,
        header: &[u8],
    ) -> Checked {
        let verdicts = self.writers[at].machine.handle_list_reply(
            message.conn,
            header,
            message.payload_length,
        );
        self.note(|| {
            format!(
                "list reply on {} to writer {at}: {verdicts:?}",
                message.conn
            )
        });
        match verdicts {
            Ok(verdicts) if message.conn == FORGER && verdicts.iter().any(Result::is_ok) => Err(
                format!("a forged list reply was taken: {verdicts:?} of {header:?}"),
            ),
            Err(error) if message.conn != FORGER => {
                Err(format!("the owner's list reply does not decode: {error}"))
            }
            _ => Ok(()),
        }
    }

    /// A third peer sends a list reply with guessed write ids of one
    /// writer, served or refused, with or without a payload.
    pub(super) fn forge_list_reply(&mut self) -> Checked {
        let Some(&(at, _)) = self
            .records
            .keys()
            .nth(self.rng.index(self.records.len().max(1)))
        else {
            return Ok(());
        };
        let ids: Vec<u64> = self
            .records
            .keys()
            .filter(|o| o.0 == at)
            .map(|o| o.1)
            .collect();
        let count = 1 + self.rng.index(ids.len().min(8));
        let mut fields = Vec::with_capacity(count);
        for _ in 0..count {
            let id = ids[self.rng.index(ids.len())];
            fields.push(if self.rng.chance(80) {
                (id, 0, self.rng.below(64))
            } else {
                (id, wire::refusal_code(Refusal::ReceiveFailed), 0)
            });
        }
        let header = wire::encode_list_reply_fields(fields.into_iter())
            .ok_or("a forged list of 1 to 8 entries does not encode")?;
        let payload_length = if self.rng.chance(30) {
            self.rng.below(64)
        } else {
            0
        };
        self.to_writers.push(ToWriter {
            conn: FORGER,
            to: Some(at),
            header: ReplyHeader::List(header),
            payload_length,
            send: None,
        });
        Ok(())
    }
}
