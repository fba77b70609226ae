//! The doorbell's park/ring protocol under concurrent submitters.
//!
//! A loop shaped like the engines' (drain the lanes, announce the park, look
//! at the lanes once more, sleep on the eventfd) serves submitters that
//! each wait for their command's answer before pushing the next, so the
//! loop goes idle and parks between most commands. Its park timeout is far
//! longer than any answer may take: a lost wake-up shows as a round trip
//! that waits for the timeout instead of the doorbell.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::channel::oneshot;
use rdmareg_engine::command::Command;
use rdmareg_engine::doorbell::Doorbell;
use rdmareg_engine::lanes::{Overflow, Receivers, Submitter, lanes};
use rdmareg_engine::lifecycle::Lifecycle;

/// How long the loop sleeps when nobody rings: the backstop a lost
/// wake-up would fall back on.
const PARK_TIMEOUT: Duration = Duration::from_secs(60);
/// The longest a round trip may take with the doorbell working (scheduling
/// on a loaded machine included).
const ROUND_TRIP_MAX: Duration = Duration::from_secs(5);
const SUBMITTERS: u64 = 4;
const ROUNDS: u64 = 1_500;

/// Serves unmaps (answering each `Ok`) until `stop`; returns how many
/// times it slept in `poll`.
fn serve(receivers: Receivers<()>, lifecycle: Arc<Lifecycle>, stop: Arc<AtomicBool>) -> u64 {
    let bell = lifecycle.doorbell();
    let mut sleeps = 0;
    let answer = |command: Command<()>| {
        if let Command::Unmap {
            reply: Some(reply), ..
        } = command
        {
            let _ = reply.send(Ok(()));
        }
    };
    while !stop.load(Ordering::SeqCst) {
        let mut worked = false;
        while let Ok(command) = receivers.control.try_recv() {
            answer(command);
            worked = true;
        }
        while let Ok(command) = receivers.ring.try_recv() {
            answer(command);
            worked = true;
        }
        if worked {
            continue;
        }
        bell.announce_park();
        if !receivers.is_empty() || stop.load(Ordering::SeqCst) {
            bell.unpark();
            continue;
        }
        let mut fd = libc::pollfd {
            fd: bell.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live, initialised pollfd record.
        unsafe { libc::poll(&raw mut fd, 1, PARK_TIMEOUT.as_millis() as i32) };
        sleeps += 1;
        bell.unpark();
        if fd.revents != 0 {
            bell.drain();
        }
    }
    sleeps
}

/// Pushes an unmap of `id` (onto the control lane or the ring) and waits
/// for its answer, at most [`ROUND_TRIP_MAX`]; false if it did not come.
fn round_trip(submitter: &Submitter<()>, id: u64, through_control: bool) -> bool {
    let started = Instant::now();
    let (reply, mut answer) = oneshot::channel();
    let command = Command::Unmap {
        id,
        reply: Some(reply),
    };
    if through_control {
        submitter.send_control(command).unwrap();
    } else {
        futures::executor::block_on(submitter.submit(command, Overflow::ToControlLane)).unwrap();
    }
    loop {
        match answer.try_recv() {
            Ok(Some(result)) => {
                result.unwrap();
                return true;
            }
            Ok(None) if started.elapsed() < ROUND_TRIP_MAX => std::thread::yield_now(),
            Ok(None) => return false,
            Err(canceled) => panic!("unmap {id} was dropped unanswered: {canceled}"),
        }
    }
}

/// Many submitters, on both lanes, against a loop that parks whenever it
/// runs dry: every command wakes it, none waits for the park timeout.
#[test]
fn racing_submitters_never_wait_for_the_park_timeout() {
    let lifecycle = Arc::new(Lifecycle::new(Doorbell::new().unwrap()));
    // A small ring, so submitters also meet it full.
    let (submitter, receivers) = lanes::<()>(2, Arc::clone(&lifecycle));
    let submitter = Arc::new(submitter);
    let stop = Arc::new(AtomicBool::new(false));
    let server = {
        let lifecycle = Arc::clone(&lifecycle);
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || serve(receivers, lifecycle, stop))
    };
    let stuck = Arc::new(AtomicU64::new(0));
    let submitters: Vec<_> = (0..SUBMITTERS)
        .map(|n| {
            let submitter = Arc::clone(&submitter);
            let stuck = Arc::clone(&stuck);
            std::thread::spawn(move || {
                for round in 0..ROUNDS {
                    if !round_trip(&submitter, n * ROUNDS + round, round % 5 == 0) {
                        stuck.fetch_add(1, Ordering::SeqCst);
                        return;
                    }
                }
            })
        })
        .collect();
    for handle in submitters {
        handle.join().unwrap();
    }
    stop.store(true, Ordering::SeqCst);
    lifecycle.doorbell().ring();
    let sleeps = server.join().unwrap();
    let stuck = stuck.load(Ordering::SeqCst);
    assert_eq!(
        stuck, 0,
        "{stuck} commands waited over {ROUND_TRIP_MAX:?} for a loop parked for {PARK_TIMEOUT:?}: \
         wake-ups were lost (the loop slept {sleeps} times)"
    );
    assert!(
        sleeps > ROUNDS / 10,
        "the loop slept only {sleeps} times: the race was hardly run"
    );
}
