//! [`OfiEngine`]: the handle to one libfabric progress thread.
//!
//! # Call order
//!
//! 1. [`OfiEngine::start`] with an [`OfiConfig`].
//! 2. Hand [`OfiEngine::fabric_address`] to the peers that read from this
//!    engine, and record theirs with [`OfiEngine::add_peer`].
//! 3. Map, unmap and GET through [`OfiEngine::backend`].
//! 4. [`OfiEngine::shutdown`] (or drop the engine): every outstanding call
//!    completes, everything is released, and
//!    [`OfiEngine::live_registrations`] reads zero.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::channel::oneshot;
use rdmareg_core::{NoticeSender, PeerId, RdmaError};
use rdmareg_engine::front::{Front, NoCallerCopies};
use rdmareg_engine::lifecycle::Lifecycle;
use rdmareg_engine::notices::NoticeBoard;
use rdmareg_engine::thread::ProgressThread;

use crate::backend::OfiBackend;
use crate::config::OfiConfig;
use crate::progress;
use rdmareg_engine::backend::Backend;

pub(crate) use rdmareg_engine::command::Reply;

/// One request to the progress thread: the engine kit's commands, on the
/// kit's two lanes ([`rdmareg_engine::lanes`]), plus this driver's peer
/// changes.
pub(crate) type Command = rdmareg_engine::command::Command<PeerChange>;

/// A change to the peer table.
#[derive(Debug)]
pub enum PeerChange {
    /// Record `peer`'s fabric address; completes once the address vector
    /// took it (or refused it).
    Add {
        peer: PeerId,
        address: Bytes,
        reply: Reply<()>,
    },
    /// Forget `peer`.
    Remove { peer: PeerId },
}

/// What the thread and the submitters both see.
#[derive(Debug)]
pub(crate) struct Signals {
    /// Teardown begun, registrations held, what teardown left; the doorbell.
    pub(crate) lifecycle: Arc<Lifecycle>,
    /// Read requests this engine, as an owner, did not serve because the
    /// provider named another sender than the reply address, or none.
    pub(crate) unconfirmed_requests: AtomicU64,
    /// Notices peers sent this engine, named by the sender's address-vector
    /// entry as the provider reported it (`progress::notices`).
    pub(crate) notices: Arc<NoticeBoard<u64>>,
    /// The number this engine's own notices carry.
    pub(crate) notice_sender: NoticeSender,
}

/// The backend front of this engine: the kit's.
pub(crate) type OfiFront = Front<PeerChange>;

/// How long a shutdown waits for the thread beyond its teardown timeout.
const JOIN_GRACE: Duration = Duration::from_secs(60);

/// What a started thread reports.
#[derive(Debug)]
pub(crate) struct StartInfo {
    pub(crate) address: Bytes,
    pub(crate) provider: String,
    pub(crate) resets_stalled_connections: bool,
}

/// A running libfabric progress thread and the handle to it.
///
/// Dropping the engine shuts it down.
#[derive(Debug)]
pub struct OfiEngine {
    front: OfiFront,
    signals: Arc<Signals>,
    thread: ProgressThread,
    address: Bytes,
    provider: String,
    teardown_timeout: Duration,
    resets_stalled_connections: bool,
}

impl OfiEngine {
    /// Starts the progress thread, which opens the provider's fabric,
    /// domain, completion queue, address vector and endpoint. Blocks until
    /// the thread has started or failed. The first engine of a process
    /// raises its soft open-file limit to the hard one
    /// ([`raise_open_file_limit`](rdmareg_engine::open_files::raise_open_file_limit)).
    ///
    /// # Errors
    /// [`RdmaError::Backend`] for an invalid configuration or a provider
    /// that cannot be opened (the message carries libfabric's error text).
    pub fn start(config: OfiConfig) -> Result<OfiEngine, RdmaError> {
        config
            .validate()
            .map_err(|e| RdmaError::backend(format!("ofi: invalid engine configuration: {e}")))?;
        let lifecycle = Lifecycle::starting("ofi")?;
        let notice_sender = rdmareg_engine::notices::draw_sender()?;
        let signals = Arc::new(Signals {
            lifecycle: Arc::clone(&lifecycle),
            unconfirmed_requests: AtomicU64::new(0),
            notices: NoticeBoard::new(config.notice_limits),
            notice_sender,
        });
        let (submitter, lanes) = rdmareg_engine::lanes::lanes(config.ring_capacity, lifecycle);
        let teardown_timeout = config.teardown_timeout;
        let thread_signals = Arc::clone(&signals);
        let (thread, info) = ProgressThread::start("rdmareg-ofi", move |ready| {
            progress::run(config, thread_signals, lanes, ready);
        })?;
        Ok(OfiEngine {
            front: Front::new(Arc::new(submitter), Arc::new(NoCallerCopies))
                .with_notices(Arc::clone(&signals.notices) as _, notice_sender),
            signals,
            thread,
            address: info.address,
            provider: info.provider,
            teardown_timeout,
            resets_stalled_connections: info.resets_stalled_connections,
        })
    }

    /// This engine's fabric address, for peers to [`add_peer`](Self::add_peer).
    pub fn fabric_address(&self) -> Bytes {
        self.address.clone()
    }

    /// The provider opened (`tcp;ofi_rxm`, `shm`).
    pub fn provider(&self) -> &str {
        &self.provider
    }

    /// Records how to reach `peer`: its fabric address goes into the
    /// address vector (validated first). Replaces an earlier address.
    ///
    /// # Errors
    /// [`RdmaError::InvalidWorkerAddress`] for malformed address bytes,
    /// [`RdmaError::Backend`] when the provider refuses the address,
    /// [`RdmaError::ShuttingDown`] after teardown began.
    pub fn add_peer(&self, peer: PeerId, address: Bytes) -> Result<(), RdmaError> {
        let (reply, result) = oneshot::channel();
        self.front
            .submitter()
            .send_control(Command::Driver(PeerChange::Add {
                peer,
                address,
                reply,
            }))?;
        futures::executor::block_on(result).unwrap_or(Err(RdmaError::ShuttingDown))
    }

    /// Forgets `peer`; its address-vector entry is removed once no GET uses
    /// it.
    ///
    /// # Errors
    /// [`RdmaError::ShuttingDown`] after teardown began.
    pub fn remove_peer(&self, peer: PeerId) -> Result<(), RdmaError> {
        self.front
            .submitter()
            .send_control(Command::Driver(PeerChange::Remove { peer }))
    }

    /// A backend over this engine.
    pub fn backend(&self) -> OfiBackend {
        Backend::new(self.front.clone())
    }

    /// The thread's own count of registrations it holds.
    pub fn live_registrations(&self) -> usize {
        self.signals.lifecycle.live_registrations()
    }

    /// Whether a read that an owner's stalled reply holds past its deadline
    /// ends with that owner's connection: true only over `tcp;ofi_rxm` in a
    /// process whose environment had `FI_AV_REMOVE_CLEANUP` set to a true
    /// value (`1`, `true`, `yes`, `on`) before libfabric first initialised,
    /// the only way libfabric 1.17 closes one connection. Where false, such
    /// a read completes only once the owner moves again, the consumer's
    /// engine shuts down, or the connection fails on its own (see
    /// `docs/ofi.md`, "Hostile peers"). The `rdmareg` binary sets the
    /// variable at start when it is unset.
    pub fn resets_stalled_connections(&self) -> bool {
        self.resets_stalled_connections
    }

    /// Read requests this engine, as an owner, did not serve because it
    /// could not confirm that their reply address is the endpoint that sent
    /// them: the provider named another sender (refused to that sender), or
    /// none (the reply address is told to ask again).
    /// Where the provider does not report senders (`FI_SOURCE`) nothing is
    /// checked and this stays 0.
    pub fn unconfirmed_requests(&self) -> u64 {
        self.signals.unconfirmed_requests.load(Ordering::Relaxed)
    }

    /// Tears the engine down and waits for the thread: GETs in flight get
    /// up to the teardown timeout, then the endpoint is closed under them;
    /// every region is deregistered; every outstanding call completes.
    ///
    /// # Cancel safety
    /// Dropping the future does not stop the teardown.
    pub async fn shutdown(&self) {
        let (reply, done) = oneshot::channel();
        if self.front.submitter().send_shutdown(reply) {
            let _ = done.await;
        }
        self.join();
    }

    /// [`shutdown`](Self::shutdown) from synchronous code.
    pub fn shutdown_blocking(&self) {
        futures::executor::block_on(self.shutdown());
    }

    /// Joins the thread. The thread ends its teardown within the teardown
    /// timeout plus the provider's own close; a thread wedged in the
    /// provider is left detached after a minute more, and logged.
    fn join(&self) {
        self.thread
            .join_by(Instant::now() + self.teardown_timeout + JOIN_GRACE);
    }

    /// The configured teardown timeout.
    pub fn teardown_timeout(&self) -> Duration {
        self.teardown_timeout
    }
}

impl Drop for OfiEngine {
    fn drop(&mut self) {
        if !self.thread.is_joined() {
            self.shutdown_blocking();
        }
    }
}
