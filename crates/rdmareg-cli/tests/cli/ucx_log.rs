//! UCX's own log lines never reach the standard output of `rdmareg`, which
//! scripts read: they go to standard error, unless the caller chose a
//! destination with `UCX_LOG_FILE`.
//!
//! An environment variable with the `UCX_` prefix that UCX does not know
//! makes UCX warn (naming the variable) when the first engine creates its
//! context, in the consumer and in the owner process alike.

use std::process::{Command, Output};

/// A variable UCX does not know; its name is in UCX's warning.
const UNKNOWN_UCX_VARIABLE: &str = "UCX_RDMAREG_NO_SUCH_SETTING";

fn demo(configure: impl FnOnce(&mut Command)) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_rdmareg"));
    command
        .env_remove("RUST_LOG")
        .env_remove("UCX_LOG_FILE")
        .env_remove("UCX_WARN_UNUSED_ENV_VARS")
        .env_remove("UCX_LOG_LEVEL")
        .env(UNKNOWN_UCX_VARIABLE, "1")
        .args([
            "demo",
            "--transport",
            "tcp",
            "--size",
            "64K",
            "--count",
            "2",
            "--plain",
        ]);
    configure(&mut command);
    command.output().expect("rdmareg runs")
}

#[test]
fn ucx_warnings_go_to_stderr_and_leave_stdout_to_the_report() {
    let output = demo(|_| {});
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "the demo failed:\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
    );
    assert!(
        stdout.contains("verification passed: 2 ranges"),
        "the report is on stdout:\n{stdout}"
    );
    assert!(
        !stdout.contains(UNKNOWN_UCX_VARIABLE) && !stdout.contains("UCX  WARN"),
        "UCX's warning reached stdout:\n{stdout}"
    );
    assert!(
        stderr.contains(UNKNOWN_UCX_VARIABLE),
        "UCX's warning about {UNKNOWN_UCX_VARIABLE} is on stderr:\n{stderr}"
    );
}

#[test]
fn a_ucx_log_file_the_caller_chose_is_left_alone() {
    let dir = std::env::temp_dir().join(format!("rdmareg-ucx-log-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    // `%p` is the process id: the owner process gets a file of its own.
    let output = demo(|command| {
        command.env("UCX_LOG_FILE", dir.join("ucx.%p.log"));
    });
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let logged: String = std::fs::read_dir(&dir)
        .expect("the scratch directory")
        .filter_map(|entry| std::fs::read_to_string(entry.ok()?.path()).ok())
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        output.status.success(),
        "the demo failed:\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
    );
    assert!(
        logged.contains(UNKNOWN_UCX_VARIABLE),
        "UCX's warning is in the chosen file:\n{logged}"
    );
    assert!(
        !stdout.contains(UNKNOWN_UCX_VARIABLE) && !stderr.contains(UNKNOWN_UCX_VARIABLE),
        "UCX's warning went to the file only:\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
    );
}
