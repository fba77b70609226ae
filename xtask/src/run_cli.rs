//! `cargo xtask demo` and `cargo xtask bench`: provision UCX (and protoc, which
//! the build needs) if needed, build
//! the `rdmareg` binary (release: the demo prints throughput and the bench
//! measures it), and run it with the remaining arguments.

use crate::util::{Result, cargo, run};
use crate::{etcd, ucx};

/// Run `rdmareg <subcommand> <args>` after provisioning UCX.
pub fn run_task(subcommand: &str, args: &[String]) -> Result<()> {
    ucx::run_task(&[])?;
    etcd::ensure()?;
    let mut command = cargo([
        "run",
        "--release",
        "--quiet",
        "--package",
        "rdmareg-cli",
        "--bin",
        "rdmareg",
        "--",
        subcommand,
    ]);
    command.args(args);
    run(&mut command)
}
