//! The one list of what the workspace needs from outside Cargo, each entry
//! with the code that finds it and the code that provisions it.
//!
//! Every task asks this module for what it needs ([`ensure`]) instead of
//! calling provisioners of its own, so two tasks cannot disagree about what
//! a build needs: `cargo xtask demo` and `cargo xtask ci` both ask for
//! [`BUILD`]. `cargo xtask doctor` prints one line per entry ([`doctor`]).
//!
//! The list is checked against the workspace rather than remembered: a test
//! reads `cargo metadata` and fails when a package declares `links = "…"`, a
//! workspace build script probes for a native library, or a build script
//! generates gRPC code (and so runs `protoc`) without an entry here that
//! provisions it and belongs to [`BUILD`].

use std::fmt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::util::{Result, bail, cargo, probe, run};
use crate::{bindgen, etcd, fuzz, netns, nixl, ofi, ucx, ucx_source};

/// Something the workspace needs that Cargo does not fetch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// UCX >= 1.22 (the patched 1.22.0 from source when none is found).
    Ucx,
    /// libfabric >= 1.17 with its development files.
    Libfabric,
    /// `protoc`, which `etcd-client`'s build script runs.
    Protoc,
    /// rdma-core's development files and the C toolchain UCX's build uses.
    UcxBuildTools,
    /// An `etcd` server, started by the discovery tests and `xtask cluster`.
    Etcd,
    /// libclang, loaded by bindgen when bindings are regenerated or checked.
    Libclang,
    /// `ip` and `tc`, for the network-namespace tasks.
    Iproute2,
    /// cargo-nextest, the test runner of `ci`, `asan` and `vendored`.
    Nextest,
    /// cargo-fuzz.
    CargoFuzz,
    /// NIXL in a virtualenv, the peer `rdmareg bench --peers nixl` compares with.
    Nixl,
    /// debootstrap, which makes the minimal Debian root of `cargo xtask fresh`.
    Debootstrap,
}

/// What every build of the workspace needs: the libraries its `-sys` crates
/// link and the program its build scripts run. The metadata test checks that
/// this covers every `links` key and native probe in the dependency graph.
pub const BUILD: &[Need] = &[Need::Ucx, Need::Libfabric, Need::Protoc];

/// One entry of the list.
pub struct Native {
    /// Which need this entry meets.
    pub need: Need,
    /// The name a person knows it by.
    pub name: &'static str,
    /// Who needs it, in a few words.
    pub needed_by: &'static str,
    /// The `links = "…"` keys of packages whose build scripts find it.
    #[cfg_attr(not(test), expect(dead_code, reason = "read by the metadata test"))]
    pub links: &'static [&'static str],
    /// Workspace packages whose build scripts probe for it.
    #[cfg_attr(not(test), expect(dead_code, reason = "read by the metadata test"))]
    pub probed_by: &'static [&'static str],
    /// Build-time crates that run it (a package build-depending on one of
    /// these needs this entry).
    #[cfg_attr(not(test), expect(dead_code, reason = "read by the metadata test"))]
    pub run_by_build_crates: &'static [&'static str],
    /// The one command that provisions it.
    pub provision_command: &'static str,
    find: fn() -> Found,
    provision: fn() -> Result<()>,
}

/// What a probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// Present: its version (as it reports it) and where it is.
    Present { version: String, location: String },
    /// Missing, and why.
    Missing(String),
}

impl fmt::Display for Found {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Found::Present { version, location } => write!(f, "{version} at {location}"),
            Found::Missing(why) => write!(f, "missing: {why}"),
        }
    }
}

/// The list, in the order [`ensure`] provisions it.
pub const NATIVE: &[Native] = &[
    Native {
        need: Need::UcxBuildTools,
        name: "rdma-core dev files and C toolchain",
        needed_by: "building UCX from source (the default UCX and `vendored`)",
        links: &[],
        probed_by: &[],
        run_by_build_crates: &[],
        provision_command: "cargo xtask ucx --from-source",
        find: find_ucx_build_tools,
        provision: ucx_source::ensure_build_dependencies,
    },
    Native {
        need: Need::Ucx,
        name: "UCX",
        needed_by: "rdmareg-ucx-sys links it",
        links: &["ucp"],
        probed_by: &["rdmareg-ucx-sys"],
        run_by_build_crates: &[],
        provision_command: "cargo xtask ucx",
        find: find_ucx,
        provision: || ucx::ensure().map(drop),
    },
    Native {
        need: Need::Libfabric,
        name: "libfabric",
        needed_by: "rdmareg-ofi-sys links it",
        links: &["fabric"],
        probed_by: &["rdmareg-ofi-sys"],
        run_by_build_crates: &[],
        provision_command: "cargo xtask ofi",
        find: find_libfabric,
        provision: || ofi::ensure().map(drop),
    },
    Native {
        need: Need::Protoc,
        name: "protoc",
        needed_by: "etcd-client's build script generates its gRPC code with it",
        links: &[],
        probed_by: &[],
        run_by_build_crates: &["prost-build", "tonic-build", "tonic-prost-build"],
        provision_command: "cargo xtask etcd",
        find: || find_program("protoc", "--version"),
        provision: etcd::ensure_protoc,
    },
    Native {
        need: Need::Etcd,
        name: "etcd",
        needed_by: "the discovery tests and `cargo xtask cluster` start one",
        links: &[],
        probed_by: &[],
        run_by_build_crates: &[],
        provision_command: "cargo xtask etcd",
        find: || find_program("etcd", "--version"),
        provision: etcd::ensure_etcd,
    },
    Native {
        need: Need::Libclang,
        name: "libclang",
        needed_by: "`cargo xtask bindgen` and `ofi-bindgen` (the committed bindings need none)",
        links: &[],
        probed_by: &[],
        run_by_build_crates: &[],
        provision_command: "cargo xtask bindgen --check",
        find: || match bindgen::find_libclang() {
            Some(path) => Found::Present {
                version: "libclang".to_owned(),
                location: path.display().to_string(),
            },
            None => Found::Missing("no libclang.so under /usr/lib/llvm-*/lib".to_owned()),
        },
        provision: bindgen::ensure_libclang,
    },
    Native {
        need: Need::Iproute2,
        name: "iproute2",
        needed_by: "`cargo xtask netns` and `cluster`",
        links: &[],
        probed_by: &[],
        run_by_build_crates: &[],
        provision_command: "cargo xtask netns",
        find: || find_program("ip", "-V"),
        provision: netns::ensure_iproute2,
    },
    Native {
        need: Need::Nextest,
        name: "cargo-nextest",
        needed_by: "`cargo xtask ci`, `asan` and `vendored` run the tests with it",
        links: &[],
        probed_by: &[],
        run_by_build_crates: &[],
        provision_command: "cargo install cargo-nextest --locked",
        find: || find_cargo_tool("nextest"),
        provision: crate::ci::ensure_nextest,
    },
    Native {
        need: Need::CargoFuzz,
        name: "cargo-fuzz",
        needed_by: "`cargo xtask fuzz`",
        links: &[],
        probed_by: &[],
        run_by_build_crates: &[],
        provision_command: "cargo install cargo-fuzz --locked",
        find: || find_cargo_tool("fuzz"),
        provision: fuzz::ensure_cargo_fuzz,
    },
    Native {
        need: Need::Nixl,
        name: "NIXL",
        needed_by: "`cargo xtask bench --peers nixl`",
        links: &[],
        probed_by: &[],
        run_by_build_crates: &[],
        provision_command: "cargo xtask nixl",
        find: find_nixl,
        provision: || nixl::run_task(&[]),
    },
    Native {
        need: Need::Debootstrap,
        name: "debootstrap",
        needed_by: "`cargo xtask fresh` makes a minimal Debian root with it",
        links: &[],
        probed_by: &[],
        run_by_build_crates: &[],
        provision: || {
            if matches!(
                find_program("debootstrap", "--version"),
                Found::Present { .. }
            ) {
                return Ok(());
            }
            apt_install(&["debootstrap"])
        },
        provision_command: "apt-get install debootstrap",
        find: || find_program("debootstrap", "--version"),
    },
];

/// Provisions whatever of `needs` is missing, in the list's order.
pub fn ensure(needs: &[Need]) -> Result<()> {
    for native in NATIVE.iter().filter(|native| needs.contains(&native.need)) {
        (native.provision)()
            .map_err(|e| crate::util::Error::msg(format!("{}: {e}", native.name)))?;
    }
    Ok(())
}

/// `cargo xtask doctor`: one line per entry, what is there and what is not.
pub fn doctor(args: &[String]) -> Result<()> {
    if let Some(extra) = args.first() {
        bail!("`cargo xtask doctor` takes no arguments (got `{extra}`)");
    }
    let mut missing_for_build = Vec::new();
    for native in NATIVE {
        let found = (native.find)();
        let line = match &found {
            Found::Present { .. } => format!("ok       {:<36} {found}", native.name),
            Found::Missing(_) => {
                if BUILD.contains(&native.need) {
                    missing_for_build.push(native.name);
                }
                format!(
                    "missing  {:<36} {found}\n         needed by {}; provision: {}",
                    native.name, native.needed_by, native.provision_command
                )
            }
        };
        println!("{line}");
    }
    if missing_for_build.is_empty() {
        println!("\nthe workspace builds: everything it links or runs at build time is here");
        Ok(())
    } else {
        bail!(
            "the workspace does not build yet: {} missing (any `cargo xtask demo`, `bench` or `ci` provisions them)",
            missing_for_build.join(", ")
        )
    }
}

fn find_program(program: &str, version_flag: &str) -> Found {
    match probe(Command::new(program).arg(version_flag)) {
        Some(output) => Found::Present {
            version: first_line(&output),
            location: which(program).unwrap_or_else(|| "PATH".to_owned()),
        },
        None => Found::Missing(format!("`{program}` is not on PATH")),
    }
}

fn find_cargo_tool(subcommand: &str) -> Found {
    let output = cargo([subcommand, "--version"])
        .env("RUSTC_BOOTSTRAP", "1")
        .stderr(Stdio::null())
        .output();
    match output {
        Ok(out) if out.status.success() => Found::Present {
            version: first_line(&String::from_utf8_lossy(&out.stdout)),
            location: which(&format!("cargo-{subcommand}"))
                .unwrap_or_else(|| "cargo's bin directory".to_owned()),
        },
        _ => Found::Missing(format!("`cargo {subcommand}` does not run")),
    }
}

fn find_ucx() -> Found {
    match ucx::find() {
        Ok(found) => Found::Present {
            version: format!("{} ({})", found.describe_version(), found.origin),
            location: found.prefix.display().to_string(),
        },
        Err(e) => Found::Missing(e.to_string()),
    }
}

fn find_ucx_build_tools() -> Found {
    let missing = ucx_source::missing_build_dependencies();
    if missing.is_empty() {
        Found::Present {
            version: "libibverbs-dev, librdmacm-dev, patch, make, g++".to_owned(),
            location: "/usr".to_owned(),
        }
    } else {
        Found::Missing(format!("Debian packages {}", missing.join(" ")))
    }
}

fn find_libfabric() -> Found {
    match ofi::find() {
        Ok(found) => Found::Present {
            version: format!("{}.{} ({})", found.api.0, found.api.1, found.origin),
            location: found.lib_dir.display().to_string(),
        },
        Err(e) => Found::Missing(e.to_string()),
    }
}

fn find_nixl() -> Found {
    match nixl::find() {
        Some(location) => Found::Present {
            version: nixl::NIXL_REQUIREMENT.to_owned(),
            location: location.display().to_string(),
        },
        None => Found::Missing("no NIXL virtualenv has been provisioned".to_owned()),
    }
}

fn first_line(text: &str) -> String {
    text.lines().next().unwrap_or("").trim().to_owned()
}

fn which(program: &str) -> Option<String> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
        .map(|found: PathBuf| found.display().to_string())
}

/// Runs `apt-get install` for `packages` (as root, or through `sudo -n`),
/// with one `apt-get update` per xtask process.
pub fn apt_install(packages: &[&str]) -> Result<()> {
    static UPDATED: AtomicBool = AtomicBool::new(false);
    if probe(Command::new("apt-get").arg("--version")).is_none() {
        bail!(
            "apt-get is unavailable: install {} by hand (see `cargo xtask doctor`)",
            packages.join(" ")
        );
    }
    let root = probe(Command::new("id").arg("-u")).is_some_and(|uid| uid.trim() == "0");
    let apt = |args: &[&str]| {
        let mut cmd = if root {
            Command::new("apt-get")
        } else {
            let mut sudo = Command::new("sudo");
            sudo.args(["-n", "apt-get"]);
            sudo
        };
        cmd.args(args).env("DEBIAN_FRONTEND", "noninteractive");
        cmd
    };
    if !UPDATED.swap(true, Ordering::SeqCst) {
        run(&mut apt(&["update"]))?;
    }
    let mut args = vec!["install", "-y", "--no-install-recommends"];
    args.extend_from_slice(packages);
    run(&mut apt(&args))
}

#[cfg(test)]
#[path = "native_tests.rs"]
mod tests;
