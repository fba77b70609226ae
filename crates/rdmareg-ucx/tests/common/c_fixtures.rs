//! C programs the tests compile and run as peers (raw UCT peers, hostile
//! UCP peers, preloaded shims), built against the UCX the crate links.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The fixture `relative` under `tests/fixtures/`.
pub fn fixture(relative: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(relative)
}

/// Compiles `source` with `args` into `name` under the target's temporary
/// directory and returns its path; panics with the compiler's output when
/// it fails.
///
/// Each test runs in a process of its own under nextest, and they run at
/// the same time: each compiles to a name of its own and renames the result
/// into place, so no process ever runs a file another is still writing
/// ("text file busy"). Callers keep the result in a `OnceLock`, so each
/// process compiles once.
pub fn compile(source: &Path, name: &str, args: &[String]) -> PathBuf {
    let binary = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let unfinished = binary.with_extension(format!("{}.tmp", std::process::id()));
    let output = Command::new(std::env::var_os("CC").unwrap_or_else(|| "cc".into()))
        .arg(source)
        .args(args)
        .arg("-o")
        .arg(&unfinished)
        .output()
        .expect("a C compiler (cc) runs");
    assert!(
        output.status.success(),
        "compiling {} failed:\n{}",
        source.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    fs::rename(&unfinished, &binary).expect("the fixture is renamed into place");
    binary
}

/// The arguments that build against the linked UCX's headers and link its
/// `libraries` (`"uct"`, `"ucp"`, ...) by absolute path.
pub fn against_ucx(libraries: &[&str]) -> Vec<String> {
    let lib = ucx_sys::install::LIB_DIR;
    let mut args = vec![
        format!("-I{}", ucx_sys::install::INCLUDE_DIR),
        format!("-L{lib}"),
        format!("-Wl,-rpath,{lib}"),
    ];
    args.extend(libraries.iter().map(|library| format!("-l{library}")));
    args
}
