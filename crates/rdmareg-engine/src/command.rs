//! What submitters ask of the progress thread.
//!
//! The commands every backend's thread serves are the backend seam's
//! operations (map, unmap, GET, batches) plus shutdown; what a driver needs
//! beyond them (peer changes, whose addresses only the driver can parse)
//! travels as its own type `P` in [`Command::Driver`].

use std::sync::Arc;

use futures::channel::oneshot;
use rdmareg_core::{BackendGet, BackendRegion, RdmaError};

/// Where the thread sends one command's result.
pub type Reply<T> = oneshot::Sender<Result<T, RdmaError>>;

/// Where the thread sends a batch's results: one per request, in order.
pub type BatchReply = oneshot::Sender<Vec<Result<(), RdmaError>>>;

/// One request to the progress thread.
#[derive(Debug)]
pub enum Command<P> {
    /// Register `[ptr, ptr + len)` under the caller-minted `id`.
    Map {
        /// Minted by the submitter before pushing (see `front`).
        id: u64,
        /// First byte.
        ptr: usize,
        /// Length in bytes, at least 1.
        len: usize,
        /// Where the region is returned.
        reply: Reply<BackendRegion>,
    },
    /// Deregister `id` (idempotent).
    Unmap {
        /// The region.
        id: u64,
        /// `None` for the compensating unmap of a dropped map.
        reply: Option<Reply<()>>,
    },
    /// Read remote memory into a registered destination.
    Get {
        /// What to read, and where to.
        request: BackendGet,
        /// Completed only once the transport released the destination.
        reply: Reply<()>,
    },
    /// Read several ranges; one result per request, in order.
    GetBatch {
        /// The reads.
        requests: Vec<BackendGet>,
        /// Completed only once every entry's destination was released.
        reply: BatchReply,
    },
    /// A batch posted again and again (shared): completed as `GetBatch`; a
    /// driver may keep work it derived from the list for the next post of
    /// the same `Arc`.
    GetSharedBatch {
        /// The reads.
        requests: Arc<[BackendGet]>,
        /// As for `GetBatch`.
        reply: BatchReply,
    },
    /// A command only the driver understands.
    Driver(P),
    /// Tear down; `reply` fires once the thread has released everything.
    Shutdown {
        /// Fired last.
        reply: oneshot::Sender<()>,
    },
}

impl<P> Command<P> {
    /// Completes the command with [`RdmaError::ShuttingDown`] without doing
    /// it. A driver command and a shutdown are dropped: their senders see
    /// the channel closed.
    pub fn refuse(self) {
        match self {
            Command::Map { reply, .. } => {
                let _ = reply.send(Err(RdmaError::ShuttingDown));
            }
            Command::Get { reply, .. }
            | Command::Unmap {
                reply: Some(reply), ..
            } => {
                let _ = reply.send(Err(RdmaError::ShuttingDown));
            }
            Command::GetBatch { requests, reply } => {
                let _ = reply.send(vec![Err(RdmaError::ShuttingDown); requests.len()]);
            }
            Command::GetSharedBatch { requests, reply } => {
                let _ = reply.send(vec![Err(RdmaError::ShuttingDown); requests.len()]);
            }
            Command::Unmap { reply: None, .. } | Command::Driver(_) | Command::Shutdown { .. } => {}
        }
    }
}
