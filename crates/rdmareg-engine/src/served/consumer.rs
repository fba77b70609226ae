//! The consumer side of an owner-served read, as a state machine with no
//! I/O and no clock of its own.
//!
//! A driver starts a read ([`Consumer::start`]), sends the request its
//! transport's way with the read's request id, and feeds back what happens:
//! replies as they arrive ([`Consumer::handle_reply`]), the end of the
//! transport's copy into the destination ([`Consumer::released`]), a failed
//! request send, a failed endpoint, the clock ([`Consumer::handle_timeout`]),
//! shutdown. The machine decides; the driver acts. Completions come out of
//! [`Consumer::poll_completion`], each read's exactly once.
//!
//! # Rules, and why
//!
//! - **A reply counts only from the endpoint its request went out on.**
//!   Request ids are a counter; a third peer guessing one must not have its
//!   bytes written into this read's destination. A reply from elsewhere, or
//!   for a read no longer waiting, is dropped ([`ReplyVerdict::Drop`]).
//! - **A reply is taken once.** From the moment a reply is accepted no later
//!   reply can reach the read, so a duplicate cannot write the destination
//!   twice or race the first.
//! - **A served reply must carry exactly the bytes asked for.** A longer
//!   payload would overrun the destination (some transports do not check a
//!   receive's size), a shorter one would complete stale bytes with `Ok`.
//! - **A read completes only once the transport released its
//!   destination.** While a read waits for its reply the transport holds
//!   nothing of the destination, so its deadline, a failed endpoint or
//!   shutdown completes it at once (and a late reply is dropped). Once the
//!   payload is being written ([`ReplyVerdict::Write`]), only
//!   [`Consumer::released`] completes it: past the deadline the machine asks the
//!   driver to stop the transfer ([`TimeoutAction::StopTransfer`]), and it
//!   completes with `Timeout` when the transport reports the end — or `Ok`
//!   if the bytes arrived after all. Completing earlier would hand the
//!   caller a buffer the transport may still write.
//!
//! # Two kinds of transport
//!
//! Where a reply's header arrives before its payload is written (UCX
//! active messages), a read starts waiting for its reply
//! ([`Consumer::start`]) and the machine checks the header before anything
//! is written. Where the payload is received straight into the destination
//! by a receive posted before the request goes out (libfabric tagged
//! messages), the transport holds the destination from the start
//! ([`Consumer::start_receiving`]): the owner's verdict comes with the
//! receive's completion, and every end of such a read goes through
//! [`Consumer::released`].
//!
//! Each read carries a value of the driver's (`T`, say its op slot), handed
//! back with its result.

use std::collections::VecDeque;
use std::fmt::Debug;
use std::hash::Hash;
use std::time::Instant;

use rdmareg_core::RdmaError;
use rustc_hash::FxHashMap as HashMap;

use crate::deadlines::DeadlineQueue;

/// One read of this consumer; its value is the request id on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReadId(pub u64);

/// A reply header, decoded from the driver's wire format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// The request id it replies to.
    pub request_id: u64,
    /// What the owner said.
    pub outcome: ReplyOutcome,
}

/// What an owner replied to a read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplyOutcome {
    /// The bytes follow: `length` of them.
    Served {
        /// Bytes the header announces.
        length: u64,
    },
    /// The owner refused; the error the read gets.
    Refused(RdmaError),
}

/// What the driver does with an arrived reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplyVerdict {
    /// Nobody may take it: drop it (for a payload the transport holds, tell
    /// the sender to stop). Nothing is written.
    Drop(DropReason),
    /// Write the payload into the read's destination (copy it, or start the
    /// transport's receive into it), then report [`Consumer::released`].
    Write(ReadId),
    /// The read completes with an error; nothing is written.
    Refused(ReadId),
}

/// Why a reply was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// No read waits for that request id (never started, completed, or past
    /// its deadline).
    NotAwaited,
    /// A read waits for it, but its request went out on another endpoint.
    WrongEndpoint,
}

/// What a deadline asks of the driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TimeoutAction<E> {
    /// The payload of `read` is being written on `endpoint`: stop it (close
    /// the endpoint, cancel the receive). The read completes when the
    /// transport reports the end ([`Consumer::released`]).
    StopTransfer {
        /// The read past its deadline.
        read: ReadId,
        /// Where its payload comes from.
        endpoint: E,
    },
}

/// Where a read stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// The request is out; the transport holds nothing of the destination.
    AwaitingReply,
    /// The payload is being written (or a receive into the destination is
    /// posted); only the transport's end completes it.
    Held {
        /// The deadline passed meanwhile.
        expired: bool,
        /// The request could not be sent: the read ends with that error
        /// once the transport gave the destination back.
        unsent: bool,
    },
}

#[derive(Debug)]
struct Read<E, T> {
    endpoint: E,
    length: u64,
    phase: Phase,
    payload: T,
}

/// Test-only switches that bring back defects the engines once had, so the
/// simulator can show it finds them.
#[cfg(test)]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Defects {
    /// Complete a read past its deadline at once, even while its payload is
    /// still being written.
    pub(crate) complete_before_release: bool,
    /// Take a reply from whichever endpoint it came on.
    pub(crate) accept_any_endpoint: bool,
    /// Take a served payload shorter than the read.
    pub(crate) accept_short_payload: bool,
    /// Check a longer served payload by its header, not its size.
    pub(crate) trust_header_length: bool,
    /// Take a refusal from whichever endpoint it came on.
    pub(crate) accept_refusals_from_any_endpoint: bool,
}

/// A read's result, with the driver's value it was started with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion<T> {
    /// The read.
    pub read: ReadId,
    /// What the driver passed when it started the read.
    pub payload: T,
    /// Its outcome.
    pub outcome: Result<(), RdmaError>,
}

/// The consumer side of owner-served reads; see the module docs.
#[derive(Debug)]
pub struct Consumer<E, T = ()> {
    reads: HashMap<u64, Read<E, T>>,
    deadlines: DeadlineQueue,
    next_request_id: u64,
    completions: VecDeque<Completion<T>>,
    /// Why a posted-receive read's request could not be sent.
    send_errors: HashMap<u64, RdmaError>,
    closing: bool,
    #[cfg(test)]
    pub(crate) defects: Defects,
}

impl<E, T> Default for Consumer<E, T> {
    fn default() -> Self {
        Consumer {
            reads: HashMap::default(),
            deadlines: DeadlineQueue::default(),
            next_request_id: 1,
            completions: VecDeque::new(),
            send_errors: HashMap::default(),
            closing: false,
            #[cfg(test)]
            defects: Defects::default(),
        }
    }
}

impl<E: Copy + Eq + Hash + Debug, T> Consumer<E, T> {
    /// A consumer with no reads.
    pub fn new() -> Consumer<E, T> {
        Consumer::default()
    }

    /// Starts a read of `length` bytes from the owner at `endpoint`, due by
    /// `deadline`, waiting for its reply. The driver sends the request with
    /// `request_id = id.0`. After shutdown began the read completes with
    /// [`RdmaError::ShuttingDown`] at once and the driver sends nothing.
    pub fn start(&mut self, endpoint: E, length: u64, deadline: Instant, payload: T) -> ReadId {
        self.enter(endpoint, length, deadline, payload, Phase::AwaitingReply)
    }

    /// As [`start`](Self::start), for a transport that receives the reply
    /// straight into the destination: the driver posts the receive, then
    /// sends the request; the read ends only through
    /// [`released`](Self::released). After shutdown began the read completes
    /// at once and the driver posts nothing.
    pub fn start_receiving(
        &mut self,
        endpoint: E,
        length: u64,
        deadline: Instant,
        payload: T,
    ) -> ReadId {
        let phase = Phase::Held {
            expired: false,
            unsent: false,
        };
        self.enter(endpoint, length, deadline, payload, phase)
    }

    fn enter(
        &mut self,
        endpoint: E,
        length: u64,
        deadline: Instant,
        payload: T,
        phase: Phase,
    ) -> ReadId {
        let id = ReadId(self.next_request_id);
        self.next_request_id += 1;
        if self.closing {
            self.completions.push_back(Completion {
                read: id,
                payload,
                outcome: Err(RdmaError::ShuttingDown),
            });
            return id;
        }
        self.reads.insert(
            id.0,
            Read {
                endpoint,
                length,
                phase,
                payload,
            },
        );
        // The queue orders by (time, slot, generation); slot is unused here.
        self.deadlines.push((deadline, 0, id.0));
        id
    }

    /// The driver's value of a read not completed yet.
    pub fn payload(&self, read: ReadId) -> Option<&T> {
        self.reads.get(&read.0).map(|entry| &entry.payload)
    }

    /// The request of `read` could not be sent. A read waiting for its
    /// reply completes with `error` at once. A read with a posted
    /// receive completes with `error` once the transport gave the receive
    /// back: true asks the driver to cancel it.
    pub fn request_failed(&mut self, read: ReadId, error: RdmaError) -> bool {
        let Some(entry) = self.reads.get_mut(&read.0) else {
            return false;
        };
        match entry.phase {
            Phase::AwaitingReply => {
                self.complete(read, Err(error));
                false
            }
            Phase::Held { expired, .. } => {
                entry.phase = Phase::Held {
                    expired,
                    unsent: true,
                };
                self.send_errors.insert(read.0, error);
                true
            }
        }
    }

    /// A reply arrived on `endpoint`, its payload `payload_length` bytes.
    pub fn handle_reply(
        &mut self,
        endpoint: E,
        reply: &Reply,
        payload_length: u64,
    ) -> ReplyVerdict {
        let id = ReadId(reply.request_id);
        let any_endpoint = self.accepts_any_endpoint()
            || (self.defect_refusals_from_any_endpoint()
                && matches!(reply.outcome, ReplyOutcome::Refused(_)));
        let payload_length = self.defect_payload_length(payload_length, reply);
        let Some(read) = self.reads.get_mut(&reply.request_id) else {
            return ReplyVerdict::Drop(DropReason::NotAwaited);
        };
        if read.phase != Phase::AwaitingReply {
            return ReplyVerdict::Drop(DropReason::NotAwaited);
        }
        if read.endpoint != endpoint && !any_endpoint {
            return ReplyVerdict::Drop(DropReason::WrongEndpoint);
        }
        match &reply.outcome {
            ReplyOutcome::Refused(error) => {
                let error = error.clone();
                self.complete(id, Err(error));
                ReplyVerdict::Refused(id)
            }
            ReplyOutcome::Served { length }
                if *length != read.length || payload_length != read.length =>
            {
                let error = RdmaError::backend(format!(
                    "the owner replied with {payload_length} bytes (header: {length}) to a {}-byte read; refused",
                    read.length
                ));
                self.complete(id, Err(error));
                ReplyVerdict::Refused(id)
            }
            ReplyOutcome::Served { .. } => {
                read.phase = Phase::Held {
                    expired: false,
                    unsent: false,
                };
                ReplyVerdict::Write(id)
            }
        }
    }

    /// The transport finished writing `read`'s payload, or gave the
    /// destination back: `result` is what it reported (for a posted
    /// receive, the owner's verdict). This is the release of the
    /// destination, and completes the read.
    pub fn released(&mut self, read: ReadId, result: Result<(), RdmaError>) {
        let Some(entry) = self.reads.get(&read.0) else {
            return;
        };
        let Phase::Held { expired, unsent } = entry.phase else {
            return;
        };
        let send_error = self.send_errors.remove(&read.0);
        let outcome = match result {
            Ok(()) => Ok(()),
            Err(_) if expired => Err(RdmaError::Timeout),
            Err(_) if self.closing => Err(RdmaError::ShuttingDown),
            Err(_) if unsent => Err(send_error.unwrap_or(RdmaError::ShuttingDown)),
            Err(error) => Err(error),
        };
        self.complete(read, outcome);
    }

    /// The endpoint to an owner failed. Reads on it that wait for their
    /// reply complete with `error`; reads whose destination the
    /// transport holds wait for it to give it back, and are returned so the
    /// driver can make sure it does (cancel their receives).
    pub fn endpoint_failed(&mut self, endpoint: E, error: RdmaError) -> Vec<ReadId> {
        let mut waiting = Vec::new();
        let mut held = Vec::new();
        for (&id, read) in &self.reads {
            if read.endpoint != endpoint {
                continue;
            }
            match read.phase {
                Phase::AwaitingReply => waiting.push(ReadId(id)),
                Phase::Held { .. } => held.push(ReadId(id)),
            }
        }
        for read in waiting {
            self.complete(read, Err(error.clone()));
        }
        held.sort_unstable();
        held
    }

    /// Expires reads whose deadline is not after `now`: a read waiting for
    /// its reply completes with `Timeout`; one whose destination the transport
    /// holds yields a [`TimeoutAction::StopTransfer`].
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<TimeoutAction<E>> {
        let mut actions = Vec::new();
        while let Some((deadline, _, id)) = self.deadlines.peek() {
            // Entries of completed reads leave from the front whatever their
            // time, so a busy loop that never sleeps keeps the queue as
            // short as its oldest live read allows.
            let live = self.reads.contains_key(&id);
            if live && deadline > now {
                break;
            }
            self.deadlines.pop();
            let Some(read) = self.reads.get_mut(&id) else {
                continue;
            };
            match read.phase {
                Phase::AwaitingReply => self.complete(ReadId(id), Err(RdmaError::Timeout)),
                Phase::Held {
                    expired: false,
                    unsent,
                } => {
                    read.phase = Phase::Held {
                        expired: true,
                        unsent,
                    };
                    actions.push(TimeoutAction::StopTransfer {
                        read: ReadId(id),
                        endpoint: read.endpoint,
                    });
                    if self.completes_before_release() {
                        self.complete(ReadId(id), Err(RdmaError::Timeout));
                    }
                }
                Phase::Held { expired: true, .. } => {}
            }
        }
        actions
    }

    /// The earliest deadline of a read not completed yet, for the driver's
    /// sleep.
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        while let Some((deadline, _, id)) = self.deadlines.peek() {
            if self.reads.contains_key(&id) {
                return Some(deadline);
            }
            self.deadlines.pop();
        }
        None
    }

    /// Teardown begins: reads waiting for their reply complete with
    /// [`RdmaError::ShuttingDown`], reads whose destination the transport
    /// holds wait for it, and new reads are refused.
    pub fn shutdown(&mut self) {
        self.closing = true;
        let waiting: Vec<u64> = self
            .reads
            .iter()
            .filter(|(_, read)| read.phase == Phase::AwaitingReply)
            .map(|(&id, _)| id)
            .collect();
        for id in waiting {
            self.complete(ReadId(id), Err(RdmaError::ShuttingDown));
        }
    }

    /// The next completion to hand out: each read's exactly once.
    pub fn poll_completion(&mut self) -> Option<Completion<T>> {
        self.completions.pop_front()
    }

    /// Reads not completed yet.
    pub fn in_flight(&self) -> usize {
        self.reads.len()
    }

    /// Deadlines queued, completed reads' included until they leave.
    #[cfg(test)]
    pub(crate) fn queued_deadlines(&self) -> usize {
        self.deadlines.len()
    }

    /// Reads whose destination the transport holds on `endpoint`: the
    /// driver keeps the endpoint until they end.
    pub fn held_on(&self, endpoint: E) -> usize {
        self.reads
            .values()
            .filter(|read| read.endpoint == endpoint && matches!(read.phase, Phase::Held { .. }))
            .count()
    }

    fn complete(&mut self, read: ReadId, outcome: Result<(), RdmaError>) {
        if let Some(entry) = self.reads.remove(&read.0) {
            self.send_errors.remove(&read.0);
            self.completions.push_back(Completion {
                read,
                payload: entry.payload,
                outcome,
            });
        }
    }

    #[cfg(test)]
    fn accepts_any_endpoint(&self) -> bool {
        self.defects.accept_any_endpoint
    }

    #[cfg(not(test))]
    fn accepts_any_endpoint(&self) -> bool {
        false
    }

    /// The payload size the length rule sees: the true one, but for the
    /// test-only defects that misjudge it.
    #[cfg(test)]
    fn defect_payload_length(&self, payload_length: u64, reply: &Reply) -> u64 {
        let Some(read) = self.reads.get(&reply.request_id) else {
            return payload_length;
        };
        match reply.outcome {
            ReplyOutcome::Served { length }
                if self.defects.trust_header_length && payload_length > read.length =>
            {
                length
            }
            _ if self.defects.accept_short_payload && payload_length < read.length => read.length,
            _ => payload_length,
        }
    }

    #[cfg(not(test))]
    fn defect_payload_length(&self, payload_length: u64, _: &Reply) -> u64 {
        payload_length
    }

    #[cfg(test)]
    fn defect_refusals_from_any_endpoint(&self) -> bool {
        self.defects.accept_refusals_from_any_endpoint
    }

    #[cfg(not(test))]
    fn defect_refusals_from_any_endpoint(&self) -> bool {
        false
    }

    #[cfg(test)]
    fn completes_before_release(&self) -> bool {
        self.defects.complete_before_release
    }

    #[cfg(not(test))]
    fn completes_before_release(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests;
