//! Running a scenario in a child process, for scenarios that can make UCX
//! abort the process.
//!
//! UCX answers some internal inconsistencies with `abort()`, which would
//! take every other test of the binary down with it. [`isolated`] re-runs
//! the calling test's own binary, filtered to that one test, with an
//! environment variable telling the child to run the scenario itself. The
//! parent asserts that the child ran exactly that test and that it passed,
//! and otherwise fails with the child's exit status and the end of its
//! output — a UCX abort becomes an ordinary, readable test failure.

use rdmareg_backend::own_process::{is_child_for, run_in_child};

/// Run `scenario` in a child process when called from the test whose path
/// (as `module_path!()` spells it, plus `::` and the test's name) is
/// `test_path`; in that child, run it directly. Unlike
/// [`in_own_process`](rdmareg_backend::own_process::in_own_process), this
/// starts a child under cargo-nextest too: the point is that an abort ends
/// the child, not that the test runs alone.
///
/// # Panics
/// In the parent, if the child could not be started, did not run exactly
/// this test, or failed (a panic or an abort).
pub fn isolated(test_path: &str, scenario: impl FnOnce()) {
    // `module_path!()` starts with the test binary's crate name, which the
    // harness's filter does not include.
    let filter = test_path
        .split_once("::")
        .map_or(test_path, |(_, rest)| rest);
    if is_child_for(filter) {
        scenario();
        return;
    }
    run_in_child(filter);
}

/// A two-worker Tokio runtime with timers, for isolated scenarios (which are
/// plain `#[test]`s, so the child can run them without the parent holding a
/// runtime).
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a Tokio runtime")
}
