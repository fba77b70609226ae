//! The writer's side of a served write: a PUT is one active message to the
//! owner, its header and the source bytes, and the owner's reply.
//!
//! Which reply counts and when a write completes is the engine kit's writer
//! machine's to decide (`rdmareg_engine::served::writer`): a write completes
//! only once UCX ended the send of its request (the source may be read until
//! then, by a rendezvous in particular) and, for `Ok`, once its owner said
//! the bytes are in. What is UCX's:
//!
//! - The request goes on the served endpoint with the reply flag, its
//!   payload named with the source's registration, so UCX sends a large one
//!   zero-copy or by rendezvous straight from the source.
//! - The source region is held (an unmap of it waits) from the post until
//!   the writer machine completed the write.
//! - A write past its deadline whose send has not ended has its endpoint
//!   force-closed, as a read receiving past its deadline does: UCX then
//!   ends the send, and only then is the write answered.
//! - Every PUT goes through the owner, on every lane: the same-host direct
//!   lane reads only.

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
use super::events::Events;
use super::serve::ZERO_COPY_FROM;
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

/// What the writer machine keeps with each write.
#[derive(Debug)]
pub(crate) struct PutValue {
    waiter: PutWaiter,
    /// The source region, held until the write completes.
    region: u64,
    peer: PeerId,
    /// The endpoint's serial, to force-close it past the deadline.
    serial: u64,
}

/// What a write's send holds until it ends.
struct PutSend {
    events: *const Events,
    write: WriteId,
}

impl Engine {
    /// `Command::Put`.
    pub(super) fn post_put(&mut self, request: BackendPut, waiter: PutWaiter) {
        if let Err((waiter, err)) = self.try_post_put(request, waiter) {
            waiter.send(Err(err));
        }
        self.complete_puts();
    }

    /// `Command::PutBatch`: every entry posted on its own, answered
    /// together.
    pub(super) fn post_put_batch(&mut self, requests: Vec<BackendPut>, reply: BatchReply) {
        let batch = Rc::new(RefCell::new(BatchPuts {
            results: vec![None; requests.len()],
            remaining: requests.len(),
            reply: Some(reply),
        }));
        for (index, request) in requests.into_iter().enumerate() {
            let waiter = PutWaiter::Entry(Rc::clone(&batch), index);
            if let Err((waiter, err)) = self.try_post_put(request, waiter) {
                waiter.send(Err(err));
            }
        }
        self.complete_puts();
    }

    /// Checks a write and sends it; hands the waiter back with the error
    /// when it could not start.
    fn try_post_put(
        &mut self,
        request: BackendPut,
        waiter: PutWaiter,
    ) -> Result<(), (PutWaiter, RdmaError)> {
        let BackendPut {
            peer,
            remote_addr,
            packed_key,
            local_region_id,
            local_offset,
            len,
            deadline,
        } = request;
        // Source: mapped, not unmapping, the range inside it.
        let (source, len, memh) =
            match self.checked_destination(local_region_id, local_offset, len, remote_addr) {
                Ok(source) => source,
                Err(err) => return Err((waiter, err)),
            };
        let Ok(key) = ReadKey::decode(&packed_key) else {
            return Err((waiter, RdmaError::InvalidKey));
        };
        let served = key.served();
        let (endpoint, serial) = match self.served_endpoint(peer) {
            Ok(found) => found,
            Err(err) => return Err((waiter, err)),
        };
        let timeout = deadline.unwrap_or(self.settings.timings.default_get_deadline);
        if let Some(region) = self.regions.get_mut(&local_region_id) {
            region.in_flight += 1;
        }
        let posted = self.events.writer.borrow_mut().start(
            endpoint.raw() as usize,
            WriteTarget {
                region: served.region_id,
                capability: served.capability,
                address: remote_addr,
                length: len as u64,
            },
            Instant::now() + timeout,
            PutValue {
                waiter,
                region: local_region_id,
                peer,
                serial,
            },
        );
        let Some(write) = posted.request else {
            // Completed at once (teardown began); answered below.
            return Ok(());
        };
        let mode = if len as u64 >= ZERO_COPY_FROM {
            SendMode::Registered(memh)
        } else {
            SendMode::Eager
        };
        let record = Box::into_raw(Box::new(PutSend {
            events: &*self.events,
            write: posted.id,
        }));
        // SAFETY: the endpoint is live (looked up this turn; endpoints close
        // only between commands); the source `[source, source + len)` was
        // checked inside the mapped registration `memh` and is held (an
        // unmap waits) until the writer machine completed the write, which
        // is after this send ended; `record` lives until the callback or,
        // if none runs, teardown frees it.
        let status = unsafe {
            send_active_message(
                endpoint.raw(),
                WRITE_REQUEST_AM_ID,
                &encode_write_request(&write),
                source,
                len,
                mode,
                true,
                on_put_sent,
                record.cast::<c_void>(),
            )
        };
        self.events.handed_off();
        match status {
            PtrStatus::Pending(_) => {
                self.events.put_records.borrow_mut().insert(record as usize);
            }
            ended => {
                // SAFETY: made by Box::into_raw above; no callback will run.
                drop(unsafe { Box::from_raw(record) });
                let result = match ended {
                    PtrStatus::Failed(code) => Err(send_failure(&self.events, peer, code)),
                    _ => Ok(()),
                };
                self.events
                    .writer
                    .borrow_mut()
                    .send_ended(posted.id, result);
            }
        }
        Ok(())
    }

    /// Hands every write the writer machine completed its answer, and
    /// lets go of its source.
    pub(super) fn complete_puts(&mut self) {
        loop {
            let completion = self.events.writer.borrow_mut().poll_completion();
            let Some(completion) = completion else { break };
            self.release_region_hold(completion.value.region);
            completion.value.waiter.send(completion.outcome);
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
fn send_failure(events: &Events, peer: PeerId, status: sys::ucs_status_t) -> RdmaError {
    if events.tearing_down.get() {
        RdmaError::ShuttingDown
    } else {
        RdmaError::backend(format!(
            "ucx: write to {peer} failed: {}",
            status_text(status)
        ))
    }
}

/// A write's send ended: recorded for the loop, which tells the writer.
unsafe extern "C" fn on_put_sent(
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
    events.put_sends.borrow_mut().push((record.write, status));
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
