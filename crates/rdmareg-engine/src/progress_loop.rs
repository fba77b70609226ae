//! The progress thread's loop, the same for every driver: commands first,
//! then a turn of the transport; spin while work keeps coming, park when it
//! stops.
//!
//! 1. Drain the control lane, then up to [`RING_BATCH`] ring commands
//!    ([`Receivers::serve`]), each handed to the driver's
//!    [`Handler`].
//! 2. Let the driver progress its transport once ([`Progress::turn`]).
//! 3. If anything happened, go again. Otherwise spin for the spin window,
//!    then let the driver park ([`Progress::park`]): it announces the park
//!    on the doorbell, looks at the lanes once more, and sleeps on the
//!    doorbell and its transport's own wake-up.
//!
//! # Spinning yields
//!
//! While it spins the loop calls `sched_yield` on every turn instead of
//! busy-waiting. The thread it most often shares a CPU with is the caller
//! it just completed a read for: the kernel tends to wake a caller onto its
//! waker's CPU, and a machine with few cores has no other. A pure spin
//! would keep that caller off the CPU for the whole spin window; a yield
//! hands the CPU over at once. The loop stays runnable, so a submission
//! during the window needs no doorbell.
//!
//! # Handing over
//!
//! A turn whose one piece of work left the next move to another thread (a
//! read request sent: the owner moves next; a read completed: its caller;
//! a reply sent: the consumer) yields at once instead of going round once
//! more. A lone read over tcp on two cores involves three threads (caller,
//! consumer loop, owner loop), so two of them share a CPU, and an extra
//! turn would only lengthen the wait for it. Turns with more than one such
//! step do not yield: nobody waits on one result, and the loop has work.

use std::time::{Duration, Instant};

use crate::command::{Command, Handler};
use crate::lanes::{Receivers, Served};

/// Ring commands handled per turn before the transport is progressed again.
pub const RING_BATCH: usize = 64;

/// The timings every driver's loop keeps, from its engine's configuration.
#[derive(Debug, Clone, Copy)]
pub struct Timings {
    /// How long an idle loop spins (yielding) before it parks.
    pub spin_window: Duration,
    /// The longest park when nothing is in flight.
    pub park_timeout: Duration,
    /// The deadline of a GET that names none.
    pub default_get_deadline: Duration,
    /// How long teardown waits for reads in flight and the transport.
    pub teardown_timeout: Duration,
}

/// What a driver's progress thread does besides handling commands.
pub trait Progress: Handler {
    /// Progresses the transport once and handles what it reported.
    fn turn(&mut self) -> Turn;

    /// Sleeps until the doorbell rings or the transport has work; returns
    /// at once if either lane holds a command.
    fn park(&mut self, lanes: &Receivers<Self::DriverCommand>);

    /// The loop has stopped (a shutdown, or every submitter gone);
    /// `leftover` is a ring command it took but did not hand over, which
    /// teardown must complete.
    fn stopped(&mut self, leftover: Option<Command<Self::DriverCommand>>);
}

/// What one [`Progress::turn`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Turn {
    /// Anything happened.
    pub worked: bool,
    /// Exactly one step left the next move to another thread (module docs:
    /// "Handing over").
    pub handed_over: bool,
}

/// Runs `driver`'s loop until a shutdown or until every submitter is gone;
/// parks after `spin_window` without work.
pub fn run<D: Progress>(
    driver: &mut D,
    lanes: &Receivers<D::DriverCommand>,
    spin_window: Duration,
) {
    let mut idle = IdleClock::new(spin_window);
    loop {
        let commands = match lanes.serve(RING_BATCH, |command| command.dispatch(driver)) {
            Served::Continue { worked } => worked,
            Served::Stop { leftover } => {
                driver.stopped(leftover);
                return;
            }
        };
        let turn = driver.turn();
        if commands || turn.worked {
            idle.worked();
            if turn.handed_over && lanes.is_empty() {
                std::thread::yield_now();
            }
            continue;
        }
        if !idle.should_park(Instant::now()) {
            std::thread::yield_now();
            continue;
        }
        driver.park(lanes);
    }
}

/// When an idle loop stops spinning and parks: after `spin_window` without
/// work. Spinning keeps a submission's cost at a queue push while work
/// keeps coming; parking gives the CPU back when it stops.
#[derive(Debug)]
struct IdleClock {
    spin_window: Duration,
    idle_since: Option<Instant>,
}

impl IdleClock {
    /// A clock that parks after `spin_window` idle.
    fn new(spin_window: Duration) -> IdleClock {
        IdleClock {
            spin_window,
            idle_since: None,
        }
    }

    /// Records a turn that did work.
    fn worked(&mut self) {
        self.idle_since = None;
    }

    /// Records a turn without work at `now`; true when the loop should
    /// park (and the clock starts again for after the park).
    fn should_park(&mut self, now: Instant) -> bool {
        let since = *self.idle_since.get_or_insert(now);
        if now.duration_since(since) < self.spin_window {
            return false;
        }
        self.idle_since = None;
        true
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use futures::channel::oneshot;
    use rdmareg_core::{BackendGet, BackendRegion};

    use super::*;
    use crate::command::{BatchReply, NewRegion, Registrations, Reply};
    use crate::doorbell::Doorbell;
    use crate::lanes::{Submitter, lanes};
    use crate::lifecycle::Lifecycle;

    /// Works for `busy_turns` turns, then idles; on its first park it asks
    /// for a shutdown through `submitter`.
    struct Script {
        busy_turns: usize,
        turns: usize,
        parks: usize,
        unmaps: Vec<u64>,
        stopped: bool,
        submitter: Submitter<()>,
        shutdown: Option<oneshot::Receiver<()>>,
    }

    impl Registrations for Script {
        fn map_region(&mut self, _: NewRegion, _: Reply<BackendRegion>) {}
        fn unmap_region(&mut self, id: u64, _: Option<Reply<()>>) {
            self.unmaps.push(id);
        }
    }

    impl Handler for Script {
        type DriverCommand = ();
        fn get(&mut self, _: BackendGet, _: Reply<()>) {}
        fn get_batch(&mut self, _: Vec<BackendGet>, _: BatchReply) {}
        fn driver_command(&mut self, _: ()) {}
        fn shutdown_requested(&mut self, _: oneshot::Sender<()>) {}
    }

    impl Progress for Script {
        fn turn(&mut self) -> Turn {
            self.turns += 1;
            Turn {
                worked: self.turns <= self.busy_turns,
                handed_over: false,
            }
        }
        fn park(&mut self, _: &Receivers<()>) {
            self.parks += 1;
            let (reply, done) = oneshot::channel();
            self.shutdown = Some(done);
            assert!(self.submitter.send_shutdown(reply));
        }
        fn stopped(&mut self, leftover: Option<Command<()>>) {
            assert!(leftover.is_none());
            self.stopped = true;
        }
    }

    #[test]
    fn the_loop_handles_commands_works_then_parks_and_stops() {
        let (submitter, receivers) = lanes(8, Arc::new(Lifecycle::new(Doorbell::new().unwrap())));
        submitter
            .push_now(Command::Unmap { id: 3, reply: None })
            .unwrap();
        let mut script = Script {
            busy_turns: 5,
            turns: 0,
            parks: 0,
            unmaps: Vec::new(),
            stopped: false,
            submitter,
            shutdown: None,
        };
        run(&mut script, &receivers, Duration::ZERO);
        assert_eq!(script.unmaps, [3]);
        assert_eq!(script.parks, 1, "parked once, after the busy turns");
        assert!(script.turns > 5);
        assert!(script.stopped);
    }

    #[test]
    fn the_idle_clock_parks_only_after_its_window() {
        let start = Instant::now();
        let mut clock = IdleClock::new(Duration::from_millis(10));
        assert!(!clock.should_park(start));
        assert!(!clock.should_park(start + Duration::from_millis(9)));
        clock.worked();
        assert!(
            !clock.should_park(start + Duration::from_millis(12)),
            "work resets it"
        );
        assert!(clock.should_park(start + Duration::from_millis(22)));
        assert!(
            !clock.should_park(start + Duration::from_millis(23)),
            "parking resets it"
        );
    }
}
