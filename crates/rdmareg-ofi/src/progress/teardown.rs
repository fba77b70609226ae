//! Teardown: end every read and reply, then deregister what no send reads.
//!
//! Queued commands fail `ShuttingDown`; write receives are withdrawn;
//! reads, reply sends and writes whose receive matched get the teardown
//! timeout, and the rest end only once the provider let go of them (by
//! closing the endpoint). Over `tcp;ofi_rxm` the provider is first let
//! read the connection requests it queued
//! (`Engine::settle_connection_requests`). A `shm` endpoint is parked instead while
//! another `shm` engine of the process is open (`fabric`): its reads are
//! cancelled and each completes once its cancellation was read
//! (`Engine::withdraw_for_parking`). Replies still being sent from an
//! endpoint that stays open keep their leases and regions, and teardown
//! says so.

use std::ffi::c_void;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use rdmareg_core::RdmaError;

use crate::engine::Command;
use crate::fabric::{ADDR_NOTAVAIL, EndpointEnd};

use super::*;

/// How long past the provider's connection-event interval teardown goes on
/// reading completions so the provider reads its queued connection
/// requests (`Engine::settle_connection_requests`).
const CONNECTION_REQUESTS_MARGIN: Duration = Duration::from_millis(2);
/// The longest teardown waits for that, whatever interval is configured.
const CONNECTION_REQUESTS_MAX: Duration = Duration::from_secs(1);

impl Engine {
    pub(super) fn teardown(&mut self, ring: &Receiver<Command>, control: &Receiver<Command>) {
        self.signals.lifecycle.close();
        self.closing = true;
        // Every read's receive is posted (or queued): none completes before
        // the provider gives it back, and each ends `ShuttingDown` unless
        // its bytes arrive or its deadline passed.
        self.consumer.shutdown();
        while let Ok(command) = control.try_recv() {
            self.dispatch_closing(command);
        }
        while let Ok(command) = ring.try_recv() {
            self.dispatch_closing(command);
        }
        // Reads in flight get the teardown timeout to finish, and so do
        // writes whose receive matched (`serve_writes`).
        self.withdraw_write_receives();
        let until = Instant::now() + self.settings.teardown_timeout;
        for slot in std::mem::take(&mut self.unposted) {
            self.provider_released(slot, Err(RdmaError::ShuttingDown));
        }
        // Replies never posted end now (their leases with them); replies
        // being sent get the same time as reads.
        for at in std::mem::take(&mut self.unsent) {
            self.send_done(at, Err((0, "teardown".into())));
        }
        while (self.consumer.in_flight() > 0
            || self.writer.in_flight() > 0
            || !self.sends.is_empty()
            || self.write_receives_posted())
            && Instant::now() < until
        {
            if !self.turn() {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        // Puts hold no source the provider reads (each chunk sent a copy):
        // they end now.
        self.end_writes_at_teardown();
        self.settle_connection_requests();
        if self.fabric.park_at_teardown() {
            self.withdraw_for_parking();
        } else {
            self.close_under_the_rest();
        }
        let closed = self.fabric.close_or_park_endpoint() == EndpointEnd::Closed;
        if !closed {
            self.answer_notices_in_flight();
            // Request receives may still be written, and replies still being
            // sent still read their sources: a parked endpoint keeps them
            // until it is closed; any other open endpoint, for good. (A
            // reply's region keeps its lease: it stays registered.)
            let receives = PostedReceives {
                buffers: self.request_buffers.drain().map(|(_, b)| b).collect(),
                discards: self.discards.drain().map(|(_, discard)| discard).collect(),
                sends: self.sends.drain().map(|(_, send)| send).collect(),
            };
            if let Err(receives) = self.fabric.keep_while_parked(Box::new(receives)) {
                std::mem::forget(receives);
            }
        }
        // Every region is unmapped once no reply is sent from it (on a
        // closed endpoint none is) and no read writes into it.
        self.owner.shutdown();
        if closed {
            self.owner.transport_closed();
        }
        self.run_owner_actions(ADDR_NOTAVAIL);
        let ids: Vec<u64> = self.regions.keys().copied().collect();
        for id in ids {
            self.deregister_if_idle(id);
        }
        for (fi_addr, _) in std::mem::take(&mut self.av) {
            self.fabric.remove_peer(fi_addr);
        }
        let live = self.signals.lifecycle.live_registrations();
        if live != 0 {
            tracing::error!(live, "teardown left regions registered");
        }
        self.signals
            .lifecycle
            .finish_teardown(self.regions.keys().copied());
        self.signals.notices.close();
        for reply in self.shutdown_replies.drain(..) {
            let _ = reply.send(());
        }
    }

    /// Before the endpoint closes, lets the provider take the connection
    /// requests it queued, so none is freed without its `fi_info`
    /// (`Fabric::connection_requests_taken`). Over `tcp;ofi_rxm` a request
    /// is queued when `fi_trywait` runs the connection manager (parking
    /// does) and read only by a completion-queue read at least the
    /// provider's interval after its last look; so unless `fi_trywait`
    /// finds nothing queued, the loop turns, reading completions and
    /// calling no `fi_trywait`, for that interval and
    /// [`CONNECTION_REQUESTS_MARGIN`] more: by then the provider has read
    /// its queue, and nothing queues a request between that read and the
    /// close. An interval set past [`CONNECTION_REQUESTS_MAX`] is waited
    /// for only that long.
    ///
    /// A connection accepted whose request has not arrived yet is not
    /// queued, and libfabric 1.17 keeps it (its socket and handle) when
    /// the endpoint closes; no call of its API reaches it.
    fn settle_connection_requests(&mut self) {
        let Some(interval) = self.fabric.connection_requests_read_within else {
            return;
        };
        if self.fabric.connection_requests_taken() {
            return;
        }
        let until =
            Instant::now() + (interval + CONNECTION_REQUESTS_MARGIN).min(CONNECTION_REQUESTS_MAX);
        while Instant::now() < until {
            if !self.turn() {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        tracing::debug!(
            waited = ?interval.min(CONNECTION_REQUESTS_MAX),
            "teardown let the provider read the connection requests it queued"
        );
    }

    /// A notice still being sent may or may not arrive: before its send is
    /// kept for good (a parked or unclosable endpoint), its caller hears
    /// the engine is shutting down rather than nothing.
    fn answer_notices_in_flight(&mut self) {
        for send in self.sends.values_mut() {
            if let Some(reply) = send.notice_reply.take() {
                let _ = reply.send(Err(RdmaError::ShuttingDown));
            }
        }
    }

    /// Teardown of an endpoint that may be closed: closes it under the
    /// reads and sends still in flight, then completes them.
    pub(super) fn close_under_the_rest(&mut self) {
        if !self.sends.is_empty() {
            if self.fabric.close_endpoint() {
                // The provider reads no source of a send on a closed
                // endpoint: the leases can go.
                let left: Vec<usize> = self.sends.keys().copied().collect();
                for at in left {
                    self.send_done(at, Err((0, "endpoint closed at teardown".into())));
                }
            } else {
                tracing::error!(
                    sends = self.sends.len(),
                    "the endpoint did not close; replies being sent keep their regions registered"
                );
                self.answer_notices_in_flight();
                for (_, send) in self.sends.drain() {
                    std::mem::forget(send);
                }
                for (_, buffer) in self.request_buffers.drain() {
                    std::mem::forget(buffer);
                }
                for (_, context) in self.discards.drain() {
                    std::mem::forget(context);
                }
            }
        }
        if self.consumer.in_flight() > 0 {
            if self.fabric.close_endpoint() {
                // The provider touches no destination of a read on a closed
                // endpoint: now the rest can complete (`Timeout` past their
                // deadline).
                for slot in 0..self.ops.len() {
                    self.provider_released(slot, Err(RdmaError::ShuttingDown));
                }
            } else {
                // The provider may still write these destinations: their
                // results (and regions) are kept from safe code for good.
                tracing::error!(
                    reads = self.consumer.in_flight(),
                    "the endpoint did not close; reads in flight stay unanswered and their regions registered"
                );
                for op in self.ops.iter_mut().filter_map(Option::take) {
                    std::mem::forget(op);
                }
                for (_, buffer) in self.request_buffers.drain() {
                    std::mem::forget(buffer);
                }
            }
        }
    }

    /// Teardown of a `shm` endpoint that will be parked, not closed,
    /// because another `shm` engine of the process is open (`fabric`).
    ///
    /// In libfabric 1.17's `shm` a receive's buffer is written only by its
    /// own endpoint's progress, and `fi_cancel` withdraws an unmatched
    /// receive at once. So each read's receive is cancelled and the read
    /// completes once the cancellation (or completion) was read; a discard
    /// receive is posted for its reply, which the other `shm` engines take
    /// by progressing parked endpoints, since a sender's large message
    /// completes only once its receiver took it (`docs/ofi.md`).
    ///
    /// A matched receive that does not end within the teardown timeout (a
    /// segmented transfer) never completes and its destination stays
    /// registered. Replies being sent are waited for while they keep
    /// completing (at least the teardown timeout or [`SENDS_IDLE_MAX`], and
    /// that long past the last); those still unfinished keep their leases
    /// and sources registered.
    pub(super) fn withdraw_for_parking(&mut self) {
        if self.consumer.in_flight() == 0 && self.sends.is_empty() {
            return;
        }
        self.withdrawing = true;
        let mut never_posted = Vec::new();
        for slot in 0..self.ops.len() {
            let Some(op) = self.ops[slot].as_mut() else {
                continue;
            };
            if op.posted {
                let context = (&raw mut op.context.space).cast::<c_void>();
                self.fabric.cancel(context);
            } else {
                never_posted.push(slot);
            }
        }
        for slot in never_posted {
            self.unposted.retain(|&s| s != slot);
            self.provider_released(slot, Err(RdmaError::ShuttingDown));
        }
        // Replies being sent are waited for while they keep completing (the
        // open `shm` engines progress parked receivers). A completion read
        // after the endpoint is parked is dropped with its lease, and its
        // region stays registered for good.
        let least = if self.sends.is_empty() {
            WITHDRAW_MIN
        } else {
            SENDS_IDLE_MAX
        };
        let mut until = Instant::now() + self.settings.teardown_timeout.max(least);
        let mut sends_left = self.sends.len();
        while (self.consumer.in_flight() > 0 || !self.sends.is_empty()) && Instant::now() < until {
            if !self.turn() {
                std::thread::sleep(Duration::from_micros(50));
            }
            if self.sends.len() < sends_left {
                until = until.max(Instant::now() + SENDS_IDLE_MAX);
            }
            sends_left = self.sends.len();
        }
        self.withdrawing = false;
        if self.consumer.in_flight() > 0 {
            tracing::error!(
                reads = self.consumer.in_flight(),
                "reads whose transfer had begun did not end; they stay unanswered and their \
                 regions registered"
            );
            for op in self.ops.iter_mut().filter_map(Option::take) {
                std::mem::forget(op);
            }
        }
        if !self.sends.is_empty() {
            tracing::warn!(
                sends = self.sends.len(),
                "replies still being sent from a parked endpoint keep their regions registered"
            );
        }
    }
}
