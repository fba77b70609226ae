//! A deterministic simulator of one owner, its consumers' endpoints and
//! its transport, driven by one `u64` seed.
//!
//! The scheduler picks, step by step, among: honest requests (from the
//! descriptors consumers were given, stale ones included); hostile ones
//! (forged capability, out of range, past the end, empty, wrapping,
//! unknown id, bytes that do not decode, duplicates of earlier requests);
//! refusals the driver decides (a sender it could not confirm);
//! batched lists of honest and hostile entries, within list bounds drawn
//! per seed; delivering requests in any order; send completions and
//! failures in any order; endpoint failures; registrations; unmaps
//! mid-read; the owner rewriting memory whose unmap finished; shutdown and
//! the transport's close.
//!
//! And descriptor leases ([`leases`]): simulated time that steps forward
//! (a little, more, or to a lease's expiry or the instant before it),
//! given to the owner before it handles requests (now and then a batch
//! goes on under the time given before, or an earlier clock reading
//! arrives, which the owner must ignore); leases of live regions for one
//! to three readers with random expiries (and terms or regions the owner
//! must refuse), handed to consumers who read under them, alone and in
//! lists, and release them over the network — once, twice, after a
//! restart with a new sender number, after the expiry — while a hostile
//! peer releases with forged capabilities, the region's own capability,
//! or another lease's capability; bursts of short leases on one region,
//! so its ended leases overflow what the owner remembers.
//!
//! Memory is simulated: a few slots of bytes, each with a version that
//! changes when the owner rewrites a slot no registration covers. The
//! transport holds a served reply's source until the send ends, and
//! copies the bytes at that moment — the latest a real transport may read
//! them.
//!
//! # Invariants, checked after every step
//!
//! 1. No payload is read from a region after its unmap completed, and a
//!    delivered payload holds the bytes of the registration it was served
//!    from.
//! 2. An unmap completes only when the transport holds no send from the
//!    region, and only for a region being unmapped.
//! 3. Each delivered request gets at most one reply, on the endpoint it
//!    came from, with its id, and exactly the one an independent model of
//!    the rules predicts (served, a given refusal, or dropped): so a
//!    forged, stale or out-of-range request never gets payload. A list
//!    gets exactly the replies the model predicts: every entry replied to
//!    once, in request order, cut into replies within the list bounds.
//! 4. Per endpoint, the transport never holds more served reads, nor more
//!    refusals, than the bound; the owner's lease count is the number of
//!    served ranges the transport holds.
//! 5. At the end, with every send ended, every unmap completed, the
//!    owner holds no lease and no endpoint, and shutdown drains.
//! 6. No read (single or list entry) is served under a descriptor lease
//!    whose expiry is at or before the time last given to the owner, or
//!    that as many distinct readers as it allows released; the model of
//!    invariant 3 predicts every lease read's verdict, `LeaseExpired`
//!    included.
//! 7. Every release gets the outcome the rules give it: counted once per
//!    reader (connection and sender) presenting the lease's capability
//!    while it is live, ignored otherwise — a duplicate, a forged, own or
//!    foreign capability, a release after the expiry or after the
//!    region's unmap started. A lease's future, polled after every step,
//!    resolves `Released` only once its last distinct reader released
//!    it, and at once then; `Withdrawn` only once it ended otherwise
//!    (expired at the owner's time, its region's unmap started, shutdown);
//!    never while it is live and unexpired; and by the time its region's
//!    unmap completed.
//! 8. The owner's memory of a region's leases stays bounded: the leases
//!    it counts live are between those that serve and those not released,
//!    and it knows at most `ENDED_REMEMBERED` ended ones besides; an
//!    ended lease the rules say it remembers is refused `LeaseExpired`,
//!    one it must have forgotten as an unknown capability.
//! 9. At the end every lease's future resolved.
//!
//! A violation names its seed and step and prints the run's last steps;
//! [`run`] replays a seed exactly. The seed test runs
//! `RDMAREG_SIM_SEEDS` seeds from `RDMAREG_SIM_FIRST_SEED`, as `cargo
//! xtask sim` sets them (`--seed S` replays one), and by default the
//! first 10,000 in an optimised build and the first 1,000 in a debug one.
//!
//! # Proof that it bites
//!
//! `Owner`'s test-only `defects` bring back mistakes an owner can make —
//! an unmap completed while leases are held, a range checked only at its
//! start, leases ended at an endpoint's failure instead of at the
//! transport's report, no bound of unfinished replies, a descriptor
//! lease's expiry not checked, every release counted as a new reader's,
//! releases counted after their region's unmap started (the owner as
//! first built, which the simulator found) — and a test per defect shows
//! the simulator finds it within the first 20 seeds.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt::Write as _;

use rdmareg_core::RdmaError;

use super::owner::{
    Action, Defects, ListLimits, Owner, OwnerConfig, Payload, Read, Refusal, SendId, UnmapStatus,
};
use super::wire;

pub(crate) use crate::sim_support::Rng;
mod leases;
mod writes;

use crate::sim_support::mix;

/// 16 random bytes, a registration's capability.
fn capability(rng: &mut Rng) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&rng.next_u64().to_le_bytes());
    out[8..].copy_from_slice(&rng.next_u64().to_le_bytes());
    out
}

/// Steps of the random phase of one run.
pub(crate) const STEPS: u32 = 200;
const SLOTS: u64 = 4;
const SLOT_STRIDE: u64 = 0x1_0000;

/// A slot of simulated memory.
#[derive(Debug)]
struct Slot {
    base: u64,
    bytes: Vec<u8>,
    version: u64,
    /// The registration covering it (live or unmapping).
    region: Option<u64>,
}

/// The bytes `from..from + len` of `slot` as written at `version`.
fn content(slot: u64, version: u64, from: u64, len: u64) -> Vec<u8> {
    (from..from + len)
        .map(|i| mix(slot << 48 ^ version << 24 ^ i) as u8)
        .collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RegionState {
    Live,
    Unmapping,
    /// The unmap completed: the memory is the caller's again.
    Unmapped,
}

#[derive(Debug)]
struct SimRegion {
    slot: usize,
    capability: [u8; 16],
    base: u64,
    len: u64,
    /// The slot's version while registered.
    version: u64,
    state: RegionState,
}

/// A request or a release on the network.
#[derive(Debug, Clone)]
struct Message {
    /// The endpoint a request came on; a release's connection.
    endpoint: u64,
    kind: Kind,
    /// A request's bytes, as the UCX engine encodes it (empty for a
    /// release).
    bytes: Vec<u8>,
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Read,
    /// A batched list.
    List,
    /// A release of a descriptor lease.
    Release {
        sender: u64,
        region: u64,
        capability: [u8; 16],
    },
}

#[derive(Debug)]
struct InFlight {
    endpoint: u64,
    /// What a served reply reads: one range for a single read, one per
    /// served entry for a list reply; none for a refusal.
    payloads: Vec<Payload>,
}

/// What the model says the owner must do with a delivered request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Serve,
    Refuse(Refusal),
    Drop,
}

impl Stats {
    fn add(&mut self, other: Stats) {
        self.served += other.served;
        self.delivered_bytes += other.delivered_bytes;
        self.refused += other.refused;
        self.dropped += other.dropped;
        self.unmaps_completed += other.unmaps_completed;
        self.unmaps_waited += other.unmaps_waited;
        self.leases += other.leases;
        self.lease_reads_served += other.lease_reads_served;
        self.lease_reads_expired += other.lease_reads_expired;
        self.lease_reads_forgotten += other.lease_reads_forgotten;
        self.releases_counted += other.releases_counted;
        self.releases_ignored += other.releases_ignored;
        self.releases_duplicate += other.releases_duplicate;
        self.releases_racing_unmap += other.releases_racing_unmap;
        self.leases_released += other.leases_released;
        self.leases_withdrawn += other.leases_withdrawn;
    }
}

/// A failed run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Violation {
    pub(crate) seed: u64,
    pub(crate) step: u32,
    pub(crate) message: String,
}

/// What a clean run did.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Stats {
    pub(crate) served: u64,
    pub(crate) delivered_bytes: u64,
    pub(crate) refused: u64,
    pub(crate) dropped: u64,
    pub(crate) unmaps_completed: u64,
    pub(crate) unmaps_waited: u64,
    /// Descriptor leases the owner granted.
    pub(crate) leases: u64,
    /// Reads under a lease served, refused `LeaseExpired`, and refused as
    /// an unknown capability (an ended lease the owner forgot).
    pub(crate) lease_reads_served: u64,
    pub(crate) lease_reads_expired: u64,
    pub(crate) lease_reads_forgotten: u64,
    /// Releases the owner counted, and ignored.
    pub(crate) releases_counted: u64,
    pub(crate) releases_ignored: u64,
    /// Releases ignored as a reader's second, and as racing the unmap of
    /// their region.
    pub(crate) releases_duplicate: u64,
    pub(crate) releases_racing_unmap: u64,
    /// Leases' futures resolved `Released`, and `Withdrawn`.
    pub(crate) leases_released: u64,
    pub(crate) leases_withdrawn: u64,
}

struct Sim {
    step: u32,
    rng: Rng,
    bound: u32,
    owner: Owner<u64>,
    slots: Vec<Slot>,
    regions: BTreeMap<u64, SimRegion>,
    next_region: u64,
    /// Every descriptor ever handed out: consumers keep stale ones.
    descriptors: Vec<u64>,
    endpoints: Vec<u64>,
    failed: BTreeSet<u64>,
    /// Failed endpoints with sends the transport has not ended: the owner
    /// drops their requests.
    dropping: BTreeSet<u64>,
    /// The bounds lists are served within, drawn per seed.
    limits: ListLimits,
    next_endpoint: u64,
    next_request: u64,
    network: Vec<Message>,
    sent: Vec<Message>,
    transport: BTreeMap<SendId, InFlight>,
    shut_down: bool,
    closed: bool,
    drained: bool,
    stats: Stats,
    /// The lease actions' random numbers, apart, so that the other
    /// actions are drawn as without leases.
    lease_rng: Rng,
    clock: leases::Clock,
    book: leases::Book,
    log: Option<VecDeque<String>>,
}

type Checked = Result<(), String>;

impl Sim {
    fn new(seed: u64, defects: Defects, verbose: bool) -> Sim {
        let mut rng = Rng::new(seed);
        let bound = 1 + rng.below(4) as u32;
        let limits = ListLimits {
            max_entry: 8 + rng.below(48),
            max_total: 16 + rng.below(112),
            entries_per_reply: 1 + rng.below(4) as usize,
            payload_per_reply: 8 + rng.below(56),
        };
        let mut owner = Owner::new(OwnerConfig {
            max_replies_per_endpoint: bound,
            ..OwnerConfig::default()
        });
        owner.defects = defects;
        let slots = (0..SLOTS)
            .map(|slot| {
                let len = 1 + rng.below(64) as usize;
                Slot {
                    base: SLOT_STRIDE * (slot + 1),
                    bytes: content(slot, 0, 0, len as u64),
                    version: 0,
                    region: None,
                }
            })
            .collect();
        Sim {
            step: 0,
            rng,
            bound,
            owner,
            slots,
            regions: BTreeMap::new(),
            next_region: 1,
            descriptors: Vec::new(),
            endpoints: vec![1, 2, 3],
            failed: BTreeSet::new(),
            dropping: BTreeSet::new(),
            limits,
            next_endpoint: 4,
            next_request: 1,
            network: Vec::new(),
            sent: Vec::new(),
            transport: BTreeMap::new(),
            shut_down: false,
            closed: false,
            drained: false,
            stats: Stats::default(),
            lease_rng: Rng::new(mix(seed ^ 0x6c65_6173_6573)),
            clock: leases::Clock::new(),
            book: leases::Book::default(),
            log: verbose.then(VecDeque::new),
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
            self.lease_step()?;
            self.check_counts()?;
            self.check_leases()?;
            if self.closed {
                break;
            }
        }
        self.step = STEPS;
        self.finish()
    }

    fn random_step(&mut self) -> Checked {
        match self.rng.below(100) {
            0..=14 => self.honest_request(),
            15..=19 => self.list_request(),
            20..=27 => self.hostile_request(),
            28..=45 => self.deliver(),
            46..=47 => self.duplicate(),
            48..=69 => self.end_send(true),
            70..=73 => self.end_send(false),
            74..=75 => self.fail_endpoint(),
            76..=83 => self.register(),
            84..=91 => self.unmap(),
            92..=93 => self.driver_refusal(),
            94..=97 => self.rewrite(),
            98 if self.rng.chance(20) => self.shutdown(),
            99 if self.shut_down && self.rng.chance(30) => self.close_transport(),
            _ => Ok(()),
        }
    }

    fn fresh_request_id(&mut self) -> u64 {
        self.next_request += 1;
        self.next_request
    }

    fn live_endpoint(&mut self) -> u64 {
        if self.endpoints.is_empty() {
            self.endpoints.push(self.next_endpoint);
            self.next_endpoint += 1;
        }
        self.endpoints[self.rng.index(self.endpoints.len())]
    }

    fn send(&mut self, endpoint: u64, bytes: Vec<u8>) {
        self.network.push(Message {
            endpoint,
            kind: Kind::Read,
            bytes,
        });
    }

    /// A read inside a descriptor the consumers were given, mostly of a
    /// live registration, sometimes of one that is gone.
    fn honest_read(&mut self) -> Option<Read> {
        if self.descriptors.is_empty() {
            return None;
        }
        let live: Vec<u64> = self
            .regions
            .iter()
            .filter(|(_, r)| r.state == RegionState::Live)
            .map(|(&id, _)| id)
            .collect();
        let id = if !live.is_empty() && self.rng.chance(85) {
            live[self.rng.index(live.len())]
        } else {
            self.descriptors[self.rng.index(self.descriptors.len())]
        };
        let region = &self.regions[&id];
        let (base, len, capability) = (region.base, region.len, region.capability);
        let offset = self.rng.below(len);
        let length = 1 + self.rng.below(len - offset);
        Some(Read {
            request_id: self.fresh_request_id(),
            region: id,
            capability,
            address: base + offset,
            length,
        })
    }

    fn honest_request(&mut self) -> Checked {
        if let Some(read) = self.honest_read() {
            let endpoint = self.live_endpoint();
            self.send(endpoint, wire::encode_request(&read).to_vec());
        }
        Ok(())
    }

    /// A read a hostile peer makes of a descriptor it saw: a forged
    /// capability, a range past the end, before the start, empty, wrapping
    /// or just past the end, or an id never given out.
    fn hostile_read(&mut self) -> Option<Read> {
        let &id = self
            .descriptors
            .get(self.rng.index(self.descriptors.len().max(1)))?;
        let region = &self.regions[&id];
        let (base, len, capability) = (region.base, region.len, region.capability);
        let honest = Read {
            request_id: self.fresh_request_id(),
            region: id,
            capability,
            address: base,
            length: len,
        };
        Some(match self.rng.below(7) {
            0 => {
                let mut forged = capability;
                forged[self.rng.index(16)] ^= 1 << self.rng.below(8);
                Read {
                    capability: forged,
                    ..honest
                }
            }
            1 => Read {
                address: base + self.rng.below(len),
                length: len + 1 + self.rng.below(16),
                ..honest
            },
            2 => Read {
                address: base.wrapping_sub(1 + self.rng.below(16)),
                length: 1 + self.rng.below(len),
                ..honest
            },
            3 => Read {
                length: 0,
                ..honest
            },
            4 => Read {
                address: u64::MAX - self.rng.below(4),
                length: 2 + self.rng.below(8),
                ..honest
            },
            5 => Read {
                region: self.next_region + self.rng.below(3),
                ..honest
            },
            _ => Read {
                address: base + len,
                length: 1,
                ..honest
            },
        })
    }

    fn hostile_request(&mut self) -> Checked {
        let endpoint = self.live_endpoint();
        let Some(read) = self.hostile_read() else {
            self.send(endpoint, vec![1, 2, 3]);
            return Ok(());
        };
        let mut bytes = wire::encode_request(&read).to_vec();
        if self.rng.chance(12) {
            match self.rng.below(3) {
                0 => bytes.truncate(self.rng.index(bytes.len())),
                1 => bytes[1 + self.rng.index(3)] = 1,
                _ => bytes.push(0),
            }
        }
        self.send(endpoint, bytes);
        Ok(())
    }

    /// A batched list of honest and hostile entries, now and then cut
    /// short or padded.
    fn list_request(&mut self) -> Checked {
        let count = 1 + self.rng.below(8);
        let mut entries = Vec::new();
        for _ in 0..count {
            let read = if self.rng.chance(25) {
                self.hostile_read()
            } else {
                self.honest_read()
            };
            entries.extend(read);
        }
        let Some(mut bytes) = wire::encode_list_request(&entries) else {
            return Ok(());
        };
        if self.rng.chance(5) {
            if self.rng.chance(50) {
                bytes.truncate(self.rng.index(bytes.len()));
            } else {
                bytes.push(0);
            }
        }
        let endpoint = self.live_endpoint();
        self.network.push(Message {
            endpoint,
            kind: Kind::List,
            bytes,
        });
        Ok(())
    }

    /// The driver refuses a request it could not confirm the sender of.
    fn driver_refusal(&mut self) -> Checked {
        let endpoint = self.live_endpoint();
        let request_id = self.fresh_request_id();
        let refusals = self
            .transport
            .values()
            .filter(|s| s.endpoint == endpoint && s.payloads.is_empty())
            .count();
        let dropped =
            self.closed || self.dropping.contains(&endpoint) || refusals >= self.bound as usize;
        self.owner
            .refuse_request(endpoint, request_id, Refusal::Unverified);
        match (self.owner.poll_action(), dropped) {
            (None, true) => self.stats.dropped += 1,
            (
                Some(Action::Refuse {
                    endpoint: to,
                    send,
                    request_id: id,
                    refusal: Refusal::Unverified,
                }),
                false,
            ) if to == endpoint && id == request_id => {
                self.stats.refused += 1;
                self.transport.insert(
                    send,
                    InFlight {
                        endpoint,
                        payloads: Vec::new(),
                    },
                );
            }
            (other, _) => {
                return Err(format!(
                    "a driver's refusal of {request_id} on {endpoint} (dropped expected: {dropped}) gave {other:?}"
                ));
            }
        }
        match self.owner.poll_action() {
            None => Ok(()),
            Some(action) => Err(format!("{action:?} after a driver's refusal")),
        }
    }

    /// A request sent earlier arrives again.
    fn duplicate(&mut self) -> Checked {
        if !self.sent.is_empty() {
            let message = self.sent[self.rng.index(self.sent.len())].clone();
            self.network.push(message);
        }
        Ok(())
    }

    /// The model: what the owner must do with `bytes` from `endpoint`.
    fn expect(&self, endpoint: u64, bytes: &[u8]) -> (u64, Expect) {
        let (mut served, mut refusals) = (0, 0);
        for send in self.transport.values().filter(|s| s.endpoint == endpoint) {
            if send.payloads.is_empty() {
                refusals += 1;
            } else {
                served += send.payloads.len();
            }
        }
        let (request_id, verdict) = match wire::decode_request(bytes) {
            Err(_) => (
                wire::request_id_of_malformed(bytes),
                Err(Refusal::Malformed),
            ),
            Ok(read) => (read.request_id, self.verdict(&read, served)),
        };
        let expect = match verdict {
            _ if self.closed || self.dropping.contains(&endpoint) => Expect::Drop,
            Ok(()) => Expect::Serve,
            Err(_) if refusals >= self.bound as usize => Expect::Drop,
            Err(refusal) => Expect::Refuse(refusal),
        };
        (request_id, expect)
    }

    fn verdict(&self, read: &Read, served_pending: usize) -> Result<(), Refusal> {
        let region = self
            .regions
            .get(&read.region)
            .filter(|r| r.state != RegionState::Unmapped)
            .ok_or(Refusal::RegionUnknown)?;
        let lease_ended = region.capability != read.capability
            && match self.judge_lease(read.region, &read.capability) {
                leases::Judged::NotALease => return Err(Refusal::CapabilityMismatch),
                leases::Judged::Serves => false,
                leases::Judged::Ended => true,
            };
        if region.state == RegionState::Unmapping {
            return Err(Refusal::Deregistering);
        }
        if lease_ended {
            return Err(Refusal::LeaseExpired);
        }
        let (start, end) = (
            u128::from(read.address),
            u128::from(read.address) + u128::from(read.length),
        );
        let inside = read.length > 0
            && start >= u128::from(region.base)
            && end <= u128::from(region.base) + u128::from(region.len);
        if !inside {
            return Err(Refusal::OutOfRange);
        }
        if served_pending >= self.bound as usize {
            return Err(Refusal::Busy);
        }
        Ok(())
    }

    fn deliver(&mut self) -> Checked {
        self.deliver_timed(true)
    }

    /// Delivers a message from the network, in any order; the driver gives
    /// the owner the time first, or (`give_time` false) handles it as one
    /// more of a batch under the time given before.
    fn deliver_timed(&mut self, give_time: bool) -> Checked {
        if self.network.is_empty() {
            return Ok(());
        }
        let message = self.network.swap_remove(self.rng.index(self.network.len()));
        if give_time {
            self.give_time();
        }
        match message.kind {
            Kind::Read => self.deliver_one(&message)?,
            Kind::List => self.deliver_list(&message)?,
            Kind::Release {
                sender,
                region,
                capability,
            } => self.deliver_release(message.endpoint, sender, region, capability)?,
        }
        self.sent.push(message);
        if self.sent.len() > 64 {
            self.sent.swap_remove(0);
        }
        Ok(())
    }

    fn deliver_one(&mut self, message: &Message) -> Checked {
        let (request_id, expect) = self.expect(message.endpoint, &message.bytes);
        self.note(|| format!("deliver from {}: expect {expect:?}", message.endpoint));
        self.owner.handle_request(message.endpoint, &message.bytes);
        let mut replies = 0;
        while let Some(action) = self.owner.poll_action() {
            replies += 1;
            if replies > 1 {
                return Err(format!("a second reply to one request: {action:?}"));
            }
            let (endpoint, send, id, got, payload) = match action {
                Action::Serve {
                    endpoint,
                    send,
                    request_id,
                    payload,
                } => (endpoint, send, request_id, Expect::Serve, Some(payload)),
                Action::Refuse {
                    endpoint,
                    send,
                    request_id,
                    refusal,
                } => (endpoint, send, request_id, Expect::Refuse(refusal), None),
                other => return Err(format!("{other:?} in reply to a request")),
            };
            if endpoint != message.endpoint {
                return Err(format!(
                    "a request from endpoint {} replied to on {endpoint}",
                    message.endpoint
                ));
            }
            if id != request_id {
                return Err(format!("request {request_id} replied to as {id}"));
            }
            if payload.is_some() {
                let read = wire::decode_request(&message.bytes).map_err(|e| e.to_string())?;
                self.check_served(&read)?;
            }
            if got != expect {
                return Err(format!(
                    "request {request_id} from {endpoint}: expected {expect:?}, the owner chose {got:?} ({payload:?})"
                ));
            }
            if let Some(payload) = payload {
                let read = wire::decode_request(&message.bytes).map_err(|e| e.to_string())?;
                if (payload.region, payload.address, payload.length)
                    != (read.region, read.address, read.length)
                {
                    return Err(format!("served {payload:?} for {read:?}"));
                }
                self.count_lease_read(&read, Ok(()));
                self.stats.served += 1;
            } else {
                if let (Ok(read), Expect::Refuse(refusal)) =
                    (wire::decode_request(&message.bytes), got)
                {
                    self.count_lease_read(&read, Err(refusal));
                }
                self.stats.refused += 1;
            }
            self.transport.insert(
                send,
                InFlight {
                    endpoint,
                    payloads: payload.into_iter().collect(),
                },
            );
        }
        if replies == 0 {
            if expect != Expect::Drop {
                return Err(format!(
                    "request {request_id} from {}: expected {expect:?}, the owner dropped it",
                    message.endpoint
                ));
            }
            self.stats.dropped += 1;
        }
        Ok(())
    }

    /// The model of a list: the replies the owner must send, each with its
    /// entries' replies in request order (empty: all dropped).
    fn expect_list(
        &self,
        endpoint: u64,
        bytes: &[u8],
    ) -> Vec<Vec<(u64, Result<Payload, Refusal>)>> {
        let Ok(entries) = wire::decode_list_request(bytes) else {
            return Vec::new();
        };
        if self.closed || self.dropping.contains(&endpoint) {
            return Vec::new();
        }
        let (mut served, mut refusals) = (0, 0);
        for send in self.transport.values().filter(|s| s.endpoint == endpoint) {
            if send.payloads.is_empty() {
                refusals += 1;
            } else {
                served += send.payloads.len();
            }
        }
        let limits = self.limits;
        let mut total = 0u128;
        let mut parts: Vec<Vec<(u64, Result<Payload, Refusal>)>> = vec![Vec::new()];
        let mut part_bytes = 0u128;
        for read in entries {
            let within = read.length <= limits.max_entry
                && total + u128::from(read.length) <= u128::from(limits.max_total);
            let outcome = if within {
                self.verdict(&read, served).map(|()| Payload {
                    region: read.region,
                    address: read.address,
                    length: read.length,
                })
            } else {
                Err(Refusal::Malformed)
            };
            let length = outcome.map_or(0, |p| u128::from(p.length));
            if outcome.is_ok() {
                served += 1;
                total += length;
            }
            let part = parts.last_mut().expect("one part at least");
            if !part.is_empty()
                && (part.len() == limits.entries_per_reply
                    || part_bytes + length > u128::from(limits.payload_per_reply))
            {
                parts.push(Vec::new());
                part_bytes = 0;
            }
            parts
                .last_mut()
                .expect("just pushed")
                .push((read.request_id, outcome));
            part_bytes += length;
        }
        parts.retain(|part| {
            if part.iter().any(|(_, outcome)| outcome.is_ok()) {
                return true;
            }
            if refusals >= self.bound as usize {
                return false;
            }
            refusals += 1;
            true
        });
        parts
    }

    fn deliver_list(&mut self, message: &Message) -> Checked {
        let expected = self.expect_list(message.endpoint, &message.bytes);
        self.note(|| {
            format!(
                "deliver a list from {}: expect {expected:?}",
                message.endpoint
            )
        });
        self.owner
            .handle_list_request(message.endpoint, &message.bytes, self.limits);
        let mut parts = Vec::new();
        while let Some(action) = self.owner.poll_action() {
            let Action::ServeList {
                endpoint,
                send,
                entry_replies,
            } = action
            else {
                return Err(format!("{action:?} in reply to a list"));
            };
            if endpoint != message.endpoint {
                return Err(format!(
                    "a list from endpoint {} replied to on {endpoint}",
                    message.endpoint
                ));
            }
            let entries = wire::decode_list_request(&message.bytes).map_err(|e| e.to_string())?;
            for reply in &entry_replies {
                if let Some(read) = entries.iter().find(|r| r.request_id == reply.request_id) {
                    if reply.outcome.is_ok() {
                        self.check_served(read)?;
                    }
                    self.count_lease_read(read, reply.outcome.map(|_| ()));
                }
            }
            let payloads: Vec<Payload> = entry_replies
                .iter()
                .filter_map(|a| a.outcome.ok())
                .collect();
            self.stats.served += payloads.len() as u64;
            self.stats.refused += (entry_replies.len() - payloads.len()) as u64;
            self.transport.insert(send, InFlight { endpoint, payloads });
            parts.push(
                entry_replies
                    .into_iter()
                    .map(|a| (a.request_id, a.outcome))
                    .collect::<Vec<_>>(),
            );
        }
        if parts != expected {
            return Err(format!(
                "a list from {}: expected replies {expected:?}, the owner sent {parts:?}",
                message.endpoint
            ));
        }
        if parts.is_empty() {
            self.stats.dropped += 1;
        }
        Ok(())
    }

    /// The transport ends a send: it reads the source one last time (a
    /// completion delivers the bytes), then the owner hears of it.
    fn end_send(&mut self, complete: bool) -> Checked {
        if self.transport.is_empty() {
            return Ok(());
        }
        let nth = self.rng.index(self.transport.len());
        let Some(&send) = self.transport.keys().nth(nth) else {
            return Ok(());
        };
        self.end_one(send, complete)
    }

    fn end_one(&mut self, send: SendId, complete: bool) -> Checked {
        let Some(in_flight) = self.transport.remove(&send) else {
            return Ok(());
        };
        // A send to a failed endpoint only fails.
        let complete = complete && !self.failed.contains(&in_flight.endpoint);
        for &payload in &in_flight.payloads {
            let bytes = self.read_source(payload)?;
            if complete {
                self.stats.delivered_bytes += bytes.len() as u64;
            }
        }
        self.note(|| format!("send {send:?} ends (completed: {complete})"));
        if !self
            .transport
            .values()
            .any(|s| s.endpoint == in_flight.endpoint)
        {
            self.dropping.remove(&in_flight.endpoint);
        }
        let known = if complete {
            self.owner.send_completed(send)
        } else {
            self.owner.send_failed(send)
        };
        if !known {
            return Err(format!("the owner did not know its send {send:?}"));
        }
        self.take_unmaps()
    }

    /// What the transport reads for `payload`, checked against the
    /// registration it was served from.
    fn read_source(&self, payload: Payload) -> Result<Vec<u8>, String> {
        let region = self
            .regions
            .get(&payload.region)
            .ok_or_else(|| format!("{payload:?} names no region the consumers knew"))?;
        if region.state == RegionState::Unmapped {
            return Err(format!(
                "the transport reads region {} after its unmap completed",
                payload.region
            ));
        }
        let slot = &self.slots[region.slot];
        let offset = payload.address.wrapping_sub(slot.base);
        let end = offset.checked_add(payload.length);
        let bytes = match end {
            Some(end) if payload.address >= region.base && end <= region.len => {
                slot.bytes[offset as usize..end as usize].to_vec()
            }
            _ => {
                return Err(format!(
                    "{payload:?} reads outside region {} ({:#x}+{})",
                    payload.region, region.base, region.len
                ));
            }
        };
        if bytes != content(region.slot as u64, region.version, offset, payload.length) {
            return Err(format!(
                "region {} holds bytes of another version than its registration's",
                payload.region
            ));
        }
        Ok(bytes)
    }

    fn fail_endpoint(&mut self) -> Checked {
        if self.endpoints.is_empty() {
            return Ok(());
        }
        let endpoint = self
            .endpoints
            .swap_remove(self.rng.index(self.endpoints.len()));
        self.failed.insert(endpoint);
        if self.transport.values().any(|s| s.endpoint == endpoint) {
            self.dropping.insert(endpoint);
        }
        self.note(|| format!("endpoint {endpoint} fails"));
        self.owner.endpoint_failed(endpoint);
        self.endpoints.push(self.next_endpoint);
        self.next_endpoint += 1;
        self.take_unmaps()
    }

    fn register(&mut self) -> Checked {
        let free: Vec<usize> = (0..self.slots.len())
            .filter(|&s| self.slots[s].region.is_none())
            .collect();
        if free.is_empty() {
            return Ok(());
        }
        let slot = free[self.rng.index(free.len())];
        let id = self.next_region;
        let capability = capability(&mut self.rng);
        let (base, len) = (self.slots[slot].base, self.slots[slot].bytes.len() as u64);
        let result = self.owner.register(id, capability, base, len);
        self.note(|| format!("register {id} in slot {slot}: {result:?}"));
        if self.shut_down {
            return match result {
                Err(RdmaError::ShuttingDown) => Ok(()),
                other => Err(format!("a register after shutdown returned {other:?}")),
            };
        }
        result.map_err(|e| format!("register {id}: {e}"))?;
        self.next_region += 1;
        self.slots[slot].region = Some(id);
        self.regions.insert(
            id,
            SimRegion {
                slot,
                capability,
                base,
                len,
                version: self.slots[slot].version,
                state: RegionState::Live,
            },
        );
        self.descriptors.push(id);
        Ok(())
    }

    fn unmap(&mut self) -> Checked {
        let ids: Vec<u64> = self
            .regions
            .iter()
            .filter(|(_, r)| r.state != RegionState::Unmapped || self.rng.chance(5))
            .map(|(&id, _)| id)
            .collect();
        if ids.is_empty() {
            return Ok(());
        }
        let id = ids[self.rng.index(ids.len())];
        let status = self.owner.unmap(id);
        self.note(|| format!("unmap {id}: {status:?}"));
        let region = self.regions.get_mut(&id).ok_or("unknown region")?;
        match (region.state, status) {
            (RegionState::Unmapped, UnmapStatus::NotRegistered) => {}
            (RegionState::Live | RegionState::Unmapping, UnmapStatus::Waiting) => {
                region.state = RegionState::Unmapping;
                if self
                    .transport
                    .values()
                    .any(|s| s.payloads.iter().any(|p| p.region == id))
                {
                    self.stats.unmaps_waited += 1;
                }
            }
            (state, status) => return Err(format!("unmap of a {state:?} region: {status:?}")),
        }
        self.take_unmaps()
    }

    /// The owner's program writes memory no registration covers.
    fn rewrite(&mut self) -> Checked {
        let slot = self.rng.index(self.slots.len());
        let entry = &mut self.slots[slot];
        if entry.region.is_none() {
            entry.version += 1;
            entry.bytes = content(slot as u64, entry.version, 0, entry.bytes.len() as u64);
            self.note(|| format!("slot {slot} rewritten"));
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
            if region.state == RegionState::Live {
                region.state = RegionState::Unmapping;
            }
        }
        self.owner.shutdown();
        self.take_unmaps()
    }

    /// The transport is destroyed: its sends stop reading (checked as a
    /// last read each) and never complete.
    fn close_transport(&mut self) -> Checked {
        self.note(|| "transport closed".into());
        for in_flight in std::mem::take(&mut self.transport).into_values() {
            for &payload in &in_flight.payloads {
                self.read_source(payload)?;
            }
        }
        self.closed = true;
        self.owner.transport_closed();
        self.take_unmaps()
    }

    /// Actions outside a reply: finished unmaps and the drained report.
    fn take_unmaps(&mut self) -> Checked {
        while let Some(action) = self.owner.poll_action() {
            match action {
                Action::Unmapped { region } => {
                    if self
                        .transport
                        .values()
                        .any(|s| s.payloads.iter().any(|p| p.region == region))
                    {
                        return Err(format!(
                            "unmap of region {region} completed while the transport still sends from it"
                        ));
                    }
                    let entry = self
                        .regions
                        .get_mut(&region)
                        .ok_or_else(|| format!("unmapped unknown region {region}"))?;
                    if entry.state != RegionState::Unmapping {
                        return Err(format!("unmapped a {:?} region {region}", entry.state));
                    }
                    entry.state = RegionState::Unmapped;
                    self.slots[entry.slot].region = None;
                    self.region_gone(region);
                    self.stats.unmaps_completed += 1;
                    self.note(|| format!("region {region} unmapped"));
                }
                Action::Drained => {
                    let open = self
                        .regions
                        .values()
                        .any(|r| r.state != RegionState::Unmapped);
                    if !self.shut_down || self.drained || open {
                        return Err("drained reported early or twice".into());
                    }
                    self.drained = true;
                }
                other => return Err(format!("{other:?} with no request to reply to")),
            }
        }
        Ok(())
    }

    fn check_counts(&self) -> Checked {
        let mut per_endpoint: Vec<(u64, u32, u32)> = Vec::new();
        let mut served = 0;
        for send in self.transport.values() {
            let at = match per_endpoint.iter().position(|e| e.0 == send.endpoint) {
                Some(at) => at,
                None => {
                    per_endpoint.push((send.endpoint, 0, 0));
                    per_endpoint.len() - 1
                }
            };
            if send.payloads.is_empty() {
                per_endpoint[at].2 += 1;
            } else {
                per_endpoint[at].1 += send.payloads.len() as u32;
                served += send.payloads.len();
            }
        }
        for (endpoint, served, refusals) in per_endpoint {
            if served > self.bound || refusals > self.bound {
                return Err(format!(
                    "endpoint {endpoint} holds {served} served replies and {refusals} refusals, bound {}",
                    self.bound
                ));
            }
        }
        if self.owner.leases_in_flight() != served {
            return Err(format!(
                "the owner counts {} leases, the transport sends {served} replies",
                self.owner.leases_in_flight()
            ));
        }
        Ok(())
    }

    /// Delivers what is left, ends every send, then checks that every
    /// unmap completed and that shutdown drains.
    fn finish(&mut self) -> Checked {
        while !self.network.is_empty() {
            self.deliver()?;
        }
        while let Some(&send) = self.transport.keys().next() {
            let complete = self.rng.chance(80);
            self.end_one(send, complete)?;
        }
        self.check_counts()?;
        if let Some((id, _)) = self
            .regions
            .iter()
            .find(|(_, r)| r.state == RegionState::Unmapping)
        {
            return Err(format!("the unmap of region {id} never completed"));
        }
        if self.owner.endpoints() != 0 {
            return Err(format!(
                "{} endpoints left with nothing in flight",
                self.owner.endpoints()
            ));
        }
        self.shutdown()?;
        if !self.closed {
            self.close_transport()?;
        }
        if !self.drained {
            return Err("shutdown never drained".into());
        }
        self.check_every_lease_ended()
    }
}

/// Runs `seed` with the owner's `defects` switched on.
pub(crate) fn run_with(seed: u64, defects: Defects) -> Result<Stats, Violation> {
    let mut sim = Sim::new(seed, defects, false);
    match sim.run() {
        Ok(()) => Ok(sim.stats),
        Err(message) => Err(Violation {
            seed,
            step: sim.step,
            message,
        }),
    }
}

/// Runs `seed` against the owner as built.
pub(crate) fn run(seed: u64) -> Result<Stats, Violation> {
    run_with(seed, Defects::default())
}

/// Replays `seed` and returns its failure with its last steps.
pub(crate) fn replay(seed: u64, defects: Defects) -> String {
    let mut sim = Sim::new(seed, defects, true);
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
mod tests {
    use super::*;
    use std::time::Instant;

    use crate::sim_support::seeds;

    /// The first of seeds `0..limit` on which the simulator finds a
    /// violation with `defects` switched on.
    fn first_failure(defects: Defects, limit: u64) -> Option<Violation> {
        (0..limit).find_map(|seed| run_with(seed, defects).err())
    }

    fn caught(defects: Defects, limit: u64) -> Violation {
        let found = first_failure(defects, limit)
            .unwrap_or_else(|| panic!("{defects:?} not caught in {limit} seeds"));
        eprintln!(
            "{defects:?}: caught at seed {} step {}: {}",
            found.seed, found.step, found.message
        );
        found
    }

    /// The owner as built keeps every invariant over the seeds of
    /// `seeds()`, and enough seeds exercise what they claim to: served
    /// bytes, refusals, dropped requests, unmaps that had to wait. A replay
    /// of one seed prints its last steps.
    #[test]
    fn every_seed_keeps_every_invariant() {
        let seeds = seeds();
        let count = seeds.end - seeds.start;
        let started = Instant::now();
        let mut total = Stats::default();
        for seed in seeds.clone() {
            match run(seed) {
                Ok(stats) => total.add(stats),
                Err(violation) => panic!(
                    "seed {} step {}: {}\n{}",
                    violation.seed,
                    violation.step,
                    violation.message,
                    replay(violation.seed, Defects::default())
                ),
            }
        }
        if count == 1 {
            eprintln!("{}", replay(seeds.start, Defects::default()));
        }
        eprintln!("seeds {seeds:?}: {:?}, {total:?}", started.elapsed());
        if count < 1_000 {
            return;
        }
        assert!(total.served > count && total.refused > count, "{total:?}");
        assert!(total.unmaps_waited > count / 10, "{total:?}");
        assert!(total.dropped > 0 && total.delivered_bytes > 0, "{total:?}");
        assert!(
            total.lease_reads_served > count / 2 && total.lease_reads_expired > count / 5,
            "{total:?}"
        );
        assert!(total.lease_reads_forgotten > count / 200, "{total:?}");
        assert!(
            total.leases_released > count && total.leases_withdrawn > count,
            "{total:?}"
        );
        assert!(
            total.releases_counted > count && total.releases_ignored > count,
            "{total:?}"
        );
        assert!(
            total.releases_duplicate > count / 10 && total.releases_racing_unmap > count / 10,
            "{total:?}"
        );
    }

    /// A seed replays exactly: the same violation at the same step, the
    /// same counts of a clean run.
    #[test]
    fn a_seed_replays_exactly() {
        let defects = Defects {
            unmap_ignores_leases: true,
            ..Defects::default()
        };
        let first = first_failure(defects, 100).expect("caught");
        assert_eq!(run_with(first.seed, defects).err(), Some(first));
        let (a, b) = (run(7).unwrap(), run(7).unwrap());
        assert_eq!(
            (a.served, a.refused, a.dropped, a.delivered_bytes),
            (b.served, b.refused, b.dropped, b.delivered_bytes)
        );
        let leases = |s: Stats| {
            (
                s.leases,
                s.lease_reads_served,
                s.lease_reads_expired,
                s.releases_counted,
                s.leases_released,
                s.leases_withdrawn,
            )
        };
        assert_eq!(leases(a), leases(b));
    }

    /// Completing an unmap while a reply still sends from the region is
    /// caught within the first 20 seeds, by invariant 2.
    #[test]
    fn the_simulator_finds_an_unmap_that_ignores_leases() {
        let defects = Defects {
            unmap_ignores_leases: true,
            ..Defects::default()
        };
        let found = caught(defects, 20);
        assert!(found.message.contains("still sends from it"), "{found:?}");
    }

    /// Serving a read that starts inside a region but ends past it is
    /// caught within the first 20 seeds, by invariant 3.
    #[test]
    fn the_simulator_finds_a_read_past_the_region_end() {
        let defects = Defects {
            range_end_unchecked: true,
            ..Defects::default()
        };
        let found = caught(defects, 20);
        assert!(found.message.contains("OutOfRange"), "{found:?}");
    }

    /// Serving every valid read whatever the endpoint has unfinished (the
    /// owner before its bound of unfinished replies) is caught within the
    /// first 20 seeds.
    #[test]
    fn the_simulator_finds_unbounded_replies() {
        let defects = Defects {
            unbounded_replies: true,
            ..Defects::default()
        };
        caught(defects, 20);
    }

    /// Ending a failed endpoint's leases before the transport reported its
    /// sends is caught within the first 20 seeds (an unmap completed while
    /// the transport still sends, or a send ending that the owner had
    /// already forgotten).
    #[test]
    fn the_simulator_finds_leases_ended_at_an_endpoint_failure() {
        let defects = Defects {
            endpoint_failure_ends_leases: true,
            ..Defects::default()
        };
        caught(defects, 20);
    }

    /// Judging reads under a descriptor lease as if no time had been given
    /// — a lease that never expires — is caught within the first 20
    /// seeds: a read served under a lease whose expiry the owner's time
    /// had reached (invariant 6).
    #[test]
    fn the_simulator_finds_reads_served_past_a_lease_expiry() {
        let defects = Defects {
            lease_expiry_unchecked: true,
            ..Defects::default()
        };
        let found = caught(defects, 20);
        assert!(found.message.contains("which expired at"), "{found:?}");
    }

    /// Counting every release as a new reader's — no dedupe per
    /// connection and sender, so a reader releasing twice or a replayed
    /// release spends another reader's share — is caught within the
    /// first 20 seeds: a duplicate counted where the rules say it is
    /// ignored (invariant 7).
    #[test]
    fn the_simulator_finds_a_release_counted_twice() {
        let defects = Defects {
            every_release_counts: true,
            ..Defects::default()
        };
        let found = caught(defects, 20);
        assert!(
            found
                .message
                .contains("expected [Ignored(AlreadyReleased)]"),
            "{found:?}"
        );
    }

    /// Counting releases of a region whose unmap started — how the owner
    /// was built before the simulator found it — is caught within the
    /// first 20 seeds: a lease the unmap ended is released, and its
    /// waiter would hear `Released` (invariant 7).
    #[test]
    fn the_simulator_finds_a_lease_released_after_its_unmap_started() {
        let defects = Defects {
            releases_count_while_unmapping: true,
            ..Defects::default()
        };
        let found = caught(defects, 20);
        assert!(
            found.message.contains("expected [Ignored(AlreadyEnded)]"),
            "{found:?}"
        );
    }
}
