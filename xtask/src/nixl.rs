//! `cargo xtask nixl`: provision NIXL, the peer `rdmareg bench --peers nixl`
//! measures beside rdmareg.
//!
//! NIXL comes from PyPI as the `nixl-cu12` wheel, pinned to
//! [`NIXL_RELEASE`]. The wheel declares `torch` as a dependency, but its
//! agent API imports and runs with only `numpy` beside it, so it is installed
//! with `--no-deps` and numpy is added alone. Both go into a virtualenv in the
//! same cache root the UCX source build uses (see
//! [`crate::ucx_source::cache_root`]): `<cache>/nixl-cu12-<release>/`. It is
//! built in a staging directory and renamed into place once it imports, so a
//! fresh clone reuses it and an interrupted run leaves nothing half-made.
//!
//! # Which UCX NIXL runs over
//!
//! The wheel bundles its own UCX (1.23.0, as `libucp-<hash>.so.0.0.0` and
//! friends, with InfiniBand modules and their `libnl`). Its UCX plugin,
//! `.nixl_cu12.mesonpy.libs/plugins/libplugin_UCX.so`, names those bundled
//! libraries in its `NEEDED` entries and finds them through an `RPATH` of
//! `$ORIGIN/..:$ORIGIN/../../nixl_cu12.libs`. A benchmark that compares
//! NIXL with rdmareg should run both over one UCX, so this task points the
//! plugin at the UCX the workspace links (`cargo xtask ucx`, 1.22.0):
//!
//! - the plugin's `NEEDED` names `libucp-<hash>.so.0.0.0` and
//!   `libucs-<hash>.so.0.0.0` are rewritten in place to `libucp.so.0` and
//!   `libucs.so.0` (shorter strings, padded with NULs; nothing else in the
//!   file moves). The untouched original is kept beside the venv;
//! - `libucp.so.0` and `libucs.so.0` symlinks in the plugin's `$ORIGIN/..`
//!   point at the linked UCX's libraries, whose own run path brings the rest
//!   of that UCX (`libuct`, `libucm`, its transport modules).
//!
//! Every symbol the plugin takes from UCX exists in 1.22; UCX prints one
//! warning that the plugin was built against API 1.23, and the transfers run.
//! The symlinks are re-pointed on every run, so after `cargo xtask ucx`
//! provisions another UCX, `cargo xtask nixl` follows it.
//!
//! Measured here: with its bundled UCX the wheel's agent crashes at process
//! exit (SIGSEGV in the bundled `libnl-route`'s destructor, loaded by the
//! bundled InfiniBand modules); over the workspace's UCX it exits cleanly.
//!
//! The interpreter of the venv is recorded in `target/nixl-python`, where
//! `rdmareg bench --peers nixl` looks for it.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{self, Command};

use crate::ucx::{self, Ucx};
use crate::util::{Context, Error, Result, bail, probe, run, target_dir, timed};

/// The NIXL release provisioned.
pub const NIXL_RELEASE: &str = "1.5.1";

/// The PyPI requirement that carries it.
pub const NIXL_REQUIREMENT: &str = "nixl-cu12==1.5.1";

/// The plugin, relative to the venv's `site-packages`.
const UCX_PLUGIN: &str = ".nixl_cu12.mesonpy.libs/plugins/libplugin_UCX.so";

/// The UCX libraries the plugin names, as the workspace's UCX spells them.
const UCX_LIBRARIES: [&str; 2] = ["libucp.so.0", "libucs.so.0"];

/// Checks the venv: imports NIXL with no torch present, creates two agents
/// with the UCX backend, and prints which `libucp` the process mapped.
const CHECK: &str = "\
import importlib.util, sys
if importlib.util.find_spec('torch') is not None:
    sys.exit('torch is installed in the NIXL venv; it must not be needed')
import numpy
import nixl_cu12 as nixl
agents = [nixl.nixl_agent(name, nixl.nixl_agent_config(backends=['UCX'])) for name in ('check-a', 'check-b')]
for agent in agents:
    if 'UCX' not in agent.backends:
        sys.exit('NIXL created an agent without its UCX backend')
mapped = sorted({line.split()[-1] for line in open('/proc/self/maps') if 'libucp' in line})
print('numpy', numpy.__version__)
for path in mapped:
    print('libucp', path)
";

/// `<cache>/nixl-cu12-<release>`: the venv.
pub fn venv_dir() -> Result<PathBuf> {
    Ok(crate::ucx_source::cache_root()?.join(format!("nixl-cu12-{NIXL_RELEASE}")))
}

/// `target/nixl-python`: names the venv's interpreter for the bench.
pub fn pointer_file() -> PathBuf {
    target_dir().join("nixl-python")
}

/// The provisioned venv's interpreter, if [`pointer_file`] names one that
/// is there.
pub fn find() -> Option<PathBuf> {
    let text = fs::read_to_string(pointer_file()).ok()?;
    let python = PathBuf::from(text.trim());
    python.exists().then_some(python)
}

/// `cargo xtask nixl`.
pub fn run_task(args: &[String]) -> Result<()> {
    if !args.is_empty() {
        bail!("usage: cargo xtask nixl (got `{}`)", args.join(" "));
    }
    let ucx = ucx::ensure()?;
    let venv = ensure_venv()?;
    let python = venv.join("bin/python");
    let site = site_packages(&python)?;
    retarget_plugin(&site, &venv, &ucx)?;
    let report = check(&python, &ucx)?;
    let pointer = pointer_file();
    fs::write(&pointer, format!("{}\n", python.display()))
        .context(format!("cannot write {}", pointer.display()))?;
    println!("NIXL {NIXL_RELEASE} (nixl-cu12, --no-deps, numpy beside it)");
    println!("  venv:    {}", venv.display());
    println!("  python:  {}", python.display());
    println!("  plugin:  {}", site.join(UCX_PLUGIN).display());
    for line in report.lines() {
        println!("  {line}");
    }
    println!("  UCX:     {} ({})", ucx.lib_dir.display(), ucx.origin);
    println!("  recorded in {}", pointer.display());
    Ok(())
}

/// The venv, created when missing.
fn ensure_venv() -> Result<PathBuf> {
    let venv = venv_dir()?;
    if venv.join("bin/python").exists() {
        return Ok(venv);
    }
    let parent = venv
        .parent()
        .ok_or_else(|| Error::msg("the NIXL venv has no parent directory"))?;
    fs::create_dir_all(parent).context(format!("cannot create {}", parent.display()))?;
    let staging = parent.join(format!(
        ".nixl-cu12-{NIXL_RELEASE}.staging-{}",
        process::id()
    ));
    if staging.exists() {
        fs::remove_dir_all(&staging).context(format!("cannot clear {}", staging.display()))?;
    }
    eprintln!("provisioning NIXL {NIXL_RELEASE} into {}", venv.display());
    let (result, elapsed) = timed(|| build_venv(&staging));
    if let Err(e) = result {
        // Best effort: a failed staging venv is never read again.
        let _ = fs::remove_dir_all(&staging);
        return Err(e);
    }
    match fs::rename(&staging, &venv) {
        Ok(()) => {}
        Err(_) if venv.join("bin/python").exists() => {
            eprintln!(
                "note: another run provisioned {} first; using it",
                venv.display()
            );
            let _ = fs::remove_dir_all(&staging);
        }
        Err(e) => {
            return Err(e).context(format!(
                "cannot rename {} to {}",
                staging.display(),
                venv.display()
            ));
        }
    }
    eprintln!(
        "provisioned NIXL {NIXL_RELEASE} in {}",
        crate::util::format_duration(elapsed)
    );
    Ok(venv)
}

fn build_venv(staging: &Path) -> Result<()> {
    run(Command::new("python3").args(["-m", "venv"]).arg(staging)).map_err(|e| {
        Error::msg(format!(
            "cannot create a Python virtualenv (needs python3 with venv): {e}"
        ))
    })?;
    let pip = |args: &[&str]| {
        let mut command = Command::new(staging.join("bin/python"));
        command
            .args(["-m", "pip", "install", "--disable-pip-version-check"])
            .args(["--progress-bar", "off", "--only-binary=:all:"])
            .args(args);
        run(&mut command)
    };
    pip(&["--no-deps", NIXL_REQUIREMENT]).map_err(|e| {
        Error::msg(format!(
            "cannot install {NIXL_REQUIREMENT} with pip (needs PyPI and a Python the wheel is built for): {e}"
        ))
    })?;
    pip(&["numpy"])
}

/// The venv's `site-packages`.
fn site_packages(python: &Path) -> Result<PathBuf> {
    let output = probe(Command::new(python).args([
        "-c",
        "import sysconfig; print(sysconfig.get_path('purelib'))",
    ]))
    .ok_or_else(|| Error::msg(format!("cannot run {}", python.display())))?;
    Ok(PathBuf::from(output.trim()))
}

/// Points the plugin at `ucx` (see the module docs).
fn retarget_plugin(site: &Path, venv: &Path, ucx: &Ucx) -> Result<()> {
    let plugin = site.join(UCX_PLUGIN);
    let mut bytes = fs::read(&plugin).context(format!(
        "cannot read {} (is {NIXL_REQUIREMENT} installed?)",
        plugin.display()
    ))?;
    let original = venv.join("libplugin_UCX.bundled-ucx.so");
    let rewritten = retarget_needed(&mut bytes);
    if rewritten > 0 {
        if !original.exists() {
            fs::copy(&plugin, &original).context(format!(
                "cannot keep the original as {}",
                original.display()
            ))?;
        }
        let scratch = plugin.with_extension(format!("so.{}", process::id()));
        fs::write(&scratch, &bytes).context(format!("cannot write {}", scratch.display()))?;
        fs::rename(&scratch, &plugin).context(format!("cannot replace {}", plugin.display()))?;
        eprintln!(
            "rewrote {rewritten} UCX library names in {} (original kept as {})",
            plugin.display(),
            original.display()
        );
    } else if !UCX_LIBRARIES
        .iter()
        .all(|name| contains(&bytes, &[name.as_bytes(), b"\0"].concat()))
    {
        bail!(
            "{} names neither the bundled nor the workspace's UCX libraries; \
             its layout is not the one NIXL {NIXL_RELEASE} ships",
            plugin.display()
        );
    }
    let libs = plugin
        .parent()
        .and_then(Path::parent)
        .ok_or_else(|| Error::msg("the plugin has no parent directory"))?;
    for name in UCX_LIBRARIES {
        let target = ucx.lib_dir.join(name);
        if !target.exists() {
            bail!("{} is missing; NIXL cannot use that UCX", target.display());
        }
        let link = libs.join(name);
        if fs::symlink_metadata(&link).is_ok() {
            fs::remove_file(&link).context(format!("cannot replace {}", link.display()))?;
        }
        std::os::unix::fs::symlink(&target, &link).context(format!(
            "cannot link {} to {}",
            link.display(),
            target.display()
        ))?;
    }
    Ok(())
}

/// Rewrites every `libucX-<8 hex>.so.0.0.0` string (NUL-terminated) in an
/// ELF file's bytes to `libucX.so.0`, padding with NULs so no offset moves.
/// Returns how many were rewritten.
pub fn retarget_needed(bytes: &mut [u8]) -> usize {
    const PREFIX: &[u8] = b"libuc";
    const SUFFIX: &[u8] = b".so.0.0.0\0";
    // "libuc" + one letter + "-" + 8 hex digits + ".so.0.0.0\0".
    const LEN: usize = 5 + 1 + 1 + 8 + 10;
    let mut rewritten = 0;
    let mut at = 0;
    while at + LEN <= bytes.len() {
        let candidate = &bytes[at..at + LEN];
        let matches = candidate.starts_with(PREFIX)
            && matches!(candidate[5], b'p' | b's' | b't' | b'm')
            && candidate[6] == b'-'
            && candidate[7..15].iter().all(u8::is_ascii_hexdigit)
            && candidate.ends_with(SUFFIX);
        if matches {
            let letter = candidate[5];
            let mut name = Vec::with_capacity(LEN);
            name.extend_from_slice(PREFIX);
            name.push(letter);
            name.extend_from_slice(b".so.0");
            name.resize(LEN, 0);
            bytes[at..at + LEN].copy_from_slice(&name);
            rewritten += 1;
            at += LEN;
        } else {
            at += 1;
        }
    }
    rewritten
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack
        .windows(needle.len())
        .any(|window| window == needle)
}

/// Runs [`CHECK`] in the venv over tcp on loopback and returns what it
/// printed, after checking the process mapped the workspace's `libucp`.
fn check(python: &Path, ucx: &Ucx) -> Result<String> {
    let output = Command::new(python)
        .args(["-c", CHECK])
        .env("UCX_TLS", "tcp")
        .env("UCX_NET_DEVICES", "lo")
        .env("UCX_WARN_UNUSED_ENV_VARS", "n")
        .env("NIXL_LOG_LEVEL", "WARN")
        .output()
        .context(format!("cannot run {}", python.display()))?;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    if !output.status.success() {
        bail!(
            "NIXL does not import or create agents ({}): {}{}",
            output.status,
            stdout.trim(),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let wanted = fs::canonicalize(ucx.lib_dir.join("libucp.so.0"))
        .context("cannot resolve the workspace's libucp.so.0")?;
    let mapped: Vec<&str> = stdout
        .lines()
        .filter_map(|line| line.strip_prefix("libucp "))
        .collect();
    if mapped.len() != 1 || Path::new(mapped[0]) != wanted {
        bail!(
            "NIXL's agent mapped {mapped:?}, not only the workspace's {}",
            wanted.display()
        );
    }
    Ok(stdout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bundled_ucx_names_are_rewritten_in_place_to_the_plain_sonames() {
        let mut bytes = b"\0libnixl_common.so\0libucp-b39b3ed9.so.0.0.0\0libucs-14c218c5.so.0.0.0\0libstdc++.so.6\0"
            .to_vec();
        let before = bytes.len();
        assert_eq!(retarget_needed(&mut bytes), 2);
        assert_eq!(bytes.len(), before);
        let strings: Vec<&[u8]> = bytes.split(|b| *b == 0).filter(|s| !s.is_empty()).collect();
        assert_eq!(
            strings,
            [
                &b"libnixl_common.so"[..],
                b"libucp.so.0",
                b"libucs.so.0",
                b"libstdc++.so.6"
            ]
        );
    }

    #[test]
    fn names_that_are_not_bundled_ucx_libraries_are_left_alone() {
        let original = b"libucp.so.0\0libucx-b39b3ed9.so.0.0.0\0libucp-b39b3ezz.so.0.0.0\0libucp-b39b3ed9.so.0.0.1\0".to_vec();
        let mut bytes = original.clone();
        assert_eq!(retarget_needed(&mut bytes), 0);
        assert_eq!(bytes, original);
    }
}
