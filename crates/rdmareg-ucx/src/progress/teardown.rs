//! Teardown of the progress thread: every reply answered, every UCX object
//! released, in an order that never frees memory a transport can still touch.
//!
//! # Order
//!
//! 1. Mark the engine closed (submitters refuse new work from now on) and
//!    answer queued commands `ShuttingDown`; queued unmaps are answered at
//!    the end, by what really happened to their region.
//! 2. Answer every in-flight GET `ShuttingDown`, close every endpoint
//!    (forcibly with peer error handling, so UCX completes their requests),
//!    and progress until UCX has released the requests and finished the
//!    closes — bounded by the teardown timeout.
//! 3. Destroy the remote keys no request still uses (a key a stuck request
//!    still holds is left to the worker's destruction rather than freed
//!    under it).
//! 4. Destroy the worker: from here no transport can read or write any
//!    registered range.
//! 5. Unmap every region still registered, answering parked unmaps; the live
//!    count reaches zero unless `ucp_mem_unmap` itself failed.
//! 6. Clean up the context, answer the shutdown callers.

use std::sync::atomic::Ordering;
use std::time::Instant;

use crossbeam_channel::Receiver;
use rdmareg_core::RdmaError;

use super::Engine;
use crate::command::{Command, Reply};

impl Engine {
    /// Tears everything down; see the module docs for the order.
    pub(super) fn teardown(mut self, ring: &Receiver<Command>, control: &Receiver<Command>) {
        self.signals.closed.store(true, Ordering::SeqCst);
        let mut queued_unmaps: Vec<(u64, Reply<()>)> = Vec::new();
        self.refuse_queued(ring, control, &mut queued_unmaps);

        for reply in self.ops.take_all_replies() {
            let _ = reply.send(Err(RdmaError::ShuttingDown));
        }
        self.close_all_endpoints();
        self.drain_events();
        let deadline = Instant::now() + self.settings.teardown_timeout;
        while (self.ops.active() > 0 || self.peers.closing_count() > 0) && Instant::now() < deadline
        {
            self.progress();
            self.poll_closing();
            self.refuse_queued(ring, control, &mut queued_unmaps);
        }
        if self.ops.active() > 0 || self.peers.closing_count() > 0 {
            tracing::warn!(
                gets = self.ops.active(),
                closes = self.peers.closing_count(),
                "UCX did not release every request within the teardown timeout; destroying the worker anyway"
            );
        }

        let mut held_keys = 0usize;
        for (rkey, in_flight) in self.rkeys.drain_all() {
            if in_flight == 0 {
                // SAFETY: unused by any request; the worker is still live;
                // drained from the table, so destroyed once.
                unsafe { self.worker.destroy_rkey(rkey) };
            } else {
                held_keys += 1;
            }
        }
        if held_keys > 0 {
            tracing::warn!(
                held_keys,
                "remote keys still used by unreleased requests are left to the worker's destruction"
            );
        }

        let Engine {
            worker,
            ops,
            peers,
            events,
            regions,
            signals,
            mut shutdown_replies,
            context,
            ..
        } = self;
        // The worker first: after this no transport touches registered memory
        // and no callback can run; then the records callbacks pointed into.
        drop(worker);
        drop(ops);
        drop(peers);
        drop(events);

        let mut still_registered = Vec::new();
        for (id, region) in regions {
            // SAFETY: each handle came from `Context::map` on this context and
            // is unmapped at most once (the table is consumed here).
            let result = unsafe { context.unmap(region.memh) };
            match &result {
                Ok(()) => {
                    signals.live_registrations.fetch_sub(1, Ordering::SeqCst);
                }
                Err(err) => {
                    tracing::error!(region = id, error = %err, "region could not be unmapped at teardown; it stays registered");
                    still_registered.push(id);
                }
            }
            for waiter in region.unmap_waiters.into_iter().flatten() {
                let _ = waiter.send(result.clone());
            }
        }
        for (id, reply) in queued_unmaps {
            let answer = if still_registered.contains(&id) {
                Err(RdmaError::ShuttingDown)
            } else {
                Ok(())
            };
            let _ = reply.send(answer);
        }
        drop(context);

        // Anything that slipped in meanwhile.
        for command in control.try_iter().chain(ring.try_iter()) {
            match command {
                Command::Shutdown { reply } => shutdown_replies.push(reply),
                Command::Unmap {
                    id,
                    reply: Some(reply),
                } => {
                    let answer = if still_registered.contains(&id) {
                        Err(RdmaError::ShuttingDown)
                    } else {
                        Ok(())
                    };
                    let _ = reply.send(answer);
                }
                other => other.refuse(),
            }
        }
        tracing::debug!(
            live = signals.live_registrations.load(Ordering::SeqCst),
            "UCX engine torn down"
        );
        for reply in shutdown_replies {
            let _ = reply.send(());
        }
    }

    /// Answers queued commands during teardown.
    fn refuse_queued(
        &mut self,
        ring: &Receiver<Command>,
        control: &Receiver<Command>,
        queued_unmaps: &mut Vec<(u64, Reply<()>)>,
    ) {
        let leftover = self.leftover.take();
        for command in leftover
            .into_iter()
            .chain(control.try_iter())
            .chain(ring.try_iter())
        {
            match command {
                Command::Shutdown { reply } => self.shutdown_replies.push(reply),
                Command::Unmap {
                    id,
                    reply: Some(reply),
                } => queued_unmaps.push((id, reply)),
                other => other.refuse(),
            }
        }
    }
}
