//! `cargo xtask ofi`: find or provision libfabric, and
//! `cargo xtask ofi-bindgen [--check]`: regenerate the committed
//! `rdmareg-ofi-sys` bindings, or check that they are current.
//!
//! Search order (the same as `rdmareg-ofi-sys`'s build script):
//! 1. `OFI_DIR`, an install prefix holding `include/rdma/fabric.h` and
//!    `lib/libfabric.so` — a site libfabric (EFA, cxi, a vendor build). An
//!    explicit choice: if it is broken or too old, the task fails.
//! 2. pkg-config (`libfabric`).
//! 3. Otherwise Debian's `libfabric-dev` is installed with apt (after one
//!    `apt-get update`): libfabric 1.17 on Debian 12.
//!
//! The minimum is libfabric **1.17**: the committed bindings carry its
//! layouts, and the engine's provider handling was measured against it.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use bindgen::{EnumVariation, Formatter, RustEdition, RustTarget};

use crate::util::{Context, Error, Result, bail, probe, workspace_root};

/// The oldest libfabric API accepted.
pub const MINIMUM: (u32, u32) = (1, 17);

/// Where a libfabric was found.
#[derive(Debug)]
pub struct Ofi {
    /// `include/` holding `rdma/fabric.h`.
    pub include_dir: PathBuf,
    /// Where `libfabric.so` is.
    pub lib_dir: PathBuf,
    /// `(major, minor)` from `rdma/fabric.h`.
    pub api: (u32, u32),
    /// How it was found.
    pub origin: &'static str,
}

/// `cargo xtask ofi`.
pub fn run_task(args: &[String]) -> Result<()> {
    if !args.is_empty() {
        bail!("usage: cargo xtask ofi (got `{}`)", args.join(" "));
    }
    let ofi = ensure()?;
    println!("libfabric {}.{} ({})", ofi.api.0, ofi.api.1, ofi.origin);
    println!("  include: {}", ofi.include_dir.display());
    println!("  libdir:  {}", ofi.lib_dir.display());
    Ok(())
}

/// Finds a usable libfabric, installing Debian's when there is none.
pub fn ensure() -> Result<Ofi> {
    if env::var_os("OFI_DIR").is_some() {
        return find();
    }
    if let Some(ofi) = from_pkg_config() {
        return require_minimum(ofi);
    }
    eprintln!("libfabric not found; installing Debian's libfabric-dev with apt-get");
    crate::native::apt_install(&["libfabric-dev", "pkg-config"]).map_err(|e| {
        Error::msg(format!(
            "cannot install libfabric-dev ({e}).\nInstall libfabric >= {}.{} yourself \
             (e.g. `apt-get install libfabric-dev`) or set OFI_DIR to its install prefix",
            MINIMUM.0, MINIMUM.1
        ))
    })?;
    find()
}

/// Finds a usable libfabric in the documented order, installing nothing.
pub fn find() -> Result<Ofi> {
    if let Some(dir) = env::var_os("OFI_DIR") {
        let dir = PathBuf::from(dir);
        let ofi = at_prefix(&dir, "OFI_DIR").map_err(|e| {
            Error::msg(format!(
                "OFI_DIR={} is not a libfabric install: {e}",
                dir.display()
            ))
        })?;
        return require_minimum(ofi);
    }
    match from_pkg_config() {
        Some(ofi) => require_minimum(ofi),
        None => bail!("pkg-config finds no libfabric (Debian: libfabric-dev)"),
    }
}

fn require_minimum(ofi: Ofi) -> Result<Ofi> {
    if ofi.api < MINIMUM {
        bail!(
            "libfabric {}.{} at {} is older than the minimum {}.{}; set OFI_DIR to a newer one",
            ofi.api.0,
            ofi.api.1,
            ofi.include_dir.display(),
            MINIMUM.0,
            MINIMUM.1
        );
    }
    Ok(ofi)
}

fn at_prefix(prefix: &Path, origin: &'static str) -> Result<Ofi> {
    let lib_dir = ["lib", "lib64"]
        .iter()
        .map(|name| prefix.join(name))
        .find(|dir| dir.join("libfabric.so").exists())
        .ok_or_else(|| Error::msg("no lib/libfabric.so or lib64/libfabric.so"))?;
    checked(prefix.join("include"), lib_dir, origin)
}

fn from_pkg_config() -> Option<Ofi> {
    let variable = |name: &str| {
        probe(Command::new("pkg-config").args(["--variable", name, "libfabric"]))
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .map(PathBuf::from)
    };
    let include = variable("includedir")?;
    let lib = variable("libdir")?;
    checked(include, lib, "pkg-config").ok()
}

fn checked(include_dir: PathBuf, lib_dir: PathBuf, origin: &'static str) -> Result<Ofi> {
    let header = include_dir.join("rdma/fabric.h");
    let text = fs::read_to_string(&header).context(format!("cannot read {}", header.display()))?;
    let api = parse_api_version(&text)
        .ok_or_else(|| Error::msg(format!("no FI_MAJOR/MINOR_VERSION in {}", header.display())))?;
    Ok(Ofi {
        include_dir,
        lib_dir,
        api,
        origin,
    })
}

/// `(FI_MAJOR_VERSION, FI_MINOR_VERSION)` from the text of `rdma/fabric.h`.
pub fn parse_api_version(header: &str) -> Option<(u32, u32)> {
    let define = |name: &str| {
        header.lines().find_map(|line| {
            let mut words = line.split_whitespace();
            (words.next() == Some("#define") && words.next() == Some(name))
                .then(|| words.next()?.parse().ok())
                .flatten()
        })
    };
    Some((define("FI_MAJOR_VERSION")?, define("FI_MINOR_VERSION")?))
}

/// Functions exported by `libfabric.so` that the engine calls. Everything
/// else (`fi_domain`, `fi_mr_reg`, `fi_read`, `fi_cq_read`, `fi_close` …)
/// is a `static inline` in the headers, which bindgen cannot bind; the
/// engine calls those through the ops tables the structs carry.
const FUNCTIONS: &[&str] = &[
    "fi_getinfo",
    "fi_freeinfo",
    "fi_dupinfo",
    "fi_fabric",
    "fi_version",
    "fi_strerror",
    "fi_tostr",
];

/// Every struct and ops table the engine walks, and the enums whose values
/// go into hints and attributes.
const TYPES: &[&str] = &[
    "fi_info",
    "fid_fabric",
    "fid_domain",
    "fid_ep",
    "fid_cq",
    "fid_av",
    "fid_mr",
    "fid_wait",
    "fi_ops",
    "fi_ops_fabric",
    "fi_ops_domain",
    "fi_ops_mr",
    "fi_ops_ep",
    "fi_ops_cm",
    "fi_ops_rma",
    "fi_ops_cq",
    "fi_ops_av",
    "fi_cq_attr",
    "fi_av_attr",
    "fi_mr_attr",
    "fi_cq_entry",
    "fi_cq_err_entry",
    "fi_ep_type",
    "fi_av_type",
    "fi_cq_format",
    "fi_wait_obj",
    "fi_mr_mode",
    "fi_threading",
    "fi_progress",
    "fi_type",
];

/// Capability, flag and mode bits (`#define`s), error numbers, versions.
const VARS: &[&str] = &["FI_.*"];

/// `crates/rdmareg-ofi-sys/src/bindings.rs`.
pub fn bindings_path() -> PathBuf {
    workspace_root().join("crates/rdmareg-ofi-sys/src/bindings.rs")
}

/// `cargo xtask ofi-bindgen [--check]`.
pub fn run_bindgen_task(args: &[String]) -> Result<()> {
    let check = match args {
        [] => false,
        [flag] if flag == "--check" => true,
        _ => bail!("usage: cargo xtask ofi-bindgen [--check]"),
    };
    use crate::native::{self, Need};
    native::ensure(&[Need::Libfabric, Need::Libclang])?;
    let ofi = find()?;
    let generated = generate(&ofi)?;
    let path = bindings_path();
    if check {
        let committed =
            fs::read_to_string(&path).context(format!("cannot read {}", path.display()))?;
        if committed != generated {
            bail!(
                "{} is stale or was generated from another libfabric; run `cargo xtask ofi-bindgen` \
                 (with OFI_DIR unset) and commit the result",
                path.display()
            );
        }
        println!("{} is current", path.display());
        return Ok(());
    }
    fs::write(&path, &generated).context(format!("cannot write {}", path.display()))?;
    println!(
        "wrote {} from libfabric {}.{} at {}",
        path.display(),
        ofi.api.0,
        ofi.api.1,
        ofi.include_dir.display()
    );
    Ok(())
}

fn generate(ofi: &Ofi) -> Result<String> {
    let mut builder = bindgen::Builder::default()
        .header_contents(
            "rdmareg_ofi_sys_wrapper.h",
            "#include <rdma/fabric.h>\n#include <rdma/fi_domain.h>\n#include <rdma/fi_endpoint.h>\n\
             #include <rdma/fi_cm.h>\n#include <rdma/fi_rma.h>\n#include <rdma/fi_eq.h>\n\
             #include <rdma/fi_errno.h>\n",
        )
        .clang_arg(format!("-I{}", ofi.include_dir.display()))
        .rust_target(RustTarget::stable(85, 0).map_err(|e| Error::msg(e.to_string()))?)
        .rust_edition(RustEdition::Edition2024)
        .formatter(Formatter::Prettyplease)
        .raw_line(format!(
            "// Generated by `cargo xtask ofi-bindgen` from libfabric {}.{} (rdma/*.h); do not edit.",
            ofi.api.0, ofi.api.1
        ))
        .raw_line("// Target: x86_64 Linux, LP64. Regenerate after changing the allowlist in xtask/src/ofi.rs.")
        .default_enum_style(EnumVariation::Consts)
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(true)
        .merge_extern_blocks(true)
        .sort_semantically(true)
        .generate_comments(false)
        .blocklist_type("iovec")
        .blocklist_type("sockaddr")
        .raw_line("use libc::{iovec, sockaddr};");
    for function in FUNCTIONS {
        builder = builder.allowlist_function(function);
    }
    for ty in TYPES {
        builder = builder.allowlist_type(ty);
    }
    for var in VARS {
        builder = builder.allowlist_var(var);
    }
    let bindings = builder.generate().map_err(|e| {
        Error::msg(format!(
            "bindgen failed on {}: {e}",
            ofi.include_dir.display()
        ))
    })?;
    Ok(bindings.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_api_version_is_read_from_the_fabric_header_defines() {
        let header = "#define FI_MAJOR_VERSION 1\n#define FI_MINOR_VERSION 17\n#define FI_REVISION_VERSION 0\n";
        assert_eq!(parse_api_version(header), Some((1, 17)));
    }

    #[test]
    fn a_header_without_version_defines_has_no_api_version() {
        assert_eq!(parse_api_version("#define FI_MAJOR_VERSION 1\n"), None);
        assert_eq!(parse_api_version("int x;\n"), None);
    }
}
