//! The doorbell: how a submitter wakes the progress thread, and only when it
//! sleeps.
//!
//! # Protocol
//!
//! The progress loop, before it sleeps, calls [`Doorbell::announce_park`]
//! (store `parked = true`, `SeqCst` fence) and then looks at its command
//! lanes once more; it sleeps in `poll` on its transport's descriptor *and*
//! this doorbell's eventfd. A submitter pushes its command, then calls
//! [`Doorbell::ring_if_parked`] (`SeqCst` fence, read `parked`). The two
//! fences order the pairs (store `parked`, read lanes) and (push, read
//! `parked`), so at least one side sees the other: either the loop finds the
//! command and does not sleep, or the submitter sees `parked` and writes the
//! eventfd, which stays readable until the loop drains it, so a write made
//! before the loop reaches `poll` still wakes it. The submitter that rings
//! swaps `parked` back to `false`, so a burst of submissions costs one write.
//! The loop's bounded park timeout is a backstop, not the mechanism.
//!
//! # Why an eventfd owned here
//!
//! Transports offer their own wake-up calls (`ucp_worker_signal`,
//! `fi_cq_signal`), but those need the transport's handle, which would then
//! have to outlive every submitter; the engines' rule is that transport
//! handles never leave the progress thread (a submitter racing teardown would
//! signal a destroyed object). An eventfd owned by this struct lives as long
//! as anyone can ring it. A write plus a `poll` wake costs microseconds,
//! which is why submitters ring only a parked loop: while it spins, a push is
//! all a submission costs.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering, fence};

/// The progress thread's wake-up line, shared by the thread and every
/// submitter.
#[derive(Debug)]
pub struct Doorbell {
    fd: OwnedFd,
    parked: AtomicBool,
}

impl Doorbell {
    /// A doorbell with a fresh non-blocking, close-on-exec eventfd.
    ///
    /// # Errors
    /// The system's error when no eventfd can be created (descriptor limit).
    pub fn new() -> io::Result<Doorbell> {
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

    /// The descriptor the loop polls for reading.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Submitter side, called after a push: wakes the loop if it sleeps.
    pub fn ring_if_parked(&self) {
        fence(Ordering::SeqCst);
        if self.parked.load(Ordering::Relaxed) && self.parked.swap(false, Ordering::SeqCst) {
            self.ring();
        }
    }

    /// Wakes the loop whether or not it sleeps (shutdown).
    pub fn ring(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to an eventfd this struct
        // owns. The only possible failure, EAGAIN (counter saturated), leaves
        // the descriptor readable anyway: nothing to handle.
        let _ = unsafe { libc::write(self.fd.as_raw_fd(), (&raw const one).cast(), 8) };
    }

    /// Loop side: announces the intent to sleep. The caller must look at its
    /// lanes once more after this returns, and call [`Self::unpark`] instead
    /// of sleeping if they hold work.
    pub fn announce_park(&self) {
        self.parked.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// Loop side: awake again (after `poll`, or instead of it).
    pub fn unpark(&self) {
        self.parked.store(false, Ordering::SeqCst);
    }

    /// Loop side: consumes pending rings so the eventfd stops being
    /// readable; returns how many there were.
    pub fn drain(&self) -> u64 {
        let mut count: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from an eventfd this struct
        // owns; non-blocking, so an empty counter returns EAGAIN.
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
        assert_eq!(bell.drain(), 0, "draining clears the count");
    }

    #[test]
    fn unpark_stops_further_rings() {
        let bell = Doorbell::new().unwrap();
        bell.announce_park();
        bell.unpark();
        bell.ring_if_parked();
        assert_eq!(bell.drain(), 0);
    }

    #[test]
    fn an_unconditional_ring_wakes_a_spinning_loop() {
        let bell = Doorbell::new().unwrap();
        bell.ring();
        assert_eq!(bell.drain(), 1);
    }
}
