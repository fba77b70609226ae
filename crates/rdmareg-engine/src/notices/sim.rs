//! A deterministic simulator of readers sending notices to one owner,
//! driven by one `u64` seed.
//!
//! Readers attach notices to reads through a [`NoticeGate`] and finish
//! the reads in any order, each succeeding or failing; a notice the gate
//! releases travels as the wire message over its reader's connection,
//! which keeps order (as the transports do) but may fail and lose what it
//! carries. Readers restart with a new sender number, and connection names
//! are reused. A hostile peer on its own connection sends garbage, floods,
//! forged sender numbers and copies of honest messages. The owner's
//! [`NoticeInbox`] has small bounds drawn per seed, and its application
//! pops notices at random steps.
//!
//! # Invariants, checked after every step
//!
//! 1. A notice leaves its reader only after every read it accompanies
//!    completed, and only if all of them succeeded; otherwise it is
//!    withheld.
//! 2. A notice the owner delivers from an honest connection under that
//!    connection's reader's sender number is one that reader sent there,
//!    delivered once, and after every notice of that reader delivered
//!    before it on that connection was sent earlier (send order).
//! 3. The inbox holds at most its bound, and every message that reached
//!    the owner was delivered, is queued or was counted as dropped.
//! 4. At the end, with the network drained and the queue emptied, every
//!    honest notice sent was delivered, lost with a failed connection, or
//!    counted as a drop for lack of room.
//!
//! The seed test runs the seeds `cargo xtask sim` asks for (see
//! `sim_support::seeds`); a failure names its seed and step.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use super::gate::{Attached, Finished, GateDefects, NoticeGate};
use super::inbox::{NoticeInbox, NoticeLimits};
use super::wire;
use crate::sim_support::Rng;

/// Steps of one run.
const STEPS: u32 = 300;
/// Honest readers.
const READERS: usize = 3;
/// Connection names, fewer than readers and restarts need, so names are
/// reused.
const NAMES: u32 = 4;
/// The hostile peer's connection name (never an honest reader's).
const HOSTILE: u32 = 99;

/// A notice a reader attached, as the simulator tracks it.
#[derive(Debug, Clone)]
struct Tracked {
    /// The reads it accompanies, and how each ended (`None`: running).
    reads: BTreeMap<u64, Option<bool>>,
}

#[derive(Debug)]
struct Reader {
    connection: u32,
    sender: u64,
    sequence: u64,
    gate: NoticeGate<u64, u64>,
    /// Reads running, and whether each will succeed.
    running: BTreeMap<u64, bool>,
    /// Notices attached, by id.
    notices: HashMap<u64, Tracked>,
}

/// One honest message on the network.
#[derive(Debug, Clone)]
struct Packet {
    bytes: Vec<u8>,
    /// `(sender, sequence)` of an honest notice; `None` for hostile bytes.
    honest: Option<(u64, u64)>,
}

struct Sim {
    rng: Rng,
    readers: Vec<Reader>,
    next_op: u64,
    next_notice: u64,
    /// Per connection name, the messages in flight, in order.
    network: BTreeMap<u32, VecDeque<Packet>>,
    inbox: NoticeInbox<u32>,
    limits: NoticeLimits,
    /// Honest notices sent: `(connection, sender, sequence)`, in send order
    /// per `(connection, sender)`.
    sent: HashSet<(u32, u64, u64)>,
    /// Honest notices lost with a failed connection.
    lost: u64,
    /// Honest notices delivered, and the last number per reader and
    /// connection.
    delivered: HashSet<(u32, u64, u64)>,
    last_delivered: HashMap<(u32, u64), u64>,
    /// Messages that reached the owner, and notices popped.
    arrived: u64,
    popped: u64,
    /// Honest sender numbers, so a delivery under one is checked.
    honest_senders: HashSet<u64>,
    log: Vec<String>,
}

impl Sim {
    fn new(seed: u64) -> Sim {
        let mut rng = Rng::new(seed);
        let limits = NoticeLimits {
            queued: 1 + rng.index(12),
            queued_per_sender: 1 + rng.index(6),
            queued_per_connection: 1 + rng.index(8),
            senders_remembered: 1 + rng.index(8),
        };
        let mut sim = Sim {
            rng,
            readers: Vec::new(),
            next_op: 1,
            next_notice: 1,
            network: BTreeMap::new(),
            inbox: NoticeInbox::new(limits),
            limits,
            sent: HashSet::new(),
            lost: 0,
            delivered: HashSet::new(),
            last_delivered: HashMap::new(),
            arrived: 0,
            popped: 0,
            honest_senders: HashSet::new(),
            log: Vec::new(),
        };
        for index in 0..READERS {
            let reader = sim.new_reader(index as u32);
            sim.readers.push(reader);
        }
        sim
    }

    fn new_reader(&mut self, connection: u32) -> Reader {
        let sender = self.rng.next_u64() | 1;
        self.honest_senders.insert(sender);
        Reader {
            connection,
            sender,
            sequence: 0,
            gate: NoticeGate::new(),
            running: BTreeMap::new(),
            notices: HashMap::new(),
        }
    }

    fn step(&mut self) -> Result<(), String> {
        match self.rng.below(100) {
            0..=19 => self.attach(),
            20..=44 => self.finish_a_read()?,
            45..=64 => self.deliver(),
            65..=79 => self.pop()?,
            80..=84 => self.fail_a_connection(),
            85..=87 => self.restart_a_reader(),
            _ => self.hostile(),
        }
        self.check()
    }

    /// A reader attaches a notice to 0 to 4 new reads.
    fn attach(&mut self) {
        let index = self.rng.index(self.readers.len());
        let count = self.rng.below(5);
        let mut ops = Vec::new();
        for _ in 0..count {
            let op = self.next_op;
            self.next_op += 1;
            let succeeds = !self.rng.chance(20);
            self.readers[index].running.insert(op, succeeds);
            ops.push(op);
        }
        let id = self.next_notice;
        self.next_notice += 1;
        self.log
            .push(format!("reader {index} attaches notice {id} to {ops:?}"));
        let reader = &mut self.readers[index];
        reader.notices.insert(
            id,
            Tracked {
                reads: ops.iter().map(|&op| (op, None)).collect(),
            },
        );
        match reader.gate.attach(&ops, id) {
            Attached::Ready(id) => self.send(index, id),
            Attached::Waiting => {}
            Attached::AlreadyWatched(_) => unreachable!("fresh op ids"),
        }
    }

    /// A running read of some reader completes.
    fn finish_a_read(&mut self) -> Result<(), String> {
        let candidates: Vec<(usize, u64)> = self
            .readers
            .iter()
            .enumerate()
            .flat_map(|(i, r)| r.running.keys().map(move |&op| (i, op)))
            .collect();
        if candidates.is_empty() {
            return Ok(());
        }
        let (index, op) = candidates[self.rng.index(candidates.len())];
        let reader = &mut self.readers[index];
        let succeeded = reader.running.remove(&op).unwrap_or(false);
        for tracked in reader.notices.values_mut() {
            if let Some(outcome) = tracked.reads.get_mut(&op) {
                *outcome = Some(succeeded);
            }
        }
        self.log.push(format!(
            "reader {index} read {op} ends {}",
            if succeeded { "ok" } else { "failed" }
        ));
        match self.readers[index].gate.op_finished(op, succeeded) {
            None => Ok(()),
            Some(Finished::Send(id)) => {
                let tracked = &self.readers[index].notices[&id];
                if tracked.reads.values().any(|o| *o != Some(true)) {
                    return Err(format!(
                        "invariant 1: notice {id} released to send with reads {:?}",
                        tracked.reads
                    ));
                }
                self.send(index, id);
                Ok(())
            }
            Some(Finished::Withhold(id)) => {
                let tracked = &self.readers[index].notices[&id];
                let all_done = tracked.reads.values().all(Option::is_some);
                let any_failed = tracked.reads.values().any(|o| *o == Some(false));
                if !(all_done && any_failed) {
                    return Err(format!(
                        "invariant 1: notice {id} withheld with reads {:?}",
                        tracked.reads
                    ));
                }
                Ok(())
            }
        }
    }

    fn send(&mut self, index: usize, id: u64) {
        let reader = &mut self.readers[index];
        reader.sequence += 1;
        let (connection, sender, sequence) = (reader.connection, reader.sender, reader.sequence);
        let bytes = wire::encode(sender, sequence, &id.to_le_bytes()).expect("small");
        self.sent.insert((connection, sender, sequence));
        self.log.push(format!(
            "reader {index} sends notice {id} as {sequence} on {connection}"
        ));
        self.network
            .entry(connection)
            .or_default()
            .push_back(Packet {
                bytes,
                honest: Some((sender, sequence)),
            });
    }

    /// The head of some connection's queue reaches the owner.
    fn deliver(&mut self) {
        let busy: Vec<u32> = self
            .network
            .iter()
            .filter(|(_, q)| !q.is_empty())
            .map(|(&c, _)| c)
            .collect();
        if busy.is_empty() {
            return;
        }
        let connection = busy[self.rng.index(busy.len())];
        let Some(packet) = self
            .network
            .get_mut(&connection)
            .and_then(VecDeque::pop_front)
        else {
            return;
        };
        self.arrived += 1;
        let result = self.inbox.receive(connection, &packet.bytes);
        self.log.push(format!(
            "{connection} delivers {:?}: {result:?}",
            packet.honest
        ));
    }

    /// The application takes a notice; it is checked against what was sent.
    fn pop(&mut self) -> Result<(), String> {
        let Some(notice) = self.inbox.pop() else {
            return Ok(());
        };
        self.popped += 1;
        let key = (notice.from, notice.sender, notice.sequence);
        self.log.push(format!("pops {key:?}"));
        if notice.from == HOSTILE || !self.honest_senders.contains(&notice.sender) {
            return Ok(());
        }
        if !self.sent.contains(&key) {
            return Err(format!(
                "invariant 2: delivered {key:?}, which its reader never sent there"
            ));
        }
        if !self.delivered.insert(key) {
            return Err(format!("invariant 2: delivered {key:?} twice"));
        }
        let last = self
            .last_delivered
            .insert((notice.from, notice.sender), notice.sequence);
        if last.is_some_and(|l| l >= notice.sequence) {
            return Err(format!(
                "invariant 2: delivered {key:?} after number {last:?}"
            ));
        }
        Ok(())
    }

    /// A connection fails: what it carried is lost, and the owner forgets
    /// it.
    fn fail_a_connection(&mut self) {
        let connection = self.rng.below(u64::from(NAMES)) as u32;
        if let Some(queue) = self.network.get_mut(&connection) {
            self.lost += queue.iter().filter(|p| p.honest.is_some()).count() as u64;
            queue.clear();
        }
        self.inbox.connection_closed(connection);
        self.log.push(format!("connection {connection} fails"));
    }

    /// A reader restarts: a new sender number, maybe another connection
    /// name; its waiting notices end unsent with it.
    fn restart_a_reader(&mut self) {
        let index = self.rng.index(self.readers.len());
        // A name no other reader holds (its own old one included): a
        // transport reuses only names of closed connections.
        let free: Vec<u32> = (0..NAMES)
            .filter(|&name| {
                self.readers
                    .iter()
                    .enumerate()
                    .all(|(i, r)| i == index || r.connection != name)
            })
            .collect();
        let connection = free[self.rng.index(free.len())];
        let _withheld = self.readers[index].gate.withhold_all();
        let old = self.readers[index].connection;
        if let Some(queue) = self.network.get_mut(&old) {
            self.lost += queue.iter().filter(|p| p.honest.is_some()).count() as u64;
            queue.clear();
        }
        self.inbox.connection_closed(old);
        let mut reader = self.new_reader(connection);
        reader.gate.defects = self.readers[index].gate.defects;
        self.readers[index] = reader;
        self.log
            .push(format!("reader {index} restarts on {connection}"));
    }

    /// The hostile peer sends something on its own connection.
    fn hostile(&mut self) {
        let bytes = match self.rng.below(4) {
            0 => (0..self.rng.below(40))
                .map(|_| self.rng.next_u64() as u8)
                .collect(),
            1 => {
                // A forged sender number of an honest reader.
                let reader = &self.readers[self.rng.index(self.readers.len())];
                let sequence = self.rng.next_u64();
                wire::encode(reader.sender, sequence, b"forged").expect("small")
            }
            2 => {
                // A copy of an honest message still in flight.
                let copies: Vec<Vec<u8>> = self
                    .network
                    .values()
                    .flat_map(|q| q.iter().map(|p| p.bytes.clone()))
                    .collect();
                if copies.is_empty() {
                    return;
                }
                copies[self.rng.index(copies.len())].clone()
            }
            _ => {
                // A burst under fresh sender numbers.
                for _ in 0..8 {
                    let sender = self.rng.next_u64() & !1;
                    let packet = Packet {
                        bytes: wire::encode(sender, 1, b"flood").expect("small"),
                        honest: None,
                    };
                    self.network.entry(HOSTILE).or_default().push_back(packet);
                }
                return;
            }
        };
        self.network.entry(HOSTILE).or_default().push_back(Packet {
            bytes,
            honest: None,
        });
    }

    fn check(&self) -> Result<(), String> {
        if self.inbox.queued() > self.limits.queued {
            return Err(format!(
                "invariant 3: {} queued past the bound {}",
                self.inbox.queued(),
                self.limits.queued
            ));
        }
        let accounted = self.popped + self.inbox.queued() as u64 + self.inbox.drops().total();
        if accounted != self.arrived {
            return Err(format!(
                "invariant 3: {} arrived, {accounted} delivered, queued or dropped",
                self.arrived
            ));
        }
        Ok(())
    }

    /// Drains the network and the queue, then checks invariant 4.
    fn finish(&mut self) -> Result<(), String> {
        while self.network.values().any(|q| !q.is_empty()) {
            self.deliver();
            self.check()?;
            while self.inbox.queued() > 0 {
                self.pop()?;
            }
        }
        while self.inbox.queued() > 0 {
            self.pop()?;
        }
        self.check()?;
        let drops = self.inbox.drops();
        let sent = self.sent.len() as u64;
        let delivered = self.delivered.len() as u64;
        let unexplained = sent.saturating_sub(delivered + self.lost);
        let for_room = drops.queue_full + drops.sender_queue_full + drops.connection_queue_full;
        if unexplained > for_room {
            return Err(format!(
                "invariant 4: {sent} sent, {delivered} delivered, {} lost, {unexplained} \
                 missing against {drops:?}",
                self.lost
            ));
        }
        Ok(())
    }
}

/// Runs one seed; the error names the step and the run's last steps.
fn run(seed: u64) -> Result<(), String> {
    run_with(seed, GateDefects::default())
}

/// [`run`] with readers whose gates make `defects`.
fn run_with(seed: u64, defects: GateDefects) -> Result<(), String> {
    let mut sim = Sim::new(seed);
    for reader in &mut sim.readers {
        reader.gate.defects = defects;
    }
    for step in 0..STEPS {
        sim.step().map_err(|why| {
            let tail = sim
                .log
                .iter()
                .rev()
                .take(12)
                .rev()
                .cloned()
                .collect::<Vec<_>>();
            format!(
                "seed {seed}, step {step}: {why}\nlast steps:\n  {}",
                tail.join("\n  ")
            )
        })?;
    }
    sim.finish()
        .map_err(|why| format!("seed {seed}, at the end: {why}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_keep_their_promises_on_every_seed() {
        for seed in crate::sim_support::seeds() {
            if let Err(failure) = run(seed) {
                panic!("{failure}\nreplay: cargo xtask sim --seed {seed}");
            }
        }
    }

    /// The first seed that finds `defects`, among the first 20.
    fn found_within_20(defects: GateDefects) -> Option<(u64, String)> {
        (0..20).find_map(|seed| run_with(seed, defects).err().map(|why| (seed, why)))
    }

    #[test]
    fn sim_finds_a_gate_that_sends_after_a_failed_read() {
        let found = found_within_20(GateDefects {
            sends_after_a_failure: true,
            ..GateDefects::default()
        });
        let (_, why) = found.expect("found within 20 seeds");
        assert!(why.contains("invariant 1"), "{why}");
    }

    #[test]
    fn sim_finds_a_gate_that_sends_before_the_last_read() {
        let found = found_within_20(GateDefects {
            releases_at_the_first_read: true,
            ..GateDefects::default()
        });
        let (_, why) = found.expect("found within 20 seeds");
        assert!(why.contains("invariant 1"), "{why}");
    }
}
