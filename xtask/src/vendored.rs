//! `cargo xtask vendored`: build UCX from `rdmareg-ucx-src` statically
//! (the `vendored` feature of `rdmareg-ucx-sys`) and run the UCX suites
//! over it.
//!
//! It installs rdma-core's development packages when they are missing,
//! then runs the tests of `rdmareg-ucx-sys` and `rdmareg-ucx` with the
//! feature on, in their own target directory (`target/vendored`) so the
//! ordinary build's artifacts stay as they are. Among them,
//! `build_info::tests::the_vendored_build_carries_the_ib_rdmacm_and_cma_components`
//! proves verbs (`ib`), RDMA-CM (`rdmacm`) and cma were linked in. The
//! static UCX itself is cached outside the clone (see `rdmareg-ucx-src`),
//! so only the first run on a machine builds it.
//!
//! What this cannot show without a NIC: that verbs open a device, register
//! memory and complete a GET. Those paths run only on a machine with an
//! InfiniBand or RoCE adapter; here the `ib` component is present and finds
//! no device.

use std::process::Command;

use crate::ci::ensure_nextest;
use crate::ucx_source::ensure_build_dependencies;
use crate::util::{Result, bail, cargo, run, target_dir};

/// The test runs: the two UCX crates with the static UCX linked in.
fn test_command() -> Command {
    let mut cmd = cargo([
        "nextest",
        "run",
        "-p",
        "rdmareg-ucx-sys",
        "-p",
        "rdmareg-ucx",
        "--features",
        "rdmareg-ucx-sys/vendored",
    ]);
    cmd.env("CARGO_TARGET_DIR", target_dir().join("vendored"))
        .env_remove("RDMAREG_UCX_NO_VENDOR");
    cmd
}

/// `cargo xtask vendored`.
pub fn run_task(args: &[String]) -> Result<()> {
    if let Some(extra) = args.first() {
        bail!("`cargo xtask vendored` takes no arguments (got `{extra}`)");
    }
    ensure_build_dependencies()?;
    ensure_nextest()?;
    run(&mut test_command())
}
