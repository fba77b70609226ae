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
//! 2. Retry reads the provider asked to retry (`-FI_EAGAIN`), then read
//!    completions and answer what finished.
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
//! # Answers only after the provider let go
//!
//! A read is answered when its completion (success or error) was read, or
//! after the endpoint was closed at teardown — never earlier, since until
//! then the provider may write its destination. Past its deadline a read is
//! marked, the provider is asked to cancel it, and it answers `Timeout` when
//! the provider ends it with an error (a read that completes late answers
//! `Ok`: the bytes are there). A provider that never ends a read (a stopped
//! peer) holds its answer until teardown closes the endpoint.

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

use crate::config::OfiConfig;
use crate::engine::{Command, Reply, Signals, StartInfo};
use crate::fabric::{Completion, Fabric, MemoryRegion, ProviderContext};
use crate::key::{PackedKey, validate_address};

/// Ring commands handled per turn.
const RING_BATCH: usize = 64;
/// Completions read per turn.
const COMPLETION_BATCH: usize = 256;
/// How long a parked loop sleeps while reads of its own are in flight.
const BUSY_PARK: Duration = Duration::from_micros(20);

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
    };
    let mut engine = Engine::new(fabric, &config, signals);
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
    /// Reads landing in it.
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

/// One posted (or to-be-posted) read.
struct Op {
    context: Box<OpContext>,
    region: u64,
    fi_addr: u64,
    answer: Answer,
    deadline: Instant,
    timed_out: bool,
    posted: bool,
    buf: usize,
    len: usize,
    desc: *mut c_void,
    remote: u64,
    key: u64,
}

/// What the loop needs of the configuration.
#[derive(Debug, Clone)]
struct Settings {
    spin_window: Duration,
    park_timeout: Duration,
    default_get_deadline: Duration,
    teardown_timeout: Duration,
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
    settings: Settings,
    signals: Arc<Signals>,
    page_size: u64,
    shutdown_replies: Vec<oneshot::Sender<()>>,
    fabric: Fabric,
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
            settings: Settings {
                spin_window: config.spin_window,
                park_timeout: config.park_timeout,
                default_get_deadline: config.default_get_deadline,
                teardown_timeout: config.teardown_timeout,
            },
            signals,
            page_size,
            shutdown_replies: Vec::new(),
            fabric,
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
        let mut worked = self.retry_unposted();
        worked |= self.reap();
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
        // SAFETY: the caller of `map` guarantees the range stays allocated
        // until an unmap of `id` answers Ok; the engine deregisters before it
        // answers any unmap of `id` Ok.
        let mr = match unsafe { self.fabric.register(ptr, len, id) } {
            Ok(mr) => mr,
            Err(err) => {
                let _ = reply.send(Err(err));
                return;
            }
        };
        self.signals
            .live_registrations
            .fetch_add(1, Ordering::SeqCst);
        let key = PackedKey {
            virt_addr: self.fabric.virt_addr(),
            mr_key: mr.key,
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
            None => {
                let fi_addr = self.fabric.insert_peer(&address)?;
                self.by_address.insert(address.clone(), fi_addr);
                self.av.insert(
                    fi_addr,
                    AvEntry {
                        address,
                        peers: 0,
                        ops: 0,
                    },
                );
                fi_addr
            }
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
        if entry.peers == 0 && entry.ops == 0 {
            if let Some(entry) = self.av.remove(&fi_addr) {
                self.by_address.remove(&entry.address);
            }
            self.fabric.remove_peer(fi_addr);
        }
    }

    // ---- reads ----

    /// Validates and posts one read; on refusal hands the answer back with
    /// the error.
    fn post(&mut self, request: BackendGet, answer: Answer) -> Result<(), (Answer, RdmaError)> {
        let checked = self.check(&request);
        let (fi_addr, target, key, buf, desc) = match checked {
            Ok(found) => found,
            Err(err) => return Err((answer, err)),
        };
        let deadline = Instant::now()
            + request
                .deadline
                .unwrap_or(self.settings.default_get_deadline);
        let slot = self.free_slots.pop().unwrap_or_else(|| {
            self.ops.push(None);
            self.ops.len() - 1
        });
        let context = Box::new(OpContext {
            space: [std::ptr::null_mut(); 8],
        });
        let context_addr = (&raw const *context) as usize;
        self.ops[slot] = Some(Op {
            context,
            region: request.local_region_id,
            fi_addr,
            answer,
            deadline,
            timed_out: false,
            posted: false,
            buf,
            len: request.len as usize,
            desc,
            remote: target,
            key,
        });
        self.by_context.insert(context_addr, slot);
        self.active += 1;
        if let Some(region) = self.regions.get_mut(&request.local_region_id) {
            region.in_flight += 1;
        }
        if let Some(entry) = self.av.get_mut(&fi_addr) {
            entry.ops += 1;
        }
        match self.try_post(slot) {
            Ok(true) => {}
            Ok(false) => self.unposted.push_back(slot),
            Err(err) => self.finish(slot, Err(err)),
        }
        Ok(())
    }

    /// Everything a read is checked against before libfabric sees it.
    #[allow(clippy::type_complexity)]
    fn check(
        &self,
        request: &BackendGet,
    ) -> Result<(u64, u64, u64, usize, *mut c_void), RdmaError> {
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
        Ok((fi_addr, target, key.mr_key, buf, region.mr.desc))
    }

    fn try_post(&mut self, slot: usize) -> Result<bool, RdmaError> {
        let Some(op) = self.ops[slot].as_mut() else {
            return Ok(true);
        };
        let context = (&raw mut op.context.space).cast::<c_void>();
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
        for (index, request) in requests.into_iter().enumerate() {
            if let Err((answer, err)) = self.post(request, Answer::Batch(Rc::clone(&batch), index))
            {
                give(answer, Err(err));
            }
        }
    }

    /// Reads completions and answers what they end.
    fn reap(&mut self) -> bool {
        let mut completions = std::mem::take(&mut self.completions);
        self.fabric
            .poll_completions(&mut completions, COMPLETION_BATCH);
        let worked = !completions.is_empty();
        for completion in completions.drain(..) {
            let (context, result) = match completion {
                Completion::Done(context) => (context, Ok(())),
                Completion::Failed(context, code, text) => (context, Err((code, text))),
            };
            let Some(slot) = self.by_context.get(&(context as usize)).copied() else {
                tracing::warn!(?context, "a completion for no read of this engine");
                continue;
            };
            let timed_out = self.ops[slot].as_ref().is_some_and(|op| op.timed_out);
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
        give(op.answer, result);
    }

    /// Marks reads past their deadline; a read never posted ends at once.
    fn expire(&mut self, now: Instant) {
        let mut unposted_expired = Vec::new();
        for slot in 0..self.ops.len() {
            let Some(op) = self.ops[slot].as_mut() else {
                continue;
            };
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
        let mut timeout = if self.active > 0 {
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
        while self.active > 0 && Instant::now() < until {
            if !self.turn() {
                std::thread::sleep(Duration::from_micros(50));
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
            }
        }
        self.fabric.close_endpoint();
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
}
