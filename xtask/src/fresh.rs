//! `cargo xtask fresh`: the README's first command, `cargo xtask demo`, run
//! in a Debian root that has only what a new user's machine has.
//!
//! A green CI on a machine where everything was installed once can hide a
//! missing install step; this task cannot. The root is a minimal Debian 12
//! tree made by `debootstrap` with a C toolchain, Python 3 and CA
//! certificates, and nothing else: no libfabric, no rdma-core development
//! files, no protoc, no etcd, no pkg-config, no UCX cache. The host's Rust
//! toolchain is bind-mounted read-only (Debian's rustc is too old for the
//! workspace), and the host's download cache of crates.io is shared, since
//! it holds no system package. The workspace's files (tracked and untracked,
//! not ignored) are copied in, so a change is checked before it is
//! committed.
//!
//! Each run starts from the same base tree through an overlay mount, so the
//! base (cached in `<cache>/fresh/`, keyed by what it was made from) is never
//! changed, and the run's own writes are discarded at the end. The root is
//! entered with `unshare --mount --pid --fork` and `chroot`, with an empty
//! environment but `PATH` and `HOME`.
//!
//! When the run passes, `.ci/fresh-passed` records a digest of every file
//! that decides provisioning (xtask's sources, build scripts, manifests and
//! the lock file). CI runs this task only when that digest no longer
//! matches ([`is_current`]), which keeps a full run (UCX from source and a
//! release build, about 10 minutes on two cores) out of every CI run.
//! Needs root.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::native::{self, Need};
use crate::netns::ensure_root;
use crate::util::{
    Context, Error, Result, bail, format_duration, probe, run, timed, workspace_root,
};

/// The Debian release the root is made from.
const SUITE: &str = "bookworm";

/// The mirror debootstrap fetches from.
const MIRROR: &str = "http://deb.debian.org/debian";

/// What a new user's machine has beyond a minimal Debian: a C toolchain,
/// Python 3 with pip, and the certificates cargo needs for crates.io.
const BASE_PACKAGES: &[&str] = &[
    "ca-certificates",
    "gcc",
    "g++",
    "make",
    "libc6-dev",
    "python3",
    "python3-pip",
];

/// The file holding the digest of the last passing run.
const STAMP: &str = ".ci/fresh-passed";

/// `cargo xtask fresh [--if-changed]`.
pub fn run_task(args: &[String]) -> Result<()> {
    let only_if_changed = match args {
        [] => false,
        [flag] if flag == "--if-changed" => true,
        _ => bail!("usage: cargo xtask fresh [--if-changed]"),
    };
    let digest = provisioning_digest()?;
    if only_if_changed && is_current(&digest) {
        println!(
            "fresh: {STAMP} matches the provisioning files ({digest}); a fresh machine already ran the demo with them"
        );
        return Ok(());
    }
    ensure_root()?;
    native::ensure(&[Need::Debootstrap])?;
    let base = ensure_base()?;
    let (outcome, elapsed) = timed(|| run_demo(&base));
    outcome?;
    println!(
        "fresh: `cargo xtask demo` passed in a fresh root in {}",
        format_duration(elapsed)
    );
    record_pass(&digest, elapsed)
}

/// Whether [`STAMP`] records `digest`.
fn is_current(digest: &str) -> bool {
    fs::read_to_string(workspace_root().join(STAMP))
        .is_ok_and(|text| text.split_whitespace().nth(1) == Some(digest))
}

fn record_pass(digest: &str, elapsed: Duration) -> Result<()> {
    let path = workspace_root().join(STAMP);
    let line = format!(
        "sha256 {digest} demo-in-fresh-root {}\n",
        format_duration(elapsed)
    );
    fs::write(&path, line).context(format!("cannot write {}", path.display()))?;
    println!("fresh: recorded in {STAMP} (commit it with the change)");
    Ok(())
}

/// A digest of every file that decides what a build needs and how it is
/// provisioned: xtask's sources and manifest, every build script and
/// manifest of the workspace, and `Cargo.lock`.
fn provisioning_digest() -> Result<String> {
    let root = workspace_root();
    let listed = probe(
        Command::new("git")
            .args([
                "ls-files",
                "--cached",
                "--others",
                "--exclude-standard",
                "-z",
            ])
            .current_dir(&root),
    )
    .ok_or_else(|| Error::msg("`git ls-files` failed: run this in a git checkout"))?;
    let mut files: Vec<&str> = listed
        .split('\0')
        .filter(|path| decides_provisioning(path))
        .collect();
    files.sort_unstable();
    files.dedup();
    let mut manifest = String::new();
    for file in files {
        let path = root.join(file);
        if !path.is_file() {
            continue;
        }
        let digest = probe(Command::new("sha256sum").arg(&path))
            .and_then(|out| out.split_whitespace().next().map(str::to_owned))
            .ok_or_else(|| Error::msg(format!("cannot hash {}", path.display())))?;
        manifest.push_str(&format!("{digest}  {file}\n"));
    }
    let scratch = std::env::temp_dir().join(format!("fresh-digest-{}", std::process::id()));
    fs::write(&scratch, &manifest).context("cannot write the digest list")?;
    let digest = probe(Command::new("sha256sum").arg(&scratch))
        .and_then(|out| out.split_whitespace().next().map(|d| d[..16].to_owned()));
    let _ = fs::remove_file(&scratch);
    digest.ok_or_else(|| Error::msg("sha256sum failed"))
}

/// Whether the file at `path` (relative to the workspace) takes part in
/// [`provisioning_digest`].
fn decides_provisioning(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    (path.starts_with("xtask/") && !path.ends_with(".md"))
        || name == "build.rs"
        || name == "build_stubs.rs"
        || name == "Cargo.toml"
        || path == "Cargo.lock"
        || path.starts_with("crates/rdmareg-ucx-src/patches/")
}

/// The base tree, made with debootstrap once per package list.
fn ensure_base() -> Result<PathBuf> {
    let cache = crate::ucx_source::cache_root()?.join("fresh");
    let key = format!("{SUITE}-{:016x}", fnv1a(BASE_PACKAGES.join(" ").as_bytes()));
    let base = cache.join(format!("base-{key}"));
    if base.join(".complete").exists() {
        eprintln!("fresh: reusing the base tree {}", base.display());
        return Ok(base);
    }
    let staging = cache.join(format!(".base-{key}.staging-{}", std::process::id()));
    if staging.exists() {
        fs::remove_dir_all(&staging).context(format!("cannot clear {}", staging.display()))?;
    }
    fs::create_dir_all(&staging).context(format!("cannot create {}", staging.display()))?;
    let (made, elapsed) = timed(|| {
        run(Command::new("debootstrap")
            .arg("--variant=minbase")
            .arg(format!("--include={}", BASE_PACKAGES.join(",")))
            .arg(SUITE)
            .arg(&staging)
            .arg(MIRROR))
    });
    made?;
    eprintln!("fresh: base tree made in {}", format_duration(elapsed));
    // Package scripts in the root must not start services (etcd-server's
    // would): the policy hook refuses them all.
    let policy = staging.join("usr/sbin/policy-rc.d");
    fs::write(&policy, "#!/bin/sh\nexit 101\n").context("cannot write policy-rc.d")?;
    run(Command::new("chmod").arg("0755").arg(&policy))?;
    fs::write(staging.join(".complete"), "").context("cannot mark the base complete")?;
    if base.exists() {
        fs::remove_dir_all(&base).context(format!("cannot clear {}", base.display()))?;
    }
    fs::rename(&staging, &base).context(format!("cannot publish {}", base.display()))?;
    Ok(base)
}

/// FNV-1a, 64 bits: names the base tree after the package list it holds.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The mounts of one run, undone when dropped.
struct Root {
    scratch: PathBuf,
    merged: PathBuf,
    mounts: Vec<PathBuf>,
}

impl Root {
    /// An overlay of `base` with its own writable layer.
    fn over(base: &Path) -> Result<Root> {
        clear_stale_runs();
        let scratch = std::env::temp_dir().join(format!("rdmareg-fresh-{}", std::process::id()));
        let (upper, work, merged) = (
            scratch.join("upper"),
            scratch.join("work"),
            scratch.join("root"),
        );
        for dir in [&upper, &work, &merged] {
            fs::create_dir_all(dir).context(format!("cannot create {}", dir.display()))?;
        }
        let mut root = Root {
            scratch,
            merged: merged.clone(),
            mounts: Vec::new(),
        };
        run(Command::new("mount")
            .args(["-t", "overlay", "overlay", "-o"])
            .arg(format!(
                "lowerdir={},upperdir={},workdir={}",
                base.display(),
                upper.display(),
                work.display()
            ))
            .arg(&merged))?;
        root.mounts.push(merged);
        Ok(root)
    }

    /// Bind-mounts `source` at `inside` (a path within the root).
    fn bind(&mut self, source: &Path, inside: &str, read_only: bool) -> Result<()> {
        let target = self.merged.join(inside.trim_start_matches('/'));
        fs::create_dir_all(&target).context(format!("cannot create {}", target.display()))?;
        run(Command::new("mount").arg("--bind").arg(source).arg(&target))?;
        self.mounts.push(target.clone());
        if read_only {
            run(Command::new("mount")
                .args(["-o", "remount,bind,ro"])
                .arg(&target))?;
        }
        Ok(())
    }
}

impl Drop for Root {
    fn drop(&mut self) {
        for mount in self.mounts.iter().rev() {
            // Best effort: a mount left behind is reported by umount itself.
            let _ = Command::new("umount").arg("--lazy").arg(mount).status();
        }
        remove_unmounted(&self.scratch);
    }
}

/// Removes `scratch` unless something is still mounted below it: a bind of
/// the host's `/dev` or cargo's cache there must never be deleted through.
fn remove_unmounted(scratch: &Path) {
    if mounted_below(scratch) {
        eprintln!(
            "fresh: {} still has mounts below it; left in place",
            scratch.display()
        );
        return;
    }
    let _ = fs::remove_dir_all(scratch);
}

/// Whether any mount point of this mount namespace lies below `dir`.
fn mounted_below(dir: &Path) -> bool {
    let Ok(table) = fs::read_to_string("/proc/self/mountinfo") else {
        return true;
    };
    table
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .any(|point| Path::new(point).starts_with(dir))
}

/// Unmounts and removes the scratch directories of earlier runs whose
/// process is gone (killed before it could clean up).
fn clear_stale_runs() {
    let Ok(entries) = fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.filter_map(|entry| entry.ok()) {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix("rdmareg-fresh-") else {
            continue;
        };
        if Path::new("/proc").join(pid).exists() {
            continue;
        }
        let root = entry.path().join("root");
        if mounted_below(&entry.path()) {
            let _ = Command::new("umount")
                .args(["--recursive", "--lazy"])
                .arg(&root)
                .status();
        }
        remove_unmounted(&entry.path());
    }
}

/// Runs `cargo xtask demo` inside an overlay of `base`.
fn run_demo(base: &Path) -> Result<()> {
    let mut root = Root::over(base)?;
    let toolchain = rust_toolchain()?;
    root.bind(&toolchain, "/opt/rust", true)?;
    let registry = cargo_home().join("registry");
    fs::create_dir_all(&registry).context("cannot create cargo's registry cache")?;
    root.bind(&registry, "/var/cargo-home/registry", false)?;
    root.bind(Path::new("/dev"), "/dev", false)?;
    root.bind(Path::new("/sys"), "/sys", true)?;
    fs::copy("/etc/resolv.conf", root.merged.join("etc/resolv.conf"))
        .context("cannot copy /etc/resolv.conf")?;
    copy_workspace(&root.merged.join("src"))?;
    println!(
        "\n==> fresh root {}: cargo xtask demo",
        root.merged.display()
    );
    run(Command::new("unshare")
        .args(["--mount", "--pid", "--fork"])
        .arg(format!(
            "--mount-proc={}",
            root.merged.join("proc").display()
        ))
        .arg("chroot")
        .arg(&root.merged)
        .args(["/usr/bin/env", "-i"])
        .args([
            "HOME=/root",
            "PATH=/opt/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "CARGO_HOME=/var/cargo-home",
            "LANG=C.UTF-8",
        ])
        .args(["sh", "-c", "cd /src && cargo xtask demo"]))
}

/// The workspace's files that git tracks or would track (ignored files,
/// such as `target/`, left out), copied to `dest`.
fn copy_workspace(dest: &Path) -> Result<()> {
    fs::create_dir_all(dest).context(format!("cannot create {}", dest.display()))?;
    run(Command::new("sh")
        .arg("-c")
        .arg(
            "git ls-files --cached --others --exclude-standard -z \
             | tar --create --null --ignore-failed-read --files-from=- --file=- \
             | tar --extract --file=- --directory=\"$1\"",
        )
        .arg("copy-workspace")
        .arg(dest)
        .current_dir(workspace_root()))
}

/// The directory of the toolchain running this task (`rustc`'s sysroot).
fn rust_toolchain() -> Result<PathBuf> {
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let sysroot = probe(Command::new(rustc).args(["--print", "sysroot"]))
        .ok_or_else(|| Error::msg("`rustc --print sysroot` failed"))?;
    Ok(PathBuf::from(sysroot.trim()))
}

fn cargo_home() -> PathBuf {
    std::env::var_os("CARGO_HOME").map_or_else(
        || PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cargo"),
        PathBuf::from,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provisioning_files_are_what_decides_a_build() {
        for path in [
            "xtask/src/native.rs",
            "crates/rdmareg-ucx-sys/build.rs",
            "crates/rdmareg-ucx-sys/build_stubs.rs",
            "crates/rdmareg-ofi/Cargo.toml",
            "Cargo.lock",
            "crates/rdmareg-ucx-src/patches/0001-x.patch",
        ] {
            assert!(decides_provisioning(path), "{path}");
        }
        for path in [
            "crates/rdmareg-ucx/src/engine.rs",
            "docs/safety.md",
            "README.md",
        ] {
            assert!(!decides_provisioning(path), "{path}");
        }
    }

    /// Scratch directories are removed only when nothing is mounted below
    /// them: `/proc` is a mount point, a new empty directory has none.
    #[test]
    fn mounts_below_a_directory_are_seen() {
        assert!(mounted_below(Path::new("/proc")));
        let empty = std::env::temp_dir().join(format!("fresh-test-{}", std::process::id()));
        fs::create_dir_all(&empty).unwrap();
        assert!(!mounted_below(&empty));
        remove_unmounted(&empty);
        assert!(!empty.exists());
    }
}
