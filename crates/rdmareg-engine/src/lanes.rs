//! The two lanes commands travel on into the progress thread, and the
//! submit future that waits for room.
//!
//! The bounded **ring** carries everything in submission order and gives the
//! hot path backpressure. The unbounded **control lane** carries only what
//! must never wait or be refused for lack of room: shutdown, the
//! compensating unmap of a dropped map, and commands that found the ring
//! full but must proceed (an unmap whose future was dropped while waiting,
//! peer changes).
//!
//! The thread drains the control lane before each ring command, so a control
//! command pushed before a ring command (in happens-before order) is always
//! handled first. The other direction, a control command overtaking ring
//! commands pushed before it, is reached through a full ring or by a
//! command sent with [`Submitter::send_control`], with these effects:
//!
//! - a compensating unmap that overtakes its map finds nothing, and the map
//!   then sees its caller gone and is skipped;
//! - a diverted unmap (its future dropped while the ring was full) runs
//!   before reads into its region still waiting in the ring. Those reads
//!   then find the region gone and are refused
//!   ([`RdmaError::RegionNotFound`]) before anything is written, instead of
//!   being written before the unmap; the unmap's own caller no longer
//!   waits for its result;
//! - a driver command on the control lane (a peer change sent there, or
//!   one [`Submitter::push_now`] diverted from a full ring) is made before
//!   reads still waiting in the ring, which then go by the peer table as it
//!   changed.

use std::future::Future;
use std::ops::ControlFlow;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use crossbeam_channel::{Receiver, Sender, TryRecvError, TrySendError};
use rdmareg_core::RdmaError;

use crate::command::Command;
use crate::lifecycle::Lifecycle;

/// A pair of lanes into a thread whose life is `lifecycle`: the submitter
/// side and the thread's side. The ring holds `ring_capacity` commands.
pub fn lanes<P>(ring_capacity: usize, lifecycle: Arc<Lifecycle>) -> (Submitter<P>, Receivers<P>) {
    let (ring_tx, ring_rx) = crossbeam_channel::bounded(ring_capacity);
    let (control_tx, control_rx) = crossbeam_channel::unbounded();
    (
        Submitter {
            ring: ring_tx,
            control: control_tx,
            lifecycle,
            next_region_id: AtomicU64::new(1),
        },
        Receivers {
            ring: ring_rx,
            control: control_rx,
        },
    )
}

/// The thread's side of the lanes.
#[derive(Debug)]
pub struct Receivers<P> {
    /// Commands in submission order.
    pub ring: Receiver<Command<P>>,
    /// Commands that must not wait; drained before each ring command.
    pub control: Receiver<Command<P>>,
}

/// How a turn of [`Receivers::serve`] ended.
#[derive(Debug)]
pub enum Served<P> {
    /// Go on; `worked` says whether any command was handled.
    Continue {
        /// A command was handled this turn.
        worked: bool,
    },
    /// Stop serving: a shutdown was dispatched, or every submitter is gone.
    /// `leftover` is a ring command taken but not dispatched (a shutdown
    /// was found on the control lane just before it): teardown must complete
    /// it.
    Stop {
        /// The command taken but not handled.
        leftover: Option<Command<P>>,
    },
}

impl<P> Receivers<P> {
    /// Whether both lanes are empty.
    pub fn is_empty(&self) -> bool {
        self.ring.is_empty() && self.control.is_empty()
    }

    /// One turn of command handling: everything on the control lane, then
    /// up to `ring_batch` ring commands, the control lane drained again
    /// before each (module docs: causal order across the lanes). `dispatch`
    /// breaks to stop serving (shutdown).
    pub fn serve(
        &self,
        ring_batch: usize,
        mut dispatch: impl FnMut(Command<P>) -> ControlFlow<()>,
    ) -> Served<P> {
        let stop = Served::Stop { leftover: None };
        let mut worked = !self.control.is_empty();
        if self.drain_control(&mut dispatch).is_break() {
            return stop;
        }
        for _ in 0..ring_batch {
            match self.ring.try_recv() {
                Ok(command) => {
                    worked = true;
                    if self.drain_control(&mut dispatch).is_break() {
                        return Served::Stop {
                            leftover: Some(command),
                        };
                    }
                    if dispatch(command).is_break() {
                        return stop;
                    }
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return stop,
            }
        }
        Served::Continue { worked }
    }

    /// Handles everything on the control lane; breaks on shutdown or when
    /// every submitter is gone.
    fn drain_control(
        &self,
        dispatch: &mut impl FnMut(Command<P>) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        loop {
            match self.control.try_recv() {
                Ok(command) => dispatch(command)?,
                Err(TryRecvError::Empty) => return ControlFlow::Continue(()),
                Err(TryRecvError::Disconnected) => return ControlFlow::Break(()),
            }
        }
    }
}

/// The submitter side of an engine, shared by the engine handle and every
/// backend.
#[derive(Debug)]
pub struct Submitter<P> {
    ring: Sender<Command<P>>,
    control: Sender<Command<P>>,
    lifecycle: Arc<Lifecycle>,
    next_region_id: AtomicU64,
}

impl<P> Submitter<P> {
    /// The engine's life.
    pub fn lifecycle(&self) -> &Lifecycle {
        &self.lifecycle
    }

    /// Whether teardown has begun.
    pub fn is_closed(&self) -> bool {
        self.lifecycle.is_closed()
    }

    /// A region id this engine never used before (ids start at 1).
    pub fn mint_region_id(&self) -> u64 {
        self.next_region_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Pushes onto the unbounded control lane; never waits.
    ///
    /// # Errors
    /// [`RdmaError::ShuttingDown`] once teardown has begun.
    pub fn send_control(&self, command: Command<P>) -> Result<(), RdmaError> {
        if self.is_closed() {
            return Err(RdmaError::ShuttingDown);
        }
        self.control
            .send(command)
            .map_err(|_| RdmaError::ShuttingDown)?;
        self.lifecycle.doorbell().ring_if_parked();
        Ok(())
    }

    /// Pushes the shutdown command and rings whether or not the thread
    /// sleeps. False if the thread is gone already.
    pub fn send_shutdown(&self, reply: futures::channel::oneshot::Sender<()>) -> bool {
        let sent = self.control.send(Command::Shutdown { reply }).is_ok();
        self.lifecycle.doorbell().ring();
        sent
    }

    /// Pushes onto the ring if it has room, else onto the control lane:
    /// never waits, and keeps submission order whenever the ring has room.
    ///
    /// # Errors
    /// [`RdmaError::ShuttingDown`] once teardown has begun.
    pub fn push_now(&self, command: Command<P>) -> Result<(), RdmaError> {
        let mut submit = self.submit(command, Overflow::ToControlLane);
        submit.try_now().unwrap_or(Ok(()))
    }

    /// Pushes onto the bounded ring, yielding to the executor while it is
    /// full; see [`Overflow`] for what dropping the future while it waits
    /// does.
    pub fn submit(&self, command: Command<P>, overflow: Overflow) -> Submit<'_, P> {
        Submit {
            submitter: self,
            command: Some(command),
            overflow,
        }
    }
}

/// What a [`Submit`] does with its command if it is dropped while the ring
/// is still full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overflow {
    /// Nothing: the command was never submitted (maps and GETs, whose
    /// callers then see nothing happen).
    Abandon,
    /// Push it onto the control lane: for commands that must proceed once
    /// issued (unmap). The command then overtakes whatever still waits in
    /// the ring (see the module docs).
    ToControlLane,
}

/// Future of [`Submitter::submit`].
///
/// While the ring is full the future rings the doorbell and yields (waking
/// itself), so a burst larger than the ring waits without blocking an
/// executor thread.
#[derive(Debug)]
pub struct Submit<'a, P> {
    submitter: &'a Submitter<P>,
    command: Option<Command<P>>,
    overflow: Overflow,
}

impl<P> Submit<'_, P> {
    /// One attempt: `None` while the ring is full.
    pub fn try_now(&mut self) -> Option<Result<(), RdmaError>> {
        let command = self.command.take()?;
        if self.submitter.is_closed() {
            return Some(Err(RdmaError::ShuttingDown));
        }
        let doorbell = self.submitter.lifecycle.doorbell();
        match self.submitter.ring.try_send(command) {
            Ok(()) => {
                doorbell.ring_if_parked();
                Some(Ok(()))
            }
            Err(TrySendError::Full(command)) => {
                self.command = Some(command);
                doorbell.ring_if_parked();
                None
            }
            Err(TrySendError::Disconnected(_)) => Some(Err(RdmaError::ShuttingDown)),
        }
    }
}

impl<P> Future for Submit<'_, P> {
    type Output = Result<(), RdmaError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if this.command.is_none() {
            return Poll::Ready(Ok(()));
        }
        match this.try_now() {
            Some(result) => Poll::Ready(result),
            None => {
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        }
    }
}

impl<P> Unpin for Submit<'_, P> {}

impl<P> Drop for Submit<'_, P> {
    fn drop(&mut self) {
        if let (Some(command), Overflow::ToControlLane) = (self.command.take(), self.overflow) {
            let _ = self.submitter.send_control(command);
        }
    }
}

#[cfg(test)]
mod tests {
    use futures::channel::oneshot;

    use super::*;
    use crate::doorbell::Doorbell;

    fn lanes_of(capacity: usize) -> (Submitter<()>, Receivers<()>) {
        lanes(capacity, Arc::new(Lifecycle::new(Doorbell::new().unwrap())))
    }

    fn unmap(id: u64) -> Command<()> {
        Command::Unmap { id, reply: None }
    }

    fn id_of(command: Command<()>) -> u64 {
        match command {
            Command::Unmap { id, .. } => id,
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn region_ids_are_never_reused() {
        let (submitter, _receivers) = lanes_of(1);
        let first = submitter.mint_region_id();
        let second = submitter.mint_region_id();
        assert!(first >= 1 && second > first);
    }

    #[test]
    fn a_full_ring_diverts_a_dropped_unmap_to_control() {
        let (submitter, receivers) = lanes_of(1);
        submitter.push_now(unmap(1)).unwrap();
        let mut waiting = submitter.submit(unmap(2), Overflow::ToControlLane);
        assert!(waiting.try_now().is_none(), "the ring is full");
        drop(waiting);
        assert_eq!(id_of(receivers.ring.try_recv().unwrap()), 1);
        assert_eq!(id_of(receivers.control.try_recv().unwrap()), 2);
    }

    #[test]
    fn a_full_ring_abandons_a_dropped_get() {
        let (submitter, receivers) = lanes_of(1);
        submitter.push_now(unmap(1)).unwrap();
        let mut waiting = submitter.submit(unmap(2), Overflow::Abandon);
        assert!(waiting.try_now().is_none());
        drop(waiting);
        assert_eq!(id_of(receivers.ring.try_recv().unwrap()), 1);
        assert!(receivers.is_empty(), "an abandoned command is never sent");
    }

    #[test]
    fn a_closed_engine_refuses_submissions() {
        let (submitter, receivers) = lanes_of(4);
        submitter.lifecycle().close();
        assert_eq!(submitter.push_now(unmap(1)), Err(RdmaError::ShuttingDown));
        assert_eq!(
            submitter.send_control(unmap(1)),
            Err(RdmaError::ShuttingDown)
        );
        assert!(receivers.is_empty());
    }

    #[test]
    fn shutdown_is_sent_even_after_close() {
        let (submitter, receivers) = lanes_of(4);
        submitter.lifecycle().close();
        let (reply, _result) = oneshot::channel();
        assert!(submitter.send_shutdown(reply));
        assert!(matches!(
            receivers.control.try_recv(),
            Ok(Command::Shutdown { .. })
        ));
        assert_eq!(submitter.lifecycle().doorbell().drain(), 1);
    }

    /// A dispatcher that records unmap ids and stops at a shutdown.
    fn recorder(seen: &mut Vec<u64>) -> impl FnMut(Command<()>) -> ControlFlow<()> + '_ {
        |command| match command {
            Command::Unmap { id, .. } => {
                seen.push(id);
                ControlFlow::Continue(())
            }
            _ => ControlFlow::Break(()),
        }
    }

    #[test]
    fn control_commands_are_served_before_each_ring_command() {
        let (submitter, receivers) = lanes_of(8);
        submitter.push_now(unmap(1)).unwrap();
        submitter.push_now(unmap(2)).unwrap();
        submitter.send_control(unmap(10)).unwrap();
        let mut seen = Vec::new();
        let served = receivers.serve(1, recorder(&mut seen));
        assert!(matches!(served, Served::Continue { worked: true }));
        assert_eq!(seen, [10, 1], "control first, then one ring command");
        let served = receivers.serve(8, recorder(&mut seen));
        assert!(matches!(served, Served::Continue { worked: true }));
        let served = receivers.serve(8, recorder(&mut seen));
        assert!(matches!(served, Served::Continue { worked: false }));
        assert_eq!(seen, [10, 1, 2]);
    }

    #[test]
    fn a_shutdown_found_first_stops_before_the_ring() {
        let (submitter, receivers) = lanes_of(8);
        submitter.push_now(unmap(1)).unwrap();
        let (reply, _result) = oneshot::channel();
        submitter.send_shutdown(reply);
        let mut seen = Vec::new();
        let served = receivers.serve(8, recorder(&mut seen));
        assert!(matches!(served, Served::Stop { leftover: None }));
        assert!(seen.is_empty());
        assert_eq!(receivers.ring.len(), 1, "the ring command is teardown's");
    }

    /// A shutdown that reaches the control lane while a turn is under way
    /// is handled before the next ring command, which is handed back.
    #[test]
    fn a_ring_command_taken_behind_a_shutdown_is_left_over() {
        let (submitter, receivers) = lanes_of(8);
        submitter.push_now(unmap(1)).unwrap();
        submitter.push_now(unmap(2)).unwrap();
        let mut seen = Vec::new();
        let served = receivers.serve(8, |command| match command {
            Command::Unmap { id, .. } => {
                seen.push(id);
                let (reply, _result) = oneshot::channel();
                submitter.send_shutdown(reply);
                ControlFlow::Continue(())
            }
            _ => ControlFlow::Break(()),
        });
        assert_eq!(seen, [1]);
        match served {
            Served::Stop {
                leftover: Some(command),
            } => assert_eq!(id_of(command), 2),
            other => panic!("expected unmap 2 left over, got {other:?}"),
        }
    }

    #[test]
    fn a_parked_thread_is_rung_by_a_push() {
        let (submitter, _receivers) = lanes_of(4);
        submitter.lifecycle().doorbell().announce_park();
        submitter.push_now(unmap(1)).unwrap();
        assert_eq!(submitter.lifecycle().doorbell().drain(), 1);
    }
}
