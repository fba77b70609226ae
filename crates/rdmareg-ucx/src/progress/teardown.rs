//! Teardown of the progress thread, in an order that frees nothing in use.
//!
//! Every caller gets its reply, and no memory is freed while a transport can
//! still touch it.
//!
//! # Order
//!
//! 1. Mark the engine closed (submitters refuse new work) and fail queued
//!    commands `ShuttingDown`; queued unmaps complete at the end, with what
//!    really happened to their region.
//! 2. **Let reads finish**, this engine's own and the replies it serves, for
//!    at most three quarters of the teardown timeout; a read that finishes
//!    here returns its real outcome.
//! 3. Fail the reads still waiting for a reply `ShuttingDown`, close every
//!    endpoint (forcibly with peer error handling, so UCX ends running
//!    receives) and progress until UCX releases the requests, for the rest
//!    of the timeout.
//! 4. Destroy the workers: no transport touches registered memory and no
//!    callback runs from here. Only now do reads UCX never released fail
//!    `ShuttingDown`.
//! 5. Unmap every region still registered and complete parked unmaps; the
//!    live count reaches zero unless `ucp_mem_unmap` itself failed.
//! 6. Clean up the context and reply to the shutdown callers.

use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use rdmareg_core::RdmaError;

use super::Engine;
use crate::command::{Command, Reply};

/// The share of the teardown timeout that reads in flight get to finish
/// before endpoints are closed under them; the rest is for UCX to release
/// what the closes cancelled, which it normally does at once.
const DRAIN_SHARE: f64 = 0.75;

/// Sleep between progress calls that found nothing to do during teardown,
/// so waiting for a slow peer does not burn a core.
const IDLE_NAP: Duration = Duration::from_micros(200);

/// The command queues teardown keeps serving while it waits.
struct Queues<'a> {
    ring: &'a Receiver<Command>,
    control: &'a Receiver<Command>,
    unmaps: &'a mut Vec<(u64, Reply<()>)>,
}

impl Engine {
    /// Tears everything down; see the module docs for the order.
    pub(super) fn teardown(mut self, ring: &Receiver<Command>, control: &Receiver<Command>) {
        self.signals.lifecycle.close();
        // Copies on callers' threads that started before `closed` was set
        // end here; none starts after.
        self.signals.caller_copies.withdraw_everything();
        let mut queued_unmaps: Vec<(u64, Reply<()>)> = Vec::new();
        self.refuse_queued(ring, control, &mut queued_unmaps);

        let started = Instant::now();
        let deadline = started + self.settings.timings.teardown_timeout;
        let mut queues = Queues {
            ring,
            control,
            unmaps: &mut queued_unmaps,
        };

        let reads_before = self.ops.active();
        let leases_before = self.leases_outstanding();
        let drain_until = started + self.settings.timings.teardown_timeout.mul_f64(DRAIN_SHARE);
        let drained = self.settle(drain_until, &mut queues, |e| {
            e.ops.active() == 0
                && e.leases_outstanding() == 0
                && e.events.writer.borrow().in_flight() == 0
        });
        if reads_before > 0 || leases_before > 0 {
            tracing::debug!(
                reads = reads_before,
                served_replies = leases_before,
                reads_left = self.ops.active(),
                served_replies_left = self.leases_outstanding(),
                drained,
                "let reads in flight finish before closing endpoints"
            );
        }

        self.events.tearing_down.set(true);
        self.fail_all_awaiting();
        self.drain_events();
        self.close_all_endpoints();
        self.drain_events();
        let released = self.settle(deadline, &mut queues, |e| {
            e.ops.active() == 0 && e.peers.closing_count() == 0
        });
        if !released {
            tracing::warn!(
                reads = self.ops.active(),
                closes = self.peers.closing_count(),
                "UCX did not release every request within the teardown timeout; destroying the worker anyway"
            );
        }
        let (refused, dropped) = {
            let owner = self.events.owner.borrow();
            (
                owner.refused_requests(),
                self.events.dropped_messages.get() + owner.dropped_requests(),
            )
        };
        if refused > 0 || dropped > 0 {
            tracing::info!(
                refused_requests = refused,
                dropped_messages = dropped,
                "reads refused or messages dropped over this engine's life"
            );
        }

        let Engine {
            worker,
            direct,
            ops,
            peers,
            events,
            regions,
            signals,
            mut shutdown_replies,
            mut release,
            context,
            ..
        } = self;
        // The worker first: after this no transport touches registered memory
        // and no callback can run; then the reads UCX never released are
        // failed, and the records callbacks pointed into are freed.
        events.worker.set(std::ptr::null_mut());
        drop(worker);
        // The direct lane's workers too; its context stays for the unmaps.
        let direct_context = direct.map(|lane| lane.destroy_workers());
        let mut ops = ops;
        ops.fail_all_after_worker_destroyed();
        drop(ops);
        drop(peers);
        // SAFETY: the worker was destroyed above.
        let unfinished = unsafe { super::serve::close_owner(&events) };
        if unfinished > 0 {
            tracing::debug!(
                unfinished,
                "freed the records of reply sends UCX never completed"
            );
        }
        // SAFETY: as above.
        let unended = unsafe { super::puts::close_puts(&events) };
        if unended > 0 {
            tracing::debug!(unended, "write sends UCX never ended end with the engine");
        }
        // SAFETY: as above.
        let unsent = unsafe { super::notices::close_notices(&events) };
        if unsent > 0 {
            tracing::debug!(unsent, "notices UCX never sent end with the engine");
        }
        drop(events);

        let mut still_registered = Vec::new();
        for (id, region) in regions {
            // Before any unmap completes: no same-host read of the region
            // counts from here on (`regions`).
            let mut draining = region.draining_slot;
            if let (Some(slot), Some(table)) = (region.release_slot, release.as_mut()) {
                if region.direct_writable {
                    table.retire_writable(slot);
                    draining = Some(slot);
                } else {
                    table.retire(slot);
                }
            }
            // A same-host write that checked the slot before ends first.
            let writers_gone = match (draining, release.as_mut()) {
                (Some(slot), Some(table)) => loop {
                    if table.writers_gone(slot) {
                        break true;
                    }
                    if Instant::now() >= deadline {
                        break false;
                    }
                    std::thread::sleep(IDLE_NAP);
                },
                _ => true,
            };
            if !writers_gone {
                let err = RdmaError::backend(format!(
                    "ucx: region {id} was still being written by a same-host writer at teardown"
                ));
                tracing::error!(
                    region = id,
                    "a same-host writer held a region past the teardown timeout; it stays registered"
                );
                still_registered.push(id);
                for waiter in region.unmap_waiters.into_iter().flatten() {
                    let _ = waiter.send(Err(err.clone()));
                }
                continue;
            }
            let direct_result = match (region.direct_memh, &direct_context) {
                // SAFETY: the handle came from the lane's context and is
                // unmapped at most once (the table is consumed here).
                (Some(memh), Some(lane)) => unsafe { lane.unmap(memh) },
                _ => Ok(()),
            };
            // SAFETY: each handle came from `Context::map` on this context and
            // is unmapped at most once (the table is consumed here).
            let result = unsafe { context.unmap(region.memh) }.and(direct_result);
            match &result {
                Ok(()) => {
                    signals.lifecycle.deregistered();
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
            let result = if still_registered.contains(&id) {
                Err(RdmaError::ShuttingDown)
            } else {
                Ok(())
            };
            let _ = reply.send(result);
        }
        drop(direct_context);
        drop(context);

        // Anything that slipped in meanwhile.
        for command in control.try_iter().chain(ring.try_iter()) {
            match command {
                Command::Shutdown { reply } => shutdown_replies.push(reply),
                Command::Unmap {
                    id,
                    reply: Some(reply),
                } => {
                    let result = if still_registered.contains(&id) {
                        Err(RdmaError::ShuttingDown)
                    } else {
                        Ok(())
                    };
                    let _ = reply.send(result);
                }
                other => other.refuse(),
            }
        }
        // From here the submitters complete unmaps, from this record.
        signals
            .lifecycle
            .finish_teardown(still_registered.iter().copied());
        tracing::debug!(
            live = signals.lifecycle.live_registrations(),
            "UCX engine torn down"
        );
        for reply in shutdown_replies {
            let _ = reply.send(());
        }
    }

    /// Progresses (expiring deadlines, finishing closes, serving queued
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

    /// Replies this engine is still sending to peers from its regions.
    fn leases_outstanding(&self) -> usize {
        self.events.owner.borrow().leases_in_flight()
    }

    /// Serves queued commands during teardown.
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
