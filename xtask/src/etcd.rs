//! `cargo xtask etcd`: the two programs discovery needs from the system.
//!
//! - `etcd` (Debian's `etcd-server`, 3.4): the discovery tests start a real
//!   one per test on random loopback ports, and `cargo xtask cluster` runs one
//!   inside a network namespace.
//! - `protoc` (Debian's `protobuf-compiler`): the `etcd-client` crate
//!   generates its gRPC code at build time, so **no workspace build succeeds
//!   without it**. Every task here that builds the workspace calls
//!   [`ensure`] first, and CI runs this step before its first build.
//!
//! Both are installed with `apt-get` when missing (as root, or through `sudo`
//! when that is available); a machine without apt gets one message that says
//! what to install.

use std::process::Command;

use crate::util::{Result, bail, probe};

/// A program discovery needs and the Debian package that carries it.
struct Tool {
    program: &'static str,
    version_flag: &'static str,
    package: &'static str,
}

const TOOLS: [Tool; 2] = [
    Tool {
        program: "etcd",
        version_flag: "--version",
        package: "etcd-server",
    },
    Tool {
        program: "protoc",
        version_flag: "--version",
        package: "protobuf-compiler",
    },
];

/// `cargo xtask etcd`.
pub fn run_task(args: &[String]) -> Result<()> {
    if let Some(extra) = args.first() {
        bail!("`cargo xtask etcd` takes no arguments (got `{extra}`)");
    }
    ensure()?;
    for tool in &TOOLS {
        let version = version_of(tool).unwrap_or_default();
        let first = version.lines().next().unwrap_or("").trim();
        println!("{}: {first}", tool.program);
    }
    Ok(())
}

/// Installs `etcd` and `protoc` when either is missing.
pub fn ensure() -> Result<()> {
    install_missing(&TOOLS.iter().collect::<Vec<_>>())
}

/// Installs `protoc` alone when it is missing: what every build needs.
pub fn ensure_protoc() -> Result<()> {
    install_missing(
        &TOOLS
            .iter()
            .filter(|t| t.program == "protoc")
            .collect::<Vec<_>>(),
    )
}

/// Installs `etcd` alone when it is missing: what the discovery tests need.
pub fn ensure_etcd() -> Result<()> {
    install_missing(
        &TOOLS
            .iter()
            .filter(|t| t.program == "etcd")
            .collect::<Vec<_>>(),
    )
}

fn install_missing(wanted: &[&Tool]) -> Result<()> {
    let missing: Vec<&Tool> = wanted
        .iter()
        .copied()
        .filter(|t| version_of(t).is_none())
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let packages: Vec<&str> = missing.iter().map(|t| t.package).collect();
    eprintln!(
        "{} missing; installing {}",
        names(&missing),
        packages.join(" ")
    );
    crate::native::apt_install(&packages).map_err(|e| {
        crate::util::Error::msg(format!(
            "{e} (etcd 3.4 or newer; protoc for the etcd-client build), or put them on PATH"
        ))
    })?;
    let still: Vec<&Tool> = missing
        .iter()
        .copied()
        .filter(|t| version_of(t).is_none())
        .collect();
    if !still.is_empty() {
        bail!("{} still not runnable after installing", names(&still));
    }
    Ok(())
}

fn version_of(tool: &Tool) -> Option<String> {
    probe(Command::new(tool.program).arg(tool.version_flag))
}

fn names(tools: &[&Tool]) -> String {
    tools
        .iter()
        .map(|t| format!("`{}`", t.program))
        .collect::<Vec<_>>()
        .join(" and ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tool_names_the_debian_package_that_carries_it() {
        let packages: Vec<&str> = TOOLS.iter().map(|t| t.package).collect();
        assert_eq!(packages, ["etcd-server", "protobuf-compiler"]);
    }

    #[test]
    fn missing_tools_are_listed_by_program_name() {
        let listed = names(&TOOLS.iter().collect::<Vec<_>>());
        assert_eq!(listed, "`etcd` and `protoc`");
    }
}
