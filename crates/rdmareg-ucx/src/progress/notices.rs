//! Notices over UCX (see the engine kit's `notices`).
//!
//! A reader sends each notice as one active message ([`NOTICE_AM_ID`]) on
//! its served endpoint to the owner, whatever lane its reads took: the
//! direct lane's reads are one-sided, so the notice is the only message
//! the owner gets. The message goes eager only, as the payload, with the
//! reply flag so the owner's handler learns the connection; it is owned by
//! a record that lives until UCX completes the send. The caller hears as
//! soon as the send is posted: UCX has taken the notice then.
//!
//! A read with a notice (`Command::GetWithNotice`) carries it in its
//! waiter; when the read succeeds the waiter queues it in
//! `Engine::notices_due`, and the thread sends it at the next drain of
//! its records, before the caller hears of the read.
//!
//! The release of a descriptor lease travels the same way, as a message
//! of the same series (`notices::wire`'s kind 1, the lease key's region
//! and capability); the owner's handler hands it to the engine kit's owner,
//! which counts it once per connection and sender, and never to the
//! notice board.
//!
//! The owner's handler feeds every other message to the engine's notice board;
//! a rendezvous message (which an honest reader never sends) is dropped
//! and counted as malformed, since taking it would mean holding UCX's
//! data past the handler.

use std::ffi::c_void;

use bytes::Bytes;
use rdmareg_core::{PeerId, RdmaError};
use rdmareg_engine::notices::wire;
use ucx_sys as sys;

use super::Engine;
use super::events::Events;
use super::serve::reply_endpoint;
use super::ucp::{SendMode, send_active_message};
use crate::command::Reply;
use crate::read_protocol::{NOTICE_AM_ID, ServedKey};
use crate::status::{PtrStatus, backend_error};

/// A notice being sent: the message UCX reads until the send completes.
struct NoticeSend {
    events: *const Events,
    message: Vec<u8>,
}

impl Engine {
    /// Sends `notice` (within the bound: the front checked it) to `peer`.
    pub(super) fn send_notice(&mut self, peer: PeerId, notice: Bytes, reply: Reply<()>) {
        let sender = self.signals.notice_sender.0;
        self.send_message(peer, reply, |sequence| {
            wire::encode(sender, sequence, &notice)
        });
    }

    /// Sends the release of the lease whose key is `packed_key` to `peer`,
    /// as a message of the notice series (module docs of `leases`).
    pub(super) fn send_release(&mut self, peer: PeerId, packed_key: Bytes, reply: Reply<()>) {
        let key = match ServedKey::decode_lease(&packed_key) {
            Ok(key) => key,
            Err(_) => {
                let _ = reply.send(Err(RdmaError::InvalidKey));
                return;
            }
        };
        let sender = self.signals.notice_sender.0;
        self.send_message(peer, reply, |sequence| {
            Ok(wire::encode_release(
                sender,
                sequence,
                key.region_id,
                &key.capability,
            ))
        });
    }

    /// Sends the message `encode` makes from the next sequence number of
    /// this engine's notice series to `peer`.
    fn send_message(
        &mut self,
        peer: PeerId,
        reply: Reply<()>,
        encode: impl FnOnce(u64) -> Result<Vec<u8>, RdmaError>,
    ) {
        if self.events.tearing_down.get() {
            // No endpoint is opened once teardown began.
            let _ = reply.send(Err(RdmaError::ShuttingDown));
            return;
        }
        let endpoint = match self.endpoint_for(peer) {
            Ok((endpoint, _)) => endpoint,
            Err(err) => {
                let _ = reply.send(Err(err));
                return;
            }
        };
        let sequence = self.events.notice_sequence.get() + 1;
        let message = match encode(sequence) {
            Ok(message) => message,
            Err(err) => {
                let _ = reply.send(Err(err));
                return;
            }
        };
        self.events.notice_sequence.set(sequence);
        let record = Box::into_raw(Box::new(NoticeSend {
            events: &*self.events,
            message,
        }));
        // SAFETY: on the worker's thread; `endpoint` is live (endpoints
        // close only between commands); the message lives in `record`
        // until the send ends, and `record` until its callback ran (or
        // teardown frees it after the worker is gone).
        let status = unsafe {
            send_active_message(
                endpoint.raw(),
                NOTICE_AM_ID,
                &[],
                (*record).message.as_ptr(),
                (*record).message.len(),
                SendMode::EagerOnly,
                true,
                on_notice_sent,
                record.cast::<c_void>(),
            )
        };
        // UCX has taken the notice once the send is posted: the caller
        // hears so now, not when the bytes have left (notices are not
        // acknowledged, so a later failure is only logged).
        let outcome = match status {
            PtrStatus::Pending(_) => {
                self.events
                    .notice_records
                    .borrow_mut()
                    .insert(record as usize);
                Ok(())
            }
            ended => {
                // No callback will run.
                // SAFETY: made by Box::into_raw above, not held by UCX.
                drop(unsafe { Box::from_raw(record) });
                match ended {
                    PtrStatus::Failed(code) => Err(backend_error(code, "sending a notice")),
                    _ => Ok(()),
                }
            }
        };
        // Not a hand-over: nothing comes back for a notice, so the loop
        // has no reason to yield for one.
        let _ = reply.send(outcome);
    }
}

impl Engine {
    /// Sends the notices whose reads succeeded since the last call.
    pub(super) fn send_notices_due(&mut self) {
        if self.notices_due.borrow().is_empty() {
            return;
        }
        let due = std::mem::take(&mut *self.notices_due.borrow_mut());
        for notice in due {
            self.send_notice(notice.peer, notice.notice, notice.reply);
        }
    }
}

/// A notice's send ended.
unsafe extern "C" fn on_notice_sent(
    request: *mut c_void,
    status: sys::ucs_status_t,
    user_data: *mut c_void,
) {
    // SAFETY: `user_data` is the `NoticeSend` boxed for this very send;
    // this callback runs once per send, so it is reclaimed once.
    let send = unsafe { Box::from_raw(user_data.cast::<NoticeSend>()) };
    // SAFETY: the events record outlives the worker.
    let events = unsafe { &*send.events };
    events
        .notice_records
        .borrow_mut()
        .remove(&(user_data as usize));
    if status != sys::UCS_OK {
        tracing::debug!(
            error = %backend_error(status, "sending a notice"),
            "a notice was not delivered"
        );
    }
    // SAFETY: a completed request of this worker, returned once; UCX
    // allows freeing a request from its own completion callback.
    unsafe { sys::ucp_request_free(request) };
}

/// The owner's handler of [`NOTICE_AM_ID`]: the message goes to the
/// engine's notice board, under the address of the connection's reply
/// endpoint.
///
/// # Safety
/// Installed with `arg` = the engine's `Events`, which outlives the worker.
pub(super) unsafe extern "C" fn on_notice(
    arg: *mut c_void,
    _header: *const c_void,
    _header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: `arg` is the engine's boxed `Events` (see `Engine::start`),
    // alive until after the worker is destroyed.
    let events = unsafe { &*arg.cast::<Events>() };
    // SAFETY: UCX passes a valid parameter record for the call's duration.
    let param = unsafe { &*param };
    let from = reply_endpoint(param).map_or(0, |ep| ep as usize);
    let rendezvous = param.recv_attr & u64::from(sys::UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    let message: &[u8] = if rendezvous || data.is_null() || length == 0 {
        // Not a message this engine takes: counted as malformed.
        &[]
    } else {
        // SAFETY: an eager message's `length` bytes at `data` are readable
        // for the handler's duration, and the slice does not outlive it.
        unsafe { std::slice::from_raw_parts(data.cast::<u8>(), length) }
    };
    if wire::is_release(message) {
        receive_release(events, from, message);
    } else if let Some(board) = &events.notices {
        let _ = board.receive(from, message);
    }
    sys::UCS_OK
}

/// A release arrived on the connection `from`: the owner counts it.
fn receive_release(events: &Events, from: usize, message: &[u8]) {
    let release = match wire::decode_release(message) {
        Ok(release) => release,
        Err(err) => {
            tracing::debug!(error = %err, "a malformed lease release was dropped");
            return;
        }
    };
    let mut owner = events.owner.borrow_mut();
    owner.set_time(std::time::Instant::now());
    owner.handle_release(from, release.sender, release.region, &release.capability);
}

/// Frees the records of notice sends UCX never completed. Returns how
/// many there were.
///
/// # Safety
/// The worker the sends were posted on is destroyed: no callback of it can
/// run any more.
pub(super) unsafe fn close_notices(events: &Events) -> usize {
    let records: Vec<usize> = events.notice_records.borrow_mut().drain().collect();
    for &record in &records {
        // SAFETY: every address in the set was made by `Box::into_raw` of
        // a `NoticeSend` whose callback never ran (a callback removes its
        // record first), and the worker is gone: reclaimed once, here.
        drop(unsafe { Box::from_raw(record as *mut NoticeSend) });
    }
    if let Some(board) = &events.notices {
        board.close();
    }
    records.len()
}
