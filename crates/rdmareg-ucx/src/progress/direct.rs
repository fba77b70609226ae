//! The same-host direct lane: cma reads (and writes, `direct_writes`)
//! between engines of one user.
//!
//! On one host the kernel can copy straight out of the owner's process
//! without waking it. UCX offers cma only to a context with RMA, which also
//! installs software-RMA handlers that read and write any address a peer
//! names, so the lane is a context of its own that only a same-user process
//! of this host can reach:
//!
//! - Its transports are `posix,cma` only: no network, no System V segment;
//!   the posix segment is shared through `/proc/<pid>/fd`. UCX requires the
//!   posix lane beside cma; no read uses it.
//! - An **exposed** worker publishes its address and is never progressed,
//!   so a peer's emulated PUT or GET over the posix lane never runs.
//! - This engine's endpoints to peers' lanes live on a **reader** worker,
//!   never published, that the loop progresses. They are only UCX's witness
//!   that a peer is on this host, carry no read, and use no peer error
//!   handling (UCX offers none on posix); a failed one is closed so the next
//!   read tries again.
//!
//! The reads themselves are this engine's own kernel copies (`vectored`,
//! `crate::caller_copies`), when the peer published its process and release
//! table and shares this kernel and pid namespace; every other same-host
//! read goes through the owner. The owner does not check a direct read;
//! each key's release-table slot (`release_table`) makes a stale descriptor
//! fail with `RegionNotFound`. An owner that wants every read checked opens
//! no lane ([`crate::UcxConfig::with_same_host_direct_reads`]). See
//! `docs/safety.md`, "The same-host direct lane".

use std::ffi::c_void;

use bytes::Bytes;
use rdmareg_core::{PeerId, RdmaError};

use super::Engine;
use super::events::Events;
use super::peers::{
    DirectState, Endpoint, free_error_context, new_error_context, on_endpoint_error,
};
use super::ucp::{Context, ContextRole, EpHandle, MemHandle, Worker};
use crate::config::UcxConfig;
use crate::packed_key::{PackedKeyFormat, validate_packed_key};
use crate::status::{PtrStatus, status_text};

/// The lane's UCX objects. Field order is drop order: workers before their
/// context.
pub(crate) struct DirectLane {
    /// Holds this engine's endpoints to peers' lanes; progressed by the
    /// loop.
    pub(crate) reader: Worker,
    /// Publishes the lane's address; never progressed.
    exposed: Worker,
    pub(crate) context: Context,
    /// The exposed worker's packed address.
    pub(crate) address: Bytes,
    pub(crate) key_format: PackedKeyFormat,
}

impl std::fmt::Debug for DirectLane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectLane")
            .field("address_len", &self.address.len())
            .finish_non_exhaustive()
    }
}

impl DirectLane {
    /// Opens the lane, or says why not (the engine then runs without it).
    pub(crate) fn open(config: &UcxConfig, version: (u32, u32, u32)) -> Result<DirectLane, String> {
        let key_format =
            PackedKeyFormat::for_ucx_version(version.0, version.1).ok_or_else(|| {
                format!(
                    "no packed-key layout known for UCX {}.{}",
                    version.0, version.1
                )
            })?;
        let settings = config.direct_read_settings_from_env();
        let context =
            Context::new(&settings, ContextRole::DirectReads).map_err(|e| e.to_string())?;
        let exposed = Worker::new(&context).map_err(|e| e.to_string())?;
        let reader = Worker::new(&context).map_err(|e| e.to_string())?;
        let address = exposed.address().map_err(|e| e.to_string())?;
        Ok(DirectLane {
            reader,
            exposed,
            context,
            address,
            key_format,
        })
    }

    /// Destroys both workers, consuming the lane and returning its context
    /// (teardown unmaps the lane's registrations before cleaning it up).
    pub(crate) fn destroy_workers(self) -> Context {
        let DirectLane {
            reader,
            exposed,
            context,
            ..
        } = self;
        drop(reader);
        drop(exposed);
        context
    }
}

impl Engine {
    /// The open direct endpoint to `peer`, opening it now if it was never
    /// tried; `None` when this engine or the peer has no direct lane, or UCX
    /// cannot reach the peer's.
    pub(super) fn direct_endpoint_for(&mut self, peer: PeerId) -> Option<(EpHandle, u64)> {
        let lane = self.direct.as_ref()?;
        let events: *const Events = &*self.events;
        match &self.peers.connection_mut(peer)?.direct {
            DirectState::Open(endpoint) => return Some((endpoint.handle, endpoint.serial)),
            DirectState::Unreachable => return None,
            DirectState::Untried => {}
        }
        // Only a new endpoint takes a serial: the common case above is a
        // lookup on every read.
        let serial = self.peers.next_serial();
        let connection = self.peers.connection_mut(peer)?;
        let address = connection.direct_address.as_ref()?;
        let error_context = new_error_context(events, serial);
        // SAFETY: the address was validated and padded by `add_peer`; the
        // error context lives until the close completes or the workers are
        // destroyed.
        let created = unsafe {
            lane.reader.create_endpoint(
                address,
                Some((on_endpoint_error as _, error_context.cast::<c_void>())),
                false,
            )
        };
        match created {
            Ok(handle) => {
                tracing::debug!(%peer, serial, "direct-read endpoint created");
                connection.direct = DirectState::Open(Endpoint {
                    handle,
                    serial,
                    error_context,
                    // One-sided reads: no replies to split.
                    reads_in_chunks: false,
                    writes_in_chunks: false,
                });
                Some((handle, serial))
            }
            Err(err) => {
                free_error_context(error_context);
                tracing::debug!(%peer, error = %err, "the peer's direct-read lane is out of reach; reading through it instead");
                connection.direct = DirectState::Unreachable;
                None
            }
        }
    }

    /// Whether `ucx_key` has the layout this UCX's direct lane packs.
    pub(super) fn direct_key_is_well_formed(&self, ucx_key: &[u8]) -> bool {
        self.direct
            .as_ref()
            .is_some_and(|lane| validate_packed_key(&lane.key_format, ucx_key).is_ok())
    }

    /// Closes a direct endpoint gracefully. No read runs on it (it is
    /// only UCX's witness that the peer is on this host), so nothing is
    /// waited for.
    pub(super) fn close_direct_endpoint(&mut self, endpoint: Endpoint) {
        let Some(lane) = self.direct.as_ref() else {
            free_error_context(endpoint.error_context);
            return;
        };
        // SAFETY: the endpoint was created on the reader worker and left its
        // connection before this call, so it is closed exactly once.
        match unsafe { lane.reader.close_endpoint(endpoint.handle, false) } {
            PtrStatus::Done => free_error_context(endpoint.error_context),
            PtrStatus::Pending(request) => self
                .peers
                .push_closing_direct(request, endpoint.error_context),
            PtrStatus::Failed(status) => {
                tracing::debug!(serial = endpoint.serial, status = %status_text(status), "direct endpoint close reported an error");
                self.peers.park_error_context(endpoint.error_context);
            }
        }
    }

    /// The lane's registration of a freshly mapped range and the same-host
    /// part of its key; `None` without the lane.
    pub(super) fn map_direct(
        &self,
        ptr: usize,
        len: usize,
    ) -> Result<Option<(MemHandle, Vec<u8>)>, RdmaError> {
        let Some(lane) = self.direct.as_ref() else {
            return Ok(None);
        };
        let memh = lane.context.map(ptr, len)?;
        match lane.context.pack_remote_key(memh) {
            Ok(key) => Ok(Some((memh, key.to_vec()))),
            Err(err) => {
                // SAFETY: mapped just above on this context, in no table,
                // unmapped once here.
                if let Err(unmap_err) = unsafe { lane.context.unmap(memh) } {
                    tracing::error!(error = %unmap_err, "could not undo a direct-lane registration whose key could not be packed");
                }
                Err(err)
            }
        }
    }

    /// Deregisters the lane's handle of a region.
    ///
    /// # Safety
    /// `memh` came from [`Engine::map_direct`] and is unmapped at most once.
    pub(super) unsafe fn unmap_direct(&self, memh: MemHandle) -> Result<(), RdmaError> {
        match self.direct.as_ref() {
            // SAFETY: the caller's contract.
            Some(lane) => unsafe { lane.context.unmap(memh) },
            None => Ok(()),
        }
    }
}
