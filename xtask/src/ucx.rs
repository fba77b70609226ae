//! `cargo xtask ucx`: make a UCX available and say which one it is.
//!
//! The search order is the one the `rdmareg-ucx-sys` build script uses, so what this
//! prints is what the workspace links, and what any other crate depending on
//! `rdmareg-ucx-sys` links on this machine:
//!
//! 1. `RDMAREG_UCX_DIR`, when set. It is the user's explicit choice, so a
//!    broken or too-old one is an error, never silently skipped. (No variable
//!    of ours starts with `UCX_`: UCX reads every `UCX_*` variable at run time
//!    and warns about the ones it does not know.)
//! 2. pkg-config (`ucx`), when it names UCX 1.22 or newer: a site UCX.
//! 3. The UCX named by `<cache>/ucx-prefix`, which every provisioning below
//!    writes: the last one provisioned is the one linked.
//! 4. The newest complete from-source build in `<cache>`.
//! 5. Otherwise the pinned UCX is built from source with rdmareg's patches
//!    (see [`crate::ucx_source`]); this is what CI uses.
//!
//! `<cache>` is `$RDMAREG_UCX_CACHE`, else `/var/cache/rdmareg` for root,
//! else `$XDG_CACHE_HOME/rdmareg` or `~/.cache/rdmareg`: outside any clone,
//! so a packaged copy of `rdmareg-ucx-sys` finds the same UCX.
//!
//! Two ways to provision, whatever is found:
//!
//! - `--from-source`: UCX 1.22.0 built from the release tarball with the
//!   patches in `crates/rdmareg-ucx-src/patches/`, verbs, rdmacm and cma, into
//!   the cache. Several minutes the first time, then reused.
//! - `--wheel`: the upstream-built `libucx-cu12` wheel, fetched with pip and
//!   unpacked into `target/ucx-1.22.0/`. Seconds, but unpatched and without
//!   InfiniBand. The wheel is unpacked into a staging directory and renamed
//!   into place only once its layout checks out, so an interrupted run leaves
//!   nothing half-made, and a second run finds the finished copy.
//!
//! The minimum accepted version is 1.22, the pinned baseline, not an older
//! release that merely has the same functions: the committed bindings carry
//! 1.22's struct layouts and enum values (the memory-type count among them),
//! and the packed-key validator in `rdmareg-ucx` knows 1.22's key format and
//! refuses others. Newer 1.x releases keep the ABI and are accepted.

use std::env;
use std::ffi::OsString;
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{self, Command};

use crate::util::{Context, Error, Result, bail, probe, run, target_dir, timed};

/// The UCX release the workspace is developed and tested against.
pub const PINNED_RELEASE: &str = "1.22.0";

/// The PyPI requirement that carries the pinned UCX build.
const WHEEL_REQUIREMENT: &str = "libucx-cu12==1.22.0";

/// The oldest UCX API the workspace accepts (see the module docs for why).
pub const MINIMUM_API: ApiVersion = ApiVersion {
    major: 1,
    minor: 22,
};

/// How to fix a missing or unusable UCX; part of every such error.
const FIX: &str = "Fix it either way:\n  \
     - run `cargo xtask ucx` (with RDMAREG_UCX_DIR unset) to provision UCX 1.22.0 (built from source; `--wheel` for the quick unpatched wheel), or\n  \
     - set RDMAREG_UCX_DIR=/path/to/ucx, an install prefix holding include/ucp/api/ucp.h and lib/libucp.so (UCX >= 1.22)\n\
     `cargo xtask doctor` lists every native dependency and how to provision it.";

/// The variable naming a UCX install prefix explicitly.
pub const DIR_VARIABLE: &str = "RDMAREG_UCX_DIR";

/// A UCX API version as the headers state it (`UCP_API_MAJOR`/`UCP_API_MINOR`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ApiVersion {
    /// `UCP_API_MAJOR`.
    pub major: u32,
    /// `UCP_API_MINOR`.
    pub minor: u32,
}

impl fmt::Display for ApiVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// Where a UCX was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// The `RDMAREG_UCX_DIR` environment variable.
    UcxDir,
    /// The wheel copy under `target/` made by `cargo xtask ucx --wheel`.
    Provisioned,
    /// The patched build made by `cargo xtask ucx --from-source`.
    SourceBuild,
    /// pkg-config.
    PkgConfig,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Origin::UcxDir => "from RDMAREG_UCX_DIR",
            Origin::Provisioned => "wheel provisioned by cargo xtask ucx --wheel",
            Origin::SourceBuild => "built from source by cargo xtask ucx --from-source",
            Origin::PkgConfig => "from pkg-config",
        })
    }
}

/// A UCX install whose layout and version have been checked.
#[derive(Clone, Debug)]
pub struct Ucx {
    /// Where it was found.
    pub origin: Origin,
    /// Install prefix.
    pub prefix: PathBuf,
    /// Directory holding `ucp/api/ucp.h`.
    pub include_dir: PathBuf,
    /// Directory holding `libucp.so`.
    pub lib_dir: PathBuf,
    /// Directory holding `ucx_info` and `ucx_perftest` (may be absent).
    pub bin_dir: PathBuf,
    /// The API version its headers declare.
    pub api: ApiVersion,
}

impl Ucx {
    /// Checks the standard `include/`, `lib/` (or `lib64/`), `bin/` layout
    /// under `prefix`.
    pub fn at(prefix: &Path, origin: Origin) -> Result<Ucx> {
        let lib_dir = ["lib", "lib64"]
            .iter()
            .map(|name| prefix.join(name))
            .find(|dir| dir.join("libucp.so").exists())
            .unwrap_or_else(|| prefix.join("lib"));
        Ucx::from_dirs(
            origin,
            prefix.to_path_buf(),
            prefix.join("include"),
            lib_dir,
            prefix.join("bin"),
        )
    }

    /// Checks a UCX whose directories were given one by one (pkg-config).
    fn from_dirs(
        origin: Origin,
        prefix: PathBuf,
        include_dir: PathBuf,
        lib_dir: PathBuf,
        bin_dir: PathBuf,
    ) -> Result<Ucx> {
        let header = include_dir.join("ucp/api/ucp.h");
        if !header.is_file() {
            bail!("{} is missing", header.display());
        }
        let library = lib_dir.join("libucp.so");
        if !library.exists() {
            bail!("{} is missing", library.display());
        }
        let version_header = include_dir.join("ucp/api/ucp_version.h");
        let text = fs::read_to_string(&version_header)
            .context(format!("cannot read {}", version_header.display()))?;
        let api = parse_api_version(&text).ok_or_else(|| {
            Error::msg(format!(
                "{} has no UCP_API_MAJOR/MINOR",
                version_header.display()
            ))
        })?;
        Ok(Ucx {
            origin,
            prefix,
            include_dir,
            lib_dir,
            bin_dir,
            api,
        })
    }

    /// A command running one of this UCX's tools with this UCX's libraries.
    ///
    /// The tools in the pinned wheel carry a run path from the machine they
    /// were built on, so the library directory is put on the child's
    /// `LD_LIBRARY_PATH` (only the child's).
    pub fn tool(&self, name: &str) -> Command {
        let mut cmd = Command::new(self.bin_dir.join(name));
        let mut paths = vec![self.lib_dir.clone()];
        if let Some(existing) = env::var_os("LD_LIBRARY_PATH") {
            paths.extend(env::split_paths(&existing));
        }
        let joined: OsString =
            env::join_paths(paths).unwrap_or_else(|_| self.lib_dir.clone().into());
        cmd.env("LD_LIBRARY_PATH", joined);
        cmd
    }

    /// The full release (`1.22.0`) as `ucx_info -v` reports it, if the tool
    /// is there and runs.
    pub fn release(&self) -> Option<String> {
        let output = probe(self.tool("ucx_info").arg("-v"))?;
        output.lines().find_map(|line| {
            line.trim_start_matches('#')
                .trim()
                .strip_prefix("Library version:")
                .map(|version| version.trim().to_string())
        })
    }

    /// The release if known, else the API version.
    pub fn describe_version(&self) -> String {
        self.release()
            .unwrap_or_else(|| format!("{} (API; ucx_info unavailable)", self.api))
    }

    fn require_minimum(self) -> Result<Ucx> {
        if self.api < MINIMUM_API {
            bail!(
                "UCX {} at {} ({}) is older than {MINIMUM_API}, the oldest this workspace supports \
                 (the bindings and the packed-key validator follow the 1.22 headers).\n{FIX}",
                self.api,
                self.prefix.display(),
                self.origin,
            );
        }
        Ok(self)
    }
}

/// Reads `UCP_API_MAJOR` and `UCP_API_MINOR` from `ucp_version.h`.
pub fn parse_api_version(header: &str) -> Option<ApiVersion> {
    let define = |name: &str| {
        header.lines().find_map(|line| {
            let mut words = line.split_whitespace();
            (words.next() == Some("#define") && words.next() == Some(name))
                .then(|| words.next()?.parse::<u32>().ok())
                .flatten()
        })
    };
    Some(ApiVersion {
        major: define("UCP_API_MAJOR")?,
        minor: define("UCP_API_MINOR")?,
    })
}

/// `target/ucx-1.22.0`: the provisioned tree (the wheel's top level).
pub fn provisioned_root() -> PathBuf {
    target_dir().join(format!("ucx-{PINNED_RELEASE}"))
}

/// `target/ucx-1.22.0/libucx`: the provisioned install prefix.
pub fn provisioned_prefix() -> PathBuf {
    provisioned_root().join("libucx")
}

/// `<cache>/ucx-prefix`: the install prefix of the UCX provisioned last.
pub fn pointer_file() -> Result<PathBuf> {
    Ok(crate::ucx_source::cache_root()?.join("ucx-prefix"))
}

/// Makes `prefix` the provisioned UCX every build on this machine links
/// (unless `RDMAREG_UCX_DIR` or pkg-config names one), by writing
/// [`pointer_file`] in one step.
pub fn record_provisioned(prefix: &Path) -> Result<()> {
    let pointer = pointer_file()?;
    let wanted = prefix.display().to_string();
    if fs::read_to_string(&pointer).is_ok_and(|current| current.trim() == wanted) {
        return Ok(());
    }
    let cache = crate::ucx_source::cache_root()?;
    fs::create_dir_all(&cache).context(format!("cannot create {}", cache.display()))?;
    let scratch = cache.join(format!(".ucx-prefix.{}", process::id()));
    fs::write(&scratch, format!("{wanted}\n"))
        .context(format!("cannot write {}", scratch.display()))?;
    fs::rename(&scratch, &pointer).context(format!("cannot write {}", pointer.display()))?;
    eprintln!("{} now names {wanted}", pointer.display());
    Ok(())
}

/// `cargo xtask ucx [--from-source | --wheel]`.
pub fn run_task(args: &[String]) -> Result<()> {
    let ucx = match args {
        [] => ensure()?,
        [flag] if flag == "--from-source" => provision_from_source()?,
        [flag] if flag == "--wheel" => provision_wheel()?,
        _ => bail!(
            "usage: cargo xtask ucx [--from-source | --wheel] (got `{}`)",
            args.join(" ")
        ),
    };
    print_ucx(&ucx);
    Ok(())
}

/// `--from-source`: build (or reuse) the patched UCX and record it; then
/// report what the workspace will actually link.
pub fn provision_from_source() -> Result<Ucx> {
    let built = crate::ucx_source::ensure()?;
    note_if_overridden(&built)
}

/// `--wheel`: unpack (or reuse) the wheel and record it.
fn provision_wheel() -> Result<Ucx> {
    let wheel = match find_wheel() {
        Some(ucx) => ucx,
        None => provision()?,
    };
    record_provisioned(&wheel.prefix)?;
    note_if_overridden(&wheel)
}

/// What the workspace links after provisioning `provisioned`: that one,
/// unless `RDMAREG_UCX_DIR` or pkg-config names another (said on stderr).
fn note_if_overridden(provisioned: &Ucx) -> Result<Ucx> {
    let linked = ensure()?;
    if linked.prefix != provisioned.prefix {
        eprintln!(
            "note: {} ({}) overrides the provisioned {} for every build",
            linked.prefix.display(),
            linked.origin,
            provisioned.prefix.display()
        );
    }
    Ok(linked)
}

fn print_ucx(ucx: &Ucx) {
    println!("UCX {} ({})", ucx.describe_version(), ucx.origin);
    println!("  prefix:  {}", ucx.prefix.display());
    println!("  include: {}", ucx.include_dir.display());
    println!("  libdir:  {}", ucx.lib_dir.display());
    println!("  bindir:  {}", ucx.bin_dir.display());
}

/// Finds a usable UCX, provisioning the pinned one when there is none.
pub fn ensure() -> Result<Ucx> {
    match find() {
        Ok(ucx) => Ok(ucx),
        Err(e) if env::var_os(DIR_VARIABLE).is_some() => Err(e),
        Err(_) => crate::ucx_source::ensure(),
    }
}

/// Finds a usable UCX in the documented order, provisioning nothing.
pub fn find() -> Result<Ucx> {
    if let Some(dir) = env::var_os(DIR_VARIABLE).filter(|dir| !dir.is_empty()) {
        let dir = PathBuf::from(dir);
        return Ucx::at(&dir, Origin::UcxDir)
            .map_err(|e| {
                Error::msg(format!(
                    "{DIR_VARIABLE}={} is not a UCX install: {e}\n{FIX}",
                    dir.display()
                ))
            })?
            .require_minimum();
    }
    let mut problems = vec![format!("{DIR_VARIABLE} is unset")];
    match from_pkg_config() {
        Some(Ok(ucx)) if ucx.api >= MINIMUM_API => return Ok(ucx),
        Some(Ok(ucx)) => problems.push(format!(
            "pkg-config names UCX {} at {}, older than {MINIMUM_API}",
            ucx.api,
            ucx.prefix.display()
        )),
        Some(Err(e)) => problems.push(format!("the UCX pkg-config names is unusable: {e}")),
        None => problems.push("pkg-config knows no `ucx`".to_owned()),
    }
    match find_recorded() {
        Ok(ucx) => return Ok(ucx),
        Err(e) => problems.push(e.to_string()),
    }
    match crate::ucx_source::newest_cached() {
        Some(ucx) => return Ok(ucx),
        None => problems.push("the cache holds no complete from-source build".to_owned()),
    }
    bail!("no usable UCX: {}.\n{FIX}", problems.join("; "))
}

/// The UCX [`pointer_file`] names, if it is there and usable.
fn find_recorded() -> Result<Ucx> {
    let pointer = pointer_file()?;
    let text = fs::read_to_string(&pointer).context(format!(
        "no {} (nothing provisioned yet)",
        pointer.display()
    ))?;
    let prefix = PathBuf::from(text.trim());
    let origin = if prefix == provisioned_prefix() {
        Origin::Provisioned
    } else {
        Origin::SourceBuild
    };
    Ucx::at(&prefix, origin)
        .and_then(Ucx::require_minimum)
        .context(format!(
            "{} names {}, which is unusable",
            pointer.display(),
            prefix.display()
        ))
}

/// The wheel copy, if it is there and complete.
fn find_wheel() -> Option<Ucx> {
    let prefix = provisioned_prefix();
    if !prefix.exists() {
        return None;
    }
    match Ucx::at(&prefix, Origin::Provisioned).and_then(Ucx::require_minimum) {
        Ok(ucx) => Some(ucx),
        Err(e) => {
            eprintln!(
                "note: {} is unusable ({e}); provisioning it again",
                prefix.display()
            );
            None
        }
    }
}

/// The UCX pkg-config knows about, if pkg-config and a `ucx.pc` exist.
fn from_pkg_config() -> Option<Result<Ucx>> {
    let variable = |name: &str| {
        probe(Command::new("pkg-config").args(["--variable", name, "ucx"]))
            .map(|value| value.trim().to_string())
            .filter(|value| !value.is_empty())
    };
    probe(Command::new("pkg-config").args(["--exists", "ucx"]))?;
    let prefix = PathBuf::from(variable("prefix")?);
    let include_dir = variable("includedir").map_or_else(|| prefix.join("include"), PathBuf::from);
    let lib_dir = variable("libdir").map_or_else(|| prefix.join("lib"), PathBuf::from);
    let bin_dir = variable("bindir").map_or_else(|| prefix.join("bin"), PathBuf::from);
    Some(Ucx::from_dirs(
        Origin::PkgConfig,
        prefix,
        include_dir,
        lib_dir,
        bin_dir,
    ))
}

/// Fetches the pinned wheel and publishes it at [`provisioned_root`].
fn provision() -> Result<Ucx> {
    eprintln!(
        "provisioning UCX {PINNED_RELEASE} into {}",
        provisioned_root().display()
    );
    let staging = target_dir().join(format!(".ucx-{PINNED_RELEASE}.staging-{}", process::id()));
    if staging.exists() {
        fs::remove_dir_all(&staging).context(format!("cannot clear {}", staging.display()))?;
    }
    fs::create_dir_all(&staging).context(format!("cannot create {}", staging.display()))?;
    let (result, elapsed) = timed(|| provision_via(&staging));
    // Best effort: the staging directory holds only the download and, after
    // a failure, a partial tree; neither is ever read again.
    let _ = fs::remove_dir_all(&staging);
    let ucx = result?;
    eprintln!(
        "provisioned UCX {PINNED_RELEASE} in {}",
        crate::util::format_duration(elapsed)
    );
    Ok(ucx)
}

/// Python that unpacks a wheel (a zip) keeping the files' permission bits,
/// which `python3 -m zipfile -e` drops (the tools would not be executable).
const UNPACK_WHEEL: &str = "\
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    for entry in wheel.infolist():
        path = wheel.extract(entry, sys.argv[2])
        mode = (entry.external_attr >> 16) & 0o777
        if mode and not entry.is_dir():
            os.chmod(path, mode)
";

fn provision_via(staging: &Path) -> Result<Ucx> {
    let download = staging.join("download");
    run(Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:"])
        .args(["--disable-pip-version-check", "--progress-bar", "off", "-d"])
        .arg(&download)
        .arg(WHEEL_REQUIREMENT))
    .map_err(|e| {
        Error::msg(format!(
            "cannot download {WHEEL_REQUIREMENT} with pip (needs python3, pip and PyPI): {e}\n\
             Alternatively set RDMAREG_UCX_DIR=/path/to/ucx, an install prefix of UCX >= 1.22."
        ))
    })?;
    let wheel = single_wheel(&download)?;

    let tree = staging.join("tree");
    let unpack_script = staging.join("unpack_wheel.py");
    fs::write(&unpack_script, UNPACK_WHEEL)
        .context(format!("cannot write {}", unpack_script.display()))?;
    run(Command::new("python3")
        .arg(&unpack_script)
        .arg(&wheel)
        .arg(&tree))?;
    let unpacked = Ucx::at(&tree.join("libucx"), Origin::Provisioned).context(format!(
        "{} does not have the expected layout",
        wheel.display()
    ))?;
    if unpacked.api != MINIMUM_API {
        bail!(
            "{} declares UCX API {}, expected {PINNED_RELEASE}",
            wheel.display(),
            unpacked.api
        );
    }
    // `bin/ucx_perftest` finds its bundled OpenMP runtime through a run path
    // pointing at this sibling directory, so it must come along.
    if !tree.join("libucx_cu12.libs").is_dir() {
        bail!(
            "{} has no libucx_cu12.libs/ beside libucx/",
            wheel.display()
        );
    }

    publish(&tree, staging)?;
    Ucx::at(&provisioned_prefix(), Origin::Provisioned)
}

/// The one `.whl` pip put in `dir`.
fn single_wheel(dir: &Path) -> Result<PathBuf> {
    let mut wheels = fs::read_dir(dir)
        .context(format!("cannot list {}", dir.display()))?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "whl"));
    match (wheels.next(), wheels.next()) {
        (Some(wheel), None) => Ok(wheel),
        (None, _) => bail!("pip left no wheel in {}", dir.display()),
        (Some(_), Some(_)) => bail!("pip left more than one wheel in {}", dir.display()),
    }
}

/// Renames the checked `tree` to [`provisioned_root`] in one step.
///
/// If a usable copy is already there (another run published first), it is
/// kept and ours discarded. An unusable one is moved into `staging`, to be
/// deleted with it.
fn publish(tree: &Path, staging: &Path) -> Result<()> {
    let root = provisioned_root();
    if root.exists() {
        if find_wheel().is_some() {
            eprintln!(
                "note: another run provisioned {} first; using it",
                root.display()
            );
            return Ok(());
        }
        fs::rename(&root, staging.join("unusable"))
            .context(format!("cannot move the unusable {} aside", root.display()))?;
    }
    match fs::rename(tree, &root) {
        Ok(()) => Ok(()),
        Err(_) if find_wheel().is_some() => {
            eprintln!(
                "note: another run provisioned {} first; using it",
                root.display()
            );
            Ok(())
        }
        Err(e) => Err(e).context(format!(
            "cannot rename {} to {}",
            tree.display(),
            root.display()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: &str = "#define UCP_VERSION_MINOR_SHIFT    16\n\
                          #define UCP_API_MAJOR    1\n\
                          #define UCP_API_MINOR    22\n\
                          #define UCP_API_VERSION  UCP_VERSION(1, 22)\n";

    #[test]
    fn api_version_is_read_from_the_version_header() {
        assert_eq!(
            parse_api_version(HEADER),
            Some(ApiVersion {
                major: 1,
                minor: 22
            })
        );
    }

    #[test]
    fn a_header_without_the_api_defines_has_no_version() {
        assert_eq!(parse_api_version("#define UCP_API_MAJOR 1\n"), None);
        assert_eq!(
            parse_api_version("#define UCP_API_MAJORITY 1\n#define UCP_API_MINOR 3\n"),
            None
        );
    }

    #[test]
    fn versions_order_by_major_then_minor() {
        let v = |major, minor| ApiVersion { major, minor };
        assert!(v(1, 16) < MINIMUM_API);
        assert!(v(1, 23) > MINIMUM_API);
        assert!(v(2, 0) > v(1, 99));
    }

    #[test]
    fn a_prefix_without_headers_is_refused_with_the_missing_path() {
        let dir = env::temp_dir().join(format!("xtask-test-empty-prefix-{}", process::id()));
        fs::create_dir_all(dir.join("lib")).unwrap();
        let err = Ucx::at(&dir, Origin::UcxDir).unwrap_err().to_string();
        fs::remove_dir_all(&dir).unwrap();
        assert!(err.contains("include/ucp/api/ucp.h"), "{err}");
    }

    #[test]
    fn a_too_old_ucx_is_refused_naming_both_remedies() {
        let old = Ucx {
            origin: Origin::PkgConfig,
            prefix: PathBuf::from("/opt/ucx-1.16"),
            include_dir: PathBuf::from("/opt/ucx-1.16/include"),
            lib_dir: PathBuf::from("/opt/ucx-1.16/lib"),
            bin_dir: PathBuf::from("/opt/ucx-1.16/bin"),
            api: ApiVersion {
                major: 1,
                minor: 16,
            },
        };
        let err = old.require_minimum().unwrap_err().to_string();
        assert!(err.contains("UCX 1.16 at /opt/ucx-1.16"), "{err}");
        assert!(err.contains("cargo xtask ucx"), "{err}");
        assert!(err.contains("RDMAREG_UCX_DIR=/path/to/ucx"), "{err}");
        assert!(err.contains("cargo xtask doctor"), "{err}");
    }
}
