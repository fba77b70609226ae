//! The admission gate: how work is let in, and how shutdown knows it has all
//! left.
//!
//! Entering takes a ticket *first* and then reads the closed flag (both
//! `SeqCst`); closing stores the flag and then waits for zero tickets. So an
//! entrant either sees the flag or is waited for; a check-then-act on the
//! flag alone could let work in after the closer saw everything drained.
//! One gate guards the registry's work, another each region's readers.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use tokio::sync::Notify;

/// In-flight counter plus closed flag.
#[derive(Debug, Default)]
pub(crate) struct Gate {
    in_flight: AtomicUsize,
    closed: AtomicBool,
    drained: Notify,
}

impl Gate {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Take a ticket if the gate is open. The caller must call
    /// [`leave`](Self::leave) exactly once for every `true`.
    fn try_enter(&self) -> bool {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        if self.closed.load(Ordering::SeqCst) {
            self.leave();
            return false;
        }
        true
    }

    /// Give a ticket back. Returns whether this was the last ticket of a
    /// closed gate (the moment a closer's wait ends).
    fn leave(&self) -> bool {
        let last = self.in_flight.fetch_sub(1, Ordering::SeqCst) == 1;
        if last && self.closed.load(Ordering::SeqCst) {
            self.drained.notify_waiters();
            return true;
        }
        false
    }

    /// A ticket that owns a handle to the gate, for work that outlives the
    /// caller's borrow (a spawned transfer).
    pub(crate) fn enter(self: &Arc<Self>) -> Option<Ticket> {
        self.try_enter().then(|| Ticket {
            gate: Arc::clone(self),
        })
    }

    /// A further ticket for work an admitted caller hands off (a rollback),
    /// taken even if the gate closed since: the caller's ticket already
    /// made shutdown wait. Only call while holding a ticket.
    pub(crate) fn admitted(self: &Arc<Self>) -> Ticket {
        debug_assert!(self.in_flight() > 0, "admitted() without a held ticket");
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        Ticket {
            gate: Arc::clone(self),
        }
    }

    /// A ticket borrowed from the gate.
    pub(crate) fn enter_local(&self) -> Option<LocalTicket<'_>> {
        self.try_enter().then(|| LocalTicket { gate: self })
    }

    /// Refuse new tickets from now on. Returns whether this call closed it
    /// (`false` if it was already closed).
    pub(crate) fn close(&self) -> bool {
        !self.closed.swap(true, Ordering::SeqCst)
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Tickets currently held.
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Whether the gate is closed and no ticket is held.
    pub(crate) fn is_drained(&self) -> bool {
        self.is_closed() && self.in_flight() == 0
    }

    /// Resolve once the gate is closed and every ticket has been given back.
    ///
    /// # Cancel safety
    /// Cancel-safe: it only observes.
    pub(crate) async fn drained(&self) {
        loop {
            let notified = self.drained.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_drained() {
                return;
            }
            notified.await;
        }
    }
}

/// An admitted unit of work; leaving is dropping it.
#[derive(Debug)]
pub(crate) struct Ticket {
    gate: Arc<Gate>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.gate.leave();
    }
}

/// A borrowed ticket. [`release`](Self::release) says whether it was the
/// last one of a closed gate, for owners that act on that moment.
#[derive(Debug)]
pub(crate) struct LocalTicket<'a> {
    gate: &'a Gate,
}

impl LocalTicket<'_> {
    /// Give the ticket back; `true` if it was the last one of a closed gate.
    pub(crate) fn release(self) -> bool {
        let gate = self.gate;
        std::mem::forget(self);
        gate.leave()
    }
}

impl Drop for LocalTicket<'_> {
    fn drop(&mut self) {
        self.gate.leave();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn closed_gate_refuses_and_leaves_no_ticket_behind() {
        let gate = Arc::new(Gate::new());
        assert!(gate.close());
        assert!(!gate.close());
        assert!(gate.enter().is_none());
        assert!(gate.enter_local().is_none());
        assert_eq!(gate.in_flight(), 0);
    }

    #[test]
    fn last_local_ticket_of_a_closed_gate_reports_it() {
        let gate = Gate::new();
        let a = gate.enter_local().unwrap();
        let b = gate.enter_local().unwrap();
        assert!(!a.release());
        gate.close();
        assert!(b.release());
    }

    #[tokio::test(start_paused = true)]
    async fn drained_waits_for_every_admitted_ticket() {
        let gate = Arc::new(Gate::new());
        let ticket = gate.enter().unwrap();
        gate.close();
        let waiter = tokio::spawn({
            let gate = Arc::clone(&gate);
            async move { gate.drained().await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!waiter.is_finished());
        drop(ticket);
        tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .expect("drained resolves once the ticket is back")
            .unwrap();
    }

    #[test]
    fn entrants_racing_a_close_are_either_refused_or_waited_for() {
        // Each admitted entrant records itself before leaving; after the
        // closer has seen the gate drained, nobody may be admitted any more.
        for _ in 0..200 {
            let gate = Arc::new(Gate::new());
            let late = Arc::new(AtomicBool::new(false));
            let closed_and_drained = Arc::new(AtomicBool::new(false));
            std::thread::scope(|s| {
                for _ in 0..3 {
                    let (gate, late, done) = (
                        Arc::clone(&gate),
                        Arc::clone(&late),
                        Arc::clone(&closed_and_drained),
                    );
                    s.spawn(move || {
                        for _ in 0..50 {
                            if let Some(t) = gate.enter() {
                                if done.load(Ordering::SeqCst) {
                                    late.store(true, Ordering::SeqCst);
                                }
                                drop(t);
                            }
                        }
                    });
                }
                let (gate, done) = (Arc::clone(&gate), Arc::clone(&closed_and_drained));
                s.spawn(move || {
                    gate.close();
                    while !gate.is_drained() {
                        std::hint::spin_loop();
                    }
                    done.store(true, Ordering::SeqCst);
                });
            });
            assert!(!late.load(Ordering::SeqCst));
        }
    }
}
