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

use std::process::Command;

/// Set in the child to the test path it must run.
const CHILD_VARIABLE: &str = "RDMAREG_TESTS_ISOLATED_CHILD";

/// Bytes of the child's output quoted in a failure.
const QUOTED_TAIL: usize = 4000;

/// Run `scenario` in a child process when called from the test whose path
/// (as `module_path!()` spells it, plus `::` and the test's name) is
/// `test_path`; in that child, run it directly.
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
    if std::env::var(CHILD_VARIABLE).as_deref() == Ok(filter) {
        scenario();
        return;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let output = Command::new(exe)
        .args([filter, "--exact", "--nocapture", "--test-threads", "1"])
        .env(CHILD_VARIABLE, filter)
        .output()
        .expect("the child test process starts");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let ran_once = stdout.contains("test result: ok. 1 passed");
    if !output.status.success() || !ran_once {
        panic!(
            "isolated scenario {filter} failed in its child process ({}):\n--- stdout (end) ---\n{}\n--- stderr (end) ---\n{}",
            output.status,
            tail(&stdout),
            tail(&stderr)
        );
    }
}

/// The last [`QUOTED_TAIL`] bytes of `text`, cut at a character boundary.
fn tail(text: &str) -> &str {
    let mut start = text.len().saturating_sub(QUOTED_TAIL);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
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
