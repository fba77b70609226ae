//! The owner's side of a served read or write, as a state machine with no
//! I/O and no clock: admission of each request against the live
//! registrations, read leases and write holds, the per-endpoint bound of
//! unfinished replies, and unmaps that wait for every lease and hold.
//! Served writes are [`writes`]'.
//!
//! # Driving it
//!
//! The driver (the transport-specific engine) feeds [`Owner`] what
//! happened and performs what [`Owner::poll_action`] returns, in order:
//!
//! 1. [`Owner::register`] after the transport registered a range,
//!    [`Owner::unmap`] when a caller asks to unmap one.
//! 2. [`Owner::handle_request`] (UCX bytes, see [`wire`]) or
//!    [`Owner::handle_read`] (a request the driver decoded itself) for
//!    each request that arrived, with the endpoint to reply on;
//!    [`Owner::handle_list_request`] or [`Owner::handle_list`] for a
//!    batched list.
//! 3. Then [`Owner::poll_action`] until it returns `None`: an
//!    [`Action::Serve`] is a send of the reply header and the payload
//!    `[address, address + length)` of a registered region; an
//!    [`Action::Refuse`] a send of a refusal header without payload; an
//!    [`Action::ServeList`] a list reply header and its served entries'
//!    bytes back to back; an
//!    [`Action::Unmapped`] says no send reads the region any more, so the
//!    driver deregisters it and completes every caller waiting on its unmap.
//! 4. [`Owner::send_completed`] or [`Owner::send_failed`] when the
//!    transport reports a send of step 3 ended, and not earlier: until
//!    then the transport may still read the region.
//! 5. [`Owner::endpoint_failed`] when an endpoint dies,
//!    [`Owner::shutdown`] and then [`Owner::transport_closed`] at teardown.
//! 6. Served writes ([`writes`]): [`Owner::handle_write_request`] or
//!    [`Owner::handle_write`] for each write that arrived;
//!    [`Action::Receive`] is a receive of its payload into the
//!    registration, reported with [`Owner::receive_completed`] or
//!    [`Owner::receive_failed`]; [`Action::Acknowledge`] a send of the
//!    reply header that says the bytes are in.
//!    [`Owner::handle_write_list_request`] or [`Owner::handle_write_list`]
//!    for a write list ([`write_lists`]), answered by one
//!    [`Action::AcknowledgeList`]. [`Owner::take_written`]
//!    when a caller asks which ranges writes filled.
//! 7. With descriptor leases (`super::leases`): [`Owner::register_lease`]
//!    to hand a region out under one, [`Owner::handle_release`] for each
//!    release that arrived, and [`Owner::set_time`] before step 2 once
//!    [`Owner::is_leasing`].
//!
//! Endpoints are ids the driver chooses (`E`): an address, a counter, an
//! entry of an address vector. A driver gives a failed endpoint's id to a
//! new endpoint only after the transport ended the failed one's sends (UCX
//! fails them before it frees the endpoint). The owner never reads a
//! clock: only a lease's expiry depends on time, and the driver gives it.
//!
//! Take each action out before performing it, and hold no borrow of the
//! owner across the send: a transport may run handlers inside a send (UCX
//! over loopback delivers there), and those feed the owner again. A send
//! that completes or fails inside the call is reported at once.
//!
//! # Rules
//!
//! - **A request is served only if** it names a registration the owner
//!   holds, proves it was given that registration's descriptor (its
//!   16-byte capability), the registration is not being unmapped, and
//!   `[address, address + length)` is non-empty and lies inside the range
//!   that was registered. Anything else gets a typed [`Refusal`] and not
//!   one byte: region ids, capabilities and addresses come from peers, and
//!   the transports check nothing on these paths. The checks run in that
//!   order, capability before state, so a peer without the capability
//!   learns nothing about the registration.
//! - **A served reply holds a read lease** on its region from the
//!   [`Action::Serve`] until the driver reports the send's end. An unmap
//!   marks the region unmapping at once (new reads are refused
//!   [`Refusal::Deregistering`]) and is finished — [`Action::Unmapped`] —
//!   only when the last lease ended, so the caller's permission to free
//!   the memory comes only after the transport stopped reading it. Every
//!   unmap submitted meanwhile joins the same wait; an unmap of an id the
//!   owner does not hold completes at once ([`UnmapStatus::NotRegistered`]).
//! - **Region ids are the driver's and never reused by it**, and every
//!   registration gets a fresh capability, so a descriptor of an earlier
//!   registration names nothing; the owner refuses to register an id it
//!   holds.
//! - **An endpoint holds a bounded number of unfinished replies**
//!   ([`OwnerConfig::max_replies_per_endpoint`]): a reply holds its lease
//!   and its send until the consumer takes the bytes, and a consumer that
//!   asks and never takes would otherwise grow the owner's sends, leases
//!   and stalled unmaps without limit. A valid read past the bound is
//!   refused [`Refusal::Busy`] (a transient error at the consumer). A read
//!   that is wrong in itself is refused for that, whatever the load.
//!   Refusals are bounded the same way, apart: past the bound a request is
//!   dropped without a reply (its reader runs into its deadline), since a
//!   consumer that does not take its refusals would otherwise grow them.
//!   An endpoint's record is forgotten when both its counts are back at
//!   zero, so the driver may give its id to a later endpoint.
//! - **A batched list** is judged entry by entry, each exactly as a
//!   single read (one lease and one place under the endpoint's bound per
//!   served entry; past the bound an entry is busy), so a list is no way
//!   around a rule. An entry longer than [`ListLimits::max_entry`], or one
//!   that would take the list's served bytes past
//!   [`ListLimits::max_total`], is refused [`Refusal::Malformed`]: the
//!   consumer expects a list's bytes in one eager payload. The entries' replies
//!   go out in request order, cut into replies of at most
//!   [`ListLimits::entries_per_reply`] entries and
//!   [`ListLimits::payload_per_reply`] bytes; a reply that serves nothing
//!   counts as one refusal. A list that does not decode is dropped: it has
//!   no request id to trust.
//! - **An endpoint's failure ends nothing by itself.** The transport still
//!   reports each of its sends as ended (UCX and libfabric fail them), and
//!   only that ends their leases; until then the owner drops the failed
//!   endpoint's requests.
//! - **Teardown.** [`Owner::shutdown`] marks every region unmapping (an
//!   [`Action::Unmapped`] each once its leases ended) and refuses new
//!   registrations; [`Action::Drained`] follows once no lease is held and
//!   no region is left. [`Owner::transport_closed`] says the transport is
//!   destroyed and no send of it will ever read again: every send ends
//!   there, and later requests are dropped.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::hash::Hash;
use std::time::Instant;

use rdmareg_core::{Access, MAX_WRITTEN_RANGES, RdmaError, WrittenLog};
use rustc_hash::FxHashMap as HashMap;

pub mod write_lists;
pub mod writes;
pub use write_lists::WriteListLimits;
pub use writes::{ReceiveId, Write};

pub use super::refusal::Refusal;
use super::wire;
pub use rdmareg_backend::leases::{LeaseReleased, LeaseTerms, ReleaseOutcome};
use rdmareg_backend::leases::{RegionLeases, capabilities_match};

/// A read as a consumer asks it: the fields every backend's request
/// carries, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Read {
    /// Chosen by the consumer; echoed in the reply.
    pub request_id: u64,
    /// The registration's id, from the consumer's descriptor.
    pub region: u64,
    /// The registration's capability, from the consumer's descriptor.
    pub capability: [u8; 16],
    /// First byte to read, as an address in the owner's process.
    pub address: u64,
    /// How many bytes.
    pub length: u64,
}

/// Names one send the owner asked for, until the driver reports its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SendId(pub u64);

/// The bytes a served reply carries: `[address, address + length)` of the
/// registration `region`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Payload {
    /// The registration read from.
    pub region: u64,
    /// First byte, inside the registration.
    pub address: u64,
    /// Length, at least 1; the range ends inside the registration.
    pub length: u64,
}

/// What the driver must do next.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Action<E> {
    /// Send a served reply for `request_id` on `endpoint`: the header and
    /// then `payload`'s bytes, read from the registration while the send
    /// runs. Report its end with `send`.
    Serve {
        /// Where the request came from.
        endpoint: E,
        /// The send's id.
        send: SendId,
        /// The request's id, echoed.
        request_id: u64,
        /// The bytes to send.
        payload: Payload,
    },
    /// Send a refusal of `request_id` on `endpoint`, without payload.
    /// Report its end with `send`.
    Refuse {
        /// Where the request came from.
        endpoint: E,
        /// The send's id.
        send: SendId,
        /// The request's id, echoed.
        request_id: u64,
        /// Why.
        refusal: Refusal,
    },
    /// Send one reply to a batched list on `endpoint`: a header with one
    /// result per entry of this part of the list, in request order, then
    /// the served entries' bytes back to back in that order. Report its
    /// end with `send`.
    ServeList {
        /// Where the list came from.
        endpoint: E,
        /// The send's id.
        send: SendId,
        /// The entries' results this reply carries.
        entry_replies: Vec<ListEntryReply>,
    },
    /// Receive the payload of an accepted write into `[address, address +
    /// length)` of the registration `region` (copy an eager payload, or
    /// post the transport's receive straight into it), then report
    /// [`Owner::receive_completed`] or [`Owner::receive_failed`] with
    /// `receive`. The registration stays mapped until then.
    ///
    /// The bytes start `payload_offset` bytes into the message's payload:
    /// 0 for a single write, the sum of the earlier entries' lengths for
    /// an entry of a write list.
    Receive {
        /// Where the write came from.
        endpoint: E,
        /// The receive's id.
        receive: ReceiveId,
        /// The write's id, echoed in its reply.
        request_id: u64,
        /// The registration written into.
        region: u64,
        /// First byte, inside the registration.
        address: u64,
        /// Length, at least 1.
        length: u64,
        /// Where the bytes start in the message's payload.
        payload_offset: u64,
    },
    /// Send the reply to a write whose bytes are in the registration:
    /// a header saying `length` bytes were written, without payload.
    /// Report its end with `send`.
    Acknowledge {
        /// Where the write came from.
        endpoint: E,
        /// The send's id.
        send: SendId,
        /// The write's id, echoed.
        request_id: u64,
        /// Bytes written.
        length: u64,
    },
    /// Send the one reply to a write list on `endpoint`, once every
    /// accepted entry's receive ended: a list reply header with one result
    /// per entry, in request order (`Ok` with the bytes written, or why
    /// not), without payload. Report its end with `send`.
    AcknowledgeList {
        /// Where the list came from.
        endpoint: E,
        /// The send's id.
        send: SendId,
        /// The entries' results.
        entry_replies: Vec<ListEntryReply>,
    },
    /// No send reads `region` any more and the owner forgot it: deregister
    /// it with the transport and complete every caller of its unmap.
    Unmapped {
        /// The region.
        region: u64,
    },
    /// After [`Owner::shutdown`]: no lease is held and every region was
    /// unmapped.
    Drained,
}

impl<E: Copy> Action<E> {
    /// The UCX reply header of a [`Action::Serve`], [`Action::Refuse`] or
    /// [`Action::Acknowledge`].
    pub fn reply_header(&self) -> Option<[u8; wire::REPLY_LEN]> {
        let reply = match *self {
            Action::Acknowledge {
                request_id, length, ..
            } => wire::Reply {
                request_id,
                outcome: Ok(length),
            },
            Action::Serve {
                request_id,
                payload,
                ..
            } => wire::Reply {
                request_id,
                outcome: Ok(payload.length),
            },
            Action::Refuse {
                request_id,
                refusal,
                ..
            } => wire::Reply {
                request_id,
                outcome: Err(refusal),
            },
            _ => return None,
        };
        Some(reply.encode())
    }

    /// The UCX list reply header of a [`Action::ServeList`] or an
    /// [`Action::AcknowledgeList`].
    pub fn list_reply_header(&self) -> Option<Vec<u8>> {
        match self {
            Action::ServeList { entry_replies, .. }
            | Action::AcknowledgeList { entry_replies, .. } => {
                wire::encode_list_reply(entry_replies)
            }
            _ => None,
        }
    }
}

/// The owner's reply to one entry of a batched list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListEntryReply {
    /// The entry's request id, echoed.
    pub request_id: u64,
    /// The bytes to send for it, or why it is refused.
    pub outcome: Result<Payload, Refusal>,
}

/// The bounds of a batched list and of each reply to one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListLimits {
    /// Largest entry that is batched: a longer one is refused
    /// [`Refusal::Malformed`], never served in a way its consumer would not
    /// expect.
    pub max_entry: u64,
    /// Most bytes the served entries of one list take together; an entry
    /// past it is refused [`Refusal::Malformed`].
    pub max_total: u64,
    /// Most entries one reply carries: the transport's bound on a header
    /// (UCX writes a longer one past its fragment buffer). A list is
    /// replied to in several replies, in order, when it has more.
    pub entries_per_reply: usize,
    /// Most payload bytes one reply carries, except that an entry longer
    /// than this goes alone (over tcp, one fragment's payload).
    pub payload_per_reply: u64,
}

impl Default for ListLimits {
    /// The UCX engine's: entries of up to 16 KiB, 256 KiB a list, 64
    /// entries and 256 KiB a reply.
    fn default() -> Self {
        ListLimits {
            max_entry: 16 * 1024,
            max_total: 256 * 1024,
            entries_per_reply: wire::MAX_LIST_ENTRIES,
            payload_per_reply: 256 * 1024,
        }
    }
}

/// How the owner took an unmap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnmapStatus {
    /// The owner holds no such region: complete the caller with `Ok` now.
    NotRegistered,
    /// The region is unmapping; [`Action::Unmapped`] follows once its last
    /// lease ended (at once if it holds none).
    Waiting,
}

/// The owner's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OwnerConfig {
    /// Most served replies one endpoint may have unfinished, and, counted
    /// apart, most refusals (at least 1).
    pub max_replies_per_endpoint: u32,
    /// Most disjoint ranges each registration's log of written ranges
    /// keeps ([`Owner::take_written`]; at least 1).
    pub max_written_ranges: usize,
}

impl Default for OwnerConfig {
    /// 4096 replies, as the UCX engine's default, and
    /// [`MAX_WRITTEN_RANGES`] written ranges.
    fn default() -> Self {
        OwnerConfig {
            max_replies_per_endpoint: 4096,
            max_written_ranges: MAX_WRITTEN_RANGES,
        }
    }
}

/// What one endpoint has unfinished at the owner.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct EndpointLoad {
    /// Served replies: each holds a read lease and a send.
    pub served: u32,
    /// Refusal sends.
    pub refusals: u32,
}

#[derive(Debug)]
struct Region<E> {
    capability: [u8; 16],
    start: u64,
    end: u64,
    /// What peers may do with it.
    access: Access,
    /// Served replies reading from the region whose send did not end,
    /// and accepted writes whose receive did not end.
    leases: u32,
    unmapping: bool,
    /// Descriptor leases of the region, each reader named by its
    /// connection and sender number (`super::leases`).
    descriptor_leases: RegionLeases<(E, u64)>,
    /// Ranges whose writes' receives completed since the last take
    /// ([`Owner::take_written`]).
    written: WrittenLog,
}

#[derive(Debug, Default)]
struct Endpoint {
    load: EndpointLoad,
    /// Failed: its requests are dropped until its sends ended.
    failed: bool,
}

#[derive(Debug)]
struct Send<E> {
    endpoint: E,
    /// The region of each lease the send holds, one per served read it
    /// carries; empty for a refusal (counted under the refusal bound).
    leases: Leases,
    /// The accepted writes it answers (one for a single write's reply,
    /// one per accepted entry for a write list's): each holds its place
    /// under the bound of served replies until the send ended, and no
    /// lease.
    write_places: u32,
}

/// The leases of one send: a single reply holds at most one, a list reply
/// one per served entry.
#[derive(Debug)]
enum Leases {
    None,
    One(u64),
    Many(Vec<u64>),
}

impl Leases {
    fn regions(&self) -> &[u64] {
        match self {
            Leases::None => &[],
            Leases::One(region) => std::slice::from_ref(region),
            Leases::Many(regions) => regions,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Running,
    ShuttingDown,
    Closed,
}

/// Defects the engines once had, brought back on purpose so the simulator
/// can show it finds them. Test builds only.
#[cfg(test)]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Defects {
    /// Finish an unmap at once, whatever leases the region holds.
    pub(crate) unmap_ignores_leases: bool,
    /// Check only that a read starts inside its region, not that it ends
    /// there.
    pub(crate) range_end_unchecked: bool,
    /// End a failed endpoint's leases at its failure, before the transport
    /// reported its sends.
    pub(crate) endpoint_failure_ends_leases: bool,
    /// Serve every valid read, whatever the endpoint has unfinished (the
    /// owner before the bound of unfinished replies).
    pub(crate) unbounded_replies: bool,
    /// Judge reads under a descriptor lease as if no time had been given:
    /// a lease never expires.
    pub(crate) lease_expiry_unchecked: bool,
    /// Count every release as a new reader's (no per-reader dedupe): a
    /// reader releasing twice, or a replay, spends another's share.
    pub(crate) every_release_counts: bool,
    /// Count releases of a region whose unmap started (the owner before
    /// it ignored them), so a lease the unmap ended is reported released.
    pub(crate) releases_count_while_unmapping: bool,
    /// Accept writes into registrations that do not allow them.
    pub(crate) write_access_unchecked: bool,
    /// Take no hold on a region for a write's receive, so an unmap
    /// finishes while bytes are still being received into it.
    pub(crate) unmap_ignores_receives: bool,
    /// Acknowledge a write as soon as it is accepted, before its bytes
    /// were received.
    pub(crate) acknowledge_before_receive: bool,
    /// List a write's range in the log of written ranges when its receive
    /// ends, whether it completed or failed.
    pub(crate) failed_receives_listed: bool,
    /// Answer a write list when its first receive ended rather than its
    /// last, so its reply says `Ok` for bytes still being received.
    pub(crate) answer_list_before_last_receive: bool,
    /// Send a write list's replies last part first, so its writer takes
    /// its entries out of order.
    pub(crate) list_replies_out_of_order: bool,
}

/// The owner side of served reads (module docs).
///
/// # Example
///
/// One read served while an unmap waits for it:
///
/// ```
/// use rdmareg_engine::served::{Action, Owner, OwnerConfig, Read, UnmapStatus};
///
/// let mut owner: Owner<u64> = Owner::new(OwnerConfig::default());
/// owner.register(1, [7; 16], 0x1000, 4096)?;
/// let read = Read { request_id: 5, region: 1, capability: [7; 16], address: 0x1000, length: 64 };
/// owner.handle_read(9, read);
/// let Some(Action::Serve { endpoint: 9, send, payload, .. }) = owner.poll_action() else {
///     panic!("served");
/// };
/// // The driver sends the reply header and `payload`'s bytes on endpoint 9.
/// assert_eq!((payload.address, payload.length), (0x1000, 64));
/// assert_eq!(owner.unmap(1), UnmapStatus::Waiting);
/// assert_eq!(owner.poll_action(), None, "the send may still read the region");
/// owner.send_completed(send);
/// assert_eq!(owner.poll_action(), Some(Action::Unmapped { region: 1 }));
/// # Ok::<(), rdmareg_core::RdmaError>(())
/// ```
#[derive(Debug)]
pub struct Owner<E> {
    bound: u32,
    written_limit: usize,
    regions: BTreeMap<u64, Region<E>>,
    endpoints: HashMap<E, Endpoint>,
    sends: HashMap<SendId, Send<E>>,
    next_send: u64,
    actions: VecDeque<Action<E>>,
    stage: Stage,
    leases: usize,
    dropped: u64,
    refused: u64,
    drained: bool,
    /// The time the driver last gave, for descriptor leases' expiry.
    now: Option<Instant>,
    /// Whether any descriptor lease was ever registered.
    leasing: bool,
    #[cfg(test)]
    pub(crate) defects: Defects,
    /// Accepted writes whose receive did not end.
    receives: HashMap<ReceiveId, writes::Receive<E>>,
    next_receive: u64,
    /// Write lists with a receive that did not end.
    write_lists: HashMap<u64, write_lists::WriteList<E>>,
    next_write_list: u64,
    /// Readers made up for [`Defects::every_release_counts`].
    #[cfg(test)]
    made_up_readers: u64,
}

impl<E: Copy + Eq + Hash + fmt::Debug> Owner<E> {
    /// An owner with no registrations.
    pub fn new(config: OwnerConfig) -> Self {
        Owner {
            bound: config.max_replies_per_endpoint.max(1),
            written_limit: config.max_written_ranges.max(1),
            regions: BTreeMap::new(),
            endpoints: HashMap::default(),
            sends: HashMap::default(),
            next_send: 0,
            actions: VecDeque::new(),
            stage: Stage::Running,
            leases: 0,
            dropped: 0,
            refused: 0,
            drained: false,
            now: None,
            leasing: false,
            receives: HashMap::default(),
            next_receive: 0,
            write_lists: HashMap::default(),
            next_write_list: 0,
            #[cfg(test)]
            defects: Defects::default(),
            #[cfg(test)]
            made_up_readers: 0,
        }
    }

    /// Serves `[address, address + length)` as the registration `region`
    /// with `capability` (16 random bytes the driver drew for it), for
    /// reads only: [`Owner::register_with_access`] of [`Access::Read`].
    ///
    /// # Errors
    /// [`RdmaError::OutOfRange`] for an empty range or one that wraps;
    /// [`RdmaError::Backend`] for an id the owner holds;
    /// [`RdmaError::ShuttingDown`] after [`Owner::shutdown`].
    pub fn register(
        &mut self,
        region: u64,
        capability: [u8; 16],
        address: u64,
        length: u64,
    ) -> Result<(), RdmaError> {
        self.register_with_access(region, capability, address, length, Access::Read)
    }

    /// As [`Owner::register`], allowing peers `access`: a read of a
    /// registration that does not allow reads, and a write to one that
    /// does not allow writes, are refused [`Refusal::AccessDenied`].
    ///
    /// # Errors
    /// As [`Owner::register`].
    pub fn register_with_access(
        &mut self,
        region: u64,
        capability: [u8; 16],
        address: u64,
        length: u64,
        access: Access,
    ) -> Result<(), RdmaError> {
        if self.stage != Stage::Running {
            return Err(RdmaError::ShuttingDown);
        }
        let end = address
            .checked_add(length)
            .filter(|_| length > 0)
            .ok_or(RdmaError::OutOfRange)?;
        if self.regions.contains_key(&region) {
            return Err(RdmaError::backend(format!(
                "region id {region} is already registered"
            )));
        }
        self.regions.insert(
            region,
            Region {
                capability,
                start: address,
                end,
                access,
                leases: 0,
                unmapping: false,
                descriptor_leases: RegionLeases::default(),
                written: WrittenLog::with_limit(self.written_limit),
            },
        );
        Ok(())
    }

    /// Hands out `region` under a descriptor lease with `capability` (16
    /// random bytes the driver drew for it) and `terms`; `now` is the
    /// time, as [`Owner::set_time`] takes it. The future resolves when the
    /// lease ended (`super::leases`).
    ///
    /// # Errors
    /// [`RdmaError::RegionNotFound`] for a region the owner does not hold
    /// or is unmapping; [`RdmaError::OutOfRange`] for terms
    /// [`LeaseTerms::check`] refuses; [`RdmaError::ShuttingDown`] after
    /// [`Owner::shutdown`].
    pub fn register_lease(
        &mut self,
        region: u64,
        capability: [u8; 16],
        terms: LeaseTerms,
        now: Instant,
    ) -> Result<LeaseReleased, RdmaError> {
        if self.stage != Stage::Running {
            return Err(RdmaError::ShuttingDown);
        }
        self.set_time(now);
        let now = self.now.unwrap_or(now);
        let entry = self
            .regions
            .get_mut(&region)
            .filter(|entry| !entry.unmapping)
            .ok_or(RdmaError::RegionNotFound)?;
        terms.check(now)?;
        entry.descriptor_leases.sweep(now);
        self.leasing = true;
        Ok(entry.descriptor_leases.add(capability, terms))
    }

    /// A reader released a descriptor lease: `capability` of `region`,
    /// arriving on `connection` from the reading engine `sender`. Counted
    /// once per reader; see [`ReleaseOutcome`]. Once the region's unmap
    /// started (or the owner's shutdown) its leases have ended, and a
    /// release is not counted: their waiters hear `Withdrawn`, when the
    /// unmap completes.
    pub fn handle_release(
        &mut self,
        connection: E,
        sender: u64,
        region: u64,
        capability: &[u8; 16],
    ) -> ReleaseOutcome {
        use rdmareg_backend::leases::IgnoredRelease;
        let now = self.now;
        #[cfg(test)]
        let sender = if self.defects.every_release_counts {
            self.made_up_readers += 1;
            u64::MAX - self.made_up_readers
        } else {
            sender
        };
        let Some(entry) = self.regions.get_mut(&region) else {
            return ReleaseOutcome::Ignored(IgnoredRelease::UnknownLease);
        };
        #[cfg(test)]
        let unmapping = entry.unmapping && !self.defects.releases_count_while_unmapping;
        #[cfg(not(test))]
        let unmapping = entry.unmapping;
        if unmapping {
            let known = entry.descriptor_leases.judge(capability, None).is_some();
            tracing::debug!(region, "a descriptor lease release after the unmap started");
            return ReleaseOutcome::Ignored(if known {
                IgnoredRelease::AlreadyEnded
            } else {
                IgnoredRelease::UnknownLease
            });
        }
        let outcome = entry
            .descriptor_leases
            .release((connection, sender), capability, now);
        tracing::debug!(region, ?outcome, "a descriptor lease release");
        outcome
    }

    /// The time, for descriptor leases' expiry: a read under a lease is
    /// served only while this is before the lease's expiry. The owner
    /// reads no clock; a driver that registered leases gives the time
    /// before each batch of requests. Time never goes back: an earlier
    /// instant than one already given is ignored.
    pub fn set_time(&mut self, now: Instant) {
        if self.now.is_none_or(|before| now > before) {
            self.now = Some(now);
        }
    }

    /// Whether a descriptor lease was ever registered, so the driver must
    /// give the time ([`Owner::set_time`]) before requests.
    pub fn is_leasing(&self) -> bool {
        self.leasing
    }

    /// Descriptor leases of `region` that have not ended at the time last
    /// given (or not yet swept), if the owner holds the region.
    pub fn live_descriptor_leases(&self, region: u64) -> Option<usize> {
        self.regions
            .get(&region)
            .map(|entry| entry.descriptor_leases.live())
    }

    /// Starts the unmap of `region`: it serves no new read or write from
    /// now on, and [`Action::Unmapped`] follows once its last lease and
    /// its last write's receive ended.
    pub fn unmap(&mut self, region: u64) -> UnmapStatus {
        let Some(entry) = self.regions.get_mut(&region) else {
            return UnmapStatus::NotRegistered;
        };
        entry.unmapping = true;
        #[cfg(test)]
        if self.defects.unmap_ignores_leases {
            self.finish_unmap(region);
            return UnmapStatus::Waiting;
        }
        if entry.leases == 0 {
            self.finish_unmap(region);
        } else {
            tracing::debug!(
                region,
                leases = entry.leases,
                "unmap waits for replies still sending from the region"
            );
        }
        UnmapStatus::Waiting
    }

    /// A request arrived on `endpoint` as the UCX engine encodes it
    /// ([`wire`]); bytes that do not decode are refused
    /// [`Refusal::Malformed`] under the id they seem to carry.
    pub fn handle_request(&mut self, endpoint: E, bytes: &[u8]) {
        match wire::decode_request(bytes) {
            Ok(read) => self.handle_read(endpoint, read),
            Err(err) => {
                tracing::debug!(error = %err, "a malformed read request");
                self.handle_malformed(endpoint, wire::request_id_of_malformed(bytes));
            }
        }
    }

    /// A decoded request arrived on `endpoint`: serve it or refuse it.
    pub fn handle_read(&mut self, endpoint: E, read: Read) {
        if !self.may_reply(endpoint) {
            return;
        }
        match self.admit(endpoint, &read) {
            Ok(payload) => {
                let send = self.start_send(endpoint, Leases::One(payload.region));
                tracing::trace!(
                    request = read.request_id,
                    len = read.length,
                    "serving a read"
                );
                self.actions.push_back(Action::Serve {
                    endpoint,
                    send,
                    request_id: read.request_id,
                    payload,
                });
            }
            Err(refusal) => self.refuse(endpoint, read.request_id, refusal),
        }
    }

    /// A request arrived on `endpoint` that the driver could not decode;
    /// `request_id` is the id it seems to carry.
    pub fn handle_malformed(&mut self, endpoint: E, request_id: u64) {
        if self.may_reply(endpoint) {
            self.refuse(endpoint, request_id, Refusal::Malformed);
        }
    }

    /// A batched list arrived on `endpoint` as the UCX engine encodes it
    /// ([`wire`]); bytes that do not decode are dropped, as there are no
    /// request ids to trust in them.
    pub fn handle_list_request(&mut self, endpoint: E, bytes: &[u8], limits: ListLimits) {
        match wire::decode_list_request(bytes) {
            Ok(entries) => self.handle_list(endpoint, &entries, limits),
            Err(err) => {
                tracing::debug!(error = %err, "a malformed list request was dropped");
                self.dropped += 1;
            }
        }
    }

    /// A decoded batched list arrived on `endpoint`: each entry is judged
    /// as a single read is, one lease and one place under the endpoint's
    /// bound per served entry, and the entries' results go out in one or more
    /// [`Action::ServeList`] replies within `limits`, in request order. A
    /// reply that serves no entry counts as one refusal, and is not sent
    /// past the refusal bound.
    pub fn handle_list(&mut self, endpoint: E, entries: &[Read], limits: ListLimits) {
        if !self.may_reply(endpoint) {
            return;
        }
        if entries.is_empty() || limits.entries_per_reply == 0 {
            self.dropped += 1;
            return;
        }
        let mut entry_replies = Vec::with_capacity(entries.len());
        let mut bytes = 0u64;
        for read in entries {
            let within = read.length <= limits.max_entry
                && bytes
                    .checked_add(read.length)
                    .is_some_and(|sum| sum <= limits.max_total);
            let outcome = if within {
                self.admit(endpoint, read)
            } else {
                Err(Refusal::Malformed)
            };
            match outcome {
                Ok(payload) => bytes += payload.length,
                Err(_) => self.refused += 1,
            }
            entry_replies.push(ListEntryReply {
                request_id: read.request_id,
                outcome,
            });
        }
        let mut rest = &entry_replies[..];
        while !rest.is_empty() {
            let (part, tail) = rest.split_at(part_len(rest, limits));
            rest = tail;
            let regions: Vec<u64> = part
                .iter()
                .filter_map(|a| a.outcome.ok().map(|p| p.region))
                .collect();
            let leases = if regions.is_empty() {
                let entry = self.endpoints.entry(endpoint).or_default();
                if entry.load.refusals >= self.bound {
                    tracing::debug!(
                        "an endpoint holds too many refusals; a list reply was dropped"
                    );
                    self.dropped += 1;
                    continue;
                }
                entry.load.refusals += 1;
                Leases::None
            } else {
                Leases::Many(regions)
            };
            let send = self.start_send(endpoint, leases);
            self.actions.push_back(Action::ServeList {
                endpoint,
                send,
                entry_replies: part.to_vec(),
            });
        }
    }

    /// Refuses `request_id` on `endpoint` for a reason the driver decided
    /// itself (such as [`Refusal::Unverified`]): sent under the endpoint's
    /// refusal bound like the owner's own refusals, dropped past it, with
    /// no lease.
    pub fn refuse_request(&mut self, endpoint: E, request_id: u64, refusal: Refusal) {
        if self.may_reply(endpoint) {
            self.refuse(endpoint, request_id, refusal);
        }
    }

    /// Judges `read` as [`Owner::handle_read`] does (it runs this check
    /// first) — registration, capability (the registration's or a
    /// descriptor lease's), access, unmapping, the lease's end, range, in
    /// that order —
    /// but takes no lease,
    /// counts nothing under a bound and asks for no send: for a driver
    /// that copies the bytes of a served read out of the registration
    /// before it feeds the owner anything else (libfabric's batched
    /// replies are such a copy), so that no unmap can finish while the
    /// copy runs and no lease would outlive it.
    pub fn check_read(&self, read: &Read) -> Result<Payload, Refusal> {
        let region = self
            .regions
            .get(&read.region)
            .ok_or(Refusal::RegionUnknown)?;
        let under_lease = if capabilities_match(&region.capability, &read.capability) {
            Ok(())
        } else if region.descriptor_leases.is_empty() {
            return Err(Refusal::CapabilityMismatch);
        } else {
            #[cfg(test)]
            let now = self.now.filter(|_| !self.defects.lease_expiry_unchecked);
            #[cfg(not(test))]
            let now = self.now;
            region
                .descriptor_leases
                .judge(&read.capability, now)
                .ok_or(Refusal::CapabilityMismatch)?
                .map_err(|_| Refusal::LeaseExpired)
        };
        if !region.access.allows_read() {
            return Err(Refusal::AccessDenied);
        }
        if region.unmapping || self.stage == Stage::Closed {
            return Err(Refusal::Deregistering);
        }
        under_lease?;
        if !self.inside(region, read.address, read.length) {
            return Err(Refusal::OutOfRange);
        }
        Ok(Payload {
            region: read.region,
            address: read.address,
            length: read.length,
        })
    }

    /// The transport finished the send `send`. Returns whether the owner
    /// knew it.
    pub fn send_completed(&mut self, send: SendId) -> bool {
        self.end_send(send)
    }

    /// The transport failed the send `send` and no longer reads its
    /// payload. Returns whether the owner knew it.
    pub fn send_failed(&mut self, send: SendId) -> bool {
        self.end_send(send)
    }

    /// `endpoint` failed: its requests are dropped from now on, until the
    /// transport reported each of its sends as ended.
    pub fn endpoint_failed(&mut self, endpoint: E) {
        let Some(entry) = self.endpoints.get_mut(&endpoint) else {
            return;
        };
        entry.failed = true;
        #[cfg(test)]
        if self.defects.endpoint_failure_ends_leases {
            let mut ids: Vec<SendId> = self
                .sends
                .iter()
                .filter(|(_, send)| send.endpoint == endpoint)
                .map(|(&id, _)| id)
                .collect();
            ids.sort_unstable();
            for id in ids {
                self.end_send(id);
            }
        }
    }

    /// Stops serving: every region turns unmapping, new registrations are
    /// refused, and [`Action::Drained`] follows once no lease is held and
    /// no write's receive is left.
    pub fn shutdown(&mut self) {
        if self.stage != Stage::Running {
            return;
        }
        self.stage = Stage::ShuttingDown;
        let ids: Vec<u64> = self.regions.keys().copied().collect();
        for id in ids {
            self.unmap(id);
        }
        self.report_drained();
    }

    /// The transport is destroyed: no send of it reads any more and no
    /// receive writes any more, and none will be reported. Every send and
    /// every write's receive ends here (the write unanswered); requests
    /// are dropped from now on.
    pub fn transport_closed(&mut self) {
        self.shutdown();
        self.stage = Stage::Closed;
        self.end_every_receive();
        let mut ids: Vec<SendId> = self.sends.keys().copied().collect();
        // In the order they started, whatever the table's.
        ids.sort_unstable();
        for id in ids {
            self.end_send(id);
        }
        self.endpoints.clear();
    }

    /// The next thing to do, in order.
    pub fn poll_action(&mut self) -> Option<Action<E>> {
        self.actions.pop_front()
    }

    /// Served replies unfinished over every endpoint.
    pub fn leases_in_flight(&self) -> usize {
        self.leases
    }

    /// What `endpoint` has unfinished.
    pub fn load(&self, endpoint: E) -> EndpointLoad {
        self.endpoints
            .get(&endpoint)
            .map(|entry| entry.load)
            .unwrap_or_default()
    }

    /// Endpoints with something unfinished (or failed and not yet
    /// forgotten).
    pub fn endpoints(&self) -> usize {
        self.endpoints.len()
    }

    /// The leases `region` holds (served replies sending from it, and
    /// writes receiving into it), if the owner holds it.
    pub fn region_leases(&self, region: u64) -> Option<u32> {
        self.regions.get(&region).map(|entry| entry.leases)
    }

    /// Requests refused (single reads, list entries and writes), sent or
    /// not.
    pub fn refused_requests(&self) -> u64 {
        self.refused
    }

    /// Requests dropped without a reply: past an endpoint's refusal bound, from
    /// a failed endpoint, or after the transport closed.
    pub fn dropped_requests(&self) -> u64 {
        self.dropped
    }

    fn may_reply(&mut self, endpoint: E) -> bool {
        let failed = self.endpoints.get(&endpoint).is_some_and(|e| e.failed);
        if self.stage == Stage::Closed || failed {
            self.dropped += 1;
            return false;
        }
        true
    }

    /// Checks `read` against the registrations ([`Owner::check_read`]) and
    /// `endpoint`'s bound; on success counts the reply and takes a lease.
    fn admit(&mut self, endpoint: E, read: &Read) -> Result<Payload, Refusal> {
        let payload = self.check_read(read)?;
        if !self.regions.contains_key(&read.region) {
            return Err(Refusal::RegionUnknown);
        }
        self.take_served_places(endpoint, 1, "read")?;
        if let Some(region) = self.regions.get_mut(&read.region) {
            region.leases += 1;
        }
        self.leases += 1;
        Ok(payload)
    }

    /// Takes `places` places under `endpoint`'s bound of served replies
    /// for one request (`what`, for the log), or refuses it
    /// [`Refusal::Busy`] when the endpoint is at its bound.
    fn take_served_places(&mut self, endpoint: E, places: u32, what: &str) -> Result<(), Refusal> {
        let entry = self.endpoints.entry(endpoint).or_default();
        #[cfg(test)]
        let at_bound = entry.load.served >= self.bound && !self.defects.unbounded_replies;
        #[cfg(not(test))]
        let at_bound = entry.load.served >= self.bound;
        if at_bound {
            tracing::debug!(
                bound = self.bound,
                request = what,
                "an endpoint is at its bound of unfinished replies; refusing as busy"
            );
            return Err(Refusal::Busy);
        }
        entry.load.served += places;
        Ok(())
    }

    /// Sends a refusal of `request_id` on `endpoint`, or drops it past the
    /// endpoint's refusal bound.
    fn refuse(&mut self, endpoint: E, request_id: u64, refusal: Refusal) {
        self.refused += 1;
        let entry = self.endpoints.entry(endpoint).or_default();
        if entry.load.refusals >= self.bound {
            tracing::debug!("an endpoint holds too many refusals; a request was dropped");
            self.dropped += 1;
            return;
        }
        entry.load.refusals += 1;
        let send = self.start_send(endpoint, Leases::None);
        tracing::debug!(request = request_id, %refusal, "refused a read");
        self.actions.push_back(Action::Refuse {
            endpoint,
            send,
            request_id,
            refusal,
        });
    }

    fn start_send(&mut self, endpoint: E, leases: Leases) -> SendId {
        self.start_send_of(endpoint, leases, 0)
    }

    fn start_send_of(&mut self, endpoint: E, leases: Leases, write_places: u32) -> SendId {
        let id = SendId(self.next_send);
        self.next_send += 1;
        self.sends.insert(
            id,
            Send {
                endpoint,
                leases,
                write_places,
            },
        );
        id
    }

    /// Whether `[address, address + length)` is non-empty and inside
    /// `region`.
    fn inside(&self, region: &Region<E>, address: u64, length: u64) -> bool {
        let inside = length > 0
            && address >= region.start
            && address
                .checked_add(length)
                .is_some_and(|end| end <= region.end);
        #[cfg(test)]
        let inside = inside
            || (self.defects.range_end_unchecked
                && length > 0
                && address >= region.start
                && address < region.end);
        inside
    }

    /// One served place of `endpoint` ended: forget the endpoint once it
    /// has nothing unfinished.
    fn end_served_place(&mut self, endpoint: E) {
        if let Some(entry) = self.endpoints.get_mut(&endpoint) {
            entry.load.served = entry.load.served.saturating_sub(1);
            if entry.load == EndpointLoad::default() {
                self.endpoints.remove(&endpoint);
            }
        }
    }

    /// One hold on `region` ended: finish its unmap if it waits for it.
    fn end_hold(&mut self, region: u64) {
        if let Some(entry) = self.regions.get_mut(&region) {
            entry.leases -= 1;
            if entry.unmapping && entry.leases == 0 {
                self.finish_unmap(region);
            }
        }
    }

    /// A send ended: release what it counted, finish a waiting unmap.
    fn end_send(&mut self, id: SendId) -> bool {
        let Some(send) = self.sends.remove(&id) else {
            return false;
        };
        let regions = send.leases.regions();
        if let Some(entry) = self.endpoints.get_mut(&send.endpoint) {
            let load = &mut entry.load;
            if send.write_places > 0 {
                load.served = load.served.saturating_sub(send.write_places);
            } else if regions.is_empty() {
                load.refusals = load.refusals.saturating_sub(1);
            } else {
                load.served = load.served.saturating_sub(regions.len() as u32);
            }
            if *load == EndpointLoad::default() {
                self.endpoints.remove(&send.endpoint);
            }
        }
        for &region in regions {
            self.leases -= 1;
            self.end_hold(region);
        }
        true
    }

    fn finish_unmap(&mut self, region: u64) {
        self.regions.remove(&region);
        self.actions.push_back(Action::Unmapped { region });
        self.report_drained();
    }

    fn report_drained(&mut self) {
        if self.stage != Stage::Running
            && !self.drained
            && self.regions.is_empty()
            && self.leases == 0
            && self.receives.is_empty()
        {
            self.drained = true;
            self.actions.push_back(Action::Drained);
        }
    }
}

/// How many of `entry_replies`, from the first, the next reply carries: at
/// most `entries_per_reply`, and served entries of at most
/// `payload_per_reply` bytes together, except that an entry longer than
/// that goes alone.
fn part_len(entry_replies: &[ListEntryReply], limits: ListLimits) -> usize {
    let mut end = 0;
    let mut payload = 0u64;
    while end < entry_replies.len() && end < limits.entries_per_reply {
        let length = entry_replies[end].outcome.map_or(0, |p| p.length);
        if end > 0 && payload.saturating_add(length) > limits.payload_per_reply {
            break;
        }
        payload = payload.saturating_add(length);
        end += 1;
    }
    end
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAP: [u8; 16] = [7; 16];
    const BASE: u64 = 0x10_000;
    const LEN: u64 = 0x1000;

    fn owner(bound: u32) -> Owner<u64> {
        let mut owner = Owner::new(OwnerConfig {
            max_replies_per_endpoint: bound,
            ..OwnerConfig::default()
        });
        owner.register(3, CAP, BASE, LEN).unwrap();
        owner
    }

    fn read(region: u64, capability: [u8; 16], address: u64, length: u64) -> Read {
        Read {
            request_id: 1,
            region,
            capability,
            address,
            length,
        }
    }

    fn actions(owner: &mut Owner<u64>) -> Vec<Action<u64>> {
        std::iter::from_fn(|| owner.poll_action()).collect()
    }

    /// The refusal `read` gets on endpoint 1, or `None` if it is served.
    fn refusal_of(owner: &mut Owner<u64>, read: Read) -> Option<Refusal> {
        owner.handle_read(1, read);
        match actions(owner).as_slice() {
            [Action::Refuse { refusal, .. }] => Some(*refusal),
            [Action::Serve { .. }] => None,
            other => panic!("one reply expected, got {other:?}"),
        }
    }

    fn only_send(owner: &mut Owner<u64>) -> SendId {
        match actions(owner).as_slice() {
            [Action::Serve { send, .. } | Action::Refuse { send, .. }] => *send,
            other => panic!("one send expected, got {other:?}"),
        }
    }

    /// A read inside a live registration is served on the endpoint it came
    /// from, with its id, its range, and a lease on the region.
    #[test]
    fn a_read_inside_a_live_region_is_served_under_a_lease() {
        let mut owner = owner(4);
        owner.handle_read(9, read(3, CAP, BASE + 16, 32));
        let [
            Action::Serve {
                endpoint,
                request_id,
                payload,
                ..
            },
        ] = actions(&mut owner)[..]
        else {
            panic!("not served");
        };
        assert_eq!((endpoint, request_id), (9, 1));
        assert_eq!(
            payload,
            Payload {
                region: 3,
                address: BASE + 16,
                length: 32
            }
        );
        assert_eq!(owner.region_leases(3), Some(1));
        assert_eq!(owner.load(9).served, 1);
        assert_eq!(owner.leases_in_flight(), 1);
    }

    /// One byte past the end, an address before the start, an empty range
    /// and a range that wraps are all out of range, and take no lease.
    #[test]
    fn a_read_past_the_region_end_is_refused() {
        let mut owner = owner(16);
        for (address, length) in [
            (BASE, LEN + 1),
            (BASE + LEN - 1, 2),
            (BASE - 1, 1),
            (BASE, 0),
            (u64::MAX, 2),
            (BASE + LEN, 1),
        ] {
            assert_eq!(
                refusal_of(&mut owner, read(3, CAP, address, length)),
                Some(Refusal::OutOfRange),
                "{address:#x}+{length}"
            );
        }
        assert_eq!(refusal_of(&mut owner, read(3, CAP, BASE, LEN)), None);
        assert_eq!(owner.region_leases(3), Some(1));
    }

    /// A capability that differs in one byte is refused, before anything
    /// about the region's state or range is said.
    #[test]
    fn a_forged_capability_is_refused() {
        let mut owner = owner(4);
        let mut forged = CAP;
        forged[15] ^= 1;
        assert_eq!(
            refusal_of(&mut owner, read(3, forged, BASE, 1)),
            Some(Refusal::CapabilityMismatch)
        );
        assert_eq!(
            refusal_of(&mut owner, read(3, forged, 0, u64::MAX)),
            Some(Refusal::CapabilityMismatch),
            "the range of a forged read is not judged"
        );
        // An unmapping region: one lease keeps it waiting.
        let mut owner = self::owner(4);
        owner.handle_read(1, read(3, CAP, BASE, 1));
        actions(&mut owner);
        owner.unmap(3);
        assert_eq!(
            refusal_of(&mut owner, read(3, forged, BASE, 1)),
            Some(Refusal::CapabilityMismatch),
            "a forger does not learn the region is unmapping"
        );
        assert_eq!(owner.region_leases(3), Some(1));
    }

    /// An id the owner never held, and the id of a finished unmap, name
    /// nothing; a later registration under another id with a fresh
    /// capability does not serve the old descriptor either.
    #[test]
    fn a_reused_region_id_names_nothing() {
        let mut owner = owner(4);
        assert_eq!(
            refusal_of(&mut owner, read(4, CAP, BASE, 1)),
            Some(Refusal::RegionUnknown)
        );
        assert_eq!(owner.unmap(3), UnmapStatus::Waiting);
        assert_eq!(actions(&mut owner), [Action::Unmapped { region: 3 }]);
        assert_eq!(
            refusal_of(&mut owner, read(3, CAP, BASE, 1)),
            Some(Refusal::RegionUnknown)
        );
        // The same memory registered again: new id, new capability.
        owner.register(5, [9; 16], BASE, LEN).unwrap();
        assert_eq!(
            refusal_of(&mut owner, read(3, CAP, BASE, 1)),
            Some(Refusal::RegionUnknown)
        );
        assert_eq!(
            refusal_of(&mut owner, read(5, CAP, BASE, 1)),
            Some(Refusal::CapabilityMismatch)
        );
    }

    /// An id the owner holds cannot be registered twice; bad ranges and
    /// registrations after shutdown are typed errors.
    #[test]
    fn a_held_id_empty_range_or_shut_owner_refuses_a_register() {
        let mut owner = owner(4);
        assert!(matches!(
            owner.register(3, CAP, 0x90_000, 1),
            Err(RdmaError::Backend(_))
        ));
        assert_eq!(owner.register(4, CAP, BASE, 0), Err(RdmaError::OutOfRange));
        assert_eq!(
            owner.register(4, CAP, u64::MAX, 2),
            Err(RdmaError::OutOfRange)
        );
        owner.shutdown();
        assert_eq!(
            owner.register(4, CAP, BASE, 1),
            Err(RdmaError::ShuttingDown)
        );
    }

    /// An unmap waits while a reply sends from the region, new reads are
    /// refused meanwhile, and it finishes at the last lease's end — a
    /// failed send ends a lease as a completed one does.
    #[test]
    fn an_unmap_waits_for_every_lease() {
        let mut owner = owner(4);
        owner.handle_read(1, read(3, CAP, BASE, 8));
        let first = only_send(&mut owner);
        owner.handle_read(2, read(3, CAP, BASE, 8));
        let second = only_send(&mut owner);
        assert_eq!(owner.unmap(3), UnmapStatus::Waiting);
        assert_eq!(
            owner.unmap(3),
            UnmapStatus::Waiting,
            "a second caller joins"
        );
        assert_eq!(
            refusal_of(&mut owner, read(3, CAP, BASE, 8)),
            Some(Refusal::Deregistering)
        );
        assert!(owner.send_completed(first));
        assert_eq!(actions(&mut owner), [], "one lease is still held");
        assert!(owner.send_failed(second));
        assert_eq!(actions(&mut owner), [Action::Unmapped { region: 3 }]);
        assert_eq!(owner.unmap(3), UnmapStatus::NotRegistered);
        assert_eq!(owner.leases_in_flight(), 0);
    }

    /// A refusal's send holds no lease, so an unmap does not wait for it.
    #[test]
    fn an_unmap_does_not_wait_for_refusals() {
        let mut owner = owner(4);
        owner.handle_read(1, read(3, [0; 16], BASE, 8));
        let _refusal = only_send(&mut owner);
        owner.unmap(3);
        assert_eq!(actions(&mut owner), [Action::Unmapped { region: 3 }]);
    }

    /// An endpoint at its bound of served replies gets busy refusals,
    /// without a lease; another endpoint has its own bound; a wrong read
    /// is refused for what is wrong with it, busy or not; an ended reply
    /// frees its place.
    #[test]
    fn a_busy_connection_gets_busy_refusals() {
        let mut owner = owner(2);
        let ok = read(3, CAP, BASE, 16);
        owner.handle_read(1, ok);
        let first = only_send(&mut owner);
        assert_eq!(refusal_of(&mut owner, ok), None);
        assert_eq!(refusal_of(&mut owner, ok), Some(Refusal::Busy));
        assert_eq!(owner.region_leases(3), Some(2), "no lease for busy");
        assert_eq!(
            refusal_of(&mut owner, read(3, [8; 16], BASE, 16)),
            Some(Refusal::CapabilityMismatch)
        );
        owner.handle_read(2, ok);
        assert!(matches!(
            actions(&mut owner)[..],
            [Action::Serve { endpoint: 2, .. }]
        ));
        owner.send_completed(first);
        assert_eq!(refusal_of(&mut owner, ok), None, "the place is free again");
    }

    /// Past the refusal bound a request is dropped without a reply; refusals
    /// do not use up served places, nor served replies refusal places.
    #[test]
    fn refusals_are_bounded_apart_from_served_replies() {
        let mut owner = owner(2);
        let forged = read(3, [0; 16], BASE, 1);
        owner.handle_read(1, forged);
        let first = only_send(&mut owner);
        owner.handle_read(1, forged);
        only_send(&mut owner);
        owner.handle_read(1, forged);
        assert_eq!(actions(&mut owner), [], "dropped past the bound");
        assert_eq!(owner.dropped_requests(), 1);
        assert_eq!(owner.refused_requests(), 3);
        assert_eq!(refusal_of(&mut owner, read(3, CAP, BASE, 1)), None);
        assert_eq!(
            owner.load(1),
            EndpointLoad {
                served: 1,
                refusals: 2
            }
        );
        owner.send_completed(first);
        assert_eq!(
            refusal_of(&mut owner, forged),
            Some(Refusal::CapabilityMismatch)
        );
    }

    /// Once both its counts are back at zero an endpoint is forgotten, so
    /// its id may name a later endpoint.
    #[test]
    fn an_idle_endpoint_is_forgotten() {
        let mut owner = owner(1);
        owner.handle_read(1, read(3, CAP, BASE, 1));
        let served = only_send(&mut owner);
        owner.handle_read(1, read(9, CAP, BASE, 1));
        let refused = only_send(&mut owner);
        assert_eq!(owner.endpoints(), 1);
        owner.send_completed(served);
        owner.send_failed(refused);
        assert_eq!(owner.endpoints(), 0);
        assert!(!owner.send_completed(served), "a send ends once");
    }

    /// A failed endpoint's requests are dropped, but its leases end only
    /// when the transport reports its sends, so an unmap keeps waiting.
    #[test]
    fn an_endpoint_failure_ends_no_lease_by_itself() {
        let mut owner = owner(4);
        owner.handle_read(1, read(3, CAP, BASE, 8));
        let send = only_send(&mut owner);
        owner.endpoint_failed(1);
        owner.handle_read(1, read(3, CAP, BASE, 8));
        assert_eq!(actions(&mut owner), [], "a failed endpoint gets no reply");
        owner.unmap(3);
        assert_eq!(actions(&mut owner), []);
        assert_eq!(owner.region_leases(3), Some(1));
        owner.send_failed(send);
        assert_eq!(actions(&mut owner), [Action::Unmapped { region: 3 }]);
        assert_eq!(owner.endpoints(), 0, "forgotten once its sends ended");
    }

    /// A request that does not decode is refused as malformed under the id
    /// it seems to carry; one that does is judged as a decoded one.
    #[test]
    fn a_malformed_request_is_refused_as_malformed() {
        let mut owner = owner(4);
        let mut bytes = wire::encode_request(&Read {
            request_id: 42,
            ..read(3, CAP, BASE, 1)
        });
        owner.handle_request(1, &bytes);
        assert!(matches!(
            actions(&mut owner)[..],
            [Action::Serve { request_id: 42, .. }]
        ));
        bytes[1] = 1;
        owner.handle_request(1, &bytes);
        assert!(matches!(
            actions(&mut owner)[..],
            [Action::Refuse {
                request_id: 42,
                refusal: Refusal::Malformed,
                ..
            }]
        ));
        owner.handle_request(1, &bytes[..3]);
        assert!(matches!(
            actions(&mut owner)[..],
            [Action::Refuse { request_id: 0, .. }]
        ));
    }

    /// Shutdown unmaps every idle region at once and a leased one at its
    /// last lease's end, then reports drained; closing the transport ends
    /// every send and drops later requests.
    #[test]
    fn shutdown_unmaps_every_region_then_drains() {
        let mut owner = owner(4);
        owner.register(4, CAP, 0x90_000, 16).unwrap();
        owner.handle_read(1, read(3, CAP, BASE, 8));
        let send = only_send(&mut owner);
        owner.shutdown();
        assert_eq!(actions(&mut owner), [Action::Unmapped { region: 4 }]);
        assert_eq!(
            refusal_of(&mut owner, read(3, CAP, BASE, 8)),
            Some(Refusal::Deregistering)
        );
        owner.send_completed(send);
        assert_eq!(
            actions(&mut owner),
            [Action::Unmapped { region: 3 }, Action::Drained]
        );
        owner.transport_closed();
        owner.handle_read(1, read(3, CAP, BASE, 8));
        assert_eq!(actions(&mut owner), []);
        assert_eq!(owner.endpoints(), 0);
    }

    /// Closing the transport while replies are in flight ends them all,
    /// finishing the unmaps they held back.
    #[test]
    fn a_closed_transport_ends_every_send() {
        let mut owner = owner(4);
        owner.handle_read(1, read(3, CAP, BASE, 8));
        only_send(&mut owner);
        owner.handle_read(2, read(9, CAP, BASE, 8));
        only_send(&mut owner);
        owner.transport_closed();
        assert_eq!(
            actions(&mut owner),
            [Action::Unmapped { region: 3 }, Action::Drained]
        );
        assert_eq!(owner.leases_in_flight(), 0);
        assert_eq!(owner.endpoints(), 0);
    }

    /// The UCX reply header of each entry's result.
    #[test]
    fn a_reply_gives_its_ucx_reply_header() {
        let mut owner = owner(4);
        owner.handle_read(1, read(3, CAP, BASE, 8));
        let serve = actions(&mut owner).remove(0);
        let header = serve.reply_header().unwrap();
        assert_eq!(
            wire::Reply::decode(&header),
            Ok(wire::Reply {
                request_id: 1,
                outcome: Ok(8)
            })
        );
        assert_eq!(Action::<u64>::Drained.reply_header(), None);
    }

    fn entry(request_id: u64, capability: [u8; 16], address: u64, length: u64) -> Read {
        Read {
            request_id,
            ..read(3, capability, address, length)
        }
    }

    /// The entries' results of each list reply `owner` asks for, and their
    /// sends.
    fn list_replies(owner: &mut Owner<u64>) -> Vec<(SendId, Vec<ListEntryReply>)> {
        actions(owner)
            .into_iter()
            .map(|action| match action {
                Action::ServeList {
                    send,
                    entry_replies,
                    ..
                } => (send, entry_replies),
                other => panic!("a list reply expected, got {other:?}"),
            })
            .collect()
    }

    fn refusals(entry_replies: &[ListEntryReply]) -> Vec<Option<Refusal>> {
        entry_replies.iter().map(|a| a.outcome.err()).collect()
    }

    /// Each entry of a list is judged on its own, exactly as a single read
    /// is: the refused ones contribute no bytes and the others are served,
    /// each under its own lease, in one reply in request order.
    #[test]
    fn a_list_entry_is_judged_as_a_single_read() {
        let mut owner = owner(8);
        let list = [
            entry(1, CAP, BASE, 8),
            entry(2, [0; 16], BASE, 8),
            entry(3, CAP, BASE + LEN - 4, 8),
            entry(4, CAP, BASE + 8, 8),
        ];
        owner.handle_list(1, &list, ListLimits::default());
        let replies = list_replies(&mut owner);
        let [(_, entry_replies)] = &replies[..] else {
            panic!("one reply expected: {replies:?}");
        };
        let ids: Vec<u64> = entry_replies.iter().map(|a| a.request_id).collect();
        assert_eq!(ids, [1, 2, 3, 4]);
        assert_eq!(
            refusals(entry_replies),
            [
                None,
                Some(Refusal::CapabilityMismatch),
                Some(Refusal::OutOfRange),
                None
            ]
        );
        assert_eq!(owner.region_leases(3), Some(2));
        assert_eq!(owner.load(1).served, 2);
    }

    /// An entry longer than the batching bound, or one past the list's
    /// total, is refused as malformed; the total counts served entries
    /// only.
    #[test]
    fn a_list_entry_past_the_batching_bounds_is_malformed() {
        let mut owner = owner(8);
        let limits = ListLimits {
            max_entry: 16,
            max_total: 24,
            ..ListLimits::default()
        };
        let list = [
            entry(1, CAP, BASE, 17),
            entry(2, CAP, BASE, 16),
            entry(3, [0; 16], BASE, 8),
            entry(4, CAP, BASE, 16),
            entry(5, CAP, BASE, 8),
        ];
        owner.handle_list(1, &list, limits);
        let replies = list_replies(&mut owner);
        assert_eq!(
            refusals(&replies[0].1),
            [
                Some(Refusal::Malformed),
                None,
                Some(Refusal::CapabilityMismatch),
                Some(Refusal::Malformed),
                None
            ]
        );
    }

    /// A list is replied to in several replies, in order, when it has more
    /// entries than one reply's header carries or more bytes than one
    /// reply's payload; an entry longer than a reply's payload goes alone.
    #[test]
    fn a_list_is_replied_to_in_parts_within_the_reply_limits() {
        let mut owner = owner(16);
        let limits = ListLimits {
            entries_per_reply: 3,
            payload_per_reply: 16,
            ..ListLimits::default()
        };
        let list = [
            entry(1, CAP, BASE, 8),
            entry(2, CAP, BASE, 8),
            entry(3, CAP, BASE, 8),
            entry(4, CAP, BASE, 32),
            entry(5, [0; 16], BASE, 8),
            entry(6, [0; 16], BASE, 8),
            entry(7, [0; 16], BASE, 8),
            entry(8, [0; 16], BASE, 8),
        ];
        owner.handle_list(1, &list, limits);
        let parts: Vec<Vec<u64>> = list_replies(&mut owner)
            .iter()
            .map(|(_, entry_replies)| entry_replies.iter().map(|a| a.request_id).collect())
            .collect();
        assert_eq!(
            parts,
            [vec![1, 2], vec![3], vec![4], vec![5, 6, 7], vec![8]]
        );
        assert_eq!(
            owner.load(1),
            EndpointLoad {
                served: 4,
                refusals: 2
            }
        );
    }

    /// A reply that serves no entry holds no lease and counts as one
    /// refusal; past the refusal bound it is not sent.
    #[test]
    fn a_list_reply_that_serves_nothing_counts_as_one_refusal() {
        let mut owner = owner(1);
        let forged = [entry(1, [0; 16], BASE, 8), entry(2, [0; 16], BASE, 8)];
        owner.handle_list(1, &forged, ListLimits::default());
        let replies = list_replies(&mut owner);
        assert_eq!(replies.len(), 1);
        assert_eq!(
            owner.load(1),
            EndpointLoad {
                served: 0,
                refusals: 1
            }
        );
        owner.handle_list(1, &forged, ListLimits::default());
        assert_eq!(list_replies(&mut owner), [], "dropped past the bound");
        assert_eq!(owner.dropped_requests(), 1);
        owner.send_completed(replies[0].0);
        assert_eq!(owner.endpoints(), 0);
    }

    /// List entries past the endpoint's bound of served replies are busy,
    /// counted with its single replies.
    #[test]
    fn list_entries_past_the_bound_are_busy() {
        let mut owner = owner(2);
        owner.handle_read(1, read(3, CAP, BASE, 8));
        only_send(&mut owner);
        let list = [entry(1, CAP, BASE, 8), entry(2, CAP, BASE, 8)];
        owner.handle_list(1, &list, ListLimits::default());
        let replies = list_replies(&mut owner);
        assert_eq!(refusals(&replies[0].1), [None, Some(Refusal::Busy)]);
    }

    /// The leases of a list reply end together when its send ends, and an
    /// unmap waits for them.
    #[test]
    fn an_unmap_waits_for_a_list_reply() {
        let mut owner = owner(8);
        let list = [entry(1, CAP, BASE, 8), entry(2, CAP, BASE + 8, 8)];
        owner.handle_list(1, &list, ListLimits::default());
        let replies = list_replies(&mut owner);
        owner.unmap(3);
        assert_eq!(actions(&mut owner), []);
        owner.send_failed(replies[0].0);
        assert_eq!(actions(&mut owner), [Action::Unmapped { region: 3 }]);
        assert_eq!(owner.leases_in_flight(), 0);
        assert_eq!(owner.endpoints(), 0);
    }

    /// A list that does not decode is dropped: there is no request id in it
    /// to reply to; one that does is served, with the UCX list reply header.
    #[test]
    fn a_malformed_list_is_dropped() {
        let mut owner = owner(8);
        let bytes = wire::encode_list_request(&[entry(1, CAP, BASE, 8)]).unwrap();
        owner.handle_list_request(1, &bytes[..bytes.len() - 1], ListLimits::default());
        assert_eq!(actions(&mut owner), []);
        assert_eq!(owner.dropped_requests(), 1);
        owner.handle_list_request(1, &bytes, ListLimits::default());
        let action = actions(&mut owner).remove(0);
        let header = action.list_reply_header().unwrap();
        assert_eq!(header.len(), 8 + wire::LIST_REPLY_ENTRY_LEN);
        assert_eq!(action.reply_header(), None);
    }

    /// A refusal the driver decides takes a place under the endpoint's
    /// refusal bound, holds no lease, and is dropped past the bound.
    #[test]
    fn a_refusal_the_driver_decides_counts_under_the_bound() {
        let mut owner = owner(1);
        owner.refuse_request(4, 11, Refusal::Unverified);
        assert!(matches!(
            actions(&mut owner)[..],
            [Action::Refuse {
                endpoint: 4,
                request_id: 11,
                refusal: Refusal::Unverified,
                ..
            }]
        ));
        owner.refuse_request(4, 12, Refusal::NotTheRequester);
        assert_eq!(actions(&mut owner), [], "dropped past the bound");
        assert_eq!(
            owner.load(4),
            EndpointLoad {
                served: 0,
                refusals: 1
            }
        );
        assert_eq!(owner.leases_in_flight(), 0);
    }

    /// `check_read` gives every read the verdict `handle_read` would (on
    /// an endpoint with room under its bound), and takes no lease: an
    /// unmap after it finishes at once.
    #[test]
    fn a_checked_read_is_judged_as_served_without_a_lease() {
        let reads = [
            read(3, CAP, BASE, LEN),
            read(3, CAP, BASE + LEN - 1, 2),
            read(3, CAP, BASE - 1, 2),
            read(3, CAP, BASE, 0),
            read(3, [8; 16], BASE, 1),
            read(4, CAP, BASE, 1),
        ];
        for candidate in reads {
            let mut served = owner(64);
            let checked = owner(64).check_read(&candidate);
            served.handle_read(1, candidate);
            let expected = match actions(&mut served).as_slice() {
                [Action::Serve { payload, .. }] => Ok(*payload),
                [Action::Refuse { refusal, .. }] => Err(*refusal),
                other => panic!("one reply expected, got {other:?}"),
            };
            assert_eq!(checked, expected, "{candidate:?}");
        }
        let mut owner = owner(1);
        assert!(owner.check_read(&read(3, CAP, BASE, 8)).is_ok());
        assert_eq!(owner.leases_in_flight(), 0);
        assert_eq!(owner.load(1), EndpointLoad::default());
        assert_eq!(owner.unmap(3), UnmapStatus::Waiting);
        assert_eq!(actions(&mut owner), vec![Action::Unmapped { region: 3 }]);
        assert_eq!(
            owner.check_read(&read(3, CAP, BASE, 8)),
            Err(Refusal::RegionUnknown)
        );
    }

    /// An unmap ends the region's descriptor leases even while a reply
    /// still sends from the region: a reader's release arriving meanwhile
    /// is not counted, and whoever waits for the lease hears `Withdrawn`
    /// once the unmap completes, never `Released`. (The simulator found
    /// the owner counting such a release and reporting the lease
    /// released after its region's unmap had started.)
    #[test]
    fn a_release_after_the_unmap_started_does_not_count() {
        use futures::FutureExt;
        use rdmareg_backend::leases::{IgnoredRelease, LeaseEnd};

        let start = Instant::now();
        let lease = [9; 16];
        let mut owner = owner(4);
        let terms = LeaseTerms {
            readers: 1,
            expires_at: start + std::time::Duration::from_secs(10),
        };
        let mut released = owner.register_lease(3, lease, terms, start).unwrap();
        owner.handle_read(1, read(3, lease, BASE, 8));
        let send = only_send(&mut owner);
        assert_eq!(owner.unmap(3), UnmapStatus::Waiting);
        assert_eq!(
            owner.handle_release(1, 5, 3, &lease),
            ReleaseOutcome::Ignored(IgnoredRelease::AlreadyEnded)
        );
        assert_eq!(
            owner.handle_release(1, 5, 3, &[8; 16]),
            ReleaseOutcome::Ignored(IgnoredRelease::UnknownLease)
        );
        assert_eq!((&mut released).now_or_never(), None, "the unmap waits");
        owner.send_completed(send);
        assert_eq!(actions(&mut owner), vec![Action::Unmapped { region: 3 }]);
        assert_eq!((&mut released).now_or_never(), Some(LeaseEnd::Withdrawn));
    }

    #[test]
    fn capabilities_match_only_when_every_byte_does() {
        let mut other = CAP;
        assert!(capabilities_match(&CAP, &other));
        other[0] ^= 0x80;
        assert!(!capabilities_match(&CAP, &other));
    }
}
