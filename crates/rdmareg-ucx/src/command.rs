//! What submitters ask of the progress thread, and the shared signals both
//! sides read.
//!
//! Commands travel on two lanes into the one thread. The bounded **ring**
//! carries everything in submission order and gives the hot path
//! backpressure. The unbounded **control lane** carries only what must never
//! wait or be refused for lack of room: shutdown, the compensating unmap of a
//! dropped map, and commands that found the ring full but must proceed (an
//! unmap whose future was dropped while waiting for room, peer changes).
//!
//! Before handling a ring command the thread drains the control lane, so a
//! control message pushed before a ring command (in happens-before order) is
//! always handled first. The other direction is only reached when the ring is
//! full, and is harmless: a compensating unmap that overtakes its map finds
//! nothing, and the map then sees its caller gone and is skipped.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize};

use futures::channel::oneshot;
use rdmareg_core::{BackendGet, BackendRegion, PeerId, RdmaError};

use crate::doorbell::Doorbell;
use crate::engine_address::EngineAddress;

/// Where the thread answers one command.
pub(crate) type Reply<T> = oneshot::Sender<Result<T, RdmaError>>;

/// One request to the progress thread.
#[derive(Debug)]
pub(crate) enum Command {
    /// Register `[ptr, ptr + len)` under the caller-minted `id`.
    Map {
        id: u64,
        ptr: usize,
        len: usize,
        reply: Reply<BackendRegion>,
    },
    /// Deregister `id` (idempotent). `reply` is `None` for a compensating
    /// unmap pushed by a dropped map.
    Unmap { id: u64, reply: Option<Reply<()>> },
    /// Read remote memory into a mapped region.
    Get {
        request: BackendGet,
        reply: Reply<()>,
    },
    /// Read several ranges; one answer per request, in order.
    GetBatch {
        requests: Vec<BackendGet>,
        reply: oneshot::Sender<Vec<Result<(), RdmaError>>>,
    },
    /// Read several ranges of a list posted again and again (shared):
    /// answered as `GetBatch` of the same requests.
    GetSharedBatch {
        requests: Arc<[BackendGet]>,
        reply: oneshot::Sender<Vec<Result<(), RdmaError>>>,
    },
    /// Record (or replace) how to reach `peer`: its addresses, validated
    /// and padded for `ucp_ep_create`.
    AddPeer {
        peer: PeerId,
        address: EngineAddress,
    },
    /// Forget `peer`, closing its endpoint.
    RemovePeer { peer: PeerId },
    /// Tear down; `reply` fires once the thread has released everything.
    Shutdown { reply: oneshot::Sender<()> },
}

impl Command {
    /// Answer the command with [`RdmaError::ShuttingDown`] without doing it.
    pub(crate) fn refuse(self) {
        match self {
            Command::Map { reply, .. } => {
                let _ = reply.send(Err(RdmaError::ShuttingDown));
            }
            Command::Get { reply, .. } => {
                let _ = reply.send(Err(RdmaError::ShuttingDown));
            }
            Command::GetBatch { requests, reply } => {
                let _ = reply.send(vec![Err(RdmaError::ShuttingDown); requests.len()]);
            }
            Command::GetSharedBatch { requests, reply } => {
                let _ = reply.send(vec![Err(RdmaError::ShuttingDown); requests.len()]);
            }
            Command::Unmap {
                reply: Some(reply), ..
            } => {
                let _ = reply.send(Err(RdmaError::ShuttingDown));
            }
            Command::Unmap { reply: None, .. }
            | Command::AddPeer { .. }
            | Command::RemovePeer { .. }
            | Command::Shutdown { .. } => {}
        }
    }
}

/// State the progress thread and the submitters share. Holds no UCX handle.
#[derive(Debug)]
pub(crate) struct Signals {
    /// Wakes the parked loop.
    pub(crate) doorbell: Doorbell,
    /// Set when teardown begins: submitters refuse new work from then on.
    pub(crate) closed: AtomicBool,
    /// Registrations the thread holds: incremented after a successful
    /// `ucp_mem_map`, decremented after a successful `ucp_mem_unmap`.
    pub(crate) live_registrations: AtomicUsize,
    /// Replies the thread serves whose sends UCX has not finished, over
    /// every consumer connection (kept by the request handler).
    pub(crate) served_replies_in_flight: Arc<AtomicUsize>,
    /// Set once teardown has finished; then `unmap` is answered here (see
    /// [`Signals::unmap_after_teardown`]) instead of by the thread.
    pub(crate) torn_down: std::sync::OnceLock<TornDown>,
    /// What same-host reads copied on the caller's thread need (see
    /// `caller_copies`).
    pub(crate) caller_copies: crate::caller_copies::CallerCopies,
    /// Posts of shared lists the thread answered by their copy plan (see
    /// `progress::copy_plans`).
    pub(crate) lists_copied_by_plan: std::sync::atomic::AtomicU64,
    /// Owner-served reads asked in pieces (see `progress::pieces`).
    pub(crate) reads_asked_in_pieces: std::sync::atomic::AtomicU64,
}

/// What teardown left behind, for the unmaps that arrive after it.
#[derive(Debug, Default)]
pub(crate) struct TornDown {
    /// Regions whose `ucp_mem_unmap` failed at teardown: still registered as
    /// far as anyone can tell.
    pub(crate) still_registered: Vec<u64>,
}

impl Signals {
    /// The answer to an unmap of `id` once teardown has finished: `Ok(())`
    /// for every id but those teardown could not unmap (contract point 2:
    /// an id that names nothing answers `Ok`), which stay *unknown*
    /// ([`RdmaError::ShuttingDown`](rdmareg_core::RdmaError::ShuttingDown)).
    /// `None` while the thread still runs.
    pub(crate) fn unmap_after_teardown(
        &self,
        id: u64,
    ) -> Option<Result<(), rdmareg_core::RdmaError>> {
        let torn_down = self.torn_down.get()?;
        Some(if torn_down.still_registered.contains(&id) {
            Err(rdmareg_core::RdmaError::ShuttingDown)
        } else {
            Ok(())
        })
    }
}
