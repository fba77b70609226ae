//! Finds the UCX to link, links `libucp` and `libucs`, and tells dependents
//! where it is.
//!
//! Search order (the same as `cargo xtask ucx`), which works the same in the
//! workspace and in a copy from crates.io, since nothing is looked up
//! relative to this crate:
//! 1. `RDMAREG_UCX_DIR`, an install prefix. An explicit choice: if it is
//!    broken or too old, the build fails rather than quietly using something
//!    else. (Not `UCX_DIR`: UCX reads every `UCX_*` variable at run time and
//!    warns about the ones it does not know.)
//! 2. pkg-config (`ucx`), when it names UCX 1.22 or newer: a site UCX.
//! 3. The prefix named in `<cache>/ucx-prefix`, written by `cargo xtask ucx`
//!    whenever it provisions (the patched source build by default and in CI,
//!    or the wheel with `--wheel`).
//! 4. The newest complete from-source build `<cache>/ucx-1.22.0-src-*`.
//!
//! `<cache>` is `RDMAREG_UCX_CACHE`, else `/var/cache/rdmareg` for root,
//! else `$XDG_CACHE_HOME/rdmareg` or `$HOME/.cache/rdmareg` (the rule of
//! `rdmareg_ucx_src::cache_root`, written out here so that this crate needs
//! `rdmareg-ucx-src` only for `vendored`).
//!
//! When `DOCS_RS` is set (docs.rs builds documentation with no UCX present)
//! nothing is searched and nothing is linked: the committed bindings need no
//! headers, and every published path is empty.
//!
//! Metadata for dependents' build scripts (`DEP_UCP_<KEY>`): `ROOT`,
//! `INCLUDE`, `LIBDIR`, `BINDIR`, `VERSION` (the headers' `major.minor`).
//! The same paths reach this crate's code as `UCXSYS_*` compile-time
//! variables. How binaries find the libraries at run time: `build_stubs.rs`.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

#[path = "build_stubs.rs"]
mod build_stubs;

/// The oldest UCX API accepted: the committed bindings carry 1.22's layouts
/// and enum values, and the engine's packed-key validator knows 1.22's format.
const MINIMUM_API: (u32, u32) = (1, 22);

/// The variable naming a UCX install prefix explicitly.
const DIR_VARIABLE: &str = "RDMAREG_UCX_DIR";

/// The file in the cache naming the prefix `cargo xtask ucx` provisioned.
const POINTER: &str = "ucx-prefix";

/// How the from-source builds in the cache are named.
const SOURCE_BUILD_PREFIX: &str = "ucx-1.22.0-src-";

const FIX: &str = "Fix it one of these ways:\n  \
    - in an rdmareg checkout, run `cargo xtask doctor` to see what is missing and `cargo xtask ucx` to provision UCX 1.22.0 (built from source with rdmareg's patches), or\n  \
    - set RDMAREG_UCX_DIR=/path/to/ucx, an install prefix holding include/ucp/api/ucp.h and lib/libucp.so (UCX >= 1.22), or make pkg-config find it, or\n  \
    - enable the `vendored` feature to build UCX from the sources in rdmareg-ucx-src and link it statically";

struct Install {
    root: PathBuf,
    include: PathBuf,
    libdir: PathBuf,
    bindir: PathBuf,
    api: (u32, u32),
}

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed={DIR_VARIABLE}");
    println!("cargo::rerun-if-env-changed=RDMAREG_UCX_CACHE");
    println!("cargo::rerun-if-env-changed=PKG_CONFIG_PATH");
    println!("cargo::rerun-if-env-changed=DOCS_RS");

    if env::var_os("DOCS_RS").is_some() {
        // docs.rs has no UCX. The committed bindings compile without one;
        // nothing is linked (rustdoc links nothing) and every path is empty.
        publish(&[
            ("root", String::new()),
            ("include", String::new()),
            ("libdir", String::new()),
            ("bindir", String::new()),
            ("version", String::new()),
        ]);
        return;
    }

    println!("cargo::rustc-check-cfg=cfg(ucx_vendored)");
    println!("cargo::rerun-if-env-changed=RDMAREG_UCX_NO_VENDOR");
    #[cfg(feature = "vendored")]
    {
        println!("cargo::rerun-if-env-changed=RDMAREG_UCX_CACHE");
        if env::var_os("RDMAREG_UCX_NO_VENDOR").is_none_or(|value| value.is_empty() || value == "0")
        {
            vendored();
            return;
        }
    }

    let ucx = match find() {
        Ok(ucx) => ucx,
        Err(problem) => {
            panic!("\n\nrdmareg-ucx-sys cannot find a usable UCX: {problem}\n{FIX}\n\n")
        }
    };
    if ucx.api < MINIMUM_API {
        panic!(
            "\n\nrdmareg-ucx-sys found UCX {}.{} at {}, older than the minimum {}.{}.\n{FIX}\n\n",
            ucx.api.0,
            ucx.api.1,
            ucx.root.display(),
            MINIMUM_API.0,
            MINIMUM_API.1
        );
    }
    // A different install (or a reinstall) under the same path changes this.
    println!(
        "cargo::rerun-if-changed={}",
        ucx.include.join("ucp/api/ucp_version.h").display()
    );

    // Every binary that links this crate names UCX's libraries by absolute
    // path (see build_stubs.rs), so it starts from anywhere with no run path.
    println!("cargo::rerun-if-changed=build_stubs.rs");
    match build_stubs::build(&ucx.libdir) {
        Ok(stubs) => println!("cargo::rustc-link-search=native={}", stubs.display()),
        Err(e) => {
            println!(
                "cargo::warning=cannot build UCX link stubs ({e}); binaries started outside cargo need LD_LIBRARY_PATH={}",
                ucx.libdir.display()
            );
            println!("cargo::rustc-link-search=native={}", ucx.libdir.display());
            // `cargo run`, `cargo test` and cargo-nextest put link-search
            // directories inside the target directory on the loader's path.
            match link_farm(&ucx.libdir) {
                Ok(farm) => println!("cargo::rustc-link-search=native={}", farm.display()),
                Err(e) => println!("cargo::warning=cannot link UCX's libraries into OUT_DIR ({e})"),
            }
        }
    }
    for library in build_stubs::LINKED {
        // `uct`: the component listing (`ucx_sys::uct`) calls libuct directly.
        println!("cargo::rustc-link-lib=dylib={library}");
    }

    let version = format!("{}.{}", ucx.api.0, ucx.api.1);
    println!("cargo::metadata=vendored=");
    publish(&[
        ("root", ucx.root.display().to_string()),
        ("include", ucx.include.display().to_string()),
        ("libdir", ucx.libdir.display().to_string()),
        ("bindir", ucx.bindir.display().to_string()),
        ("version", version),
    ]);
}

/// The fallback when no stub can be built: `OUT_DIR/ucx-lib`, holding
/// symbolic links to UCX's shared libraries in
/// `libdir` (`libucp.so*`, `libucs.so*`, `libuct.so*`, `libucm.so*`) and to
/// its module directory `ucx/`: libucs looks for transport modules in
/// `ucx/` beside the path it was loaded from (and in the install's own
/// module directory, which a relocated install such as the wheel lacks).
fn link_farm(libdir: &Path) -> std::io::Result<PathBuf> {
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let farm = out.join("ucx-lib");
    if farm.exists() {
        fs::remove_dir_all(&farm)?;
    }
    fs::create_dir_all(&farm)?;
    for entry in fs::read_dir(libdir)? {
        let entry = entry?;
        let name = entry.file_name();
        let text = name.to_string_lossy();
        let wanted = text == "ucx"
            || ["libucp.so", "libucs.so", "libuct.so", "libucm.so"]
                .iter()
                .any(|stem| text.starts_with(stem));
        if wanted {
            let real = fs::canonicalize(entry.path())?;
            std::os::unix::fs::symlink(real, farm.join(&name))?;
        }
    }
    Ok(farm)
}

/// The `vendored` feature: build (or reuse the cached) static UCX from
/// `rdmareg-ucx-src` and link it in, with rdma-core's libraries dynamic.
#[cfg(feature = "vendored")]
fn vendored() {
    // The patches decide which build is linked (its cache key hashes them),
    // but cargo tracks only the Rust sources of `rdmareg-ucx-src`: without
    // these lines a changed patch would leave an existing target directory
    // linked against the build of the old patches.
    println!(
        "cargo::rerun-if-changed={}",
        rdmareg_ucx_src::patch_dir().display()
    );
    match rdmareg_ucx_src::patches() {
        Ok(patches) => {
            for patch in patches {
                println!("cargo::rerun-if-changed={}", patch.display());
            }
        }
        Err(e) => panic!("\n\nrdmareg-ucx-sys cannot list the UCX patches: {e}\n\n"),
    }
    let build = match rdmareg_ucx_src::static_build() {
        Ok(build) => build,
        Err(e) => panic!(
            "\n\nrdmareg-ucx-sys cannot build the vendored UCX: {e}\n\
             In an rdmareg checkout, `cargo xtask doctor` lists what the build needs.\n\n"
        ),
    };
    let header = build.include_dir.join("ucp/api/ucp_version.h");
    let api = fs::read_to_string(&header)
        .ok()
        .and_then(|text| api_version(&text))
        .unwrap_or_else(|| panic!("{} has no UCP_API_MAJOR/MINOR", header.display()));
    println!(
        "cargo::rustc-link-search=native={}",
        build.lib_dir.display()
    );
    println!(
        "cargo::rustc-link-search=native={}",
        build.module_dir.display()
    );
    for archive in build.archives() {
        println!("cargo::rustc-link-lib=static={archive}");
    }
    for library in build.system_libraries() {
        println!("cargo::rustc-link-lib=dylib={library}");
    }
    // This crate's code references each component's constructor.
    println!("cargo::rustc-cfg=ucx_vendored");
    println!("cargo::metadata=vendored=1");
    publish(&[
        ("root", build.prefix.display().to_string()),
        ("include", build.include_dir.display().to_string()),
        // Nothing to find at run time: no run path wanted.
        ("libdir", String::new()),
        // A static-only build makes no tools.
        ("bindir", String::new()),
        ("version", format!("{}.{}", api.0, api.1)),
    ]);
}

/// Tells dependents' build scripts (`DEP_UCP_<KEY>`) and this crate's code
/// (`UCXSYS_<KEY>`) where the install is.
fn publish(entries: &[(&str, String)]) {
    for (key, value) in entries {
        println!("cargo::metadata={key}={value}");
        println!("cargo::rustc-env=UCXSYS_{}={value}", key.to_uppercase());
    }
}

fn find() -> Result<Install, String> {
    if let Some(dir) = env::var_os(DIR_VARIABLE).filter(|dir| !dir.is_empty()) {
        let dir = PathBuf::from(dir);
        return at_prefix(&dir)
            .map_err(|e| format!("{DIR_VARIABLE}={} is not a UCX install: {e}", dir.display()));
    }
    let mut problems = vec![format!("{DIR_VARIABLE} is unset")];
    match from_pkg_config() {
        Ok(ucx) if ucx.api >= MINIMUM_API => return Ok(ucx),
        Ok(ucx) => problems.push(format!(
            "pkg-config names UCX {}.{} at {}, too old",
            ucx.api.0,
            ucx.api.1,
            ucx.root.display()
        )),
        Err(e) => problems.push(format!("pkg-config: {e}")),
    }
    let cache = match cache_root() {
        Some(cache) => cache,
        None => {
            problems.push(
                "no cache directory (RDMAREG_UCX_CACHE, XDG_CACHE_HOME and HOME are unset)"
                    .to_owned(),
            );
            return Err(problems.join("; "));
        }
    };
    let pointer = cache.join(POINTER);
    if !pointer.is_file() && cache.is_dir() {
        // Without a pointer the newest install is taken, so a later
        // provisioning that adds one (or writes the pointer) must rerun this.
        // Only then is the directory watched: cargo scans a watched
        // directory to its last file, following links, and the cache also
        // holds `cargo xtask fresh`'s Debian root (whose `dev/stdin` leads
        // to `/proc`, newer at every look) and CI's target directories, so
        // watching it made every build rerun this script and recompile
        // everything above it.
        println!("cargo::rerun-if-changed={}", cache.display());
    }
    if let Ok(text) = fs::read_to_string(&pointer) {
        // Every provisioning writes the pointer, so this is the change to
        // watch.
        println!("cargo::rerun-if-changed={}", pointer.display());
        let prefix = PathBuf::from(text.trim());
        match at_prefix(&prefix) {
            Ok(ucx) => return Ok(ucx),
            Err(e) => problems.push(format!(
                "{} names {}, which is not a UCX install ({e})",
                pointer.display(),
                prefix.display()
            )),
        }
    }
    match newest_source_build(&cache) {
        Some(ucx) => Ok(ucx),
        None => {
            problems.push(format!(
                "{} holds no complete {SOURCE_BUILD_PREFIX}* build",
                cache.display()
            ));
            Err(problems.join("; "))
        }
    }
}

/// The cache of provisioned builds (see the module docs).
fn cache_root() -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let nonempty = |name: &str| env::var_os(name).filter(|value| !value.is_empty());
    if let Some(dir) = nonempty("RDMAREG_UCX_CACHE") {
        return Some(PathBuf::from(dir));
    }
    if fs::metadata("/proc/self").is_ok_and(|meta| meta.uid() == 0) {
        return Some(PathBuf::from("/var/cache/rdmareg"));
    }
    if let Some(dir) = nonempty("XDG_CACHE_HOME") {
        return Some(PathBuf::from(dir).join("rdmareg"));
    }
    nonempty("HOME").map(|home| PathBuf::from(home).join(".cache/rdmareg"))
}

/// The newest complete from-source install in `cache`.
fn newest_source_build(cache: &Path) -> Option<Install> {
    fs::read_dir(cache)
        .ok()?
        .filter_map(|entry| entry.ok())
        .filter(|entry| {
            entry
                .file_name()
                .to_string_lossy()
                .starts_with(SOURCE_BUILD_PREFIX)
        })
        .map(|entry| entry.path())
        .filter_map(|path| {
            let modified = fs::metadata(path.join(".complete")).ok()?.modified().ok()?;
            Some((modified, path))
        })
        .max()
        .and_then(|(_, path)| at_prefix(&path).ok())
}

/// An install prefix laid out as `include/`, `lib/` (or `lib64/`), `bin/`.
fn at_prefix(prefix: &Path) -> Result<Install, String> {
    let libdir = ["lib", "lib64"]
        .iter()
        .map(|name| prefix.join(name))
        .find(|dir| dir.join("libucp.so").exists())
        .unwrap_or_else(|| prefix.join("lib"));
    checked(
        prefix.to_path_buf(),
        prefix.join("include"),
        libdir,
        prefix.join("bin"),
    )
}

fn from_pkg_config() -> Result<Install, String> {
    pkg_config::Config::new()
        .cargo_metadata(false)
        .env_metadata(true)
        .probe("ucx")
        .map_err(|e| e.to_string())?;
    let variable = |name: &str| {
        pkg_config::get_variable("ucx", name)
            .ok()
            .filter(|value| !value.is_empty())
            .map(PathBuf::from)
    };
    let root = variable("prefix").ok_or("ucx.pc has no prefix")?;
    let include = variable("includedir").unwrap_or_else(|| root.join("include"));
    let libdir = variable("libdir").unwrap_or_else(|| root.join("lib"));
    let bindir = variable("bindir").unwrap_or_else(|| root.join("bin"));
    checked(root, include, libdir, bindir)
}

/// Checks the header and library are where they should be and reads the
/// API version from `ucp_version.h`.
fn checked(
    root: PathBuf,
    include: PathBuf,
    libdir: PathBuf,
    bindir: PathBuf,
) -> Result<Install, String> {
    if !include.join("ucp/api/ucp.h").is_file() {
        return Err(format!(
            "{} is missing",
            include.join("ucp/api/ucp.h").display()
        ));
    }
    if !libdir.join("libucp.so").exists() {
        return Err(format!("{} is missing", libdir.join("libucp.so").display()));
    }
    let version_header = include.join("ucp/api/ucp_version.h");
    let text = fs::read_to_string(&version_header)
        .map_err(|e| format!("cannot read {}: {e}", version_header.display()))?;
    let api = api_version(&text)
        .ok_or_else(|| format!("{} has no UCP_API_MAJOR/MINOR", version_header.display()))?;
    Ok(Install {
        root,
        include,
        libdir,
        bindir,
        api,
    })
}

fn api_version(header: &str) -> Option<(u32, u32)> {
    let define = |name: &str| {
        header.lines().find_map(|line| {
            let mut words = line.split_whitespace();
            (words.next() == Some("#define") && words.next() == Some(name))
                .then(|| words.next()?.parse::<u32>().ok())
                .flatten()
        })
    };
    Some((define("UCP_API_MAJOR")?, define("UCP_API_MINOR")?))
}
