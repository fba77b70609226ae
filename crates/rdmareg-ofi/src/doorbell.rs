//! The doorbell: how a submitter wakes the progress thread, and only when it
//! sleeps.
//!
//! The loop stores `parked = true`, fences, then looks at its queues once
//! more before it sleeps in `poll` on the doorbell's eventfd (and the
//! completion queue's wait descriptor, when the provider has one). A
//! submitter pushes, fences, then reads `parked`. With both fences `SeqCst`
//! one side always sees the other: the loop finds the command, or the
//! submitter sees `parked` and writes the eventfd, which stays readable until
//! the loop drains it. The submitter that rings swaps `parked` back, so a
//! burst costs one write; while the loop spins a submission costs only the
//! push.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering, fence};

/// The progress thread's wake-up line.
#[derive(Debug)]
pub(crate) struct Doorbell {
    fd: OwnedFd,
    parked: AtomicBool,
}

impl Doorbell {
    pub(crate) fn new() -> io::Result<Doorbell> {
        // SAFETY: eventfd takes no pointers; the flags are valid constants.
        let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(Doorbell {
            fd,
            parked: AtomicBool::new(false),
        })
    }

    pub(crate) fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Submitter side, after a push: wake the loop if it sleeps.
    pub(crate) fn ring_if_parked(&self) {
        fence(Ordering::SeqCst);
        if self.parked.load(Ordering::Relaxed) && self.parked.swap(false, Ordering::SeqCst) {
            self.ring();
        }
    }

    /// Wake the loop unconditionally.
    pub(crate) fn ring(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to an eventfd this struct
        // owns; the only possible failure (EAGAIN, counter saturated) leaves
        // the fd readable anyway.
        let _ = unsafe { libc::write(self.fd.as_raw_fd(), (&raw const one).cast(), 8) };
    }

    /// Loop side: announce the intent to sleep; look at the queues again
    /// after this, and [`unpark`](Self::unpark) instead of sleeping if they
    /// hold work.
    pub(crate) fn announce_park(&self) {
        self.parked.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    pub(crate) fn unpark(&self) {
        self.parked.store(false, Ordering::SeqCst);
    }

    /// Loop side: consume pending rings; answers how many there were.
    pub(crate) fn drain(&self) -> u64 {
        let mut count: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from an eventfd this struct
        // owns; non-blocking, so an empty counter answers EAGAIN.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), (&raw mut count).cast(), 8) };
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
        assert_eq!(bell.drain(), 0);
    }

    #[test]
    fn a_parked_loop_is_rung_once_per_park() {
        let bell = Doorbell::new().unwrap();
        bell.announce_park();
        bell.ring_if_parked();
        bell.ring_if_parked();
        assert_eq!(bell.drain(), 1);
        assert_eq!(bell.drain(), 0);
    }
}
