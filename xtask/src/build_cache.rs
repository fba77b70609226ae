//! CI's build cache: the cargo target directories of `cargo xtask ci`,
//! kept outside the clone so that a fresh clone does not compile every
//! dependency again.
//!
//! CI runs on a fresh clone, so a target directory inside it starts empty
//! and every build step (clippy, the tests, the vendored build, ASan, the
//! fuzz build, package verification, each in a directory of its own)
//! compiled the registry dependencies again on every run. When the caller
//! has not set `CARGO_TARGET_DIR`, `cargo xtask ci` sets it to
//! `<cache>/target-<rustc>`: `<cache>` is the provisioning cache that also
//! holds the patched UCX ([`crate::ucx_source::cache_root`], so
//! `/var/cache/rdmareg` for root), `<rustc>` the start of the commit hash
//! `rustc -vV` prints, so a new toolchain starts an empty directory. Which
//! artifacts are still valid is cargo's own fingerprints' business, as in
//! any target directory: the clone's sources are newer than the cached
//! artifacts, so the workspace crates always compile again; only what
//! comes from crates.io is reused (incremental compilation is turned off
//! for the run, unless the caller set `CARGO_INCREMENTAL`: its data would
//! only fill the cache).
//!
//! Before each run the directories of other toolchains are removed, and a
//! directory that has grown past [`MAX_BYTES`] (artifacts of older
//! dependency versions pile up in it) is emptied and starts again.
//! Removing `<cache>/target-*` by hand is always safe.
//!
//! `cargo xtask fresh` is not affected: it runs its build in a chroot with
//! an empty environment and a target directory of its own.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::util::{Context, Result, bail, probe};

/// The size past which the cache is emptied before a run. One CI run
/// leaves roughly 15 to 20 GiB on the two-core CI machine (the ASan build
/// about 7.5, the workspace's own test binaries about 5, package
/// verification 1.6, the fuzz build 0.4, plus the dependencies); the
/// margin lets a few dependency updates pile up before it starts again,
/// on a disk that other builds share.
pub const MAX_BYTES: u64 = 24 << 30;

/// The prefix of every cache directory's name.
const PREFIX: &str = "target-";

/// Points `CARGO_TARGET_DIR` at the build cache unless the caller set it,
/// and returns the directory every cargo build of this process uses.
pub fn use_for_this_run() -> Result<PathBuf> {
    if crate::util::target_dir_override().is_some() {
        let dir = crate::util::build_dir();
        eprintln!(
            "build cache: not used, CARGO_TARGET_DIR is set ({})",
            dir.display()
        );
        return Ok(dir);
    }
    let dir = prepare(&crate::ucx_source::cache_root()?, &rustc_key()?, MAX_BYTES)?;
    eprintln!("build cache: {} (remove it to start clean)", dir.display());
    // SAFETY: called before any step starts: xtask is single-threaded here,
    // and no other thread reads the environment while it is written.
    unsafe { std::env::set_var("CARGO_TARGET_DIR", &dir) };
    // Incremental data is most of a debug target directory and grows with
    // every session; a CI run recompiles the workspace's crates whole
    // anyway (a fresh clone's sources are newer), so it is not kept.
    if std::env::var_os("CARGO_INCREMENTAL").is_none() {
        // SAFETY: as above.
        unsafe { std::env::set_var("CARGO_INCREMENTAL", "0") };
    }
    Ok(dir)
}

/// The key of the running toolchain: the first 12 hex digits of the
/// commit hash `rustc -vV` prints.
fn rustc_key() -> Result<String> {
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let Some(version) = probe(Command::new(rustc).arg("-vV")) else {
        bail!("`rustc -vV` failed; cannot key the build cache by the toolchain");
    };
    match key_of(&version) {
        Some(key) => Ok(key),
        None => bail!("`rustc -vV` names neither a commit hash nor a release:\n{version}"),
    }
}

/// The key in `rustc -vV`'s output: its commit hash, or its release for a
/// compiler built without one.
fn key_of(version: &str) -> Option<String> {
    let field = |name: &str| {
        version
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .map(str::trim)
            .filter(|value| !value.is_empty() && *value != "unknown")
    };
    if let Some(hash) = field("commit-hash:") {
        return Some(hash.chars().take(12).collect());
    }
    field("release:").map(str::to_owned)
}

/// Makes `<cache>/target-<key>` ready: other keys removed, emptied when
/// past `max_bytes`, created.
fn prepare(cache: &Path, key: &str, max_bytes: u64) -> Result<PathBuf> {
    let dir = cache.join(format!("{PREFIX}{key}"));
    if let Ok(entries) = fs::read_dir(cache) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(PREFIX) && entry.path() != dir {
                eprintln!(
                    "build cache: removing {} (another toolchain)",
                    entry.path().display()
                );
                remove(&entry.path())?;
            }
        }
    }
    let size = size_of(&dir);
    if size > max_bytes {
        eprintln!(
            "build cache: {} holds {} MiB, past the {} MiB cap; starting it again",
            dir.display(),
            size >> 20,
            max_bytes >> 20
        );
        remove(&dir)?;
    }
    fs::create_dir_all(&dir).context(format!("cannot create {}", dir.display()))?;
    Ok(dir)
}

fn remove(dir: &Path) -> Result<()> {
    fs::remove_dir_all(dir).context(format!("cannot remove {}", dir.display()))
}

/// Bytes of the regular files below `dir` (symbolic links not followed);
/// 0 when it does not exist.
fn size_of(dir: &Path) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|entry| match entry.file_type() {
            Ok(kind) if kind.is_dir() => size_of(&entry.path()),
            Ok(kind) if kind.is_file() => entry.metadata().map_or(0, |meta| meta.len()),
            _ => 0,
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("xtask-build-cache-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn the_key_is_the_start_of_rustcs_commit_hash() {
        let version = "rustc 1.95.0 (59807616e 2026-04-14)\nbinary: rustc\n\
                       commit-hash: 59807616e1fa2540724bfbac14d7976d7e4a3860\n\
                       release: 1.95.0\n";
        assert_eq!(key_of(version).as_deref(), Some("59807616e1fa"));
    }

    #[test]
    fn a_compiler_without_a_commit_hash_is_keyed_by_its_release() {
        let version = "rustc 1.95.0\ncommit-hash: unknown\nrelease: 1.95.0-dev\n";
        assert_eq!(key_of(version).as_deref(), Some("1.95.0-dev"));
        assert_eq!(key_of("rustc ?\n"), None);
    }

    #[test]
    fn other_toolchains_directories_go_and_the_rest_of_the_cache_stays() {
        let cache = scratch("prune");
        for dir in [
            "target-old",
            "target-new/debug",
            "ucx-1.22.0-src-abc",
            "fresh",
        ] {
            fs::create_dir_all(cache.join(dir)).unwrap();
        }
        fs::write(cache.join("ucx-prefix"), "x").unwrap();
        fs::write(cache.join("target-new/debug/artifact"), "kept").unwrap();

        let dir = prepare(&cache, "new", MAX_BYTES).unwrap();

        assert_eq!(dir, cache.join("target-new"));
        assert!(!cache.join("target-old").exists());
        assert_eq!(
            fs::read_to_string(cache.join("target-new/debug/artifact")).unwrap(),
            "kept"
        );
        for kept in ["ucx-1.22.0-src-abc", "fresh", "ucx-prefix"] {
            assert!(cache.join(kept).exists(), "{kept}");
        }
        fs::remove_dir_all(&cache).unwrap();
    }

    #[test]
    fn a_directory_past_the_cap_starts_empty() {
        let cache = scratch("cap");
        fs::create_dir_all(cache.join("target-k/debug")).unwrap();
        fs::write(cache.join("target-k/debug/big"), [0u8; 64]).unwrap();

        let dir = prepare(&cache, "k", 100).unwrap();
        assert!(dir.join("debug/big").exists(), "under the cap, kept");

        let dir = prepare(&cache, "k", 63).unwrap();
        assert!(dir.is_dir());
        assert!(!dir.join("debug").exists(), "past the cap, emptied");
        fs::remove_dir_all(&cache).unwrap();
    }

    #[test]
    fn sizes_count_files_in_every_subdirectory() {
        let dir = scratch("size");
        fs::create_dir_all(dir.join("a/b")).unwrap();
        fs::write(dir.join("one"), [0u8; 10]).unwrap();
        fs::write(dir.join("a/b/two"), [0u8; 32]).unwrap();
        assert_eq!(size_of(&dir), 42);
        assert_eq!(size_of(&dir.join("missing")), 0);
        fs::remove_dir_all(&dir).unwrap();
    }
}
