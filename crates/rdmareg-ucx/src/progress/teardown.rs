//! Teardown of the progress thread: every reply answered, every UCX object
//! released, in an order that never frees memory a transport can still touch
//! and never cuts a connection a peer is still answering on when that can be
//! helped.
//!
//! # Order
//!
//! 1. Mark the engine closed (submitters refuse new work from now on) and
//!    answer queued commands `ShuttingDown`; queued unmaps are answered at
//!    the end, by what really happened to their region.
//! 2. Answer every in-flight GET `ShuttingDown`, then **let the GETs finish**
//!    (progressing, expiring deadlines, closing failed endpoints) for at most
//!    three quarters of the teardown timeout.
//! 3. Close every endpoint (forcibly with peer error handling, so UCX
//!    completes what is still in flight) and progress until UCX has released
//!    the requests and finished the closes — bounded by the rest of the
//!    teardown timeout.
//! 4. If this engine closed endpoints under GETs a peer may still be
//!    answering (see `peers`), keep the worker alive until it has been quiet
//!    for [`OWED_REPLY_QUIET`], within the same bound.
//! 5. Destroy the remote keys no request still uses (a key a stuck request
//!    still holds is left to the worker's destruction rather than freed
//!    under it).
//! 6. Destroy the worker: from here no transport can read or write any
//!    registered range.
//! 7. Unmap every region still registered, answering parked unmaps; the live
//!    count reaches zero unless `ucp_mem_unmap` itself failed.
//! 8. Clean up the context, answer the shutdown callers.
//!
//! # Why steps 2 and 4 wait
//!
//! On transports that emulate GET in software (tcp), the *owner* answers a
//! GET by sending the bytes from inside its UCX progress, and UCX 1.22 aborts
//! the owner's process (`ucs_fatal`, "unexpected error") when such a send
//! fails synchronously — which is what happens when the consumer's
//! connection is reset while the owner is still answering or has the request
//! unread. Destroying the worker closes every connection, so an engine that
//! tore down with GETs in flight could kill the processes it was reading
//! from. Step 2 closes that hole for GETs still in flight. Step 4 narrows it
//! for GETs the engine gave up on earlier (deadline, peer removed or
//! re-added): their replies may still be streaming in, and the worker stays
//! up while they do. A peer that answers only after this engine is gone
//! (stopped for longer, or a consumer that crashed) cannot be protected from
//! the consumer side; see the crate docs.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use rdmareg_core::RdmaError;

use super::Engine;
use crate::command::{Command, Reply};

/// How long the worker must have been idle before teardown stops waiting
/// for replies to GETs it gave up on. A peer that is answering keeps the
/// worker busy far more often than this; a peer that resumes from a stop
/// starts answering well within it.
const OWED_REPLY_QUIET: Duration = Duration::from_millis(100);

/// The share of the teardown timeout that in-flight GETs get to finish
/// before endpoints are closed under them; the rest is for UCX to release
/// what the closes cancelled, which it normally does at once.
const DRAIN_SHARE: f64 = 0.75;

/// Sleep between progress calls that found nothing to do during teardown,
/// so waiting for a slow peer does not burn a core.
const IDLE_NAP: Duration = Duration::from_micros(200);

/// The command queues teardown keeps answering while it waits.
struct Queues<'a> {
    ring: &'a Receiver<Command>,
    control: &'a Receiver<Command>,
    unmaps: &'a mut Vec<(u64, Reply<()>)>,
}

impl Engine {
    /// Tears everything down; see the module docs for the order.
    pub(super) fn teardown(mut self, ring: &Receiver<Command>, control: &Receiver<Command>) {
        self.signals.closed.store(true, Ordering::SeqCst);
        let mut queued_unmaps: Vec<(u64, Reply<()>)> = Vec::new();
        self.refuse_queued(ring, control, &mut queued_unmaps);

        for reply in self.ops.take_all_replies() {
            let _ = reply.send(Err(RdmaError::ShuttingDown));
        }
        let started = Instant::now();
        let deadline = started + self.settings.teardown_timeout;
        let mut queues = Queues {
            ring,
            control,
            unmaps: &mut queued_unmaps,
        };

        let gets_before = self.ops.active();
        let drain_until = started + self.settings.teardown_timeout.mul_f64(DRAIN_SHARE);
        let drained = self.settle(drain_until, &mut queues, |e| e.ops.active() == 0);
        if gets_before > 0 {
            tracing::debug!(
                gets = gets_before,
                still_in_flight = self.ops.active(),
                drained,
                "let in-flight GETs finish before closing endpoints"
            );
        }

        self.close_all_endpoints();
        self.drain_events();
        let released = self.settle(deadline, &mut queues, |e| {
            e.ops.active() == 0 && e.peers.closing_count() == 0
        });
        if !released {
            tracing::warn!(
                gets = self.ops.active(),
                closes = self.peers.closing_count(),
                "UCX did not release every request within the teardown timeout; destroying the worker anyway"
            );
        }

        let abandoned = self.peers.abandoned_gets();
        if abandoned > 0 {
            let quiet = self.linger_while_replies_arrive(deadline, &mut queues);
            tracing::debug!(
                abandoned_gets = abandoned,
                quiet,
                "kept the worker up for replies to GETs given up on earlier"
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

    /// Progresses (expiring deadlines, finishing closes, answering queued
    /// commands) until `done` holds or `until` passes; returns whether `done`
    /// held.
    fn settle(
        &mut self,
        until: Instant,
        queues: &mut Queues<'_>,
        done: impl Fn(&Engine) -> bool,
    ) -> bool {
        loop {
            self.drain_events();
            if done(self) {
                return true;
            }
            let now = Instant::now();
            if now >= until {
                return false;
            }
            let worked = self.progress() > 0;
            self.expire_gets(now);
            self.drain_events();
            self.poll_closing();
            self.refuse_queued(queues.ring, queues.control, queues.unmaps);
            if !worked {
                std::thread::sleep(IDLE_NAP);
            }
        }
    }

    /// Progresses until the worker has done nothing for [`OWED_REPLY_QUIET`]
    /// or `until` passes; returns whether it went quiet.
    fn linger_while_replies_arrive(&mut self, until: Instant, queues: &mut Queues<'_>) -> bool {
        let mut last_activity = Instant::now();
        loop {
            let now = Instant::now();
            if now.duration_since(last_activity) >= OWED_REPLY_QUIET {
                return true;
            }
            if now >= until {
                return false;
            }
            if self.progress() > 0 {
                last_activity = Instant::now();
            } else {
                std::thread::sleep(IDLE_NAP);
            }
            self.poll_closing();
            self.refuse_queued(queues.ring, queues.control, queues.unmaps);
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
