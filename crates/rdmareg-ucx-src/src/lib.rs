//! The UCX 1.22.0 release sources with rdmareg's patches, and a cached
//! static build of them.
//!
//! This crate is what `rdmareg-ucx-sys`'s `vendored` feature builds from
//! (the convention of `openssl-src` behind `openssl-sys`), and what
//! `cargo xtask ucx --from-source` unpacks for the shared build the
//! workspace's CI links. It carries:
//!
//! - [`tarball`]: the UCX 1.22.0 release tarball, taken unmodified from the
//!   crates.io package `ucx-rs 0.1.0+ucx.1.22.0` (`vendor/ucx-1.22.0.tar.gz`
//!   there) and checked against [`TARBALL_SHA256`] before every unpack;
//! - [`patches`]: rdmareg's patches to it, applied in name order;
//! - [`static_build`]: configure, build and install a static UCX with
//!   verbs, mlx5, rdmacm, cma and multi-thread support, cached outside the
//!   target directory so every workspace and CI run builds it once.
//!
//! # The cache
//!
//! [`cache_root`] is `$RDMAREG_UCX_CACHE` if set; else `/var/cache/rdmareg`
//! for root (whose home other users cannot enter); else
//! `$XDG_CACHE_HOME/rdmareg` or `$HOME/.cache/rdmareg`. A static build lives
//! in `<root>/ucx-1.22.0-static-<key>`, `<key>` being the first 16 hex
//! digits of a SHA-256 over the tarball digest, each patch's name and
//! content, and the configure arguments: a changed patch builds a new
//! install beside the old one. A build runs in a staging directory and is
//! renamed into place only when complete, so an interrupted build leaves
//! nothing that looks finished, and two builds racing end with one install.

use std::env;
use std::fmt;
use std::fs;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{self, Command};

use sha2::{Digest, Sha256};

/// The UCX release this crate carries.
pub const VERSION: &str = "1.22.0";

/// SHA-256 of [`tarball`]: the UCX 1.22.0 release tarball as vendored by
/// the crates.io package `ucx-rs 0.1.0+ucx.1.22.0` (whose `.crate` file has
/// SHA-256 [`UCX_RS_CRATE_SHA256`]).
pub const TARBALL_SHA256: &str = "258941cddd14ca60d38c0d31b9b09ec1052c901086841011a498da8b55a3cb24";

/// SHA-256 of the `.crate` file of `ucx-rs 0.1.0+ucx.1.22.0` the tarball was
/// taken from, as the crates.io index records it; kept so the tarball's
/// origin can be checked again.
pub const UCX_RS_CRATE_SHA256: &str =
    "b0f69840ad9bf0a2dddb056c1fcc847ea8de16cce0d29dee6a4d164049598b45";

/// The configure arguments of the static build beyond `--prefix`: UCX's
/// release settings, a static position-independent library, threads, cma,
/// InfiniBand (verbs and mlx5 direct verbs) and RDMA-CM through the system
/// rdma-core, and nothing GPU, EFA, Java, Go or documentation.
pub const STATIC_CONFIGURE_ARGS: &[&str] = &[
    "--enable-static",
    "--disable-shared",
    // The archives end up inside Rust binaries, shared objects included.
    "--with-pic",
    "--disable-logging",
    "--disable-debug",
    "--disable-assertions",
    "--disable-params-check",
    "--enable-mt",
    "--enable-cma",
    "--with-verbs",
    "--with-mlx5",
    "--with-rdmacm",
    "--without-efa",
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
];

/// The library directories built and installed, in order. UCX's top-level
/// `make` also builds the tools, which need the shared libraries that a
/// static-only build does not make.
const STATIC_SUBDIRS: &[&str] = &["src/ucm", "src/ucs", "src/uct", "src/ucp"];

/// What a build needs on the machine, as (a file that shows it is there,
/// the Debian package providing it).
pub const BUILD_DEPENDENCIES: &[(&str, &str)] = &[
    ("/usr/include/infiniband/verbs.h", "libibverbs-dev"),
    ("/usr/include/infiniband/mlx5dv.h", "libibverbs-dev"),
    ("/usr/include/rdma/rdma_cma.h", "librdmacm-dev"),
    ("/usr/bin/patch", "patch"),
    ("/usr/bin/make", "make"),
    ("/usr/bin/g++", "g++"),
];

/// A failed step, with what to do about it where there is something.
#[derive(Debug)]
pub struct Error(String);

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

fn error(message: impl Into<String>) -> Error {
    Error(message.into())
}

/// The vendored release tarball.
pub fn tarball() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("vendor/ucx-{VERSION}.tar.gz"))
}

/// The directory holding the patches.
pub fn patch_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("patches")
}

/// The patches (`*.patch` in [`patch_dir`]), sorted by file name: the order
/// they apply in.
pub fn patches() -> Result<Vec<PathBuf>, Error> {
    let dir = patch_dir();
    let entries =
        fs::read_dir(&dir).map_err(|e| error(format!("cannot list {}: {e}", dir.display())))?;
    let mut found: Vec<PathBuf> = entries
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "patch"))
        .collect();
    found.sort();
    Ok(found)
}

/// The SHA-256 of a file, as lowercase hex.
pub fn sha256_file(path: &Path) -> Result<String, Error> {
    let mut file =
        fs::File::open(path).map_err(|e| error(format!("cannot open {}: {e}", path.display())))?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 16];
    loop {
        let read = file
            .read(&mut buffer)
            .map_err(|e| error(format!("cannot read {}: {e}", path.display())))?;
        if read == 0 {
            break;
        }
        hasher.update(&buffer[..read]);
    }
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// Checks [`tarball`] against [`TARBALL_SHA256`].
pub fn verify_tarball() -> Result<(), Error> {
    let path = tarball();
    let actual = sha256_file(&path)?;
    if actual != TARBALL_SHA256 {
        return Err(error(format!(
            "{} has SHA-256 {actual}, expected {TARBALL_SHA256}; refusing to build it",
            path.display()
        )));
    }
    Ok(())
}

/// Verifies the tarball, unpacks it into `dir` and applies the patches;
/// returns the source tree (`<dir>/ucx-1.22.0`).
pub fn unpack_patched(dir: &Path) -> Result<PathBuf, Error> {
    verify_tarball()?;
    fs::create_dir_all(dir).map_err(|e| error(format!("cannot create {}: {e}", dir.display())))?;
    run(Command::new("tar")
        .arg("-xzf")
        .arg(tarball())
        .arg("-C")
        .arg(dir))?;
    let source = dir.join(format!("ucx-{VERSION}"));
    for patch in patches()? {
        run(Command::new("patch")
            .args(["-p1", "--forward", "--batch", "--silent", "--input"])
            .arg(&patch)
            .current_dir(&source))?;
    }
    Ok(source)
}

/// The cache root (see the crate docs).
pub fn cache_root() -> Result<PathBuf, Error> {
    let nonempty = |name: &str| env::var_os(name).filter(|value| !value.is_empty());
    if let Some(dir) = nonempty("RDMAREG_UCX_CACHE") {
        return Ok(PathBuf::from(dir));
    }
    if fs::metadata("/proc/self").is_ok_and(|meta| meta.uid() == 0) {
        return Ok(PathBuf::from("/var/cache/rdmareg"));
    }
    if let Some(dir) = nonempty("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(dir).join("rdmareg"));
    }
    match nonempty("HOME") {
        Some(home) => Ok(PathBuf::from(home).join(".cache/rdmareg")),
        None => Err(error(
            "neither RDMAREG_UCX_CACHE, XDG_CACHE_HOME nor HOME is set; set RDMAREG_UCX_CACHE",
        )),
    }
}

/// The first 16 hex digits of a digest of everything that decides a build:
/// the tarball digest, each patch's name and content, and `args`.
pub fn build_key(args: &[&str]) -> Result<String, Error> {
    let mut hasher = Sha256::new();
    hasher.update(TARBALL_SHA256.as_bytes());
    hasher.update(b"\n");
    hasher.update(args.join(" ").as_bytes());
    hasher.update(b"\n");
    for patch in patches()? {
        let name = patch.file_name().unwrap_or_default().to_string_lossy();
        hasher.update(format!("{name} {}\n", sha256_file(&patch)?).as_bytes());
    }
    Ok(hex(&hasher.finalize())[..16].to_string())
}

/// A finished static install.
#[derive(Debug, Clone)]
pub struct StaticBuild {
    /// The install prefix.
    pub prefix: PathBuf,
    /// The directory holding `ucp/api/ucp.h`.
    pub include_dir: PathBuf,
    /// The directory holding `libucp.a`, `libuct.a`, `libucs.a`, `libucm.a`.
    pub lib_dir: PathBuf,
    /// The directory holding the transport archives (`libuct_ib.a`, …).
    pub module_dir: PathBuf,
}

impl StaticBuild {
    fn at(prefix: PathBuf) -> Self {
        Self {
            include_dir: prefix.join("include"),
            lib_dir: prefix.join("lib"),
            module_dir: prefix.join("lib/ucx"),
            prefix,
        }
    }

    /// The archives to link, as names for `-l` (`ucp` for `libucp.a`), in
    /// link order: the transport modules first (they call into the core
    /// libraries), `uct_ib` before `uct_ib_mlx5` (the order their
    /// constructors register memory-domain drivers in decides which driver
    /// opens a device first: mlx5's must end up first), then the core.
    pub fn archives(&self) -> &'static [&'static str] {
        &[
            "uct_ib",
            "uct_ib_mlx5",
            "uct_rdmacm",
            "uct_cma",
            "ucp",
            "uct",
            "ucs",
            "ucs_signal",
            "ucm",
        ]
    }

    /// The system libraries the archives need, as names for `-l`:
    /// rdma-core's (dynamic; they find the NIC's provider at run time) and
    /// the C runtime's.
    pub fn system_libraries(&self) -> &'static [&'static str] {
        &["ibverbs", "mlx5", "rdmacm", "m", "dl", "rt", "pthread"]
    }

    /// The ELF constructors that register UCX's components. In a static
    /// link an archive member is pulled only when a symbol in it is
    /// referenced, so a binary must reference each of these or the
    /// component it registers is silently absent (UCX's own pkg-config
    /// files say the same with `-Wl,--undefined=`).
    pub fn constructors(&self) -> &'static [&'static str] {
        &[
            "ucs_init",
            "uct_init",
            "ucp_global_init",
            "uct_ib_init",
            "uct_mlx5_init",
            "uct_rdmacm_init",
            "uct_cma_init",
        ]
    }
}

/// Builds the static UCX, or reuses the cached one built from the same
/// tarball, patches and arguments.
pub fn static_build() -> Result<StaticBuild, Error> {
    let key = build_key(STATIC_CONFIGURE_ARGS)?;
    let root = cache_root()?;
    let prefix = root.join(format!("ucx-{VERSION}-static-{key}"));
    if prefix.join(".complete").exists() {
        return Ok(StaticBuild::at(prefix));
    }
    check_build_dependencies()?;
    fs::create_dir_all(&root)
        .map_err(|e| error(format!("cannot create {}: {e}", root.display())))?;
    let staging = root.join(format!(
        ".ucx-{VERSION}-static-{key}.staging-{}",
        process::id()
    ));
    if staging.exists() {
        fs::remove_dir_all(&staging)
            .map_err(|e| error(format!("cannot clear {}: {e}", staging.display())))?;
    }
    let result = build_in(&staging, &prefix);
    if result.is_ok() {
        // Best effort: the staging directory holds only the build tree now.
        let _ = fs::remove_dir_all(&staging);
    }
    result
}

fn build_in(staging: &Path, prefix: &Path) -> Result<StaticBuild, Error> {
    let source = unpack_patched(staging)?;
    let build_dir = source.join("build-static");
    fs::create_dir_all(&build_dir)
        .map_err(|e| error(format!("cannot create {}: {e}", build_dir.display())))?;
    run(Command::new(source.join("configure"))
        .arg(format!("--prefix={}", prefix.display()))
        .args(STATIC_CONFIGURE_ARGS)
        .current_dir(&build_dir))?;
    let jobs = env::var("NUM_JOBS")
        .ok()
        .filter(|jobs| !jobs.is_empty())
        .unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map_or(2, usize::from)
                .to_string()
        });
    let destdir = staging.join("destdir");
    for subdir in STATIC_SUBDIRS {
        run(Command::new("make")
            .args(["-C", subdir, "-j", &jobs])
            .current_dir(&build_dir))?;
        run(Command::new("make")
            .args(["-C", subdir, "install"])
            .arg(format!("DESTDIR={}", destdir.display()))
            .current_dir(&build_dir))?;
    }
    // `DESTDIR` puts the tree under `destdir/<prefix>`; the prefix is
    // compiled in, so the tree must end up exactly there.
    let installed = destdir.join(prefix.strip_prefix("/").unwrap_or(prefix));
    let built = StaticBuild::at(installed.clone());
    for name in built.archives() {
        let archive = [&built.lib_dir, &built.module_dir]
            .iter()
            .map(|dir| dir.join(format!("lib{name}.a")))
            .find(|path| path.exists());
        if archive.is_none() {
            return Err(error(format!(
                "the build installed no lib{name}.a under {}; is rdma-core's development \
                 package (libibverbs-dev, librdmacm-dev) installed?",
                built.lib_dir.display()
            )));
        }
    }
    fs::write(installed.join(".complete"), "")
        .map_err(|e| error(format!("cannot mark {} complete: {e}", installed.display())))?;
    match fs::rename(&installed, prefix) {
        Ok(()) => {}
        // Another build of the same key finished first: use it.
        Err(_) if prefix.join(".complete").exists() => {}
        Err(e) => {
            return Err(error(format!(
                "cannot rename {} to {}: {e}",
                installed.display(),
                prefix.display()
            )));
        }
    }
    Ok(StaticBuild::at(prefix.to_path_buf()))
}

/// Fails naming the Debian packages to install when a build dependency is
/// missing.
pub fn check_build_dependencies() -> Result<(), Error> {
    let mut missing: Vec<&str> = BUILD_DEPENDENCIES
        .iter()
        .filter(|(file, _)| !Path::new(file).exists())
        .map(|&(_, package)| package)
        .collect();
    missing.dedup();
    if missing.is_empty() {
        return Ok(());
    }
    Err(error(format!(
        "building UCX needs {} (Debian: `apt-get install {}`; `cargo xtask vendored` installs \
         them); or build without the `vendored` feature, or set RDMAREG_UCX_NO_VENDOR=1",
        missing.join(", "),
        missing.join(" ")
    )))
}

/// Runs `cmd`, its output going to this process's stderr (a build script's
/// output log), failing unless it exits successfully.
fn run(cmd: &mut Command) -> Result<(), Error> {
    let line = format!("{cmd:?}");
    // Stdout goes to stderr too: a build script's stdout is read by cargo
    // as instructions.
    let status = cmd
        .stdout(std::io::stderr())
        .status()
        .map_err(|e| error(format!("cannot start {line}: {e}")))?;
    if !status.success() {
        return Err(error(format!("{line} failed ({status})")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vendored_tarball_matches_its_recorded_digest() {
        assert_eq!(sha256_file(&tarball()).unwrap(), TARBALL_SHA256);
        verify_tarball().unwrap();
    }

    #[test]
    fn the_put_refusal_patch_is_among_the_patches() {
        let patches = patches().unwrap();
        let put = patches
            .iter()
            .find(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().contains("refuse-put"))
            })
            .expect("the PUT-refusal patch is vendored");
        let text = fs::read_to_string(put).unwrap();
        assert!(text.contains("but PUT is disabled on this interface"));
    }

    #[test]
    fn the_accept_patch_is_among_the_patches() {
        let patches = patches().unwrap();
        let accept = patches
            .iter()
            .find(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().contains("accept-errors"))
            })
            .expect("the accept patch is vendored");
        let text = fs::read_to_string(accept).unwrap();
        assert!(text.contains("ACCEPT_HANDSHAKE_TIMEOUT"));
        assert!(text.contains("uct_tcp_iface_accept_errno_is_resource"));
    }

    #[test]
    fn the_fragment_offset_patch_is_among_the_patches() {
        let patches = patches().unwrap();
        let offsets = patches
            .iter()
            .find(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().contains("fragment-offsets"))
            })
            .expect("the fragment-offset patch is vendored");
        let text = fs::read_to_string(offsets).unwrap();
        assert!(text.contains("outside its message"));
        assert!(text.contains("(offset > dt_iter->length)"));
    }

    #[test]
    fn the_build_key_changes_with_the_configure_arguments() {
        let with = build_key(STATIC_CONFIGURE_ARGS).unwrap();
        let without = build_key(&STATIC_CONFIGURE_ARGS[1..]).unwrap();
        assert_eq!(with.len(), 16);
        assert_ne!(with, without);
        assert_eq!(with, build_key(STATIC_CONFIGURE_ARGS).unwrap());
    }

    #[test]
    fn the_static_build_asks_for_verbs_mlx5_rdmacm_cma_and_threads() {
        for wanted in [
            "--with-verbs",
            "--with-mlx5",
            "--with-rdmacm",
            "--enable-cma",
            "--enable-mt",
            "--enable-static",
        ] {
            assert!(STATIC_CONFIGURE_ARGS.contains(&wanted), "{wanted}");
        }
    }

    #[test]
    fn mlx5s_archive_links_after_the_ib_archive() {
        let build = StaticBuild::at(PathBuf::from("/x"));
        let position = |name| build.archives().iter().position(|a| *a == name).unwrap();
        assert!(position("uct_ib") < position("uct_ib_mlx5"));
        assert!(position("uct_ib_mlx5") < position("ucp"));
    }

    #[test]
    fn the_hex_of_bytes_is_two_lowercase_digits_each() {
        assert_eq!(hex(&[0x00, 0xab, 0x7f]), "00ab7f");
    }
}
