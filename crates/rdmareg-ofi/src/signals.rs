//! Termination signals in a process that links libfabric.
//!
//! libfabric 1.17 links the PSM libraries, whose load-time constructors
//! install SIGINT and SIGTERM handlers that print a backtrace and end the
//! process. Tokio's signal handling chains to the handler it finds, so a
//! service that links this crate and waits for SIGTERM to shut down in
//! order is ended by PSM's handler instead, even if it never starts an
//! [`OfiEngine`](crate::OfiEngine). The constructors run before `main`, so
//! only the program can undo them, before it installs handlers of its own.

/// Gives SIGINT and SIGTERM their default action back, undoing the
/// handlers libfabric's PSM libraries installed when the program loaded.
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
