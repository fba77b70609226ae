//! `cargo xtask ci`: every check CI runs, in order, stopping at the first
//! failure.
//!
//! Each step prints a header line and, when it ends, its wall time; a summary
//! of all timings closes the run. Steps are plain data ([`Step`]) so adding
//! one is one more entry in [`steps`].
//!
//! The first step provisions everything in xtask's native list
//! ([`crate::native`]) that CI uses, before any build: UCX as
//! `cargo xtask ucx --from-source` builds it (cached outside the clone):
//! 1.22.0 with the patches in `crates/rdmareg-ucx-src/patches/`, verbs,
//! rdmacm and cma, so every step runs over the patched tcp transport
//! (`RDMAREG_UCX_DIR`, when set, still overrides it, said in the step's
//! output; the PUT-refusal test then fails unless that UCX carries the
//! patch); libfabric; protoc, which `etcd-client`'s build script runs; etcd
//! for the discovery tests; libclang for the bindings checks; the test tools.
//!
//! Every step but `cargo xtask vendored` runs with
//! `RDMAREG_UCX_NO_VENDOR=1`: `--all-features` turns on
//! `rdmareg-ucx-sys/vendored`, and those steps are meant to run over the
//! shared patched build above; the vendored static build gets its own step.
//!
//! The sanitizer and fuzz steps run last: they build in their own target
//! directories (`asan/`, `fuzz/` in the build directory), so a failure in
//! the ordinary steps is reported before the slowest builds start.
//!
//! Unless `CARGO_TARGET_DIR` is set, every build goes to the build cache
//! outside the clone ([`crate::build_cache`]), so a fresh clone compiles
//! only the workspace's own crates.

use std::process::Command;

use crate::native::{self, Need};
use crate::util::{Result, bail, cargo, format_duration, run, timed};
use crate::{
    asan, bindgen, build_cache, cluster, example, fresh, fuzz, netns, ofi, package, sim, ucx,
    vendored,
};

/// What CI provisions in its first step: every entry of the native list but
/// NIXL, which only `cargo xtask bench --peers nixl` uses.
pub const NEEDS: &[Need] = &[
    Need::UcxBuildTools,
    Need::Ucx,
    Need::Libfabric,
    Need::Protoc,
    Need::Etcd,
    Need::Libclang,
    Need::Iproute2,
    Need::Nextest,
    Need::CargoFuzz,
];

/// What a step does.
enum Action {
    /// A task of this xtask, run in-process.
    Task(fn() -> Result<()>),
    /// A child command.
    Command(fn() -> Command),
}

/// One named CI step.
struct Step {
    name: &'static str,
    action: Action,
}

/// The CI steps, in the order they run.
fn steps() -> Vec<Step> {
    vec![
        Step {
            name: "provision native dependencies, UCX from source with our patches (cargo xtask doctor lists them)",
            action: Action::Task(|| {
                ucx::run_task(&["--from-source".to_string()])?;
                native::ensure(NEEDS)?;
                native::doctor(&[])
            }),
        },
        Step {
            name: "bindings are current (cargo xtask bindgen --check)",
            action: Action::Task(|| bindgen::run_task(&["--check".to_string()])),
        },
        Step {
            name: "libfabric bindings are current (cargo xtask ofi-bindgen --check)",
            action: Action::Task(|| ofi::run_bindgen_task(&["--check".to_string()])),
        },
        Step {
            name: "format (cargo fmt --check)",
            action: Action::Command(|| cargo(["fmt", "--all", "--check"])),
        },
        Step {
            name: "lint (cargo clippy -D warnings)",
            action: Action::Command(|| {
                cargo([
                    "clippy",
                    "--workspace",
                    "--all-targets",
                    "--all-features",
                    "--",
                    "-D",
                    "warnings",
                ])
            }),
        },
        Step {
            name: "every publishable crate packs and verifies (cargo xtask package)",
            action: Action::Task(|| package::run_task(&[])),
        },
        Step {
            name: "tests (cargo nextest run)",
            action: Action::Task(|| {
                run(&mut cargo([
                    "nextest",
                    "run",
                    "--workspace",
                    "--all-features",
                    "--profile",
                    "ci",
                ]))
            }),
        },
        Step {
            name: "deterministic simulation: 10,000 fixed seeds, 20,000 random (cargo xtask sim)",
            action: Action::Task(sim::ci_run),
        },
        Step {
            name: "static UCX from rdmareg-ucx-src: ib, rdmacm, cma linked in; GETs in one process and across two over it (cargo xtask vendored)",
            action: Action::Task(|| vendored::run_task(&[])),
        },
        Step {
            name: "downstream example: block service on the published crate names (cargo xtask example)",
            action: Action::Task(|| example::run_task(&[])),
        },
        Step {
            name: "two hosts: demo, link cut, stopped owner, killed consumer (cargo xtask netns)",
            action: Action::Task(|| netns::run_task(&[])),
        },
        Step {
            name: "many hosts: discovery on etcd, owner killed, link cut (cargo xtask cluster)",
            action: Action::Task(|| cluster::run_task(&[])),
        },
        Step {
            name: "doc tests (cargo test --doc)",
            action: Action::Command(|| cargo(["test", "--workspace", "--doc", "--all-features"])),
        },
        Step {
            name: "docs (cargo doc, rustdoc -D warnings)",
            action: Action::Command(|| {
                let mut cmd = cargo(["doc", "--workspace", "--no-deps", "--all-features"]);
                cmd.env("RUSTDOCFLAGS", "-D warnings");
                cmd
            }),
        },
        Step {
            name: "AddressSanitizer (cargo xtask asan)",
            action: Action::Task(|| asan::run_task(&[])),
        },
        Step {
            name: "fuzz smoke (cargo xtask fuzz --secs 10)",
            action: Action::Task(fuzz::smoke),
        },
        Step {
            name: "fresh machine: the demo in a debootstrap root, when provisioning changed (cargo xtask fresh --if-changed)",
            action: Action::Task(|| fresh::run_task(&["--if-changed".to_string()])),
        },
    ]
}

/// `cargo xtask ci`.
pub fn run_task(args: &[String]) -> Result<()> {
    if let Some(extra) = args.first() {
        bail!("`cargo xtask ci` takes no arguments (got `{extra}`)");
    }
    // The `--all-features` steps would otherwise turn on
    // `rdmareg-ucx-sys/vendored` and link every test binary against the
    // static UCX, which has no tools (`ucx_info`, `ucx_perftest`) and is
    // covered by its own step. `cargo xtask vendored` clears the variable
    // for its children.
    // SAFETY: nothing else runs yet: xtask is single-threaded here, and no
    // other thread reads the environment while it is written.
    unsafe { std::env::set_var("RDMAREG_UCX_NO_VENDOR", "1") };
    build_cache::use_for_this_run()?;
    let steps = steps();
    let total = steps.len();
    let mut timings = Vec::with_capacity(total);
    for (index, step) in steps.into_iter().enumerate() {
        println!("\n==> [{}/{total}] {}", index + 1, step.name);
        let (outcome, elapsed) = timed(|| match step.action {
            Action::Task(task) => task(),
            Action::Command(command) => run(&mut command()),
        });
        let verdict = if outcome.is_ok() { "ok" } else { "FAILED" };
        println!(
            "<== [{}/{total}] {} {verdict} in {}",
            index + 1,
            step.name,
            format_duration(elapsed)
        );
        timings.push((step.name, elapsed));
        if let Err(e) = outcome {
            print_summary(&timings);
            bail!("CI step `{}` failed: {e}", step.name);
        }
    }
    print_summary(&timings);
    println!("ci: all {total} steps passed");
    Ok(())
}

fn print_summary(timings: &[(&str, std::time::Duration)]) {
    println!("\nstep timings:");
    for (name, elapsed) in timings {
        println!("  {:>9}  {name}", format_duration(*elapsed));
    }
}

/// Installs cargo-nextest when `cargo nextest` is not available.
pub fn ensure_nextest() -> Result<()> {
    let available = cargo(["nextest", "--version"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    if available {
        return Ok(());
    }
    eprintln!("cargo-nextest is missing; installing it");
    run(&mut cargo(["install", "cargo-nextest", "--locked"]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn native_dependencies_are_provisioned_before_the_first_build() {
        let names: Vec<&str> = steps().iter().map(|step| step.name).collect();
        let provision = names.iter().position(|n| n.contains("native")).unwrap();
        let first_build = names
            .iter()
            .position(|n| n.contains("clippy") || n.contains("nextest") || n.contains("bindgen"))
            .unwrap();
        assert!(provision < first_build, "steps: {names:?}");
    }

    /// CI provisions at least what every build needs, so a green CI cannot
    /// hide a dependency only CI installs.
    #[test]
    fn ci_provisions_everything_a_build_needs() {
        for need in native::BUILD {
            assert!(NEEDS.contains(need), "{need:?}");
        }
    }

    #[test]
    fn the_fuzz_step_names_the_time_it_runs() {
        let name = format!("--secs {}", fuzz::CI_SECONDS);
        assert!(steps().iter().any(|step| step.name.contains(&name)));
    }
}
