//! The same-host direct-read lane: one-sided reads with cma between engines
//! of one host and one user.
//!
//! # Why a second context
//!
//! Reading through the owner (`serve`, `gets`) costs a request and a reply
//! per read; on one host the kernel can copy straight out of the owner's
//! process (`process_vm_readv`, UCX's cma transport) without waking it.
//! UCX offers that only to a context with `UCP_FEATURE_RMA`, and a context
//! with RMA also installs UCX's software-RMA handlers, which write and read
//! any address a peer names on any active-message lane. So the lane lives
//! in a context of its own that only a same-user process of this host can
//! reach:
//!
//! - Its transports are `posix,cma` and nothing else: no network transport,
//!   and no System V segment (those are group-accessible). cma itself is
//!   the kernel's ptrace check; the posix segment is shared through
//!   `/proc/<pid>/fd`, which the kernel opens only for a process allowed to
//!   ptrace this one. UCX requires the posix lane beside cma for its
//!   messaging; no read uses it.
//! - Its address is published by an **exposed** worker that this engine
//!   never progresses, so even a same-user peer's emulated PUT or GET sent
//!   over the posix lane is never executed (a same-user peer can write this
//!   process with `process_vm_writev` anyway: that is the kernel's trust
//!   domain, not this library's).
//! - This engine's own direct reads run on a separate **reader** worker,
//!   whose address is never published; the loop progresses it.
//!
//! # What the owner gives up on this lane
//!
//! A direct read is not checked by the owner: the kernel copies whatever the
//! owner's address space holds at that address when the read runs. The
//! consumer's engine checks the range against the mapped range the key
//! carries, which keeps honest callers honest and bounds nothing against a
//! hostile same-user process. A read with a stale descriptor returns the
//! memory's current bytes, or fails if the pages are gone. An owner that
//! does not want this opens no direct lane
//! ([`crate::UcxConfig::with_same_host_direct_reads`]); its keys are then
//! served-only and every read is checked.
//!
//! # Reads
//!
//! When the peer published its process and shares this engine's kernel and
//! pid namespace, the engine copies its direct reads itself, a whole turn's
//! worth per owner in one vectored system call (`vectored`); the endpoint
//! below is then opened only as UCX's witness that the peer is on this
//! host. Otherwise each read goes through UCX's cma:
//!
//! A direct read holds its destination like any other (`gets`); the
//! kernel copy completes inside UCX's progress without the owner, so a read
//! past its deadline is only marked and answered by its completion (`Ok` if
//! the bytes landed). Endpoints use no peer error handling (UCX offers none
//! on posix); a failed copy (the owner exited) fails the read, and UCX's
//! error callback closes the endpoint so the next read tries again.

use std::ffi::c_void;

use bytes::Bytes;
use rdmareg_core::{PeerId, RdmaError};
use ucx_sys as sys;

use super::Engine;
use super::answer::Answer;
use super::events::Events;
use super::ops::{GetOp, Phase};
use super::peers::{
    DirectState, Endpoint, free_error_context, new_error_context, on_endpoint_error,
};
use super::ucp::{Context, ContextRole, EpHandle, MemHandle, RemoteKey, Worker, get};
use crate::config::UcxConfig;
use crate::packed_key::{PackedKeyFormat, copy_for_unpack, validate_packed_key};
use crate::read_protocol::SameHostKey;
use crate::status::{PtrStatus, status_text};

/// How long closing a direct endpoint waits for the kernel copies still
/// running on it.
const DIRECT_SETTLE_LIMIT: std::time::Duration = std::time::Duration::from_secs(1);

/// The lane's UCX objects. Field order is drop order: workers before their
/// context.
pub(crate) struct DirectLane {
    /// Runs this engine's direct reads; progressed by the loop.
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

/// A direct read's copy ended.
unsafe extern "C" fn on_direct_read_done(
    _request: *mut c_void,
    status: sys::ucs_status_t,
    user_data: *mut c_void,
) {
    let op = user_data.cast::<GetOp>();
    // SAFETY: `user_data` is the op slot this read was posted for; slots
    // outlive the workers and are recycled only after the loop handled this
    // completion; the loop touches ops only between UCX calls.
    let op = unsafe { &mut *op };
    op.direct_read_ended(status);
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
                    reads_in_pieces: false,
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

    /// Posts `key`'s read one-sided if the peer's direct lane is reachable;
    /// gives the reply back when it is not, so the caller reads through the
    /// owner.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn try_post_direct_get(
        &mut self,
        peer: PeerId,
        key: &SameHostKey,
        remote_addr: u64,
        local_region_id: u64,
        dest: *mut u8,
        len: usize,
        deadline: std::time::Instant,
        reply: Answer,
    ) -> Result<Option<Answer>, (Answer, RdmaError)> {
        let Some((endpoint, serial)) = self.direct_endpoint_for(peer) else {
            return Ok(Some(reply));
        };
        if !key.covers(remote_addr, len as u64) {
            return Err((reply, RdmaError::OutOfRange));
        }
        let Some(lane) = self.direct.as_ref() else {
            return Ok(Some(reply));
        };
        let Ok(packed) = copy_for_unpack(&lane.key_format, &key.ucx_key) else {
            return Err((reply, RdmaError::InvalidKey));
        };
        // SAFETY: the endpoint is live on the reader worker, used from this
        // thread; the key's layout was validated just above.
        let rkey = match unsafe { RemoteKey::unpack(endpoint, &packed) } {
            Ok(rkey) => rkey,
            Err(_) => return Err((reply, RdmaError::InvalidKey)),
        };
        let events: *const Events = &*self.events;
        let (slot, op) = self.ops.alloc(events);
        // SAFETY: the freshly allocated slot; nothing refers to it yet.
        unsafe {
            let op = &mut *op;
            op.reply = Some(reply);
            op.peer = peer;
            op.endpoint_serial = serial;
            op.endpoint = endpoint.raw();
            op.region_id = local_region_id;
            op.dest = dest;
            op.len = len;
            op.phase = Phase::Receiving;
            op.hold_released = false;
            op.direct_key = Some(rkey);
        }
        if let Some(region) = self.regions.get_mut(&local_region_id) {
            region.in_flight += 1;
        }
        self.ops.schedule_deadline(slot, deadline);
        // SAFETY: endpoint and key as above (the key lives until the op's
        // completion is handled, in `finish_get`); the destination was
        // checked against its mapped region and is held until then; the
        // slot outlives the read.
        let status = unsafe {
            get(
                endpoint,
                dest,
                len,
                remote_addr,
                rkey,
                on_direct_read_done,
                op.cast::<c_void>(),
            )
        };
        // SAFETY: the slot is active and owned by this read.
        let op_ref = unsafe { &mut *op };
        match status {
            PtrStatus::Pending(request) => op_ref.receive_request = request,
            PtrStatus::Done => op_ref.direct_read_ended(sys::UCS_OK),
            PtrStatus::Failed(code) => op_ref.direct_read_ended(code),
        }
        self.drain_events();
        Ok(None)
    }

    /// Closes a direct endpoint gracefully, once the reads on it have
    /// ended and their keys are destroyed: UCX requires a key to be
    /// destroyed before its endpoint. A direct read ends inside UCX's
    /// progress without the peer, so this waits for kernel copies only,
    /// bounded by [`DIRECT_SETTLE_LIMIT`]; keys of reads still running then
    /// are leaked rather than destroyed too late.
    pub(super) fn close_direct_endpoint(&mut self, endpoint: Endpoint) {
        if self.direct.is_none() {
            free_error_context(endpoint.error_context);
            return;
        }
        let started = std::time::Instant::now();
        let running = self.ops.direct_reads_on_endpoint(endpoint.serial);
        if running > 0 {
            tracing::debug!(
                serial = endpoint.serial,
                running,
                "letting direct reads end before their endpoint closes"
            );
        }
        while self.ops.direct_reads_on_endpoint(endpoint.serial) > 0 {
            if started.elapsed() > DIRECT_SETTLE_LIMIT {
                tracing::warn!(
                    serial = endpoint.serial,
                    "direct reads did not end before their endpoint closed; leaking their keys"
                );
                self.ops.forget_direct_keys_on_endpoint(endpoint.serial);
                break;
            }
            if let Some(lane) = &self.direct {
                lane.reader.progress();
            }
            self.drain_events();
        }
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
