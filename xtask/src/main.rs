//! Developer tasks for the rdmareg workspace, run as `cargo xtask <task>`.
//!
//! Each task lives in its own module and is dispatched from [`main`]; adding
//! a task means one module, one arm in [`dispatch`] and one line of usage.

mod asan;
mod bindgen;
mod build_cache;
mod ci;
mod cluster;
#[cfg(test)]
mod doc_links;
mod etcd;
mod example;
mod fresh;
mod fuzz;
mod native;
mod netns;
mod nixl;
mod ofi;
mod package;
mod run_cli;
mod sim;
mod ucx;
mod ucx_source;
mod util;
mod vendored;

use std::process::ExitCode;

use util::{Result, bail};

const USAGE: &str = "\
usage: cargo xtask <task> [args]

tasks:
  ucx [--from-source | --wheel]
                     find or provision UCX (>= 1.22; pinned 1.22.0) and print which one;
                     --from-source: build 1.22.0 with our patches, verbs, rdmacm, cma
                     (cached outside the clone; what CI uses); --wheel: the quick,
                     unpatched libucx-cu12 wheel (no InfiniBand)
  nixl               provision NIXL 1.5.1 (the nixl-cu12 wheel, numpy, no torch) in a
                     cached virtualenv, running over the workspace's UCX; the peer of
                     `rdmareg bench --peers nixl`
  bindgen [--check]  regenerate crates/rdmareg-ucx-sys/src/bindings.rs, or check it is current
  etcd               install etcd and protoc when missing (discovery tests; the
                     etcd-client build needs protoc)
  ofi                find or provision libfabric (>= 1.17; Debian's libfabric-dev when
                     missing, or OFI_DIR / pkg-config for a site libfabric)
  ofi-bindgen [--check]
                     regenerate crates/rdmareg-ofi-sys/src/bindings.rs, or check it is current
  package            cargo package every publishable crate, verified against the provisioned UCX
  vendored [--full]  build UCX statically from crates/rdmareg-ucx-src (feature `vendored`:
                     verbs, mlx5, rdmacm, cma) and run the UCX suites over it
  example            build and run examples/block-service (a downstream project on the published crates)
                     and the two-process guide's example (rdmareg's `two_processes`)
  doctor             one line per native dependency (UCX, libfabric, protoc, etcd, tools):
                     what is present, its version and where, or the command that provisions it
  fresh [--if-changed]
                     run `cargo xtask demo` in a minimal Debian root made by debootstrap
                     (no libfabric, protoc, etcd, pkg-config or UCX cache; needs root);
                     --if-changed: only when provisioning files changed since .ci/fresh-passed
  ci                 run every CI step in order, stopping at the first failure
  demo [args]        provision UCX, build and run `rdmareg demo` (args go to it)
  bench [args]       provision UCX, build and run `rdmareg bench` (args go to it)
  netns [--release]  the demo across two network namespaces: passes, link cut,
                     owner stopped, consumer killed (needs root and iproute2)
  cluster [--release]
                     discovery across network namespaces on a bridge: etcd, three
                     owners, a consumer; one owner killed, one cut off (needs root)
  asan               run the registry, UCX, libfabric and integration tests under AddressSanitizer
  fuzz [TARGET|all] [--secs N]
                     run the fuzz targets (cargo-fuzz on stable; 30 s each by default)
  sim [--seeds N [--from S] | --random N | --seed S]
                     run the engine kit's deterministic simulators (first 10,000 seeds
                     by default); --seed replays one
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match dispatch(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs the task named by the first argument.
fn dispatch(args: &[String]) -> Result<()> {
    let Some((task, rest)) = args.split_first() else {
        print!("{USAGE}");
        return Ok(());
    };
    match task.as_str() {
        "ucx" => ucx::run_task(rest),
        "nixl" => nixl::run_task(rest),
        "bindgen" => bindgen::run_task(rest),
        "ofi" => ofi::run_task(rest),
        "ofi-bindgen" => ofi::run_bindgen_task(rest),
        "ci" => ci::run_task(rest),
        "doctor" => native::doctor(rest),
        "fresh" => fresh::run_task(rest),
        "etcd" => etcd::run_task(rest),
        "package" => package::run_task(rest),
        "example" => example::run_task(rest),
        "vendored" => vendored::run_task(rest),
        "demo" => run_cli::run_task("demo", rest),
        "bench" => run_cli::run_task("bench", rest),
        "asan" => asan::run_task(rest),
        "fuzz" => fuzz::run_task(rest),
        "sim" => sim::run_task(rest),
        "netns" => netns::run_task(rest),
        "cluster" => cluster::run_task(rest),
        "help" | "-h" | "--help" => {
            print!("{USAGE}");
            Ok(())
        }
        other => bail!("unknown task `{other}`\n\n{USAGE}"),
    }
}
