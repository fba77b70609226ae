//! The consumer's side of a read: post the request, write the reply into the
//! destination, and complete only once UCX has let go of it.
//!
//! 1. **Posted.** The destination is checked and held (an unmap of it
//!    waits), the key decoded, an op slot taken and the read started in the
//!    consumer machine (`Events::consumer`), which gives its request id and
//!    keeps its deadline; the request goes to the owner as an active message.
//! 2. **Replied.** The machine accepts one reply, from the request's
//!    endpoint and of the requested length (UCX's release build does not
//!    check the destination's size); the handler (`replies`) copies eager
//!    bytes, starts a rendezvous receive into the destination, or turns a
//!    refusal into its error (`read_protocol::Refusal`).
//! 3. **Finished.** The callback that finished the op completes the caller;
//!    the loop drops the destination hold and recycles the slot once the
//!    request send has completed too.
//!
//! No read completes while UCX may still write its destination
//! (`docs/safety.md`, "A GET completes only after UCX lets go"): past its
//! deadline a read still waiting for its reply completes at once, and one
//! whose rendezvous receive runs has its endpoint force-closed and
//! completes when UCX ends the receive.
//!
//! A same-host read whose owner process and release table this engine can
//! reach skips the owner: it is copied with the turn's other such reads
//! (`vectored`), checked against the release table before and after
//! (`release_table`), and completes once the copy returned.

use std::ffi::c_void;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use rdmareg_core::{BackendGet, PeerId, RdmaError};
use ucx_sys as sys;

use super::Engine;
use super::chunks;
use super::events::Events;
use super::key_memo::DecodedKey;
use super::ops::{GetOp, Phase};
use super::results::{BatchReply, BatchResults, ChunkResults, NoticeAfterRead, Waiter};
use rdmareg_engine::served::consumer::TimeoutAction;

use super::replies::{failure, on_request_sent};
use super::ucp::{EpHandle, MemHandle, SendMode, send_active_message};
use super::vectored::{self, CopyEntry};
use crate::command::Reply;
use crate::owner_process::{OwnerProcess, SameHostSource};
use crate::read_protocol::{READ_REQUEST_AM_ID, ReadKey, ReadRequest, ServedKey};
use crate::status::PtrStatus;

/// A same-host read collected for this turn's vectored copy.
#[derive(Debug)]
pub(super) struct PendingCopy {
    /// The owner's process.
    owner: Arc<OwnerProcess>,
    entry: CopyEntry,
    /// The key's release slot and the tag it holds while the registration
    /// is live (`release_table`, `ServedKey::release_tag`).
    release_slot: u32,
    release_tag: u64,
    /// The read as asked, to post through the owner if the kernel refuses.
    request: BackendGet,
    /// Taken when the read completes.
    waiter: Option<Waiter>,
}

/// What every chunk of one served read shares.
struct ServedTarget {
    peer: PeerId,
    /// The endpoint's serial, and the endpoint, looked up this turn.
    serial: u64,
    endpoint: sys::ucp_ep_h,
    local_region_id: u64,
    memh: MemHandle,
    deadline: Instant,
    key: ServedKey,
}

/// An owner-served read whose op is set up (waiting for its reply, deadline
/// scheduled) and whose request is still to be sent.
#[derive(Debug)]
pub(super) struct PreparedRead {
    pub(super) slot: u32,
    pub(super) op: *mut GetOp,
    /// The endpoint to the owner, looked up this turn.
    pub(super) endpoint: sys::ucp_ep_h,
    pub(super) request: ReadRequest,
}

impl Engine {
    /// `Command::Get`.
    pub(super) fn post_get(&mut self, request: BackendGet, reply: Reply<()>) {
        let waiter = Waiter::Single(reply);
        if waiter.is_abandoned() {
            return; // Nobody waits and nothing was transferred: skip it.
        }
        if let Err((waiter, err)) = self.try_post_get(request, waiter) {
            waiter.send(Err(err));
        }
        self.flush_copies();
    }

    /// `Command::GetWithNotice`: the read, whose notice is sent from its
    /// completion (see `notices`).
    pub(super) fn post_get_with_notice(
        &mut self,
        request: BackendGet,
        notice: Bytes,
        reply: Reply<()>,
    ) {
        let waiter = Waiter::ThenNotice {
            notice: NoticeAfterRead {
                peer: request.peer,
                notice,
                reply,
            },
            due: Rc::clone(&self.notices_due),
        };
        if waiter.is_abandoned() {
            return;
        }
        if let Err((waiter, err)) = self.try_post_get(request, waiter) {
            waiter.send(Err(err));
        }
        self.flush_copies();
        self.send_notices_due();
    }

    /// `Command::GetBatch`: every entry posted in this one turn, each
    /// completing as its own read would; the results go to the caller once
    /// the last one completes (see `results`).
    pub(super) fn post_batch(&mut self, requests: Vec<BackendGet>, reply: BatchReply) {
        if reply.is_canceled() {
            return; // Nobody waits and nothing was transferred: skip it.
        }
        if requests.is_empty() {
            let _ = reply.send(Vec::new());
            return;
        }
        let in_a_list = requests.len() > 1;
        let batch = BatchResults::new(requests.len(), reply);
        let mut served = Vec::new();
        // One clock for the batch: its entries are posted in this one turn.
        let mut posted = Instant::now();
        for (index, request) in requests.into_iter().enumerate() {
            let waiter = Waiter::Entry {
                batch: std::rc::Rc::clone(&batch),
                index,
            };
            if let Err((waiter, err)) =
                self.prepare_get(request, waiter, in_a_list, &mut posted, &mut served)
            {
                waiter.send(Err(err));
            }
        }
        // Sends below may run callbacks that close endpoints.
        self.endpoint_memo = None;
        // Small served reads of one owner travel as lists.
        self.send_prepared(served);
        self.flush_copies();
    }

    /// `peer`'s served endpoint (`endpoint_for`), remembered for the next
    /// read of the same batch. The memo is sound only while nothing can
    /// close or replace an endpoint: `post_batch` and `try_post_get` clear
    /// it before they send anything, and the direct lane clears it before
    /// it runs.
    fn served_endpoint(&mut self, peer: PeerId) -> Result<(EpHandle, u64), RdmaError> {
        if let Some((memo_peer, endpoint, serial)) = self.endpoint_memo {
            if memo_peer == peer {
                return Ok((endpoint, serial));
            }
        }
        let (endpoint, serial) = self.endpoint_for(peer)?;
        self.endpoint_memo = Some((peer, endpoint, serial));
        Ok((endpoint, serial))
    }

    /// Where `peer`'s same-host reads come from: its process, copied from
    /// here, when it published one and its release table in this engine's
    /// pid space and UCX reaches its direct lane (see `vectored`); nothing,
    /// once a copy found that process gone; otherwise its owner's engine.
    pub(super) fn copy_source(&mut self, peer: PeerId) -> SameHostSource {
        if let Some((memo_peer, source)) = &self.copy_source_memo {
            if *memo_peer == peer {
                return source.clone();
            }
        }
        let source = self.look_up_copy_source(peer);
        self.copy_source_memo = Some((peer, source.clone()));
        source
    }

    pub(super) fn look_up_copy_source(&mut self, peer: PeerId) -> SameHostSource {
        let Some(connection) = self.peers.connection_mut(peer) else {
            return SameHostSource::NotCopied;
        };
        let owner = match &connection.process {
            SameHostSource::Copy(owner) => Arc::clone(owner),
            other => return other.clone(),
        };
        if owner.release().is_none() {
            // Nothing would tell a copy that a registration is gone.
            return SameHostSource::ThroughOwner;
        }
        if self.direct_endpoint_for(peer).is_none() {
            return SameHostSource::NotCopied;
        }
        self.signals.caller_copies.publish_source(peer, &owner);
        SameHostSource::Copy(owner)
    }

    /// `packed_key` decoded (`None` if it does not decode), from the memo
    /// when this engine decoded the same bytes lately.
    pub(super) fn decoded_key(&mut self, packed_key: &[u8]) -> Option<DecodedKey> {
        if let Some(decoded) = self.key_memo.get(packed_key) {
            return Some(decoded);
        }
        let key = ReadKey::decode(packed_key).ok()?;
        let direct_well_formed = match &key {
            ReadKey::SameHost(same_host) => self.direct_key_is_well_formed(&same_host.ucx_key),
            ReadKey::Served(_) => false,
        };
        let decoded = DecodedKey {
            key: std::rc::Rc::new(key),
            direct_well_formed,
        };
        self.key_memo.insert(packed_key, decoded.clone());
        Some(decoded)
    }

    /// Copies the same-host reads collected this turn, one vectored call per
    /// owner process and kernel vector limit, and completes each. A peer the
    /// kernel refuses to let this process read is read through its owner
    /// from now on (never UCX's cma, which names the process by pid alone),
    /// these reads included.
    fn flush_copies(&mut self) {
        self.copy_source_memo = None;
        if self.copies.is_empty() {
            return;
        }
        let mut copies = std::mem::take(&mut self.copies);
        // Stable: each owner's reads keep their order.
        if !copies.is_sorted_by_key(|copy| copy.owner.pid()) {
            copies.sort_by_key(|copy| copy.owner.pid());
        }
        let mut fallback = Vec::new();
        for group in copies.chunk_by_mut(|a, b| Arc::ptr_eq(&a.owner, &b.owner)) {
            let entries: Vec<CopyEntry> = group.iter().map(|copy| copy.entry).collect();
            // SAFETY: every destination was checked inside a region this
            // engine mapped and that cannot be unmapped before this returns
            // (unmaps run on this thread); the registry holds each
            // destination until its result, sent below after the copy.
            let outcomes = unsafe { vectored::copy_from_process(&group[0].owner, &entries) };
            for (copy, outcome) in group.iter_mut().zip(outcomes) {
                let Some(waiter) = copy.waiter.take() else {
                    continue;
                };
                match outcome {
                    Ok(()) => {
                        // The check that decides (`release_table`).
                        let live = copy.owner.release().is_some_and(|table| {
                            table.still_live_after_copy(copy.release_slot, copy.release_tag)
                        });
                        if live {
                            waiter.send(Ok(()));
                        } else {
                            // SAFETY: the destination was checked when the
                            // read was collected and is held until its
                            // result, sent below; the copy has returned.
                            unsafe { std::ptr::write_bytes(copy.entry.dest, 0, copy.entry.len) };
                            waiter.send(Err(RdmaError::RegionNotFound));
                        }
                    }
                    Err(err) if err.is_refusal() => {
                        tracing::debug!(peer = %copy.request.peer, error = %err, "same-host copies refused; reading through the owner");
                        self.stop_copying_from(copy.request.peer, SameHostSource::ThroughOwner);
                        fallback.push((copy.request.clone(), waiter));
                    }
                    Err(err) => {
                        if err.is_gone() {
                            // Its pid may name another process now or
                            // later: never read it again, by any copy.
                            tracing::debug!(peer = %copy.request.peer, "same-host owner process gone; its same-host reads fail from now on");
                            self.stop_copying_from(copy.request.peer, SameHostSource::Gone);
                        }
                        waiter.send(Err(RdmaError::backend(format!(
                            "ucx: same-host copy from {} failed: {err}",
                            copy.request.peer
                        ))));
                    }
                }
            }
        }
        for (request, waiter) in fallback {
            if let Err((waiter, err)) = self.try_post_get(request, waiter) {
                waiter.send(Err(err));
            }
        }
        // A fallback is never copied again: its peer's process was cleared.
        debug_assert!(self.copies.is_empty());
        self.copy_source_memo = None;
    }

    /// `peer`'s reads no longer copy from its process, on this thread or
    /// on callers' (whose sources are all withdrawn: rare, and the thread
    /// republishes what still holds); they come from `instead`.
    pub(super) fn stop_copying_from(&mut self, peer: PeerId, instead: SameHostSource) {
        if let Some(connection) = self.peers.connection_mut(peer) {
            connection.process = instead;
        }
        self.signals.caller_copies.withdraw_all_sources();
    }

    fn try_post_get(
        &mut self,
        request: BackendGet,
        reply: Waiter,
    ) -> Result<(), (Waiter, RdmaError)> {
        let mut served = std::mem::take(&mut self.served_scratch);
        let prepared = self.prepare_get(request, reply, false, &mut Instant::now(), &mut served);
        self.endpoint_memo = None;
        for read in served.drain(..) {
            self.send_read_request(read);
        }
        self.served_scratch = served;
        prepared
    }

    /// Checks a read and starts it, up to its request: a same-host read is
    /// collected for this turn's copy; a served read gets its op (deadline
    /// reckoned from `posted`) and is pushed to `served`, to be sent alone
    /// or in a list (`read_lists`). `in_a_list`: the read is one of a batch
    /// of two or more (see `chunks`).
    pub(super) fn prepare_get(
        &mut self,
        request: BackendGet,
        reply: Waiter,
        in_a_list: bool,
        posted: &mut Instant,
        served: &mut Vec<PreparedRead>,
    ) -> Result<(), (Waiter, RdmaError)> {
        let BackendGet {
            peer,
            remote_addr,
            packed_key,
            local_region_id,
            local_offset,
            len,
            deadline,
        } = request;
        // Destination: mapped, not unmapping, and the range inside the mapped
        // pointer and length.
        let (dest, len, memh) =
            match self.checked_destination(local_region_id, local_offset, len, remote_addr) {
                Ok(destination) => destination,
                Err(err) => return Err((reply, err)),
            };
        let Some(DecodedKey {
            key,
            direct_well_formed,
        }) = self.decoded_key(&packed_key)
        else {
            return Err((reply, RdmaError::InvalidKey));
        };
        let source = match &*key {
            ReadKey::SameHost(same_host) if same_host.access.allows_read() => {
                self.copy_source(peer)
            }
            // A key that grants no read goes to its owner, which refuses
            // the read.
            ReadKey::SameHost(_) | ReadKey::Served(_) => SameHostSource::NotCopied,
        };
        if let SameHostSource::Gone = source {
            return Err((
                reply,
                RdmaError::backend(format!(
                    "ucx: the process of {peer} is gone (it exited or replaced its program); its same-host memory with it"
                )),
            ));
        }
        if let (ReadKey::SameHost(same_host), SameHostSource::Copy(owner)) = (&*key, source) {
            // The UCX key goes unused on this path, but a key is checked
            // the same whichever way it is read.
            if !direct_well_formed {
                return Err((reply, RdmaError::InvalidKey));
            }
            if !same_host.covers(remote_addr, len as u64) {
                return Err((reply, RdmaError::OutOfRange));
            }
            let (release_slot, release_tag) = (same_host.release_slot, same_host.release_tag());
            // The check before the copy (`release_table`); `copy_source`
            // returns `Copy` only for owners whose table is open.
            let live = owner
                .release()
                .is_some_and(|table| table.is_live(release_slot, release_tag));
            if !live {
                return Err((reply, RdmaError::RegionNotFound));
            }
            self.copies.push(PendingCopy {
                owner,
                entry: CopyEntry {
                    remote_addr,
                    dest,
                    len,
                },
                release_slot,
                release_tag,
                request: BackendGet {
                    peer,
                    remote_addr,
                    packed_key,
                    local_region_id,
                    local_offset,
                    len: len as u64,
                    deadline,
                },
                waiter: Some(reply),
            });
            return Ok(());
        }
        // Every other read goes through the owner, which checks it, a
        // same-host read this engine cannot copy with a release check
        // included.
        let timeout = deadline.unwrap_or(self.settings.timings.default_get_deadline);
        let deadline = *posted + timeout;
        let key = key.served();
        let (endpoint, serial) = match self.served_endpoint(peer) {
            Ok(found) => found,
            Err(err) => return Err((reply, err)),
        };

        let target = ServedTarget {
            peer,
            serial,
            endpoint: endpoint.raw(),
            local_region_id,
            memh,
            deadline,
            key,
        };
        let chunks = chunks::chunks(len, in_a_list).filter(|_| {
            self.ops.active() < chunks::SPLIT_WHILE_FEWER_THAN && self.peers.reads_in_chunks(peer)
        });
        let Some(chunks) = chunks else {
            served.push(self.enter_served_read(&target, remote_addr, dest, len, reply));
            return Ok(());
        };
        self.signals
            .reads_asked_in_chunks
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let whole = ChunkResults::new(chunks.len(), reply);
        for (offset, chunk_len) in chunks {
            let waiter = Waiter::Chunk(std::rc::Rc::clone(&whole));
            // In bounds: `offset + chunk_len <= len`, inside the checked
            // destination.
            let chunk_dest = dest.wrapping_add(offset);
            served.push(self.enter_served_read(
                &target,
                remote_addr + offset as u64,
                chunk_dest,
                chunk_len,
                waiter,
            ));
        }
        Ok(())
    }

    /// Takes an op slot for one served read of `len` bytes at
    /// `remote_addr` into `dest`, starts it in the consumer machine (which
    /// keeps its deadline), and returns it ready to send.
    fn enter_served_read(
        &mut self,
        target: &ServedTarget,
        remote_addr: u64,
        dest: *mut u8,
        len: usize,
        reply: Waiter,
    ) -> PreparedRead {
        let events: *const Events = &*self.events;
        let (slot, op) = self.ops.alloc(events);
        // SAFETY: the freshly allocated slot; nothing refers to it yet.
        unsafe {
            (*op).reply = Some(reply);
            (*op).peer = target.peer;
            (*op).endpoint_serial = target.serial;
            (*op).endpoint = target.endpoint;
            (*op).region_id = target.local_region_id;
            (*op).dest = dest;
            (*op).len = len;
            (*op).memh = Some(target.memh);
            (*op).phase = Phase::AwaitingReply;
            (*op).hold_released = false;
            // Until its request is sent (alone, or as a list's leader) or
            // handed to a list (`read_lists`): the slot is not recycled.
            (*op).send_pending = true;
        }
        if let Some(region) = self.regions.get_mut(&target.local_region_id) {
            region.in_flight += 1;
        }
        let read = self.events.consumer.borrow_mut().start(
            target.endpoint as usize,
            len as u64,
            target.deadline,
            op,
        );
        // SAFETY: as above.
        unsafe { (*op).read = read };
        // Started during teardown, the machine completed it at once.
        self.events.complete_reads();
        let request = ReadRequest {
            request_id: read.0,
            key: target.key,
            address: remote_addr,
            length: len as u64,
        };
        PreparedRead {
            slot,
            op,
            endpoint: target.endpoint,
            request,
        }
    }

    /// Sends a prepared read's request on its own.
    pub(super) fn send_read_request(&mut self, prepared: PreparedRead) {
        let PreparedRead {
            slot,
            op,
            endpoint,
            request,
        } = prepared;
        // An earlier send of this turn may have run callbacks that closed
        // this read's endpoint, completing the read; the handle must not be
        // used again.
        // SAFETY: the slot is active and owned by this read.
        if unsafe { (*op).phase } != Phase::AwaitingReply {
            // SAFETY: as above.
            unsafe { (*op).send_pending = false };
            self.settle_op(slot);
            return;
        }
        // SAFETY: the endpoint is live (looked up this turn, and endpoints
        // close only between commands); no payload; the slot outlives the
        // send (freed only after the worker). The whole exchange can
        // complete inside this call, so the op was entered first and no
        // borrow is held across it.
        let status = unsafe {
            send_active_message(
                endpoint,
                READ_REQUEST_AM_ID,
                &request.encode(),
                std::ptr::null(),
                0,
                SendMode::Small,
                true,
                on_request_sent,
                op.cast::<c_void>(),
            )
        };
        self.events.handed_off();
        match status {
            // SAFETY: the slot is active and owned by this read.
            PtrStatus::Pending(request) => unsafe { (*op).send_request = request },
            PtrStatus::Done => self.request_sent(slot, sys::UCS_OK),
            PtrStatus::Failed(code) => self.request_sent(slot, code),
        }
        self.drain_events();
    }

    /// A read's request send ended with `status`.
    pub(super) fn request_sent(&mut self, slot: u32, status: sys::ucs_status_t) {
        let Some(op) = self.ops.op(slot) else {
            return;
        };
        // SAFETY: active slot, touched between UCX calls only.
        let op_ref = unsafe { &mut *op };
        if !op_ref.send_request.is_null() {
            // SAFETY: the request came from ucp_am_send_nbx on this worker,
            // has completed, and is freed once.
            unsafe { self.worker.free_request(op_ref.send_request) };
            op_ref.send_request = std::ptr::null_mut();
        }
        op_ref.send_pending = false;
        let members = std::mem::take(&mut op_ref.list_members);
        if status != sys::UCS_OK {
            self.fail_unsent(slot, status);
            for (member, generation) in members {
                if self.ops.is_current(member, generation) {
                    self.fail_unsent(member, status);
                }
            }
        }
        self.settle_op(slot);
    }

    /// Fails a read whose request could not be sent, if it still waits for
    /// a reply.
    fn fail_unsent(&mut self, slot: u32, status: sys::ucs_status_t) {
        let Some(op) = self.ops.op(slot) else {
            return;
        };
        // SAFETY: active slot, touched between UCX calls only.
        let op_ref = unsafe { &mut *op };
        if op_ref.phase != Phase::AwaitingReply {
            return;
        }
        let err = failure(op_ref, &self.events, status);
        // Nothing is written before the reply's header: nothing to cancel.
        let _ = self
            .events
            .consumer
            .borrow_mut()
            .request_failed(op_ref.read, err);
        self.events.complete_reads();
    }

    /// A read completed: drop its destination hold, and recycle the slot
    /// once its request send is done too.
    pub(super) fn finish_get(&mut self, slot: u32) {
        let Some(op) = self.ops.op(slot) else {
            return;
        };
        // SAFETY: active slot, touched between UCX calls only.
        let op_ref = unsafe { &mut *op };
        if !op_ref.receive_request.is_null() {
            // SAFETY: the receive request completed (its callback ran) and
            // is freed once.
            unsafe { self.worker.free_request(op_ref.receive_request) };
            op_ref.receive_request = std::ptr::null_mut();
        }
        self.settle_op(slot);
    }

    pub(super) fn settle_op(&mut self, slot: u32) {
        let Some(op) = self.ops.op(slot) else {
            return;
        };
        // SAFETY: active slot, touched between UCX calls only.
        let op_ref = unsafe { &mut *op };
        if op_ref.phase != Phase::Finished {
            return;
        }
        if !op_ref.hold_released {
            op_ref.hold_released = true;
            let region_id = op_ref.region_id;
            self.release_region_hold(region_id);
        }
        if !op_ref.send_pending && op_ref.receive_request.is_null() {
            self.ops.recycle(slot);
        }
    }

    /// Ends reads past their deadline: at once if UCX holds nothing of their
    /// destination, else by force-closing the endpoint so UCX ends the
    /// receive; the consumer machine decides which.
    ///
    /// Every expired read is completed or marked before any endpoint is
    /// force-closed, so a read whose own deadline passed (chunks of one
    /// read share theirs) keeps its `Timeout`.
    pub(super) fn expire_gets(&mut self, now: Instant) {
        let actions = self.events.consumer.borrow_mut().handle_timeout(now);
        self.events.complete_reads();
        let mut unresponsive = Vec::new();
        for TimeoutAction::StopTransfer { read, .. } in actions {
            if let Some(op) = self.events.op_of(read) {
                // SAFETY: held by the machine, so an active slot, touched
                // between UCX calls only.
                let op_ref = unsafe { &*op };
                unresponsive.push((op_ref.peer, op_ref.endpoint_serial));
            }
        }
        for (peer, serial) in unresponsive {
            self.declare_unresponsive(peer, serial);
        }
        self.drain_events();
    }

    /// The earliest deadline of a read not completed yet.
    pub(super) fn next_read_deadline(&self) -> Option<Instant> {
        self.events.consumer.borrow_mut().poll_timeout()
    }

    /// Fails every read still waiting for a reply on `endpoint` with
    /// `error`: the endpoint is closing. (Reads whose payload UCX is
    /// receiving end when UCX ends the receive.)
    pub(super) fn fail_awaiting_on_endpoint(&mut self, endpoint: sys::ucp_ep_h, error: &RdmaError) {
        let _ = self
            .events
            .consumer
            .borrow_mut()
            .endpoint_failed(endpoint as usize, error.clone());
        // Writes whose send has not ended complete when UCX ends it.
        let _ = self
            .events
            .writer
            .borrow_mut()
            .endpoint_failed(endpoint as usize, error.clone());
        self.events.complete_reads();
        self.complete_puts();
    }

    /// Teardown: every read still waiting for a reply fails with
    /// `ShuttingDown` (UCX holds none of their destinations), and reads
    /// started from now on are refused.
    pub(super) fn fail_all_awaiting(&mut self) {
        self.events.consumer.borrow_mut().shutdown();
        self.events.writer.borrow_mut().shutdown();
        self.events.complete_reads();
        self.complete_puts();
    }
}
