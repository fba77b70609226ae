//! `cargo xtask package`: `cargo package` for every publishable crate, each
//! verified by building it as crates.io would (from the packed `.crate`,
//! with path dependencies replaced by the other packed crates).
//!
//! Verification builds `rdmareg-ucx-sys` from its package, outside the
//! workspace, with no variable naming the UCX: it must find it as a
//! dependent's copy from crates.io does (pkg-config, or the provisioning
//! cache outside any clone). The test crate and xtask are not published and are left out;
//! `rdmareg-cli` (`publish = false`) is packed and verified all the same, so
//! the binary is known to build from the packed libraries.

use std::fs;
use std::path::PathBuf;

use crate::ucx;
use crate::util::{Result, bail, cargo, run};

/// Removes what earlier runs unpacked from cargo's temporary registry.
///
/// Verification unpacks each packed dependency under
/// `$CARGO_HOME/registry/src/<id of target/package/tmp-registry>/` and
/// reuses a directory already there for the same name and version, so a
/// second run from the same checkout path would verify against the first
/// run's sources (seen: a dependent failing on an item added since).
fn clear_unpacked() -> Result<()> {
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cargo")));
    let Some(sources) = home.map(|home| home.join("registry/src")) else {
        return Ok(());
    };
    let Ok(registries) = fs::read_dir(&sources) else {
        return Ok(());
    };
    for registry in registries.flatten() {
        let Ok(entries) = fs::read_dir(registry.path()) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if is_ours(&name) {
                fs::remove_dir_all(entry.path()).map_err(|e| {
                    crate::util::Error::msg(format!(
                        "cannot remove {}: {e}",
                        entry.path().display()
                    ))
                })?;
            }
        }
    }
    Ok(())
}

/// Whether `unpacked` (a directory name under a registry's `src/`) is one
/// of this workspace's crates at this version. Every crate the workspace
/// packs is named `rdmareg` or `rdmareg-…`, so a crate added later is
/// covered without a list to keep up to date (a list missed
/// `rdmareg-discovery`: verification then built the CLI against its
/// sources from an earlier run).
fn is_ours(unpacked: &str) -> bool {
    let Some(name) = unpacked.strip_suffix(concat!("-", env!("CARGO_PKG_VERSION"))) else {
        return false;
    };
    name == "rdmareg" || name.starts_with("rdmareg-")
}

/// The `cargo package` arguments: the workspace less what is never packed.
pub const ARGS: &[&str] = &[
    "package",
    "--workspace",
    "--exclude",
    "xtask",
    "--exclude",
    "rdmareg-tests",
];

/// The target directory verification builds in: its own, so that every
/// rdmareg crate compiled there came from cargo's temporary registry.
fn verify_target_dir() -> PathBuf {
    crate::util::build_dir().join("package-verify")
}

/// Removes the fingerprints of rdmareg's crates from [`verify_target_dir`].
///
/// Cargo takes a registry crate of a given name and version to be
/// immutable, so it would reuse what an earlier verification compiled from
/// older sources of the same version (seen: a dependent failing on an item
/// added since). Without the fingerprints it compiles them again; the
/// third-party dependencies stay built.
fn forget_verified_builds() -> Result<()> {
    let fingerprints = verify_target_dir().join("debug/.fingerprint");
    let Ok(entries) = fs::read_dir(&fingerprints) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("rdmareg-") || name.starts_with("rdmareg_") {
            fs::remove_dir_all(entry.path()).map_err(|e| {
                crate::util::Error::msg(format!("cannot remove {}: {e}", entry.path().display()))
            })?;
        }
    }
    Ok(())
}

/// `cargo xtask package`.
pub fn run_task(args: &[String]) -> Result<()> {
    if let Some(extra) = args.first() {
        bail!("`cargo xtask package` takes no arguments (got `{extra}`)");
    }
    clear_unpacked()?;
    forget_verified_builds()?;
    let mut cmd = cargo(ARGS.iter().copied());
    cmd.env("CARGO_TARGET_DIR", verify_target_dir());
    crate::native::ensure(crate::native::BUILD)?;
    // Plain `cargo package`: the packaged `rdmareg-ucx-sys` finds the UCX
    // the same way a dependent's copy from crates.io does (pkg-config or the
    // provisioning cache), with no variable pointing at it.
    let _ = ucx::find()?;
    run(&mut cmd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_workspace_crate_at_this_version_is_cleared() {
        let version = env!("CARGO_PKG_VERSION");
        for name in [
            "rdmareg",
            "rdmareg-discovery",
            "rdmareg-engine",
            "rdmareg-ofi-sys",
        ] {
            assert!(is_ours(&format!("{name}-{version}")), "{name}");
        }
        assert!(!is_ours(&format!("rdmareg-core-{version}.1")));
        assert!(!is_ours("rdmareg-core-0.0.1"));
        assert!(!is_ours(&format!("tokio-{version}")));
        assert!(!is_ours(&format!("rdmaregx-{version}")));
    }
}
