//! Descriptor leases in the simulator: simulated time, leases handed to
//! consumers, their reads and releases, and the invariants on them
//! (invariants 6 to 9 of the parent module's docs).
//!
//! Time is an `Instant` drawn once per run plus a simulated offset that
//! only steps forward, so a seed replays exactly. The driver gives it to
//! the owner ([`Owner::set_time`](crate::served::Owner::set_time)) before
//! it hands it requests; the model judges by the last time given, as the
//! owner must.
//!
//! The model of a region's leases keeps what the rules say the owner
//! knows: which leases are live, which readers' releases counted, and the
//! order in which leases ended, so that it knows which ended capabilities
//! the owner must still remember ([`ENDED_REMEMBERED`] per region). Leases
//! that one sweep ended together may be forgotten in any order among
//! themselves; for those alone the model asks the owner
//! ([`Owner::check_read`](crate::served::Owner::check_read), which
//! changes nothing) whether it still knows the capability, and checks the
//! bound on what it remembers apart.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use futures::FutureExt;
use rdmareg_core::RdmaError;

use super::{Checked, Kind, Message, RegionState, Sim, capability};
use crate::served::leases::{
    ENDED_REMEMBERED, IgnoredRelease, LeaseEnd, LeaseReleased, LeaseTerms, MAX_LEASE_READERS,
    ReleaseOutcome,
};
use crate::served::{Read, Refusal, wire};

/// The hostile peer's connection, never an honest consumer's.
const HOSTILE: u64 = 1 << 40;

/// A reader as a release names it: the connection it came on and the
/// sender number its engine drew.
type Reader = (u64, u64);

/// Simulated time.
#[derive(Debug)]
pub(super) struct Clock {
    base: Instant,
    /// Now, in the simulation.
    pub(super) now: Instant,
    /// The last time the driver gave the owner (the latest, as the owner
    /// ignores earlier ones).
    owner: Option<Instant>,
}

impl Clock {
    pub(super) fn new() -> Clock {
        let base = Instant::now();
        Clock {
            base,
            now: base,
            owner: None,
        }
    }

    /// `at` as an offset from the start of the run, for messages.
    fn show(&self, at: Instant) -> Duration {
        at.saturating_duration_since(self.base)
    }

    /// Whether a lease expiring at `expires_at` has expired at the owner's
    /// time.
    fn expired(&self, expires_at: Instant) -> bool {
        self.owner.is_some_and(|now| now >= expires_at)
    }

    fn given(&mut self, at: Instant) {
        if self.owner.is_none_or(|before| at > before) {
            self.owner = Some(at);
        }
    }
}

/// A lease as the model tracks it.
#[derive(Debug)]
pub(super) struct SimLease {
    region: u64,
    capability: [u8; 16],
    terms: LeaseTerms,
    /// The consumers it was handed to, each with whether it sent a release.
    holders: Vec<(Reader, bool)>,
    /// Distinct readers whose release counted, in order.
    counted: Vec<Reader>,
    /// In the owner's list of live leases: not yet ended by its last
    /// reader, by a release after its expiry, by a sweep or by its
    /// region's end. (A lease in it may have expired all the same.)
    in_live_list: bool,
    /// Which batch of its region's endings moved it to the owner's ended
    /// leases.
    ended_batch: Option<usize>,
    /// Its last reader released it.
    released_out: bool,
    /// Its region's unmap completed: the owner forgot the region.
    region_gone: bool,
    /// Whoever waits for the release holds this, polled after every step.
    future: Option<LeaseReleased>,
    resolved: Option<LeaseEnd>,
}

impl SimLease {
    /// Whether a read under it must be served (as far as the lease goes).
    fn serves(&self, clock: &Clock) -> bool {
        self.in_live_list && !self.released_out && !clock.expired(self.terms.expires_at)
    }
}

/// The leases of a run.
#[derive(Debug, Default)]
pub(super) struct Book {
    leases: Vec<SimLease>,
    /// Indexes into `leases`: by region and capability; by region, in
    /// the order granted; those whose future has not resolved; those not
    /// of a burst (a burst's are picked only where any lease is).
    by_capability: HashMap<(u64, [u8; 16]), usize>,
    by_region: BTreeMap<u64, Vec<usize>>,
    pending: Vec<usize>,
    plain: Vec<usize>,
    /// Per region, the sizes of the batches of leases the owner moved to
    /// its ended ones, oldest first, and those leases in that order.
    ended_log: BTreeMap<u64, Vec<usize>>,
    ended_order: BTreeMap<u64, Vec<usize>>,
    next_sender: u64,
    /// Regions that gained a lease or whose leases ended in this step:
    /// the owner's memory of them is checked after it.
    touched: BTreeSet<u64>,
}

/// Whether the owner must still know an ended lease's capability.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Remembered {
    Yes,
    No,
    /// It ended in a sweep with others, some of which the owner has
    /// forgotten: which ones is the owner's choice.
    Maybe,
}

/// What a read's capability is to the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Judged {
    /// No lease the owner knows: the region's own capability or a wrong one.
    NotALease,
    /// A live lease: judged as the region's own.
    Serves,
    /// An ended lease the owner remembers: refused `LeaseExpired`.
    Ended,
}

/// What a release does to the model once the owner agreed.
#[derive(Debug, Clone, Copy)]
enum Effect {
    Nothing,
    /// A reader's second release.
    Duplicate,
    /// A release of a live lease whose region's unmap started.
    RacedUnmap,
    Counted(usize, Reader),
    /// A release after the expiry: the owner ends the lease.
    EndedLate(usize),
}

impl Sim {
    fn lease_of(&self, region: u64, capability: &[u8; 16]) -> Option<usize> {
        self.book.by_capability.get(&(region, *capability)).copied()
    }

    fn leases_of(&self, region: u64) -> impl Iterator<Item = &SimLease> {
        self.book
            .by_region
            .get(&region)
            .into_iter()
            .flatten()
            .map(|&at| &self.book.leases[at])
    }

    fn remembered(&self, lease: &SimLease) -> Remembered {
        if lease.region_gone {
            return Remembered::No;
        }
        if lease.in_live_list {
            return Remembered::Yes;
        }
        let (Some(batch), Some(log)) = (lease.ended_batch, self.book.ended_log.get(&lease.region))
        else {
            return Remembered::No;
        };
        let after: usize = log[batch + 1..].iter().sum();
        if after + log[batch] <= ENDED_REMEMBERED {
            Remembered::Yes
        } else if after >= ENDED_REMEMBERED {
            Remembered::No
        } else {
            Remembered::Maybe
        }
    }

    /// Whether the owner knows `capability` of `region` as a lease, asked
    /// of the owner itself (a read that changes nothing).
    fn owner_knows(&self, region: u64, capability: [u8; 16]) -> bool {
        let Some(sim_region) = self.regions.get(&region) else {
            return false;
        };
        let probe = Read {
            request_id: 0,
            region,
            capability,
            address: sim_region.base,
            length: 1,
        };
        !matches!(
            self.owner.check_read(&probe),
            Err(Refusal::CapabilityMismatch | Refusal::RegionUnknown)
        )
    }

    fn is_remembered(&self, lease: &SimLease) -> bool {
        match self.remembered(lease) {
            Remembered::Yes => true,
            Remembered::No => false,
            Remembered::Maybe => self.owner_knows(lease.region, lease.capability),
        }
    }

    /// The model's judgement of a read's capability other than its
    /// region's own, for a region the owner holds.
    pub(super) fn judge_lease(&self, region: u64, capability: &[u8; 16]) -> Judged {
        let Some(at) = self.lease_of(region, capability) else {
            return Judged::NotALease;
        };
        let lease = &self.book.leases[at];
        if !self.is_remembered(lease) {
            Judged::NotALease
        } else if lease.serves(&self.clock) {
            Judged::Serves
        } else {
            Judged::Ended
        }
    }

    /// Invariant 6, checked for every read the owner served: not under a
    /// lease that expired at the owner's time or that its readers released.
    pub(super) fn check_served(&self, read: &Read) -> Checked {
        let Some(at) = self.lease_of(read.region, &read.capability) else {
            return Ok(());
        };
        let lease = &self.book.leases[at];
        let clock = &self.clock;
        if clock.expired(lease.terms.expires_at) {
            return Err(format!(
                "request {} served under lease {at} of region {}, which expired at {:?}, the owner's time {:?}",
                read.request_id,
                read.region,
                clock.show(lease.terms.expires_at),
                clock.owner.map(|t| clock.show(t))
            ));
        }
        if lease.released_out || !lease.in_live_list {
            return Err(format!(
                "request {} served under lease {at} of region {}, which ended (released by {:?} of {} readers)",
                read.request_id, read.region, lease.counted, lease.terms.readers
            ));
        }
        Ok(())
    }

    /// Counts a lease read's reply for the run's statistics.
    pub(super) fn count_lease_read(&mut self, read: &Read, outcome: Result<(), Refusal>) {
        if self.lease_of(read.region, &read.capability).is_none() {
            return;
        }
        match outcome {
            Ok(()) => self.stats.lease_reads_served += 1,
            Err(Refusal::LeaseExpired) => self.stats.lease_reads_expired += 1,
            Err(Refusal::CapabilityMismatch) => self.stats.lease_reads_forgotten += 1,
            Err(_) => {}
        }
    }

    /// The driver gives the owner the time before it hands it requests.
    pub(super) fn give_time(&mut self) {
        let now = self.clock.now;
        self.owner.set_time(now);
        self.clock.given(now);
    }

    /// After each step's other action, with its own random numbers: now
    /// and then a lease action.
    pub(super) fn lease_step(&mut self) -> Checked {
        std::mem::swap(&mut self.rng, &mut self.lease_rng);
        let result = self.lease_action();
        std::mem::swap(&mut self.rng, &mut self.lease_rng);
        result
    }

    fn lease_action(&mut self) -> Checked {
        if !self.rng.chance(40) {
            return Ok(());
        }
        match self.rng.below(100) {
            0..=19 => self.advance_time(),
            20..=31 => self.register_lease(),
            32..=56 => self.release(),
            57..=74 => self.lease_request(),
            75..=81 => self.lease_list_request(),
            82..=86 => self.hostile_lease_request(),
            87..=89 => self.deliver_timed(false),
            90..=91 => self.stale_time(),
            92..=93 => self.lease_burst(),
            _ => Ok(()),
        }
    }

    /// A consumer reads under a lease it was given.
    fn lease_request(&mut self) -> Checked {
        if let Some(read) = self.lease_read() {
            let endpoint = self.live_endpoint();
            self.send(endpoint, wire::encode_request(&read).to_vec());
        }
        Ok(())
    }

    /// A hostile peer reads with a lease it saw, forged or naming another
    /// region.
    fn hostile_lease_request(&mut self) -> Checked {
        if let Some(read) = self.hostile_lease_read() {
            let endpoint = self.live_endpoint();
            self.send(endpoint, wire::encode_request(&read).to_vec());
        }
        Ok(())
    }

    /// A batched list whose entries read under leases, mixed with reads of
    /// regions' own descriptors and hostile entries.
    fn lease_list_request(&mut self) -> Checked {
        let count = 1 + self.rng.below(8);
        let mut entries = Vec::new();
        for _ in 0..count {
            let read = match self.rng.below(100) {
                0..=49 => self.lease_read(),
                50..=59 => self.hostile_lease_read(),
                60..=69 => self.hostile_read(),
                _ => self.honest_read(),
            };
            entries.extend(read);
        }
        let Some(bytes) = wire::encode_list_request(&entries) else {
            return Ok(());
        };
        let endpoint = self.live_endpoint();
        self.network.push(Message {
            endpoint,
            kind: Kind::List,
            bytes,
        });
        Ok(())
    }

    /// Time steps forward: a little, more, or to a live lease's expiry
    /// (or the instant before it).
    pub(super) fn advance_time(&mut self) -> Checked {
        let now = self.clock.now;
        let step = match self.rng.below(10) {
            0..=5 => Duration::from_micros(self.rng.below(500)),
            6..=8 => Duration::from_micros(1_000 + self.rng.below(4_000)),
            _ => {
                let ahead: Vec<Instant> = self
                    .book
                    .plain
                    .iter()
                    .map(|&at| &self.book.leases[at])
                    .filter(|l| l.in_live_list && l.terms.expires_at > now)
                    .map(|l| l.terms.expires_at)
                    .collect();
                if ahead.is_empty() {
                    return Ok(());
                }
                let to = ahead[self.rng.index(ahead.len())];
                let to = if self.rng.chance(50) {
                    to - Duration::from_nanos(1)
                } else {
                    to
                };
                to.saturating_duration_since(now)
            }
        };
        self.clock.now += step;
        let at = self.clock.show(self.clock.now);
        self.note(|| format!("time {at:?}"));
        Ok(())
    }

    /// The driver gives the owner a time without requests: the current
    /// one, or an earlier reading (from another thread's clock), which the
    /// owner must ignore.
    pub(super) fn stale_time(&mut self) -> Checked {
        let now = self.clock.now;
        let at = if self.rng.chance(50) {
            now
        } else {
            now.checked_sub(Duration::from_micros(1 + self.rng.below(5_000)))
                .unwrap_or(now)
                .max(self.clock.base)
        };
        self.owner.set_time(at);
        self.clock.given(at);
        let shown = self.clock.show(at);
        self.note(|| format!("the driver gives the time {shown:?}"));
        Ok(())
    }

    fn fresh_sender(&mut self) -> u64 {
        self.book.next_sender += 1;
        1_000 + self.book.next_sender
    }

    /// Consumers to hand a lease to: `count` distinct readers, on the
    /// consumers' connections, with small sender numbers so that one
    /// number shows up on several connections.
    fn holders(&mut self, count: u32) -> Vec<(Reader, bool)> {
        let mut out: Vec<(Reader, bool)> = Vec::new();
        while out.len() < count as usize {
            let connection = 1 + self.rng.below(self.next_endpoint.max(2) - 1);
            let reader = (connection, 1 + self.rng.below(3));
            if !out.iter().any(|(r, _)| *r == reader) {
                out.push((reader, false));
            }
        }
        out
    }

    /// Asks the owner for a lease and checks its answer against the model;
    /// on success the model and the consumers get it.
    fn register_one(
        &mut self,
        region: u64,
        terms: LeaseTerms,
        given: Instant,
        holders: Vec<(Reader, bool)>,
        burst: bool,
    ) -> Checked {
        let capability = capability(&mut self.rng);
        let result = self.owner.register_lease(region, capability, terms, given);
        let expiry = self.clock.show(terms.expires_at);
        let shown = self.clock.show(given);
        self.note(|| {
            format!(
                "lease of region {region} for {} readers until {expiry:?} at {shown:?}: {}",
                terms.readers,
                if result.is_ok() { "ok" } else { "refused" }
            )
        });
        let expected = if self.shut_down {
            Err(RdmaError::ShuttingDown)
        } else {
            self.clock.given(given);
            let now = self.clock.owner.unwrap_or(given);
            let live = self
                .regions
                .get(&region)
                .is_some_and(|r| r.state == RegionState::Live);
            if !live {
                Err(RdmaError::RegionNotFound)
            } else if terms.check(now).is_err() {
                Err(RdmaError::OutOfRange)
            } else {
                Ok(())
            }
        };
        let future = match (result, expected) {
            (Ok(future), Ok(())) => future,
            (Err(got), Err(expected)) if got == expected => return Ok(()),
            (got, expected) => {
                return Err(format!(
                    "a lease of region {region} ({terms:?}): expected {expected:?}, the owner gave {:?}",
                    got.map(|_| ())
                ));
            }
        };
        self.sweep(region);
        self.book.touched.insert(region);
        let at = self.book.leases.len();
        self.book.by_capability.insert((region, capability), at);
        self.book.by_region.entry(region).or_default().push(at);
        self.book.pending.push(at);
        if !burst {
            self.book.plain.push(at);
        }
        self.book.leases.push(SimLease {
            region,
            capability,
            terms,
            holders,
            counted: Vec::new(),
            in_live_list: true,
            ended_batch: None,
            released_out: false,
            region_gone: false,
            future: Some(future),
            resolved: None,
        });
        self.stats.leases += 1;
        Ok(())
    }

    /// A new lease sweeps its region: every lease expired at the owner's
    /// time ends, in one batch.
    fn sweep(&mut self, region: u64) {
        let clock = &self.clock;
        let swept: Vec<usize> = self
            .book
            .by_region
            .get(&region)
            .into_iter()
            .flatten()
            .copied()
            .filter(|&at| {
                let lease = &self.book.leases[at];
                lease.in_live_list && clock.expired(lease.terms.expires_at)
            })
            .collect();
        self.end_batch(region, &swept);
    }

    fn end_batch(&mut self, region: u64, ended: &[usize]) {
        if ended.is_empty() {
            return;
        }
        self.book.touched.insert(region);
        let log = self.book.ended_log.entry(region).or_default();
        let batch = log.len();
        log.push(ended.len());
        let order = self.book.ended_order.entry(region).or_default();
        order.extend_from_slice(ended);
        for &at in ended {
            let lease = &mut self.book.leases[at];
            lease.in_live_list = false;
            lease.ended_batch = Some(batch);
        }
    }

    /// A lease of a region, mostly a live one with one to three readers
    /// and an expiry a little or a while ahead; now and then terms the
    /// owner must refuse, a region it must refuse, or the time of a clock
    /// reading taken a little earlier.
    pub(super) fn register_lease(&mut self) -> Checked {
        let live: Vec<u64> = self
            .regions
            .iter()
            .filter(|(_, r)| r.state == RegionState::Live)
            .map(|(&id, _)| id)
            .collect();
        let region = if !live.is_empty() && self.rng.chance(85) {
            live[self.rng.index(live.len())]
        } else {
            1 + self.rng.below(self.next_region)
        };
        let now = self.clock.now;
        let readers = match self.rng.below(40) {
            0 => 0,
            1 => MAX_LEASE_READERS + 1,
            _ => 1 + self.rng.below(3) as u32,
        };
        let ahead = match self.rng.below(20) {
            0 => Duration::ZERO,
            1..=4 => Duration::from_nanos(1 + self.rng.below(1_000_000)),
            5..=14 => Duration::from_micros(1_000 + self.rng.below(9_000)),
            _ => Duration::from_micros(10_000 + self.rng.below(90_000)),
        };
        let given = if self.rng.chance(5) {
            now.checked_sub(Duration::from_micros(self.rng.below(2_000)))
                .unwrap_or(now)
                .max(self.clock.base)
        } else {
            now
        };
        let terms = LeaseTerms {
            readers,
            expires_at: now + ahead,
        };
        let extra = u32::from(self.rng.chance(20));
        let holders = self.holders(readers.min(3) + extra);
        self.register_one(region, terms, given, holders, false)
    }

    /// Many short leases of one region at once, each for one reader, most
    /// of them released at once (a few releases travel the network): a
    /// long-lived region whose ended leases must stay bounded.
    pub(super) fn lease_burst(&mut self) -> Checked {
        let live: Vec<u64> = self
            .regions
            .iter()
            .filter(|(_, r)| r.state == RegionState::Live)
            .map(|(&id, _)| id)
            .collect();
        if live.is_empty() {
            return Ok(());
        }
        let region = live[self.rng.index(live.len())];
        let count = 48 + self.rng.below(64);
        for _ in 0..count {
            let now = self.clock.now;
            let terms = LeaseTerms {
                readers: 1,
                expires_at: now + Duration::from_nanos(1 + self.rng.below(3_000_000)),
            };
            let holders = self.holders(1);
            self.register_one(region, terms, now, holders, true)?;
            let at = self.book.leases.len() - 1;
            match self.rng.below(10) {
                0..=5 => {
                    self.book.leases[at].holders[0].1 = true;
                    let ((connection, sender), _) = self.book.leases[at].holders[0];
                    let capability = self.book.leases[at].capability;
                    self.give_time();
                    self.deliver_release(connection, sender, region, capability)?;
                }
                6 => self.send_release(at, 0)?,
                _ => {}
            }
            self.clock.now += Duration::from_micros(self.rng.below(50));
        }
        Ok(())
    }

    /// Holder `holder` of lease `at` sends its release.
    fn send_release(&mut self, at: usize, holder: usize) -> Checked {
        let lease = &mut self.book.leases[at];
        let ((connection, sender), _) = lease.holders[holder];
        lease.holders[holder].1 = true;
        let (region, capability) = (lease.region, lease.capability);
        self.push_release(connection, sender, region, capability)
    }

    /// A release goes on the network, or now and then arrives at once
    /// (racing whatever this step does).
    fn push_release(
        &mut self,
        connection: u64,
        sender: u64,
        region: u64,
        capability: [u8; 16],
    ) -> Checked {
        let message = Message {
            endpoint: connection,
            kind: Kind::Release {
                sender,
                region,
                capability,
            },
            bytes: Vec::new(),
        };
        if self.rng.chance(75) {
            self.network.push(message);
            return Ok(());
        }
        self.give_time();
        self.deliver_release(connection, sender, region, capability)?;
        self.sent.push(message);
        if self.sent.len() > 64 {
            self.sent.swap_remove(0);
        }
        Ok(())
    }

    /// A lease for a release: mostly one that serves, or one that would
    /// but for its region's unmap having started (the release racing the
    /// unmap); sometimes any (a late release).
    fn pick_lease(&mut self) -> usize {
        let (mut open, mut unmapping) = (Vec::new(), Vec::new());
        for &at in &self.book.plain {
            let lease = &self.book.leases[at];
            if !lease.serves(&self.clock) {
                continue;
            }
            match self.regions.get(&lease.region).map(|r| r.state) {
                Some(RegionState::Live) => open.push(at),
                Some(RegionState::Unmapping) => unmapping.push(at),
                _ => {}
            }
        }
        match self.rng.below(100) {
            0..=64 if !open.is_empty() => open[self.rng.index(open.len())],
            65..=79 if !unmapping.is_empty() => unmapping[self.rng.index(unmapping.len())],
            _ => self.rng.index(self.book.leases.len()),
        }
    }

    /// A release goes on the network: a holder's (mostly one that has not
    /// released yet), a holder's again, a holder's after it restarted
    /// with a new sender number, or a hostile one — a forged capability,
    /// the region's own capability, or another lease's capability naming
    /// this lease's region (a consumer releasing a lease it was not given).
    pub(super) fn release(&mut self) -> Checked {
        if self.book.leases.is_empty() {
            return Ok(());
        }
        let at = self.pick_lease();
        let holders = self.book.leases[at].holders.len();
        match self.rng.below(100) {
            0..=54 => {
                let pending: Vec<usize> = (0..holders)
                    .filter(|&h| !self.book.leases[at].holders[h].1)
                    .collect();
                let holder = if !pending.is_empty() && self.rng.chance(80) {
                    pending[self.rng.index(pending.len())]
                } else {
                    self.rng.index(holders)
                };
                self.send_release(at, holder)
            }
            55..=69 => {
                // A holder that released already, of a lease that still
                // serves if there is one.
                let mut done = Vec::new();
                for &other in &self.book.plain {
                    let lease = &self.book.leases[other];
                    for (holder, &(_, released)) in lease.holders.iter().enumerate() {
                        if released && lease.serves(&self.clock) {
                            done.push((other, holder));
                        }
                    }
                }
                let (at, holder) = if done.is_empty() {
                    (at, self.rng.index(holders))
                } else {
                    done[self.rng.index(done.len())]
                };
                self.send_release(at, holder)?;
                self.send_release(at, holder)
            }
            70..=74 => {
                let holder = self.rng.index(holders);
                let sender = self.fresh_sender();
                self.book.leases[at].holders[holder].0.1 = sender;
                self.send_release(at, holder)
            }
            75..=84 => {
                let lease = &self.book.leases[at];
                let (region, mut forged) = (lease.region, lease.capability);
                forged[self.rng.index(16)] ^= 1 << self.rng.below(8);
                let sender = self.rng.below(4);
                self.push_release(HOSTILE, sender, region, forged)
            }
            85..=89 => {
                let region = self.book.leases[at].region;
                let own = self.regions[&region].capability;
                let sender = self.rng.below(4);
                self.push_release(HOSTILE, sender, region, own)
            }
            _ => {
                let other = self.rng.index(self.book.leases.len());
                let lease = &self.book.leases[other];
                let holder = lease.holders[self.rng.index(lease.holders.len())].0;
                let (region, capability) = (self.book.leases[at].region, lease.capability);
                self.push_release(holder.0, holder.1, region, capability)
            }
        }
    }

    /// The model's outcomes of a release (one, or the two an ended lease
    /// that may be forgotten allows) and what it does.
    fn expect_release(
        &self,
        reader: Reader,
        region: u64,
        capability: &[u8; 16],
    ) -> (Vec<ReleaseOutcome>, Effect) {
        use ReleaseOutcome::Ignored;
        let unknown = (vec![Ignored(IgnoredRelease::UnknownLease)], Effect::Nothing);
        let ended = (vec![Ignored(IgnoredRelease::AlreadyEnded)], Effect::Nothing);
        let Some(state) = self.regions.get(&region).map(|r| r.state) else {
            return unknown;
        };
        let Some(at) = self.lease_of(region, capability) else {
            return unknown;
        };
        let lease = &self.book.leases[at];
        match (state, self.remembered(lease)) {
            (RegionState::Unmapped, _) | (_, Remembered::No) => return unknown,
            (_, Remembered::Maybe) => {
                return (
                    vec![
                        Ignored(IgnoredRelease::AlreadyEnded),
                        Ignored(IgnoredRelease::UnknownLease),
                    ],
                    Effect::Nothing,
                );
            }
            // The unmap ended the region's leases.
            (RegionState::Unmapping, Remembered::Yes) if lease.in_live_list => {
                return (ended.0, Effect::RacedUnmap);
            }
            (RegionState::Unmapping, Remembered::Yes) => return ended,
            (RegionState::Live, Remembered::Yes) => {}
        }
        if !lease.in_live_list {
            return ended;
        }
        if self.clock.expired(lease.terms.expires_at) {
            return (
                vec![Ignored(IgnoredRelease::AlreadyEnded)],
                Effect::EndedLate(at),
            );
        }
        if lease.counted.contains(&reader) {
            return (
                vec![Ignored(IgnoredRelease::AlreadyReleased)],
                Effect::Duplicate,
            );
        }
        let remaining = lease.terms.readers - lease.counted.len() as u32 - 1;
        let outcome = if remaining == 0 {
            ReleaseOutcome::Ended
        } else {
            ReleaseOutcome::Counted { remaining }
        };
        (vec![outcome], Effect::Counted(at, reader))
    }

    /// The owner handles a release that arrived; its outcome must be the
    /// model's.
    pub(super) fn deliver_release(
        &mut self,
        connection: u64,
        sender: u64,
        region: u64,
        capability: [u8; 16],
    ) -> Checked {
        let reader = (connection, sender);
        let (expected, effect) = self.expect_release(reader, region, &capability);
        let got = self
            .owner
            .handle_release(connection, sender, region, &capability);
        let lease = self.lease_of(region, &capability);
        self.note(|| {
            format!("release by {reader:?} of region {region} (lease {lease:?}): expect {expected:?}, got {got:?}")
        });
        if !expected.contains(&got) {
            return Err(format!(
                "a release by {reader:?} of region {region} (lease {lease:?}): expected {expected:?}, the owner said {got:?}"
            ));
        }
        match got {
            ReleaseOutcome::Ignored(_) => self.stats.releases_ignored += 1,
            _ => self.stats.releases_counted += 1,
        }
        match effect {
            Effect::Nothing => {}
            Effect::Duplicate => self.stats.releases_duplicate += 1,
            Effect::RacedUnmap => self.stats.releases_racing_unmap += 1,
            Effect::EndedLate(at) => self.end_batch(region, &[at]),
            Effect::Counted(at, reader) => {
                let lease = &mut self.book.leases[at];
                lease.counted.push(reader);
                if lease.counted.len() as u32 == lease.terms.readers {
                    lease.released_out = true;
                    self.end_batch(region, &[at]);
                }
            }
        }
        Ok(())
    }

    /// The owner's unmap of `region` completed: it forgot the region and
    /// its leases.
    pub(super) fn region_gone(&mut self, region: u64) {
        for &at in self.book.by_region.get(&region).into_iter().flatten() {
            let lease = &mut self.book.leases[at];
            lease.region_gone = true;
            lease.in_live_list = false;
        }
        self.book.ended_log.remove(&region);
        self.book.ended_order.remove(&region);
    }

    /// How a lease may have ended by now, if it has: `None` while it is
    /// live and unexpired, so its future must not resolve.
    fn may_end_as(&self, lease: &SimLease) -> Option<LeaseEnd> {
        if lease.released_out {
            return Some(LeaseEnd::Released);
        }
        let unmapping = self
            .regions
            .get(&lease.region)
            .is_some_and(|r| r.state != RegionState::Live);
        let ended = lease.region_gone
            || unmapping
            || self.shut_down
            || !lease.in_live_list
            || self.clock.expired(lease.terms.expires_at);
        ended.then_some(LeaseEnd::Withdrawn)
    }

    /// Invariants 7 and 8, after every step: each lease's future resolves
    /// only as the lease ended (`Released` only after as many distinct
    /// readers released it as it allows), at once when its last reader
    /// released it or its region's unmap completed; and the owner's memory
    /// of the leases of every region touched in the step is bounded.
    pub(super) fn check_leases(&mut self) -> Checked {
        let mut still = 0;
        for nth in 0..self.book.pending.len() {
            let at = self.book.pending[nth];
            let Some(future) = self.book.leases[at].future.as_mut() else {
                continue;
            };
            let polled = future.now_or_never();
            let lease = &self.book.leases[at];
            let may = self.may_end_as(lease);
            match polled {
                Some(end) if may == Some(end) => {
                    let lease = &mut self.book.leases[at];
                    lease.future = None;
                    lease.resolved = Some(end);
                    match end {
                        LeaseEnd::Released => self.stats.leases_released += 1,
                        LeaseEnd::Withdrawn => self.stats.leases_withdrawn += 1,
                    }
                }
                Some(end) => {
                    return Err(format!(
                        "lease {at} of region {} resolved {end:?}, but {}",
                        lease.region,
                        self.lease_state(lease)
                    ));
                }
                None if lease.released_out => {
                    return Err(format!(
                        "lease {at} of region {}: its last reader released it, its future has not resolved",
                        lease.region
                    ));
                }
                None if lease.region_gone => {
                    return Err(format!(
                        "lease {at} of region {}: the region's unmap completed, its future has not resolved",
                        lease.region
                    ));
                }
                None => {
                    self.book.pending[still] = at;
                    still += 1;
                }
            }
        }
        self.book.pending.truncate(still);
        let touched = std::mem::take(&mut self.book.touched);
        for region in touched {
            self.check_memory(region)?;
        }
        Ok(())
    }

    fn lease_state(&self, lease: &SimLease) -> String {
        format!(
            "the model has it {} (released by {:?} of {} readers, expiry {:?}, the owner's time {:?}, region {:?})",
            match self.may_end_as(lease) {
                None => "live".to_string(),
                Some(end) => format!("ended, as {end:?}"),
            },
            lease.counted,
            lease.terms.readers,
            self.clock.show(lease.terms.expires_at),
            self.clock.owner.map(|t| self.clock.show(t)),
            self.regions.get(&lease.region).map(|r| r.state)
        )
    }

    /// Invariant 8 for `region`: the owner counts as live no lease its
    /// readers released and misses none that serves, and besides those
    /// it knows at most [`ENDED_REMEMBERED`] ended ones. (Of the leases
    /// the model has as ended, the owner may know those it still counts
    /// live, which serve no read, and those it remembers as ended.) Only
    /// the latest endings are asked about: an owner that remembers too
    /// many knows more than the bound of those, and one that forgets the
    /// wrong ones is caught by the reads' verdicts.
    fn check_memory(&self, region: u64) -> Checked {
        let Some(live) = self.owner.live_descriptor_leases(region) else {
            return Ok(());
        };
        let ours = || self.leases_of(region);
        let unreleased = ours().filter(|l| !l.released_out).count();
        let serving = ours().filter(|l| l.serves(&self.clock)).count();
        if live > unreleased || live < serving {
            return Err(format!(
                "region {region}: the owner counts {live} live leases; {serving} serve, {unreleased} were not released"
            ));
        }
        let Some(order) = self.book.ended_order.get(&region) else {
            return Ok(());
        };
        if order.len() <= ENDED_REMEMBERED {
            return Ok(());
        }
        let known_ended = order
            .iter()
            .rev()
            .take(ENDED_REMEMBERED + 16)
            .filter(|&&at| self.owner_knows(region, self.book.leases[at].capability))
            .count();
        if known_ended > ENDED_REMEMBERED + (live - serving) {
            return Err(format!(
                "region {region}: the owner knows {known_ended} ended leases' capabilities, counts {live} live of which {serving} serve; at most {ENDED_REMEMBERED} ended ones may be remembered"
            ));
        }
        Ok(())
    }

    /// Invariant 9, at the end: every lease's future resolved.
    pub(super) fn check_every_lease_ended(&mut self) -> Checked {
        self.check_leases()?;
        match self.book.leases.iter().position(|l| l.resolved.is_none()) {
            None => Ok(()),
            Some(at) => Err(format!(
                "lease {at} of region {}: its future never resolved",
                self.book.leases[at].region
            )),
        }
    }

    /// A read under a lease the consumers were given: mostly one that
    /// serves, sometimes one that expired a moment ago (a consumer whose
    /// clock is behind), any (stale, expired, released, or of a region
    /// gone), or the oldest of a region (which the owner may have
    /// forgotten).
    pub(super) fn lease_read(&mut self) -> Option<Read> {
        if self.book.leases.is_empty() {
            return None;
        }
        let (mut serving, mut expired) = (Vec::new(), Vec::new());
        for &at in &self.book.plain {
            let lease = &self.book.leases[at];
            if lease.serves(&self.clock) {
                serving.push(at);
            } else if lease.in_live_list {
                expired.push(at);
            }
        }
        let at = match self.rng.below(100) {
            0..=59 if !serving.is_empty() => serving[self.rng.index(serving.len())],
            60..=74 if !expired.is_empty() => expired[self.rng.index(expired.len())],
            0..=84 => self.rng.index(self.book.leases.len()),
            _ => {
                let region = self.book.leases[self.rng.index(self.book.leases.len())].region;
                self.book.by_region[&region][0]
            }
        };
        let (region, capability) = {
            let lease = &self.book.leases[at];
            (lease.region, lease.capability)
        };
        let sim_region = &self.regions[&region];
        let (base, len) = (sim_region.base, sim_region.len);
        let offset = self.rng.below(len);
        let length = 1 + self.rng.below(len - offset);
        Some(Read {
            request_id: self.fresh_request_id(),
            region,
            capability,
            address: base + offset,
            length,
        })
    }

    /// A read a hostile peer makes with a lease it saw: a forged lease
    /// capability, or a lease's capability naming another region.
    pub(super) fn hostile_lease_read(&mut self) -> Option<Read> {
        let mut read = self.lease_read()?;
        if self.rng.chance(50) {
            read.capability[self.rng.index(16)] ^= 1 << self.rng.below(8);
        } else {
            read.region = 1 + self.rng.below(self.next_region);
        }
        Some(read)
    }
}
