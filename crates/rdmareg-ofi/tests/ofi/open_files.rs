//! Starting an engine raises the process's soft open-file limit to its
//! hard one, as the UCX engine does: every peer connection costs a
//! descriptor, and libfabric 1.17's tcp listener bounds neither the
//! connections it holds nor how long one may stay silent, so at the default
//! soft limit (1,024) a peer holding idle connections shut honest ones out.

use crate::common;

use rdmareg_backend::own_process::in_own_process;
use rdmareg_ofi::{OfiEngine, Provider};

/// In a process of its own (the raise happens once per process): lowers
/// the soft limit, starts a tcp engine, and finds the soft limit at the
/// hard one.
#[test]
fn starting_an_engine_raises_the_open_file_limit() {
    in_own_process(|| {
        common::init_tracing();
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `limit` is a valid, writable rlimit for the call.
        let read = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
        assert_eq!(read, 0);
        let hard = limit.rlim_max;
        assert!(hard > 256, "a hard limit of {hard} leaves nothing to raise");
        limit.rlim_cur = 256;
        // SAFETY: lowering the soft limit needs no privilege and affects
        // only this process, which runs no other test.
        let lowered = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
        assert_eq!(lowered, 0);
        let engine = OfiEngine::start(common::config(Provider::Tcp)).expect("starts");
        // SAFETY: as the first read.
        let read = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
        assert_eq!(read, 0);
        assert_eq!(limit.rlim_cur, hard);
        engine.shutdown_blocking();
    });
}
