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

/// The name libtest knows the test `name` of the module `module_path` by
/// (pass `module_path!()`): its path without the test binary's own name,
/// which is what `--exact` compares a filter with.
pub fn test_path(module_path: &str, name: &str) -> String {
    match module_path.split_once("::") {
        Some((_binary, module)) => format!("{module}::{name}"),
        None => name.to_string(),
    }
}

/// Starts this test binary again, filtered to the test `name` of the module
/// `module_path` and in its child role, with `env` set, its stdout piped and
/// its stderr discarded.
pub fn spawn_child(module_path: &str, name: &str, env: &[(&str, String)]) -> Child {
    Command::new(std::env::current_exe().expect("the test binary"))
        .args([
            test_path(module_path, name).as_str(),
            "--exact",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(CHILD_ROLE, name)
        .envs(env.iter().map(|(key, value)| (key, value)))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("the child process starts")
}
