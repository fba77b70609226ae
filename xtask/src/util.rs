//! Small shared helpers: the task error type, the workspace location, and
//! running child processes with their command line echoed.
//!
//! Every child command is printed before it runs so a failing CI log shows
//! exactly what to re-run by hand.

use std::ffi::OsStr;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A task failure: one human-readable message, printed by `main`.
pub struct Error(String);

/// Result of every task.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An error with the given message.
    pub fn msg(message: impl Into<String>) -> Self {
        Error(message.into())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Adds what was being attempted to a lower-level error.
pub trait Context<T> {
    /// Wraps the error as `"{what}: {error}"`.
    fn context(self, what: impl fmt::Display) -> Result<T>;
}

impl<T, E: fmt::Display> Context<T> for std::result::Result<T, E> {
    fn context(self, what: impl fmt::Display) -> Result<T> {
        self.map_err(|e| Error(format!("{what}: {e}")))
    }
}

/// Returns early with an [`Error`] built from a format string.
macro_rules! bail {
    ($($arg:tt)*) => {
        return Err($crate::util::Error::msg(format!($($arg)*)))
    };
}
pub(crate) use bail;

/// The workspace root (the directory holding the top-level `Cargo.toml`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// The directory provisioned tools go to (the UCX wheel, NIXL's
/// virtualenv, fuzz corpora); builds go to [`build_dir`].
///
/// Always `<workspace>/target`, whatever `CARGO_TARGET_DIR` says: the
/// `rdmareg-ucx-sys` build script looks for the provisioned UCX at exactly this path.
pub fn target_dir() -> PathBuf {
    workspace_root().join("target")
}

/// `CARGO_TARGET_DIR` when it is set and not empty.
pub fn target_dir_override() -> Option<PathBuf> {
    std::env::var_os("CARGO_TARGET_DIR")
        .filter(|dir| !dir.is_empty())
        .map(PathBuf::from)
}

/// The target directory cargo builds in: `CARGO_TARGET_DIR` when set (a
/// relative one taken from the workspace root, where [`cargo`] runs),
/// else `<workspace>/target`. `cargo xtask ci` sets it to its build cache
/// ([`crate::build_cache`]). The tasks that build in a directory of their
/// own (`asan`, `vendored`, `package`, `fuzz`) use one below this.
pub fn build_dir() -> PathBuf {
    match target_dir_override() {
        Some(dir) => workspace_root().join(dir),
        None => target_dir(),
    }
}

/// Renders a command line for echoing.
fn display(cmd: &Command) -> String {
    let mut line = String::new();
    for (key, value) in cmd.get_envs() {
        if let Some(value) = value {
            line.push_str(&format!(
                "{}={} ",
                key.to_string_lossy(),
                value.to_string_lossy()
            ));
        }
    }
    line.push_str(&cmd.get_program().to_string_lossy());
    for arg in cmd.get_args() {
        line.push(' ');
        line.push_str(&arg.to_string_lossy());
    }
    line
}

/// Runs `cmd` with inherited stdio, failing unless it exits successfully.
pub fn run(cmd: &mut Command) -> Result<()> {
    let line = display(cmd);
    eprintln!("$ {line}");
    let status = cmd.status().context(format!("cannot start `{line}`"))?;
    if !status.success() {
        bail!("`{line}` failed ({status})");
    }
    Ok(())
}

/// Runs `cmd` quietly and returns its stdout, or `None` when it cannot be
/// started or exits unsuccessfully. For probes whose absence is normal.
pub fn probe(cmd: &mut Command) -> Option<String> {
    let output = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    if !output.status.success() {
        return None;
    }
    String::from_utf8(output.stdout).ok()
}

/// A `cargo` command using the same cargo that runs this xtask.
pub fn cargo<I, S>(args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(args).current_dir(workspace_root());
    cmd
}

/// Formats a wall time for step reports: `1m05.3s` or `4.21s`.
pub fn format_duration(elapsed: Duration) -> String {
    let secs = elapsed.as_secs_f64();
    if secs >= 60.0 {
        let minutes = (secs / 60.0).floor();
        format!("{minutes:.0}m{:04.1}s", secs - minutes * 60.0)
    } else {
        format!("{secs:.2}s")
    }
}

/// Runs `body`, returning its result and how long it took.
pub fn timed<T>(body: impl FnOnce() -> T) -> (T, Duration) {
    let start = Instant::now();
    let value = body();
    (value, start.elapsed())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_under_a_minute_show_seconds() {
        assert_eq!(format_duration(Duration::from_millis(4210)), "4.21s");
    }

    #[test]
    fn durations_over_a_minute_show_minutes_and_seconds() {
        assert_eq!(format_duration(Duration::from_millis(65_300)), "1m05.3s");
    }

    #[test]
    fn context_prefixes_the_error() {
        let failed: std::result::Result<(), &str> = Err("no such file");
        let err = failed.context("reading ucp.h").unwrap_err();
        assert_eq!(err.to_string(), "reading ucp.h: no such file");
    }

    #[test]
    fn workspace_root_holds_the_workspace_manifest() {
        let manifest = std::fs::read_to_string(workspace_root().join("Cargo.toml")).unwrap();
        assert!(manifest.contains("[workspace]"));
    }
}
