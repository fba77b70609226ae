//! The writers of the simulator of served writes: posting single writes,
//! their sends' ends and deadlines, the replies they take (forged ones
//! too), and the checks on every answer (invariants 5 and 10).

use std::time::Duration;

use rdmareg_core::RdmaError;

use super::{
    Checked, FORGER, MAX_WRITES, Origin, Record, ReplyHeader, Request, Sim, SimWriter, State,
    ToWriter,
};
use crate::served::consumer::{Reply, ReplyOutcome};
use crate::served::refusal::Operation;
use crate::served::wire;
use crate::served::writer::{WriteId, WriteTarget, WriteTimeout, Writer};
use crate::sim_support::mix;

impl Sim {
    /// A writer posts a write: honest (a random range of a descriptor it
    /// was given) or hostile.
    pub(super) fn post(&mut self, hostile: bool) -> Checked {
        let Some(at) = self.poster(MAX_WRITES - 1) else {
            return Ok(());
        };
        let Some((target, payload_length, corrupt)) = self.draw_target(if hostile { 8 } else { 0 })
        else {
            return Ok(());
        };
        let deadline = self.now + Duration::from_millis(1 + self.rng.below(40));
        let writer = &mut self.writers[at];
        let conn = writer.conn;
        let posted = writer.machine.start(conn, target, deadline, ());
        let Some(request) = posted.request else {
            return Err(format!("write {:?} refused before shutdown", posted.id));
        };
        let mut header = wire::encode_write_request(&request).to_vec();
        if corrupt {
            match self.rng.below(3) {
                0 => header.truncate(self.rng.index(header.len())),
                1 => header[1 + self.rng.index(3)] = 1,
                _ => header[0] = 2,
            }
        }
        let seed = self.rng.next_u64();
        let payload: Vec<u8> = (0..payload_length.min(256))
            .map(|i| mix(seed ^ i) as u8)
            .collect();
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
                batch: None,
            },
        );
        self.stats.writes += 1;
        self.note(|| format!("writer {at} posts {request:?} ({payload_length} bytes) on {conn}"));
        self.to_owner.push(Request {
            conn,
            header,
            payload,
            origin: Some(origin),
            of: Some(origin),
            list: false,
        });
        Ok(())
    }

    /// The writer that posts next (a new one comes in a killed one's
    /// stead), if it has at most `room` writes unanswered and there is a
    /// descriptor to write to.
    pub(super) fn poster(&mut self, room: usize) -> Option<usize> {
        let mut at = self.rng.index(self.writers.len());
        if !self.writers[at].alive {
            let mut machine = Writer::new();
            machine.defects = self.writers[at].machine.defects;
            let conn = self.fresh_conn();
            self.writers.push(SimWriter {
                conn,
                machine,
                alive: true,
            });
            at = self.writers.len() - 1;
        }
        if self.writers[at].machine.in_flight() > room || self.regions.is_empty() {
            return None;
        }
        Some(at)
    }

    /// A write's target: a random range of a descriptor a writer was
    /// given (of a live registration mostly, else of any, stale ones
    /// included), made hostile by one of the first `hostile` ways (none
    /// for 0): forged capability, unknown region, past the end, before the
    /// start, empty, wrapping; a payload of another length; a header that
    /// will not decode. Returns it with its payload's length and whether
    /// to corrupt its header.
    pub(super) fn draw_target(&mut self, hostile: u64) -> Option<(WriteTarget, u64, bool)> {
        let ids: Vec<u64> = self.regions.keys().copied().collect();
        let live: Vec<u64> = self
            .regions
            .iter()
            .filter(|(_, r)| r.state == State::Live)
            .map(|(&id, _)| id)
            .collect();
        let id = if !live.is_empty() && self.rng.chance(85) {
            live[self.rng.index(live.len())]
        } else {
            *ids.get(self.rng.index(ids.len()))?
        };
        let region = &self.regions[&id];
        let (base, len, cap) = (region.base, region.len, region.capability);
        let offset = self.rng.below(len);
        let mut target = WriteTarget {
            region: id,
            capability: cap,
            address: base + offset,
            length: 1 + self.rng.below(len - offset),
        };
        let mut payload_length = target.length;
        let mut corrupt = false;
        if hostile > 0 {
            match self.rng.below(hostile) {
                0 => target.capability[self.rng.index(16)] ^= 1 << self.rng.below(8),
                1 => target.region = self.next_region + self.rng.below(3),
                2 => target.length = len - offset + 1 + self.rng.below(8),
                3 => target.address = base.wrapping_sub(1 + self.rng.below(8)),
                4 => target.length = 0,
                5 => {
                    target.address = u64::MAX - self.rng.below(4);
                    target.length = 2 + self.rng.below(8);
                }
                6 => {
                    payload_length = if self.rng.chance(50) {
                        target.length - 1
                    } else {
                        target.length + 1 + self.rng.below(4)
                    }
                }
                _ => corrupt = true,
            }
        }
        Some((target, payload_length, corrupt))
    }

    pub(super) fn fresh_conn(&mut self) -> u64 {
        self.next_conn += 1;
        self.next_conn
    }

    /// The transport reports a write's send ended, once nothing of it
    /// travels or is received any more (or it was stopped).
    pub(super) fn end_writer_send(&mut self) -> Checked {
        let ready = self.ready_sends();
        if ready.is_empty() {
            return Ok(());
        }
        let origin = ready[self.rng.index(ready.len())];
        self.end_send_of(origin)
    }

    /// The sends the transport may report ended, each named by a write it
    /// carries: nothing of it travels or is received any more.
    pub(super) fn ready_sends(&self) -> Vec<Origin> {
        let idle = |r: &Record| !r.send_ended && !r.travelling && r.receiving == 0;
        let mut ready: Vec<Origin> = self
            .records
            .iter()
            .filter(|(_, r)| r.batch.is_none() && idle(r))
            .map(|(&o, _)| o)
            .collect();
        for members in self.batches.values() {
            let mut present = members.iter().filter_map(|o| self.records.get(o));
            if present.all(idle) && self.records.contains_key(&members[0]) {
                ready.push(members[0]);
            }
        }
        ready
    }

    /// The writes one send carries with `origin`: its write list's, the
    /// first of them first, or itself alone.
    pub(super) fn send_members(&self, origin: Origin) -> Vec<Origin> {
        self.records
            .get(&origin)
            .and_then(|r| r.batch)
            .and_then(|batch| self.batches.get(&batch))
            .cloned()
            .unwrap_or_else(|| vec![origin])
    }

    /// The message of `origin`'s send left the network (delivered, lost,
    /// withdrawn).
    pub(super) fn arrived(&mut self, origin: Origin) {
        for member in self.send_members(origin) {
            if let Some(record) = self.records.get_mut(&member) {
                record.travelling = false;
            }
        }
    }

    /// The transport reports the send carrying `origin` ended, for every
    /// write it carries.
    pub(super) fn end_send_of(&mut self, origin: Origin) -> Checked {
        let ok = self.rng.chance(85);
        let members = self.send_members(origin);
        let record = self.records.get(&origin).ok_or("no record")?;
        if record.send_ended {
            return Ok(());
        }
        let result = if ok && !record.stopping && !self.failed.contains(&record.conn) {
            Ok(())
        } else {
            Err(RdmaError::backend("send ended in error"))
        };
        if let Some(batch) = record.batch {
            self.batches.remove(&batch);
        }
        self.note(|| format!("send of {members:?} ended: {result:?}"));
        for member in members {
            let Some(record) = self.records.get_mut(&member) else {
                continue;
            };
            record.send_ended = true;
            let writer = &mut self.writers[member.0];
            if writer.alive {
                writer.machine.send_ended(WriteId(member.1), result.clone());
            }
        }
        Ok(())
    }

    /// A writer's deadlines pass.
    pub(super) fn advance_clock(&mut self) -> Checked {
        self.now += Duration::from_millis(1 + self.rng.below(20));
        self.expire()
    }

    pub(super) fn expire(&mut self) -> Checked {
        for at in 0..self.writers.len() {
            if !self.writers[at].alive {
                continue;
            }
            let actions = self.writers[at].machine.handle_timeout(self.now);
            for WriteTimeout::StopSend { write, .. } in actions {
                self.stop_send((at, write.0))?;
            }
        }
        Ok(())
    }

    /// The driver stops a write's send (a write list's, for all its
    /// writes): a message not yet out is withdrawn, a receive reading it
    /// fails.
    pub(super) fn stop_send(&mut self, origin: Origin) -> Checked {
        if !self.records.contains_key(&origin) {
            return Err("stop of no record".into());
        }
        let members = self.send_members(origin);
        let mut travelling = false;
        for member in &members {
            if let Some(record) = self.records.get_mut(member) {
                record.stopping = true;
                travelling |= record.travelling;
                record.travelling = false;
            }
        }
        if travelling {
            self.to_owner.retain(|m| m.origin != Some(members[0]));
        }
        for receive in self.receiving.values_mut() {
            if receive.origin.is_some_and(|o| members.contains(&o)) {
                receive.doomed = true;
            }
        }
        Ok(())
    }

    /// Delivers a reply to the writer on its connection.
    pub(super) fn deliver_reply(&mut self) -> Checked {
        if self.to_writers.is_empty() {
            return Ok(());
        }
        let message = self
            .to_writers
            .swap_remove(self.rng.index(self.to_writers.len()));
        let Some(at) = message.to.or_else(|| {
            self.writers
                .iter()
                .position(|w| w.alive && w.conn == message.conn)
        }) else {
            return Ok(());
        };
        if !self.writers[at].alive {
            return Ok(());
        }
        let header = match &message.header {
            ReplyHeader::Single(header) => header,
            ReplyHeader::List(header) => return self.deliver_list_reply(at, &message, header),
        };
        let Ok(decoded) = wire::Reply::decode(header) else {
            return Ok(());
        };
        let reply = Reply {
            request_id: decoded.request_id,
            outcome: match decoded.outcome {
                Ok(length) => ReplyOutcome::Served { length },
                Err(refusal) => ReplyOutcome::Refused(refusal.error_for(Operation::Write)),
            },
        };
        let verdict =
            self.writers[at]
                .machine
                .handle_reply(message.conn, &reply, message.payload_length);
        self.note(|| {
            format!(
                "reply {reply:?} on {} to writer {at}: {verdict:?}",
                message.conn
            )
        });
        if message.conn == FORGER && verdict.is_ok() {
            return Err(format!("a forged reply was taken: {reply:?}"));
        }
        Ok(())
    }

    /// A third peer replies with guessed write ids, in a single reply or,
    /// now and then, a list reply.
    pub(super) fn forge_reply(&mut self) -> Checked {
        if self.rng.chance(30) {
            return self.forge_list_reply();
        }
        let Some(&(at, id)) = self
            .records
            .keys()
            .nth(self.rng.index(self.records.len().max(1)))
        else {
            return Ok(());
        };
        let length = self.rng.below(64);
        self.to_writers.push(ToWriter {
            conn: FORGER,
            to: Some(at),
            header: ReplyHeader::Single(wire::encode_reply_fields(id, 0, length)),
            payload_length: if self.rng.chance(50) { length } else { 0 },
            send: None,
        });
        Ok(())
    }

    /// Answers taken out of every live writer, checked.
    pub(super) fn take_completions(&mut self) -> Checked {
        for at in 0..self.writers.len() {
            if !self.writers[at].alive {
                continue;
            }
            while let Some(done) = self.writers[at].machine.poll_completion() {
                let origin = (at, done.write.0);
                let record = self
                    .records
                    .get_mut(&origin)
                    .ok_or_else(|| format!("an answer to a write never posted: {origin:?}"))?;
                if record.answered {
                    return Err(format!("write {origin:?} answered twice"));
                }
                if !record.send_ended {
                    return Err(format!(
                        "write {origin:?} answered {:?} before its send ended",
                        done.outcome
                    ));
                }
                if done.outcome.is_ok() && !record.received {
                    return Err(format!(
                        "write {origin:?} answered Ok but its bytes were never received whole"
                    ));
                }
                record.answered = true;
                if done.outcome.is_ok() && record.batch.is_some() {
                    self.stats.list_writes_ok += 1;
                }
                if done.outcome.is_ok() {
                    self.stats.answered_ok += 1;
                } else {
                    self.stats.answered_err += 1;
                }
            }
        }
        // Records of answered writes whose source nothing holds go.
        self.records
            .retain(|_, r| !(r.answered && r.send_ended && !r.travelling && r.receiving == 0));
        Ok(())
    }
}
