//! [`UcxEngine`]: the handle to one progress thread.
//!
//! # Call order
//!
//! 1. [`UcxEngine::start`] with a [`UcxConfig`].
//! 2. Hand [`UcxEngine::worker_address`] to the peers that will read from
//!    this engine, and record theirs with [`UcxEngine::add_peer`].
//! 3. Use [`UcxEngine::backend`] (an `Arc<dyn RdmaBackend>`-compatible
//!    [`UcxBackend`]) to map, unmap and GET.
//! 4. [`UcxEngine::shutdown`] (or drop the engine): every outstanding call
//!    completes, everything is released, and
//!    [`UcxEngine::live_registrations`] reads zero.
//!
//! Backends handed out keep working until teardown begins and return
//! [`RdmaError::ShuttingDown`] afterwards; they do not keep the thread alive.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::channel::oneshot;
use rdmareg_core::{PeerId, RdmaError};
use rdmareg_engine::backend::Backend;
use rdmareg_engine::front::Front;
use rdmareg_engine::lifecycle::Lifecycle;
use rdmareg_engine::notices::NoticeBoard;
use rdmareg_engine::thread::ProgressThread;

use crate::backend::UcxBackend;
use crate::caller_copies::CallerCopies;
use crate::command::{Command, PeerChange, Signals};
use crate::config::UcxConfig;
use crate::engine_address::EngineAddress;
use crate::progress;
use crate::worker_address::WorkerAddressFormat;

/// The backend front of this engine: the kit's, trying same-host copies on
/// the caller's thread first.
pub(crate) type UcxFront = Front<PeerChange, Signals>;

/// Extra time a blocking shutdown grants the thread beyond its own teardown
/// timeout before it gives up waiting.
const JOIN_GRACE: Duration = Duration::from_secs(1);

/// A running UCX progress thread and the handle to it.
///
/// Dropping the engine shuts it down (bounded by the configured teardown
/// timeout plus a second); see [`UcxEngine::shutdown_blocking`].
#[derive(Debug)]
pub struct UcxEngine {
    front: UcxFront,
    signals: Arc<Signals>,
    thread: ProgressThread,
    worker_address: Bytes,
    ucx_version: (u32, u32, u32),
    teardown_timeout: Duration,
}

impl UcxEngine {
    /// Starts the progress thread, which creates the UCX context and worker.
    ///
    /// Blocks until the thread has either started or failed. The first
    /// engine of a process raises its soft open-file limit to the hard one
    /// ([`build_info::raise_open_file_limit`](crate::build_info::raise_open_file_limit)).
    ///
    /// # Errors
    /// [`RdmaError::Backend`] when the configuration is invalid or UCX refuses
    /// to initialise (the message carries UCX's status text).
    pub fn start(config: UcxConfig) -> Result<UcxEngine, RdmaError> {
        config
            .validate()
            .map_err(|e| RdmaError::backend(format!("ucx: invalid engine configuration: {e}")))?;
        let lifecycle = Lifecycle::starting("ucx")?;
        let notice_sender = rdmareg_engine::notices::draw_sender()?;
        let signals = Arc::new(Signals {
            lifecycle: Arc::clone(&lifecycle),
            served_replies_in_flight: Arc::default(),
            caller_copies: CallerCopies::new(config.caller_copy_limit),
            lists_copied_by_plan: Default::default(),
            reads_asked_in_chunks: Default::default(),
            puts_sent_in_chunks: Default::default(),
            notices: NoticeBoard::new(config.notice_limits),
            notice_sender,
        });
        let (submitter, lanes) = rdmareg_engine::lanes::lanes(config.ring_capacity, lifecycle);
        let teardown_timeout = config.teardown_timeout;
        let thread_signals = Arc::clone(&signals);
        let (thread, info) = ProgressThread::start("rdmareg-ucx", move |ready| {
            progress::run(config, thread_signals, lanes, ready);
        })?;
        tracing::debug!(version = ?info.ucx_version, address_len = info.worker_address.len(), "UCX engine started");
        Ok(UcxEngine {
            front: Front::new(Arc::new(submitter), Arc::clone(&signals))
                .with_notices(Arc::clone(&signals.notices) as _, notice_sender),
            signals,
            thread,
            worker_address: info.worker_address,
            ucx_version: info.ucx_version,
            teardown_timeout,
        })
    }

    /// This engine's address: what a peer passes to its own
    /// [`UcxEngine::add_peer`] to read from this engine.
    ///
    /// Without the same-host direct-read lane it is the serving worker's
    /// packed UCP address; with it, an [`EngineAddress`] envelope that adds
    /// the direct-read worker's address. Whoever holds it can create an
    /// endpoint to this process and send it read requests; what they can
    /// read is bounded by the descriptors they were given, which the engine
    /// checks on every request — except over the direct-read lane, which
    /// only same-user processes of this host can reach (see the crate
    /// docs).
    pub fn worker_address(&self) -> Bytes {
        self.worker_address.clone()
    }

    /// The `(major, minor, release)` version of the UCX library in use.
    pub fn ucx_version(&self) -> (u32, u32, u32) {
        self.ucx_version
    }

    /// Records how to reach `peer`: its packed worker address.
    ///
    /// The endpoint is created by the first GET to `peer`. Re-adding a peer
    /// with a different address closes its current endpoint (GETs in flight
    /// on it fail). UCX parses the address without a length check, so it is
    /// validated here against the worker-address layout of the UCX in use
    /// ([`crate::worker_address`]) and stored padded; a malformed address is
    /// refused and leaves the peer table unchanged.
    ///
    /// # Errors
    /// [`RdmaError::InvalidWorkerAddress`] for an address that is empty, not
    /// well-formed, or from a UCX version whose layout is unknown;
    /// [`RdmaError::ShuttingDown`] after teardown began.
    ///
    /// # Whom this trusts
    /// An address with a same-host direct-read lane is trusted to name the
    /// peer's *own* lane: reads with same-host keys from `peer` then copy,
    /// through the kernel, from the process that lane belongs to, checked
    /// only against the range the key claims. Connections are keyed by the
    /// whole address, so an envelope from one peer cannot redirect another
    /// peer's reads; but a peer that hands you both its address and its
    /// descriptors can make this engine copy from any process of this host
    /// and user. For addresses from peers you do not trust that far, use
    /// [`add_peer_served_only`](Self::add_peer_served_only).
    pub fn add_peer(&self, peer: PeerId, address: Bytes) -> Result<(), RdmaError> {
        self.add_peer_with(peer, address, true)
    }

    /// As [`add_peer`](Self::add_peer), but ignores the direct-read lane
    /// the address may carry: every read from `peer` goes through its
    /// owner's engine, which checks it (see `docs/safety.md`), whatever the
    /// keys say. For peers trusted with the network, not with this host.
    ///
    /// # Errors
    /// As [`add_peer`](Self::add_peer).
    pub fn add_peer_served_only(&self, peer: PeerId, address: Bytes) -> Result<(), RdmaError> {
        self.add_peer_with(peer, address, false)
    }

    fn add_peer_with(
        &self,
        peer: PeerId,
        address: Bytes,
        direct_lane: bool,
    ) -> Result<(), RdmaError> {
        let (major, minor, _) = self.ucx_version;
        let format = WorkerAddressFormat::for_ucx_version(major, minor).ok_or_else(|| {
            RdmaError::InvalidWorkerAddress(format!(
                "the worker-address layout of UCX {major}.{minor} is unknown (known: {:?}), so no address is accepted",
                WorkerAddressFormat::supported_versions().collect::<Vec<_>>()
            ))
        })?;
        let mut address =
            EngineAddress::decode_for_endpoints(&address, &format).map_err(|err| {
                tracing::debug!(%peer, error = %err, "refusing peer worker address");
                RdmaError::InvalidWorkerAddress(format!("{err} (for {peer})"))
            })?;
        if !direct_lane {
            address.direct = None;
            address.process = None;
        }
        self.push_peer_change(PeerChange::Add { peer, address })
    }

    /// Forgets `peer` and closes its endpoint; GETs in flight to it fail.
    ///
    /// # Errors
    /// [`RdmaError::ShuttingDown`] after teardown began.
    pub fn remove_peer(&self, peer: PeerId) -> Result<(), RdmaError> {
        self.push_peer_change(PeerChange::Remove { peer })
    }

    /// Same-host reads this engine's callers copied on their own threads
    /// so far, without the progress thread (see
    /// [`UcxConfig::caller_copy_limit`](crate::UcxConfig::caller_copy_limit)).
    pub fn reads_copied_on_caller_threads(&self) -> u64 {
        self.signals.caller_copies.copied()
    }

    /// Same-host PUTs this engine wrote on its callers' threads, without
    /// its progress thread (`caller_copies`, "Writes").
    pub fn writes_made_on_caller_threads(&self) -> u64 {
        self.signals.caller_copies.written()
    }

    /// Posts of a transfer list posted again (the same shared requests,
    /// [`RdmaBackend::get_shared_batch`](rdmareg_backend::RdmaBackend::get_shared_batch))
    /// that the progress thread completed by the list's copy plan: one
    /// vectored copy worked out at an earlier post, instead of each entry
    /// checked again. Only same-host lists copied from one owner process
    /// have a plan.
    pub fn lists_copied_by_plan(&self) -> u64 {
        self.signals.lists_copied_by_plan.load(Ordering::Relaxed)
    }

    /// Served reads this engine asked in chunks, on endpoints whose every
    /// lane is tcp, counted once per read.
    ///
    /// Reads longer than one tcp fragment and up to the size UCX still sends
    /// eager go in chunks of one fragment each; a list's reads longer than
    /// the list entry bound and at most twice it go in two chunks batched
    /// with the list's small reads.
    pub fn reads_asked_in_chunks(&self) -> u64 {
        self.signals.reads_asked_in_chunks.load(Ordering::Relaxed)
    }

    /// Served PUTs this engine sent in chunks of one tcp fragment, on
    /// endpoints whose active messages go over tcp, counted once per PUT.
    ///
    /// PUTs longer than 256 KiB and at most 4 MiB go as 60 KiB writes and a
    /// remainder, each arriving in one fragment; every other served PUT
    /// goes in writes of at most 1 MiB.
    pub fn puts_sent_in_chunks(&self) -> u64 {
        self.signals.puts_sent_in_chunks.load(Ordering::Relaxed)
    }

    /// A backend submitting to this engine.
    pub fn backend(&self) -> Arc<UcxBackend> {
        Arc::new(Backend::new(self.front.clone()))
    }

    /// Registrations the progress thread holds: its own count, moved only by
    /// successful `ucp_mem_map` / `ucp_mem_unmap` calls. Always `Some`: the
    /// same value as
    /// [`RdmaBackend::live_registrations`](rdmareg_backend::RdmaBackend::live_registrations)
    /// on this engine's backends.
    pub fn live_registrations(&self) -> Option<usize> {
        Some(self.signals.lifecycle.live_registrations())
    }

    /// Replies this engine, as an owner, is serving whose sends UCX has
    /// not finished yet, over every consumer connection: each holds a read
    /// lease on its region. At most
    /// [`UcxConfig::max_served_replies_per_connection`](crate::UcxConfig::max_served_replies_per_connection)
    /// per connection; zero once teardown is done.
    pub fn served_replies_in_flight(&self) -> usize {
        self.signals
            .served_replies_in_flight
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Tears the engine down and waits for it.
    ///
    /// Every outstanding call completes ([`RdmaError::ShuttingDown`] for
    /// maps and GETs; unmaps by what happened to their region), endpoints
    /// are closed, every region still registered is unmapped, the worker and
    /// context are destroyed and the thread is joined. Idempotent.
    ///
    /// # Cancel safety
    /// Dropping the future does not stop the teardown, which runs on the
    /// progress thread; only the wait is abandoned (dropping the engine
    /// waits again, bounded).
    pub async fn shutdown(&self) {
        let (reply, done) = oneshot::channel();
        if self.request_shutdown(reply) {
            let _ = done.await;
        }
        self.join_if_finished(Instant::now() + JOIN_GRACE);
    }

    /// [`UcxEngine::shutdown`] for synchronous callers: waits at most the
    /// configured teardown timeout plus a second. Returns whether the
    /// thread finished; if it did not (UCX wedged inside a call), it is left
    /// detached and an error is logged.
    pub fn shutdown_blocking(&self) -> bool {
        let (reply, _done) = oneshot::channel();
        self.request_shutdown(reply);
        self.join_if_finished(Instant::now() + self.teardown_timeout + JOIN_GRACE)
    }

    /// Pushes a peer change onto the ring (the control lane if the ring is
    /// full), counted first as submitted, so reads submitted after it wait
    /// for the thread to make it before they copy on their caller's thread
    /// (see `caller_copies`).
    fn push_peer_change(&self, change: PeerChange) -> Result<(), RdmaError> {
        self.signals.caller_copies.peer_change_submitted();
        self.front.submitter().push_now(Command::Driver(change))
    }

    /// Pushes a shutdown command (even if teardown began: it then waits for
    /// the end of it). Returns whether the thread will reply to it.
    fn request_shutdown(&self, reply: oneshot::Sender<()>) -> bool {
        self.front.submitter().send_shutdown(reply)
    }

    /// Joins the thread once it has finished, waiting until `deadline`.
    fn join_if_finished(&self, deadline: Instant) -> bool {
        self.thread.join_by(deadline)
    }
}

impl Drop for UcxEngine {
    fn drop(&mut self) {
        if !self.thread.is_joined() {
            self.shutdown_blocking();
        }
    }
}
