//! [`OfiEngine`]: the handle to one libfabric progress thread.
//!
//! # Call order
//!
//! 1. [`OfiEngine::start`] with an [`OfiConfig`].
//! 2. Hand [`OfiEngine::fabric_address`] to the peers that read from this
//!    engine, and record theirs with [`OfiEngine::add_peer`].
//! 3. Map, unmap and GET through [`OfiEngine::backend`].
//! 4. [`OfiEngine::shutdown`] (or drop the engine): every outstanding answer
//!    is given, everything is released, and
//!    [`OfiEngine::live_registrations`] reads zero.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;
use crossbeam_channel::{Sender, TrySendError};
use futures::channel::oneshot;
use rdmareg_core::{BackendGet, BackendRegion, PeerId, RdmaError};

use crate::backend::OfiBackend;
use crate::config::OfiConfig;
use crate::doorbell::Doorbell;
use crate::progress;

/// Where the thread answers one command.
pub(crate) type Reply<T> = oneshot::Sender<Result<T, RdmaError>>;

/// One request to the progress thread.
///
/// Commands travel on two lanes: the bounded **ring** carries everything in
/// submission order; the unbounded **control lane** carries what must never
/// wait for room (shutdown, peer changes, the compensating unmap of a dropped
/// map, an unmap that found the ring full). The thread drains the control
/// lane before each ring command.
#[derive(Debug)]
pub(crate) enum Command {
    Map {
        id: u64,
        ptr: usize,
        len: usize,
        reply: Reply<BackendRegion>,
    },
    Unmap {
        id: u64,
        reply: Option<Reply<()>>,
    },
    Get {
        request: BackendGet,
        reply: Reply<()>,
    },
    GetBatch {
        requests: Vec<BackendGet>,
        reply: oneshot::Sender<Vec<Result<(), RdmaError>>>,
    },
    AddPeer {
        peer: PeerId,
        address: Bytes,
        reply: Reply<()>,
    },
    RemovePeer {
        peer: PeerId,
    },
    Shutdown {
        reply: oneshot::Sender<()>,
    },
}

/// What the thread and the submitters both see.
#[derive(Debug)]
pub(crate) struct Signals {
    pub(crate) doorbell: Doorbell,
    pub(crate) closed: AtomicBool,
    pub(crate) live_registrations: AtomicUsize,
    /// Set once teardown ended: the region ids it could not deregister.
    /// Every other id names nothing any more, so an unmap of it is the
    /// idempotent unmap of a released id and answers `Ok`.
    pub(crate) still_registered_after_teardown: std::sync::OnceLock<std::collections::HashSet<u64>>,
    /// Read requests this engine, as an owner, did not serve because the
    /// provider named another sender than the reply address, or none.
    pub(crate) unconfirmed_requests: AtomicU64,
}

/// The submitter side of an engine, shared by the handle and every backend.
#[derive(Debug)]
pub(crate) struct EngineShared {
    ring: Sender<Command>,
    control: Sender<Command>,
    pub(crate) signals: Arc<Signals>,
    next_region_id: AtomicU64,
}

impl EngineShared {
    pub(crate) fn is_closed(&self) -> bool {
        self.signals.closed.load(Ordering::SeqCst)
    }

    /// A region id never used before by this engine; also the key the
    /// engine requests for it, so a stale key never names a later region.
    pub(crate) fn mint_region_id(&self) -> u64 {
        self.next_region_id.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn live_registrations(&self) -> usize {
        self.signals.live_registrations.load(Ordering::SeqCst)
    }

    /// Pushes onto the unbounded control lane; never waits.
    pub(crate) fn send_control(&self, command: Command) -> Result<(), RdmaError> {
        if self.is_closed() {
            return Err(RdmaError::ShuttingDown);
        }
        self.control
            .send(command)
            .map_err(|_| RdmaError::ShuttingDown)?;
        self.signals.doorbell.ring_if_parked();
        Ok(())
    }

    /// Pushes onto the bounded ring, yielding while it is full.
    pub(crate) fn submit(&self, command: Command, overflow: Overflow) -> Submit<'_> {
        Submit {
            shared: self,
            command: Some(command),
            overflow,
        }
    }
}

/// What a [`Submit`] dropped while the ring is full does with its command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Overflow {
    /// Nothing: never submitted (maps, GETs).
    Abandon,
    /// Onto the control lane: it must proceed once issued (unmap).
    ToControlLane,
}

/// Future of [`EngineShared::submit`].
#[derive(Debug)]
pub(crate) struct Submit<'a> {
    shared: &'a EngineShared,
    command: Option<Command>,
    overflow: Overflow,
}

impl Submit<'_> {
    /// One attempt: `None` while the ring is full.
    pub(crate) fn try_now(&mut self) -> Option<Result<(), RdmaError>> {
        let command = self.command.take()?;
        if self.shared.is_closed() {
            return Some(Err(RdmaError::ShuttingDown));
        }
        match self.shared.ring.try_send(command) {
            Ok(()) => {
                self.shared.signals.doorbell.ring_if_parked();
                Some(Ok(()))
            }
            Err(TrySendError::Full(command)) => {
                self.command = Some(command);
                self.shared.signals.doorbell.ring();
                None
            }
            Err(TrySendError::Disconnected(_)) => Some(Err(RdmaError::ShuttingDown)),
        }
    }
}

impl Future for Submit<'_> {
    type Output = Result<(), RdmaError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if this.command.is_none() {
            return Poll::Ready(Ok(()));
        }
        match this.try_now() {
            Some(result) => Poll::Ready(result),
            None => {
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        }
    }
}

impl Drop for Submit<'_> {
    fn drop(&mut self) {
        if let (Some(command), Overflow::ToControlLane) = (self.command.take(), self.overflow) {
            let _ = self.shared.send_control(command);
        }
    }
}

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
    shared: Arc<EngineShared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    address: Bytes,
    provider: String,
    teardown_timeout: Duration,
    resets_stalled_connections: bool,
}

impl OfiEngine {
    /// Starts the progress thread, which opens the provider's fabric,
    /// domain, completion queue, address vector and endpoint. Blocks until
    /// the thread has started or failed.
    ///
    /// # Errors
    /// [`RdmaError::Backend`] for an invalid configuration or a provider
    /// that cannot be opened (the message carries libfabric's error text).
    pub fn start(config: OfiConfig) -> Result<OfiEngine, RdmaError> {
        config
            .validate()
            .map_err(|e| RdmaError::Backend(format!("ofi: invalid engine configuration: {e}")))?;
        let doorbell = Doorbell::new()
            .map_err(|e| RdmaError::Backend(format!("ofi: creating the doorbell eventfd: {e}")))?;
        let signals = Arc::new(Signals {
            doorbell,
            closed: AtomicBool::new(false),
            live_registrations: AtomicUsize::new(0),
            still_registered_after_teardown: std::sync::OnceLock::new(),
            unconfirmed_requests: AtomicU64::new(0),
        });
        let (ring_tx, ring_rx) = crossbeam_channel::bounded(config.ring_capacity);
        let (control_tx, control_rx) = crossbeam_channel::unbounded();
        let (ready_tx, ready_rx) = crossbeam_channel::bounded(1);
        let teardown_timeout = config.teardown_timeout;
        let thread_signals = Arc::clone(&signals);
        let thread = std::thread::Builder::new()
            .name("rdmareg-ofi".into())
            .spawn(move || {
                progress::run(config, thread_signals, ring_rx, control_rx, ready_tx);
            })
            .map_err(|e| RdmaError::Backend(format!("ofi: spawning the progress thread: {e}")))?;
        let info = match ready_rx.recv() {
            Ok(Ok(info)) => info,
            Ok(Err(err)) => {
                let _ = thread.join();
                return Err(err);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(RdmaError::Backend(
                    "ofi: the progress thread exited during start".into(),
                ));
            }
        };
        Ok(OfiEngine {
            shared: Arc::new(EngineShared {
                ring: ring_tx,
                control: control_tx,
                signals,
                next_region_id: AtomicU64::new(1),
            }),
            thread: Mutex::new(Some(thread)),
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
        let (reply, answer) = oneshot::channel();
        self.shared.send_control(Command::AddPeer {
            peer,
            address,
            reply,
        })?;
        futures::executor::block_on(answer).unwrap_or(Err(RdmaError::ShuttingDown))
    }

    /// Forgets `peer`; its address-vector entry is removed once no GET uses
    /// it.
    ///
    /// # Errors
    /// [`RdmaError::ShuttingDown`] after teardown began.
    pub fn remove_peer(&self, peer: PeerId) -> Result<(), RdmaError> {
        self.shared.send_control(Command::RemovePeer { peer })
    }

    /// A backend over this engine.
    pub fn backend(&self) -> OfiBackend {
        OfiBackend::new(Arc::clone(&self.shared))
    }

    /// The thread's own count of registrations it holds.
    pub fn live_registrations(&self) -> usize {
        self.shared.live_registrations()
    }

    /// Whether a read that an owner's stalled reply holds past its deadline
    /// ends with that owner's connection: true only over `tcp;ofi_rxm` in a
    /// process whose environment had `FI_AV_REMOVE_CLEANUP` set to a true
    /// value (`1`, `true`, `yes`, `on`) before libfabric first initialised,
    /// the only way libfabric 1.17 closes one connection. Where false, such
    /// a read is answered only once the owner moves again, the consumer's
    /// engine shuts down, or the connection fails on its own (see
    /// `docs/ofi.md`, "Hostile peers"). The `rdmareg` binary sets the
    /// variable at start when it is unset.
    pub fn resets_stalled_connections(&self) -> bool {
        self.resets_stalled_connections
    }

    /// Read requests this engine, as an owner, answered without serving
    /// them because it could not confirm that their reply address is the
    /// endpoint that sent them: the provider named another sender (refused
    /// to that sender), or none (the reply address is asked to ask again).
    /// Where the provider does not report senders (`FI_SOURCE`) nothing is
    /// checked and this stays 0.
    pub fn unconfirmed_requests(&self) -> u64 {
        self.shared
            .signals
            .unconfirmed_requests
            .load(Ordering::Relaxed)
    }

    /// Tears the engine down and waits for the thread: GETs in flight get
    /// up to the teardown timeout, then the endpoint is closed under them;
    /// every region is deregistered; every answer is given.
    ///
    /// # Cancel safety
    /// Dropping the future does not stop the teardown.
    pub async fn shutdown(&self) {
        let (reply, answer) = oneshot::channel();
        if self
            .shared
            .control
            .send(Command::Shutdown { reply })
            .is_ok()
        {
            self.shared.signals.doorbell.ring();
            let _ = answer.await;
        }
        self.join();
    }

    /// [`shutdown`](Self::shutdown) from synchronous code.
    pub fn shutdown_blocking(&self) {
        futures::executor::block_on(self.shutdown());
    }

    fn join(&self) {
        let handle = self.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(handle) = handle {
            if handle.join().is_err() {
                tracing::error!("the ofi progress thread panicked");
            }
        }
    }

    /// The configured teardown timeout.
    pub fn teardown_timeout(&self) -> Duration {
        self.teardown_timeout
    }
}

impl Drop for OfiEngine {
    fn drop(&mut self) {
        let running = self.thread.lock().map(|t| t.is_some()).unwrap_or(false);
        if running {
            self.shutdown_blocking();
        }
    }
}
