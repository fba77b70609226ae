//! The consumer side of a served write, as a state machine with no I/O and
//! no clock of its own.
//!
//! A driver starts a write ([`Writer::start`]), sends the request header
//! it gets with the bytes to write as payload, and feeds back what
//! happens: the end of that send ([`Writer::send_ended`]), the owner's
//! reply ([`Writer::handle_reply`]), a failed endpoint, the clock
//! ([`Writer::handle_timeout`]), shutdown. Completions come out of
//! [`Writer::poll_completion`], each write's exactly once.
//!
//! # Rules, and why
//!
//! 1. **A write completes only once its send ended.** Until the transport
//!    reports the send of the request and its payload ended, it may still
//!    read the caller's source (a rendezvous reads it while the owner
//!    receives), so no answer — `Ok`, an owner's refusal, `Timeout`,
//!    `ShuttingDown`, a failed endpoint — is handed out earlier.
//! 2. **`Ok` needs the owner's word.** A write completes `Ok` only on a
//!    reply from the endpoint its request went out on, with its id,
//!    saying exactly the write's length was written, and carrying no
//!    payload. A reply from elsewhere, or for a write no longer waiting,
//!    is dropped; the first reply taken is the owner's answer, and a
//!    reply that claims payload bytes or another length is taken as a
//!    failure of the write (the owner is not following the protocol).
//! 3. **An ended send with no reply is not `Ok`.** Past the deadline, on
//!    a failed endpoint or at shutdown, a write whose send ended
//!    completes with that error at once; one whose send has not ended is
//!    answered when it does ([`WriteTimeout::StopSend`] asks the driver to
//!    end it), with the owner's reply if it came meanwhile.
//!
//! Write ids have [`wire::WRITE_REQUEST_ID_BIT`] set, so replies to reads
//! and writes sharing a handler are told apart by their id.

use std::collections::VecDeque;
use std::fmt::Debug;
use std::hash::Hash;
use std::time::Instant;

use rdmareg_core::RdmaError;
use rustc_hash::FxHashMap as HashMap;

use super::consumer::{DropReason, Reply, ReplyOutcome};
use super::owner::Write;
use super::refusal::Operation;
use super::wire;
use crate::deadlines::DeadlineQueue;

/// One write of this writer; its value is the request id on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WriteId(pub u64);

/// Where a write goes: from the owner's descriptor and the caller's range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteTarget {
    /// The registration's id.
    pub region: u64,
    /// The registration's capability.
    pub capability: [u8; 16],
    /// First byte to write, as an address in the owner's process.
    pub address: u64,
    /// How many bytes the payload has.
    pub length: u64,
}

/// A started write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PostedWrite {
    /// The write.
    pub id: WriteId,
    /// The request header to send, with the bytes to write as payload
    /// ([`wire::encode_write_request`] in the UCX format); `None` when the
    /// write already completed (shutdown began) and nothing is sent.
    pub request: Option<Write>,
}

/// What a deadline asks of the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteTimeout<E> {
    /// The send of `write` on `endpoint` has not ended: stop it (cancel
    /// the send, close the endpoint). The write completes with `Timeout`
    /// when the transport reports the end ([`Writer::send_ended`]), or
    /// with the owner's reply if that came first.
    StopSend {
        /// The write past its deadline.
        write: WriteId,
        /// Where its send goes.
        endpoint: E,
    },
}

/// A write's result, with the driver's value it was started with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteCompletion<T> {
    /// The write.
    pub write: WriteId,
    /// What the driver passed when it started the write.
    pub value: T,
    /// `Ok`: the bytes are in the owner's registration.
    pub outcome: Result<(), RdmaError>,
}

/// Test-only switches that bring back defects, so the simulator can show
/// it finds them.
#[cfg(test)]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Defects {
    /// Complete a write as soon as the owner's reply arrived, whether or
    /// not its send ended.
    pub(crate) answer_before_send_ended: bool,
}

#[derive(Debug)]
struct Entry<E, T> {
    endpoint: E,
    length: u64,
    value: T,
    /// The send's end, once reported: its own result.
    send: Option<Result<(), RdmaError>>,
    /// The owner's answer, once taken.
    reply: Option<Result<(), RdmaError>>,
    /// Why the write ends without a reply, once its send ended.
    abandoned: Option<RdmaError>,
}

/// The consumer side of served writes; see the module docs.
#[derive(Debug)]
pub struct Writer<E, T = ()> {
    writes: HashMap<u64, Entry<E, T>>,
    deadlines: DeadlineQueue,
    next: u64,
    completions: VecDeque<WriteCompletion<T>>,
    closing: bool,
    #[cfg(test)]
    pub(crate) defects: Defects,
}

impl<E, T> Default for Writer<E, T> {
    fn default() -> Self {
        Writer {
            writes: HashMap::default(),
            deadlines: DeadlineQueue::default(),
            next: 1,
            completions: VecDeque::new(),
            closing: false,
            #[cfg(test)]
            defects: Defects::default(),
        }
    }
}

impl<E: Copy + Eq + Hash + Debug, T> Writer<E, T> {
    /// A writer with no writes.
    pub fn new() -> Writer<E, T> {
        Writer::default()
    }

    /// Starts a write of `target` to the owner at `endpoint`, due by
    /// `deadline`. After shutdown began it completes with
    /// [`RdmaError::ShuttingDown`] at once and the driver sends nothing.
    pub fn start(
        &mut self,
        endpoint: E,
        target: WriteTarget,
        deadline: Instant,
        value: T,
    ) -> PostedWrite {
        let id = WriteId(wire::WRITE_REQUEST_ID_BIT | self.next);
        self.next = (self.next + 1) & !wire::WRITE_REQUEST_ID_BIT;
        if self.closing {
            self.completions.push_back(WriteCompletion {
                write: id,
                value,
                outcome: Err(RdmaError::ShuttingDown),
            });
            return PostedWrite { id, request: None };
        }
        self.writes.insert(
            id.0,
            Entry {
                endpoint,
                length: target.length,
                value,
                send: None,
                reply: None,
                abandoned: None,
            },
        );
        self.deadlines.push((deadline, 0, id.0));
        PostedWrite {
            id,
            request: Some(Write {
                request_id: id.0,
                region: target.region,
                capability: target.capability,
                address: target.address,
                length: target.length,
            }),
        }
    }

    /// The driver's value of a write not completed yet.
    pub fn value(&self, write: WriteId) -> Option<&T> {
        self.writes.get(&write.0).map(|entry| &entry.value)
    }

    /// The transport ended the send of `write`'s request and payload and
    /// no longer reads the source: `result` is what it reported. Without
    /// the owner's reply yet, a failed send completes the write with its
    /// error; a send that ended well waits for the reply.
    pub fn send_ended(&mut self, write: WriteId, result: Result<(), RdmaError>) {
        let Some(entry) = self.writes.get_mut(&write.0) else {
            return;
        };
        if entry.send.is_some() {
            return;
        }
        if entry.reply.is_none() && entry.abandoned.is_none() {
            if let Err(error) = &result {
                entry.abandoned = Some(if self.closing {
                    RdmaError::ShuttingDown
                } else {
                    error.clone()
                });
            }
        }
        entry.send = Some(result);
        self.complete_if_ready(write);
    }

    /// A reply arrived on `endpoint`, with `payload_length` bytes of
    /// payload (which the driver discards whatever the verdict: nothing
    /// of a write reply is written anywhere). `Ok` names the write it was
    /// taken for.
    ///
    /// # Errors
    /// Why it was dropped.
    pub fn handle_reply(
        &mut self,
        endpoint: E,
        reply: &Reply,
        payload_length: u64,
    ) -> Result<WriteId, DropReason> {
        let id = WriteId(reply.request_id);
        let Some(entry) = self.writes.get_mut(&reply.request_id) else {
            return Err(DropReason::NotAwaited);
        };
        if entry.reply.is_some() || entry.abandoned.is_some() {
            return Err(DropReason::NotAwaited);
        }
        if entry.endpoint != endpoint {
            return Err(DropReason::WrongEndpoint);
        }
        let answer = match &reply.outcome {
            ReplyOutcome::Refused(error) => Err(error.clone()),
            ReplyOutcome::Served { length } if *length == entry.length && payload_length == 0 => {
                Ok(())
            }
            ReplyOutcome::Served { length } => Err(RdmaError::backend(format!(
                "the owner acknowledged {length} bytes with a {payload_length}-byte payload for a {}-byte write; the write's outcome is unknown",
                entry.length
            ))),
        };
        entry.reply = Some(answer);
        self.complete_if_ready(id);
        Ok(id)
    }

    /// A write list's reply arrived on `endpoint` as the UCX engine encodes
    /// it ([`wire::decode_list_reply`]), with `payload_length` bytes of
    /// payload (a write list's reply has none): each entry is taken as
    /// [`Writer::handle_reply`] takes a single reply, the payload judged
    /// against every served entry. Returns each entry's verdict, in order.
    ///
    /// # Errors
    /// A header that does not decode: nothing in it is taken.
    pub fn handle_list_reply(
        &mut self,
        endpoint: E,
        header: &[u8],
        payload_length: u64,
    ) -> Result<Vec<Result<WriteId, DropReason>>, wire::ProtocolError> {
        let entries = wire::decode_list_reply(header)?;
        Ok(entries
            .into_iter()
            .map(|entry| {
                let reply = Reply {
                    request_id: entry.request_id,
                    outcome: match entry.outcome {
                        Ok(length) => ReplyOutcome::Served { length },
                        Err(refusal) => ReplyOutcome::Refused(refusal.error_for(Operation::Write)),
                    },
                };
                self.handle_reply(endpoint, &reply, payload_length)
            })
            .collect())
    }

    /// The endpoint to an owner failed. Writes on it waiting for their
    /// reply complete with `error` once their send ended (at once if it
    /// did); those whose send has not ended are returned, so the driver
    /// makes sure it ends.
    pub fn endpoint_failed(&mut self, endpoint: E, error: RdmaError) -> Vec<WriteId> {
        let mut ids: Vec<u64> = self
            .writes
            .iter()
            .filter(|(_, entry)| entry.endpoint == endpoint)
            .map(|(&id, _)| id)
            .collect();
        ids.sort_unstable();
        let mut held = Vec::new();
        for id in ids {
            let Some(entry) = self.writes.get_mut(&id) else {
                continue;
            };
            if entry.reply.is_none() && entry.abandoned.is_none() {
                entry.abandoned = Some(error.clone());
            }
            if entry.send.is_none() {
                held.push(WriteId(id));
            }
            self.complete_if_ready(WriteId(id));
        }
        held
    }

    /// Expires writes whose deadline is not after `now`: one waiting for
    /// its reply with its send ended completes with `Timeout`; one whose
    /// send has not ended yields a [`WriteTimeout::StopSend`].
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<WriteTimeout<E>> {
        let mut actions = Vec::new();
        while let Some((deadline, _, id)) = self.deadlines.peek() {
            let live = self.writes.contains_key(&id);
            if live && deadline > now {
                break;
            }
            self.deadlines.pop();
            let Some(entry) = self.writes.get_mut(&id) else {
                continue;
            };
            if entry.reply.is_none() && entry.abandoned.is_none() {
                entry.abandoned = Some(RdmaError::Timeout);
            }
            if entry.send.is_none() {
                actions.push(WriteTimeout::StopSend {
                    write: WriteId(id),
                    endpoint: entry.endpoint,
                });
            }
            self.complete_if_ready(WriteId(id));
        }
        actions
    }

    /// The earliest deadline of a write not completed yet, for the
    /// driver's sleep.
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        while let Some((deadline, _, id)) = self.deadlines.peek() {
            if self.writes.contains_key(&id) {
                return Some(deadline);
            }
            self.deadlines.pop();
        }
        None
    }

    /// Teardown begins: writes without the owner's reply complete with
    /// [`RdmaError::ShuttingDown`] once their send ended, and new writes
    /// are refused.
    pub fn shutdown(&mut self) {
        self.closing = true;
        let mut ids: Vec<u64> = self.writes.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            if let Some(entry) = self.writes.get_mut(&id) {
                if entry.reply.is_none() && entry.abandoned.is_none() {
                    entry.abandoned = Some(RdmaError::ShuttingDown);
                }
            }
            self.complete_if_ready(WriteId(id));
        }
    }

    /// The next completion to hand out: each write's exactly once.
    pub fn poll_completion(&mut self) -> Option<WriteCompletion<T>> {
        self.completions.pop_front()
    }

    /// Writes not completed yet.
    pub fn in_flight(&self) -> usize {
        self.writes.len()
    }

    /// Writes on `endpoint` whose send has not ended: the driver keeps the
    /// endpoint until they end.
    pub fn sending_on(&self, endpoint: E) -> usize {
        self.writes
            .values()
            .filter(|entry| entry.endpoint == endpoint && entry.send.is_none())
            .count()
    }

    /// Completes `write` if its send ended and it has an answer.
    fn complete_if_ready(&mut self, write: WriteId) {
        let Some(entry) = self.writes.get(&write.0) else {
            return;
        };
        let send_ended = entry.send.is_some() || self.answers_before_send_ended();
        if !send_ended {
            return;
        }
        let outcome = match (&entry.reply, &entry.abandoned) {
            (Some(answer), _) => answer.clone(),
            (None, Some(error)) => Err(error.clone()),
            (None, None) => return,
        };
        if let Some(entry) = self.writes.remove(&write.0) {
            self.completions.push_back(WriteCompletion {
                write,
                value: entry.value,
                outcome,
            });
        }
    }

    #[cfg(test)]
    fn answers_before_send_ended(&self) -> bool {
        self.defects.answer_before_send_ended
    }

    #[cfg(not(test))]
    fn answers_before_send_ended(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests;
