//! Peers and their endpoints on the progress thread.
//!
//! # Rules
//!
//! - `add_peer` only records the packed worker address; the endpoint is
//!   created by the first GET that needs it. Re-adding a peer with a new
//!   address closes the old endpoint.
//! - Endpoints are created with peer error handling unless the transport is
//!   the no-error-handling shared-memory option. When UCX reports an endpoint
//!   failed, the engine closes it (forcibly: receives running on it complete
//!   with an error), fails the reads still waiting for a reply on it, and
//!   forgets it: **the next read from that peer creates a fresh endpoint**
//!   from the recorded address. A peer that is really gone then fails that
//!   read too, promptly.
//! - A read that misses its deadline while UCX is receiving its bytes
//!   declares its endpoint unresponsive: UCX cannot withdraw a single
//!   receive, so the engine force-closes the endpoint, which makes UCX end
//!   every request on it — and with them release the destinations. A read
//!   that misses its deadline while still waiting for the reply needs no
//!   close (see `gets`), so a stopped owner costs timeouts, not reconnects.
//! - A read from a peer never added answers [`RdmaError::NotConfigured`].
//! - Each endpoint's error-callback context is a small heap record freed when
//!   its close completes, or after the worker is destroyed.

use std::collections::HashMap;
use std::ffi::c_void;

use bytes::Bytes;
use rdmareg_core::{PeerId, RdmaError};
use ucx_sys::{ucp_ep_h, ucs_status_t};

use super::Engine;
use super::events::Events;
use super::ucp::EpHandle;
use crate::status::{PtrStatus, status_text};

/// What the endpoint error callback needs: where to report, and which
/// endpoint it is.
#[derive(Debug)]
pub(crate) struct ErrorContext {
    events: *const Events,
    serial: u64,
}

/// A live endpoint to a peer.
#[derive(Debug)]
pub(crate) struct Endpoint {
    pub(crate) handle: EpHandle,
    /// Unique over the engine's life: names this endpoint in callbacks and
    /// in the remote-key cache, so nothing confuses it with its successor.
    pub(crate) serial: u64,
    error_context: *mut ErrorContext,
}

#[derive(Debug)]
pub(crate) struct Peer {
    address: Bytes,
    endpoint: Option<Endpoint>,
}

#[derive(Debug)]
struct ClosingEndpoint {
    request: *mut c_void,
    error_context: *mut ErrorContext,
}

/// Peers by id, plus endpoints whose close is still in progress.
#[derive(Debug, Default)]
pub(crate) struct PeerTable {
    peers: HashMap<PeerId, Peer>,
    next_serial: u64,
    closing: Vec<ClosingEndpoint>,
    /// Contexts that may still be called back until the worker is gone.
    parked_contexts: Vec<*mut ErrorContext>,
}

impl PeerTable {
    /// Whether endpoint closes are still in progress.
    pub(crate) fn closing_count(&self) -> usize {
        self.closing.len()
    }

    /// The current endpoint serial of `peer`, if it has a live endpoint.
    pub(crate) fn current_serial(&self, peer: PeerId) -> Option<u64> {
        self.peers.get(&peer)?.endpoint.as_ref().map(|e| e.serial)
    }
}

impl Drop for PeerTable {
    fn drop(&mut self) {
        // Runs after the worker is destroyed (field order in `Engine`), so
        // no callback can reach these contexts any more.
        let live = self
            .peers
            .values_mut()
            .filter_map(|p| p.endpoint.take())
            .map(|e| e.error_context);
        let closing = self.closing.drain(..).map(|c| c.error_context);
        let all: Vec<_> = live
            .chain(closing)
            .chain(self.parked_contexts.drain(..))
            .collect();
        for context in all {
            free_error_context(context);
        }
    }
}

fn free_error_context(context: *mut ErrorContext) {
    if !context.is_null() {
        // SAFETY: every non-null context was made by Box::into_raw in
        // `create_endpoint` and is freed once: it leaves the table when freed.
        drop(unsafe { Box::from_raw(context) });
    }
}

/// UCX's endpoint error callback: records the failure for the loop.
unsafe extern "C" fn on_endpoint_error(arg: *mut c_void, _ep: ucp_ep_h, status: ucs_status_t) {
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
    pub(super) fn add_peer(&mut self, peer: PeerId, address: Bytes) {
        if let Some(existing) = self.peers.peers.get_mut(&peer) {
            if existing.address == address {
                return;
            }
            existing.address = address;
            if let Some(endpoint) = existing.endpoint.take() {
                tracing::debug!(%peer, "peer re-added with a new address; closing its endpoint");
                let reason = RdmaError::Backend(format!(
                    "ucx: {peer} was re-added with a new address while the read waited"
                ));
                self.close_endpoint(endpoint, &reason);
            }
            return;
        }
        self.peers.peers.insert(
            peer,
            Peer {
                address,
                endpoint: None,
            },
        );
    }

    /// `Command::RemovePeer`.
    pub(super) fn remove_peer(&mut self, peer: PeerId) {
        if let Some(endpoint) = self
            .peers
            .peers
            .remove(&peer)
            .and_then(|mut p| p.endpoint.take())
        {
            let reason =
                RdmaError::Backend(format!("ucx: {peer} was removed while the read waited"));
            self.close_endpoint(endpoint, &reason);
        }
    }

    /// The live endpoint to `peer`, created now if it has none.
    pub(super) fn endpoint_for(&mut self, peer: PeerId) -> Result<(EpHandle, u64), RdmaError> {
        let error_handling = self.settings.peer_error_handling;
        let events: *const Events = &*self.events;
        let table = &mut self.peers;
        let Some(entry) = table.peers.get_mut(&peer) else {
            return Err(RdmaError::NotConfigured);
        };
        if let Some(endpoint) = &entry.endpoint {
            return Ok((endpoint.handle, endpoint.serial));
        }
        table.next_serial += 1;
        let serial = table.next_serial;
        let error_context = if error_handling {
            Box::into_raw(Box::new(ErrorContext { events, serial }))
        } else {
            std::ptr::null_mut()
        };
        let on_error = (!error_context.is_null())
            .then_some((on_endpoint_error as _, error_context.cast::<c_void>()));
        // SAFETY: the address was recorded by `add_peer` from the peer's
        // packed worker address (the engine's trust boundary, see the crate
        // docs); the error context lives until the close completes or the
        // worker is destroyed.
        match unsafe { self.worker.create_endpoint(&entry.address, on_error) } {
            Ok(handle) => {
                tracing::debug!(%peer, serial, "endpoint created");
                entry.endpoint = Some(Endpoint {
                    handle,
                    serial,
                    error_context,
                });
                Ok((handle, serial))
            }
            Err(err) => {
                free_error_context(error_context);
                Err(match err {
                    RdmaError::Backend(text) => {
                        RdmaError::Backend(format!("{text} (reaching {peer})"))
                    }
                    other => other,
                })
            }
        }
    }

    /// UCX reported endpoint `serial` failed.
    pub(super) fn endpoint_failed(&mut self, serial: u64, status: ucs_status_t) {
        let found = self
            .peers
            .peers
            .iter_mut()
            .find(|(_, p)| p.endpoint.as_ref().is_some_and(|e| e.serial == serial));
        let Some((peer, entry)) = found else {
            return; // Already closed or replaced.
        };
        let peer = *peer;
        if let Some(endpoint) = entry.endpoint.take() {
            tracing::warn!(%peer, serial, status = %status_text(status), "endpoint failed; closing it, the next read reconnects");
            let reason = RdmaError::Backend(format!(
                "ucx: the connection to {peer} failed: {}",
                status_text(status)
            ));
            self.close_endpoint(endpoint, &reason);
        }
    }

    /// The GET on endpoint `serial` to `peer` missed its deadline.
    pub(super) fn declare_unresponsive(&mut self, peer: PeerId, serial: u64) {
        if !self.settings.peer_error_handling {
            // Without peer error handling a forced close is undefined
            // behaviour in UCX; the request keeps its region until it ends.
            return;
        }
        if self.peers.current_serial(peer) != Some(serial) {
            return;
        }
        let endpoint = self
            .peers
            .peers
            .get_mut(&peer)
            .and_then(|p| p.endpoint.take());
        if let Some(endpoint) = endpoint {
            tracing::warn!(%peer, serial, "read deadline passed during its receive; force-closing the endpoint so UCX releases the destination");
            let reason = RdmaError::Backend(format!(
                "ucx: the endpoint to {peer} was force-closed after another read's deadline"
            ));
            self.close_endpoint(endpoint, &reason);
        }
    }

    /// Starts closing `endpoint` (forcibly when peer error handling is on),
    /// answering the reads still waiting for a reply on it with `reason`.
    pub(super) fn close_endpoint(&mut self, endpoint: Endpoint, reason: &RdmaError) {
        self.fail_awaiting_on_endpoint(endpoint.serial, reason);
        let force = self.settings.peer_error_handling;
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
        self.peers.closing.retain(|closing| {
            // SAFETY: the request came from ucp_ep_close_nbx on this worker
            // and is freed only below, once, when it leaves the list.
            if unsafe { worker.request_in_progress(closing.request) } {
                return true;
            }
            // SAFETY: as above; completed, so it is returned to UCX once.
            unsafe { worker.free_request(closing.request) };
            free_error_context(closing.error_context);
            false
        });
    }

    /// Starts closing every endpoint (teardown).
    pub(super) fn close_all_endpoints(&mut self) {
        let endpoints: Vec<Endpoint> = self
            .peers
            .peers
            .values_mut()
            .filter_map(|p| p.endpoint.take())
            .collect();
        for endpoint in endpoints {
            self.close_endpoint(endpoint, &RdmaError::ShuttingDown);
        }
    }
}
