//! Write lists on the served lane: a batch's small PUTs to one owner go out
//! as one active message, answered by one reply.
//!
//! A served PUT sent alone costs a message and a reply; over tcp that is
//! what bounds a batch of small ones. So a batch's PUTs of at most
//! [`MAX_LISTED_WRITE`] bytes to one owner travel together: the header is
//! the engine kit's write list (`rdmareg_engine::served::wire`), one entry
//! per write, and the payload their sources back to back, gathered by UCX
//! from where they lie. The owner checks each entry as a single write
//! (`rdmareg_engine::served::owner::write_lists`) and answers the list
//! once every accepted entry's bytes are in.
//!
//! - **Each write stays its own.** Every entry is its own write in the
//!   writer machine, with its own id, deadline, source hold and result;
//!   only the send is shared, so its end is every entry's send's end, and
//!   a refused entry fails alone.
//! - **Eager only, within bounds.** A list carries at most as many entries
//!   as the worker's header bound allows and [`WRITE_CHUNK`] bytes, as a
//!   single write does, so the owner copies it in its handler and keeps no
//!   receive pending on a writer.
//! - **Replies are matched as single ones are.** An entry of a list reply
//!   completes a write only if it came on the endpoint the list went out
//!   on, names an awaited write and says exactly its length was written.

use std::ffi::c_void;

use rdmareg_core::RdmaError;
use rdmareg_engine::served::wire::encode_write_list_request;
use ucx_sys as sys;

use super::Engine;
use super::puts::{PreparedPut, PutParts, PutSend, PutWaiter, WRITE_CHUNK, on_put_sent};
use super::read_lists::copied_on_this_lane;
use super::replies::ArrivedReply;
use super::ucp::send_gathered;
use crate::read_list::{REQUEST_ENTRY_LEN, entries_within};
use crate::read_protocol::WRITE_LIST_REQUEST_AM_ID;

/// Longest PUT that travels in a write list; a longer one goes alone,
/// where a list would save little beside its bytes.
pub(crate) const MAX_LISTED_WRITE: usize = 64 * 1024;

/// Whether a checked PUT may travel in a write list.
pub(super) fn fits_a_write_list(put: &PreparedPut) -> bool {
    put.len <= MAX_LISTED_WRITE
}

impl Engine {
    /// Sends checked PUTs of at most [`MAX_LISTED_WRITE`] bytes: runs to
    /// one owner as write lists within the bounds, a run of one alone.
    pub(super) fn send_put_lists(&mut self, mut listed: Vec<(PreparedPut, PutWaiter)>) {
        // Stable: each owner's writes keep their order.
        listed.sort_by_key(|(put, _)| put.endpoint as usize);
        let most = entries_within(self.events.max_am_header.get(), REQUEST_ENTRY_LEN);
        let mut run: Vec<(PreparedPut, PutWaiter)> = Vec::new();
        let mut run_bytes = 0usize;
        for (put, waiter) in listed {
            let joins = run.first().is_some_and(|(first, _)| {
                first.endpoint == put.endpoint
                    && run.len() < most
                    && run_bytes + put.len <= WRITE_CHUNK
            });
            if !joins {
                self.send_run(std::mem::take(&mut run));
                run_bytes = 0;
            }
            run_bytes += put.len;
            run.push((put, waiter));
        }
        self.send_run(run);
    }

    /// Sends one run: alone if it is one write, else as a list.
    fn send_run(&mut self, mut run: Vec<(PreparedPut, PutWaiter)>) {
        if run.len() > 1 {
            return self.send_write_list(run);
        }
        if let Some((put, waiter)) = run.pop() {
            self.send_put(put, waiter);
        }
    }

    /// Starts every write of `run` (one owner, within the bounds) in the
    /// writer machine and sends them as one write list.
    fn send_write_list(&mut self, run: Vec<(PreparedPut, PutWaiter)>) {
        let Some((endpoint, peer)) = run.first().map(|(put, _)| (put.endpoint, put.peer)) else {
            return;
        };
        let mut headers = Vec::with_capacity(run.len());
        let mut iov = Vec::with_capacity(run.len());
        let mut writes = Vec::with_capacity(run.len());
        for (put, waiter) in run {
            if let Some(region) = self.regions.get_mut(&put.source_region) {
                region.in_flight += 1;
            }
            let value = put.value(PutParts::single(waiter));
            let posted = self.events.writer.borrow_mut().start(
                endpoint as usize,
                put.target,
                put.due,
                value,
            );
            // `None`: completed at once (teardown began), answered by the
            // caller's `complete_puts`.
            if let Some(write) = posted.request {
                headers.push(write);
                iov.push(sys::ucp_dt_iov_t {
                    buffer: put.source.cast::<c_void>(),
                    length: put.len,
                });
                writes.push(posted.id);
            }
        }
        let Some(header) = encode_write_list_request(&headers) else {
            // No write left to send (teardown began), or more than a list
            // holds (the run's bound keeps it within): none is sent, so
            // each ends now.
            let mut writer = self.events.writer.borrow_mut();
            for &write in &writes {
                writer.send_ended(
                    write,
                    Err(RdmaError::backend("ucx: a write list could not be encoded")),
                );
            }
            return;
        };
        let payload: usize = iov.iter().map(|range| range.length).sum();
        let copied =
            copied_on_this_lane(&self.events, header.len() as u64, payload as u64, iov.len());
        let record = Box::into_raw(Box::new(PutSend {
            events: &*self.events,
            writes,
            iov,
        }));
        // SAFETY: the endpoint is live (looked up this turn; endpoints close
        // only between commands); every range of the vector lies inside its
        // checked, mapped source, held (an unmap waits) until the writer
        // machine completed its write, which is after this send ended; the
        // vector lives in `record`, which lives until the callback or, if
        // none runs, teardown frees it.
        let status = unsafe {
            send_gathered(
                endpoint,
                WRITE_LIST_REQUEST_AM_ID,
                &header,
                &(*record).iov,
                copied,
                on_put_sent,
                record.cast::<c_void>(),
            )
        };
        // SAFETY: `record` was just passed to this send.
        unsafe { self.writes_sent(record, status, peer) };
    }
}

/// UCX's handler for a write list's reply (`WRITE_LIST_REPLY_AM_ID`), on
/// the writer: each entry goes to the writer machine, which decides what
/// it completes.
///
/// # Safety
/// Installed with `arg` = the engine's `Events`, which outlives the worker.
pub(super) unsafe extern "C" fn on_write_list_reply(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    _data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: UCX's arguments to this handler, installed with the engine's
    // `Events` as `arg`.
    let ArrivedReply {
        events,
        arrived_on,
        header,
        ..
    } = unsafe { ArrivedReply::read(arg, header, header_length, param) };
    // A write list's reply carries no payload; whatever came with one is
    // dropped (for a rendezvous, UCX tells the sender), and the writes it
    // acknowledges fail.
    let verdicts =
        events
            .writer
            .borrow_mut()
            .handle_list_reply(arrived_on as usize, header, length as u64);
    match verdicts {
        Ok(verdicts) => {
            for reason in verdicts.into_iter().filter_map(Result::err) {
                tracing::debug!(?reason, "dropped an entry of a write list's reply");
                events.dropped_message();
            }
        }
        Err(err) => {
            tracing::debug!(error = %err, "dropped an undecodable write list reply");
            events.dropped_message();
        }
    }
    sys::UCS_OK
}
