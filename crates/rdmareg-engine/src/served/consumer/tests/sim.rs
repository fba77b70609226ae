//! A deterministic simulation of the consumer state machine against
//! honest, slow, failing and hostile owners.
//!
//! One `u64` seed drives everything: which reads start (waiting for a reply
//! header, or with a receive posted into the destination first), when replies are
//! delivered (reordered, duplicated, delayed past deadlines, never), which
//! owners refuse or send the wrong number of bytes (more or fewer than asked,
//! under a header that tells the truth or lies), when a third peer forges
//! replies or refusals with guessed request ids, how long the transport takes to write a payload and
//! whether it fails half way, when endpoints fail, when the clock jumps past
//! deadlines, and when shutdown begins. Memory is simulated: every
//! destination records each byte write with the step that made it.
//!
//! After every step the promises are checked as invariants:
//!
//! - every read is completed at most once, and by the end exactly once;
//! - no byte is written into a destination after its read was completed,
//!   nor past its end;
//! - an `Ok` destination holds exactly the bytes its own owner served for
//!   that read (never a third peer's, never a partial write);
//! - no read is completed with a third peer's refusal;
//! - the machine keeps no state for completed reads.
//!
//! A failure names its seed and step, and the same seed replays it exactly:
//! `cargo xtask sim --seed S`.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use rdmareg_core::RdmaError;

use super::super::{
    Completion, Consumer, Defects, ReadId, Reply, ReplyOutcome, ReplyVerdict, TimeoutAction,
};

/// Honest owners are endpoints `0..OWNERS`; the forger is `FORGER`.
const OWNERS: u32 = 3;
const FORGER: u32 = 99;
/// Steps per seed.
const STEPS: u64 = 300;
/// Reads in flight at most (the simulation's own bound).
const MAX_READS: usize = 24;
/// Byte the forger writes.
const FORGED: u8 = 0x66;
/// Byte a fresh destination holds.
const UNWRITTEN: u8 = 0xEE;
/// What the forger's refusals say.
const FORGED_REFUSAL: &str = "forged refusal";

use crate::sim_support::{Rng, seeds};

/// A message on its way to the consumer.
#[derive(Debug, Clone)]
struct Message {
    from: u32,
    reply: Reply,
    payload: Vec<u8>,
}

/// A payload the transport is writing into a destination.
#[derive(Debug)]
struct Transfer {
    read: ReadId,
    from: u32,
    payload: Vec<u8>,
    /// Bytes written so far.
    written: usize,
    /// Asked to stop (deadline) or its endpoint failed: it ends in error.
    doomed: bool,
}

/// A receive posted into a destination before its request went out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Receive {
    /// Not that kind of read.
    None,
    /// Posted: a message with the read's id is written into it.
    Posted,
    /// Cancel asked; it may still match a message before it ends.
    Cancelling,
    /// Ended.
    Ended,
}

/// One read as the simulation sees it.
#[derive(Debug)]
struct SimRead {
    owner: u32,
    receive: Receive,
    destination: Vec<u8>,
    /// What the owner served for this read, once it did.
    served: Option<Vec<u8>>,
    completed_at: Option<u64>,
    outcome: Option<Result<(), RdmaError>>,
    /// A write past the destination's end, when one happened.
    overrun_at: Option<u64>,
}

/// A broken promise: seed, step and what happened.
#[derive(Debug)]
pub(super) struct Failure {
    pub(super) seed: u64,
    pub(super) step: u64,
    pub(super) what: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "seed {} step {}: {} (replay: cargo xtask sim --seed {})",
            self.seed, self.step, self.what, self.seed
        )
    }
}

/// What one seed did, for coverage checks.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Summary {
    pub(super) reads: u64,
    pub(super) ok: u64,
    pub(super) timeouts: u64,
    pub(super) forged_dropped: u64,
    pub(super) stopped_transfers: u64,
    pub(super) posted_receives_ok: u64,
    /// Served replies of the wrong length the machine refused.
    pub(super) wrong_lengths_refused: u64,
}

struct Sim {
    seed: u64,
    rng: Rng,
    start: Instant,
    clock_ms: u64,
    step: u64,
    consumer: Consumer<u32>,
    reads: BTreeMap<ReadId, SimRead>,
    network: Vec<Message>,
    transfers: Vec<Transfer>,
    /// Owners whose endpoint failed: they send nothing more.
    failed: Vec<u32>,
    /// Per owner: how it misbehaves (percent of replies).
    wrong_length: HashMap<u32, u64>,
    refuses: HashMap<u32, u64>,
    silent: HashMap<u32, u64>,
    closing: bool,
    summary: Summary,
}

/// Runs one seed; `defects` brings back a historical defect.
pub(super) fn run(seed: u64, defects: Defects) -> Result<Summary, Failure> {
    let mut rng = Rng::new(seed);
    let mut sim = Sim {
        seed,
        start: Instant::now(),
        clock_ms: 0,
        step: 0,
        consumer: Consumer::new(),
        reads: BTreeMap::new(),
        network: Vec::new(),
        transfers: Vec::new(),
        failed: Vec::new(),
        wrong_length: (0..OWNERS).map(|o| (o, rng.below(3) * 5)).collect(),
        refuses: (0..OWNERS).map(|o| (o, rng.below(3) * 5)).collect(),
        silent: (0..OWNERS).map(|o| (o, rng.below(3) * 5)).collect(),
        closing: false,
        summary: Summary::default(),
        rng,
    };
    sim.consumer.defects = defects;
    for _ in 0..STEPS {
        sim.step += 1;
        sim.one_step()?;
        sim.collect_completions()?;
    }
    sim.drain()?;
    Ok(sim.summary)
}

impl Sim {
    fn now(&self) -> Instant {
        self.start + Duration::from_millis(self.clock_ms)
    }

    fn fail(&self, what: String) -> Failure {
        Failure {
            seed: self.seed,
            step: self.step,
            what,
        }
    }

    fn one_step(&mut self) -> Result<(), Failure> {
        match self.rng.below(100) {
            0..=24 => self.start_read(),
            25..=49 => self.deliver(),
            50..=69 => self.progress_transfer(),
            70..=79 => {
                self.clock_ms += 1 + self.rng.below(8);
                self.expire();
            }
            80..=82 => self.duplicate(),
            83..=84 => self.end_a_cancel(),
            85..=91 => self.forge(),
            92..=94 => self.fail_endpoint(),
            95 if self.rng.chance(20) => {
                self.closing = true;
                self.consumer.shutdown();
            }
            _ => self.deliver(),
        }
        Ok(())
    }

    fn start_read(&mut self) {
        if self.closing || self.consumer.in_flight() >= MAX_READS {
            return;
        }
        let owner = self.rng.below(u64::from(OWNERS)) as u32;
        let length = 1 + self.rng.below(32);
        let timeout = Duration::from_millis(2 + self.rng.below(40));
        let receive_first = self.rng.chance(30);
        let deadline = self.now() + timeout;
        let read = if receive_first {
            self.consumer.start_receiving(owner, length, deadline, ())
        } else {
            self.consumer.start(owner, length, deadline, ())
        };
        self.summary.reads += 1;
        self.reads.insert(
            read,
            SimRead {
                owner,
                receive: if receive_first {
                    Receive::Posted
                } else {
                    Receive::None
                },
                destination: vec![UNWRITTEN; length as usize],
                served: None,
                completed_at: None,
                outcome: None,
                overrun_at: None,
            },
        );
        if self.failed.contains(&owner) {
            let cancel = self
                .consumer
                .request_failed(read, RdmaError::backend("endpoint failed"));
            if cancel {
                self.cancel_receive(read);
            }
            return;
        }
        // The owner's reply, queued now and delivered in any order later.
        if self.rng.chance(self.silent[&owner]) {
            return;
        }
        let reply = if self.rng.chance(self.refuses[&owner]) {
            Message {
                from: owner,
                reply: Reply {
                    request_id: read.0,
                    outcome: ReplyOutcome::Refused(RdmaError::RegionNotFound),
                },
                payload: Vec::new(),
            }
        } else {
            // How many bytes follow, and how many the header announces.
            let (payload_length, header_length) = if self.rng.chance(self.wrong_length[&owner]) {
                let more = length + 1 + self.rng.below(4);
                let fewer = self.rng.below(length);
                match self.rng.below(4) {
                    0 => (more, more),
                    1 => (fewer, fewer),
                    // The header lies: it announces what was asked.
                    2 => (more, length),
                    _ => (fewer, length),
                }
            } else {
                (length, length)
            };
            // The owner's bytes: distinct per read, never the forger's.
            let payload: Vec<u8> = (0..payload_length)
                .map(|i| (read.0.wrapping_mul(31).wrapping_add(i) % 200) as u8)
                .collect();
            if let Some(sim_read) = self.reads.get_mut(&read) {
                sim_read.served = Some(payload.clone());
            }
            Message {
                from: owner,
                reply: Reply {
                    request_id: read.0,
                    outcome: ReplyOutcome::Served {
                        length: header_length,
                    },
                },
                payload,
            }
        };
        self.network.push(reply);
    }

    fn deliver(&mut self) {
        if self.network.is_empty() {
            return;
        }
        let at = self.rng.below(self.network.len() as u64) as usize;
        let message = self.network.swap_remove(at);
        if self.failed.contains(&message.from) {
            return;
        }
        let read = ReadId(message.reply.request_id);
        let receive = self.reads.get(&read).map_or(Receive::None, |r| r.receive);
        if receive != Receive::None {
            self.receive_into(read, receive, message);
            return;
        }
        let verdict =
            self.consumer
                .handle_reply(message.from, &message.reply, message.payload.len() as u64);
        match verdict {
            ReplyVerdict::Write(read) => {
                let transfer = Transfer {
                    read,
                    from: message.from,
                    payload: message.payload,
                    written: 0,
                    doomed: false,
                };
                if self.rng.chance(40) {
                    // Eager: copied at once, then reported.
                    let mut transfer = transfer;
                    let length = transfer.payload.len();
                    self.write(&mut transfer, length);
                    self.consumer.released(read, Ok(()));
                } else {
                    self.transfers.push(transfer);
                }
            }
            ReplyVerdict::Drop(_) if message.from == FORGER => self.summary.forged_dropped += 1,
            ReplyVerdict::Refused(_)
                if matches!(message.reply.outcome, ReplyOutcome::Served { .. }) =>
            {
                self.summary.wrong_lengths_refused += 1;
            }
            ReplyVerdict::Drop(_) | ReplyVerdict::Refused(_) => {}
        }
    }

    /// A message matched by a posted receive: the transport writes it
    /// straight into the destination (as much as fits), then the receive
    /// ends; the driver checks the length it reports.
    fn receive_into(&mut self, read: ReadId, receive: Receive, message: Message) {
        if receive == Receive::Ended {
            return;
        }
        if let Some(sim_read) = self.reads.get_mut(&read) {
            sim_read.receive = Receive::Ended;
        }
        let result = match message.reply.outcome {
            ReplyOutcome::Refused(error) => Err(error),
            ReplyOutcome::Served { .. } => {
                let mut transfer = Transfer {
                    read,
                    from: message.from,
                    payload: message.payload,
                    written: 0,
                    doomed: false,
                };
                // A posted receive is bounded by its buffer: the transport
                // writes no more than fits.
                let length = transfer.payload.len();
                let room = self.reads.get(&read).map_or(0, |r| r.destination.len());
                self.write(&mut transfer, length.min(room));
                let fits = self
                    .reads
                    .get(&read)
                    .is_some_and(|r| r.destination.len() == length);
                if fits {
                    Ok(())
                } else {
                    Err(RdmaError::backend("received the wrong length"))
                }
            }
        };
        self.consumer.released(read, result);
    }

    /// Asks the transport to give a posted receive back.
    fn cancel_receive(&mut self, read: ReadId) {
        if let Some(sim_read) = self.reads.get_mut(&read) {
            if sim_read.receive == Receive::Posted {
                sim_read.receive = Receive::Cancelling;
            }
        }
    }

    /// The transport gives back one receive whose cancel was asked.
    fn end_a_cancel(&mut self) {
        let cancelling: Vec<ReadId> = self
            .reads
            .iter()
            .filter(|(_, r)| r.receive == Receive::Cancelling)
            .map(|(&read, _)| read)
            .collect();
        if cancelling.is_empty() {
            return;
        }
        let read = cancelling[self.rng.below(cancelling.len() as u64) as usize];
        if let Some(sim_read) = self.reads.get_mut(&read) {
            sim_read.receive = Receive::Ended;
        }
        self.consumer
            .released(read, Err(RdmaError::backend("receive cancelled")));
    }

    /// Writes the next `bytes` of a transfer's payload into its destination,
    /// recording a violation if the read was completed already or the write
    /// runs past the destination's end (a transport that does not check a
    /// receive's size).
    fn write(&mut self, transfer: &mut Transfer, bytes: usize) {
        let end = (transfer.written + bytes).min(transfer.payload.len());
        if let Some(read) = self.reads.get_mut(&transfer.read) {
            if end > read.destination.len() && read.overrun_at.is_none() {
                read.overrun_at = Some(self.step);
            }
            let end = end.min(read.destination.len());
            if transfer.written < end {
                read.destination[transfer.written..end]
                    .copy_from_slice(&transfer.payload[transfer.written..end]);
                if read.completed_at.is_some() {
                    read.outcome = Some(Err(RdmaError::backend(format!(
                        "written at step {} after its completion",
                        self.step
                    ))));
                    read.completed_at = Some(u64::MAX);
                }
            }
        }
        transfer.written = end;
    }

    fn progress_transfer(&mut self) {
        if self.transfers.is_empty() {
            return;
        }
        let at = self.rng.below(self.transfers.len() as u64) as usize;
        let mut transfer = self.transfers.swap_remove(at);
        let chunk = 1 + self.rng.below(16) as usize;
        if transfer.doomed || self.rng.chance(3) {
            // Stopped or failed: maybe a few more bytes, then an error.
            let partial = self.rng.below(chunk as u64) as usize;
            self.write(&mut transfer, partial);
            self.consumer
                .released(transfer.read, Err(RdmaError::backend("receive failed")));
            return;
        }
        self.write(&mut transfer, chunk);
        if transfer.written >= transfer.payload.len() {
            self.consumer.released(transfer.read, Ok(()));
        } else {
            self.transfers.push(transfer);
        }
    }

    fn expire(&mut self) {
        for action in self.consumer.handle_timeout(self.now()) {
            let TimeoutAction::StopTransfer { read, .. } = action;
            self.summary.stopped_transfers += 1;
            self.cancel_receive(read);
            for transfer in &mut self.transfers {
                if transfer.read == read {
                    transfer.doomed = true;
                }
            }
        }
    }

    fn duplicate(&mut self) {
        if self.network.is_empty() {
            return;
        }
        let at = self.rng.below(self.network.len() as u64) as usize;
        let copy = self.network[at].clone();
        self.network.push(copy);
    }

    /// A third peer sends a reply with a guessed request id and the right
    /// length, or a refusal. (Not to reads with a posted receive: a
    /// transport that matches receives by id alone needs ids no peer can
    /// guess, which is the driver's to provide.)
    fn forge(&mut self) {
        let Some((&read, sim_read)) = self
            .reads
            .range(..)
            .nth(self.rng.below(self.reads.len().max(1) as u64) as usize)
        else {
            return;
        };
        if sim_read.receive != Receive::None {
            return;
        }
        let length = sim_read.destination.len();
        let (outcome, payload) = if self.rng.chance(30) {
            (
                ReplyOutcome::Refused(RdmaError::backend(FORGED_REFUSAL)),
                Vec::new(),
            )
        } else {
            (
                ReplyOutcome::Served {
                    length: length as u64,
                },
                vec![FORGED; length],
            )
        };
        self.network.push(Message {
            from: FORGER,
            reply: Reply {
                request_id: read.0,
                outcome,
            },
            payload,
        });
    }

    fn fail_endpoint(&mut self) {
        let owner = self.rng.below(u64::from(OWNERS)) as u32;
        if self.failed.contains(&owner) {
            return;
        }
        self.failed.push(owner);
        let holding = self
            .consumer
            .endpoint_failed(owner, RdmaError::backend("endpoint failed"));
        for read in holding {
            self.cancel_receive(read);
        }
        for transfer in &mut self.transfers {
            if transfer.from == owner {
                transfer.doomed = true;
            }
        }
    }

    /// Takes the machine's completions and checks each.
    fn collect_completions(&mut self) -> Result<(), Failure> {
        while let Some(Completion { read, outcome, .. }) = self.consumer.poll_completion() {
            let step = self.step;
            let Some(sim_read) = self.reads.get_mut(&read) else {
                return Err(self.fail(format!("{read:?} completed but never started")));
            };
            if sim_read.completed_at.is_some() {
                return Err(self.fail(format!("{read:?} completed twice")));
            }
            sim_read.completed_at = Some(step);
            if outcome.is_ok() {
                self.summary.ok += 1;
                if sim_read.receive != Receive::None {
                    self.summary.posted_receives_ok += 1;
                }
            }
            if outcome == Err(RdmaError::Timeout) {
                self.summary.timeouts += 1;
            }
            sim_read.outcome = Some(outcome);
        }
        self.check()
    }

    fn check(&self) -> Result<(), Failure> {
        for (read, sim_read) in &self.reads {
            if let Some(step) = sim_read.overrun_at {
                return Err(self.fail(format!(
                    "{read:?} was written past its destination's end at step {step}"
                )));
            }
            if let Some(Err(RdmaError::Backend(text))) = &sim_read.outcome {
                if text == FORGED_REFUSAL {
                    return Err(
                        self.fail(format!("{read:?} completed with a third peer's refusal"))
                    );
                }
            }
            if sim_read.completed_at == Some(u64::MAX) {
                return Err(self.fail(format!(
                    "a byte was written into {read:?} after its completion ({:?})",
                    sim_read.outcome
                )));
            }
            if let Some(Ok(())) = &sim_read.outcome {
                let expected = sim_read.served.as_deref();
                if expected != Some(&sim_read.destination[..]) {
                    let forged = sim_read.destination.contains(&FORGED);
                    return Err(self.fail(format!(
                        "{read:?} completed Ok with bytes its owner {} did not serve (forged bytes: {forged})",
                        sim_read.owner
                    )));
                }
            }
        }
        let pending = self
            .reads
            .values()
            .filter(|r| r.completed_at.is_none())
            .count();
        if self.consumer.in_flight() > pending {
            return Err(self.fail(format!(
                "the machine holds {} reads, {pending} not completed",
                self.consumer.in_flight()
            )));
        }
        Ok(())
    }

    fn cancelling(&self) -> bool {
        self.reads
            .values()
            .any(|r| r.receive == Receive::Cancelling)
    }

    /// Lets every transfer end and every deadline pass; then every read must
    /// be completed exactly once.
    fn drain(&mut self) -> Result<(), Failure> {
        while !self.transfers.is_empty() || !self.network.is_empty() || self.cancelling() {
            self.step += 1;
            match self.rng.below(3) {
                0 => self.deliver(),
                1 => self.progress_transfer(),
                _ => self.end_a_cancel(),
            }
            self.collect_completions()?;
        }
        self.clock_ms += 3_600_000;
        self.expire();
        while !self.transfers.is_empty() || self.cancelling() {
            self.step += 1;
            self.progress_transfer();
            self.end_a_cancel();
            self.collect_completions()?;
        }
        self.collect_completions()?;
        if let Some((read, _)) = self.reads.iter().find(|(_, r)| r.completed_at.is_none()) {
            return Err(self.fail(format!("{read:?} was never completed")));
        }
        if self.consumer.in_flight() != 0 {
            return Err(self.fail(format!(
                "{} reads left in the machine after every completion",
                self.consumer.in_flight()
            )));
        }
        Ok(())
    }
}

#[test]
fn every_seed_keeps_every_promise() {
    let seeds = seeds();
    let count = seeds.end - seeds.start;
    let mut total = Summary::default();
    for seed in seeds {
        let summary = run(seed, Defects::default()).unwrap_or_else(|failure| panic!("{failure}"));
        total.reads += summary.reads;
        total.ok += summary.ok;
        total.timeouts += summary.timeouts;
        total.forged_dropped += summary.forged_dropped;
        total.stopped_transfers += summary.stopped_transfers;
        total.posted_receives_ok += summary.posted_receives_ok;
        total.wrong_lengths_refused += summary.wrong_lengths_refused;
    }
    // Enough seeds exercise what they claim to: successes, deadlines,
    // forged replies turned away, deadlines that had to stop a transfer. (A
    // replay of one seed need not.)
    if count < 1_000 {
        return;
    }
    assert!(total.ok > count, "{total:?}");
    assert!(total.timeouts > count / 10, "{total:?}");
    assert!(total.forged_dropped > count, "{total:?}");
    assert!(total.stopped_transfers > count / 10, "{total:?}");
    assert!(total.posted_receives_ok > count / 10, "{total:?}");
    assert!(total.wrong_lengths_refused > count / 10, "{total:?}");
}

#[test]
fn a_seed_replays_exactly() {
    let first = run(4242, Defects::default()).unwrap();
    let second = run(4242, Defects::default()).unwrap();
    assert_eq!(format!("{first:?}"), format!("{second:?}"));
}

/// The first failing seed under `defects`, if any below `limit`.
fn first_failure(defects: Defects, limit: u64) -> Option<Failure> {
    (0..limit).find_map(|seed| run(seed, defects).err())
}

/// Completing a read at its deadline while the transport still writes its
/// destination (the engine once did): the simulator finds a byte written
/// after the completion.
#[test]
fn the_simulator_finds_completions_before_release() {
    let defects = Defects {
        complete_before_release: true,
        ..Defects::default()
    };
    let failure = first_failure(defects, 100).expect("caught within 100 seeds");
    assert!(failure.what.contains("after its completion"), "{failure}");
}

/// Taking a reply from whichever endpoint it arrived on (the engine once
/// did): the simulator finds a forger's bytes completed `Ok`.
#[test]
fn the_simulator_finds_replies_taken_from_any_endpoint() {
    let defects = Defects {
        accept_any_endpoint: true,
        ..Defects::default()
    };
    let failure = first_failure(defects, 100).expect("caught within 100 seeds");
    assert!(failure.what.contains("did not serve"), "{failure}");
}

/// Taking a served reply whose payload is shorter than the read: the
/// simulator finds stale bytes completed `Ok`.
#[test]
fn the_simulator_finds_short_payloads_taken() {
    let defects = Defects {
        accept_short_payload: true,
        ..Defects::default()
    };
    let failure = first_failure(defects, 100).expect("caught within 100 seeds");
    assert!(failure.what.contains("did not serve"), "{failure}");
}

/// Trusting a served reply's header over its payload's size: the
/// simulator finds a write past the destination's end.
#[test]
fn the_simulator_finds_payloads_longer_than_their_header() {
    let defects = Defects {
        trust_header_length: true,
        ..Defects::default()
    };
    let failure = first_failure(defects, 100).expect("caught within 100 seeds");
    assert!(
        failure.what.contains("past its destination's end"),
        "{failure}"
    );
}

/// Taking a refusal from whichever endpoint it came on: the simulator finds
/// a read failed by a third peer.
#[test]
fn the_simulator_finds_refusals_taken_from_any_endpoint() {
    let defects = Defects {
        accept_refusals_from_any_endpoint: true,
        ..Defects::default()
    };
    let failure = first_failure(defects, 100).expect("caught within 100 seeds");
    assert!(failure.what.contains("third peer's refusal"), "{failure}");
}
