//! Termination signals in a process that links libfabric.
//!
//! libfabric 1.17 installs SIGINT and SIGTERM handlers that end the process
//! in two places, and Tokio's signal handling chains to the handler it
//! finds, so a service waiting for SIGTERM to shut down in order was ended
//! by libfabric's instead:
//!
//! - the PSM libraries it links install theirs as the program loads,
//!   before `main`, even if it never starts an [`OfiEngine`](crate::OfiEngine);
//!   only the program can undo that, with
//!   [`restore_default_termination_signals`] first in `main`;
//! - the `shm` provider installs its own as it opens a process's first
//!   endpoint (to delete its region files, then end the process); the
//!   engine saves both actions before it opens an `shm` endpoint and puts
//!   them back after ([`TerminationActions`]). A process that ends by one
//!   of these signals without its own handler then leaves its regions in
//!   /dev/shm, as after SIGKILL.

/// The signals whose actions the engine keeps.
const TERMINATION: [libc::c_int; 2] = [libc::SIGINT, libc::SIGTERM];

/// The process's actions for SIGINT and SIGTERM at one moment.
pub(crate) struct TerminationActions([libc::sigaction; 2]);

impl TerminationActions {
    /// The actions as they are now.
    pub(crate) fn now() -> TerminationActions {
        // SAFETY: `sigaction` is plain data, for which all zeroes is a
        // valid value.
        let mut actions: [libc::sigaction; 2] = unsafe { std::mem::zeroed() };
        for (signal, action) in TERMINATION.iter().zip(actions.iter_mut()) {
            // SAFETY: a valid signal number, no new action, and `action`
            // is valid and writable for the call.
            unsafe { libc::sigaction(*signal, std::ptr::null(), action) };
        }
        TerminationActions(actions)
    }

    /// Makes these the actions again.
    pub(crate) fn put_back(&self) {
        for (signal, action) in TERMINATION.iter().zip(self.0.iter()) {
            // SAFETY: a valid signal number and an action `sigaction`
            // itself reported for it; the old action is not asked for.
            unsafe { libc::sigaction(*signal, action, std::ptr::null_mut()) };
        }
    }
}

/// Gives SIGINT and SIGTERM their default action back, undoing the
/// handlers libfabric's PSM libraries installed when the program loaded
/// (the `shm` provider's later ones the engine undoes itself).
///
/// Call it first in `main`, before any handler of the program's own (a
/// Tokio `signal(...)` stream, `ctrl_c()`) exists: it would replace those
/// too. The fault signals keep their handlers.
pub fn restore_default_termination_signals() {
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: `signal` is a valid signal number and `SIG_DFL` a valid
        // disposition; `signal(2)` only replaces the process's disposition
        // for it and touches no memory of this program.
        unsafe { libc::signal(signal, libc::SIG_DFL) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// After the call SIGTERM's disposition is the default, whatever the
    /// loaded libraries installed: a handler set here is gone.
    #[test]
    fn termination_signals_get_their_default_action() {
        extern "C" fn handler(_: libc::c_int) {}
        // SAFETY: as above; the handler does nothing, and this test binary
        // sends no SIGTERM.
        unsafe { libc::signal(libc::SIGTERM, handler as *const () as libc::sighandler_t) };
        restore_default_termination_signals();
        // SAFETY: reads the disposition into a zeroed `sigaction`, which
        // `sigaction(2)` fills.
        let current = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            assert_eq!(
                libc::sigaction(libc::SIGTERM, std::ptr::null(), &mut action),
                0
            );
            action.sa_sigaction
        };
        assert_eq!(current, libc::SIG_DFL);
    }
}
