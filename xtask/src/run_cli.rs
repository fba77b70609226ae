//! `cargo xtask demo` and `cargo xtask bench`: provision what the build
//! needs ([`native::BUILD`]: UCX, libfabric, protoc), build
//! the `rdmareg` binary (release: the demo prints throughput and the bench
//! measures it), and run it with the remaining arguments. A bench asked for
//! `--peers nixl` provisions NIXL first (`cargo xtask nixl`).

use crate::native::{self, Need};
use crate::util::{Result, cargo, run};

/// Run `rdmareg <subcommand> <args>` after provisioning what it needs.
pub fn run_task(subcommand: &str, args: &[String]) -> Result<()> {
    native::ensure(native::BUILD)?;
    if subcommand == "bench" && wants_nixl(args) {
        native::ensure(&[Need::Nixl])?;
    }
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

/// Whether the arguments name `nixl` among `--peers` (`--peers nixl`,
/// `--peers=nixl`, or in a comma-separated list).
fn wants_nixl(args: &[String]) -> bool {
    let names_nixl = |list: &str| list.split(',').any(|peer| peer.trim() == "nixl");
    args.iter()
        .enumerate()
        .any(|(i, arg)| match arg.strip_prefix("--peers") {
            Some("") => args.get(i + 1).is_some_and(|list| names_nixl(list)),
            Some(rest) => rest.strip_prefix('=').is_some_and(names_nixl),
            None => false,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Vec<String> {
        line.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn a_bench_naming_nixl_among_its_peers_wants_nixl() {
        assert!(wants_nixl(&args("--sizes 8,4K --peers nixl")));
        assert!(wants_nixl(&args("--peers=nixl --scale 0.1")));
        assert!(wants_nixl(&args("--peers other,nixl")));
    }

    #[test]
    fn a_bench_without_nixl_among_its_peers_does_not() {
        assert!(!wants_nixl(&args("--sizes 8,4K")));
        assert!(!wants_nixl(&args("--peers")));
        assert!(!wants_nixl(&args("--out nixl --peers other")));
        assert!(!wants_nixl(&args("--peersx nixl")));
    }
}
