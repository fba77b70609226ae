//! The progress thread: the one thread that owns every libfabric object.
//!
//! It opens the provider's fabric, domain, completion queue, address vector
//! and endpoint (`fabric`), holds every memory region, peer entry and
//! posted read, and serves commands from the ring and the control lane.
//! Reading the completion queue is also what progresses the provider: both
//! providers tested here progress data only when called
//! (`FI_PROGRESS_MANUAL`), so this loop is what serves the reads *peers*
//! make of this engine's regions, as well as landing its own.
//!
//! # The loop
//!
//! 1. Drain the control lane, then up to a batch of the ring (the control
//!    lane again before each ring command).
//! 2. Repost request receives and retry sends and reads the provider asked
//!    to retry (`-FI_EAGAIN`), then read completions and answer what
//!    finished (or serve what arrived).
//! 3. Mark reads past their deadline (`fi_cancel` is asked; the answer still
//!    waits for the provider to end the read — see below).
//! 4. If anything happened, go again; else turn (yielding) for the spin
//!    window, then park: announce it on the doorbell, look at the queues
//!    once more, ask `fi_trywait`, and sleep in `poll` on the doorbell and
//!    the completion queue's wait descriptor (when the provider gives one),
//!    bounded by the park timeout — or by a few tens of microseconds while
//!    reads of this engine are in flight, since a manual-progress provider
//!    lands them only when called.
//!
//! # Serving reads (owner-served path)
//!
//! The loop keeps receives posted on the request tag (`protocol`). A
//! request is checked against the live regions — exists, not being
//! unmapped, capability matches, range inside — and answered by a tagged
//! send of the region's bytes under a read lease (the region's
//! `in_flight` count, which an unmap waits for), released when that send's
//! completion is read, or by a zero-length refusal. This engine's own reads
//! post their reply receive first and then send the request.
//!
//! Each consumer address may have at most
//! `OfiConfig::max_served_replies_per_peer` replies unfinished (and, apart,
//! as many refusals): a consumer that asks and never receives would
//! otherwise hold leases and sends without limit. A valid read past the
//! bound is refused as busy; a refusal past the refusal bound is not sent
//! (the request is dropped). The counts drop when each send's completion
//! (success or error) is read, and at teardown with the sends. Since a
//! request names its reply address itself, these bounds are per address:
//! addresses are reduced to one spelling first, gathered replies are also
//! bounded in total ([`GATHERED_BYTES_MAX`]), and a full table of consumer
//! addresses forgets those with nothing unfinished — addresses no send ever
//! completed to (made-up ones) before consumers it reached.
//!
//! Over `tcp;ofi_rxm` a single read is served only to the endpoint the
//! provider names as its request's sender (`FI_SOURCE`); a request from
//! another endpoint than its reply address is refused to its sender, and
//! one whose sender the provider cannot name yet (not in the address
//! vector) is answered "ask again" at its reply address, without a lease.
//! A consumer's engine asks again on that answer, a few times at most
//! (`Engine::ask_again`). In a process run with `FI_AV_REMOVE_CLEANUP`
//! set, an owner that forgets a connected consumer closes its connection;
//! the consumer's next request then fails to send (`FI_ENOTCONN`), and the
//! consumer resets its entry for the owner and sends the request again on
//! a new connection, a few times at most
//! (`Engine::resend_on_new_connection`).
//!
//! # Dead peers
//!
//! Over `tcp;ofi_rxm` nothing tells the application that a peer's process
//! died: the provider handles the connection's shutdown itself, a posted
//! receive stays posted, and every later send to the peer answers "try
//! again" while its reconnections are refused. So the loop watches sends:
//! a peer no send could be posted to for `OfiConfig::unreachable_after`,
//! while no read from it and no send to it completed either (under load a
//! live peer's sends wait for earlier ones, which do complete), is
//! declared unreachable — its queued sends end (releasing their leases),
//! its unposted reads answer, its posted reads are cancelled and answer
//! the error once the provider reports it. To have a send to watch when a
//! read's request went out long ago, a peer this engine waits on and heard
//! nothing from for [`PROBE_INTERVAL`] is sent a four-byte probe
//! (`protocol::PROBE`), at most one per interval. The retry queue keeps
//! order per peer, so an unreachable peer holds up only its own sends.
//!
//! # Answers only after the provider let go
//!
//! A read is answered when its completion (success or error) was read, or
//! after the endpoint was closed at teardown — never earlier, since until
//! then the provider may write its destination. (A `shm` endpoint that
//! teardown parks instead of closing has its reads cancelled; each answers
//! once its cancellation was read: see `Engine::withdraw_for_parking`.) Past its deadline a read is
//! marked, the provider is asked to cancel it, and it answers `Timeout` when
//! the provider ends it with an error (a read that completes late answers
//! `Ok`: the bytes are there). A provider that never ends a read (a stopped
//! peer) holds its answer until teardown closes the endpoint — except over
//! `tcp;ofi_rxm` in a process run with `FI_AV_REMOVE_CLEANUP` set, where a
//! read still held [`STALLED_AFTER`] past its deadline has its owner's
//! connection reset (`Engine::reset_connection`), which ends it.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::ops::ControlFlow;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use crossbeam_channel::{Receiver, Sender, TryRecvError};
use futures::channel::oneshot;
use rdmareg_core::{BackendGet, BackendRegion, PeerId, RdmaError};

use crate::config::{OfiConfig, Provider, ReadPath};
use crate::engine::{Command, Reply, Signals, StartInfo};
use crate::fabric::{
    ADDR_NOTAVAIL, ADDR_UNSPEC, Completion, ERR_NOT_CONNECTED, ERR_TRUNCATED, EndpointEnd, Fabric,
    MemoryRegion, ProviderContext,
};
use crate::key::{CAPABILITY_LEN, PackedKey, validate_address};
use crate::protocol::{
    GATHER_ENTRY_MAX, GATHER_TOTAL_MAX, LIST_VERSION, ListEntry, ListRequest, MAX_LIST_ENTRIES,
    PROBE, RECEIVE_MAX, REPLY_IGNORE, REQUEST_ID_MASK, REQUEST_TAG, ReadRequest, Refusal,
    capability_matches, is_unverified, parse_gathered, refusal_tag, reply_outcome,
};

/// Ring commands handled per turn.
const RING_BATCH: usize = 64;
/// Completions read per turn.
const COMPLETION_BATCH: usize = 256;
/// How long past its deadline a read whose receive the provider did not
/// give back on `fi_cancel` waits before its owner's connection is reset
/// (`Engine::reset_connection`). On `tcp;ofi_rxm` a receive not yet
/// matched is cancelled at once; one still there is matched.
const STALLED_AFTER: Duration = Duration::from_millis(100);
/// The least time teardown waits for the cancellations of the reads of an
/// endpoint it parks (`Engine::withdraw_for_parking`); on `shm` a receive
/// not yet matched is cancelled at once.
const WITHDRAW_MIN: Duration = Duration::from_millis(100);
/// How long teardown of an endpoint it parks goes on waiting for its
/// replies being sent once none completed (`Engine::withdraw_for_parking`).
const SENDS_IDLE_MAX: Duration = Duration::from_secs(1);
/// How long a parked loop sleeps while reads of its own are in flight.
const BUSY_PARK: Duration = Duration::from_micros(20);
/// How many times a read asks its owner again when the owner could not
/// name its sender (`Refusal::Unverified`). One is enough for a consumer
/// the owner had not inserted yet; an owner that forgot a consumer while it
/// stayed connected may answer its first ask again the same way (see
/// `Engine::rename_stale_senders`), hence more.
pub(crate) const ASKS_AGAIN: u8 = 3;
/// How many times a read sends its request again after the send failed
/// because the owner's connection was closed under it (`FI_ENOTCONN`; see
/// `Engine::resend_on_new_connection`).
pub(crate) const RESENDS: u8 = 3;
/// Receives an owner-serving engine keeps posted for requests.
const REQUEST_RECEIVES: usize = 32;
/// How long reads from a peer may go without a completion from it before
/// the engine probes it, and the least time between two probes of it.
const PROBE_INTERVAL: Duration = Duration::from_millis(100);
/// The most distinct consumer addresses an owner inserts into its address
/// vector to answer them; requests from further addresses are dropped.
pub(crate) const MAX_SERVED_PEERS: usize = 4096;
/// The most gathered replies an owner keeps unfinished for one consumer
/// address: each holds a copy of up to `GATHER_TOTAL_MAX` bytes, so this
/// bounds that memory (16 MiB per address) apart from the reply bound.
const GATHERED_PER_PEER: u32 = 64;
/// The most bytes of gathered replies an owner keeps unfinished for all
/// consumers together. The bound per address alone does not bound memory:
/// a peer names any reply address it likes, and replies to an address
/// nobody takes them at stay until that peer is declared unreachable (or
/// for good, at one that never receives). Past it lists are refused as
/// busy, except a consumer address's first unfinished one (so the most
/// held is this plus one reply per address of [`MAX_SERVED_PEERS`]).
pub(crate) const GATHERED_BYTES_MAX: usize = 64 << 20;
/// The most scratch memory a consumer keeps posted for the late replies of
/// one owner's cancelled reads, beyond one such receive (always allowed,
/// whatever its length). An owner that never answers would otherwise make
/// its consumer keep a receive of each timed-out read's length until
/// teardown. Past it the owner's late reply finds no receive, and the
/// owner keeps that reply's lease until the connection ends.
pub(crate) const DISCARD_BYTES_PER_PEER: usize = 64 << 20;
/// The longest gathered reply a consumer on `shm` asks for: the provider's
/// inject size (`SMR_INJECT_SIZE` in libfabric 1.17). A longer message
/// takes `shm`'s copy protocols, which need both sides' progress; measured
/// here, lists of 16 × 4 KiB then moved 64–303 MiB/s against 306–1124 as
/// separate inject-sized reads.
const SHM_GATHER_REPLY_MAX: usize = 4096;

/// One spelling of a validated reply address: the bytes a provider ignores
/// (`sin_zero` of a `sockaddr_in`, the flow label of a `sockaddr_in6`, the
/// NUL padding of a string past its first NUL) zeroed or cut. An owner
/// bounds what it holds per consumer address, so one consumer must not
/// pass for several by spelling its address differently.
fn canonical_address(format: crate::key::AddressFormat, address: &[u8]) -> Vec<u8> {
    use crate::key::AddressFormat;
    let mut canonical = address.to_vec();
    match format {
        AddressFormat::SockaddrIn if canonical.len() == 16 => canonical[8..].fill(0),
        AddressFormat::SockaddrIn6 if canonical.len() == 28 => canonical[4..8].fill(0),
        AddressFormat::Str => {
            if let Some(text) = canonical.iter().position(|&b| b == 0) {
                canonical.truncate(text + 1);
            }
        }
        _ => {}
    }
    canonical
}

/// The thread's body: start, report, serve, tear down.
pub(crate) fn run(
    config: OfiConfig,
    signals: Arc<Signals>,
    ring: Receiver<Command>,
    control: Receiver<Command>,
    ready: Sender<Result<StartInfo, RdmaError>>,
) {
    let fabric = match Fabric::open(&config) {
        Ok(fabric) => fabric,
        Err(err) => {
            signals.closed.store(true, Ordering::SeqCst);
            let _ = ready.send(Err(err));
            return;
        }
    };
    let info = StartInfo {
        address: fabric.address.clone(),
        provider: fabric.provider.clone(),
        resets_stalled_connections: fabric.av_remove_closes,
    };
    tracing::info!(
        provider = %fabric.provider,
        resets_stalled_connections = fabric.av_remove_closes,
        "ofi engine started"
    );
    let mut engine = Engine::new(fabric, &config, signals);
    engine.post_request_receives();
    if ready.send(Ok(info)).is_ok() {
        engine.serve(&ring, &control);
    }
    engine.teardown(&ring, &control);
}

/// One registered region.
#[derive(Debug)]
struct Region {
    ptr: usize,
    len: usize,
    mr: MemoryRegion,
    /// The random capability its key carries.
    capability: [u8; CAPABILITY_LEN],
    /// Reads landing in it, and read leases: replies being sent from it.
    in_flight: usize,
    /// An unmap was submitted: new reads are refused, and these wait for
    /// the reads in flight.
    unmapping: bool,
    waiters: Vec<Reply<()>>,
}

/// An address-vector entry and who uses it.
#[derive(Debug)]
struct AvEntry {
    address: Bytes,
    peers: usize,
    ops: usize,
    /// Inserted to answer a consumer's requests: kept while replies to it
    /// are unfinished, and until the table of consumer addresses fills.
    served: bool,
    /// A send to this address completed: a connection to it was made. The
    /// provider may go on naming that connection after the entry is
    /// removed (see `Engine::forget_idle_consumers`), so such entries are
    /// forgotten last. (Not set from a request's named sender: a name is
    /// what may be wrong.)
    connected: bool,
    /// How many times this engine reset the connection to this address
    /// (`Engine::reconnect`): a send posted under an earlier count ran on
    /// a connection already replaced.
    connection: u64,
}

/// Where a read's answer goes.
#[derive(Debug)]
enum Answer {
    Single(Reply<()>),
    Batch(Rc<RefCell<Batch>>, usize),
}

/// A batch's answers, gathered in request order.
#[derive(Debug)]
struct Batch {
    results: Vec<Option<Result<(), RdmaError>>>,
    remaining: usize,
    reply: Option<oneshot::Sender<Vec<Result<(), RdmaError>>>>,
}

impl Batch {
    fn set(&mut self, index: usize, result: Result<(), RdmaError>) {
        if self.results[index].replace(result).is_none() {
            self.remaining -= 1;
        }
        if self.remaining == 0 {
            if let Some(reply) = self.reply.take() {
                let results = self
                    .results
                    .drain(..)
                    .map(|r| r.unwrap_or(Err(RdmaError::ShuttingDown)))
                    .collect();
                let _ = reply.send(results);
            }
        }
    }
}

fn give(answer: Answer, result: Result<(), RdmaError>) {
    match answer {
        Answer::Single(reply) => {
            let _ = reply.send(result);
        }
        Answer::Batch(batch, index) => batch.borrow_mut().set(index, result),
    }
}

/// Provider context space for one read; its address is the read's
/// context pointer.
#[repr(C)]
struct OpContext {
    space: ProviderContext,
}

/// One posted (or to-be-posted) read. On the owner-served path `posted`
/// means its reply receive is posted.
struct Op {
    context: Box<OpContext>,
    /// The destination region (0, which names none, for a list).
    region: u64,
    fi_addr: u64,
    /// Where the answer goes (`None` for a list: each entry has its own).
    answer: Option<Answer>,
    /// A gathered list: the entries, and the scratch memory the reply is
    /// received into (`buf`/`len` point at it).
    list: Option<Box<ListPart>>,
    deadline: Instant,
    timed_out: bool,
    posted: bool,
    buf: usize,
    len: usize,
    desc: *mut c_void,
    remote: u64,
    key: u64,
    /// Owner-served: the request to send once the receive is posted, and
    /// its id (the reply's tag).
    request: Option<(u64, Vec<u8>)>,
    /// Owner-served: the request id (0 on the one-sided path).
    request_id: u64,
    /// Why the read failed when its request could not be sent, or its
    /// owner was declared unreachable (its receive was then cancelled).
    failure: Option<RdmaError>,
    /// Its owner was declared unreachable: a cancelled receive gets no
    /// discard receive (no reply can come over a connection that is gone).
    unreachable: bool,
    /// Its request could not be sent: no reply will come, so a cancelled
    /// receive gets no discard receive either.
    request_failed: bool,
    /// Its owner's connection was reset for it (or with it) past its
    /// deadline (`Engine::reset_connection`).
    connection_reset: bool,
    /// Owner-served: the request again, for asking once more when the
    /// owner could not name its sender (`Refusal::Unverified`), at most
    /// [`ASKS_AGAIN`] times; `None` once used up.
    ask_again: Option<(u64, Vec<u8>)>,
    /// How many more times the read may ask again.
    asks_left: u8,
    /// Owner-served: the request to send again, on a new connection, once
    /// its receive (cancelled because the request's send found the
    /// connection closed) was given back (`Engine::resend_on_new_connection`).
    resend: Option<(u64, Vec<u8>)>,
    /// How many more times the read may send its request again so.
    resends_left: u8,
}

/// A gathered list's own part of its [`Op`].
struct ListPart {
    entries: Vec<ListItem>,
    /// The reply lands here; served entries are copied out of it.
    scratch: Vec<u8>,
}

/// One entry of a gathered list.
struct ListItem {
    answer: Option<Answer>,
    /// Its destination region, whose `in_flight` counts it.
    region: u64,
    buf: usize,
    len: usize,
    /// Set from the reply; entries without one take the list's outcome.
    result: Option<Result<(), RdmaError>>,
}

/// A batch entry checked and waiting to go into a list.
struct Gatherable {
    request: BackendGet,
    answer: Answer,
    buf: usize,
    region_id: u64,
    capability: [u8; CAPABILITY_LEN],
}

/// Which of a consumer's bounds a reply counts against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReplyKind {
    /// Bytes sent from a region under a lease.
    Bytes,
    /// A zero-length refusal.
    Refusal,
    /// A gathered reply (a copy).
    Gathered,
}

/// One tagged send: a request of this engine's reads, or a reply (bytes or
/// refusal) to a peer's request.
struct SendOp {
    context: Box<OpContext>,
    /// Keeps a request's bytes alive until the send completes.
    _bytes: Option<Vec<u8>>,
    ptr: usize,
    len: usize,
    desc: *mut c_void,
    dest: u64,
    tag: u64,
    /// The region this reply reads: a lease released on completion.
    lease: Option<u64>,
    /// A reply to a consumer counted against its bound: the consumer's
    /// address and whether the reply carries bytes (else a refusal).
    counted: Option<(u64, ReplyKind)>,
    /// The context and request id of the read this request belongs to
    /// (the id tells a later read at a reused context address apart).
    for_read: Option<(usize, u64)>,
    /// A liveness probe ([`PROBE`]).
    probe: bool,
    /// The destination entry's `AvEntry::connection` when the send was
    /// posted (`None`: not posted).
    connection: Option<u64>,
}

impl SendOp {
    /// A zero-length refusal to the consumer at `dest`, counted against
    /// its bound of unfinished replies.
    fn refusal(dest: u64, tag: u64) -> SendOp {
        SendOp {
            context: Box::new(OpContext {
                space: [std::ptr::null_mut(); 8],
            }),
            _bytes: None,
            ptr: 0,
            len: 0,
            desc: std::ptr::null_mut(),
            dest,
            tag,
            lease: None,
            counted: Some((dest, ReplyKind::Refusal)),
            for_read: None,
            probe: false,
            connection: None,
        }
    }
}

/// The receives an endpoint left open at teardown may still write.
#[expect(
    dead_code,
    reason = "held only so they are freed after the endpoint closes"
)]
struct PostedReceives {
    buffers: Vec<RequestBuffer>,
    /// Contexts and buffers of receives posted to discard replies.
    discards: Vec<(Box<OpContext>, Vec<u8>)>,
    /// Sends still in flight: the provider holds their contexts (and, for
    /// requests, their bytes).
    sends: Vec<SendOp>,
}

// SAFETY: no thread uses these any more: they are only kept, and dropped
// once the endpoint that could write them is closed (`Fabric`).
unsafe impl Send for PostedReceives {}

/// A receive kept posted for requests.
struct RequestBuffer {
    context: Box<OpContext>,
    data: Box<[u8; RECEIVE_MAX]>,
    posted: bool,
}

/// What the loop needs of the configuration.
#[derive(Debug, Clone)]
struct Settings {
    spin_window: Duration,
    park_timeout: Duration,
    default_get_deadline: Duration,
    teardown_timeout: Duration,
}

/// Replies one consumer address has unfinished at this owner.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct PeerLoad {
    /// Replies carrying bytes: each holds a read lease.
    served: u32,
    /// Refusals not yet completed.
    refusals: u32,
    /// Gathered replies not yet completed.
    gathered: u32,
}

/// What the engine knows of whether a peer can be reached.
#[derive(Debug, Clone, Copy)]
struct PeerWatch {
    /// Since when a send to it could not be posted (the provider asked to
    /// wait), if one cannot now.
    blocked_since: Option<Instant>,
    /// When a read from it or a send to it last completed without an
    /// error (or its watch began).
    last_heard: Instant,
    /// When it was last probed.
    last_probe: Option<Instant>,
    /// A probe to it is queued or in flight.
    probing: bool,
}

impl PeerWatch {
    fn new(now: Instant) -> PeerWatch {
        PeerWatch {
            blocked_since: None,
            last_heard: now,
            last_probe: None,
            probing: false,
        }
    }
}

/// Everything the progress thread owns. `fabric` is dropped last.
struct Engine {
    regions: HashMap<u64, Region>,
    peers: HashMap<PeerId, u64>,
    av: HashMap<u64, AvEntry>,
    by_address: HashMap<Bytes, u64>,
    ops: Vec<Option<Op>>,
    free_slots: Vec<usize>,
    by_context: HashMap<usize, usize>,
    active: usize,
    unposted: VecDeque<usize>,
    completions: Vec<Completion>,
    /// Completions read out of the queue ahead of forgetting consumer
    /// addresses (`Engine::forget_idle_consumers`), each with its request's
    /// sender already resolved: handled first by the next `reap`.
    read_ahead: Vec<(Completion, Option<Bytes>)>,
    settings: Settings,
    signals: Arc<Signals>,
    page_size: u64,
    shutdown_replies: Vec<oneshot::Sender<()>>,
    /// Sends in flight, by context address.
    sends: HashMap<usize, SendOp>,
    /// Sends the provider asked to retry, by context address, in order.
    unsent: VecDeque<usize>,
    /// Request receives (owner-served path), by context address.
    request_buffers: HashMap<usize, RequestBuffer>,
    /// Receives into scratch memory that take the late reply of a read
    /// whose receive was cancelled, by context address.
    discards: HashMap<usize, (Box<OpContext>, Vec<u8>)>,
    /// The owner and length of each discard receive, by context address,
    /// and the bytes of them posted per owner.
    discard_owners: HashMap<usize, (u64, usize)>,
    discard_bytes: HashMap<u64, usize>,
    served_peers: usize,
    /// The most consumer addresses kept ([`MAX_SERVED_PEERS`]; less in
    /// some of this crate's tests).
    served_peers_bound: usize,
    /// Entry numbers the provider may still name a connection by although
    /// the entry was removed, with the addresses removed from them: over
    /// `tcp;ofi_rxm`, unless `FI_AV_REMOVE_CLEANUP` is set, `fi_av_remove`
    /// leaves a connected peer's record with its old number until the
    /// address is inserted again (`rxm_av_add_peers`,
    /// `prov/util/src/rxm_av.c`), and a later insert reuses the number.
    /// A request named by such a number may come from either peer.
    stale_numbers: HashMap<u64, Vec<Bytes>>,
    /// The number each address of `stale_numbers` was removed from, and
    /// the order they were removed in: past `served_peers_bound` of them
    /// the oldest is dropped (a peer that stayed connected and silent that
    /// long may then be named as another again).
    stale_addresses: HashMap<Bytes, u64>,
    stale_order: VecDeque<Bytes>,
    /// Unfinished replies per consumer address, and their bound.
    reply_loads: HashMap<u64, PeerLoad>,
    reply_bound: u32,
    /// Bytes of gathered replies not yet completed, all consumers together
    /// (bounded by [`GATHERED_BYTES_MAX`]).
    gathered_bytes: usize,
    /// Reachability of the peers sends go to, by address-vector entry.
    watch: HashMap<u64, PeerWatch>,
    unreachable_after: Duration,
    /// When the watch is next looked at.
    next_watch: Instant,
    /// The longest gathered reply this engine asks for (bytes).
    gather_reply_max: usize,
    next_request_id: u64,
    /// Makes request ids unguessable (see `mint_request_id`).
    request_ids: RequestIdPermutation,
    closing: bool,
    /// Teardown is withdrawing the reads of an endpoint it will park
    /// (see [`Engine::withdraw_for_parking`]): discard receives are posted.
    withdrawing: bool,
    fabric: Fabric,
}

/// A secret permutation of 48-bit values: a four-round Feistel network on
/// 24-bit halves whose round function is a randomly keyed SipHash
/// (`RandomState`). Peers never see its output except for their own
/// requests' ids, which tell nothing about another engine's.
struct RequestIdPermutation {
    keys: std::hash::RandomState,
}

impl RequestIdPermutation {
    fn new() -> RequestIdPermutation {
        RequestIdPermutation {
            keys: std::hash::RandomState::new(),
        }
    }

    /// The image of `value` (its low 48 bits), below 2⁴⁸.
    fn permute(&self, value: u64) -> u64 {
        use std::hash::BuildHasher;
        const HALF: u64 = (1 << 24) - 1;
        let (mut left, mut right) = ((value >> 24) & HALF, value & HALF);
        for round in 0u8..4 {
            let mixed = self.keys.hash_one((round, right)) & HALF;
            (left, right) = (right, left ^ mixed);
        }
        (left << 24) | right
    }
}

impl Engine {
    fn new(fabric: Fabric, config: &OfiConfig, signals: Arc<Signals>) -> Engine {
        // SAFETY: sysconf takes no pointers.
        let page_size = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
            n if n > 0 => n as u64,
            _ => 4096,
        };
        Engine {
            regions: HashMap::new(),
            peers: HashMap::new(),
            av: HashMap::new(),
            by_address: HashMap::new(),
            ops: Vec::new(),
            free_slots: Vec::new(),
            by_context: HashMap::new(),
            active: 0,
            unposted: VecDeque::new(),
            completions: Vec::with_capacity(COMPLETION_BATCH),
            read_ahead: Vec::new(),
            settings: Settings {
                spin_window: config.spin_window,
                park_timeout: config.park_timeout,
                default_get_deadline: config.default_get_deadline,
                teardown_timeout: config.teardown_timeout,
            },
            signals,
            page_size,
            shutdown_replies: Vec::new(),
            sends: HashMap::new(),
            unsent: VecDeque::new(),
            request_buffers: HashMap::new(),
            discards: HashMap::new(),
            discard_owners: HashMap::new(),
            discard_bytes: HashMap::new(),
            served_peers: 0,
            served_peers_bound: {
                #[cfg(test)]
                let bound = config.served_peers_bound.unwrap_or(MAX_SERVED_PEERS);
                #[cfg(not(test))]
                let bound = MAX_SERVED_PEERS;
                bound
            },
            stale_numbers: HashMap::new(),
            stale_addresses: HashMap::new(),
            stale_order: VecDeque::new(),
            reply_loads: HashMap::new(),
            reply_bound: config.max_served_replies_per_peer,
            gathered_bytes: 0,
            watch: HashMap::new(),
            unreachable_after: config.unreachable_after,
            next_watch: Instant::now(),
            gather_reply_max: if config.provider == Provider::Shm {
                SHM_GATHER_REPLY_MAX
            } else {
                MAX_LIST_ENTRIES + GATHER_TOTAL_MAX as usize
            },
            next_request_id: 1,
            request_ids: RequestIdPermutation::new(),
            closing: false,
            withdrawing: false,
            fabric,
        }
    }

    fn owner_served(&self) -> bool {
        self.fabric.read_path == ReadPath::OwnerServed
    }

    /// Posts the request receives of the owner-served path.
    fn post_request_receives(&mut self) {
        if !self.owner_served() {
            return;
        }
        for _ in 0..REQUEST_RECEIVES {
            let buffer = RequestBuffer {
                context: Box::new(OpContext {
                    space: [std::ptr::null_mut(); 8],
                }),
                data: Box::new([0u8; RECEIVE_MAX]),
                posted: false,
            };
            let at = (&raw const *buffer.context) as usize;
            self.request_buffers.insert(at, buffer);
            self.repost_request(at);
        }
    }

    /// (Re)posts one request receive; it stays unposted (retried each
    /// turn) while the provider asks to wait.
    fn repost_request(&mut self, at: usize) {
        if self.closing {
            return;
        }
        let Some(buffer) = self.request_buffers.get_mut(&at) else {
            return;
        };
        if buffer.posted {
            return;
        }
        let context = (&raw mut buffer.context.space).cast::<c_void>();
        let data = buffer.data.as_mut_ptr() as usize;
        // SAFETY: the buffer and its context are boxed in
        // `request_buffers`, which keeps them until the endpoint is closed
        // (teardown forgets them if it cannot close it).
        let posted = unsafe {
            self.fabric.trecv(
                data,
                RECEIVE_MAX,
                std::ptr::null_mut(),
                ADDR_UNSPEC,
                REQUEST_TAG,
                0,
                context,
            )
        };
        match posted {
            Ok(true) => buffer.posted = true,
            Ok(false) => {}
            Err(err) => tracing::warn!(error = %err, "could not post a request receive"),
        }
    }

    fn retry_request_receives(&mut self) {
        if self.request_buffers.values().all(|b| b.posted) {
            return;
        }
        let waiting: Vec<usize> = self
            .request_buffers
            .iter()
            .filter(|(_, b)| !b.posted)
            .map(|(&at, _)| at)
            .collect();
        for at in waiting {
            self.repost_request(at);
        }
    }

    fn serve(&mut self, ring: &Receiver<Command>, control: &Receiver<Command>) {
        let mut idle_since: Option<Instant> = None;
        loop {
            let mut worked = !control.is_empty();
            if self.drain_control(control).is_break() {
                return;
            }
            for _ in 0..RING_BATCH {
                match ring.try_recv() {
                    Ok(command) => {
                        worked = true;
                        if self.drain_control(control).is_break() {
                            self.dispatch_closing(command);
                            return;
                        }
                        if self.dispatch(command).is_break() {
                            return;
                        }
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return,
                }
            }
            worked |= self.turn();
            if worked {
                idle_since = None;
                continue;
            }
            let now = Instant::now();
            let since = *idle_since.get_or_insert(now);
            if now.duration_since(since) < self.settings.spin_window {
                std::thread::yield_now();
                continue;
            }
            self.park(ring, control);
            idle_since = None;
        }
    }

    /// Retries, completions, deadlines; answers whether anything happened.
    fn turn(&mut self) -> bool {
        self.retry_request_receives();
        let mut worked = self.retry_unsent();
        worked |= self.retry_unposted();
        worked |= self.reap();
        if self.fabric.is_shm() {
            // Parked endpoints of this process's other engines take what is
            // sent to them only when someone progresses them.
            worked |= Fabric::progress_parked();
        }
        if self.active > 0 || !self.unsent.is_empty() {
            let now = Instant::now();
            if now >= self.next_watch {
                self.next_watch = now + PROBE_INTERVAL / 4;
                worked |= self.watch_peers(now);
            }
        }
        if self.active > 0 {
            self.expire(Instant::now());
        }
        worked
    }

    fn drain_control(&mut self, control: &Receiver<Command>) -> ControlFlow<()> {
        loop {
            match control.try_recv() {
                Ok(command) => self.dispatch(command)?,
                Err(TryRecvError::Empty) => return ControlFlow::Continue(()),
                Err(TryRecvError::Disconnected) => return ControlFlow::Break(()),
            }
        }
    }

    fn dispatch(&mut self, command: Command) -> ControlFlow<()> {
        match command {
            Command::Map {
                id,
                ptr,
                len,
                reply,
            } => self.map_region(id, ptr, len, reply),
            Command::Unmap { id, reply } => self.unmap_region(id, reply),
            Command::Get { request, reply } => {
                if let Err(err) = self.post(request, Answer::Single(reply)) {
                    give(err.0, Err(err.1));
                }
            }
            Command::GetBatch { requests, reply } => self.post_batch(requests, reply),
            Command::AddPeer {
                peer,
                address,
                reply,
            } => {
                let _ = reply.send(self.add_peer(peer, address));
            }
            Command::RemovePeer { peer } => self.remove_peer(peer),
            Command::Shutdown { reply } => {
                self.shutdown_replies.push(reply);
                return ControlFlow::Break(());
            }
        }
        ControlFlow::Continue(())
    }

    /// A command found once teardown began: unmaps proceed, everything else
    /// answers `ShuttingDown`.
    fn dispatch_closing(&mut self, command: Command) {
        match command {
            Command::Map { reply, .. } => {
                let _ = reply.send(Err(RdmaError::ShuttingDown));
            }
            Command::Unmap { id, reply } => self.unmap_region(id, reply),
            Command::Get { reply, .. } => {
                let _ = reply.send(Err(RdmaError::ShuttingDown));
            }
            Command::GetBatch { requests, reply } => {
                let _ = reply.send(vec![Err(RdmaError::ShuttingDown); requests.len()]);
            }
            Command::AddPeer { reply, .. } => {
                let _ = reply.send(Err(RdmaError::ShuttingDown));
            }
            Command::RemovePeer { .. } => {}
            Command::Shutdown { reply } => self.shutdown_replies.push(reply),
        }
    }

    // ---- regions ----

    fn map_region(&mut self, id: u64, ptr: usize, len: usize, reply: Reply<BackendRegion>) {
        if reply.is_canceled() {
            // The caller is gone (its compensating unmap may already have
            // found nothing): do not register at all.
            return;
        }
        let mut capability = [0u8; CAPABILITY_LEN];
        let mut requested_key = id;
        if let Err(err) = getrandom::fill(&mut capability) {
            let _ = reply.send(Err(RdmaError::Backend(format!(
                "ofi: drawing a capability: {err}"
            ))));
            return;
        }
        if self.owner_served() {
            // No peer is told this key; a random one is not guessable from
            // the region ids peers see.
            requested_key = u64::from_le_bytes(capability[..8].try_into().unwrap_or([1; 8]))
                ^ u64::from_le_bytes(capability[8..].try_into().unwrap_or([2; 8]));
        }
        // SAFETY: the caller of `map` guarantees the range stays allocated
        // until an unmap of `id` answers Ok; the engine deregisters before it
        // answers any unmap of `id` Ok.
        let mr = match unsafe { self.fabric.register(ptr, len, requested_key) } {
            Ok(mr) => mr,
            Err(err) => {
                let _ = reply.send(Err(err));
                return;
            }
        };
        self.signals
            .live_registrations
            .fetch_add(1, Ordering::SeqCst);
        let served = self.owner_served();
        let key = PackedKey {
            owner_served: served,
            virt_addr: !served && self.fabric.virt_addr(),
            region_id: id,
            capability,
            mr_key: if served { 0 } else { mr.key },
            base: ptr as u64,
            len: len as u64,
            owner: self.fabric.address.clone(),
        };
        let page = self.page_size;
        let start = (ptr as u64) & !(page - 1);
        let end = (ptr as u64 + len as u64).div_ceil(page) * page;
        self.regions.insert(
            id,
            Region {
                ptr,
                len,
                mr,
                capability,
                in_flight: 0,
                unmapping: false,
                waiters: Vec::new(),
            },
        );
        let region = BackendRegion {
            backend_region_id: id,
            effective_addr: start,
            effective_len: end - start,
            packed_key: key.encode(),
        };
        if reply.send(Ok(region)).is_err() {
            tracing::debug!(id, "map answered nobody: rolling it back");
            self.unmap_region(id, None);
        }
    }

    fn unmap_region(&mut self, id: u64, reply: Option<Reply<()>>) {
        let Some(region) = self.regions.get_mut(&id) else {
            if let Some(reply) = reply {
                let _ = reply.send(Ok(()));
            }
            return;
        };
        region.unmapping = true;
        region.waiters.extend(reply);
        if region.in_flight == 0 {
            self.deregister(id);
        }
    }

    /// Deregisters a region with no reads in flight and answers its
    /// waiters. On failure the region stays (still registered, still
    /// counted) and the waiters hear the error.
    fn deregister(&mut self, id: u64) {
        let Some(region) = self.regions.get_mut(&id) else {
            return;
        };
        let waiters = std::mem::take(&mut region.waiters);
        match self.fabric.deregister(&region.mr) {
            Ok(()) => {
                self.regions.remove(&id);
                self.signals
                    .live_registrations
                    .fetch_sub(1, Ordering::SeqCst);
                for waiter in waiters {
                    let _ = waiter.send(Ok(()));
                }
            }
            Err(err) => {
                tracing::warn!(id, error = %err, "deregistration failed; the region stays registered");
                for waiter in waiters {
                    let _ = waiter.send(Err(err.clone()));
                }
            }
        }
    }

    // ---- peers ----

    fn add_peer(&mut self, peer: PeerId, address: Bytes) -> Result<(), RdmaError> {
        validate_address(self.fabric.address_format, &address)?;
        let fi_addr = match self.by_address.get(&address) {
            Some(&fi_addr) => fi_addr,
            None => self.insert_address(address, false)?,
        };
        if let Some(entry) = self.av.get_mut(&fi_addr) {
            entry.peers += 1;
        }
        if let Some(previous) = self.peers.insert(peer, fi_addr) {
            self.release_av(previous, |entry| entry.peers -= 1);
        }
        Ok(())
    }

    fn remove_peer(&mut self, peer: PeerId) {
        if let Some(fi_addr) = self.peers.remove(&peer) {
            self.release_av(fi_addr, |entry| entry.peers -= 1);
        }
    }

    /// Applies `change` to an entry and removes it once nobody uses it.
    fn release_av(&mut self, fi_addr: u64, change: impl FnOnce(&mut AvEntry)) {
        let Some(entry) = self.av.get_mut(&fi_addr) else {
            return;
        };
        change(entry);
        if entry.peers == 0 && entry.ops == 0 && !entry.served {
            if let Some(entry) = self.av.remove(&fi_addr) {
                self.by_address.remove(&entry.address);
                if entry.connected && self.fabric.reports_source && !self.fabric.av_remove_closes {
                    self.mark_stale(fi_addr, entry.address);
                }
            }
            self.watch.remove(&fi_addr);
            self.fabric.remove_peer(fi_addr);
        }
    }

    // ---- reads ----

    /// Validates and posts one read; on refusal hands the answer back with
    /// the error.
    fn post(&mut self, request: BackendGet, answer: Answer) -> Result<(), (Answer, RdmaError)> {
        let checked = self.check(&request);
        let (fi_addr, target, key, buf, desc, served) = match checked {
            Ok(found) => found,
            Err(err) => return Err((answer, err)),
        };
        let request_bytes = served.map(|(region_id, capability)| {
            let request_id = self.mint_request_id();
            let wire = ReadRequest {
                request_id,
                region_id,
                capability,
                address: request.remote_addr,
                length: request.len,
                reply_to: self.fabric.address.to_vec(),
            }
            .encode();
            (request_id, wire)
        });
        let deadline = Instant::now()
            + request
                .deadline
                .unwrap_or(self.settings.default_get_deadline);
        if let Some(region) = self.regions.get_mut(&request.local_region_id) {
            region.in_flight += 1;
        }
        self.start_op(Op {
            context: Box::new(OpContext {
                space: [std::ptr::null_mut(); 8],
            }),
            region: request.local_region_id,
            fi_addr,
            answer: Some(answer),
            list: None,
            deadline,
            timed_out: false,
            posted: false,
            buf,
            len: request.len as usize,
            desc,
            remote: target,
            key,
            request_id: request_bytes.as_ref().map_or(0, |(id, _)| *id),
            // Only an owner whose provider names senders answers "ask
            // again", and both ends use the same provider.
            ask_again: if self.fabric.reports_source {
                request_bytes.clone()
            } else {
                None
            },
            asks_left: ASKS_AGAIN,
            resend: None,
            resends_left: RESENDS,
            request: request_bytes,
            failure: None,
            unreachable: false,
            request_failed: false,
            connection_reset: false,
        });
        Ok(())
    }

    /// A request id not in use (below 2⁴⁸, never 0) that no other peer can
    /// guess: the next value of a counter, through a secret permutation.
    /// An owner answers at the address a request names, so a third peer
    /// could otherwise ask an owner, in a victim's name, for a read with
    /// the id the victim uses next (a counter from 1 is plain to see), and
    /// the victim's receive for that id would take the answer.
    fn mint_request_id(&mut self) -> u64 {
        loop {
            let counter = self.next_request_id;
            self.next_request_id = (self.next_request_id + 1) & REQUEST_ID_MASK;
            if self.next_request_id == 0 {
                self.next_request_id = 1;
            }
            // Distinct counters give distinct ids: a permutation.
            let request_id = self.request_ids.permute(counter);
            if request_id != 0 {
                return request_id;
            }
        }
    }

    /// Enters a checked read (or list) into the op table and posts it,
    /// queues it while the provider asks to wait, or ends it.
    fn start_op(&mut self, op: Op) {
        let slot = self.free_slots.pop().unwrap_or_else(|| {
            self.ops.push(None);
            self.ops.len() - 1
        });
        let context_addr = (&raw const *op.context) as usize;
        let fi_addr = op.fi_addr;
        self.ops[slot] = Some(op);
        self.by_context.insert(context_addr, slot);
        self.active += 1;
        if let Some(entry) = self.av.get_mut(&fi_addr) {
            entry.ops += 1;
        }
        match self.try_post(slot) {
            Ok(true) => {}
            Ok(false) => self.unposted.push_back(slot),
            Err(err) => self.finish(slot, Err(err)),
        }
    }

    /// Posts a batch. On the owner-served path its small reads (at most
    /// `GATHER_ENTRY_MAX`) of one owner go as lists of up to
    /// `MAX_LIST_ENTRIES` entries and `GATHER_TOTAL_MAX` bytes, each
    /// answered by one gathered reply; every entry is checked here as a
    /// single read is, and answered on its own.
    fn post_batch(
        &mut self,
        requests: Vec<BackendGet>,
        reply: oneshot::Sender<Vec<Result<(), RdmaError>>>,
    ) {
        let batch = Rc::new(RefCell::new(Batch {
            results: vec![None; requests.len()],
            remaining: requests.len(),
            reply: Some(reply),
        }));
        if requests.is_empty() {
            if let Some(reply) = batch.borrow_mut().reply.take() {
                let _ = reply.send(Vec::new());
            }
            return;
        }
        // Scratch receives need no registration only where the provider
        // needs no local descriptors.
        let gather = self.owner_served() && !self.fabric.needs_local_desc();
        let mut groups: Vec<(u64, Vec<Gatherable>)> = Vec::new();
        for (index, request) in requests.into_iter().enumerate() {
            let answer = Answer::Batch(Rc::clone(&batch), index);
            // An entry that cannot share a reply with another is not
            // worth a list.
            let small = request.len <= GATHER_ENTRY_MAX
                && (request.len as usize) < self.gather_reply_max / 2;
            if gather && small {
                match self.check(&request) {
                    Ok((fi_addr, _, _, buf, _, Some((region_id, capability)))) => {
                        let entry = Gatherable {
                            request,
                            answer,
                            buf,
                            region_id,
                            capability,
                        };
                        match groups.iter_mut().find(|(at, _)| *at == fi_addr) {
                            Some((_, group)) => group.push(entry),
                            None => groups.push((fi_addr, vec![entry])),
                        }
                        continue;
                    }
                    Ok(_) => {}
                    Err(err) => {
                        give(answer, Err(err));
                        continue;
                    }
                }
            }
            if let Err((answer, err)) = self.post(request, answer) {
                give(answer, Err(err));
            }
        }
        for (fi_addr, group) in groups {
            let mut list = Vec::new();
            let mut total = 0;
            for entry in group {
                // The reply: a status byte per entry and their bytes.
                let grown = total + entry.request.len as usize;
                if list.len() == MAX_LIST_ENTRIES
                    || grown > GATHER_TOTAL_MAX as usize
                    || list.len() + 1 + grown > self.gather_reply_max
                {
                    self.post_list(fi_addr, std::mem::take(&mut list));
                    total = 0;
                }
                total += entry.request.len as usize;
                list.push(entry);
            }
            self.post_list(fi_addr, list);
        }
    }

    /// Posts checked entries of one owner as one list (a lone entry as a
    /// single read).
    fn post_list(&mut self, fi_addr: u64, mut entries: Vec<Gatherable>) {
        if entries.len() <= 1 {
            if let Some(entry) = entries.pop() {
                if let Err((answer, err)) = self.post(entry.request, entry.answer) {
                    give(answer, Err(err));
                }
            }
            return;
        }
        let request_id = self.mint_request_id();
        let request = ListRequest {
            request_id,
            entries: entries
                .iter()
                .map(|entry| ListEntry {
                    region_id: entry.region_id,
                    capability: entry.capability,
                    address: entry.request.remote_addr,
                    length: entry.request.len,
                })
                .collect(),
            reply_to: self.fabric.address.to_vec(),
        };
        let reply_len = request.reply_len();
        let wire = request.encode();
        let now = Instant::now();
        let default = self.settings.default_get_deadline;
        let deadline = entries
            .iter()
            .map(|entry| now + entry.request.deadline.unwrap_or(default))
            .min()
            .unwrap_or(now + default);
        let mut scratch = vec![0u8; reply_len];
        let buf = scratch.as_mut_ptr() as usize;
        let mut items = Vec::with_capacity(entries.len());
        for entry in entries {
            let region = entry.request.local_region_id;
            if let Some(held) = self.regions.get_mut(&region) {
                held.in_flight += 1;
            }
            items.push(ListItem {
                answer: Some(entry.answer),
                region,
                buf: entry.buf,
                len: entry.request.len as usize,
                result: None,
            });
        }
        self.start_op(Op {
            context: Box::new(OpContext {
                space: [std::ptr::null_mut(); 8],
            }),
            region: 0,
            fi_addr,
            answer: None,
            list: Some(Box::new(ListPart {
                entries: items,
                scratch,
            })),
            deadline,
            timed_out: false,
            posted: false,
            buf,
            len: reply_len,
            desc: std::ptr::null_mut(),
            remote: 0,
            key: 0,
            request_id,
            request: Some((request_id, wire)),
            ask_again: None,
            asks_left: 0,
            resend: None,
            resends_left: RESENDS,
            failure: None,
            unreachable: false,
            request_failed: false,
            connection_reset: false,
        });
    }

    /// A list's reply arrived (`len` bytes, tag `tag`): checks that it adds
    /// up and copies each served entry into its destination. An error ends
    /// every entry that has no answer of its own.
    fn land_list(&mut self, slot: usize, len: usize, tag: u64) -> Result<(), RdmaError> {
        reply_outcome(tag)?;
        let Some(list) = self.ops[slot].as_mut().and_then(|op| op.list.as_mut()) else {
            return Ok(());
        };
        let lengths: Vec<u64> = list.entries.iter().map(|item| item.len as u64).collect();
        let outcomes = list
            .scratch
            .get(..len)
            .and_then(|received| parse_gathered(received, &lengths))
            .ok_or_else(|| {
                RdmaError::Backend(format!(
                    "ofi: the owner's gathered reply of {len} bytes does not add up to its \
                     {} entries; nothing of it landed",
                    lengths.len()
                ))
            })?;
        for (item, outcome) in list.entries.iter_mut().zip(outcomes) {
            item.result = Some(outcome.map(|at| {
                // SAFETY: `parse_gathered` checked `at + item.len` lies
                // within the `len` bytes received into `scratch`; `item.buf`
                // and `item.len` lie inside the item's destination region
                // (checked against the mapped pointer and length), which
                // stays registered while its `in_flight` counts this list,
                // and the caller of `get` leaves it alone until answered.
                // The provider is done with `scratch`: its receive completed.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        list.scratch.as_ptr().add(at),
                        item.buf as *mut u8,
                        item.len,
                    );
                }
            }));
        }
        Ok(())
    }

    /// Everything a read is checked against before libfabric sees it; for
    /// an owner-served key also the region id and capability to ask with.
    #[allow(clippy::type_complexity)]
    fn check(
        &self,
        request: &BackendGet,
    ) -> Result<
        (
            u64,
            u64,
            u64,
            usize,
            *mut c_void,
            Option<(u64, [u8; CAPABILITY_LEN])>,
        ),
        RdmaError,
    > {
        if request.len == 0 {
            return Err(RdmaError::OutOfRange);
        }
        let fi_addr = *self
            .peers
            .get(&request.peer)
            .ok_or(RdmaError::NotConfigured)?;
        let key = PackedKey::decode(&request.packed_key)?;
        let owner = self.av.get(&fi_addr).map(|entry| &entry.address);
        if owner != Some(&key.owner) {
            // A key of another owner than the peer named.
            return Err(RdmaError::InvalidKey);
        }
        if key.owner_served != self.owner_served() {
            // A key of the other read path: this engine cannot use it.
            return Err(RdmaError::InvalidKey);
        }
        let target = key.target(request.remote_addr, request.len)?;
        let region = self
            .regions
            .get(&request.local_region_id)
            .filter(|region| !region.unmapping)
            .ok_or(RdmaError::RegionNotFound)?;
        let end = request
            .local_offset
            .checked_add(request.len)
            .ok_or(RdmaError::OutOfRange)?;
        if end > region.len as u64 {
            return Err(RdmaError::OutOfRange);
        }
        let buf = region.ptr + request.local_offset as usize;
        let served = key.owner_served.then_some((key.region_id, key.capability));
        Ok((fi_addr, target, key.mr_key, buf, region.mr.desc, served))
    }

    fn try_post(&mut self, slot: usize) -> Result<bool, RdmaError> {
        let Some(op) = self.ops[slot].as_mut() else {
            return Ok(true);
        };
        let context = (&raw mut op.context.space).cast::<c_void>();
        if let Some((request_id, _)) = &op.request {
            // SAFETY: as below: the destination range stays registered
            // while `in_flight` counts this read, and the context box lives
            // in the op table until the receive's completion is read or the
            // endpoint is closed.
            let posted = unsafe {
                self.fabric.trecv(
                    op.buf,
                    op.len,
                    op.desc,
                    op.fi_addr,
                    *request_id,
                    REPLY_IGNORE,
                    context,
                )
            }?;
            op.posted = posted;
            if posted {
                // The receive is posted: now ask.
                let (request_id, wire) = op.request.take().unwrap_or_default();
                let send = SendOp {
                    context: Box::new(OpContext {
                        space: [std::ptr::null_mut(); 8],
                    }),
                    ptr: wire.as_ptr() as usize,
                    len: wire.len(),
                    _bytes: Some(wire),
                    desc: std::ptr::null_mut(),
                    dest: op.fi_addr,
                    tag: REQUEST_TAG,
                    lease: None,
                    counted: None,
                    for_read: Some((context as usize, request_id)),
                    probe: false,
                    connection: None,
                };
                self.queue_send(send);
            }
            return Ok(posted);
        }
        // SAFETY: `buf..buf+len` lies inside the destination region (checked
        // against the mapped pointer and length), which stays registered
        // while `in_flight` counts this read (unmaps wait); the context box
        // lives in the op table until the completion is read or the
        // endpoint is closed.
        let posted = unsafe {
            self.fabric.read(
                op.buf, op.len, op.desc, op.fi_addr, op.remote, op.key, context,
            )
        }?;
        op.posted = posted;
        Ok(posted)
    }

    fn retry_unposted(&mut self) -> bool {
        let mut worked = false;
        for _ in 0..self.unposted.len() {
            let Some(slot) = self.unposted.pop_front() else {
                break;
            };
            match self.try_post(slot) {
                Ok(true) => worked = true,
                Ok(false) => {
                    self.unposted.push_front(slot);
                    break;
                }
                Err(err) => {
                    worked = true;
                    self.finish(slot, Err(err));
                }
            }
        }
        worked
    }

    /// The address of the entry a request's completion names its sender
    /// by, as the address vector is now (`None`: not a request, not named,
    /// a provider that names no senders, or a number that may name a
    /// forgotten peer as well: see `stale_numbers`).
    fn sender_of(&self, completion: &Completion) -> Option<Bytes> {
        match completion {
            Completion::Done(context, _, _, source)
                if self.fabric.reports_source
                    && self.request_buffers.contains_key(&(*context as usize))
                    && !self.stale_numbers.contains_key(source) =>
            {
                self.av.get(source).map(|entry| entry.address.clone())
            }
            _ => None,
        }
    }

    /// Records that the provider may go on naming `address`'s connection
    /// by `number`, removed from the address vector.
    fn mark_stale(&mut self, number: u64, address: Bytes) {
        self.unmark_stale(&address);
        self.stale_addresses.insert(address.clone(), number);
        self.stale_numbers
            .entry(number)
            .or_default()
            .push(address.clone());
        self.stale_order.push_back(address);
        if self.stale_order.len() > self.served_peers_bound {
            if let Some(oldest) = self.stale_order.front().cloned() {
                self.unmark_stale(&oldest);
            }
        }
    }

    /// `address` is no longer named by a removed number; answers whether
    /// it was.
    fn unmark_stale(&mut self, address: &Bytes) -> bool {
        let Some(old) = self.stale_addresses.remove(address) else {
            return false;
        };
        self.stale_order.retain(|held| held != address);
        if let Some(holders) = self.stale_numbers.get_mut(&old) {
            holders.retain(|held| held != address);
            if holders.is_empty() {
                self.stale_numbers.remove(&old);
            }
        }
        true
    }

    /// The completions of a batch name some senders by numbers that may
    /// also name forgotten peers: those requests are answered as unnamed
    /// ("ask again", at their reply address, without a lease), and the
    /// forgotten peers are inserted again, which renames their
    /// connections, so that the requests asked again are named right.
    fn rename_stale_senders(&mut self, completions: &[Completion]) {
        let named: Vec<u64> = completions
            .iter()
            .filter_map(|completion| match completion {
                Completion::Done(context, _, _, source)
                    if self.request_buffers.contains_key(&(*context as usize))
                        && self.stale_numbers.contains_key(source) =>
                {
                    Some(*source)
                }
                _ => None,
            })
            .collect();
        for number in named {
            for address in self.stale_numbers.get(&number).cloned().unwrap_or_default() {
                if self.by_address.contains_key(&address) {
                    self.unmark_stale(&address);
                    continue;
                }
                tracing::debug!(
                    number,
                    "a request was named by the number of a forgotten peer; inserting that peer again"
                );
                match self.insert_address(address.clone(), true) {
                    Ok(_) => self.served_peers += 1,
                    Err(err) => {
                        self.unmark_stale(&address);
                        tracing::debug!(error = %err, "could not insert a forgotten peer again");
                    }
                }
            }
        }
    }

    /// Reads every completion the provider has ready, resolving request
    /// senders now, for the next `reap`: done before entries are removed
    /// from the address vector, whose numbers later inserts reuse, so that
    /// no completion written before the removal is read after it.
    fn read_ahead_of_forgetting(&mut self) {
        if !self.fabric.reports_source {
            return;
        }
        let mut read = Vec::new();
        loop {
            let before = read.len();
            self.fabric
                .poll_completions(&mut read, before + COMPLETION_BATCH);
            if read.len() - before < COMPLETION_BATCH {
                break;
            }
        }
        for completion in read {
            let sender = self.sender_of(&completion);
            self.read_ahead.push((completion, sender));
        }
    }

    /// Reads completions and answers what they end.
    fn reap(&mut self) -> bool {
        let mut completions = std::mem::take(&mut self.completions);
        let mut senders: Vec<Option<Bytes>> = Vec::new();
        for (completion, sender) in std::mem::take(&mut self.read_ahead) {
            completions.push(completion);
            senders.push(sender);
        }
        self.fabric
            .poll_completions(&mut completions, COMPLETION_BATCH);
        let worked = !completions.is_empty();
        // The address-vector entry a request's sender is named by is read
        // now, before any request of this batch is served: serving one may
        // forget idle consumer addresses and give their entry numbers to
        // new ones, after which a number read here would name another peer.
        let polled: Vec<Option<Bytes>> = completions[senders.len()..]
            .iter()
            .map(|completion| self.sender_of(completion))
            .collect();
        senders.extend(polled);
        if !self.stale_numbers.is_empty() {
            self.rename_stale_senders(&completions);
        }
        for (index, completion) in completions.drain(..).enumerate() {
            let (context, result) = match completion {
                Completion::Done(context, len, tag, source) => (context, Ok((len, tag, source))),
                Completion::Failed(context, code, text) => (context, Err((code, text))),
            };
            let at = context as usize;
            if self.sends.contains_key(&at) {
                self.send_done(at, result.map(|_| ()));
                continue;
            }
            if self.request_buffers.contains_key(&at) {
                let sender = senders.get(index).cloned().flatten();
                self.request_arrived(at, result.map(|(len, _, _)| (len, sender)));
                continue;
            }
            if self.discards.remove(&at).is_some() {
                if let Some((owner, len)) = self.discard_owners.remove(&at) {
                    if let Some(held) = self.discard_bytes.get_mut(&owner) {
                        *held = held.saturating_sub(len);
                        if *held == 0 {
                            self.discard_bytes.remove(&owner);
                        }
                    }
                }
                tracing::trace!(ok = result.is_ok(), "a discard receive ended");
                continue;
            }
            let Some(slot) = self.by_context.get(&at).copied() else {
                tracing::warn!(?context, "a completion for no operation of this engine");
                continue;
            };
            let (timed_out, failure, served, expected, request_id, fi_addr, no_reply) =
                match self.ops[slot].as_mut() {
                    Some(op) => (
                        op.timed_out,
                        op.failure.take(),
                        self.fabric.read_path == ReadPath::OwnerServed,
                        op.len,
                        op.request_id,
                        op.fi_addr,
                        op.unreachable || op.request_failed,
                    ),
                    None => continue,
                };
            let resend = self.ops[slot].as_mut().and_then(|op| op.resend.take());
            if let (Some(request), Err(_)) = (resend, &result) {
                // The receive cancelled for a request that found its
                // connection closed was given back: post it again and
                // send the request on the new connection.
                if self.closing {
                    self.finish(slot, Err(RdmaError::ShuttingDown));
                    continue;
                }
                if !timed_out {
                    if let Some(op) = self.ops[slot].as_mut() {
                        tracing::debug!(
                            request = request.0,
                            resends_left = op.resends_left,
                            "sending a read request again on a new connection"
                        );
                        op.request = Some(request);
                        op.request_failed = false;
                        op.posted = false;
                        self.unposted.push_back(slot);
                        continue;
                    }
                }
            }
            if result.is_ok() {
                if let Some(watch) = self.watch.get_mut(&fi_addr) {
                    watch.last_heard = Instant::now();
                }
            }
            tracing::trace!(
                slot,
                ok = result.is_ok(),
                timed_out,
                "a read's receive ended"
            );
            let is_list = self.ops[slot].as_ref().is_some_and(|op| op.list.is_some());
            if let (Ok((_, tag, _)), true) = (&result, served) {
                if is_unverified(*tag) {
                    if self.ask_again(slot) {
                        continue;
                    }
                    // Not asked again: past its deadline, or at teardown.
                    if timed_out || self.closing {
                        let why = if timed_out {
                            RdmaError::Timeout
                        } else {
                            RdmaError::ShuttingDown
                        };
                        self.finish(slot, Err(why));
                        continue;
                    }
                }
            }
            if let (Ok((len, tag, _)), true) = (&result, is_list) {
                let outcome = self.land_list(slot, *len, *tag);
                self.finish(slot, outcome);
                continue;
            }
            let truncated = matches!(result, Err((ERR_TRUNCATED, _)));
            if served && result.is_err() && !no_reply && !truncated {
                // The receive ended (cancelled) without the reply: the owner
                // may still send it, and holds its lease until a receive
                // takes it. (A reply longer than asked did arrive, truncated:
                // nothing is left to take, and a discard receive would stay
                // posted, with its scratch memory, until teardown.)
                self.post_discard(fi_addr, request_id, expected);
            }
            let result = match result {
                Ok((len, tag, _)) if served => match reply_outcome(tag) {
                    Ok(()) if len != expected => Err((
                        0,
                        format!("the owner sent {len} bytes for a read of {expected}"),
                    )),
                    Ok(()) => Ok(()),
                    Err(refused) => {
                        self.finish(slot, Err(refused));
                        continue;
                    }
                },
                Ok(_) => Ok(()),
                Err(failed) => match failure {
                    Some(err) => {
                        self.finish(slot, Err(err));
                        continue;
                    }
                    None => Err(failed),
                },
            };
            // Only the deadline makes a Timeout: tcp;ofi_rxm reports an
            // owner's refusal (stale key, range outside the region) as
            // FI_ECANCELED, which is a refusal, not a timeout.
            let result = match result {
                Ok(()) => Ok(()),
                Err(_) if timed_out => Err(RdmaError::Timeout),
                Err((_, text)) => Err(RdmaError::Backend(format!("ofi: read failed: {text}"))),
            };
            self.finish(slot, result);
        }
        self.completions = completions;
        worked
    }

    // ---- sends and serving ----

    /// Posts a receive into scratch memory for the reply (or refusal) of
    /// `request_id`, so the owner's send of it completes and its lease
    /// ends. (A truncating zero-length receive is not enough: measured on
    /// shm, a large send truncated that way never completes.)
    fn post_discard(&mut self, fi_addr: u64, request_id: u64, len: usize) {
        if (self.closing && !self.withdrawing) || self.fabric.needs_local_desc() {
            return;
        }
        let held = self.discard_bytes.get(&fi_addr).copied().unwrap_or(0);
        // Withdrawing at teardown, every read in flight gets one: that is
        // bounded by the reads in flight, and an owner of the process waits
        // for its reply to be taken (see `withdraw_for_parking`).
        if !self.withdrawing && held > 0 && held + len > DISCARD_BYTES_PER_PEER {
            tracing::debug!(
                request_id,
                held,
                "this owner's late replies already have their scratch budget; the owner keeps \
                 this reply's lease until the connection ends"
            );
            return;
        }
        let mut context = Box::new(OpContext {
            space: [std::ptr::null_mut(); 8],
        });
        let mut scratch = vec![0u8; len];
        let at = (&raw const *context) as usize;
        let space = (&raw mut context.space).cast::<c_void>();
        // SAFETY: the scratch buffer and the context box stay in `discards`
        // until the receive's completion is read or the endpoint is closed;
        // the provider needs no descriptor for local buffers.
        let posted = unsafe {
            self.fabric.trecv(
                scratch.as_mut_ptr() as usize,
                len,
                std::ptr::null_mut(),
                fi_addr,
                request_id,
                REPLY_IGNORE,
                space,
            )
        };
        match posted {
            Ok(true) => {
                self.discards.insert(at, (context, scratch));
                self.discard_owners.insert(at, (fi_addr, len));
                *self.discard_bytes.entry(fi_addr).or_default() += len;
            }
            Ok(false) | Err(_) => {
                tracing::debug!(
                    request_id,
                    "could not post a discard receive; the owner keeps its lease until teardown"
                );
            }
        }
    }

    /// Posts a send now, or queues it when the provider asks to wait.
    fn queue_send(&mut self, send: SendOp) {
        let at = (&raw const *send.context) as usize;
        let dest = send.dest;
        self.sends.insert(at, send);
        // Sends to one peer keep their order; a peer that cannot be reached
        // holds up only its own.
        let waiting = self
            .unsent
            .iter()
            .any(|queued| self.sends.get(queued).is_some_and(|s| s.dest == dest));
        if waiting || !self.post_send(at) {
            self.unsent.push_back(at);
        }
    }

    /// Posts one queued send; `false` to retry later. A send that fails to
    /// post ends as if its completion had failed.
    fn post_send(&mut self, at: usize) -> bool {
        let Some(send) = self.sends.get_mut(&at) else {
            return true;
        };
        let context = (&raw mut send.context.space).cast::<c_void>();
        // SAFETY: a reply's bytes lie inside a registered region held by
        // its lease until this send's completion is read; a request's
        // bytes are owned by the entry; the entry (and its boxed context)
        // stays in `sends` until then, or until the endpoint is closed.
        let posted = unsafe {
            self.fabric
                .tsend(send.ptr, send.len, send.desc, send.dest, send.tag, context)
        };
        let dest = send.dest;
        match posted {
            Ok(true) => {
                send.connection = self.av.get(&dest).map(|entry| entry.connection);
                if let Some(watch) = self.watch.get_mut(&dest) {
                    watch.blocked_since = None;
                }
                true
            }
            Ok(false) => {
                let now = Instant::now();
                let watch = self
                    .watch
                    .entry(dest)
                    .or_insert_with(|| PeerWatch::new(now));
                watch.blocked_since.get_or_insert(now);
                false
            }
            Err(err) => {
                self.send_done(at, Err((0, err.to_string())));
                true
            }
        }
    }

    /// Retries queued sends in order; a peer whose send must wait holds up
    /// only its own later sends.
    fn retry_unsent(&mut self) -> bool {
        let mut worked = false;
        let mut waiting: Vec<u64> = Vec::new();
        let mut left = VecDeque::with_capacity(self.unsent.len());
        while let Some(at) = self.unsent.pop_front() {
            let Some(dest) = self.sends.get(&at).map(|send| send.dest) else {
                continue;
            };
            if waiting.contains(&dest) {
                left.push_back(at);
            } else if self.post_send(at) {
                worked = true;
            } else {
                waiting.push(dest);
                left.push_back(at);
            }
        }
        self.unsent = left;
        worked
    }

    /// Probes peers this engine waits on and hears nothing from, and
    /// declares unreachable those no send could be posted to, and nothing
    /// completed with, for `unreachable_after`. Answers whether anything
    /// happened.
    fn watch_peers(&mut self, now: Instant) -> bool {
        if self.owner_served() && self.active > 0 {
            let waited_on: Vec<u64> = self
                .av
                .iter()
                .filter(|(_, entry)| entry.ops > 0)
                .map(|(&fi_addr, _)| fi_addr)
                .collect();
            for fi_addr in waited_on {
                let watch = self
                    .watch
                    .entry(fi_addr)
                    .or_insert_with(|| PeerWatch::new(now));
                let quiet = now.duration_since(watch.last_heard) >= PROBE_INTERVAL;
                let due = watch
                    .last_probe
                    .is_none_or(|at| now.duration_since(at) >= PROBE_INTERVAL);
                if quiet && due && !watch.probing {
                    watch.probing = true;
                    watch.last_probe = Some(now);
                    self.queue_send(SendOp {
                        context: Box::new(OpContext {
                            space: [std::ptr::null_mut(); 8],
                        }),
                        ptr: PROBE.as_ptr() as usize,
                        len: PROBE.len(),
                        _bytes: None,
                        desc: std::ptr::null_mut(),
                        dest: fi_addr,
                        tag: REQUEST_TAG,
                        lease: None,
                        counted: None,
                        for_read: None,
                        probe: true,
                        connection: None,
                    });
                }
            }
        }
        let gone: Vec<(u64, Duration)> = self
            .watch
            .iter()
            .filter_map(|(&fi_addr, watch)| {
                // Blocked sends alone are not enough: under load a live
                // peer's sends wait for earlier ones (a full transmit
                // queue) while those complete.
                let since = watch.blocked_since?;
                let waited = now.duration_since(since);
                let quiet = now.duration_since(watch.last_heard);
                (waited >= self.unreachable_after && quiet >= self.unreachable_after)
                    .then_some((fi_addr, waited))
            })
            .collect();
        let worked = !gone.is_empty();
        for (fi_addr, waited) in gone {
            self.declare_unreachable(fi_addr, waited);
        }
        worked
    }

    /// Ends everything that waits on a peer no send could reach for
    /// `waited`: its queued sends (a reply's lease with it), its reads not
    /// yet posted; its posted reads are cancelled and answer the error once
    /// the provider reports the cancellation (or at their deadline or
    /// teardown, if it cannot withdraw them).
    fn declare_unreachable(&mut self, fi_addr: u64, waited: Duration) {
        let error = RdmaError::Backend(format!(
            "ofi: the peer is unreachable: nothing could be sent to it for {} ms (its process \
             died, or its connection was lost and cannot be made again)",
            waited.as_millis()
        ));
        tracing::warn!(fi_addr, ?waited, "a peer is unreachable; its reads end");
        let stuck: Vec<usize> = self
            .unsent
            .iter()
            .copied()
            .filter(|at| self.sends.get(at).is_some_and(|send| send.dest == fi_addr))
            .collect();
        self.unsent.retain(|at| !stuck.contains(at));
        for at in stuck {
            self.send_done(at, Err((0, "the peer is unreachable".into())));
        }
        let mut unposted = Vec::new();
        for slot in 0..self.ops.len() {
            let Some(op) = self.ops[slot].as_mut() else {
                continue;
            };
            if op.fi_addr != fi_addr {
                continue;
            }
            op.failure = Some(error.clone());
            op.unreachable = true;
            if op.posted {
                let context = (&raw mut op.context.space).cast::<c_void>();
                self.fabric.cancel(context);
            } else {
                unposted.push(slot);
            }
        }
        for slot in unposted {
            self.unposted.retain(|&s| s != slot);
            self.finish(slot, Err(error.clone()));
        }
        self.watch.insert(fi_addr, PeerWatch::new(Instant::now()));
    }

    /// A send ended: release its lease; a failed request fails its read
    /// (whose receive is cancelled, and answers when that is reported).
    fn send_done(&mut self, at: usize, result: Result<(), (i32, String)>) {
        let Some(send) = self.sends.remove(&at) else {
            return;
        };
        tracing::trace!(tag = format_args!("{:#x}", send.tag), ok = result.is_ok(), lease = ?send.lease, "a send ended");
        if let Some(region) = send.lease {
            self.release_lease(region);
        }
        if let Some((peer, kind)) = send.counted {
            self.release_reply(peer, kind);
            if kind == ReplyKind::Gathered {
                self.gathered_bytes = self.gathered_bytes.saturating_sub(send.len);
            }
        }
        if result.is_ok() {
            if let Some(entry) = self.av.get_mut(&send.dest) {
                entry.connected = true;
            }
        }
        if let Some(watch) = self.watch.get_mut(&send.dest) {
            if send.probe {
                watch.probing = false;
            }
            if result.is_ok() {
                watch.last_heard = Instant::now();
            }
        }
        if let Err((code, text)) = result {
            tracing::debug!(tag = format_args!("{:#x}", send.tag), error = %text, "a tagged send failed");
            if let Some((read, request_id)) = send.for_read {
                let slot = self.by_context.get(&read).copied().filter(|&slot| {
                    self.ops[slot]
                        .as_ref()
                        .is_some_and(|op| op.request_id == request_id)
                });
                let Some(slot) = slot else {
                    return;
                };
                if self.resend_on_new_connection(slot, code, send) {
                    return;
                }
                if let Some(op) = self.ops[slot].as_mut() {
                    op.request_failed = true;
                    // A request that teardown ended failed because the
                    // engine is going away, not because of the fabric.
                    op.failure = Some(if self.closing {
                        RdmaError::ShuttingDown
                    } else if code == ERR_NOT_CONNECTED && op.resends_left < RESENDS {
                        RdmaError::Backend(format!(
                            "ofi: sending the read request failed: {text}; it was sent again \
                             on a new connection {} times",
                            RESENDS - op.resends_left
                        ))
                    } else {
                        RdmaError::Backend(format!("ofi: sending the read request failed: {text}"))
                    });
                    self.fabric.cancel(read as *mut c_void);
                }
            }
        }
    }

    /// The request of the read in `slot` failed to send (`code`). Over
    /// `tcp;ofi_rxm` in a process run with `FI_AV_REMOVE_CLEANUP` set, an
    /// owner whose table of consumer addresses is full forgets idle
    /// consumers, and removing one closes its connection
    /// (`rxm_av_remove_handler`); the consumer's provider goes on sending
    /// on its end of it, and the send fails with `FI_ENOTCONN` (measured:
    /// sending again on it, even 50 times in a row, fails the same way).
    /// So the owner's address-vector entry is reset as for a stalled read
    /// (`Engine::reconnect`: removing it closes this end of the connection,
    /// and the next send connects anew), once per connection, and the read
    /// sends its request again ([`RESENDS`] times at most) once its reply
    /// receive, cancelled here, was given back: the provider may write the
    /// destination until then, and the new receive may name the owner by
    /// another entry number. A request send that failed otherwise on a
    /// connection this engine reset since it was posted is sent again the
    /// same way. Answers whether the read will send again; if not, the
    /// caller fails it.
    fn resend_on_new_connection(&mut self, slot: usize, code: i32, send: SendOp) -> bool {
        if !self.fabric.av_remove_closes || self.closing {
            return false;
        }
        let current = self.av.get(&send.dest).map(|entry| entry.connection);
        let not_connected = code == ERR_NOT_CONNECTED;
        if not_connected && current.is_some() && current == send.connection {
            tracing::debug!(
                fi_addr = send.dest,
                "a read request found its owner's connection closed; resetting it"
            );
            self.reconnect(send.dest);
        }
        let reset_since = matches!(
            (current, send.connection),
            (Some(now), Some(then)) if now > then
        );
        if !not_connected && !reset_since {
            return false;
        }
        let Some(op) = self.ops[slot].as_mut() else {
            return false;
        };
        if op.timed_out || op.failure.is_some() || op.resends_left == 0 {
            return false;
        }
        let Some((read, request_id)) = send.for_read else {
            return false;
        };
        let Some(wire) = send._bytes else {
            return false;
        };
        op.resends_left -= 1;
        op.resend = Some((request_id, wire));
        // No reply comes to a request that was not sent: the cancelled
        // receive gets no discard receive.
        op.request_failed = true;
        self.fabric.cancel(read as *mut c_void);
        true
    }

    /// A reply to `peer` ended (`served`: it carried bytes).
    fn release_reply(&mut self, peer: u64, kind: ReplyKind) {
        let Some(load) = self.reply_loads.get_mut(&peer) else {
            return;
        };
        let count = match kind {
            ReplyKind::Bytes => &mut load.served,
            ReplyKind::Refusal => &mut load.refusals,
            ReplyKind::Gathered => &mut load.gathered,
        };
        *count = count.saturating_sub(1);
        if *load == PeerLoad::default() {
            self.reply_loads.remove(&peer);
        }
    }

    fn release_lease(&mut self, id: u64) {
        let release = self.regions.get_mut(&id).is_some_and(|region| {
            region.in_flight -= 1;
            region.in_flight == 0 && region.unmapping
        });
        if release {
            self.deregister(id);
        }
    }

    /// A request receive completed: take the request, post the receive
    /// again, answer the request.
    fn request_arrived(
        &mut self,
        at: usize,
        result: Result<(usize, Option<Bytes>), (i32, String)>,
    ) {
        let mut source = None;
        let bytes = match (result, self.request_buffers.get_mut(&at)) {
            (Ok((len, from)), Some(buffer)) => {
                buffer.posted = false;
                source = from;
                Some(buffer.data[..len.min(RECEIVE_MAX)].to_vec())
            }
            (Err((_, text)), Some(buffer)) => {
                buffer.posted = false;
                tracing::debug!(error = %text, "a request receive failed");
                None
            }
            (_, None) => None,
        };
        self.repost_request(at);
        if let Some(bytes) = bytes {
            self.serve_request(&bytes, source);
        }
    }

    /// Checks a peer's request against the live registrations, and sends
    /// the bytes under a read lease or a refusal. `source` is the address
    /// of the entry the provider named the request's sender by, as it was
    /// when the request's completion was read (`None`: not named).
    fn serve_request(&mut self, bytes: &[u8], source: Option<Bytes>) {
        if bytes == PROBE {
            tracing::trace!("a liveness probe arrived");
            return;
        }
        if bytes.first() == Some(&LIST_VERSION) {
            self.serve_list(bytes);
            return;
        }
        let Some(request) = ReadRequest::decode(bytes) else {
            tracing::debug!(len = bytes.len(), "a malformed read request was dropped");
            return;
        };
        let Some(dest) = self.served_peer(&request.reply_to) else {
            return;
        };
        if self.fabric.reports_source {
            // Compared by address, not entry number: `served_peer` may have
            // just forgotten the sender's entry and given its number to the
            // reply address.
            let confirmed = source
                .as_ref()
                .is_some_and(|address| self.av.get(&dest).is_some_and(|e| e.address == *address));
            if !confirmed {
                // The sender's entry now, if it is still in the vector.
                let sender = source
                    .and_then(|address| self.by_address.get(&address).copied())
                    .unwrap_or(ADDR_NOTAVAIL);
                self.refuse_unconfirmed(request.request_id, sender, dest);
                return;
            }
        }
        tracing::trace!(
            request = request.request_id,
            len = request.length,
            "serving a read request"
        );
        let load = self.reply_loads.entry(dest).or_default();
        let verdict = match self.regions.get_mut(&request.region_id) {
            None => Err(Refusal::RegionUnknown),
            Some(region) if region.unmapping => Err(Refusal::Deregistering),
            Some(region) if !capability_matches(&region.capability, &request.capability) => {
                Err(Refusal::CapabilityMismatch)
            }
            Some(region) => {
                let start = region.ptr as u64;
                let end = start + region.len as u64;
                match request.address.checked_add(request.length) {
                    Some(last) if request.address >= start && last <= end => {
                        if load.served >= self.reply_bound {
                            Err(Refusal::Busy)
                        } else {
                            load.served += 1;
                            region.in_flight += 1;
                            Ok((request.address as usize, region.mr.desc))
                        }
                    }
                    _ => Err(Refusal::OutOfRange),
                }
            }
        };
        if verdict.is_err() {
            if load.refusals >= self.reply_bound {
                // This consumer does not take its refusals either: answer
                // nothing more until it does.
                tracing::debug!(
                    request = request.request_id,
                    "a consumer holds too many refusals; a read request was dropped"
                );
                if *load == PeerLoad::default() {
                    self.reply_loads.remove(&dest);
                }
                return;
            }
            load.refusals += 1;
        }
        let send = match verdict {
            Ok((ptr, desc)) => SendOp {
                context: Box::new(OpContext {
                    space: [std::ptr::null_mut(); 8],
                }),
                _bytes: None,
                ptr,
                len: request.length as usize,
                desc,
                dest,
                tag: request.request_id,
                lease: Some(request.region_id),
                counted: Some((dest, ReplyKind::Bytes)),
                for_read: None,
                probe: false,
                connection: None,
            },
            Err(refusal) => {
                tracing::debug!(
                    region = request.region_id,
                    ?refusal,
                    "refused a read request"
                );
                SendOp::refusal(dest, refusal_tag(request.request_id, refusal))
            }
        };
        self.queue_send(send);
    }

    /// A request whose sender the provider named as another endpoint than
    /// its reply address (`dest`), or could not name (`source` is
    /// [`ADDR_NOTAVAIL`]): no bytes go out and no lease is taken. A named
    /// sender is refused [`Refusal::NotTheRequester`]; otherwise the reply
    /// address, inserted by now, is answered [`Refusal::Unverified`], and
    /// asks again if it did ask (over `tcp;ofi_rxm` the provider then names
    /// it). Either refusal counts against its receiver's refusal bound.
    fn refuse_unconfirmed(&mut self, request_id: u64, source: u64, dest: u64) {
        self.signals
            .unconfirmed_requests
            .fetch_add(1, Ordering::Relaxed);
        let (to, refusal) = if source == ADDR_NOTAVAIL {
            (dest, Refusal::Unverified)
        } else {
            (source, Refusal::NotTheRequester)
        };
        tracing::debug!(
            request = request_id,
            source,
            dest,
            ?refusal,
            "a read request's sender is not confirmed as its reply address"
        );
        let load = self.reply_loads.entry(to).or_default();
        if load.refusals >= self.reply_bound {
            if *load == PeerLoad::default() {
                self.reply_loads.remove(&to);
            }
            return;
        }
        load.refusals += 1;
        self.queue_send(SendOp::refusal(to, refusal_tag(request_id, refusal)));
    }

    /// Serves a list request: checks each entry as a single read is
    /// checked, copies the bytes of every entry it serves into one reply
    /// (so no lease outlives this call) and sends it; refuses the whole
    /// list as busy past the consumer's bound of gathered replies.
    fn serve_list(&mut self, bytes: &[u8]) {
        let Some(list) = ListRequest::decode(bytes) else {
            tracing::debug!(len = bytes.len(), "a malformed list request was dropped");
            return;
        };
        if self.fabric.needs_local_desc() {
            // A gathered reply would need a registration of its own.
            tracing::debug!("a list request was dropped: this provider needs local descriptors");
            return;
        }
        let Some(dest) = self.served_peer(&list.reply_to) else {
            return;
        };
        let bound = self.reply_bound;
        let held = self.gathered_bytes;
        let load = self.reply_loads.entry(dest).or_default();
        // Past the total, a consumer with no gathered reply unfinished is
        // still served one: the total bounds memory (to it plus one reply
        // per consumer address), and peers that hold replies without
        // taking them cannot starve the consumers that do take theirs.
        if load.gathered >= GATHERED_PER_PEER.min(bound)
            || (load.gathered > 0 && held + list.reply_len() > GATHERED_BYTES_MAX)
        {
            if load.refusals >= bound {
                tracing::debug!(
                    request = list.request_id,
                    "a consumer holds too many refusals; a list request was dropped"
                );
                return;
            }
            load.refusals += 1;
            self.queue_send(SendOp::refusal(
                dest,
                refusal_tag(list.request_id, Refusal::Busy),
            ));
            return;
        }
        load.gathered += 1;
        let mut reply = vec![0u8; list.entries.len()];
        reply.reserve_exact(list.reply_len() - list.entries.len());
        for (index, entry) in list.entries.iter().enumerate() {
            match self.check_entry(entry) {
                Ok(source) => {
                    let start = reply.len();
                    let len = entry.length as usize;
                    reply.resize(start + len, 0);
                    // SAFETY: `source..source + len` lies inside a live
                    // registration that is not being unmapped (checked just
                    // now, and no unmap runs until this call returns), whose
                    // owner keeps it allocated until an unmap of it answers
                    // `Ok`; the destination is the `len` bytes just added to
                    // `reply`. The bytes are copied as the provider copies a
                    // region it sends from: no reference to them is made.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            source as *const u8,
                            reply.as_mut_ptr().add(start),
                            len,
                        );
                    }
                }
                Err(refusal) => reply[index] = refusal.status(),
            }
        }
        // Released by the send's end, by this same length.
        self.gathered_bytes += reply.len();
        tracing::trace!(
            request = list.request_id,
            entries = list.entries.len(),
            len = reply.len(),
            "serving a list request"
        );
        self.queue_send(SendOp {
            context: Box::new(OpContext {
                space: [std::ptr::null_mut(); 8],
            }),
            ptr: reply.as_ptr() as usize,
            len: reply.len(),
            _bytes: Some(reply),
            desc: std::ptr::null_mut(),
            dest,
            tag: list.request_id,
            lease: None,
            counted: Some((dest, ReplyKind::Gathered)),
            for_read: None,
            probe: false,
            connection: None,
        });
    }

    /// Where a list entry's bytes start in this process, or why it is
    /// refused: the checks of a single read.
    fn check_entry(&self, entry: &ListEntry) -> Result<usize, Refusal> {
        let region = self
            .regions
            .get(&entry.region_id)
            .ok_or(Refusal::RegionUnknown)?;
        if region.unmapping {
            return Err(Refusal::Deregistering);
        }
        if !capability_matches(&region.capability, &entry.capability) {
            return Err(Refusal::CapabilityMismatch);
        }
        let start = region.ptr as u64;
        let end = start + region.len as u64;
        match entry.address.checked_add(entry.length) {
            Some(last) if entry.address >= start && last <= end => Ok(entry.address as usize),
            _ => Err(Refusal::OutOfRange),
        }
    }

    /// Inserts a validated address the table does not hold yet into the
    /// address vector and the table.
    fn insert_address(&mut self, address: Bytes, served: bool) -> Result<u64, RdmaError> {
        let fi_addr = self.fabric.insert_peer(&address)?;
        // Inserted again, a connected address's record is renamed: the
        // number it was removed from no longer names it. It stays known as
        // connected, so that forgetting it again is recorded again.
        let connected = self.unmark_stale(&address);
        self.by_address.insert(address.clone(), fi_addr);
        self.av.insert(
            fi_addr,
            AvEntry {
                address,
                peers: 0,
                ops: 0,
                served,
                connected,
                connection: 0,
            },
        );
        Ok(fi_addr)
    }

    /// The address-vector entry to answer a consumer at, inserted on first
    /// use (validated first; bounded by [`MAX_SERVED_PEERS`]).
    fn served_peer(&mut self, claimed: &[u8]) -> Option<u64> {
        if let Err(err) = validate_address(self.fabric.address_format, claimed) {
            tracing::debug!(error = %err, "a read request with a malformed reply address was dropped");
            return None;
        }
        let address = canonical_address(self.fabric.address_format, claimed);
        if let Some(&fi_addr) = self.by_address.get(address.as_slice()) {
            if let Some(entry) = self.av.get_mut(&fi_addr) {
                if !entry.served {
                    entry.served = true;
                    self.served_peers += 1;
                }
            }
            return Some(fi_addr);
        }
        if self.served_peers >= self.served_peers_bound {
            self.forget_idle_consumers();
        }
        if self.served_peers >= self.served_peers_bound {
            tracing::warn!("too many consumer addresses; a read request was dropped");
            return None;
        }
        match self.insert_address(Bytes::from(address), true) {
            Ok(fi_addr) => {
                self.served_peers += 1;
                Some(fi_addr)
            }
            Err(err) => {
                tracing::debug!(error = %err, "could not insert a consumer's address");
                None
            }
        }
    }

    /// Forgets the consumer addresses no reply is unfinished to: their
    /// entries leave the address vector (those also added as peers, or
    /// used by this engine's own reads, stay, no longer counted as served).
    /// Without this, the first [`MAX_SERVED_PEERS`] addresses named in
    /// requests — made up ones included — would lock every later consumer
    /// out for the engine's life. A consumer forgotten is inserted again at
    /// its next request.
    ///
    /// Addresses no send ever completed to are forgotten first, and those
    /// a send did complete to only if the table is still full: over
    /// `tcp;ofi_rxm` forgetting a connected consumer disturbs its next
    /// requests. libfabric 1.17 names a request's sender by the peer record
    /// of the connection it came on; `fi_av_remove` leaves that record with
    /// the removed entry's number (it is rewritten only when the address is
    /// inserted again, `rxm_av_add_peers` in `prov/util/src/rxm_av.c`), so
    /// once another address takes the number the consumer's requests are
    /// named as that address's. Such numbers are kept in `stale_numbers`
    /// and name nobody (see `Engine::rename_stale_senders`). With
    /// `FI_AV_REMOVE_CLEANUP` set the removal closes the connection
    /// instead (`rxm_av_remove_handler`), and a request on its way is lost
    /// with it or, measured, named as a made-up address (the provider finds
    /// a request's connection by an index in its header, `ofi_idm_at` on
    /// `conn_id` in `prov/rxm/src/rxm_cq.c`, and a closed connection's
    /// index is given to later peers): that read answers nothing until its
    /// deadline; the consumer's next request finds its end of the
    /// connection closed (`FI_ENOTCONN`) and is sent again on a new one
    /// (`Engine::resend_on_new_connection`). A made-up address never
    /// completes a send, so a flood of them is forgotten before any
    /// consumer that was served.
    fn forget_idle_consumers(&mut self) {
        self.read_ahead_of_forgetting();
        for connected in [false, true] {
            if self.served_peers < self.served_peers_bound {
                break;
            }
            let forgotten: Vec<u64> = self
                .av
                .iter()
                .filter(|(fi_addr, entry)| {
                    entry.served
                        && entry.connected == connected
                        && !self.reply_loads.contains_key(fi_addr)
                })
                .map(|(&fi_addr, _)| fi_addr)
                .collect();
            tracing::debug!(
                idle = forgotten.len(),
                connected,
                "the consumer address table is full: forgetting idle ones"
            );
            for fi_addr in forgotten {
                self.served_peers -= 1;
                self.release_av(fi_addr, |entry| entry.served = false);
            }
        }
    }

    /// Ends a read the provider let go of (or never saw): releases its
    /// destination and address-vector hold, and answers.
    fn finish(&mut self, slot: usize, result: Result<(), RdmaError>) {
        let Some(op) = self.ops[slot].take() else {
            return;
        };
        self.free_slots.push(slot);
        self.by_context.remove(&((&raw const *op.context) as usize));
        self.active -= 1;
        let release = self.regions.get_mut(&op.region).is_some_and(|region| {
            region.in_flight -= 1;
            region.in_flight == 0 && region.unmapping
        });
        if release {
            self.deregister(op.region);
        }
        self.release_av(op.fi_addr, |entry| entry.ops -= 1);
        if let Some(answer) = op.answer {
            give(answer, result.clone());
        }
        if let Some(list) = op.list {
            for mut item in list.entries {
                let release = self.regions.get_mut(&item.region).is_some_and(|region| {
                    region.in_flight -= 1;
                    region.in_flight == 0 && region.unmapping
                });
                if release {
                    self.deregister(item.region);
                }
                if let Some(answer) = item.answer.take() {
                    give(answer, item.result.take().unwrap_or_else(|| result.clone()));
                }
            }
        }
    }

    /// The owner could not name the sender of this read's request and
    /// refused it as unverified; its receive ended with that refusal. Posts
    /// the receive and sends the request once more (same id), unless it
    /// asked again [`ASKS_AGAIN`] times already or is past its deadline.
    /// Answers whether it will be.
    fn ask_again(&mut self, slot: usize) -> bool {
        let Some(op) = self.ops[slot].as_mut() else {
            return false;
        };
        if op.timed_out || op.failure.is_some() || self.closing || op.asks_left == 0 {
            return false;
        }
        op.asks_left -= 1;
        let request = if op.asks_left == 0 {
            op.ask_again.take()
        } else {
            op.ask_again.clone()
        };
        let Some(request) = request else {
            return false;
        };
        tracing::debug!(
            request = request.0,
            "the owner could not name this engine as the sender; asking again"
        );
        op.request = Some(request);
        op.posted = false;
        self.unposted.push_back(slot);
        true
    }

    /// Marks reads past their deadline; a read never posted ends at once.
    fn expire(&mut self, now: Instant) {
        let mut unposted_expired = Vec::new();
        let mut stalled = Vec::new();
        for slot in 0..self.ops.len() {
            let Some(op) = self.ops[slot].as_mut() else {
                continue;
            };
            if op.timed_out
                && op.posted
                && !op.connection_reset
                && self.fabric.av_remove_closes
                && now >= op.deadline + STALLED_AFTER
                && !stalled.contains(&op.fi_addr)
            {
                stalled.push(op.fi_addr);
            }
            if op.timed_out || op.deadline > now {
                continue;
            }
            op.timed_out = true;
            if op.posted {
                let context = (&raw mut op.context.space).cast::<c_void>();
                self.fabric.cancel(context);
            } else {
                unposted_expired.push(slot);
            }
        }
        for slot in unposted_expired {
            self.unposted.retain(|&s| s != slot);
            self.finish(slot, Err(RdmaError::Timeout));
        }
        for fi_addr in stalled {
            self.reset_connection(fi_addr);
        }
    }

    /// A read from `fi_addr` is still held past its deadline although its
    /// cancellation was asked: the provider had matched its receive (over
    /// `tcp;ofi_rxm`, a rendezvous reply whose sender stopped). libfabric
    /// 1.17 withdraws a matched receive only with the connection it runs
    /// on: `fi_av_remove` closes the peer's connection when the process
    /// runs with `FI_AV_REMOVE_CLEANUP` set (`rxm_av_remove_handler`,
    /// `prov/rxm/src/rxm_conn.c`), which ends every operation in flight on
    /// it with an error completion — measured: the read then answers
    /// `Timeout`. The address is inserted again (the next read connects
    /// anew); the peer's other reads in flight fail, as on the UCX lane's
    /// forced close.
    fn reset_connection(&mut self, fi_addr: u64) {
        for op in self.ops.iter_mut().flatten() {
            if op.fi_addr == fi_addr {
                op.connection_reset = true;
            }
        }
        if self.av.contains_key(&fi_addr) {
            tracing::debug!(
                fi_addr,
                "a read is held past its deadline; resetting its owner's connection"
            );
        }
        self.reconnect(fi_addr);
    }

    /// Removes entry `fi_addr` from the address vector and inserts its
    /// address again: with `FI_AV_REMOVE_CLEANUP` set the removal closes
    /// the peer's connection, ending what ran on it, and the next send to
    /// the address connects anew. Counts the reset in the entry's
    /// `connection`.
    fn reconnect(&mut self, fi_addr: u64) {
        let Some(entry) = self.av.get_mut(&fi_addr) else {
            return;
        };
        entry.connection += 1;
        let address = entry.address.clone();
        self.fabric.remove_peer(fi_addr);
        match self.fabric.insert_peer(&address) {
            Ok(again) if again == fi_addr => {}
            Ok(again) => self.renumber_peer(fi_addr, again),
            Err(err) => {
                // The entry is gone: reads naming it fail from now on (a
                // post to a removed entry is refused), and it is never
                // removed a second time.
                tracing::warn!(error = %err, "could not insert a reset peer's address again");
                if let Some(entry) = self.av.remove(&fi_addr) {
                    self.by_address.remove(&entry.address);
                }
                self.watch.remove(&fi_addr);
            }
        }
    }

    /// Every table that names address-vector entry `from` names `to` now.
    fn renumber_peer(&mut self, from: u64, to: u64) {
        tracing::debug!(from, to, "a reset peer's address got another entry");
        for value in self.peers.values_mut() {
            if *value == from {
                *value = to;
            }
        }
        if let Some(entry) = self.av.remove(&from) {
            self.by_address.insert(entry.address.clone(), to);
            self.av.insert(to, entry);
        }
        if let Some(watch) = self.watch.remove(&from) {
            self.watch.insert(to, watch);
        }
        if let Some(load) = self.reply_loads.remove(&from) {
            self.reply_loads.insert(to, load);
        }
        if let Some(bytes) = self.discard_bytes.remove(&from) {
            self.discard_bytes.insert(to, bytes);
        }
        for owner in self.discard_owners.values_mut() {
            if owner.0 == from {
                owner.0 = to;
            }
        }
        for op in self.ops.iter_mut().flatten() {
            if op.fi_addr == from {
                op.fi_addr = to;
            }
        }
        for send in self.sends.values_mut() {
            if send.dest == from {
                send.dest = to;
            }
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.ops
            .iter()
            .flatten()
            .filter(|op| !op.timed_out)
            .map(|op| op.deadline)
            .min()
    }

    // ---- parking ----

    fn park(&mut self, ring: &Receiver<Command>, control: &Receiver<Command>) {
        let signals = Arc::clone(&self.signals);
        let bell = &signals.doorbell;
        bell.announce_park();
        if !ring.is_empty() || !control.is_empty() || self.turn() || !self.fabric.try_wait() {
            bell.unpark();
            return;
        }
        let mut timeout = if self.active > 0 || !self.sends.is_empty() {
            BUSY_PARK
        } else {
            self.settings.park_timeout
        };
        if let Some(deadline) = self.next_deadline() {
            timeout = timeout.min(deadline.saturating_duration_since(Instant::now()));
        }
        let mut fds = [
            libc::pollfd {
                fd: bell.fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.fabric.wait_fd.unwrap_or(-1),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let count = if self.fabric.wait_fd.is_some() { 2 } else { 1 };
        let spec = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
        };
        // SAFETY: `fds` holds `count` initialised pollfd records and `spec`
        // is a live timespec; no signal mask is passed.
        unsafe { libc::ppoll(fds.as_mut_ptr(), count, &spec, std::ptr::null()) };
        bell.unpark();
        if fds[0].revents != 0 {
            bell.drain();
        }
    }

    // ---- teardown ----

    fn teardown(&mut self, ring: &Receiver<Command>, control: &Receiver<Command>) {
        self.signals.closed.store(true, Ordering::SeqCst);
        self.closing = true;
        while let Ok(command) = control.try_recv() {
            self.dispatch_closing(command);
        }
        while let Ok(command) = ring.try_recv() {
            self.dispatch_closing(command);
        }
        // Reads in flight get the teardown timeout to land.
        let until = Instant::now() + self.settings.teardown_timeout;
        for slot in std::mem::take(&mut self.unposted) {
            self.finish(slot, Err(RdmaError::ShuttingDown));
        }
        // Replies never posted end now (their leases with them); replies
        // being sent get the same time as reads.
        for at in std::mem::take(&mut self.unsent) {
            self.send_done(at, Err((0, "teardown".into())));
        }
        while (self.active > 0 || !self.sends.is_empty()) && Instant::now() < until {
            if !self.turn() {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        if self.fabric.park_at_teardown() {
            self.withdraw_for_parking();
        } else {
            self.close_under_the_rest();
        }
        if self.fabric.close_or_park_endpoint() == EndpointEnd::StillOpen {
            // Request receives may still be written, and replies still being
            // sent still read their sources: a parked endpoint keeps them
            // until it is closed; any other open endpoint, for good. (A
            // reply's region keeps its lease: it stays registered.)
            let receives = PostedReceives {
                buffers: self.request_buffers.drain().map(|(_, b)| b).collect(),
                discards: self.discards.drain().map(|(_, discard)| discard).collect(),
                sends: self.sends.drain().map(|(_, send)| send).collect(),
            };
            if let Err(receives) = self.fabric.keep_while_parked(Box::new(receives)) {
                std::mem::forget(receives);
            }
        }
        let ids: Vec<u64> = self.regions.keys().copied().collect();
        for id in ids {
            if self.regions.get(&id).is_some_and(|r| r.in_flight == 0) {
                self.deregister(id);
            }
        }
        for (fi_addr, _) in std::mem::take(&mut self.av) {
            self.fabric.remove_peer(fi_addr);
        }
        let live = self.signals.live_registrations.load(Ordering::SeqCst);
        if live != 0 {
            tracing::error!(live, "teardown left regions registered");
        }
        let _ = self
            .signals
            .still_registered_after_teardown
            .set(self.regions.keys().copied().collect());
        for reply in self.shutdown_replies.drain(..) {
            let _ = reply.send(());
        }
    }

    /// Teardown of an endpoint that may be closed: closes it under the
    /// reads and sends still in flight, then answers them.
    fn close_under_the_rest(&mut self) {
        if !self.sends.is_empty() {
            if self.fabric.close_endpoint() {
                // The provider reads no source of a send on a closed
                // endpoint: the leases can go.
                let left: Vec<usize> = self.sends.keys().copied().collect();
                for at in left {
                    self.send_done(at, Err((0, "endpoint closed at teardown".into())));
                }
            } else {
                tracing::error!(
                    sends = self.sends.len(),
                    "the endpoint did not close; replies being sent keep their regions registered"
                );
                for (_, send) in self.sends.drain() {
                    std::mem::forget(send);
                }
                for (_, buffer) in self.request_buffers.drain() {
                    std::mem::forget(buffer);
                }
                for (_, context) in self.discards.drain() {
                    std::mem::forget(context);
                }
            }
        }
        if self.active > 0 {
            if self.fabric.close_endpoint() {
                // The provider touches no destination of a read on a closed
                // endpoint: now the rest can be answered.
                for slot in 0..self.ops.len() {
                    let timed_out = match &self.ops[slot] {
                        Some(op) => op.timed_out,
                        None => continue,
                    };
                    let result = if timed_out {
                        RdmaError::Timeout
                    } else {
                        RdmaError::ShuttingDown
                    };
                    self.finish(slot, Err(result));
                }
            } else {
                // The provider may still write these destinations: their
                // answers (and regions) are kept from safe code for good.
                tracing::error!(
                    reads = self.active,
                    "the endpoint did not close; reads in flight stay unanswered and their regions registered"
                );
                for op in self.ops.iter_mut().filter_map(Option::take) {
                    std::mem::forget(op);
                }
                for (_, buffer) in self.request_buffers.drain() {
                    std::mem::forget(buffer);
                }
            }
        }
    }

    /// Teardown of a `shm` endpoint that will be parked, not closed, because
    /// another `shm` engine of the process is open (see `fabric`'s module
    /// docs: closing it would unmap a region that engine still uses).
    ///
    /// Read from libfabric 1.17's `shm` (`prov/shm/src/smr_progress.c`,
    /// `smr_ep.c`): a receive's buffer is written only by its own
    /// endpoint's progress (`smr_ep_progress`, run by reading its completion
    /// queue) — inline and inject messages are copied, larger ones pulled
    /// from the sender with `process_vm_readv`, segmented ones copied out of
    /// the receiver's own region — never by the sender; `fi_cancel` takes a
    /// receive not yet matched off the queue and writes its `FI_ECANCELED`
    /// completion at once; a matched receive ends within the progress call
    /// that matched it, except a segmented one. So each read's receive is
    /// cancelled, and it is answered once its cancellation (or completion)
    /// was read: from then on the provider holds nothing of its destination.
    /// A discard receive is posted for each, so the reply still on its way
    /// lands in scratch memory kept with the parked endpoint: a sender's
    /// message larger than the inject size completes only once the receiver
    /// took it, and the sender's later completions wait behind it. The
    /// other `shm` engines of the process progress parked endpoints
    /// (`Fabric::progress_parked`) so those replies are taken.
    ///
    /// A read whose receive was matched and does not end within the
    /// teardown timeout (a segmented transfer) cannot be answered: its
    /// destination stays registered and the read unanswered. Replies still
    /// being sent are waited for while they keep completing (at least the
    /// teardown timeout or [`SENDS_IDLE_MAX`], and that long past the last
    /// one that did);
    /// those still unfinished then (a receiver that stopped taking them)
    /// keep their leases: their sources stay registered.
    fn withdraw_for_parking(&mut self) {
        if self.active == 0 && self.sends.is_empty() {
            return;
        }
        self.withdrawing = true;
        let mut never_posted = Vec::new();
        for slot in 0..self.ops.len() {
            let Some(op) = self.ops[slot].as_mut() else {
                continue;
            };
            if !op.timed_out && op.failure.is_none() {
                op.failure = Some(RdmaError::ShuttingDown);
            }
            if op.posted {
                let context = (&raw mut op.context.space).cast::<c_void>();
                self.fabric.cancel(context);
            } else {
                never_posted.push((slot, op.timed_out));
            }
        }
        for (slot, timed_out) in never_posted {
            self.unposted.retain(|&s| s != slot);
            let result = if timed_out {
                RdmaError::Timeout
            } else {
                RdmaError::ShuttingDown
            };
            self.finish(slot, Err(result));
        }
        // Replies being sent are waited for too, for as long as they keep
        // completing: each completes once its receiver took it, and the open
        // `shm` engines of the process (this one's loop included) progress
        // receivers that are parked. A reply's completion read after this
        // endpoint is parked is dropped with its lease, and its region stays
        // registered for good.
        let least = if self.sends.is_empty() {
            WITHDRAW_MIN
        } else {
            SENDS_IDLE_MAX
        };
        let mut until = Instant::now() + self.settings.teardown_timeout.max(least);
        let mut sends_left = self.sends.len();
        while (self.active > 0 || !self.sends.is_empty()) && Instant::now() < until {
            if !self.turn() {
                std::thread::sleep(Duration::from_micros(50));
            }
            if self.sends.len() < sends_left {
                until = until.max(Instant::now() + SENDS_IDLE_MAX);
            }
            sends_left = self.sends.len();
        }
        self.withdrawing = false;
        if self.active > 0 {
            tracing::error!(
                reads = self.active,
                "reads whose transfer had begun did not end; they stay unanswered and their \
                 regions registered"
            );
            for op in self.ops.iter_mut().filter_map(Option::take) {
                std::mem::forget(op);
            }
        }
        if !self.sends.is_empty() {
            tracing::warn!(
                sends = self.sends.len(),
                "replies still being sent from a parked endpoint keep their regions registered"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::OfiEngine;
    use crate::key::PackedKey;
    use crate::protocol::BUSY_TEXT;
    use crate::{OfiConfig, Provider};
    use rdmareg_backend::RdmaBackend;

    /// Request ids come from a secret permutation of a counter: distinct,
    /// non-zero, below 2⁴⁸, and not the counter itself (a fresh engine's
    /// first ids are not 1, 2, 3, which any peer could guess).
    #[test]
    fn request_ids_are_distinct_below_2_48_and_not_the_counter() {
        let permutation = RequestIdPermutation::new();
        let ids: Vec<u64> = (1..=100_000u64).map(|n| permutation.permute(n)).collect();
        let distinct: std::collections::HashSet<u64> = ids.iter().copied().collect();
        assert_eq!(distinct.len(), ids.len(), "a permutation repeats no id");
        assert!(ids.iter().all(|&id| id <= REQUEST_ID_MASK));
        let fixed = ids.iter().zip(1u64..).filter(|(id, n)| *id == n).count();
        assert!(fixed < 2, "{fixed} ids equal their counter");
        let other = RequestIdPermutation::new();
        let same = (1..=1000u64)
            .filter(|&n| other.permute(n) == permutation.permute(n))
            .count();
        assert!(same < 2, "two engines share {same} of their first 1000 ids");
    }

    /// A bare endpoint that speaks the protocol by hand: it asks for reads
    /// and never posts a receive for their bytes, only for busy refusals.
    struct RawConsumer {
        fabric: Fabric,
        owner: u64,
        /// Receive and send contexts, kept until the endpoint is closed.
        /// Boxed: the provider holds their addresses, so they must not move
        /// when the vector grows.
        #[allow(clippy::vec_box)]
        contexts: Vec<Box<OpContext>>,
        /// Request bytes, kept until the endpoint is closed.
        wires: Vec<Vec<u8>>,
        /// Busy-refusal receive contexts, by address.
        busy_receives: HashMap<usize, u64>,
        busy: Vec<u64>,
    }

    impl RawConsumer {
        fn new(config: &OfiConfig, owner: &[u8]) -> RawConsumer {
            let mut fabric = Fabric::open(config).expect("raw endpoint");
            let owner = fabric.insert_peer(owner).expect("owner address");
            RawConsumer {
                fabric,
                owner,
                contexts: Vec::new(),
                wires: Vec::new(),
                busy_receives: HashMap::new(),
                busy: Vec::new(),
            }
        }

        fn context(&mut self) -> *mut c_void {
            let mut context = Box::new(OpContext {
                space: [std::ptr::null_mut(); 8],
            });
            let at = (&raw mut context.space).cast::<c_void>();
            self.contexts.push(context);
            at
        }

        /// Asks for `length` bytes at `address` as read `id`, listening only
        /// for a busy refusal of it.
        /// Asks the owner once for a region that does not exist and waits
        /// for the answer, as an engine's first read does: over tcp the
        /// owner's provider cannot name a sender before the owner inserted
        /// its address, so the first request is answered "ask again"
        /// (`Refusal::Unverified`); later ones are checked and served.
        fn introduce(&mut self, id: u64) {
            let receive = self.context();
            // SAFETY: a zero-length receive; its context lives in
            // `contexts` until the fabric (and its endpoint) is dropped.
            let posted = unsafe {
                self.fabric.trecv(
                    0,
                    0,
                    std::ptr::null_mut(),
                    self.owner,
                    id,
                    REPLY_IGNORE,
                    receive,
                )
            };
            assert_eq!(posted.ok(), Some(true), "introduction receive posted");
            let wire = ReadRequest {
                request_id: id,
                region_id: u64::MAX,
                capability: [0; CAPABILITY_LEN],
                address: 0x1000,
                length: 8,
                reply_to: self.fabric.address.to_vec(),
            }
            .encode();
            self.send_request(id, wire);
            let until = Instant::now() + Duration::from_secs(5);
            let mut out = Vec::new();
            while Instant::now() < until {
                self.fabric.poll_completions(&mut out, 64);
                if out
                    .drain(..)
                    .any(|c| matches!(c, Completion::Done(at, ..) if at == receive))
                {
                    return;
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            panic!("the owner never answered the introduction");
        }

        fn ask(&mut self, key: &PackedKey, address: u64, length: u64, id: u64) {
            let wire = ReadRequest {
                request_id: id,
                region_id: key.region_id,
                capability: key.capability,
                address,
                length,
                reply_to: self.fabric.address.to_vec(),
            }
            .encode();
            self.send_request(id, wire);
        }

        /// Asks for `count` entries of `length` bytes from `address` on as
        /// list `id`, listening only for a busy refusal of it.
        fn ask_list(&mut self, key: &PackedKey, address: u64, length: u64, count: u64, id: u64) {
            let wire = ListRequest {
                request_id: id,
                entries: (0..count)
                    .map(|i| ListEntry {
                        region_id: key.region_id,
                        capability: key.capability,
                        address: address + i * length,
                        length,
                    })
                    .collect(),
                reply_to: self.fabric.address.to_vec(),
            }
            .encode();
            self.send_request(id, wire);
        }

        /// Sends request bytes of request `id`, listening only for a busy
        /// refusal of it.
        fn send_request(&mut self, id: u64, wire: Vec<u8>) {
            let receive = self.context();
            // SAFETY: a zero-length receive; its context lives in
            // `contexts` until the fabric (and its endpoint) is dropped.
            let posted = unsafe {
                self.fabric.trecv(
                    0,
                    0,
                    std::ptr::null_mut(),
                    self.owner,
                    refusal_tag(id, Refusal::Busy),
                    0,
                    receive,
                )
            };
            assert_eq!(posted.ok(), Some(true), "busy receive posted");
            self.busy_receives.insert(receive as usize, id);
            let send = self.context();
            let until = Instant::now() + Duration::from_secs(5);
            loop {
                // SAFETY: the request's bytes and the context live in
                // `wires` and `contexts` until the fabric is dropped.
                let sent = unsafe {
                    self.fabric.tsend(
                        wire.as_ptr() as usize,
                        wire.len(),
                        std::ptr::null_mut(),
                        self.owner,
                        REQUEST_TAG,
                        send,
                    )
                };
                match sent {
                    Ok(true) => break,
                    // The provider asks to wait (connecting): progress.
                    Ok(false) if Instant::now() < until => {
                        self.progress_for(Duration::from_millis(1))
                    }
                    other => panic!("request not sent: {other:?}"),
                }
            }
            self.wires.push(wire);
        }

        /// Progresses for `span`, recording busy refusals.
        fn progress_for(&mut self, span: Duration) {
            let until = Instant::now() + span;
            let mut out = Vec::new();
            while Instant::now() < until {
                self.fabric.poll_completions(&mut out, 64);
                for completion in out.drain(..) {
                    if let Completion::Done(context, _, tag, _) = completion {
                        if self.busy_receives.contains_key(&(context as usize)) {
                            assert_eq!(
                                reply_outcome(tag),
                                Err(RdmaError::Backend(BUSY_TEXT.into()))
                            );
                            self.busy.push(tag & REQUEST_ID_MASK);
                        }
                    }
                }
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }

    impl Drop for RawConsumer {
        fn drop(&mut self) {
            // The endpoint first: then nothing the provider holds points
            // into the contexts or the request bytes.
            self.fabric.close_endpoint();
        }
    }

    /// A consumer that sends an owner (reply bound 4) eight lists whose
    /// 32 KiB gathered replies it never receives gets four of them held and
    /// the other four refused as busy: gathered replies are bounded per
    /// consumer as single replies are, and hold no lease (the source's
    /// unmap answers while they are held).
    #[test]
    fn gathered_replies_a_consumer_never_receives_are_bounded_and_hold_no_lease() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let config = OfiConfig::new(Provider::Tcp)
            .with_domain("lo")
            .with_teardown_timeout(Duration::from_secs(2))
            .with_max_served_replies_per_peer(4);
        let owner = OfiEngine::start(config.clone()).expect("owner starts");
        let backend = owner.backend();
        let len = 1usize << 20;
        // Reached only through its raw pointer while registered, and
        // dropped after its unmap answered.
        let source = Box::into_raw(vec![7u8; len].into_boxed_slice());
        let source_addr = source as *mut u8 as usize;
        // SAFETY: the range is this test's own allocation, no reference
        // aliases it while it is registered, and it is freed only after
        // the unmap answered `Ok`.
        let region = rt
            .block_on(unsafe { backend.map(source_addr, len) })
            .expect("maps");
        let key = PackedKey::decode(&region.packed_key).expect("its own key");
        let mut raw = RawConsumer::new(&config, &owner.fabric_address());
        for id in 1..=8 {
            raw.ask_list(&key, source_addr as u64, 16 << 10, 2, id);
        }
        raw.progress_for(Duration::from_secs(2));
        let busy = raw.busy.len();
        let unmapped = rt.block_on(async {
            tokio::time::timeout(
                Duration::from_secs(5),
                backend.unmap(region.backend_region_id),
            )
            .await
        });
        if matches!(unmapped, Ok(Ok(()))) {
            // SAFETY: made by Box::into_raw above; its registration is gone.
            drop(unsafe { Box::from_raw(source) });
        }
        drop(raw);
        owner.shutdown_blocking();
        assert_eq!(busy, 4, "busy refusals of the eight lists");
        assert!(
            matches!(unmapped, Ok(Ok(()))),
            "the unmap answered while gathered replies were held: {unmapped:?}"
        );
        assert_eq!(owner.live_registrations(), 0);
    }

    /// A bare endpoint posing as an owner: it takes one request and
    /// answers it with bytes of its choosing.
    struct RawOwner {
        fabric: Fabric,
        request: Box<[u8; RECEIVE_MAX]>,
        /// Receive and send contexts, kept until the endpoint is closed.
        #[allow(clippy::vec_box)]
        contexts: Vec<Box<OpContext>>,
        /// Reply bytes, kept until the endpoint is closed.
        replies: Vec<Vec<u8>>,
    }

    impl RawOwner {
        fn new(config: &OfiConfig) -> RawOwner {
            let mut owner = RawOwner {
                fabric: Fabric::open(config).expect("raw endpoint"),
                request: Box::new([0u8; RECEIVE_MAX]),
                contexts: Vec::new(),
                replies: Vec::new(),
            };
            let context = owner.context();
            let data = owner.request.as_mut_ptr() as usize;
            // SAFETY: the buffer and the context live in `self` until the
            // fabric (and its endpoint) is closed in `drop`.
            let posted = unsafe {
                owner.fabric.trecv(
                    data,
                    RECEIVE_MAX,
                    std::ptr::null_mut(),
                    ADDR_UNSPEC,
                    REQUEST_TAG,
                    0,
                    context,
                )
            };
            assert_eq!(posted.ok(), Some(true), "request receive posted");
            owner
        }

        fn context(&mut self) -> *mut c_void {
            let mut context = Box::new(OpContext {
                space: [std::ptr::null_mut(); 8],
            });
            let at = (&raw mut context.space).cast::<c_void>();
            self.contexts.push(context);
            at
        }

        /// Waits up to five seconds for a list request.
        fn take_list(&mut self) -> ListRequest {
            let until = Instant::now() + Duration::from_secs(5);
            let mut out = Vec::new();
            while Instant::now() < until {
                self.fabric.poll_completions(&mut out, 16);
                for completion in out.drain(..) {
                    if let Completion::Done(_, len, REQUEST_TAG, _) = completion {
                        return ListRequest::decode(&self.request[..len]).expect("a list request");
                    }
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            panic!("no list request arrived");
        }

        /// Sends `reply` with tag `tag` to `to` and progresses a while.
        fn answer(&mut self, to: u64, tag: u64, reply: Vec<u8>) {
            let context = self.context();
            let until = Instant::now() + Duration::from_secs(5);
            loop {
                // SAFETY: the bytes and the context live in `self` until
                // the fabric is closed.
                let sent = unsafe {
                    self.fabric.tsend(
                        reply.as_ptr() as usize,
                        reply.len(),
                        std::ptr::null_mut(),
                        to,
                        tag,
                        context,
                    )
                };
                match sent {
                    Ok(true) => break,
                    Ok(false) if Instant::now() < until => {
                        let mut out = Vec::new();
                        self.fabric.poll_completions(&mut out, 16);
                    }
                    other => panic!("reply not sent: {other:?}"),
                }
            }
            self.replies.push(reply);
            let mut out = Vec::new();
            let until = Instant::now() + Duration::from_millis(300);
            while Instant::now() < until {
                self.fabric.poll_completions(&mut out, 16);
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }

    impl Drop for RawOwner {
        fn drop(&mut self) {
            self.fabric.close_endpoint();
        }
    }

    /// A hostile owner answers a gathered list with a reply whose length
    /// fits the consumer's receive but not what its statuses and the asked
    /// lengths add up to (it says entry 1 is refused, yet sends its bytes):
    /// every entry answers a typed error and no byte lands.
    #[test]
    fn a_gathered_reply_whose_lengths_do_not_add_up_lands_nothing() {
        for provider in [Provider::Tcp, Provider::Shm] {
            // A worker thread runs the batch while this thread plays the owner.
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            let mut config = OfiConfig::new(provider.clone());
            if provider == Provider::Tcp {
                config = config.with_domain("lo");
            }
            let mut raw = RawOwner::new(&config);
            let consumer = OfiEngine::start(config).expect("consumer starts");
            consumer
                .add_peer(PeerId(1), raw.fabric.address.clone())
                .expect("the raw owner's address");
            let key = crate::adversarial_peers::raw_owner_key(raw.fabric.address.clone(), 4096);
            let backend = consumer.backend();
            let mut dst = vec![0u8; 3 * 64];
            // SAFETY: `dst` outlives its registration (unmapped below, or
            // the engine shut down) and is read only after the batch
            // answered.
            let region = rt
                .block_on(unsafe { backend.map(dst.as_mut_ptr() as usize, dst.len()) })
                .expect("maps");
            let requests: Vec<BackendGet> = (0..3u64)
                .map(|i| BackendGet {
                    peer: PeerId(1),
                    remote_addr: 0x10_0000 + 64 * i,
                    packed_key: key.clone(),
                    local_region_id: region.backend_region_id,
                    local_offset: 64 * i,
                    len: 64,
                    deadline: Some(Duration::from_secs(10)),
                })
                .collect();
            let batch = rt.spawn({
                let backend = backend.clone();
                // SAFETY: as above: nothing touches `dst` until the batch
                // answered.
                async move { unsafe { backend.get_batch(requests) }.await }
            });
            let list = raw.take_list();
            assert_eq!(list.entries.len(), 3, "{provider:?}: one list of three");
            let to = raw
                .fabric
                .insert_peer(&list.reply_to)
                .expect("the consumer's address");
            let mut reply = vec![0, Refusal::OutOfRange.status(), 0];
            reply.extend(std::iter::repeat_n(0xEE, 3 * 64));
            raw.answer(to, list.request_id, reply);
            let answers = rt.block_on(batch).expect("the batch task");
            rt.block_on(backend.unmap(region.backend_region_id))
                .expect("unmaps");
            consumer.shutdown_blocking();
            drop(raw);
            assert_eq!(answers.len(), 3);
            for answer in &answers {
                assert!(
                    matches!(answer, Err(RdmaError::Backend(text)) if text.contains("does not add up")),
                    "{provider:?}: answered {answer:?}"
                );
            }
            assert!(dst.iter().all(|&b| b == 0), "{provider:?}: bytes landed");
            assert_eq!(consumer.live_registrations(), 0);
        }
    }

    /// A consumer that asks an owner (bound 4) for eight large reads and
    /// never receives their bytes holds four replies open and gets the
    /// other four refused as busy. The held replies keep the region's
    /// leases, so its unmap waits — on `tcp;ofi_rxm` even after the
    /// consumer's endpoint is gone (the provider does not fail those sends)
    /// — and answers `Ok` once the owner's teardown ended them.
    #[test]
    fn a_consumer_that_never_receives_holds_at_most_the_bound_and_is_refused_busy_past_it() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let config = OfiConfig::new(Provider::Tcp)
            .with_domain("lo")
            .with_teardown_timeout(Duration::from_secs(2))
            .with_max_served_replies_per_peer(4);
        let owner = OfiEngine::start(config.clone()).expect("owner starts");
        let backend = owner.backend();
        let len = 1usize << 20;
        // Reached only through its raw pointer from here on, and dropped
        // after the owner's teardown ended its registration.
        let source = Box::into_raw(vec![7u8; len].into_boxed_slice());
        let source_addr = source as *mut u8 as usize;
        // SAFETY: the range is this test's own allocation, no reference
        // aliases it while it is registered (only `source_addr` names it),
        // and it is freed below only after the unmap answered `Ok` and the
        // owner's teardown ended.
        let region = rt
            .block_on(unsafe { backend.map(source_addr, len) })
            .expect("maps");
        let key = PackedKey::decode(&region.packed_key).expect("its own key");
        let mut raw = RawConsumer::new(&config, &owner.fabric_address());
        raw.introduce(100);
        for id in 1..=8 {
            raw.ask(&key, source_addr as u64, len as u64, id);
        }
        raw.progress_for(Duration::from_secs(2));
        let mut busy = raw.busy.clone();
        busy.sort_unstable();
        // The unmap waits for the four leases while the consumer lives.
        let unmap = {
            let backend = backend.clone();
            let id = region.backend_region_id;
            rt.spawn(async move { backend.unmap(id).await })
        };
        raw.progress_for(Duration::from_millis(300));
        let answered_while_held = unmap.is_finished();
        drop(raw);
        std::thread::sleep(Duration::from_secs(2));
        let answered_after_consumer_left = unmap.is_finished();
        owner.shutdown_blocking();
        let unmapped =
            rt.block_on(async { tokio::time::timeout(Duration::from_secs(10), unmap).await });
        let live = owner.live_registrations();
        if matches!(unmapped, Ok(Ok(Ok(())))) && live == 0 {
            // SAFETY: made by Box::into_raw above; its registration is gone.
            drop(unsafe { Box::from_raw(source) });
        }
        eprintln!(
            "busy {busy:?}; unmap answered while held: {answered_while_held}, \
             2 s after the consumer left: {answered_after_consumer_left}; after teardown: {unmapped:?}"
        );
        assert_eq!(busy.len(), 4, "busy refusals: {busy:?}");
        assert!(
            !answered_while_held,
            "the unmap answered while replies were held"
        );
        assert!(
            matches!(unmapped, Ok(Ok(Ok(())))),
            "the leases ended at teardown: {unmapped:?}"
        );
        assert_eq!(live, 0);
    }
}
