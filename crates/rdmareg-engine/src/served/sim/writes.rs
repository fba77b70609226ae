//! A deterministic simulator of served writes: one owner over simulated
//! memory, writers ([`Writer`] machines) on connections to it, and the
//! transport between them, driven by one `u64` seed.
//!
//! The scheduler picks, step by step, among: honest writes (random ranges
//! of the descriptors writers were given, of registrations made for
//! reading, writing or both, stale ones included); hostile writes (forged
//! capability, unknown region, out of range, past the end, empty,
//! wrapping, a payload of another length than the header's, a header
//! that does not decode); delivering requests in any order, dropping and
//! duplicating them; receiving an accepted write's bytes a few at a time
//! (as a rendezvous does), failing a receive; ending the owner's reply
//! sends and the writers' request sends, in any order; delivering replies
//! in any order, and forged replies from a third peer; connection
//! failures and writers killed mid-transfer; the clock passing writes'
//! deadlines; registrations, unmaps racing writes, the program reusing
//! memory whose unmap finished; shutdown and the transport's close.
//!
//! And write lists ([`lists`]): a writer sends 1 to 64 of its writes as
//! one message with one send (honest entries and hostile ones, some over
//! an earlier entry's range, now and then a payload that does not add up
//! or a header that does not decode), the owner answers the list once,
//! in one reply or several, and the writer takes each reply; forged list
//! replies come from a third peer. A quarter of the runs raise the
//! owner's bound so lists get entries in by the dozen, a quarter bound a
//! list's entries and total tightly, and a quarter answer a list in
//! replies of 1 to 8 entries (each drawn from the seed apart from the
//! runs' other choices).
//!
//! # Invariants, checked after every step
//!
//! 1. No byte is written outside a registration that allows writes and
//!    whose unmap has not finished: checked at each byte the transport
//!    writes.
//! 2. A write is received exactly when an independent model of the rules
//!    says it is accepted, and otherwise refused with the refusal the
//!    model gives (or dropped when it says so): a refused write writes
//!    nothing.
//! 3. An unmap finishes only for a region being unmapped, and only when
//!    no receive into it is left.
//! 4. A write answered `Ok` was received whole: its receive completed
//!    with the target range holding exactly its bytes (but for bytes a
//!    receive of another write overlapping it wrote since).
//! 5. Every write of a live writer is answered exactly once, and never
//!    before the transport reported its request's send ended.
//! 6. Per connection the owner holds at most its bound of accepted writes
//!    and, apart, of refusals; each writer keeps state only for writes
//!    not answered. The one excess is a write list's: it is admitted while
//!    the connection holds fewer than the bound and then takes a place per
//!    reply at once, so the connection may hold past the bound by the
//!    places the list admitted last still holds, but one — by nothing once
//!    a single write was admitted since (the owner's count and the
//!    model's both).
//! 7. At the end, with every message delivered, every receive and send
//!    ended and the deadlines passed, every write is answered, every
//!    unmap finished, the owner holds no endpoint, and shutdown drains.
//! 8. The owner's log of written ranges lists only bytes a completed
//!    receive wrote, none a failed receive overlapped since: each listed
//!    byte holds the byte of a receive that completed (or of one still
//!    in flight over it), never of a refused or failed write, and, against
//!    a byte map of what landed, a listed byte landed. Unless the log says
//!    it is incomplete, every byte that landed is listed — a killed
//!    writer's completed receives included. Half the runs bound the log
//!    to a few ranges, so it overflows; a take starts it afresh, and the
//!    log ends with the registration.
//! 9. A write list gets exactly the receives the model predicts, entry by
//!    entry (each at its place in the payload, so with its own bytes),
//!    and one answer of `ceil(n / entries_per_reply)` replies, each
//!    carrying its part of the entries, the parts in entry order: at once
//!    when no entry is accepted (each reply under the refusal bound, the
//!    ones past it dropped; none, past it), else all right when its last
//!    receive ended — never earlier, never twice, never on a failed
//!    connection or after the transport closed — with each entry's `Ok`,
//!    refusal or failed receive as the model gives them. A list arriving
//!    at the connection's bound is busy as a whole; otherwise it holds
//!    one place per reply from acceptance until that reply's send ended
//!    (6 bounds what the transport holds for a connection).
//! 10. A list's writes are answered as single ones are (5 and 4): each
//!     once, through the reply of its part, after the list's one send
//!     ended, `Ok` only when its receive left its bytes in memory.
//!
//! # Proof that it bites
//!
//! The owner's test-only defects `write_access_unchecked`,
//! `unmap_ignores_receives`, `acknowledge_before_receive`,
//! `failed_receives_listed`, `answer_list_before_last_receive` and
//! `list_replies_out_of_order`, and the writer's
//! `answer_before_send_ended`, are each caught within the first 20 seeds
//! by a test in `tests`.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use rdmareg_core::{Access, RdmaError};

use super::{Checked, Rng, Violation, capability};
use crate::served::owner::{
    Action, Defects, Owner, OwnerConfig, ReceiveId, Refusal, SendId, WriteListLimits,
};
use crate::served::wire;
use crate::served::writer::{self, Writer};
use crate::sim_support::mix;

mod lists;
mod writers;
mod written;

use lists::{Due, SimList};

/// Steps of the random phase of one run.
const STEPS: u32 = 250;
const SLOTS: u64 = 4;
const SLOT_LEN: u64 = 64;
const SLOT_STRIDE: u64 = 0x1_0000;
/// The connection forged replies come on.
const FORGER: u64 = 999;
/// Writes one writer has unanswered at most (the simulation's own bound).
const MAX_WRITES: usize = 12;
/// The same, when it posts a write list (up to 64 entries at once).
const MAX_LIST_WRITES: usize = 96;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Live,
    Unmapping,
    Unmapped,
}

#[derive(Debug)]
struct Region {
    slot: usize,
    capability: [u8; 16],
    base: u64,
    len: u64,
    access: Access,
    state: State,
}

/// A request on its way to the owner.
#[derive(Debug, Clone)]
struct Request {
    conn: u64,
    header: Vec<u8>,
    payload: Vec<u8>,
    /// The write whose send this message is (its source is held while the
    /// message travels); `None` for a duplicate.
    origin: Option<Origin>,
    /// The write it carries, duplicates included (a write list's first
    /// entry).
    of: Option<Origin>,
    /// The header is a write list's, the payload its entries' bytes.
    list: bool,
}

/// A writer and one of its writes.
type Origin = (usize, u64);

/// A reply on its way to a writer.
#[derive(Debug, Clone)]
struct ToWriter {
    conn: u64,
    /// The writer a forged reply is pushed at.
    to: Option<usize>,
    header: ReplyHeader,
    payload_length: u64,
    /// The owner's send, for an honest reply.
    send: Option<SendId>,
}

/// A reply's header: a single write's, or a write list's.
#[derive(Debug, Clone)]
enum ReplyHeader {
    Single([u8; wire::REPLY_LEN]),
    List(Vec<u8>),
}

/// A receive into the owner's memory in progress.
#[derive(Debug)]
struct Receiving {
    conn: u64,
    address: u64,
    bytes: Vec<u8>,
    written: usize,
    origin: Option<Origin>,
    /// The write it carries, a duplicate's included.
    of: Option<Origin>,
    /// Its connection failed or the send was stopped: it ends in error.
    doomed: bool,
    /// Addresses of its range a receive that failed while it ran may have
    /// written after it.
    spoiled: BTreeSet<u64>,
    /// The write list (the simulation's key) and entry it is of.
    list: Option<(u64, usize)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OwnerSend {
    Refusal,
    /// A reply to an accepted write (acknowledgement or failed receive).
    WriteReply,
    /// One reply (part) of the write list the simulation keys so: it
    /// holds one of the list's places until its send ended.
    ListReply(u64),
}

impl OwnerSend {
    /// Places it holds under its endpoint's bound of served replies.
    fn places(self) -> usize {
        match self {
            OwnerSend::Refusal => 0,
            OwnerSend::WriteReply | OwnerSend::ListReply(_) => 1,
        }
    }
}

#[derive(Debug)]
struct Record {
    conn: u64,
    /// The message of its send is on the network.
    travelling: bool,
    /// Receives reading its source.
    receiving: u32,
    /// The transport was asked to end the send early (deadline, failure).
    stopping: bool,
    send_ended: bool,
    answered: bool,
    /// A receive of it completed with the range holding its bytes.
    received: bool,
    /// The write list whose message carries it: one send for them all.
    batch: Option<u64>,
}

struct SimWriter {
    conn: u64,
    machine: Writer<u64, ()>,
    alive: bool,
}

/// What a clean run did.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Stats {
    pub(crate) writes: u64,
    pub(crate) received: u64,
    pub(crate) refused: u64,
    pub(crate) access_denied: u64,
    pub(crate) dropped: u64,
    pub(crate) answered_ok: u64,
    pub(crate) answered_err: u64,
    pub(crate) receives_failed: u64,
    pub(crate) unmaps_waited: u64,
    pub(crate) bytes_written: u64,
    /// Bytes the owner's log listed at a take.
    pub(crate) listed_bytes: u64,
    /// Takes that found the log incomplete.
    pub(crate) incomplete_logs: u64,
    /// Write lists posted, and their entries.
    pub(crate) lists: u64,
    pub(crate) list_entries: u64,
    /// Lists answered once their receives ended, and answered at once
    /// (no entry accepted).
    pub(crate) lists_answered: u64,
    pub(crate) lists_refused: u64,
    /// Lists the owner dropped, and lists whose endpoint failed before
    /// their receives ended (not answered).
    pub(crate) lists_dropped: u64,
    pub(crate) lists_unanswered: u64,
    /// Entries of answered lists: `Ok`, refused on arrival, failed receive.
    pub(crate) list_entries_ok: u64,
    pub(crate) list_entries_refused: u64,
    pub(crate) list_entries_failed: u64,
    /// Lists answered with two or more entries accepted.
    pub(crate) wide_lists: u64,
    /// Lists answered in two or more replies (after their receives, and
    /// at once), and replies of lists answered at once dropped past the
    /// refusal bound.
    pub(crate) lists_in_parts: u64,
    pub(crate) lists_refused_in_parts: u64,
    pub(crate) list_parts_dropped: u64,
    /// Lists whose places took their connection past its bound.
    pub(crate) lists_past_bound: u64,
    /// Writes of lists a writer completed `Ok`.
    pub(crate) list_writes_ok: u64,
}

impl Stats {
    fn add(&mut self, o: Stats) {
        self.writes += o.writes;
        self.received += o.received;
        self.refused += o.refused;
        self.access_denied += o.access_denied;
        self.dropped += o.dropped;
        self.answered_ok += o.answered_ok;
        self.answered_err += o.answered_err;
        self.receives_failed += o.receives_failed;
        self.unmaps_waited += o.unmaps_waited;
        self.bytes_written += o.bytes_written;
        self.listed_bytes += o.listed_bytes;
        self.incomplete_logs += o.incomplete_logs;
        self.lists += o.lists;
        self.list_entries += o.list_entries;
        self.lists_answered += o.lists_answered;
        self.lists_refused += o.lists_refused;
        self.lists_dropped += o.lists_dropped;
        self.lists_unanswered += o.lists_unanswered;
        self.list_entries_ok += o.list_entries_ok;
        self.list_entries_refused += o.list_entries_refused;
        self.list_entries_failed += o.list_entries_failed;
        self.wide_lists += o.wide_lists;
        self.lists_in_parts += o.lists_in_parts;
        self.lists_refused_in_parts += o.lists_refused_in_parts;
        self.list_parts_dropped += o.list_parts_dropped;
        self.lists_past_bound += o.lists_past_bound;
        self.list_writes_ok += o.list_writes_ok;
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Receive,
    Refuse(Refusal),
    Drop,
}

struct Sim {
    step: u32,
    rng: Rng,
    bound: u32,
    owner: Owner<u64>,
    /// Simulated memory, slot by slot, and per byte the receive that
    /// wrote it last.
    memory: Vec<Vec<u8>>,
    last_writer: Vec<Vec<Option<ReceiveId>>>,
    slot_region: Vec<Option<u64>>,
    regions: BTreeMap<u64, Region>,
    next_region: u64,
    writers: Vec<SimWriter>,
    records: BTreeMap<Origin, Record>,
    next_conn: u64,
    /// Connections that failed, and those whose requests the owner drops
    /// (failed while it had something of theirs unfinished).
    failed: BTreeSet<u64>,
    dropping: BTreeSet<u64>,
    to_owner: Vec<Request>,
    seen: Vec<Request>,
    to_writers: Vec<ToWriter>,
    receiving: BTreeMap<ReceiveId, Receiving>,
    owner_sends: BTreeMap<SendId, (u64, OwnerSend)>,
    now: Instant,
    shut_down: bool,
    closed: bool,
    drained: bool,
    stats: Stats,
    log: Option<VecDeque<String>>,
    /// Per region, per byte (from its start): a completed receive wrote
    /// it since the last take and no failed receive overlapped it since.
    landed: BTreeMap<u64, Vec<bool>>,
    /// Receives that ended, and whether they completed.
    ended: BTreeMap<ReceiveId, bool>,
    /// The owner's bounds of a write list, drawn per seed.
    list_limits: WriteListLimits,
    /// Write lists the owner accepted an entry of and has not answered,
    /// by the simulation's key.
    lists: BTreeMap<u64, SimList>,
    next_list: u64,
    /// The list whose last receive just ended: the owner's answer is due,
    /// its replies from the first not given yet.
    list_due: Option<Due>,
    /// Per connection, the write list (the simulation's key) whose
    /// acceptance took the last places there, or `None` when a single
    /// write did: only that list's places may lift the connection past
    /// its bound.
    admitted: BTreeMap<u64, Option<u64>>,
    /// Each write list's writes, by the key their records carry: the one
    /// send of its message ends for them all.
    batches: BTreeMap<u64, Vec<Origin>>,
}

impl Sim {
    fn new(seed: u64, defects: Defects, writer_defects: writer::Defects, verbose: bool) -> Sim {
        let mut rng = Rng::new(mix(seed ^ 0x7772_6974_6573));
        let mut bound = 1 + rng.below(4) as u32;
        // A quarter of the runs let a write list's entries in by the dozen.
        if mix(seed ^ 0x6c69_7374) % 4 == 0 {
            bound *= 16;
        }
        // And a quarter bound a list tightly: entries past these are
        // refused malformed.
        let mut list_limits = match mix(seed ^ 0x6c69_6d69) % 4 {
            0 => WriteListLimits {
                max_entry: 8 + mix(seed ^ 1) % 32,
                max_total: 32 + mix(seed ^ 2) % 256,
                ..WriteListLimits::default()
            },
            _ => WriteListLimits::default(),
        };
        // And a quarter answer a list in replies of 1 to 8 entries.
        if mix(seed ^ 0x7061_7274) % 4 == 0 {
            list_limits.entries_per_reply = 1 + (mix(seed ^ 3) % 8) as usize;
        }
        // Drawn apart from `rng`, so the runs are otherwise as before.
        let max_written_ranges = match mix(seed ^ 0x006c_6f67) % 4 {
            0 => 1,
            1 => 3,
            _ => rdmareg_core::MAX_WRITTEN_RANGES,
        };
        let mut owner = Owner::new(OwnerConfig {
            max_replies_per_endpoint: bound,
            max_written_ranges,
        });
        owner.defects = defects;
        let writers = (0..3)
            .map(|i| {
                let mut machine = Writer::new();
                machine.defects = writer_defects;
                SimWriter {
                    conn: i + 1,
                    machine,
                    alive: true,
                }
            })
            .collect();
        Sim {
            step: 0,
            rng,
            bound,
            owner,
            memory: (0..SLOTS)
                .map(|s| vec![s as u8; SLOT_LEN as usize])
                .collect(),
            last_writer: (0..SLOTS).map(|_| vec![None; SLOT_LEN as usize]).collect(),
            slot_region: vec![None; SLOTS as usize],
            regions: BTreeMap::new(),
            next_region: 1,
            writers,
            records: BTreeMap::new(),
            next_conn: 4,
            failed: BTreeSet::new(),
            dropping: BTreeSet::new(),
            to_owner: Vec::new(),
            seen: Vec::new(),
            to_writers: Vec::new(),
            receiving: BTreeMap::new(),
            owner_sends: BTreeMap::new(),
            now: Instant::now(),
            shut_down: false,
            closed: false,
            drained: false,
            stats: Stats::default(),
            log: verbose.then(VecDeque::new),
            landed: BTreeMap::new(),
            ended: BTreeMap::new(),
            list_limits,
            lists: BTreeMap::new(),
            next_list: 0,
            list_due: None,
            admitted: BTreeMap::new(),
            batches: BTreeMap::new(),
        }
    }

    fn note(&mut self, text: impl FnOnce() -> String) {
        if let Some(log) = &mut self.log {
            if log.len() == 40 {
                log.pop_front();
            }
            log.push_back(format!("step {}: {}", self.step, text()));
        }
    }

    fn run(&mut self) -> Checked {
        for step in 0..STEPS {
            self.step = step;
            self.random_step()?;
            self.take_completions()?;
            self.check_bounds()?;
            self.check_written()?;
        }
        self.step = STEPS;
        self.finish()
    }

    fn random_step(&mut self) -> Checked {
        match self.rng.below(100) {
            0..=12 => self.post(false),
            13..=16 => self.post(true),
            17..=19 => self.post_list(),
            20..=33 => self.deliver_request(),
            34 => self.drop_request(),
            35..=36 => self.duplicate(),
            37..=50 => self.progress_receive(),
            51..=58 => self.end_owner_send(),
            59..=68 => self.deliver_reply(),
            69..=76 => self.end_writer_send(),
            77 => self.forge_reply(),
            78 => self.fail_connection(false),
            79 => self.fail_connection(true),
            80..=82 => self.advance_clock(),
            83..=88 => self.register(),
            89..=94 => self.unmap(),
            95..=96 => self.reuse_memory(),
            97 if self.rng.chance(15) => self.shutdown(),
            99 => self.take_written(),
            98 if self.shut_down && self.rng.chance(20) => self.close_transport(),
            _ => Ok(()),
        }
    }

    // ----- the network and the owner -----

    fn deliver_request(&mut self) -> Checked {
        if self.to_owner.is_empty() {
            return Ok(());
        }
        let message = self
            .to_owner
            .swap_remove(self.rng.index(self.to_owner.len()));
        if let Some(origin) = message.origin {
            self.arrived(origin);
        }
        if message.list {
            return self.deliver_list(message);
        }
        let (request_id, expect) = self.expect(&message);
        self.owner.handle_write_request(
            message.conn,
            &message.header,
            message.payload.len() as u64,
        );
        let mut got = Expect::Drop;
        let mut replies = 0;
        while let Some(action) = self.owner.poll_action() {
            replies += 1;
            if replies > 1 && !matches!(action, Action::Acknowledge { .. }) {
                return Err(format!("a second action for one write: {action:?}"));
            }
            match action {
                Action::Receive {
                    endpoint,
                    receive,
                    request_id: id,
                    region,
                    address,
                    length,
                    payload_offset,
                } => {
                    if endpoint != message.conn || id != request_id || payload_offset != 0 {
                        return Err(format!(
                            "{action:?} for request {request_id} on {}",
                            message.conn
                        ));
                    }
                    let header = wire::decode_write_request(&message.header)
                        .map_err(|e| format!("received an undecodable write: {e}"))?;
                    if (region, address, length) != (header.region, header.address, header.length) {
                        return Err(format!("received {action:?} for {header:?}"));
                    }
                    got = Expect::Receive;
                    self.admitted.insert(message.conn, None);
                    if let Some(origin) = message.origin
                        && let Some(record) = self.records.get_mut(&origin)
                    {
                        record.receiving += 1;
                    }
                    self.receiving.insert(
                        receive,
                        Receiving {
                            conn: message.conn,
                            address,
                            bytes: message.payload.clone(),
                            written: 0,
                            origin: message.origin,
                            of: message.of,
                            doomed: false,
                            spoiled: BTreeSet::new(),
                            list: None,
                        },
                    );
                    self.stats.received += 1;
                }
                Action::Refuse {
                    endpoint,
                    send,
                    request_id: id,
                    refusal,
                } => {
                    if endpoint != message.conn || id != request_id {
                        return Err(format!(
                            "{action:?} for request {request_id} on {}",
                            message.conn
                        ));
                    }
                    got = Expect::Refuse(refusal);
                    if refusal == Refusal::AccessDenied {
                        self.stats.access_denied += 1;
                    }
                    self.stats.refused += 1;
                    self.reply(endpoint, send, OwnerSend::Refusal, &action);
                }
                Action::Acknowledge { endpoint, send, .. } => {
                    // Only with a defect: an acknowledgement at acceptance.
                    self.reply(endpoint, send, OwnerSend::WriteReply, &action);
                }
                other => return Err(format!("{other:?} in answer to a write")),
            }
        }
        if got == Expect::Drop {
            self.stats.dropped += 1;
        }
        self.note(|| {
            format!(
                "write {request_id} from {}: expected {expect:?}, got {got:?}",
                message.conn
            )
        });
        if got != expect {
            return Err(format!(
                "write {request_id} from {}: expected {expect:?}, the owner chose {got:?}",
                message.conn
            ));
        }
        self.remember(message);
        Ok(())
    }

    /// Keeps a delivered request, for the network to duplicate.
    fn remember(&mut self, message: Request) {
        self.seen.push(Request {
            origin: None,
            ..message
        });
        if self.seen.len() > 32 {
            self.seen.swap_remove(0);
        }
    }

    /// Queues the owner's reply `action` for its connection.
    fn reply(&mut self, conn: u64, send: SendId, kind: OwnerSend, action: &Action<u64>) {
        self.owner_sends.insert(send, (conn, kind));
        let header = action
            .reply_header()
            .map(ReplyHeader::Single)
            .or_else(|| action.list_reply_header().map(ReplyHeader::List));
        if let Some(header) = header {
            self.to_writers.push(ToWriter {
                conn,
                to: None,
                header,
                payload_length: 0,
                send: Some(send),
            });
        }
    }

    /// Places `conn` holds under the owner's bound of served replies: a
    /// single write's receive, a write list not answered one per reply it
    /// will send, and what each reply's send holds until it ended.
    fn places(&self, conn: u64) -> usize {
        self.receiving
            .values()
            .filter(|r| r.conn == conn && r.list.is_none())
            .count()
            + self
                .lists
                .values()
                .filter(|l| l.conn == conn)
                .map(|l| l.places)
                .sum::<usize>()
            + self
                .owner_sends
                .values()
                .filter(|&&(c, _)| c == conn)
                .map(|&(_, kind)| kind.places())
                .sum::<usize>()
    }

    /// How far past the bound `conn` may hold (invariant 6): a list is
    /// admitted while the connection holds fewer than the bound and then
    /// takes its places all at once, so only the list admitted last can
    /// lift it over, by the places it still holds but one.
    fn over_bound(&self, conn: u64) -> usize {
        match self.admitted.get(&conn) {
            Some(&Some(key)) => self.list_places(key).saturating_sub(1),
            _ => 0,
        }
    }

    /// Places the write list the simulation keys `key` holds: all its
    /// replies' while it waits for receives, then each reply's until its
    /// send ended.
    fn list_places(&self, key: u64) -> usize {
        self.lists.get(&key).map_or(0, |l| l.places)
            + self
                .owner_sends
                .values()
                .filter(|&&(_, kind)| kind == OwnerSend::ListReply(key))
                .count()
    }

    /// Refusals `conn` holds under the owner's bound of refusals.
    fn refusals(&self, conn: u64) -> usize {
        self.owner_sends
            .values()
            .filter(|&&(c, kind)| c == conn && kind == OwnerSend::Refusal)
            .count()
    }

    /// The model: what the owner must do with `message`.
    fn expect(&self, message: &Request) -> (u64, Expect) {
        let conn = message.conn;
        let places = self.places(conn);
        let refusals = self.refusals(conn);
        let (request_id, verdict) = match wire::decode_write_request(&message.header) {
            Err(_) => (
                wire::request_id_of_malformed(&message.header),
                Err(Refusal::Malformed),
            ),
            Ok(write) => (
                write.request_id,
                self.verdict(&write, message.payload.len() as u64, places),
            ),
        };
        let expect = match verdict {
            _ if self.closed || self.dropping.contains(&conn) => Expect::Drop,
            Ok(()) => Expect::Receive,
            Err(_) if refusals >= self.bound as usize => Expect::Drop,
            Err(refusal) => Expect::Refuse(refusal),
        };
        (request_id, expect)
    }

    fn verdict(
        &self,
        write: &crate::served::Write,
        payload_length: u64,
        places: usize,
    ) -> Result<(), Refusal> {
        let region = self
            .regions
            .get(&write.region)
            .filter(|r| r.state != State::Unmapped)
            .ok_or(Refusal::RegionUnknown)?;
        if region.capability != write.capability {
            return Err(Refusal::CapabilityMismatch);
        }
        if !region.access.allows_write() {
            return Err(Refusal::AccessDenied);
        }
        if region.state == State::Unmapping {
            return Err(Refusal::Deregistering);
        }
        let start = u128::from(write.address);
        let end = start + u128::from(write.length);
        if write.length == 0
            || start < u128::from(region.base)
            || end > u128::from(region.base) + u128::from(region.len)
        {
            return Err(Refusal::OutOfRange);
        }
        if payload_length != write.length {
            return Err(Refusal::Malformed);
        }
        if places >= self.bound as usize {
            return Err(Refusal::Busy);
        }
        Ok(())
    }

    fn drop_request(&mut self) -> Checked {
        if self.to_owner.is_empty() {
            return Ok(());
        }
        let message = self
            .to_owner
            .swap_remove(self.rng.index(self.to_owner.len()));
        if let Some(origin) = message.origin {
            self.arrived(origin);
        }
        self.note(|| format!("a request on {} is lost", message.conn));
        Ok(())
    }

    fn duplicate(&mut self) -> Checked {
        if !self.seen.is_empty() {
            let message = self.seen[self.rng.index(self.seen.len())].clone();
            self.to_owner.push(message);
        }
        Ok(())
    }

    /// The transport writes a few more bytes of a receive into memory, or
    /// ends it.
    fn progress_receive(&mut self) -> Checked {
        let Some(&id) = self
            .receiving
            .keys()
            .nth(self.rng.index(self.receiving.len().max(1)))
        else {
            return Ok(());
        };
        let fail = self.receiving[&id].doomed || self.rng.chance(4);
        if fail {
            return self.end_receive(id, false);
        }
        let (address, chunk, from) = {
            let receive = &self.receiving[&id];
            let left = receive.bytes.len() - receive.written;
            let chunk = 1 + self.rng.index(left.max(1));
            (receive.address, chunk.min(left), receive.written)
        };
        for i in from..from + chunk {
            let byte = self.receiving[&id].bytes[i];
            self.write_byte(address + i as u64, byte, id)?;
        }
        let receive = self.receiving.get_mut(&id).ok_or("gone")?;
        receive.written += chunk;
        if receive.written == receive.bytes.len() {
            self.end_receive(id, true)?;
        }
        Ok(())
    }

    /// Invariant 1, at the byte.
    fn write_byte(&mut self, address: u64, byte: u8, by: ReceiveId) -> Checked {
        let region = self
            .regions
            .values()
            .find(|r| r.state != State::Unmapped && address >= r.base && address < r.base + r.len);
        match region {
            Some(r) if r.access.allows_write() => {}
            Some(r) => {
                return Err(format!(
                    "a byte written at {address:#x} into a registration for {}",
                    r.access
                ));
            }
            None => {
                return Err(format!(
                    "a byte written at {address:#x}, in no live registration"
                ));
            }
        }
        let slot = (address / SLOT_STRIDE - 1) as usize;
        let offset = (address % SLOT_STRIDE) as usize;
        self.memory[slot][offset] = byte;
        self.last_writer[slot][offset] = Some(by);
        self.stats.bytes_written += 1;
        Ok(())
    }

    fn end_receive(&mut self, id: ReceiveId, completed: bool) -> Checked {
        let receive = self.receiving.remove(&id).ok_or("no such receive")?;
        if completed {
            // Invariant 4's ground: the range holds the bytes, but where a
            // later receive overwrote them.
            for (i, &byte) in receive.bytes.iter().enumerate() {
                let address = receive.address + i as u64;
                let slot = (address / SLOT_STRIDE - 1) as usize;
                let offset = (address % SLOT_STRIDE) as usize;
                if self.last_writer[slot][offset] == Some(id) && self.memory[slot][offset] != byte {
                    return Err(format!("receive {id:?} left a wrong byte at {address:#x}"));
                }
            }
        } else {
            self.stats.receives_failed += 1;
        }
        if let Some(origin) = receive.origin
            && let Some(record) = self.records.get_mut(&origin)
        {
            record.receiving -= 1;
        }
        if let Some(of) = receive.of
            && let Some(record) = self.records.get_mut(&of)
        {
            record.received |= completed;
        }
        self.note(|| format!("receive {id:?} ended (completed: {completed})"));
        self.model_receive_end(id, &receive, completed);
        if let Some(entry) = receive.list {
            self.end_list_entry(entry, completed);
        }
        let known = if completed {
            self.owner.receive_completed(id)
        } else {
            self.owner.receive_failed(id)
        };
        if !known {
            return Err(format!("the owner did not know its receive {id:?}"));
        }
        self.take_owner_actions()?;
        if let Some(due) = self.list_due.take() {
            return Err(format!(
                "a write list on {} was answered in {} of its {} replies once its last \
                 receive ended: {:?}",
                due.list.conn, due.given, due.list.places, due.list.replies
            ));
        }
        self.forget_dropping(receive.conn);
        Ok(())
    }

    fn end_owner_send(&mut self) -> Checked {
        let Some(&send) = self
            .owner_sends
            .keys()
            .nth(self.rng.index(self.owner_sends.len().max(1)))
        else {
            return Ok(());
        };
        let complete = self.rng.chance(85);
        self.end_owner_send_of(send, complete)
    }

    fn end_owner_send_of(&mut self, send: SendId, complete: bool) -> Checked {
        let (conn, _) = self.owner_sends.remove(&send).ok_or("no such send")?;
        let complete = complete && !self.failed.contains(&conn);
        if !complete {
            self.to_writers.retain(|m| m.send != Some(send));
        }
        self.forget_dropping(conn);
        let known = if complete {
            self.owner.send_completed(send)
        } else {
            self.owner.send_failed(send)
        };
        if !known {
            return Err(format!("the owner did not know its send {send:?}"));
        }
        self.take_owner_actions()
    }

    /// A failed connection the owner has nothing of any more: it forgot it.
    fn forget_dropping(&mut self, conn: u64) {
        let busy = self.owner_sends.values().any(|&(c, _)| c == conn)
            || self.receiving.values().any(|r| r.conn == conn);
        if !busy {
            self.dropping.remove(&conn);
        }
    }

    /// A connection fails; `kill` also kills its writer (which is then
    /// never answered).
    fn fail_connection(&mut self, kill: bool) -> Checked {
        let at = self.rng.index(self.writers.len());
        if !self.writers[at].alive {
            return Ok(());
        }
        let conn = self.writers[at].conn;
        self.note(|| format!("connection {conn} fails (writer {at} killed: {kill})"));
        self.failed.insert(conn);
        let busy = self.owner_sends.values().any(|&(c, _)| c == conn)
            || self.receiving.values().any(|r| r.conn == conn);
        if busy {
            self.dropping.insert(conn);
        }
        self.owner.endpoint_failed(conn);
        // What travels on it is lost; what is received from it fails.
        let lost: Vec<Origin> = self
            .to_owner
            .iter()
            .filter(|m| m.conn == conn)
            .filter_map(|m| m.origin)
            .collect();
        self.to_owner.retain(|m| m.conn != conn);
        self.seen.retain(|m| m.conn != conn);
        self.to_writers.retain(|m| m.conn != conn);
        for origin in lost {
            self.arrived(origin);
        }
        for receive in self.receiving.values_mut() {
            if receive.conn == conn {
                receive.doomed = true;
            }
        }
        for record in self.records.values_mut() {
            if record.conn == conn {
                record.stopping = true;
            }
        }
        let fresh = self.fresh_conn();
        let writer = &mut self.writers[at];
        if kill {
            writer.alive = false;
            for (origin, record) in self.records.iter_mut() {
                if origin.0 == at {
                    // Nobody waits for these any more.
                    record.answered = true;
                }
            }
        } else {
            writer
                .machine
                .endpoint_failed(conn, RdmaError::backend("connection failed"));
            writer.conn = fresh;
        }
        Ok(())
    }

    fn register(&mut self) -> Checked {
        if self.shut_down {
            return Ok(());
        }
        let free: Vec<usize> = (0..SLOTS as usize)
            .filter(|&s| self.slot_region[s].is_none())
            .collect();
        if free.is_empty() {
            return Ok(());
        }
        let slot = free[self.rng.index(free.len())];
        let offset = self.rng.below(SLOT_LEN / 2);
        let len = 1 + self.rng.below(SLOT_LEN - offset);
        let base = SLOT_STRIDE * (slot as u64 + 1) + offset;
        let access = match self.rng.below(3) {
            0 => Access::Read,
            1 => Access::Write,
            _ => Access::ReadWrite,
        };
        let id = self.next_region;
        self.next_region += 1;
        let capability = capability(&mut self.rng);
        self.owner
            .register_with_access(id, capability, base, len, access)
            .map_err(|e| format!("register refused: {e}"))?;
        self.slot_region[slot] = Some(id);
        self.last_writer[slot].fill(None);
        self.landed.insert(id, vec![false; len as usize]);
        self.regions.insert(
            id,
            Region {
                slot,
                capability,
                base,
                len,
                access,
                state: State::Live,
            },
        );
        self.note(|| format!("region {id}: {base:#x}+{len} for {access}"));
        Ok(())
    }

    fn unmap(&mut self) -> Checked {
        let ids: Vec<u64> = self
            .regions
            .iter()
            .filter(|(_, r)| r.state != State::Unmapped)
            .map(|(&id, _)| id)
            .collect();
        if ids.is_empty() {
            return Ok(());
        }
        let id = ids[self.rng.index(ids.len())];
        self.owner.unmap(id);
        let waits = self.receives_into(id);
        let region = self.regions.get_mut(&id).ok_or("unknown region")?;
        if region.state == State::Live {
            region.state = State::Unmapping;
            if waits {
                self.stats.unmaps_waited += 1;
            }
        }
        self.note(|| format!("unmap {id}"));
        self.take_owner_actions()
    }

    fn receives_into(&self, id: u64) -> bool {
        let Some(region) = self.regions.get(&id) else {
            return false;
        };
        self.receiving
            .values()
            .any(|r| r.address >= region.base && r.address < region.base + region.len)
    }

    /// The program writes memory whose registration is gone.
    fn reuse_memory(&mut self) -> Checked {
        let slot = self.rng.index(SLOTS as usize);
        if self.slot_region[slot].is_none() {
            let byte = self.rng.next_u64() as u8;
            self.memory[slot].fill(byte);
            self.last_writer[slot].fill(None);
        }
        Ok(())
    }

    fn shutdown(&mut self) -> Checked {
        if self.shut_down {
            return Ok(());
        }
        self.shut_down = true;
        self.note(|| "shutdown".into());
        for region in self.regions.values_mut() {
            if region.state == State::Live {
                region.state = State::Unmapping;
            }
        }
        self.owner.shutdown();
        self.take_owner_actions()
    }

    /// The owner's transport is destroyed: its receives write no more,
    /// its sends end, and every writer's connection to it fails.
    fn close_transport(&mut self) -> Checked {
        self.note(|| "transport closed".into());
        self.closed = true;
        let ended = std::mem::take(&mut self.receiving);
        for (&id, receive) in &ended {
            self.model_receive_end(id, receive, false);
        }
        let receives: Vec<Origin> = ended.into_values().filter_map(|r| r.origin).collect();
        for origin in receives {
            if let Some(record) = self.records.get_mut(&origin) {
                record.receiving -= 1;
            }
        }
        self.owner_sends.clear();
        self.to_writers.retain(|m| m.send.is_none());
        // Lists with receives running are never answered now.
        self.stats.lists_unanswered += self.lists.len() as u64;
        self.lists.clear();
        self.owner.transport_closed();
        self.take_owner_actions()?;
        for at in 0..self.writers.len() {
            if self.writers[at].alive {
                self.fail_connection_of(at)?;
            }
        }
        Ok(())
    }

    fn fail_connection_of(&mut self, at: usize) -> Checked {
        let conn = self.writers[at].conn;
        self.failed.insert(conn);
        let lost: Vec<Origin> = self
            .to_owner
            .iter()
            .filter(|m| m.conn == conn)
            .filter_map(|m| m.origin)
            .collect();
        self.to_owner.retain(|m| m.conn != conn);
        for origin in lost {
            self.arrived(origin);
        }
        for record in self.records.values_mut() {
            if record.conn == conn {
                record.stopping = true;
            }
        }
        self.writers[at]
            .machine
            .endpoint_failed(conn, RdmaError::backend("the owner is gone"));
        Ok(())
    }

    /// Actions outside a request: replies after a receive, finished
    /// unmaps, the drained report.
    fn take_owner_actions(&mut self) -> Checked {
        while let Some(action) = self.owner.poll_action() {
            match action {
                Action::Acknowledge { endpoint, send, .. } => {
                    self.reply(endpoint, send, OwnerSend::WriteReply, &action);
                }
                Action::AcknowledgeList { .. } => self.list_answered(&action)?,
                Action::Refuse {
                    endpoint,
                    send,
                    refusal: Refusal::ReceiveFailed,
                    ..
                } => {
                    self.reply(endpoint, send, OwnerSend::WriteReply, &action);
                }
                Action::Unmapped { region } => {
                    if self.receives_into(region) {
                        return Err(format!(
                            "unmap of region {region} finished while bytes are still received into it"
                        ));
                    }
                    let entry = self
                        .regions
                        .get_mut(&region)
                        .ok_or_else(|| format!("unmapped unknown region {region}"))?;
                    if entry.state != State::Unmapping {
                        return Err(format!("unmapped a {:?} region {region}", entry.state));
                    }
                    entry.state = State::Unmapped;
                    self.slot_region[entry.slot] = None;
                    self.landed.remove(&region);
                    if self.owner.take_written(region).is_some() {
                        return Err(format!("region {region}'s written log outlived its unmap"));
                    }
                    self.note(|| format!("region {region} unmapped"));
                }
                Action::Drained => {
                    let open = self.regions.values().any(|r| r.state != State::Unmapped);
                    if !self.shut_down || self.drained || open {
                        return Err("drained reported early or twice".into());
                    }
                    self.drained = true;
                }
                other => return Err(format!("{other:?} with no request to answer")),
            }
        }
        Ok(())
    }

    /// Invariant 6.
    fn check_bounds(&self) -> Checked {
        let conns: BTreeSet<u64> = self
            .receiving
            .values()
            .map(|r| r.conn)
            .chain(self.owner_sends.values().map(|&(c, _)| c))
            .collect();
        for conn in conns {
            let over = self.over_bound(conn);
            let load = self.owner.load(conn);
            if load.served as usize > self.bound as usize + over || load.refusals > self.bound {
                return Err(format!(
                    "connection {conn} holds {load:?}, bound {} (+{over} of the list admitted last)",
                    self.bound
                ));
            }
            // What the transport holds for it, as the model counts it.
            let places = self.places(conn);
            if places > self.bound as usize + over {
                return Err(format!(
                    "connection {conn} holds {places} receives and replies, bound {} \
                     (+{over} of the list admitted last)",
                    self.bound
                ));
            }
        }
        let mut unanswered = vec![0; self.writers.len()];
        for (origin, record) in &self.records {
            if !record.answered {
                unanswered[origin.0] += 1;
            }
        }
        for (at, writer) in self.writers.iter().enumerate() {
            if !writer.alive {
                continue;
            }
            let open = unanswered[at];
            if writer.machine.in_flight() != open {
                return Err(format!(
                    "writer {at} keeps {} writes, {open} are unanswered",
                    writer.machine.in_flight()
                ));
            }
        }
        Ok(())
    }

    /// Delivers and ends everything, passes every deadline, then checks
    /// invariant 7.
    fn finish(&mut self) -> Checked {
        for _ in 0..10_000 {
            let busy = !self.to_owner.is_empty()
                || !self.receiving.is_empty()
                || !self.owner_sends.is_empty()
                || !self.to_writers.is_empty()
                || !self.ready_sends().is_empty();
            if !busy {
                break;
            }
            match self.rng.below(5) {
                0 => self.deliver_request()?,
                1 => self.progress_receive()?,
                2 => self.end_owner_send()?,
                3 => self.deliver_reply()?,
                _ => self.end_writer_send()?,
            }
            self.take_completions()?;
            self.check_bounds()?;
            self.check_written()?;
        }
        self.now += Duration::from_secs(3600);
        self.expire()?;
        // Sends the deadlines stopped end now.
        for origin in self.ready_sends() {
            self.end_send_of(origin)?;
        }
        self.take_completions()?;
        self.check_bounds()?;
        if let Some((origin, record)) = self.records.iter().find(|(_, r)| !r.answered) {
            return Err(format!("write {origin:?} never answered: {record:?}"));
        }
        if let Some(list) = self.lists.values().next() {
            return Err(format!("a write list with no receive running: {list:?}"));
        }
        if let Some((id, _)) = self
            .regions
            .iter()
            .find(|(_, r)| r.state == State::Unmapping)
        {
            return Err(format!("the unmap of region {id} never finished"));
        }
        if self.owner.endpoints() != 0 {
            return Err(format!(
                "{} endpoints left with nothing in flight",
                self.owner.endpoints()
            ));
        }
        self.check_written()?;
        self.take_written()?;
        self.shutdown()?;
        if !self.closed {
            self.close_transport()?;
        }
        if !self.drained {
            return Err("shutdown never drained".into());
        }
        Ok(())
    }
}

/// Runs `seed` with the owner's and the writers' `defects` switched on.
pub(crate) fn run_with(
    seed: u64,
    defects: Defects,
    writer_defects: writer::Defects,
) -> Result<Stats, Violation> {
    let mut sim = Sim::new(seed, defects, writer_defects, false);
    match sim.run() {
        Ok(()) => Ok(sim.stats),
        Err(message) => Err(Violation {
            seed,
            step: sim.step,
            message,
        }),
    }
}

/// Replays `seed` and returns its last steps and outcome.
pub(crate) fn replay(seed: u64, defects: Defects, writer_defects: writer::Defects) -> String {
    let mut sim = Sim::new(seed, defects, writer_defects, true);
    let outcome = sim.run();
    let mut out = String::new();
    for line in sim.log.iter().flatten() {
        let _ = writeln!(out, "{line}");
    }
    let _ = match outcome {
        Ok(()) => writeln!(out, "seed {seed}: clean ({:?})", sim.stats),
        Err(message) => writeln!(out, "seed {seed} step {}: {message}", sim.step),
    };
    out
}

#[cfg(test)]
mod tests;
