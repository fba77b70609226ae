//! libfabric 1.17's `shm` provider installs SIGINT and SIGTERM handlers
//! that end the process as it opens a process's first endpoint; an engine
//! leaves the program's own actions in place.

use crate::common;

use rdmareg_backend::own_process::in_own_process;
use rdmareg_ofi::{OfiEngine, Provider};

extern "C" fn program_handler(_: libc::c_int) {}

/// The handler installed for `signal` now.
fn handler_of(signal: libc::c_int) -> libc::sighandler_t {
    // SAFETY: `sigaction` is plain data, for which all zeroes is valid.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: a valid signal number, no new action, `action` writable.
    let read = unsafe { libc::sigaction(signal, std::ptr::null(), &mut action) };
    assert_eq!(read, 0);
    action.sa_sigaction
}

/// A program that set its SIGINT and SIGTERM handlers before starting
/// `shm` engines finds them still set after: before, the first `shm`
/// endpoint replaced them with libfabric's, which ended the process on the
/// signal instead of letting the program shut down in order.
#[test]
fn shm_engines_leave_the_programs_termination_handlers() {
    in_own_process(|| {
        common::init_tracing();
        let ours = program_handler as *const () as libc::sighandler_t;
        for signal in [libc::SIGINT, libc::SIGTERM] {
            // SAFETY: a valid signal number and a handler that does
            // nothing; this process runs no other test and sends no signal.
            unsafe { libc::signal(signal, ours) };
        }
        let first = OfiEngine::start(common::config(Provider::Shm)).expect("starts");
        let second = OfiEngine::start(common::config(Provider::Shm)).expect("starts");
        assert_eq!(handler_of(libc::SIGTERM), ours, "SIGTERM");
        assert_eq!(handler_of(libc::SIGINT), ours, "SIGINT");
        second.shutdown_blocking();
        first.shutdown_blocking();
    });
}
