//! The progress thread: the one thread that owns every libfabric object.
//!
//! It opens the fabric, domain, completion queue, address vector and
//! endpoint (`fabric`), holds every memory region, peer entry and posted
//! read, and runs commands from the ring and the control lane. Both tested
//! providers progress only when called (`FI_PROGRESS_MANUAL`), so this loop
//! is also what serves peers' reads of this engine's regions.
//!
//! # The loop
//!
//! The kit's [`progress_loop`] runs it. A turn reposts request receives,
//! retries sends and reads the provider asked to retry (`-FI_EAGAIN`),
//! handles completions, and cancels the receives of reads past their
//! deadline. Parking asks `fi_trywait` and `poll`s the doorbell and the
//! completion queue's wait descriptor, for at most the park timeout, or
//! [`BUSY_PARK`] while reads of this engine are in flight or, without a
//! wait descriptor, for [`RECENT_WORK`] after a turn did work.
//!
//! # Serving reads
//!
//! Requests go to the engine kit's owner machine
//! (`rdmareg_engine::served::Owner`), which checks each against the live
//! registrations and asks for a tagged send under a read lease or a
//! refusal (`docs/ofi.md`, "Owner-served reads"). Its bounds are per
//! consumer address, so addresses are reduced to one spelling first, list
//! replies are also bounded in total ([`GATHERED_BYTES_MAX`]), and a full
//! table of consumer addresses forgets idle ones, made-up ones first. Over
//! `tcp;ofi_rxm` a single read is served only to its named sender
//! (`FI_SOURCE`); an unnamed sender gets "ask again" (`Engine::ask_again`),
//! and a closed connection is resent on a new one
//! (`Engine::resend_on_new_connection`); see "Hostile peers" there.
//!
//! Reads under a descriptor lease are such requests on either read path,
//! judged by the same owner machine at the time they are served
//! (`leases`); releases arrive as notice messages (`notices`).
//!
//! # Dead peers
//!
//! Over `tcp;ofi_rxm` a dead peer shows only as sends that never post, so a
//! peer waited on gets a probe every [`PROBE_INTERVAL`], and one no send
//! could be posted to for `OfiConfig::unreachable_after`, with nothing
//! completing, is declared unreachable: its sends end and its reads fail
//! (`docs/ofi.md`, "The engine", "A dead owner").
//!
//! # Results only after the provider let go
//!
//! Each read (single, list, or one-sided `fi_read`) is a read of the kit's
//! consumer machine (`rdmareg_engine::served::consumer`), which keeps its
//! deadline and completes it only once the loop reports the provider let
//! go of the destination (`Engine::provider_released`): its completion was
//! read, its cancellation was reported, or teardown closed the endpoint.
//! Past its deadline the receive is cancelled and the read fails with
//! `Timeout` when the provider ends it (`Ok` if its bytes arrived first). A
//! read the provider never ends waits for teardown, except over
//! `tcp;ofi_rxm` with `FI_AV_REMOVE_CLEANUP`, where [`STALLED_AFTER`] past
//! its deadline its owner's connection is reset (`Engine::reset_connection`).

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use crossbeam_channel::Receiver;
use futures::channel::oneshot;
use rdmareg_core::{BackendGet, PeerId, RdmaError};
use rdmareg_engine::command::{BatchReply, Handler, Registrations};
use rdmareg_engine::lanes::Receivers;
use rdmareg_engine::progress_loop::{self, Progress, Timings, Turn};
use rdmareg_engine::results::BatchResults;
use rdmareg_engine::served::consumer::{Consumer, ReadId};
use rdmareg_engine::served::{Owner, OwnerConfig, SendId, WriteId, Writer};
use rdmareg_engine::thread::Ready;

use crate::config::{OfiConfig, Provider, ReadPath};
use crate::engine::{Command, PeerChange, Reply, Signals, StartInfo};
use crate::fabric::{Completion, Fabric, MemoryRegion, ProviderContext};
use crate::key::CAPABILITY_LEN;
use crate::protocol::{GATHER_TOTAL_MAX, MAX_LIST_ENTRIES};

mod completions;
mod leases;
mod notices;
mod peers;
mod reads;
mod regions;
mod sends;
mod serve;
mod serve_writes;
mod teardown;
mod write_lists;
mod writes;

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
/// How long after its last work a loop with no wait descriptor (`shm`)
/// still parks for only [`BUSY_PARK`]: nothing wakes it when a peer's
/// message arrives, so a park of the full timeout would hold a peer's
/// next request, typically a moment after the last reply, that long.
const RECENT_WORK: Duration = Duration::from_millis(2);
/// How many times a read asks its owner again when the owner could not
/// name its sender (`Refusal::Unverified`). One is enough for a new
/// consumer; an owner that forgot a connected consumer may refuse the
/// first ask again the same way (`Engine::rename_stale_senders`).
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
/// vector to reply to; requests from further addresses are dropped.
pub(crate) const MAX_SERVED_PEERS: usize = 4096;
/// The most list replies an owner keeps unfinished for one consumer
/// address: each holds a copy of up to `GATHER_TOTAL_MAX` bytes, so this
/// bounds that memory (16 MiB per address) apart from the reply bound.
const GATHERED_PER_PEER: u32 = 64;
/// The most bytes of list replies an owner keeps unfinished for all
/// consumers together, since a peer names any reply address it likes. Past
/// it lists are refused as busy, except an address's first unfinished one
/// (so the most held is this plus one reply per address of
/// [`MAX_SERVED_PEERS`]).
pub(crate) const GATHERED_BYTES_MAX: usize = 64 << 20;
/// The most scratch memory a consumer keeps posted for the late replies of
/// one owner's cancelled reads, beyond one such receive (always allowed,
/// whatever its length), so an owner that never replies cannot make its
/// consumer hoard them. Past it the owner's late reply finds no receive,
/// and the owner keeps that reply's lease until the connection ends.
pub(crate) const DISCARD_BYTES_PER_PEER: usize = 64 << 20;
/// The longest list reply a consumer on `shm` asks for: the provider's
/// inject size (`SMR_INJECT_SIZE` in libfabric 1.17). Longer messages take
/// `shm`'s slower copy protocols, which need both sides' progress.
const SHM_LIST_REPLY_MAX: usize = 4096;

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
    lanes: Receivers<PeerChange>,
    ready: Ready<StartInfo>,
) {
    let fabric = match Fabric::open(&config) {
        Ok(fabric) => fabric,
        Err(err) => {
            signals.lifecycle.close();
            ready.failed(err);
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
    engine.post_notice_receives();
    ready.started(info);
    let spin_window = engine.settings.spin_window;
    progress_loop::run(&mut engine, &lanes, spin_window);
    engine.teardown(&lanes.ring, &lanes.control);
    // The lanes close before the fabric does, so a shutdown sent from now
    // on is refused at once instead of waiting for a reply nobody sends.
    drop(lanes);
    drop(engine);
}

/// One registered region. Its capability, and the read leases of replies
/// sent from it, are the owner machine's (`Engine::owner`).
#[derive(Debug)]
struct Region {
    ptr: usize,
    len: usize,
    mr: MemoryRegion,
    /// This engine's reads in flight into it.
    in_flight: usize,
    /// The owner machine still holds it: an unmap waits for its leases.
    served: bool,
    /// An unmap was submitted: new reads into it are refused, and the
    /// deregistration waits for the reads in flight and the leases.
    unmapping: bool,
    waiters: Vec<Reply<()>>,
}

/// An address-vector entry and who uses it.
#[derive(Debug)]
struct AvEntry {
    address: Bytes,
    peers: usize,
    ops: usize,
    /// Inserted to reply to a consumer's requests: kept while replies to it
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
    /// Names the entry in the consumer machine (`Engine::consumer`); kept
    /// when the entry is renumbered.
    endpoint: u64,
}

/// Who waits for a read's result: the caller of one GET, or entry `.1` of
/// a batch. [`complete`] consumes it.
#[derive(Debug)]
enum Waiter {
    Single(Reply<()>),
    Batch(Rc<BatchResults>, usize),
}

fn complete(waiter: Waiter, result: Result<(), RdmaError>) {
    match waiter {
        Waiter::Single(reply) => {
            let _ = reply.send(result);
        }
        Waiter::Batch(batch, index) => {
            batch.record(index, result);
        }
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
    /// Who waits for the result (`None` for a list: each entry has its own).
    waiter: Option<Waiter>,
    /// A list: the entries, and the scratch memory the reply is
    /// received into (`buf`/`len` point at it).
    list: Option<Box<ListPart>>,
    /// Its id in the consumer machine (`Engine::consumer`).
    read: ReadId,
    /// When the machine found it past its deadline.
    expired_at: Option<Instant>,
    posted: bool,
    buf: usize,
    len: usize,
    desc: *mut c_void,
    remote: u64,
    key: u64,
    /// Owner-served: the request to send once the receive is posted, and
    /// its id (the reply's tag).
    request: Option<(u64, Vec<u8>)>,
    /// Owner-served: the request id (0 for a one-sided `fi_read`).
    request_id: u64,
    /// Why the read failed when its owner was declared unreachable (its
    /// receive was then cancelled).
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

impl Op {
    /// A read of `len` bytes into `buf` from the owner at `fi_addr`, with
    /// nothing else set yet: no destination region, waiter, request or list.
    fn new(fi_addr: u64, buf: usize, len: usize, desc: *mut c_void) -> Op {
        Op {
            context: Box::new(OpContext {
                space: [std::ptr::null_mut(); 8],
            }),
            region: 0,
            fi_addr,
            waiter: None,
            list: None,
            read: ReadId(0),
            expired_at: None,
            posted: false,
            buf,
            len,
            desc,
            remote: 0,
            key: 0,
            request: None,
            request_id: 0,
            failure: None,
            unreachable: false,
            request_failed: false,
            connection_reset: false,
            ask_again: None,
            asks_left: 0,
            resend: None,
            resends_left: RESENDS,
        }
    }
}

/// A list's own part of its [`Op`].
struct ListPart {
    entries: Vec<ListItem>,
    /// The reply is written here; served entries are copied out of it.
    scratch: Vec<u8>,
}

/// One entry of a list.
struct ListItem {
    waiter: Option<Waiter>,
    /// Its destination region, whose `in_flight` counts it.
    region: u64,
    buf: usize,
    len: usize,
    /// Set from the reply; entries without one take the list's outcome.
    result: Option<Result<(), RdmaError>>,
}

/// A batch entry checked and waiting to go into a list.
struct ListCandidate {
    request: BackendGet,
    waiter: Waiter,
    buf: usize,
    region_id: u64,
    capability: [u8; CAPABILITY_LEN],
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
    /// A reply or refusal the owner machine asked for: its end releases
    /// the reply's lease and its place under the consumer's bound.
    owner_send: Option<SendId>,
    /// A list reply (a copy), counted in `Engine::gathered`.
    gathered: bool,
    /// The context and request id of the read this request belongs to
    /// (the id tells a later read at a reused context address apart).
    for_read: Option<(usize, u64)>,
    /// A liveness probe ([`PROBE`](crate::protocol::PROBE)).
    probe: bool,
    /// A notice's caller, told when the send ends (`notices`).
    notice_reply: Option<Reply<()>>,
    /// A write message of this engine's (`writes`), a chunk or a write
    /// list: its end is told to the writer machine for each write in it.
    for_writes: Vec<WriteId>,
    /// The destination entry's `AvEntry::connection` when the send was
    /// posted (`None`: not posted).
    connection: Option<u64>,
}

impl SendOp {
    /// A send of `len` bytes at `ptr` (registered under `desc`) to `dest`
    /// with `tag`, nothing attached.
    fn new(dest: u64, tag: u64, ptr: usize, len: usize, desc: *mut c_void) -> SendOp {
        SendOp {
            context: Box::new(OpContext {
                space: [std::ptr::null_mut(); 8],
            }),
            _bytes: None,
            ptr,
            len,
            desc,
            dest,
            tag,
            owner_send: None,
            gathered: false,
            for_read: None,
            probe: false,
            notice_reply: None,
            for_writes: Vec::new(),
            connection: None,
        }
    }

    /// A send of `bytes`, kept until it completes.
    fn owning(dest: u64, tag: u64, bytes: Vec<u8>) -> SendOp {
        let (ptr, len) = (bytes.as_ptr() as usize, bytes.len());
        SendOp {
            _bytes: Some(bytes),
            ..SendOp::new(dest, tag, ptr, len, std::ptr::null_mut())
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
    /// [`RECEIVE_MAX`](crate::protocol::RECEIVE_MAX) bytes for a request,
    /// [`NOTICE_RECEIVE_MAX`](notices::NOTICE_RECEIVE_MAX)
    /// for a notice.
    data: Box<[u8]>,
    /// [`REQUEST_TAG`](crate::protocol::REQUEST_TAG) or
    /// [`NOTICE_TAG`](crate::protocol::NOTICE_TAG): what the receive takes.
    tag: u64,
    posted: bool,
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
    /// This engine's reads, by op slot, until they complete: the engine
    /// kit's consumer machine keeps their deadlines and decides each result,
    /// given only once the provider let go of the destination. Endpoints
    /// are `AvEntry::endpoint` serials, which stay with an entry when it is
    /// renumbered.
    consumer: Consumer<u64, usize>,
    next_endpoint: u64,
    unposted: VecDeque<usize>,
    completions: Vec<Completion>,
    /// Completions read out of the queue ahead of forgetting consumer
    /// addresses (`Engine::forget_idle_consumers`), each with its request's
    /// sender already resolved: handled first by the next `reap`.
    read_ahead: Vec<(Completion, Option<Bytes>)>,
    settings: Timings,
    signals: Arc<Signals>,
    page_size: u64,
    shutdown_replies: Vec<oneshot::Sender<()>>,
    /// Sends in flight, by context address.
    sends: HashMap<usize, SendOp>,
    /// Sends the provider asked to retry, by context address, in order.
    unsent: VecDeque<usize>,
    /// Request receives (owner-served path, or once a one-sided engine
    /// made a lease) and notice receives, by context address.
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
    /// The owner side of served reads: the engine kit's state machine
    /// (admission, capabilities, read leases, the bounds of unfinished
    /// replies and refusals per consumer, unmaps that wait for leases).
    /// Consumers are named by `AvEntry::endpoint` serials, as in
    /// `consumer`.
    owner: Owner<u64>,
    /// List replies unfinished per consumer address (each a copy, no
    /// lease), and the reply bound (which also bounds them).
    gathered: HashMap<u64, u32>,
    reply_bound: u32,
    /// Bytes of list replies not yet completed, all consumers together
    /// (bounded by [`GATHERED_BYTES_MAX`]).
    gathered_bytes: usize,
    /// Reachability of the peers sends go to, by address-vector entry.
    watch: HashMap<u64, PeerWatch>,
    unreachable_after: Duration,
    /// When the watch is next looked at.
    next_watch: Instant,
    /// When a turn last did work (see [`RECENT_WORK`]).
    last_worked: Instant,
    /// The longest list reply this engine asks for (bytes).
    list_reply_max: usize,
    next_request_id: u64,
    /// Makes request ids unguessable (see `mint_request_id`).
    request_ids: RequestIdPermutation,
    closing: bool,
    /// The number of the last notice this engine sent (`notices`).
    notices_sent: u64,
    /// The writer side of served writes: the engine kit's machine, each
    /// write (one chunk of a put) named by its reply receive's context
    /// address in `write_ops`. Endpoints are `AvEntry::endpoint` serials.
    writer: Writer<u64, usize>,
    /// Chunks of puts in flight, by their reply receive's context address.
    write_ops: HashMap<usize, writes::WriteOp>,
    /// Chunks whose reply receive the provider asked to post later.
    unposted_writes: VecDeque<usize>,
    /// Puts in flight, by this engine's own serial.
    puts: HashMap<u64, writes::Put>,
    next_put: u64,
    /// `complete_writes` is running (a send it starts may end at once).
    completing_writes: bool,
    /// The write message or write list being judged, while its payload
    /// is at hand (`serve_writes`).
    serving_write: Option<serve_writes::ServingWrite>,
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
            consumer: Consumer::new(),
            next_endpoint: 1,
            unposted: VecDeque::new(),
            completions: Vec::with_capacity(COMPLETION_BATCH),
            read_ahead: Vec::new(),
            settings: Timings {
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
            owner: Owner::new(OwnerConfig {
                max_replies_per_endpoint: config.max_served_replies_per_peer,
                ..OwnerConfig::default()
            }),
            gathered: HashMap::new(),
            reply_bound: config.max_served_replies_per_peer,
            gathered_bytes: 0,
            watch: HashMap::new(),
            unreachable_after: config.unreachable_after,
            next_watch: Instant::now(),
            last_worked: Instant::now(),
            list_reply_max: if config.provider == Provider::Shm {
                SHM_LIST_REPLY_MAX
            } else {
                MAX_LIST_ENTRIES + GATHER_TOTAL_MAX as usize
            },
            next_request_id: 1,
            request_ids: RequestIdPermutation::new(),
            closing: false,
            notices_sent: 0,
            writer: Writer::new(),
            write_ops: HashMap::new(),
            unposted_writes: VecDeque::new(),
            puts: HashMap::new(),
            next_put: 1,
            completing_writes: false,
            serving_write: None,
            withdrawing: false,
            fabric,
        }
    }

    fn owner_served(&self) -> bool {
        self.fabric.read_path == ReadPath::OwnerServed
    }

    /// Retries, completions, deadlines; returns whether anything happened.
    fn turn(&mut self) -> bool {
        self.retry_request_receives();
        let mut worked = self.retry_unsent();
        worked |= self.retry_unposted();
        worked |= self.retry_unposted_writes();
        worked |= self.reap();
        if self.fabric.is_shm() {
            // Parked endpoints of this process's other engines take what is
            // sent to them only when someone progresses them.
            worked |= Fabric::progress_parked();
        }
        let writing = self.writer.in_flight() > 0;
        let reading = self.consumer.in_flight() > 0;
        if reading || writing || !self.unsent.is_empty() {
            let now = Instant::now();
            if now >= self.next_watch {
                self.next_watch = now + PROBE_INTERVAL / 4;
                worked |= self.watch_peers(now);
            }
        }
        if reading {
            self.expire(Instant::now());
        }
        if writing {
            self.expire_writes(Instant::now());
        }
        if worked && self.fabric.wait_fd.is_none() {
            self.last_worked = Instant::now();
        }
        worked
    }

    /// A command found once teardown began: unmaps proceed, everything else
    /// fails with `ShuttingDown`.
    fn dispatch_closing(&mut self, command: Command) {
        match command {
            Command::Unmap { id, reply } => self.unmap_region(id, reply),
            Command::Shutdown { reply } => self.shutdown_replies.push(reply),
            Command::Driver(PeerChange::Add { reply, .. }) => {
                let _ = reply.send(Err(RdmaError::ShuttingDown));
            }
            other => other.refuse(),
        }
    }

    fn park_until_woken(&mut self, ring: &Receiver<Command>, control: &Receiver<Command>) {
        let signals = Arc::clone(&self.signals);
        let bell = signals.lifecycle.doorbell();
        bell.announce_park();
        if !ring.is_empty() || !control.is_empty() || self.turn() || !self.fabric.try_wait() {
            bell.unpark();
            return;
        }
        let busy = self.consumer.in_flight() > 0
            || self.writer.in_flight() > 0
            || !self.sends.is_empty()
            || (self.fabric.wait_fd.is_none() && self.last_worked.elapsed() < RECENT_WORK);
        let mut timeout = if busy {
            BUSY_PARK
        } else {
            self.settings.park_timeout
        };
        if let Some(deadline) = self.consumer.poll_timeout() {
            timeout = timeout.min(deadline.saturating_duration_since(Instant::now()));
        }
        if let Some(deadline) = self.writer.poll_timeout() {
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
}

#[cfg(test)]
mod tests;

impl Handler for Engine {
    type DriverCommand = PeerChange;

    fn get(&mut self, request: BackendGet, reply: Reply<()>) {
        if let Err(err) = self.post(request, Waiter::Single(reply)) {
            complete(err.0, Err(err.1));
        }
    }

    fn get_batch(&mut self, requests: Vec<BackendGet>, reply: BatchReply) {
        self.post_batch(requests, reply);
    }

    fn put(&mut self, request: rdmareg_core::BackendPut, reply: Reply<()>) {
        self.start_put(request, Waiter::Single(reply));
    }

    fn put_batch(&mut self, requests: Vec<rdmareg_core::BackendPut>, reply: BatchReply) {
        self.start_put_batch(requests, reply);
    }

    fn send_notice(&mut self, peer: PeerId, notice: Bytes, reply: Reply<()>) {
        Engine::send_notice(self, peer, notice, reply);
    }

    fn lease(
        &mut self,
        region: u64,
        capability: [u8; CAPABILITY_LEN],
        terms: rdmareg_core::LeaseTerms,
        reply: Reply<rdmareg_backend::BackendLease>,
    ) {
        self.make_lease(region, capability, terms, reply);
    }

    fn release_lease(&mut self, peer: PeerId, packed_key: Bytes, reply: Reply<()>) {
        self.send_release(peer, packed_key, reply);
    }

    fn take_written(&mut self, region: u64, reply: Reply<rdmareg_core::WrittenRanges>) {
        let taken = self.owner.take_written(region);
        let _ = reply.send(taken.ok_or(rdmareg_core::RdmaError::RegionNotFound));
    }

    fn driver_command(&mut self, command: PeerChange) {
        match command {
            PeerChange::Add {
                peer,
                address,
                reply,
            } => {
                let _ = reply.send(self.add_peer(peer, address));
            }
            PeerChange::Remove { peer } => self.remove_peer(peer),
        }
    }

    fn shutdown_requested(&mut self, reply: oneshot::Sender<()>) {
        self.shutdown_replies.push(reply);
    }
}

impl Progress for Engine {
    fn turn(&mut self) -> Turn {
        Turn {
            worked: Engine::turn(self),
            handed_over: false,
        }
    }

    fn park(&mut self, lanes: &Receivers<PeerChange>) {
        self.park_until_woken(&lanes.ring, &lanes.control);
    }

    fn stopped(&mut self, leftover: Option<Command>) {
        if let Some(command) = leftover {
            self.dispatch_closing(command);
        }
    }
}
