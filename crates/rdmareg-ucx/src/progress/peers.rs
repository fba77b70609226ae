//! Peers and their endpoints on the progress thread.
//!
//! # Rules
//!
//! - `add_peer` only records the packed worker address; the first read that
//!   needs it creates the endpoint. **One endpoint per remote worker
//!   address**, shared by every peer id naming it, since services re-add
//!   the same owners under new ids.
//! - An endpoint is closed when no peer id names its address any more,
//!   forcibly whenever peer error handling is on (see `close_endpoint`).
//! - When UCX reports an endpoint failed, the engine force-closes it, fails
//!   the reads waiting for a reply on it and forgets it: **the next read
//!   creates a fresh endpoint** from the recorded address.
//! - A peer that vanishes while `ucp_ep_create` connects aborts UCX 1.22.0;
//!   the workspace's UCX patch (`patches/0002-…`) reports it through the
//!   error callback instead (`docs/safety.md`).
//! - A read that misses its deadline while UCX receives its bytes
//!   force-closes its endpoint, the only way to make UCX release the
//!   destination; one still waiting for its reply needs no close (`gets`).
//! - A read from a peer never added fails with [`RdmaError::NotConfigured`].
//! - Each endpoint's error-callback context is a heap record freed when its
//!   close completes, or after the worker is destroyed.
//! - A peer with a same-host direct-read address also gets a **direct
//!   endpoint** on the reader worker (`direct`), created by the first read
//!   with a same-host key; if UCX cannot reach it, reads go through the
//!   owner. It closes with its connection, and after a failure the next
//!   read tries again.
//! - Connections are keyed by the **whole** engine address, so a peer added
//!   first cannot pin an honest owner's serving address to a direct lane of
//!   its choosing.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use bytes::Bytes;
use rdmareg_core::{PeerId, RdmaError};
use ucx_sys::{ucp_ep_h, ucs_status_t};

use super::Engine;
use super::events::Events;
use super::ucp::EpHandle;
use crate::engine_address::EngineAddress;
use crate::owner_process::{OwnerProcess, SameHostSource};
use crate::status::{PtrStatus, status_text};

/// What the endpoint error callback needs: where to report, and which
/// endpoint it is.
#[derive(Debug)]
pub(crate) struct ErrorContext {
    events: *const Events,
    serial: u64,
}

/// A live endpoint to a remote worker.
#[derive(Debug)]
pub(crate) struct Endpoint {
    pub(crate) handle: EpHandle,
    /// Unique over the engine's life: names this endpoint in callbacks and
    /// in read ops, so nothing confuses it with its successor.
    pub(crate) serial: u64,
    pub(crate) error_context: *mut ErrorContext,
    /// Every lane of the endpoint is tcp, so a reply longer than one
    /// fragment and below the rendezvous threshold is copied twice on
    /// arrival: reads of such sizes go in chunks of one fragment
    /// (`chunks`).
    pub(crate) reads_in_chunks: bool,
    /// The endpoint's active messages go over tcp (its lanes are tcp, and
    /// cma, which carries none), so an eager write longer than one
    /// fragment is copied twice at the owner: PUTs of such sizes go in
    /// chunks of one fragment (`chunks`).
    pub(crate) writes_in_chunks: bool,
}

/// Where a connection's direct-read lane stands.
#[derive(Debug, Default)]
pub(crate) enum DirectState {
    /// Not tried yet (or closed after a failure: try again).
    #[default]
    Untried,
    /// Open on the direct lane's reader worker.
    Open(Endpoint),
    /// UCX could not reach the peer's direct lane; read through the owner.
    Unreachable,
}

/// The peer ids naming one remote worker address, and the endpoints to it.
#[derive(Debug, Default)]
pub(crate) struct Connection {
    endpoint: Option<Endpoint>,
    peer_ids: usize,
    /// The peer's direct-read worker address, padded, if it has that lane.
    pub(crate) direct_address: Option<Bytes>,
    pub(crate) direct: DirectState,
    /// Where the peer's same-host reads come from: its process, when it
    /// published one beside its direct lane in this engine's pid space
    /// (`owner_process`); nothing, once a copy found that process gone.
    pub(crate) process: SameHostSource,
}

#[derive(Debug)]
struct ClosingEndpoint {
    request: *mut c_void,
    error_context: *mut ErrorContext,
}

/// Peers by id, connections by address, plus endpoints whose close is
/// still in progress.
#[derive(Debug, Default)]
pub(crate) struct PeerTable {
    peers: HashMap<PeerId, EngineAddress>,
    connections: HashMap<EngineAddress, Connection>,
    next_serial: u64,
    closing: Vec<ClosingEndpoint>,
    /// Direct endpoints (on the reader worker) whose close is in progress.
    closing_direct: Vec<ClosingEndpoint>,
    /// Contexts that may still be called back until the worker is gone.
    parked_contexts: Vec<*mut ErrorContext>,
}

/// Why an endpoint is being closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CloseCause {
    /// UCX reported the connection failed.
    Failed,
    /// This engine no longer needs it, or gives up on a receive on it.
    Local,
    /// Teardown: whatever still runs on it is cancelled.
    Teardown,
}

impl PeerTable {
    /// Whether endpoint closes are still in progress.
    pub(crate) fn closing_count(&self) -> usize {
        self.closing.len() + self.closing_direct.len()
    }

    /// The current endpoint serial of `peer`, if it has a live endpoint.
    pub(crate) fn current_serial(&self, peer: PeerId) -> Option<u64> {
        let address = self.peers.get(&peer)?;
        self.connections
            .get(address)?
            .endpoint
            .as_ref()
            .map(|e| e.serial)
    }

    /// Forgets that `peer` names `address`; returns the connection to close
    /// if no peer id names it any more.
    fn detach(&mut self, address: &EngineAddress) -> Option<Connection> {
        let connection = self.connections.get_mut(address)?;
        connection.peer_ids = connection.peer_ids.saturating_sub(1);
        if connection.peer_ids > 0 {
            return None;
        }
        self.connections.remove(address)
    }

    /// The endpoint numbered `serial`, taken out of its connection.
    fn take_endpoint(&mut self, serial: u64) -> Option<(EngineAddress, Endpoint)> {
        let (address, connection) = self
            .connections
            .iter_mut()
            .find(|(_, c)| c.endpoint.as_ref().is_some_and(|e| e.serial == serial))?;
        Some((address.clone(), connection.endpoint.take()?))
    }

    /// The direct endpoint numbered `serial`, taken out of its connection
    /// (which will try the lane again on its next read).
    fn take_direct_endpoint(&mut self, serial: u64) -> Option<Endpoint> {
        let connection = self.connections.values_mut().find(
            |c| matches!(&c.direct, DirectState::Open(endpoint) if endpoint.serial == serial),
        )?;
        match std::mem::take(&mut connection.direct) {
            DirectState::Open(endpoint) => Some(endpoint),
            _ => None,
        }
    }

    /// The connection `peer` names, if it was added.
    pub(crate) fn connection_mut(&mut self, peer: PeerId) -> Option<&mut Connection> {
        let address = self.peers.get(&peer)?;
        self.connections.get_mut(address)
    }

    /// Whether reads from `peer` go in chunks of one tcp fragment (see
    /// `Endpoint::reads_in_chunks`); false while it has no served endpoint.
    pub(crate) fn reads_in_chunks(&self, peer: PeerId) -> bool {
        self.served_endpoint(peer)
            .is_some_and(|endpoint| endpoint.reads_in_chunks)
    }

    /// Whether PUTs to `peer` go in chunks of one tcp fragment (see
    /// `Endpoint::writes_in_chunks`); false while it has no served
    /// endpoint.
    pub(crate) fn writes_in_chunks(&self, peer: PeerId) -> bool {
        self.served_endpoint(peer)
            .is_some_and(|endpoint| endpoint.writes_in_chunks)
    }

    fn served_endpoint(&self, peer: PeerId) -> Option<&Endpoint> {
        let address = self.peers.get(&peer)?;
        self.connections
            .get(address)
            .and_then(|connection| connection.endpoint.as_ref())
    }

    /// A fresh endpoint serial.
    pub(crate) fn next_serial(&mut self) -> u64 {
        self.next_serial += 1;
        self.next_serial
    }

    /// Keeps `context` until the workers are gone: UCX may still call back
    /// with it.
    pub(crate) fn park_error_context(&mut self, context: *mut ErrorContext) {
        self.parked_contexts.push(context);
    }

    /// Direct endpoints whose close is still in progress.
    pub(crate) fn push_closing_direct(
        &mut self,
        request: *mut c_void,
        error_context: *mut ErrorContext,
    ) {
        self.closing_direct.push(ClosingEndpoint {
            request,
            error_context,
        });
    }
}

impl Drop for PeerTable {
    fn drop(&mut self) {
        // Runs after the worker is destroyed (field order in `Engine`), so
        // no callback can reach these contexts any more.
        let mut live = Vec::new();
        for connection in self.connections.values_mut() {
            live.extend(connection.endpoint.take().map(|e| e.error_context));
            if let DirectState::Open(e) = std::mem::take(&mut connection.direct) {
                live.push(e.error_context);
            }
        }
        let closing = self
            .closing
            .drain(..)
            .chain(self.closing_direct.drain(..))
            .map(|c| c.error_context);
        let all: Vec<_> = live
            .into_iter()
            .chain(closing)
            .chain(self.parked_contexts.drain(..))
            .collect();
        for context in all {
            free_error_context(context);
        }
    }
}

pub(crate) fn free_error_context(context: *mut ErrorContext) {
    if !context.is_null() {
        // SAFETY: every non-null context was made by Box::into_raw in
        // `create_endpoint` and is freed once: it leaves the table when freed.
        drop(unsafe { Box::from_raw(context) });
    }
}

/// A heap error context for endpoint `serial`, for [`on_endpoint_error`].
pub(crate) fn new_error_context(events: *const Events, serial: u64) -> *mut ErrorContext {
    Box::into_raw(Box::new(ErrorContext { events, serial }))
}

/// UCX's endpoint error callback: records the failure for the loop.
pub(crate) unsafe extern "C" fn on_endpoint_error(
    arg: *mut c_void,
    _ep: ucp_ep_h,
    status: ucs_status_t,
) {
    // SAFETY: `arg` is the ErrorContext registered with this endpoint; it is
    // freed only after the endpoint's close completed or the worker is gone,
    // after which UCX no longer calls back for it.
    let context = unsafe { &*arg.cast::<ErrorContext>() };
    // SAFETY: the events record outlives the worker (see `Engine`).
    let events = unsafe { &*context.events };
    events
        .failed_endpoints
        .borrow_mut()
        .push((context.serial, status));
}

impl Engine {
    /// `Command::AddPeer`.
    pub(super) fn add_peer(&mut self, peer: PeerId, address: EngineAddress) {
        self.signals.caller_copies.withdraw_source(peer);
        let ours = self.process;
        if let Some(existing) = self.peers.peers.get(&peer) {
            if *existing == address {
                return;
            }
            let old = existing.clone();
            if let Some(connection) = self.peers.detach(&old) {
                tracing::debug!(%peer, "peer re-added with a new address; closing the endpoint nobody else uses");
                let reason = RdmaError::backend(format!(
                    "ucx: {peer} was re-added with a new address while the read waited"
                ));
                self.close_connection(connection, &reason);
            }
        }
        let connection = self
            .peers
            .connections
            .entry(address.clone())
            .or_insert_with(|| Connection {
                direct_address: address.direct.clone(),
                process: address
                    .process
                    .filter(|_| address.direct.is_some())
                    .filter(|theirs| ours.is_some_and(|ours| ours.shares_pid_space_with(theirs)))
                    .map(|theirs| {
                        let owner =
                            OwnerProcess::with_release_table(&theirs, address.release_table);
                        SameHostSource::Copy(Arc::new(owner))
                    })
                    .unwrap_or_default(),
                ..Connection::default()
            });
        connection.peer_ids += 1;
        self.peers.peers.insert(peer, address);
    }

    /// Closes both endpoints of a connection nobody names any more.
    fn close_connection(&mut self, connection: Connection, reason: &RdmaError) {
        if let Some(endpoint) = connection.endpoint {
            self.close_endpoint(endpoint, CloseCause::Local, reason);
        }
        if let DirectState::Open(endpoint) = connection.direct {
            self.close_direct_endpoint(endpoint);
        }
    }

    /// `Command::RemovePeer`.
    pub(super) fn remove_peer(&mut self, peer: PeerId) {
        self.signals.caller_copies.withdraw_source(peer);
        let Some(address) = self.peers.peers.remove(&peer) else {
            return;
        };
        if let Some(connection) = self.peers.detach(&address) {
            let reason =
                RdmaError::backend(format!("ucx: {peer} was removed while the transfer waited"));
            self.close_connection(connection, &reason);
        }
    }

    /// The live endpoint to `peer`'s address, created now if it has none.
    pub(super) fn endpoint_for(&mut self, peer: PeerId) -> Result<(EpHandle, u64), RdmaError> {
        let error_handling = self.settings.peer_error_handling;
        let events: *const Events = &*self.events;
        let table = &mut self.peers;
        let Some(address) = table.peers.get(&peer) else {
            return Err(RdmaError::NotConfigured);
        };
        let Some(connection) = table.connections.get_mut(address) else {
            return Err(RdmaError::NotConfigured);
        };
        if let Some(endpoint) = &connection.endpoint {
            return Ok((endpoint.handle, endpoint.serial));
        }
        table.next_serial += 1;
        let serial = table.next_serial;
        let error_context = if error_handling {
            new_error_context(events, serial)
        } else {
            std::ptr::null_mut()
        };
        let on_error = (!error_context.is_null())
            .then_some((on_endpoint_error as _, error_context.cast::<c_void>()));
        // SAFETY: the address was recorded by `add_peer` from the peer's
        // packed worker address (the engine's trust boundary, see the crate
        // docs); the error context lives until the close completes or the
        // worker is destroyed.
        match unsafe {
            self.worker
                .create_endpoint(&address.serving, on_error, true)
        } {
            Ok(handle) => {
                let transports = handle.transport_names().unwrap_or_default();
                let chunks = self.settings.fragment_chunks && !transports.is_empty();
                let reads_in_chunks = chunks && transports.iter().all(|name| name == "tcp");
                let writes_in_chunks = chunks
                    && transports.iter().any(|name| name == "tcp")
                    && transports.iter().all(|name| name == "tcp" || name == "cma");
                tracing::debug!(
                    %peer, serial, ?transports, reads_in_chunks, writes_in_chunks, "endpoint created"
                );
                connection.endpoint = Some(Endpoint {
                    handle,
                    serial,
                    error_context,
                    reads_in_chunks,
                    writes_in_chunks,
                });
                Ok((handle, serial))
            }
            Err(err) => {
                free_error_context(error_context);
                Err(match err {
                    RdmaError::Backend(text) => {
                        RdmaError::backend(format!("{} (reaching {peer})", text.message()))
                    }
                    other => other,
                })
            }
        }
    }

    /// UCX reported endpoint `serial` failed.
    pub(super) fn endpoint_failed(&mut self, serial: u64, status: ucs_status_t) {
        if let Some(endpoint) = self.peers.take_direct_endpoint(serial) {
            self.signals.caller_copies.withdraw_all_sources();
            tracing::debug!(serial, status = %status_text(status), "direct-read endpoint failed; closing it, the next read tries the lane again");
            self.close_direct_endpoint(endpoint);
            return;
        }
        let Some((_, endpoint)) = self.peers.take_endpoint(serial) else {
            return; // Already closed or replaced.
        };
        tracing::warn!(serial, status = %status_text(status), "endpoint failed; closing it, the next read reconnects");
        let reason = RdmaError::backend(format!(
            "ucx: the connection failed: {}",
            status_text(status)
        ));
        self.close_endpoint(endpoint, CloseCause::Failed, &reason);
    }

    /// A read on endpoint `serial` to `peer` missed its deadline while UCX
    /// was receiving its bytes.
    pub(super) fn declare_unresponsive(&mut self, peer: PeerId, serial: u64) {
        if !self.settings.peer_error_handling {
            // Without peer error handling a forced close is undefined
            // behaviour in UCX; the receive keeps its region until it ends.
            return;
        }
        if self.peers.current_serial(peer) != Some(serial) {
            return;
        }
        if let Some((_, endpoint)) = self.peers.take_endpoint(serial) {
            tracing::warn!(%peer, serial, "read deadline passed during its receive; force-closing the endpoint so UCX releases the destination");
            let reason = RdmaError::backend(format!(
                "ucx: the endpoint to {peer} was force-closed after another read's deadline"
            ));
            self.close_endpoint(endpoint, CloseCause::Local, &reason);
        }
    }

    /// Starts closing `endpoint`, failing the reads still waiting for a
    /// reply on it with `reason`.
    ///
    /// With peer error handling the close is always forced: UCX 1.22 never
    /// destroys a gracefully closed endpoint whose peer connected back, so
    /// each peer churned to one address would keep two descriptors. The
    /// owner's UCX learns of the close at its next keepalive round and
    /// closes its side, so both ends are gone within two seconds
    /// (`docs/operations.md`). Without peer error handling UCX refuses a
    /// forced close, and the graceful one keeps the endpoint until the
    /// worker is destroyed.
    pub(super) fn close_endpoint(
        &mut self,
        endpoint: Endpoint,
        cause: CloseCause,
        reason: &RdmaError,
    ) {
        self.fail_awaiting_on_endpoint(endpoint.handle.raw(), reason);
        let force = self.settings.peer_error_handling;
        tracing::debug!(
            serial = endpoint.serial,
            ?cause,
            receiving = self.ops.receiving_on_endpoint(endpoint.serial),
            force,
            "closing endpoint"
        );
        // SAFETY: the endpoint was created on this worker and left the peer
        // table before this call, so it is closed exactly once.
        match unsafe { self.worker.close_endpoint(endpoint.handle, force) } {
            PtrStatus::Done => free_error_context(endpoint.error_context),
            PtrStatus::Pending(request) => self.peers.closing.push(ClosingEndpoint {
                request,
                error_context: endpoint.error_context,
            }),
            PtrStatus::Failed(status) => {
                tracing::debug!(serial = endpoint.serial, status = %status_text(status), "endpoint close reported an error");
                self.peers.parked_contexts.push(endpoint.error_context);
            }
        }
        self.drain_events();
    }

    /// Finishes endpoint closes whose requests completed.
    pub(super) fn poll_closing(&mut self) {
        let worker = &self.worker;
        let finished = |closing: &ClosingEndpoint| {
            // SAFETY: the request came from ucp_ep_close_nbx on this
            // engine's serving or reader worker and is freed only below,
            // once, when it leaves its list.
            if unsafe { worker.request_in_progress(closing.request) } {
                return false;
            }
            // SAFETY: as above; completed, so it is returned to UCX once
            // (`ucp_request_free` does not depend on the worker).
            unsafe { worker.free_request(closing.request) };
            free_error_context(closing.error_context);
            true
        };
        self.peers.closing.retain(|c| !finished(c));
        self.peers.closing_direct.retain(|c| !finished(c));
    }

    /// Starts closing every endpoint (teardown).
    pub(super) fn close_all_endpoints(&mut self) {
        let mut endpoints = Vec::new();
        let mut direct = Vec::new();
        for connection in self.peers.connections.values_mut() {
            endpoints.extend(connection.endpoint.take());
            if let DirectState::Open(endpoint) = std::mem::take(&mut connection.direct) {
                direct.push(endpoint);
            }
        }
        for endpoint in endpoints {
            self.close_endpoint(endpoint, CloseCause::Teardown, &RdmaError::ShuttingDown);
        }
        for endpoint in direct {
            self.close_direct_endpoint(endpoint);
        }
    }
}
