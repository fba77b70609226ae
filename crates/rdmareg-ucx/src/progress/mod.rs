//! The progress thread: the one thread that owns every UCX object.
//!
//! It owns the serving `ucp_context` and its `UCS_THREAD_MODE_SINGLE`
//! worker, the direct lane's context and workers if open (`direct`), the
//! endpoints and memory handles; none of these leaves it. It runs commands
//! from the ring and the control lane (`command`) and progresses the
//! workers, which serves peers' reads (`serve`) and writes the replies to
//! this engine's own reads (`gets`).
//!
//! The kit's [`progress_loop`] runs it. A turn progresses the worker a
//! bounded number of times, handles what the callbacks recorded, expires
//! GETs past their deadline and finishes endpoint closes. Parking arms the
//! worker and `poll`s its event fd and the doorbell, for at most the park
//! timeout or until the next GET deadline. A sent read request, a completed
//! read and a sent reply count as hand-overs (the kit's "Handing over").

mod chunks;
mod copy_plans;
mod direct;
pub(crate) mod direct_writes;
mod events;
mod gets;
mod key_memo;
mod leases;
mod notices;
mod ops;
mod peers;
pub(crate) mod process_writes;
mod put_lists;
mod puts;
mod read_lists;
mod regions;
mod replies;
mod results;
mod serve;
mod serve_writes;
mod teardown;
mod ucp;
pub(crate) mod vectored;

use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use crossbeam_channel::Receiver;
use futures::channel::oneshot;
use rdmareg_core::{BackendGet, BackendPut, RdmaError};
use rdmareg_engine::command::{BatchReply, Handler, Reply};
use rdmareg_engine::lanes::Receivers;
use rdmareg_engine::progress_loop::{self, Progress, Timings, Turn};
use rdmareg_engine::thread::Ready;

use crate::command::{Command, PeerChange, Signals};
use crate::config::UcxConfig;
use crate::engine_address::{EngineAddress, ProcessIdentity};
use crate::read_list::{READ_LIST_REPLY_AM_ID, READ_LIST_REQUEST_AM_ID};
use crate::read_protocol::{
    NOTICE_AM_ID, READ_REPLY_AM_ID, READ_REQUEST_AM_ID, WRITE_LIST_REPLY_AM_ID,
    WRITE_LIST_REQUEST_AM_ID, WRITE_REQUEST_AM_ID,
};
use direct::DirectLane;
use events::Events;
use ops::OpTable;
use peers::PeerTable;
use regions::RegionTable;
use ucp::{Context, ContextRole, Worker};

pub(crate) use ucp::ucx_version;

/// Worker progress calls per turn before commands are looked at again.
const PROGRESS_BATCH: usize = 64;

/// What a started engine tells its handle.
#[derive(Debug)]
pub(crate) struct StartInfo {
    pub(crate) worker_address: Bytes,
    pub(crate) ucx_version: (u32, u32, u32),
}

/// The loop's share of [`UcxConfig`].
#[derive(Debug, Clone)]
struct Settings {
    timings: Timings,
    peer_error_handling: bool,
    /// Whether reads and writes may go in chunks at all (`chunks`).
    fragment_chunks: bool,
    /// Whether writable registrations get writable same-host keys
    /// (`regions`); see `UcxConfig::same_host_direct_writes`.
    direct_writes: bool,
}

/// Everything the progress thread owns.
///
/// Field order is drop order, and it matters: the worker goes first, then
/// the records UCX callbacks point into (op slots, endpoint error contexts,
/// events), and the context last.
struct Engine {
    worker: Worker,
    /// The same-host direct-read lane, if opened (its workers, then its
    /// context).
    direct: Option<DirectLane>,
    ops: OpTable,
    peers: PeerTable,
    events: Box<Events>,
    regions: RegionTable,
    settings: Settings,
    signals: Arc<Signals>,
    page_size: u64,
    worker_fd: RawFd,
    arm_failures: u64,
    shutdown_replies: Vec<oneshot::Sender<()>>,
    /// A ring command taken just before a shutdown was found.
    leftover: Option<Command>,
    /// Emptied record lists, kept for their capacity (see `drain_events`).
    spare: SpareRecords,
    /// Notices whose reads succeeded, to send (`notices`).
    notices_due: results::NoticesDue,
    /// Same-host reads collected in this turn, copied by `flush_copies`
    /// before the turn ends.
    copies: Vec<gets::PendingCopy>,
    /// The last peer `copy_source` looked up in this turn, and its result:
    /// a batch's entries name the same peer, and each lookup hashes the
    /// peer's whole address. Cleared when the turn's copies are flushed,
    /// before any command can change the peer table.
    copy_source_memo: Option<(rdmareg_core::PeerId, crate::owner_process::SameHostSource)>,
    /// Parked unmaps of writable regions waiting for same-host writers to
    /// let go of their release slots (`regions`).
    gated_unmaps: Vec<u64>,
    /// The served endpoint of the last peer a batch's read looked up, for
    /// the same reason: a lookup hashes the peer's whole address. Set and
    /// used only while one batch's reads are prepared, and cleared before
    /// anything is sent or any callback can close an endpoint (see
    /// `gets::served_endpoint`).
    endpoint_memo: Option<(rdmareg_core::PeerId, ucp::EpHandle, u64)>,
    /// `try_post_get`'s prepared reads, kept for the capacity.
    served_scratch: Vec<gets::PreparedRead>,
    /// The read keys decoded last (see `key_memo`): a list's entries carry
    /// a few descriptors' keys, each decoded once.
    key_memo: key_memo::KeyMemo,
    /// Same-host lists posted again, worked out (see `copy_plans`).
    copy_plans: copy_plans::CopyPlans,
    /// This engine's process as its address publishes it (only with a
    /// direct lane): peers sharing its pid space are copied from directly.
    process: Option<ProcessIdentity>,
    /// Slots that tell same-host readers which registrations are live
    /// (`release_table`); `None` without the direct lane, or when it could
    /// not be made: this engine's keys are then served-only.
    release: Option<crate::release_table::ReleaseTable>,
    context: Context,
}

/// Empty vectors that trade places with the callback record lists in
/// `Events`, so handling records allocates nothing in steady state.
#[derive(Debug, Default)]
struct SpareRecords {
    sent: Vec<(u32, ucx_sys::ucs_status_t)>,
    finished: Vec<u32>,
    unmapped: Vec<u64>,
    failed: Vec<(u64, ucx_sys::ucs_status_t)>,
}

/// Takes the records out of `list`, leaving `spare` (empty, with its
/// capacity) in its place.
fn take_records<T>(list: &std::cell::RefCell<Vec<T>>, spare: &mut Vec<T>) -> Vec<T> {
    debug_assert!(spare.is_empty());
    std::mem::replace(&mut *list.borrow_mut(), std::mem::take(spare))
}

/// The thread's body: start, report, serve, tear down.
pub(crate) fn run(
    config: UcxConfig,
    signals: Arc<Signals>,
    lanes: Receivers<PeerChange>,
    ready: Ready<StartInfo>,
) {
    let pinned = match &config.progress_cpus {
        Some(cpus) => crate::affinity::pin_current_thread(cpus),
        None => Ok(()),
    };
    let started = pinned.and_then(|()| Engine::start(&config, Arc::clone(&signals)));
    let (mut engine, info) = match started {
        Ok(started) => started,
        Err(err) => {
            signals.lifecycle.close();
            ready.failed(err);
            return;
        }
    };
    ready.started(info);
    let spin_window = engine.settings.timings.spin_window;
    progress_loop::run(&mut engine, &lanes, spin_window);
    engine.teardown(&lanes.ring, &lanes.control);
}

impl Engine {
    fn start(config: &UcxConfig, signals: Arc<Signals>) -> Result<(Engine, StartInfo), RdmaError> {
        let version = ucx_version();
        let settings = config.ucx_settings_from_env().map_err(|why| {
            RdmaError::backend(format!("ucx: invalid engine configuration: {why}"))
        })?;
        if let Some(line) = &settings.overridden {
            tracing::warn!("{line}");
        }
        tracing::debug!(settings = ?settings.pairs, "starting UCX engine");
        let context = Context::new(&settings.pairs, ContextRole::Serving)?;
        let worker = Worker::new(&context)?;
        let direct = if config.direct_reads_enabled() {
            match DirectLane::open(config, version) {
                Ok(lane) => {
                    signals.caller_copies.set_key_format(lane.key_format);
                    Some(lane)
                }
                Err(why) => {
                    tracing::info!(reason = %why, "same-host direct reads unavailable; every read goes through its owner");
                    None
                }
            }
        } else {
            None
        };
        let mut events: Box<Events> = Box::default();
        events.owner = std::cell::RefCell::new(rdmareg_engine::served::Owner::new(
            rdmareg_engine::served::OwnerConfig {
                max_replies_per_endpoint: config.max_served_replies_per_connection,
                ..rdmareg_engine::served::OwnerConfig::default()
            },
        ));
        events.served_gauge = Arc::clone(&signals.served_replies_in_flight);
        events.notices = Some(Arc::clone(&signals.notices));
        // Chunked reads and fragment-sized list replies both need UCX's tcp
        // protocols to be the engine's own.
        let fragment_chunks = config.fragment_chunks_allowed_by_env();
        events.fragment_sized_replies.set(fragment_chunks);
        events.every_lane_is_tcp.set(settings.every_lane_is_tcp());
        events
            .tcp_ranges_per_zero_copy_fragment
            .set(config.tcp_ranges_per_zero_copy_fragment_by_env());
        let events_arg = (&*events as *const Events)
            .cast_mut()
            .cast::<std::ffi::c_void>();
        // SAFETY: `events` is boxed, so its address is stable, and the
        // engine drops it only after the worker (field order in `Engine`);
        // the handlers treat the argument as a shared `&Events`.
        unsafe {
            worker.set_am_handler(READ_REQUEST_AM_ID, serve::on_read_request, events_arg)?;
            worker.set_am_handler(READ_REPLY_AM_ID, replies::on_read_reply, events_arg)?;
            worker.set_am_handler(
                READ_LIST_REQUEST_AM_ID,
                read_lists::on_read_list_request,
                events_arg,
            )?;
            worker.set_am_handler(
                READ_LIST_REPLY_AM_ID,
                read_lists::on_read_list_reply,
                events_arg,
            )?;
            worker.set_am_handler(NOTICE_AM_ID, notices::on_notice, events_arg)?;
            worker.set_am_handler(
                WRITE_REQUEST_AM_ID,
                serve_writes::on_write_request,
                events_arg,
            )?;
            worker.set_am_handler(
                WRITE_LIST_REQUEST_AM_ID,
                serve_writes::on_write_list_request,
                events_arg,
            )?;
            worker.set_am_handler(
                WRITE_LIST_REPLY_AM_ID,
                put_lists::on_write_list_reply,
                events_arg,
            )?;
        }
        events.worker.set(worker.raw());
        let max_am_header = worker.max_am_header()?;
        tracing::debug!(max_am_header, "worker created");
        events.max_am_header.set(max_am_header);
        let serving_address = worker.address()?;
        // This runs on the progress thread, which lives as long as the
        // engine: copies name the process by it (`owner_process`).
        let process = direct
            .as_ref()
            .and_then(|_| ProcessIdentity::current_with_this_thread());
        let release = process
            .filter(|process| process.thread.is_some())
            .and_then(|_| match crate::release_table::ReleaseTable::create() {
                Ok(table) => Some(table),
                Err(err) => {
                    tracing::info!(error = %err, "no release table; this engine's keys are read through it");
                    None
                }
            });
        let worker_address = match &direct {
            Some(lane) => EngineAddress {
                serving: serving_address,
                direct: Some(lane.address.clone()),
                process,
                release_table: release.as_ref().and_then(|table| table.location()),
            }
            .encode()
            .map_err(|err| {
                RdmaError::backend(format!("ucx: cannot publish this engine's address: {err}"))
            })?,
            None => serving_address,
        };
        let worker_fd = worker.event_fd()?;
        // SAFETY: sysconf takes no pointers.
        let page_size = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
            n if n > 0 => n as u64,
            _ => 4096,
        };
        let engine = Engine {
            worker,
            direct,
            ops: OpTable::new(),
            peers: PeerTable::default(),
            events,
            regions: RegionTable::default(),
            settings: Settings {
                timings: Timings {
                    spin_window: config.spin_window,
                    park_timeout: config.park_timeout,
                    default_get_deadline: config.default_get_deadline,
                    teardown_timeout: config.teardown_timeout,
                },
                peer_error_handling: config.transport.peer_error_handling(),
                direct_writes: config.same_host_direct_writes,
                fragment_chunks,
            },
            signals,
            page_size,
            worker_fd,
            arm_failures: 0,
            shutdown_replies: Vec::new(),
            leftover: None,
            spare: SpareRecords::default(),
            notices_due: Default::default(),
            copies: Vec::new(),
            copy_source_memo: None,
            gated_unmaps: Vec::new(),
            endpoint_memo: None,
            served_scratch: Vec::new(),
            key_memo: key_memo::KeyMemo::default(),
            copy_plans: copy_plans::CopyPlans::default(),
            process,
            release,
            context,
        };
        let info = StartInfo {
            worker_address,
            ucx_version: version,
        };
        Ok((engine, info))
    }

    /// One progress of each worker the loop drives, then whatever the
    /// callbacks recorded.
    fn progress(&mut self) -> u32 {
        let mut n = self.worker.progress();
        if let Some(lane) = &self.direct {
            n += lane.reader.progress();
        }
        self.drain_events();
        n
    }

    /// Handles callback records until none are left (handling one can
    /// produce more: closing a failed endpoint finishes its reads).
    ///
    /// The lists are swapped with spares before they are handled (handling
    /// can push to them), so steady state allocates nothing.
    fn drain_events(&mut self) {
        while !self.events.is_empty() {
            let mut sent = take_records(&self.events.sent_requests, &mut self.spare.sent);
            let mut finished = take_records(&self.events.finished_reads, &mut self.spare.finished);
            let mut unmapped = take_records(&self.events.unmapped, &mut self.spare.unmapped);
            let mut failed = take_records(&self.events.failed_endpoints, &mut self.spare.failed);
            for (slot, status) in sent.drain(..) {
                self.request_sent(slot, status);
            }
            for slot in finished.drain(..) {
                self.finish_get(slot);
            }
            for region in unmapped.drain(..) {
                self.run_parked_unmap_if_idle(region);
            }
            for (serial, status) in failed.drain(..) {
                self.endpoint_failed(serial, status);
            }
            self.drain_put_sends();
            self.spare = SpareRecords {
                sent,
                finished,
                unmapped,
                failed,
            };
        }
        // Replies to writes complete them inside UCX's handlers.
        self.complete_puts();
        self.send_notices_due();
    }

    /// Sleeps until the worker has events, a submitter rings, or the timeout.
    fn park_until_woken(&mut self, ring: &Receiver<Command>, control: &Receiver<Command>) {
        let signals = Arc::clone(&self.signals);
        let bell = signals.lifecycle.doorbell();
        bell.announce_park();
        if !ring.is_empty() || !control.is_empty() {
            bell.unpark();
            return;
        }
        let mut armed = false;
        loop {
            if self.progress() > 0 {
                bell.unpark();
                return;
            }
            match self.worker.arm() {
                Ok(true) => {
                    armed = true;
                    break;
                }
                Ok(false) => continue,
                Err(err) => {
                    self.arm_failures += 1;
                    if self.arm_failures == 1 {
                        tracing::warn!(error = %err, "cannot arm the UCX worker; parking on short timeouts instead");
                    }
                    break;
                }
            }
        }
        let mut timeout = self.settings.timings.park_timeout;
        if !armed {
            timeout = timeout.min(Duration::from_millis(1));
        }
        if self.peers.closing_count() > 0 || !self.gated_unmaps.is_empty() {
            timeout = timeout.min(Duration::from_millis(1));
        }
        for deadline in [self.next_read_deadline(), self.next_put_deadline()]
            .into_iter()
            .flatten()
        {
            timeout = timeout.min(deadline.saturating_duration_since(Instant::now()));
        }
        let mut fds = [
            libc::pollfd {
                fd: self.worker_fd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: bell.fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // Round up so a deadline is not missed by a sub-millisecond remainder.
        let millis = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
        // SAFETY: `fds` is a live array of two initialised pollfd records.
        unsafe { libc::poll(fds.as_mut_ptr(), 2, millis) };
        bell.unpark();
        if fds[1].revents != 0 {
            bell.drain();
        }
    }
}

impl Handler for Engine {
    type DriverCommand = PeerChange;

    fn get(&mut self, request: BackendGet, reply: Reply<()>) {
        self.post_get(request, reply);
    }

    fn get_batch(&mut self, requests: Vec<BackendGet>, reply: BatchReply) {
        self.post_batch(requests, reply);
    }

    fn get_shared_batch(&mut self, requests: Arc<[BackendGet]>, reply: BatchReply) {
        self.post_shared_batch(requests, reply);
    }

    fn put(&mut self, request: BackendPut, reply: Reply<()>) {
        self.post_put(request, puts::PutWaiter::Single(reply));
    }

    fn put_batch(&mut self, requests: Vec<BackendPut>, reply: BatchReply) {
        self.post_put_batch(requests, reply);
    }

    fn get_with_notice(&mut self, request: BackendGet, notice: Bytes, reply: Reply<()>) {
        self.post_get_with_notice(request, notice, reply);
    }

    fn send_notice(&mut self, peer: rdmareg_core::PeerId, notice: Bytes, reply: Reply<()>) {
        Engine::send_notice(self, peer, notice, reply);
    }

    fn lease(
        &mut self,
        region: u64,
        capability: [u8; 16],
        terms: rdmareg_core::LeaseTerms,
        reply: Reply<rdmareg_backend::BackendLease>,
    ) {
        self.make_lease(region, capability, terms, reply);
    }

    fn release_lease(&mut self, peer: rdmareg_core::PeerId, packed_key: Bytes, reply: Reply<()>) {
        self.send_release(peer, packed_key, reply);
    }

    fn take_written(&mut self, region: u64, reply: Reply<rdmareg_core::WrittenRanges>) {
        let taken = self.events.owner.borrow_mut().take_written(region);
        let taken = taken.map(|mut taken| {
            // Same-host peers may write it one-sided, unseen by the owner
            // (`direct_writes`): the log cannot say nothing else landed.
            if self
                .regions
                .get(&region)
                .is_some_and(|region| region.direct_writable)
            {
                taken.incomplete = true;
            }
            taken
        });
        let _ = reply.send(taken.ok_or(rdmareg_core::RdmaError::RegionNotFound));
    }

    fn driver_command(&mut self, command: PeerChange) {
        match command {
            PeerChange::Add { peer, address } => self.add_peer(peer, address),
            PeerChange::Remove { peer } => self.remove_peer(peer),
        }
        self.signals.caller_copies.peer_change_applied();
    }

    fn command_done(&mut self) {
        self.drain_events();
    }

    fn shutdown_requested(&mut self, reply: oneshot::Sender<()>) {
        self.shutdown_replies.push(reply);
    }
}

impl Progress for Engine {
    fn turn(&mut self) -> Turn {
        let mut worked = false;
        for _ in 0..PROGRESS_BATCH {
            if self.progress() == 0 {
                break;
            }
            worked = true;
        }
        if self.ops.active() > 0 {
            self.expire_gets(Instant::now());
            self.drain_events();
        }
        if self.events.writer.borrow().in_flight() > 0 {
            self.expire_puts(Instant::now());
            self.drain_events();
        }
        if self.peers.closing_count() > 0 {
            self.poll_closing();
        }
        if !self.gated_unmaps.is_empty() {
            self.retry_gated_unmaps();
        }
        Turn {
            worked,
            handed_over: self.events.hand_offs.replace(0) == 1,
        }
    }

    fn park(&mut self, lanes: &Receivers<PeerChange>) {
        self.park_until_woken(&lanes.ring, &lanes.control);
    }

    fn stopped(&mut self, leftover: Option<Command>) {
        // Teardown completes it with the rest.
        self.leftover = leftover;
    }
}
