//! `cargo xtask example`: build and run `examples/block-service`, the
//! downstream project that depends on rdmareg's published crate names (by
//! path and version) and has no build script of its own.
//!
//! It runs with `cargo run`, which puts the UCX library links that
//! `rdmareg-ucx-sys` leaves in its `OUT_DIR` on the loader's path; that is
//! the mechanism under test (see docs/packaging.md). The owner runs as a
//! child process of the binary; the consumer fetches every block over UCX
//! (tcp on loopback) and checks each byte.

use crate::ucx;
use crate::util::{Result, bail, cargo, target_dir, workspace_root};

/// `cargo xtask example`.
pub fn run_task(args: &[String]) -> Result<()> {
    if let Some(extra) = args.first() {
        bail!("`cargo xtask example` takes no arguments (got `{extra}`)");
    }
    let manifest = workspace_root().join("examples/block-service/Cargo.toml");
    let mut cmd = cargo(["run", "--locked", "--manifest-path"]);
    cmd.arg(&manifest)
        // Its own workspace, but the main target directory: the rdmareg
        // crates and the dependencies resolved alike are reused from the
        // workspace's build (a fresh CI clone otherwise compiles them again).
        .env("CARGO_TARGET_DIR", target_dir());
    crate::native::ensure(crate::native::BUILD)?;
    let _ = ucx::find()?;
    crate::util::run(&mut cmd)
}
