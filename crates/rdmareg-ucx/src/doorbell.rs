//! The doorbell: how a submitter wakes the progress thread, and only when it
//! sleeps.
//!
//! # Protocol
//!
//! The progress loop, before it sleeps, stores `parked = true`, issues a
//! `SeqCst` fence and then looks at the command queues once more; it sleeps in
//! `poll` on the worker's event fd *and* this doorbell's eventfd. A submitter
//! pushes its command, issues a `SeqCst` fence and then reads `parked`. The
//! two fences order the pairs (store `parked`, read queue) and (push, read
//! `parked`), so at least one side sees the other: either the loop finds the
//! command and does not sleep, or the submitter sees `parked` and writes the
//! eventfd — which stays readable until the loop reads it, so a write that
//! lands before the loop reaches `poll` still wakes it. The submitter that
//! rings swaps `parked` back to `false`, so a burst of submissions costs one
//! write. The loop's bounded park timeout is the backstop, not the mechanism.
//!
//! # Why an eventfd and not `ucp_worker_signal`
//!
//! `ucp_worker_signal` is documented as safe from any thread, but it needs
//! the worker handle, which would then have to outlive every submitter — and
//! the engine's rule is that raw UCX handles never leave the progress thread
//! (a submitter racing teardown would signal a destroyed worker). An eventfd
//! owned by this struct lives as long as anyone can ring it, and costs the
//! same (one write plus one `poll` wake, a few microseconds here). That cost is
//! why submitters ring only a parked loop: while it spins, a push (~100 ns) is
//! all a submission costs.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering, fence};

/// The progress thread's wake-up line; shared by the thread and every
/// submitter.
#[derive(Debug)]
pub(crate) struct Doorbell {
    fd: OwnedFd,
    parked: AtomicBool,
}

impl Doorbell {
    /// A doorbell with a fresh non-blocking eventfd.
    pub(crate) fn new() -> io::Result<Doorbell> {
        // SAFETY: eventfd takes no pointers; the flags are valid constants.
        let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a freshly created descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(Doorbell {
            fd,
            parked: AtomicBool::new(false),
        })
    }

    /// The descriptor the loop polls.
    pub(crate) fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Submitter side, called after a push: wake the loop if it sleeps.
    pub(crate) fn ring_if_parked(&self) {
        fence(Ordering::SeqCst);
        if self.parked.load(Ordering::Relaxed) && self.parked.swap(false, Ordering::SeqCst) {
            self.ring();
        }
    }

    /// Wake the loop unconditionally (shutdown, full ring).
    pub(crate) fn ring(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to an eventfd this struct
        // owns. A failure can only be EAGAIN (counter saturated, so the fd is
        // readable anyway); nothing to handle.
        let _ = unsafe {
            libc::write(
                self.fd.as_raw_fd(),
                (&one as *const u64).cast::<libc::c_void>(),
                8,
            )
        };
    }

    /// Loop side: announce the intent to sleep. The caller must look at the
    /// command queues once more after this returns, and call [`Self::unpark`]
    /// instead of sleeping if they hold work.
    pub(crate) fn announce_park(&self) {
        self.parked.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// Loop side: awake again (after `poll`, or instead of it).
    pub(crate) fn unpark(&self) {
        self.parked.store(false, Ordering::SeqCst);
    }

    /// Loop side: consume pending rings so the eventfd stops being readable.
    pub(crate) fn drain(&self) {
        let mut count: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from an eventfd this struct
        // owns; non-blocking, so an empty counter answers EAGAIN.
        let _ = unsafe {
            libc::read(
                self.fd.as_raw_fd(),
                (&mut count as *mut u64).cast::<libc::c_void>(),
                8,
            )
        };
    }

    #[cfg(test)]
    fn pending(&self) -> u64 {
        let mut count: u64 = 0;
        // SAFETY: as in `drain`.
        let n = unsafe {
            libc::read(
                self.fd.as_raw_fd(),
                (&mut count as *mut u64).cast::<libc::c_void>(),
                8,
            )
        };
        if n == 8 { count } else { 0 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spinning_loop_is_not_rung() {
        let bell = Doorbell::new().unwrap();
        bell.ring_if_parked();
        assert_eq!(bell.pending(), 0);
    }

    #[test]
    fn a_parked_loop_is_rung_once_per_park() {
        let bell = Doorbell::new().unwrap();
        bell.announce_park();
        bell.ring_if_parked();
        bell.ring_if_parked();
        assert_eq!(bell.pending(), 1);
        assert_eq!(bell.pending(), 0, "reading the count clears it");
    }

    #[test]
    fn unpark_stops_further_rings() {
        let bell = Doorbell::new().unwrap();
        bell.announce_park();
        bell.unpark();
        bell.ring_if_parked();
        assert_eq!(bell.pending(), 0);
    }
}
