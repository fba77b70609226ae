//! `cargo xtask vendored`: build UCX from `rdmareg-ucx-src` statically
//! (the `vendored` feature of `rdmareg-ucx-sys`) and run the UCX suites
//! over it.
//!
//! It installs rdma-core's development packages when they are missing,
//! then runs tests of `rdmareg-ucx-sys` and `rdmareg-ucx` with the
//! feature on (a subset by default, which is what CI runs; every suite with
//! `--full`), in their own target directory (`vendored/` in the build
//! directory) so the ordinary build's artifacts stay as they are. Among them,
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

/// The test binaries of the default run: the sys crate's smoke test,
/// `rdmareg-ucx`'s integration tests (of which [`UCX_MODULES`]) and its
/// two-process suite (of which [`TWO_PROCESSES`]). With the two crates'
/// unit tests (`--lib`: among them the check that `ib`, `rdmacm` and `cma`
/// were linked in).
const SUITES: &[&str] = &["smoke", "ucx", "two_processes"];

/// The modules of `rdmareg-ucx`'s integration tests in the default run:
/// reads between two engines in one process, and the conformance kit over
/// tcp and over the same-host lane (cma).
const UCX_MODULES: &[&str] = &["two_engines", "conformance_tcp", "conformance_same_host"];

/// The tests of the two-process suite in the default run: one GET across
/// two processes over each transport (tcp, and cma on the same-host lane).
/// The rest of that suite is about peers dying, pids reused and copies
/// refused: our handling of what the kernel and the peer do, the same
/// whether UCX was linked statically or not.
const TWO_PROCESSES: &str = "get_across_processes_moves_the_right_bytes_over_";

/// The test runs: the two UCX crates with the static UCX linked in.
///
/// What this step is for is that the static UCX links, with its patches
/// and the `ib`, `rdmacm` and `cma` components, and works end to end: the
/// default run ([`SUITES`]) shows that, in a process and across two, over
/// every transport this machine has. It is what CI runs. `full` runs every
/// UCX suite over the static build, which the ordinary test step already
/// runs over the shared build of the same sources and patches; it is there
/// for a change to the vendored build itself (about three minutes more).
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
        "--profile",
        "ci",
    ]);
    if !full {
        cmd.arg("--lib");
        for suite in SUITES {
            cmd.args(["--test", suite]);
        }
        cmd.args(["-E", &default_filter()]);
    }
    cmd.env("CARGO_TARGET_DIR", build_dir().join("vendored"))
        .env_remove("RDMAREG_UCX_NO_VENDOR");
    cmd
}

/// The filterset of the default run: every test of the selected binaries
/// but the integration tests, of which only [`UCX_MODULES`], and the
/// two-process suite, of which only [`TWO_PROCESSES`].
fn default_filter() -> String {
    format!(
        "not (binary_id(rdmareg-ucx::ucx) | binary_id(rdmareg-ucx::two_processes)) | \
         (binary_id(rdmareg-ucx::ucx) & test(/^({})::/)) | \
         (binary_id(rdmareg-ucx::two_processes) & test(/^{TWO_PROCESSES}/))",
        UCX_MODULES.join("|")
    )
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_run_names_suites_that_exist() {
        let root = crate::util::workspace_root();
        for suite in SUITES {
            let found = ["crates/rdmareg-ucx/tests", "crates/rdmareg-ucx-sys/tests"]
                .iter()
                .any(|dir| {
                    root.join(dir).join(format!("{suite}.rs")).is_file()
                        || root.join(dir).join(suite).join("main.rs").is_file()
                });
            assert!(found, "no UCX test binary named {suite}");
        }
        for module in UCX_MODULES {
            let file = root.join(format!("crates/rdmareg-ucx/tests/ucx/{module}.rs"));
            assert!(file.is_file(), "no module {module} in the UCX tests");
        }
        let two_processes =
            std::fs::read_to_string(root.join("crates/rdmareg-ucx/tests/two_processes.rs"))
                .unwrap();
        for transport in ["tcp", "same_host"] {
            assert!(
                two_processes.contains(&format!("\"{TWO_PROCESSES}{transport}\"")),
                "two_processes has no test {TWO_PROCESSES}{transport}"
            );
        }
    }

    #[test]
    fn only_the_full_run_takes_every_suite() {
        let args = |full| -> Vec<String> {
            test_command(full)
                .get_args()
                .map(|arg| arg.to_string_lossy().into_owned())
                .collect()
        };
        assert!(args(false).contains(&"--lib".to_string()));
        assert!(!args(true).iter().any(|arg| arg == "--lib" || arg == "-E"));
    }
}
