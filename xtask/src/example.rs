//! `cargo xtask example`: build and run `examples/block-service`, the
//! downstream project that depends on the `rdmareg` facade alone (by path
//! and version) and has no build script of its own.
//!
//! It runs twice: with `cargo run`, as a developer would, and then as a
//! deployed binary would: copied out of `target/` into a directory of its
//! own and started with an empty environment (no `LD_LIBRARY_PATH`, no
//! variable of ours), which shows that it finds UCX by itself (see
//! docs/packaging.md). Each run starts the owner as a child process of the
//! binary; the consumer fetches every block over UCX (tcp on loopback) and
//! checks each byte.
//!
//! Then it runs the facade's `two_processes` example, the code of
//! `docs/guide-two-processes.md`, as the guide says: an owner and a
//! consumer process over TCP.

use std::fs;
use std::process::Command;

use crate::native;
use crate::util::{Context, Result, bail, build_dir, cargo, run, workspace_root};

/// `cargo xtask example`.
pub fn run_task(args: &[String]) -> Result<()> {
    if let Some(extra) = args.first() {
        bail!("`cargo xtask example` takes no arguments (got `{extra}`)");
    }
    native::ensure(native::BUILD)?;
    let manifest = workspace_root().join("examples/block-service/Cargo.toml");
    let mut cmd = cargo(["run", "--locked", "--manifest-path"]);
    cmd.arg(&manifest)
        // Its own workspace, but the main target directory: the rdmareg
        // crates and the dependencies resolved alike are reused from the
        // workspace's build (a fresh CI clone otherwise compiles them again).
        .env("CARGO_TARGET_DIR", build_dir());
    run(&mut cmd)?;

    let built = build_dir().join("debug/block-service");
    let elsewhere = std::env::temp_dir().join(format!("block-service-{}", std::process::id()));
    fs::create_dir_all(&elsewhere).context(format!("cannot create {}", elsewhere.display()))?;
    let copy = elsewhere.join("block-service");
    fs::copy(&built, &copy).context(format!("cannot copy {}", built.display()))?;
    println!(
        "\n==> the same binary, copied to {} and started with an empty environment",
        copy.display()
    );
    let outcome = run(Command::new(&copy).env_clear().current_dir(&elsewhere));
    // Best effort: the copy is only ever run once.
    let _ = fs::remove_dir_all(&elsewhere);
    outcome?;

    println!("\n==> the two-process guide's example (docs/guide-two-processes.md)");
    run(&mut cargo([
        "run",
        "--locked",
        "-p",
        "rdmareg",
        "--example",
        "two_processes",
    ]))
}
