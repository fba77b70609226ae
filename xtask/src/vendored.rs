//! `cargo xtask vendored`: build UCX from `rdmareg-ucx-src` statically
//! (the `vendored` feature of `rdmareg-ucx-sys`) and run the UCX suites
//! over it.
//!
//! It installs rdma-core's development packages when they are missing,
//! then runs tests of `rdmareg-ucx-sys` and `rdmareg-ucx` with the
//! feature on (a subset by default, every suite with `--full`), in their
//! own target directory (`vendored/` in the target directory) so the
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

use crate::native::{self, Need};
use crate::util::{Result, bail, build_dir, cargo, run};

/// The test runs: the two UCX crates with the static UCX linked in. The
/// default is the subset that proves the static build works end to end —
/// the sys crate's tests, the engine's unit tests (among them the
/// component check), reads between two engines and the conformance kit
/// over tcp — for a quick local check; `full` (what CI runs, about three
/// minutes more) runs every UCX suite, so a behaviour of the static build
/// that differs from the shared one (its patches, its components) shows.
fn test_command(full: bool) -> Command {
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
    if !full {
        cmd.args([
            "--lib",
            "--test",
            "smoke",
            "--test",
            "two_engines",
            "--test",
            "conformance_tcp",
        ]);
    }
    cmd.env("CARGO_TARGET_DIR", build_dir().join("vendored"))
        .env_remove("RDMAREG_UCX_NO_VENDOR");
    cmd
}

/// `cargo xtask vendored [--full]`.
pub fn run_task(args: &[String]) -> Result<()> {
    let full = match args {
        [] => false,
        [flag] if flag == "--full" => true,
        [extra, ..] => bail!("`cargo xtask vendored` takes only `--full` (got `{extra}`)"),
    };
    native::ensure(&[
        Need::UcxBuildTools,
        Need::Libfabric,
        Need::Protoc,
        Need::Nextest,
    ])?;
    run(&mut test_command(full))
}
