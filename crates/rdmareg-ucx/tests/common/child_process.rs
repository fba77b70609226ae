//! A test that plays its role in a child process: it starts this test
//! binary again, filtered to itself, with [`CHILD_ROLE`] naming it, and
//! the child, seeing its name there, plays the role instead of the test.

#![allow(dead_code)] // Each test binary uses its own subset.

use std::process::{Child, Command, Stdio};

/// The test a child process plays the role of, by name.
pub const CHILD_ROLE: &str = "RDMAREG_LIST_REPLIES_CHILD";

/// Whether this process is the child the test `name` started.
pub fn is_child(name: &str) -> bool {
    std::env::var(CHILD_ROLE).as_deref() == Ok(name)
}

/// Starts this test binary again, filtered to the test `name` and in its
/// child role, with `env` set, its stdout piped and its stderr discarded.
pub fn spawn_child(name: &str, env: &[(&str, String)]) -> Child {
    Command::new(std::env::current_exe().expect("the test binary"))
        .args([name, "--exact", "--nocapture", "--test-threads", "1"])
        .env(CHILD_ROLE, name)
        .envs(env.iter().map(|(key, value)| (key, value)))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("the child process starts")
}

/// Set in a child started by [`in_own_process`] to the test it runs.
const OWN_PROCESS: &str = "RDMAREG_UCX_TEST_OWN_PROCESS";

/// Runs `scenario` in a process of its own: this test binary again,
/// filtered to the test `name`, or directly when this process is that
/// child. For scenarios that count what the whole process holds (open
/// descriptors, threads), which other tests running beside them in one
/// process (`cargo test`) would disturb. The parent fails with the child's
/// exit status and the end of its output.
pub fn in_own_process(name: &str, scenario: impl FnOnce()) {
    if std::env::var(OWN_PROCESS).as_deref() == Ok(name) {
        scenario();
        return;
    }
    let output = Command::new(std::env::current_exe().expect("the test binary"))
        .args([name, "--exact", "--nocapture", "--test-threads", "1"])
        .env(OWN_PROCESS, name)
        .output()
        .expect("the child process starts");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.contains("test result: ok. 1 passed"),
        "{name} failed in its own process ({}):\n--- stdout (end) ---\n{}\n--- stderr (end) ---\n{}",
        output.status,
        tail(&stdout),
        tail(&stderr),
    );
}

/// The last few thousand bytes of `text`, cut at a character boundary.
fn tail(text: &str) -> &str {
    let mut start = text.len().saturating_sub(4000);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}
