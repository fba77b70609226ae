//! `cargo xtask ucx --from-source`: UCX 1.22.0 built from its release
//! sources with rdmareg's patches, with InfiniBand (verbs, rdmacm) and cma.
//!
//! The release tarball and the patches come from the workspace crate
//! `rdmareg-ucx-src` (`crates/rdmareg-ucx-src`), which carries the tarball
//! of the crates.io package `ucx-rs 0.1.0+ucx.1.22.0` unmodified and checks
//! it against its recorded SHA-256 before unpacking; its `patches/` are
//! applied in name order with `patch -p1`. This is the shared build with
//! tools (`ucx_info`, `ucx_perftest`) that CI links; the same sources give
//! the static build of the `vendored` feature.
//!
//! The install goes to a cache directory outside the clone, named by the
//! release and a digest of everything that decides the build (tarball,
//! patches, configure arguments), so a fresh clone reuses it and a changed
//! patch builds a new one next to it:
//!
//! `$RDMAREG_UCX_CACHE` if set, else `/var/cache/rdmareg` for root (whose
//! home other users cannot enter; some tests run as another user), else
//! `$XDG_CACHE_HOME/rdmareg`, else `$HOME/.cache/rdmareg`; the install is
//! `<that>/ucx-1.22.0-src-<digest>`.
//!
//! The build runs in a staging directory beside it and is installed with
//! `DESTDIR`, then renamed into place once `ucx_info` confirms verbs,
//! rdmacm, cma and the patch are in; an interrupted build leaves no
//! half-made install. Which UCX the workspace links is recorded in
//! `<cache>/ucx-prefix` (see [`crate::ucx`]).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{self, Command};

use crate::ucx::{self, MINIMUM_API, Origin, PINNED_RELEASE, Ucx};
use crate::util::{Context, Error, Result, bail, format_duration, run, timed};

/// The configure arguments beyond `--prefix`: UCX's own release settings
/// (`contrib/configure-release`), threads, cma, InfiniBand through the
/// system rdma-core, and nothing GPU, Java, Go or documentation.
pub const CONFIGURE_ARGS: &[&str] = &[
    "--disable-logging",
    "--disable-debug",
    "--disable-assertions",
    "--disable-params-check",
    "--enable-mt",
    "--enable-cma",
    "--with-verbs",
    "--with-rdmacm",
    "--without-cuda",
    "--without-rocm",
    "--without-ze",
    "--without-gdrcopy",
    "--without-java",
    "--without-go",
    "--without-knem",
    "--without-xpmem",
    "--without-fuse3",
    "--without-ugni",
    "--disable-doxygen-doc",
    "--disable-static",
];

/// What the build needs, as (a file that shows it is there, the Debian
/// package providing it): the rdma-core development files (headers and link
/// libraries; no NIC needed) and the tools the build runs.
const BUILD_DEPENDENCIES: &[(&str, &str)] = &[
    ("/usr/include/infiniband/verbs.h", "libibverbs-dev"),
    ("/usr/include/rdma/rdma_cma.h", "librdmacm-dev"),
    ("/usr/bin/patch", "patch"),
    ("/usr/bin/make", "make"),
    ("/usr/bin/g++", "g++"),
];

/// Text each safety patch adds to a library of the install, with the
/// patch's file name and the library: their presence shows the installed
/// libraries were built from the patched source.
const PATCH_MARKERS: [(&str, &str, &str); 4] = [
    (
        "0001-tcp-refuse-put-requests-when-put-is-disabled.patch",
        "libuct.so",
        "but PUT is disabled on this interface",
    ),
    (
        "0004-tcp-refuse-frames-longer-than-the-receive-segment.patch",
        "libuct.so",
        "longer than this interface receives",
    ),
    (
        "0005-tcp-keep-the-listener-on-accept-errors-and-close-idle-accepts.patch",
        "libuct.so",
        "ACCEPT_HANDSHAKE_TIMEOUT",
    ),
    (
        "0006-ucp-keep-fragment-offsets-inside-the-receive-buffer.patch",
        "libucp.so",
        "outside its message",
    ),
];

/// The patches, sorted by file name (the order they apply in).
fn patches() -> Result<Vec<PathBuf>> {
    rdmareg_ucx_src::patches().map_err(|e| Error::msg(e.to_string()))
}

/// The cache root: `$RDMAREG_UCX_CACHE`; else, for root,
/// `/var/cache/rdmareg`; else `$XDG_CACHE_HOME/rdmareg` or
/// `$HOME/.cache/rdmareg`.
///
/// Root's home is closed to other users (mode 0700 on Debian), and the
/// tests run some processes as another user that must load this UCX.
pub fn cache_root() -> Result<PathBuf> {
    rdmareg_ucx_src::cache_root().map_err(|e| Error::msg(e.to_string()))
}

/// SHA-256 of a file, with coreutils' `sha256sum`.
fn sha256_of(path: &Path) -> Result<String> {
    let output = Command::new("sha256sum")
        .arg(path)
        .output()
        .context("cannot run sha256sum")?;
    if !output.status.success() {
        bail!("sha256sum {} failed", path.display());
    }
    let text = String::from_utf8_lossy(&output.stdout);
    match text.split_whitespace().next() {
        Some(digest) if digest.len() == 64 => Ok(digest.to_string()),
        _ => bail!("sha256sum printed no digest for {}", path.display()),
    }
}

/// The first 16 hex digits of a digest of everything that decides the
/// build: the tarball digest, each patch's name and content, and the
/// configure arguments.
fn build_key(patches: &[PathBuf], staging: &Path) -> Result<String> {
    let mut recipe = format!(
        "{}\n{}\n",
        rdmareg_ucx_src::TARBALL_SHA256,
        CONFIGURE_ARGS.join(" ")
    );
    for patch in patches {
        let name = patch.file_name().unwrap_or_default().to_string_lossy();
        recipe.push_str(&format!("{name} {}\n", sha256_of(patch)?));
    }
    fs::create_dir_all(staging).context(format!("cannot create {}", staging.display()))?;
    let file = staging.join("recipe");
    fs::write(&file, &recipe).context(format!("cannot write {}", file.display()))?;
    let digest = sha256_of(&file);
    fs::remove_file(&file).context(format!("cannot remove {}", file.display()))?;
    Ok(digest?[..16].to_string())
}

/// Where the install for the current patches and arguments lives.
pub fn install_prefix() -> Result<PathBuf> {
    let root = cache_root()?;
    let scratch = root.join(format!(".key-{}", process::id()));
    let key = build_key(&patches()?, &scratch);
    let _ = fs::remove_dir_all(&scratch);
    Ok(root.join(format!("ucx-{PINNED_RELEASE}-src-{}", key?)))
}

/// `cargo xtask ucx --from-source`: reuse or build the patched UCX, check
/// it, and make it the one the workspace links.
pub fn ensure() -> Result<Ucx> {
    let prefix = install_prefix()?;
    let ucx = match Ucx::at(&prefix, Origin::SourceBuild) {
        Ok(ucx) if prefix.join(".complete").exists() => {
            eprintln!("reusing UCX built from source at {}", prefix.display());
            ucx
        }
        _ => build(&prefix)?,
    };
    let proof = verify(&ucx)?;
    println!("{proof}");
    ucx::record_provisioned(&ucx.prefix)?;
    Ok(ucx)
}

/// Downloads, verifies, patches, configures, builds and installs into
/// `prefix` through a staging directory.
fn build(prefix: &Path) -> Result<Ucx> {
    let root = prefix
        .parent()
        .ok_or_else(|| Error::msg("the install prefix has no parent"))?;
    fs::create_dir_all(root).context(format!("cannot create {}", root.display()))?;
    let staging = root.join(format!(
        ".{}.staging-{}",
        prefix.file_name().unwrap_or_default().to_string_lossy(),
        process::id()
    ));
    if staging.exists() {
        fs::remove_dir_all(&staging).context(format!("cannot clear {}", staging.display()))?;
    }
    fs::create_dir_all(&staging).context(format!("cannot create {}", staging.display()))?;
    eprintln!(
        "building UCX {PINNED_RELEASE} from source into {} (staging in {})",
        prefix.display(),
        staging.display()
    );
    let (result, elapsed) = timed(|| build_in(&staging, prefix));
    if result.is_ok() {
        // Best effort: the staging directory holds the download and the
        // build tree, never read again.
        let _ = fs::remove_dir_all(&staging);
    } else {
        eprintln!(
            "the failed build is left in {} for inspection",
            staging.display()
        );
    }
    let ucx = result?;
    eprintln!(
        "built UCX {PINNED_RELEASE} from source in {}",
        format_duration(elapsed)
    );
    Ok(ucx)
}

fn build_in(staging: &Path, prefix: &Path) -> Result<Ucx> {
    ensure_build_dependencies()?;

    let source = rdmareg_ucx_src::unpack_patched(staging).map_err(|e| Error::msg(e.to_string()))?;
    eprintln!(
        "unpacked {} (sha256 {}) with {} patch(es)",
        rdmareg_ucx_src::tarball().display(),
        rdmareg_ucx_src::TARBALL_SHA256,
        patches()?.len()
    );

    let build_dir = source.join("build-rdmareg");
    fs::create_dir_all(&build_dir).context(format!("cannot create {}", build_dir.display()))?;
    run(Command::new(source.join("configure"))
        .arg(format!("--prefix={}", prefix.display()))
        .args(CONFIGURE_ARGS)
        .current_dir(&build_dir))?;
    let jobs = std::thread::available_parallelism().map_or(2, usize::from);
    run(Command::new("make")
        .arg(format!("-j{jobs}"))
        .current_dir(&build_dir))?;
    let destdir = staging.join("destdir");
    run(Command::new("make")
        .arg("install")
        .arg(format!("DESTDIR={}", destdir.display()))
        .current_dir(&build_dir))?;

    // `DESTDIR` puts the tree under `destdir/<prefix>`; the prefix itself is
    // compiled in, so the tree must end up exactly there.
    let relative = prefix.strip_prefix("/").unwrap_or(prefix);
    let installed = destdir.join(relative);
    let ucx = Ucx::at(&installed, Origin::SourceBuild)
        .context("the installed tree does not have the expected layout")?;
    if ucx.api != MINIMUM_API {
        bail!(
            "the built headers declare UCX API {}, expected {PINNED_RELEASE}",
            ucx.api
        );
    }
    fs::write(installed.join(".complete"), "").context("cannot mark the install complete")?;
    if prefix.exists() {
        fs::rename(prefix, staging.join("replaced"))
            .context(format!("cannot move the old {} aside", prefix.display()))?;
    }
    fs::rename(&installed, prefix).context(format!(
        "cannot rename {} to {}",
        installed.display(),
        prefix.display()
    ))?;
    Ucx::at(prefix, Origin::SourceBuild)
}

/// The Debian packages of [`BUILD_DEPENDENCIES`] that are missing.
pub fn missing_build_dependencies() -> Vec<&'static str> {
    BUILD_DEPENDENCIES
        .iter()
        .filter(|(file, _)| !Path::new(file).exists())
        .map(|&(_, package)| package)
        .collect()
}

/// Installs with apt-get whatever of [`BUILD_DEPENDENCIES`] is missing.
pub fn ensure_build_dependencies() -> Result<()> {
    let missing = missing_build_dependencies();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("installing {} with apt-get", missing.join(" "));
    crate::native::apt_install(&missing).map_err(|e| {
        Error::msg(format!(
            "cannot install {} ({e}); install them yourself",
            missing.join(" ")
        ))
    })
}

/// The newest complete from-source install in the cache, of any recipe:
/// what a build finds when nothing was recorded (see [`crate::ucx`]).
pub fn newest_cached() -> Option<Ucx> {
    let root = cache_root().ok()?;
    let prefix_start = format!("ucx-{PINNED_RELEASE}-src-");
    fs::read_dir(&root)
        .ok()?
        .filter_map(|entry| entry.ok())
        .filter(|entry| {
            entry
                .file_name()
                .to_string_lossy()
                .starts_with(&prefix_start)
        })
        .map(|entry| entry.path())
        .filter(|path| path.join(".complete").exists())
        .filter_map(|path| {
            let modified = fs::metadata(path.join(".complete")).ok()?.modified().ok()?;
            Some((modified, path))
        })
        .max()
        .and_then(|(_, path)| Ucx::at(&path, Origin::SourceBuild).ok())
}

/// Checks with the installed `ucx_info -b` that verbs, rdmacm and cma were
/// built and that `libuct.so` carries the patch; returns the lines that
/// show it.
pub fn verify(ucx: &Ucx) -> Result<String> {
    let output = ucx
        .tool("ucx_info")
        .arg("-b")
        .output()
        .context("cannot run ucx_info -b")?;
    if !output.status.success() {
        bail!("ucx_info -b failed ({})", output.status);
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let mut proof = build_proof(&text)?;
    for module in ["libuct_ib.so", "libuct_rdmacm.so", "libuct_cma.so"] {
        let path = ucx.lib_dir.join("ucx").join(module);
        if !path.exists() {
            bail!("{} is missing", path.display());
        }
        proof.push_str(&format!("  module present: {}\n", path.display()));
    }
    for (patch, library, marker) in PATCH_MARKERS {
        let path = ucx.lib_dir.join(library);
        let bytes = fs::read(&path).context(format!("cannot read {}", path.display()))?;
        if !contains(&bytes, marker.as_bytes()) {
            bail!(
                "{} lacks the text {patch} adds; it was not built from the patched source",
                path.display()
            );
        }
    }
    Ok(format!(
        "UCX built from source at {} (ucx_info -b):\n{proof}  libuct.so and libucp.so carry the PUT-refusal, frame-length, accept and fragment-offset patches",
        ucx.prefix.display(),
    ))
}

/// The `ucx_info -b` lines proving the build has verbs, rdmacm and cma, or
/// an error naming what is missing.
fn build_proof(build_info: &str) -> Result<String> {
    let define = |name: &str| {
        build_info.lines().find_map(|line| {
            let mut words = line.split_whitespace();
            (words.next() == Some("#define") && words.next() == Some(name))
                .then(|| line.trim().to_string())
        })
    };
    let modules = define("uct_MODULES").unwrap_or_default();
    let ib_modules = define("uct_ib_MODULES").unwrap_or_default();
    let mut missing = Vec::new();
    for (what, present) in [
        ("the ib module", modules.contains(":ib")),
        ("the rdmacm module", modules.contains(":rdmacm")),
        ("the cma module", modules.contains(":cma")),
        ("HAVE_IB", define("HAVE_IB").is_some()),
        ("ENABLE_MT", define("ENABLE_MT").is_some()),
    ] {
        if !present {
            missing.push(what);
        }
    }
    if !missing.is_empty() {
        bail!(
            "this UCX build lacks {} (ucx_info -b says: {modules:?})",
            missing.join(", ")
        );
    }
    let mut proof = String::new();
    for line in [Some(modules), Some(ib_modules), define("HAVE_IB")]
        .into_iter()
        .flatten()
        .chain(define("ENABLE_MT"))
        .chain(define("UCX_CONFIGURE_FLAGS"))
        .filter(|line| !line.is_empty())
    {
        proof.push_str("  ");
        proof.push_str(&line);
        proof.push('\n');
    }
    Ok(proof)
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack
        .windows(needle.len())
        .any(|window| window == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BUILT: &str = "#define ENABLE_MT                 1\n\
        #define HAVE_IB                   1\n\
        #define UCX_CONFIGURE_FLAGS       \"--with-verbs --with-rdmacm\"\n\
        #define uct_MODULES               \":ib:rdmacm:cma\"\n\
        #define uct_ib_MODULES            \":mlx5\"\n";

    #[test]
    fn a_build_with_ib_rdmacm_and_cma_is_proven_by_its_lines() {
        let proof = build_proof(BUILT).unwrap();
        assert!(proof.contains(":ib:rdmacm:cma"), "{proof}");
        assert!(proof.contains("--with-verbs"), "{proof}");
    }

    #[test]
    fn the_wheel_build_is_refused_for_lacking_infiniband() {
        let wheel = "#define ENABLE_MT                 1\n\
            #define uct_MODULES               \":cuda:cma\"\n";
        let err = build_proof(wheel).unwrap_err().to_string();
        assert!(err.contains("the ib module"), "{err}");
        assert!(err.contains("the rdmacm module"), "{err}");
    }

    #[test]
    fn the_patch_directory_holds_the_safety_patches_and_their_markers() {
        let names: Vec<String> = patches()
            .unwrap()
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        for (patch, _, marker) in PATCH_MARKERS {
            assert!(names.iter().any(|n| n == patch), "{patch}: {names:?}");
            let text = fs::read_to_string(rdmareg_ucx_src::patch_dir().join(patch)).unwrap();
            assert!(text.contains(marker), "{patch}");
        }
    }
}
