//! The harness: an owner and a consumer joined by in-memory queues, an
//! explicit clock, simulated destinations, and raw peers.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use rdmareg_core::RdmaError;

use super::super::consumer::{Consumer, ReadId, Reply, ReplyOutcome, ReplyVerdict, TimeoutAction};
use super::super::owner::{
    Action, ListEntryReply, ListLimits, Owner, OwnerConfig, Read, Refusal, SendId,
};
use super::super::wire;

/// The owner the consumer's reads go to.
pub(super) const OWNER: u32 = 1;
/// A peer that is not the owner a read went to.
pub(super) const THIRD: u32 = 66;
/// The consumer, as the owner names it.
pub(super) const CONSUMER: u32 = 10;
/// The owner's one registration.
pub(super) const REGION: u64 = 7;
pub(super) const CAP: [u8; 16] = [0x5A; 16];
pub(super) const BASE: u64 = 0x10_0000;
pub(super) const LEN: u64 = 0x10_000;
/// What a destination holds before anything is written into it.
pub(super) const UNWRITTEN: u8 = 0xEE;
/// The deadline of a read unless a scenario says otherwise.
pub(super) const DEADLINE: Duration = Duration::from_secs(5);

/// Byte `i` of the owner's registration: never zero, never `UNWRITTEN`.
pub(super) fn source_byte(i: u64) -> u8 {
    (i % 200) as u8 + 1
}

/// What the driver's answer to a refused read is (the UCX engine's
/// mapping).
pub(super) fn refusal_error(refusal: Refusal) -> RdmaError {
    match refusal {
        Refusal::OutOfRange => RdmaError::OutOfRange,
        Refusal::RegionUnknown | Refusal::CapabilityMismatch | Refusal::Deregistering => {
            RdmaError::RegionNotFound
        }
        Refusal::Malformed => RdmaError::InvalidKey,
        other => RdmaError::backend(format!("refused: {other}")),
    }
}

/// A single reply header as an owner (honest or not) encodes it.
pub(super) fn header(request_id: u64, answer: Result<u64, Refusal>) -> Vec<u8> {
    wire::Reply {
        request_id,
        outcome: answer,
    }
    .encode()
    .to_vec()
}

/// A request for `[BASE + offset, + length)` of the owner's region.
pub(super) fn read_of(request_id: u64, offset: u64, length: u64) -> Read {
    Read {
        request_id,
        region: REGION,
        capability: CAP,
        address: BASE + offset,
        length,
    }
}

/// One single reply on its way to the consumer.
#[derive(Debug, Clone)]
pub(super) struct SingleReply {
    pub(super) from: u32,
    pub(super) header: Vec<u8>,
    pub(super) payload: Vec<u8>,
    /// The owner's send, for an honest owner's reply.
    pub(super) send: Option<SendId>,
}

/// One list reply on its way to the consumer: entries in order, the served
/// ones' bytes back to back in `payload`.
#[derive(Debug, Clone)]
pub(super) struct ListReply {
    pub(super) from: u32,
    /// `(request id, served length or refusal)` per entry.
    pub(super) entries: Vec<(u64, Result<u64, Refusal>)>,
    pub(super) payload: Vec<u8>,
    pub(super) send: Option<SendId>,
    /// The length of the encoded header, for an honest owner's reply.
    pub(super) header_len: Option<usize>,
}

/// A reply on its way to the consumer.
#[derive(Debug, Clone)]
pub(super) enum Message {
    Single(SingleReply),
    List(ListReply),
}

/// A consumer's destination: its bytes, and whether its read was answered.
#[derive(Debug)]
pub(super) struct Destination {
    pub(super) bytes: Vec<u8>,
    pub(super) answer: Option<Result<(), RdmaError>>,
    /// Writes the transport made after the read was answered.
    pub(super) late_writes: usize,
}

/// A payload the transport is writing into a destination.
#[derive(Debug)]
struct Landing {
    payload: Vec<u8>,
    send: Option<SendId>,
}

/// An owner and a consumer joined by in-memory queues, with an explicit
/// clock: the consumer reads from the owner's one region (`REGION`, `LEN`
/// bytes at `BASE`); raw peers inject bytes of their own choosing into
/// either side. Nothing moves unless a scenario says so.
#[derive(Debug)]
pub(super) struct Pair {
    /// The clock: set at the pair's creation, moved only by
    /// [`advance`](Self::advance).
    pub(super) now: Instant,
    pub(super) owner: Owner<u32>,
    pub(super) consumer: Consumer<u32>,
    /// The bounds the owner judges and cuts lists by.
    pub(super) limits: ListLimits,
    /// The owner's registered bytes.
    source: Vec<u8>,
    /// Requests on their way to the owner: (sender, bytes, a list).
    to_owner: VecDeque<(u32, Vec<u8>, bool)>,
    /// Replies on their way to the consumer.
    pub(super) to_consumer: VecDeque<Message>,
    /// What the owner sent to endpoints other than `CONSUMER` (raw
    /// consumers), in order; their sends stay open until a scenario ends them.
    pub(super) elsewhere: Vec<Action<u32>>,
    pub(super) dests: BTreeMap<ReadId, Destination>,
    landing: BTreeMap<ReadId, Landing>,
    pub(super) unmapped: Vec<u64>,
    pub(super) drained: bool,
    /// Reads answered twice (never, if the consumer keeps its promise).
    pub(super) answered_twice: usize,
}

impl Pair {
    /// A pair whose owner allows `bound` unfinished replies per endpoint.
    pub(super) fn with_bound(bound: u32) -> Pair {
        let mut owner = Owner::new(OwnerConfig {
            max_replies_per_endpoint: bound,
            ..OwnerConfig::default()
        });
        owner
            .register(REGION, CAP, BASE, LEN)
            .expect("a fresh owner registers");
        Pair {
            now: Instant::now(),
            owner,
            consumer: Consumer::new(),
            limits: ListLimits::default(),
            source: (0..LEN).map(source_byte).collect(),
            to_owner: VecDeque::new(),
            to_consumer: VecDeque::new(),
            elsewhere: Vec::new(),
            dests: BTreeMap::new(),
            landing: BTreeMap::new(),
            unmapped: Vec::new(),
            drained: false,
            answered_twice: 0,
        }
    }

    /// A pair whose owner has the default bound.
    pub(super) fn new() -> Pair {
        Pair::with_bound(OwnerConfig::default().max_replies_per_endpoint)
    }

    /// The owner's bytes `[offset, offset + length)` of its region.
    pub(super) fn source(&self, offset: u64, length: u64) -> Vec<u8> {
        self.source[offset as usize..(offset + length) as usize].to_vec()
    }

    fn fresh_destination(&mut self, read: ReadId, length: u64) {
        self.dests.insert(
            read,
            Destination {
                bytes: vec![UNWRITTEN; length as usize],
                answer: None,
                late_writes: 0,
            },
        );
        self.collect();
    }

    /// The consumer starts a read of `[BASE + offset, + length)` from
    /// `OWNER`, due `deadline` from now, and sends its request.
    pub(super) fn read(&mut self, offset: u64, length: u64, deadline: Duration) -> ReadId {
        self.read_with(OWNER, read_of(0, offset, length), deadline)
    }

    /// The consumer starts a read from `owner` asking `request` (a wrong
    /// capability, range, region...) under the read's own id. Only a
    /// request to `OWNER` goes anywhere: any other owner is a raw peer,
    /// which answers (or not) by [`inject`](Self::inject).
    pub(super) fn read_with(
        &mut self,
        owner: u32,
        mut request: Read,
        deadline: Duration,
    ) -> ReadId {
        let id = self
            .consumer
            .start(owner, request.length, self.now + deadline, ());
        request.request_id = id.0;
        self.fresh_destination(id, request.length);
        if owner == OWNER && self.dests[&id].answer.is_none() {
            let bytes = wire::encode_request(&request).to_vec();
            self.to_owner.push_back((CONSUMER, bytes, false));
        }
        id
    }

    /// The consumer starts one read per `(offset, length)`, each due
    /// `deadline` from now, and asks for them in one gathered list.
    pub(super) fn read_list(&mut self, entries: &[(u64, u64)], deadline: Duration) -> Vec<ReadId> {
        let deadlines: Vec<Duration> = entries.iter().map(|_| deadline).collect();
        self.read_list_due(entries, &deadlines)
    }

    /// As [`read_list`](Self::read_list), each entry with its own deadline.
    pub(super) fn read_list_due(
        &mut self,
        entries: &[(u64, u64)],
        deadlines: &[Duration],
    ) -> Vec<ReadId> {
        let mut reads = Vec::new();
        let mut requests = Vec::new();
        for (&(offset, length), &deadline) in entries.iter().zip(deadlines) {
            let id = self.consumer.start(OWNER, length, self.now + deadline, ());
            self.fresh_destination(id, length);
            reads.push(id);
            requests.push(read_of(id.0, offset, length));
        }
        let bytes = wire::encode_list_request(&requests).expect("a list of 1 to 64 entries");
        self.to_owner.push_back((CONSUMER, bytes, true));
        reads
    }

    /// A raw consumer `from` sends the owner `bytes` as a single request.
    pub(super) fn raw_request(&mut self, from: u32, bytes: &[u8]) {
        self.to_owner.push_back((from, bytes.to_vec(), false));
    }

    /// A raw consumer `from` sends the owner `bytes` as a list request.
    pub(super) fn raw_list(&mut self, from: u32, bytes: &[u8]) {
        self.to_owner.push_back((from, bytes.to_vec(), true));
    }

    /// A raw peer `from` sends the consumer a single reply.
    pub(super) fn inject(&mut self, from: u32, header: Vec<u8>, payload: Vec<u8>) {
        self.to_consumer.push_back(Message::Single(SingleReply {
            from,
            header,
            payload,
            send: None,
        }));
    }

    /// A raw peer `from` sends the consumer a list reply.
    pub(super) fn inject_list(
        &mut self,
        from: u32,
        entries: Vec<(u64, Result<u64, Refusal>)>,
        payload: Vec<u8>,
    ) {
        self.to_consumer.push_back(Message::List(ListReply {
            from,
            entries,
            payload,
            send: None,
            header_len: None,
        }));
    }

    /// The owner takes every request on its way, and its actions are
    /// performed: replies to the consumer are queued, others kept in
    /// `elsewhere`.
    pub(super) fn deliver_requests(&mut self) {
        while let Some((from, bytes, list)) = self.to_owner.pop_front() {
            if list {
                self.owner.handle_list_request(from, &bytes, self.limits);
            } else {
                self.owner.handle_request(from, &bytes);
            }
        }
        self.perform_owner_actions();
    }

    /// Performs what the owner asks, in order.
    pub(super) fn perform_owner_actions(&mut self) {
        while let Some(action) = self.owner.poll_action() {
            match action {
                Action::Unmapped { region } => self.unmapped.push(region),
                Action::Drained => self.drained = true,
                Action::Serve { endpoint, .. }
                | Action::Refuse { endpoint, .. }
                | Action::ServeList { endpoint, .. }
                    if endpoint != CONSUMER =>
                {
                    self.elsewhere.push(action);
                }
                Action::Serve {
                    send, ref payload, ..
                } => {
                    let offset = payload.address - BASE;
                    let bytes = self.source(offset, payload.length);
                    let header = action.reply_header().expect("a single reply").to_vec();
                    self.to_consumer.push_back(Message::Single(SingleReply {
                        from: OWNER,
                        header,
                        payload: bytes,
                        send: Some(send),
                    }));
                }
                Action::Refuse { send, .. } => {
                    let header = action.reply_header().expect("a single reply").to_vec();
                    self.to_consumer.push_back(Message::Single(SingleReply {
                        from: OWNER,
                        header,
                        payload: Vec::new(),
                        send: Some(send),
                    }));
                }
                Action::ServeList {
                    send,
                    entry_replies: ref answers,
                    ..
                } => {
                    let mut reply = self.list_reply_of(answers, send);
                    reply.header_len = action.list_reply_header().map(|h| h.len());
                    self.to_consumer.push_back(Message::List(reply));
                }
                // Served writes have their own scenarios.
                Action::Receive { .. }
                | Action::Acknowledge { .. }
                | Action::AcknowledgeList { .. } => self.elsewhere.push(action),
            }
        }
    }

    fn list_reply_of(&self, answers: &[ListEntryReply], send: SendId) -> ListReply {
        let mut payload = Vec::new();
        let entries = answers
            .iter()
            .map(|a| {
                let answer = a.outcome.map(|p| {
                    payload.extend(self.source(p.address - BASE, p.length));
                    p.length
                });
                (a.request_id, answer)
            })
            .collect();
        ListReply {
            from: OWNER,
            entries,
            payload,
            send: Some(send),
            header_len: None,
        }
    }

    /// Delivers every reply on its way to the consumer; eager payloads land
    /// at once, inside the delivery, as a UCX handler copies them.
    pub(super) fn deliver_replies(&mut self) {
        while let Some(message) = self.to_consumer.pop_front() {
            self.deliver(message, false);
        }
    }

    /// Delivers the next reply, whose payload the transport then holds
    /// (a rendezvous): a landed read stays landing until
    /// [`finish_landing`](Self::finish_landing).
    pub(super) fn deliver_next_held(&mut self) -> Vec<ReplyVerdict> {
        let message = self.to_consumer.pop_front().expect("a reply on its way");
        self.deliver(message, true)
    }

    /// Delivers `message`; returns the consumer's verdict on each reply (or
    /// entry) in it.
    pub(super) fn deliver(&mut self, message: Message, hold: bool) -> Vec<ReplyVerdict> {
        let mut verdicts = Vec::new();
        match message {
            Message::Single(reply) => {
                let Ok(decoded) = wire::Reply::decode(&reply.header) else {
                    // Bytes that are no reply: the driver drops them.
                    self.end_send(reply.send);
                    return verdicts;
                };
                let verdict = self.take(
                    reply.from,
                    decoded.request_id,
                    decoded.outcome,
                    &reply.payload,
                    hold,
                    reply.send,
                );
                verdicts.push(verdict);
            }
            Message::List(list) => {
                let mut at = 0usize;
                for &(request_id, answer) in &list.entries {
                    let length = answer.map_or(0, |n| n as usize);
                    let bytes = list.payload.get(at..at + length).unwrap_or(&[]).to_vec();
                    at = at.saturating_add(length);
                    verdicts.push(self.take(list.from, request_id, answer, &bytes, false, None));
                }
                self.end_send(list.send);
            }
        }
        self.collect();
        verdicts
    }

    /// One reply (or list entry) before the consumer: its verdict
    /// performed.
    fn take(
        &mut self,
        from: u32,
        request_id: u64,
        answer: Result<u64, Refusal>,
        payload: &[u8],
        hold: bool,
        send: Option<SendId>,
    ) -> ReplyVerdict {
        let outcome = match answer {
            Ok(length) => ReplyOutcome::Served { length },
            Err(refusal) => ReplyOutcome::Refused(refusal_error(refusal)),
        };
        let verdict = self.consumer.handle_reply(
            from,
            &Reply {
                request_id,
                outcome,
            },
            payload.len() as u64,
        );
        match verdict {
            ReplyVerdict::Write(read) => {
                self.landing.insert(
                    read,
                    Landing {
                        payload: payload.to_vec(),
                        send,
                    },
                );
                if !hold {
                    self.finish_landing(read, true);
                }
            }
            ReplyVerdict::Drop(_) | ReplyVerdict::Refused(_) => self.end_send(send),
        }
        verdict
    }

    /// The transport ends the payload it writes into `read`'s destination:
    /// all of it written (`whole`), or stopped before a byte was.
    pub(super) fn finish_landing(&mut self, read: ReadId, whole: bool) {
        let landing = self.landing.remove(&read).expect("a payload landing");
        if whole {
            self.write(read, &landing.payload);
            self.consumer.released(read, Ok(()));
        } else {
            self.consumer
                .released(read, Err(RdmaError::backend("transfer stopped")));
        }
        self.end_send(landing.send);
        self.collect();
    }

    /// The transport writes `bytes` into `read`'s destination (from its
    /// start); a write after the read's answer is counted.
    pub(super) fn write(&mut self, read: ReadId, bytes: &[u8]) {
        self.collect();
        let dest = self.dests.get_mut(&read).expect("a destination");
        if dest.answer.is_some() {
            dest.late_writes += 1;
        }
        let n = bytes.len().min(dest.bytes.len());
        dest.bytes[..n].copy_from_slice(&bytes[..n]);
    }

    fn end_send(&mut self, send: Option<SendId>) {
        if let Some(send) = send {
            self.owner.send_completed(send);
            self.perform_owner_actions();
        }
    }

    /// Moves the clock on by `by` and lets the consumer expire reads.
    pub(super) fn advance(&mut self, by: Duration) -> Vec<TimeoutAction<u32>> {
        self.now += by;
        let actions = self.consumer.handle_timeout(self.now);
        self.collect();
        actions
    }

    /// Requests and replies delivered until nothing moves.
    pub(super) fn settle(&mut self) {
        while !self.to_owner.is_empty() || !self.to_consumer.is_empty() {
            self.deliver_requests();
            self.deliver_replies();
        }
        self.collect();
    }

    /// Takes the consumer's answers into the destinations.
    pub(super) fn collect(&mut self) {
        while let Some(answer) = self.consumer.poll_completion() {
            let dest = self.dests.get_mut(&answer.read).expect("a destination");
            if dest.answer.is_some() {
                self.answered_twice += 1;
            }
            dest.answer = Some(answer.outcome);
        }
    }

    /// `read`'s answer, if it has one.
    pub(super) fn answer(&self, read: ReadId) -> Option<Result<(), RdmaError>> {
        self.dests[&read].answer.clone()
    }

    /// `read`'s destination.
    pub(super) fn dest(&self, read: ReadId) -> &[u8] {
        &self.dests[&read].bytes
    }

    /// Whether `read`'s destination holds nothing written.
    pub(super) fn untouched(&self, read: ReadId) -> bool {
        self.dest(read).iter().all(|&b| b == UNWRITTEN)
    }

    /// Overwrites `read`'s destination, as its caller may once it answered.
    pub(super) fn scribble(&mut self, read: ReadId) {
        let dest = self.dests.get_mut(&read).expect("a destination");
        dest.bytes.fill(UNWRITTEN);
    }

    /// Writes into destinations after their answers, over all reads.
    pub(super) fn late_writes(&self) -> usize {
        self.dests.values().map(|d| d.late_writes).sum()
    }

    /// The promises every scenario ends on: every read answered once,
    /// nothing written after an answer, the consumer holds no read.
    pub(super) fn assert_clean_end(&self) {
        assert_eq!(self.answered_twice, 0, "a read answered twice");
        assert_eq!(self.late_writes(), 0, "a write after an answer");
        let unanswered: Vec<&ReadId> = self
            .dests
            .iter()
            .filter(|(_, d)| d.answer.is_none())
            .map(|(id, _)| id)
            .collect();
        assert!(unanswered.is_empty(), "unanswered: {unanswered:?}");
        assert_eq!(self.consumer.in_flight(), 0);
    }
}
