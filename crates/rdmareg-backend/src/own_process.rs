//! Running one test in a process of its own.
//!
//! A test that measures the whole process (threads, memory, descriptors) is
//! wrong beside other tests of its binary, as `cargo test` runs them;
//! [`in_own_process`] re-runs the binary filtered to the one test.

use std::process::Command;

/// Set in the child to the name of the test it must run.
const CHILD_VARIABLE: &str = "RDMAREG_OWN_PROCESS_TEST";

/// Bytes of the child's output quoted in a failure.
const QUOTED_TAIL: usize = 4000;

/// Runs `body`, the whole of a `#[test]`, in a process that runs no other
/// test: here under cargo-nextest or in the child, else in a child started
/// for this test, named by its thread.
///
/// # Panics
/// Outside a test's thread, or if the child cannot be started, did not run
/// exactly this test, or failed; the message quotes its output's end.
pub fn in_own_process(body: impl FnOnce()) {
    let current = std::thread::current();
    let filter = match current.name() {
        Some(name) if name != "main" => name,
        _ => panic!(
            "in_own_process runs the whole of a #[test], on the thread the harness names after it"
        ),
    };
    let alone_already = std::env::var("NEXTEST_EXECUTION_MODE").as_deref()
        == Ok("process-per-test")
        || is_child_for(filter);
    if alone_already {
        body();
        return;
    }
    run_in_child(filter);
}

/// Whether this process is the child [`run_in_child`] started for the
/// test `filter`.
pub fn is_child_for(filter: &str) -> bool {
    std::env::var(CHILD_VARIABLE).as_deref() == Ok(filter)
}

/// Starts the test binary again, filtered to exactly the test `filter` with
/// one test thread, as its child ([`is_child_for`]); the child's outcome
/// becomes the caller's.
///
/// # Panics
/// If the child cannot be started, did not run exactly that test, or
/// failed; the message quotes the end of its output.
pub fn run_in_child(filter: &str) {
    let exe = std::env::current_exe().expect("the test binary's path");
    let output = Command::new(exe)
        .args([filter, "--exact", "--nocapture", "--test-threads", "1"])
        .env(CHILD_VARIABLE, filter)
        .output()
        .expect("the child test process starts");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() || !stdout.contains("test result: ok. 1 passed") {
        panic!(
            "{filter} failed in its own process ({}):\n--- stdout (end) ---\n{}\n--- stderr (end) ---\n{}",
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
