//! The writer's side of a served write: a PUT is one active message to the
//! owner, its header and the source bytes, and the owner's reply.
//!
//! Which reply counts and when a write completes is the engine kit's writer
//! machine's to decide (`rdmareg_engine::served::writer`): a write completes
//! only once UCX ended the send of its request (the source may be read until
//! then, by a rendezvous in particular) and, for `Ok`, once its owner said
//! the bytes are in. What is UCX's:
//!
//! - The request goes on the served endpoint with the reply flag, eager
//!   only: the owner refuses a rendezvous write (`serve_writes`), so a
//!   PUT of more than [`WRITE_CHUNK`] bytes goes as several writes of at
//!   most that, each its own request and reply, answered together with the
//!   first error any of them got. Where active messages go over tcp,
//!   PUTs of a few hundred KiB to a few MiB go in chunks of one tcp
//!   fragment instead (`chunks`). A failed
//!   PUT's target range holds, chunk by chunk, its earlier bytes or the
//!   new ones.
//! - The source region is held (an unmap of it waits) from the post until
//!   the writer machine completed every chunk.
//! - A write past its deadline whose send has not ended has its endpoint
//!   force-closed, as a read receiving past its deadline does: UCX then
//!   ends the send, and only then is the write answered.
//! - A PUT whose key is a writable same-host key is first offered to the
//!   same-host direct lane (`direct_writes`), which copies it one-sided
//!   under the owner's release table's lock when it can; every other PUT
//!   goes through the owner.

use std::cell::RefCell;
use std::ffi::c_void;
use std::rc::Rc;
use std::time::Instant;

use rdmareg_core::{BackendPut, PeerId, RdmaError};
use rdmareg_engine::command::{BatchReply, Reply};
use rdmareg_engine::served::wire::encode_write_request;
use rdmareg_engine::served::writer::{WriteId, WriteTarget, WriteTimeout};
use ucx_sys as sys;

use super::Engine;
use super::chunks;
use super::events::Events;
use super::put_lists::fits_a_write_list;
use super::ucp::{SendMode, send_active_message};
use crate::read_protocol::{ReadKey, WRITE_REQUEST_AM_ID};
use crate::status::{PtrStatus, status_text};

/// Who hears of a write's result.
#[derive(Debug)]
pub(crate) enum PutWaiter {
    /// A single `put`.
    Single(Reply<()>),
    /// Entry `index` of a batch.
    Entry(Rc<RefCell<BatchPuts>>, usize),
}

impl PutWaiter {
    fn send(self, result: Result<(), RdmaError>) {
        match self {
            PutWaiter::Single(reply) => {
                let _ = reply.send(result);
            }
            PutWaiter::Entry(batch, index) => batch.borrow_mut().answer(index, result),
        }
    }
}

/// A batch's results, sent together once the last entry is answered.
#[derive(Debug)]
pub(crate) struct BatchPuts {
    results: Vec<Option<Result<(), RdmaError>>>,
    remaining: usize,
    reply: Option<BatchReply>,
}

impl BatchPuts {
    fn answer(&mut self, index: usize, result: Result<(), RdmaError>) {
        if let Some(slot) = self.results.get_mut(index).filter(|slot| slot.is_none()) {
            *slot = Some(result);
            self.remaining -= 1;
        }
        if self.remaining == 0
            && let Some(reply) = self.reply.take()
        {
            let results = std::mem::take(&mut self.results)
                .into_iter()
                .map(|result| result.unwrap_or(Err(RdmaError::ShuttingDown)))
                .collect();
            let _ = reply.send(results);
        }
    }
}

/// Most bytes one write request carries: a larger PUT goes in chunks of
/// this, each an eager message the owner copies in its handler, so that
/// neither side keeps a receive pending on the other and the owner's UCX
/// assembles at most this per message.
pub(crate) const WRITE_CHUNK: usize = 1 << 20;

/// One PUT's chunks, answered together once the last one completed.
#[derive(Debug)]
pub(crate) struct PutParts {
    waiter: Option<PutWaiter>,
    remaining: usize,
    /// The first error a chunk got, else `Ok`.
    outcome: Result<(), RdmaError>,
}

impl PutParts {
    fn chunk_done(&mut self, outcome: Result<(), RdmaError>) {
        if self.outcome.is_ok() {
            self.outcome = outcome;
        }
        self.remaining = self.remaining.saturating_sub(1);
        if self.remaining == 0
            && let Some(waiter) = self.waiter.take()
        {
            waiter.send(std::mem::replace(&mut self.outcome, Ok(())));
        }
    }
}

/// A write checked and ready to send: its source, its owner's endpoint,
/// where it goes.
#[derive(Debug)]
pub(crate) struct PreparedPut {
    pub(super) peer: PeerId,
    pub(super) endpoint: sys::ucp_ep_h,
    /// The endpoint's serial, to force-close it past the deadline.
    pub(super) serial: u64,
    pub(super) due: Instant,
    /// `len` readable bytes inside the source region.
    pub(super) source: *mut u8,
    pub(super) len: usize,
    pub(super) source_region: u64,
    /// The whole write's target (`length` = `len`).
    pub(super) target: WriteTarget,
}

impl PreparedPut {
    /// What the writer machine keeps with one of its chunks.
    pub(super) fn value(&self, parts: Rc<RefCell<PutParts>>) -> PutValue {
        PutValue {
            parts,
            region: self.source_region,
            peer: self.peer,
            serial: self.serial,
        }
    }
}

impl PutParts {
    /// The parts of a write sent in one piece.
    pub(super) fn single(waiter: PutWaiter) -> Rc<RefCell<PutParts>> {
        Rc::new(RefCell::new(PutParts {
            waiter: Some(waiter),
            remaining: 1,
            outcome: Ok(()),
        }))
    }
}

/// What the writer machine keeps with each chunk.
#[derive(Debug)]
pub(crate) struct PutValue {
    parts: Rc<RefCell<PutParts>>,
    /// The source region, held (once per chunk) until the chunk completes.
    region: u64,
    peer: PeerId,
    /// The endpoint's serial, to force-close it past the deadline.
    serial: u64,
}

/// What a send of writes holds until it ends: the writes it carries (one
/// for a single write, every entry for a write list) and a list's payload
/// vector, which UCX reads until then.
pub(super) struct PutSend {
    pub(super) events: *const Events,
    pub(super) writes: Vec<WriteId>,
    pub(super) iov: Vec<sys::ucp_dt_iov_t>,
}

impl Engine {
    /// `Command::Put`.
    pub(super) fn post_put(&mut self, request: BackendPut, waiter: PutWaiter) {
        let (mut answered, through_owner) = self.write_directly(vec![(0, request)]);
        if let Some((_, result)) = answered.pop() {
            waiter.send(result);
        } else if let Some((_, request)) = through_owner.into_iter().next()
            && let Err((waiter, err)) = self.try_post_put(request, waiter)
        {
            waiter.send(Err(err));
        }
        self.complete_puts();
    }

    /// `Command::PutBatch`: entries the direct lane took are answered at
    /// once; of the rest, runs of small writes to one owner go as write
    /// lists (`put_lists`), every other entry on its own. Answered
    /// together.
    pub(super) fn post_put_batch(&mut self, requests: Vec<BackendPut>, reply: BatchReply) {
        let batch = Rc::new(RefCell::new(BatchPuts {
            results: vec![None; requests.len()],
            remaining: requests.len(),
            reply: Some(reply),
        }));
        let (answered, through_owner) =
            self.write_directly(requests.into_iter().enumerate().collect());
        for (index, result) in answered {
            PutWaiter::Entry(Rc::clone(&batch), index).send(result);
        }
        let mut listed = Vec::new();
        for (index, request) in through_owner {
            let waiter = PutWaiter::Entry(Rc::clone(&batch), index);
            match self.prepare_put(request) {
                Ok(put) if fits_a_write_list(&put) => listed.push((put, waiter)),
                Ok(put) => self.send_put(put, waiter),
                Err(err) => waiter.send(Err(err)),
            }
        }
        self.send_put_lists(listed);
        self.complete_puts();
    }

    /// Checks a write and sends it; hands the waiter back with the error
    /// when it could not start.
    fn try_post_put(
        &mut self,
        request: BackendPut,
        waiter: PutWaiter,
    ) -> Result<(), (PutWaiter, RdmaError)> {
        match self.prepare_put(request) {
            Ok(put) => {
                self.send_put(put, waiter);
                Ok(())
            }
            Err(err) => Err((waiter, err)),
        }
    }

    /// Checks a write: its source mapped, not unmapping, the range inside
    /// it; its key; an endpoint to its owner.
    pub(super) fn prepare_put(&mut self, request: BackendPut) -> Result<PreparedPut, RdmaError> {
        let BackendPut {
            peer,
            remote_addr,
            packed_key,
            local_region_id,
            local_offset,
            len,
            deadline,
        } = request;
        let (source, len, _memh) =
            self.checked_destination(local_region_id, local_offset, len, remote_addr)?;
        let key = ReadKey::decode(&packed_key).map_err(|_| RdmaError::InvalidKey)?;
        let served = key.served();
        // Not `served_endpoint`: its memo holds only while one batch of
        // reads is prepared, and must never outlive a send (a send's
        // callbacks may close the endpoint it names).
        let (endpoint, serial) = self.endpoint_for(peer)?;
        let due = Instant::now() + deadline.unwrap_or(self.settings.timings.default_get_deadline);
        Ok(PreparedPut {
            peer,
            endpoint: endpoint.raw(),
            serial,
            due,
            source,
            len,
            source_region: local_region_id,
            target: WriteTarget {
                region: served.region_id,
                capability: served.capability,
                address: remote_addr,
                length: len as u64,
            },
        })
    }

    /// Sends a checked write as chunks of at most [`WRITE_CHUNK`], or of
    /// one tcp fragment (`chunks::write_chunk`), each its own request,
    /// answered together.
    pub(super) fn send_put(&mut self, put: PreparedPut, waiter: PutWaiter) {
        let fragment_chunk = chunks::write_chunk(put.len).filter(|_| {
            self.events.writer.borrow().in_flight() < chunks::SPLIT_WHILE_FEWER_THAN
                && self.peers.writes_in_chunks(put.peer)
        });
        if fragment_chunk.is_some() {
            self.signals
                .puts_sent_in_chunks
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let chunk_limit = fragment_chunk.unwrap_or(WRITE_CHUNK);
        let chunks = put.len.div_ceil(chunk_limit);
        // The region counts its holds in a u32: a PUT of more chunks than
        // that (4 PiB) is refused rather than miscounted.
        let Ok(holds) = u32::try_from(chunks) else {
            return waiter.send(Err(RdmaError::OutOfRange));
        };
        if let Some(region) = self.regions.get_mut(&put.source_region) {
            region.in_flight += holds;
        }
        let parts = Rc::new(RefCell::new(PutParts {
            waiter: Some(waiter),
            remaining: chunks,
            outcome: Ok(()),
        }));
        for chunk in 0..chunks {
            let offset = chunk * chunk_limit;
            let chunk_len = chunk_limit.min(put.len - offset);
            let value = put.value(Rc::clone(&parts));
            let target = WriteTarget {
                address: put.target.address + offset as u64,
                length: chunk_len as u64,
                ..put.target
            };
            // In bounds: `offset + chunk_len <= len`, inside the checked
            // source.
            let chunk_source = put.source.wrapping_add(offset);
            self.send_write(put.endpoint, put.peer, target, put.due, chunk_source, value);
        }
    }

    /// Starts one chunk in the writer machine and sends it.
    fn send_write(
        &mut self,
        endpoint: sys::ucp_ep_h,
        peer: PeerId,
        target: WriteTarget,
        due: Instant,
        source: *mut u8,
        value: PutValue,
    ) {
        let len = target.length as usize;
        let posted = self
            .events
            .writer
            .borrow_mut()
            .start(endpoint as usize, target, due, value);
        let Some(write) = posted.request else {
            // Completed at once (teardown began); answered by the caller's
            // `complete_puts`.
            return;
        };
        let record = Box::into_raw(Box::new(PutSend {
            events: &*self.events,
            writes: vec![posted.id],
            iov: Vec::new(),
        }));
        // SAFETY: the endpoint is live (looked up this turn; endpoints close
        // only between commands); the source `[source, source + len)` lies
        // inside the checked, mapped source range and is held (an unmap
        // waits) until the writer machine completed this chunk, which is
        // after this send ended; `record` lives until the callback or, if
        // none runs, teardown frees it.
        let status = unsafe {
            send_active_message(
                endpoint,
                WRITE_REQUEST_AM_ID,
                &encode_write_request(&write),
                source,
                len,
                SendMode::EagerOnly,
                true,
                on_put_sent,
                record.cast::<c_void>(),
            )
        };
        // SAFETY: `record` was just passed to this send.
        unsafe { self.writes_sent(record, status, peer) };
    }

    /// Takes the status of a send of the writes `record` carries: a
    /// pending send keeps the record for its callback; one that ended in
    /// the call frees it and tells the writer machine each write's send
    /// ended, with its error.
    ///
    /// # Safety
    /// `record` comes from `Box::into_raw` and was passed as the user data
    /// of the send that returned `status`, and of no other.
    pub(super) unsafe fn writes_sent(
        &mut self,
        record: *mut PutSend,
        status: PtrStatus,
        peer: PeerId,
    ) {
        self.events.handed_off();
        if let PtrStatus::Pending(_) = status {
            self.events.put_records.borrow_mut().insert(record as usize);
            return;
        }
        // SAFETY: made by Box::into_raw (the caller's contract); a send
        // that ended in the call runs no callback.
        let record = unsafe { Box::from_raw(record) };
        let result = match status {
            PtrStatus::Failed(code) => Err(send_failure(&self.events, peer, code)),
            _ => Ok(()),
        };
        let mut writer = self.events.writer.borrow_mut();
        for &write in &record.writes {
            writer.send_ended(write, result.clone());
        }
    }

    /// Hands every write the writer machine completed its answer, and
    /// lets go of its source.
    pub(super) fn complete_puts(&mut self) {
        loop {
            let completion = self.events.writer.borrow_mut().poll_completion();
            let Some(completion) = completion else { break };
            self.release_region_hold(completion.value.region);
            completion
                .value
                .parts
                .borrow_mut()
                .chunk_done(completion.outcome);
        }
    }

    /// The sends UCX ended since the last call, told to the writer.
    pub(super) fn drain_put_sends(&mut self) {
        let ended = std::mem::take(&mut *self.events.put_sends.borrow_mut());
        for (write, status) in ended {
            let result = if status == sys::UCS_OK {
                Ok(())
            } else {
                let peer = self
                    .events
                    .writer
                    .borrow()
                    .value(write)
                    .map(|value| value.peer);
                Err(match peer {
                    Some(peer) => send_failure(&self.events, peer, status),
                    None => RdmaError::ShuttingDown,
                })
            };
            self.events.writer.borrow_mut().send_ended(write, result);
        }
        self.complete_puts();
    }

    /// Expires writes past their deadline: one still sending has its
    /// endpoint force-closed, so UCX ends the send and the write is
    /// answered then.
    pub(super) fn expire_puts(&mut self, now: Instant) {
        let due = self.events.writer.borrow_mut().handle_timeout(now);
        for WriteTimeout::StopSend { write, .. } in due {
            let target = self
                .events
                .writer
                .borrow()
                .value(write)
                .map(|value| (value.peer, value.serial));
            if let Some((peer, serial)) = target {
                self.declare_unresponsive(peer, serial);
            }
        }
        self.complete_puts();
    }

    /// The earliest deadline of a write in flight.
    pub(super) fn next_put_deadline(&self) -> Option<Instant> {
        self.events.writer.borrow_mut().poll_timeout()
    }
}

/// The error a write gets when UCX ended its send with `status`.
pub(super) fn send_failure(events: &Events, peer: PeerId, status: sys::ucs_status_t) -> RdmaError {
    if events.tearing_down.get() {
        RdmaError::ShuttingDown
    } else {
        RdmaError::backend(format!(
            "ucx: write to {peer} failed: {}",
            status_text(status)
        ))
    }
}

/// A send of writes ended: recorded for the loop, which tells the writer.
pub(super) unsafe extern "C" fn on_put_sent(
    request: *mut c_void,
    status: sys::ucs_status_t,
    user_data: *mut c_void,
) {
    // SAFETY: `user_data` is the `PutSend` boxed for this very send; this
    // callback runs once per send, so it is reclaimed once.
    let record = unsafe { Box::from_raw(user_data.cast::<PutSend>()) };
    // SAFETY: the events record outlives the worker.
    let events = unsafe { &*record.events };
    events
        .put_records
        .borrow_mut()
        .remove(&(user_data as usize));
    events
        .put_sends
        .borrow_mut()
        .extend(record.writes.iter().map(|&write| (write, status)));
    // SAFETY: a completed request of this worker, returned once; UCX allows
    // freeing a request from its own completion callback.
    unsafe { sys::ucp_request_free(request) };
}

/// Frees the records of write sends UCX never completed. Returns how many
/// there were.
///
/// # Safety
/// The worker the sends were posted on is destroyed: no callback of it can
/// run any more.
pub(super) unsafe fn close_puts(events: &Events) -> usize {
    let records = std::mem::take(&mut *events.put_records.borrow_mut());
    for &record in &records {
        // SAFETY: each address is a `PutSend` from Box::into_raw whose
        // callback never ran (it removes its own address first), and the
        // worker is gone, so none will.
        drop(unsafe { Box::from_raw(record as *mut PutSend) });
    }
    records.len()
}
