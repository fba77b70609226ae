//! `cargo xtask package`: `cargo package` for every publishable crate, each
//! verified by building it as crates.io would (from the packed `.crate`,
//! with path dependencies replaced by the other packed crates).
//!
//! Verification builds `rdmareg-ucx-sys` from its package, outside the
//! workspace, so its build script cannot find `target/ucx-prefix`; the task
//! hands it the provisioned UCX as `UCX_DIR` (unless `UCX_DIR` is already
//! set). The test crate and xtask are not published and are left out;
//! `rdmareg-cli` (`publish = false`) is packed and verified all the same, so
//! the binary is known to build from the packed libraries.

use crate::ucx;
use crate::util::{Result, bail, cargo, run};

/// The `cargo package` arguments: the workspace less what is never packed.
pub const ARGS: &[&str] = &[
    "package",
    "--workspace",
    "--exclude",
    "xtask",
    "--exclude",
    "rdmareg-tests",
];

/// `cargo xtask package`.
pub fn run_task(args: &[String]) -> Result<()> {
    if let Some(extra) = args.first() {
        bail!("`cargo xtask package` takes no arguments (got `{extra}`)");
    }
    let mut cmd = cargo(ARGS.iter().copied());
    if std::env::var_os("UCX_DIR").is_none() {
        let linked = ucx::ensure()?;
        cmd.env("UCX_DIR", &linked.prefix);
    }
    run(&mut cmd)
}
