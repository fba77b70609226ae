//! Where the UCX this crate was built against lives, and how to run its
//! tools (`ucx_info`, `ucx_perftest`).
//!
//! The paths are fixed when this crate is compiled (from what the build
//! script found), so they describe the build machine: a binary moved to
//! another machine must be given its tools some other way.
//!
//! Tools are run with the install's library directory first on the child's
//! `LD_LIBRARY_PATH`: the pinned 1.22.0 build's `ucx_perftest` and
//! `ucx_info` carry run paths from the machine they were built on and would
//! not find `libucp` otherwise. Only the child's environment changes.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The UCX install prefix.
pub const ROOT: &str = env!("UCXSYS_ROOT");
/// The directory holding `ucp/api/ucp.h`.
pub const INCLUDE_DIR: &str = env!("UCXSYS_INCLUDE");
/// The directory holding `libucp.so`.
pub const LIB_DIR: &str = env!("UCXSYS_LIBDIR");
/// The directory holding UCX's tools.
pub const BIN_DIR: &str = env!("UCXSYS_BINDIR");
/// The API version (`major.minor`) of the headers found at build time.
pub const API_VERSION: &str = env!("UCXSYS_VERSION");

/// The path of UCX tool `name` (for example `"ucx_perftest"`); it may not
/// exist if the install ships no tools.
pub fn tool_path(name: &str) -> PathBuf {
    Path::new(BIN_DIR).join(name)
}

/// A [`Command`] for UCX tool `name` whose environment finds this UCX's
/// libraries ([`LIB_DIR`] prepended to the child's `LD_LIBRARY_PATH`).
pub fn tool_command(name: &str) -> Command {
    let mut cmd = Command::new(tool_path(name));
    cmd.env(
        "LD_LIBRARY_PATH",
        library_path(std::env::var_os("LD_LIBRARY_PATH")),
    );
    cmd
}

/// [`LIB_DIR`] followed by the entries of `existing`.
fn library_path(existing: Option<OsString>) -> OsString {
    let mut paths = vec![PathBuf::from(LIB_DIR)];
    if let Some(existing) = existing {
        paths.extend(std::env::split_paths(&existing).filter(|p| !p.as_os_str().is_empty()));
    }
    // `LIB_DIR` comes from a directory the build script read, and the other
    // entries were split on ':', so none contains the separator.
    std::env::join_paths(paths).unwrap_or_else(|_| OsString::from(LIB_DIR))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_library_directory_goes_first_on_the_library_path() {
        let joined = library_path(Some(OsString::from("/opt/a:/opt/b")));
        assert_eq!(joined, OsString::from(format!("{LIB_DIR}:/opt/a:/opt/b")));
    }

    #[test]
    fn without_an_inherited_library_path_only_the_library_directory_is_set() {
        assert_eq!(library_path(None), OsString::from(LIB_DIR));
        assert_eq!(library_path(Some(OsString::new())), OsString::from(LIB_DIR));
    }

    #[cfg(not(ucx_vendored))]
    #[test]
    fn the_build_time_install_holds_the_header_and_library() {
        assert!(Path::new(INCLUDE_DIR).join("ucp/api/ucp.h").is_file());
        assert!(Path::new(LIB_DIR).join("libucp.so").exists());
    }

    /// The vendored build links archives and ships no shared library and no
    /// tools: what it publishes is the prefix and the headers.
    #[cfg(ucx_vendored)]
    #[test]
    fn the_vendored_install_holds_the_header_and_the_static_library() {
        assert!(Path::new(INCLUDE_DIR).join("ucp/api/ucp.h").is_file());
        assert!(Path::new(ROOT).join("lib/libucp.a").is_file());
        assert!(Path::new(ROOT).join("lib/ucx/libuct_ib.a").is_file());
        assert!(LIB_DIR.is_empty() && BIN_DIR.is_empty());
    }
}
