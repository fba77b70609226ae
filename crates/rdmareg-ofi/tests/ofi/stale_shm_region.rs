//! An `shm` engine starts even when a region left by a dead process carries
//! this process's id.
//!
//! libfabric 1.17 names an `shm` endpoint's region `<pid>:<uid>:<n>`, `n`
//! counting the process's endpoints from 0, and takes over a region left
//! by a dead process, but judges "dead" by whether a process with the
//! recorded id exists. Process ids wrap (at 32768 by default), so a
//! process that reuses the id of one killed earlier (a test owner killed
//! with SIGKILL, a crashed service) found its own id "alive" and failed
//! `fi_enable` with `FI_EBUSY`: seen in CI as
//! `ofi: fi_enable: Device or resource busy (-16)`.

use crate::common;

use rdmareg_ofi::{OfiEngine, Provider};

#[test]
fn an_shm_engine_starts_over_a_stale_region_that_carries_its_process_id() {
    common::init_tracing();
    // The name of this process's first shm endpoint, left behind as a
    // killed process would leave it (not a region libfabric knows).
    // SAFETY: getuid takes no arguments and cannot fail.
    let uid = unsafe { libc::getuid() };
    let stale = format!("/dev/shm/{}:{uid}:0", std::process::id());
    std::fs::write(&stale, vec![0u8; 4096]).expect("a stale region in /dev/shm");
    let started = OfiEngine::start(common::config(Provider::Shm));
    // libfabric removes the stale region when it refuses it; make sure.
    let _ = std::fs::remove_file(&stale);
    let engine = started.expect("the engine starts over the stale region");
    assert_eq!(engine.live_registrations(), 0);
    engine.shutdown_blocking();
}
