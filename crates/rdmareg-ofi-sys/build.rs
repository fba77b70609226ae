//! Finds the libfabric to link, links `libfabric`, and tells dependents
//! where it is.
//!
//! Search order (the same as `cargo xtask ofi`):
//! 1. `OFI_DIR`, an install prefix (a site libfabric). An explicit choice:
//!    if it is broken or too old, the build fails.
//! 2. pkg-config (`libfabric`) — Debian's `libfabric-dev`, which
//!    `cargo xtask ofi` installs when nothing is found.
//!
//! Metadata for dependents' build scripts (`DEP_FABRIC_<KEY>`): `INCLUDE`,
//! `LIBDIR`, `VERSION` (the headers' `major.minor`).

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

/// The oldest libfabric accepted: the committed bindings carry 1.17's layouts.
const MINIMUM: (u32, u32) = (1, 17);

const FIX: &str = "Fix it either way:\n  \
    - in an rdmareg checkout, run `cargo xtask doctor` to see what is missing and `cargo xtask ofi` (with OFI_DIR unset) to install Debian's libfabric-dev, or\n  \
    - set OFI_DIR=/path/to/libfabric, an install prefix holding include/rdma/fabric.h and lib/libfabric.so (libfabric >= 1.17)";

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=OFI_DIR");

    let (include, libdir) = match find() {
        Ok(found) => found,
        Err(problem) => {
            panic!("\n\nrdmareg-ofi-sys cannot find a usable libfabric: {problem}\n{FIX}\n\n")
        }
    };
    let header = include.join("rdma/fabric.h");
    println!("cargo::rerun-if-changed={}", header.display());
    let text = fs::read_to_string(&header)
        .unwrap_or_else(|e| panic!("\n\ncannot read {}: {e}\n{FIX}\n\n", header.display()));
    let api = parse_api_version(&text).unwrap_or_else(|| {
        panic!(
            "\n\n{} declares no FI_MAJOR_VERSION/FI_MINOR_VERSION\n{FIX}\n\n",
            header.display()
        )
    });
    if api < MINIMUM {
        panic!(
            "\n\nrdmareg-ofi-sys found libfabric {}.{} at {}, older than the minimum {}.{}.\n{FIX}\n\n",
            api.0,
            api.1,
            include.display(),
            MINIMUM.0,
            MINIMUM.1
        );
    }
    println!("cargo::rustc-link-search=native={}", libdir.display());
    println!("cargo::rustc-link-lib=dylib=fabric");
    println!(
        "cargo::rustc-link-arg-tests=-Wl,-rpath,{}",
        libdir.display()
    );
    let version = format!("{}.{}", api.0, api.1);
    for (key, value) in [
        ("include", include.display().to_string()),
        ("libdir", libdir.display().to_string()),
        ("version", version),
    ] {
        println!("cargo::metadata={key}={value}");
        println!("cargo::rustc-env=OFISYS_{}={value}", key.to_uppercase());
    }
}

fn find() -> Result<(PathBuf, PathBuf), String> {
    if let Some(dir) = env::var_os("OFI_DIR") {
        let dir = PathBuf::from(dir);
        return at_prefix(&dir)
            .map_err(|e| format!("OFI_DIR={} is not a libfabric install: {e}", dir.display()));
    }
    let library = pkg_config::Config::new()
        .cargo_metadata(false)
        .env_metadata(true)
        .probe("libfabric")
        .map_err(|e| format!("OFI_DIR is unset and pkg-config finds no libfabric: {e}"))?;
    let variable = |name: &str| {
        pkg_config::get_variable("libfabric", name)
            .ok()
            .filter(|value| !value.is_empty())
            .map(PathBuf::from)
    };
    let include = variable("includedir")
        .or_else(|| library.include_paths.first().cloned())
        .ok_or("libfabric.pc names no include directory")?;
    let libdir = variable("libdir")
        .or_else(|| library.link_paths.first().cloned())
        .ok_or("libfabric.pc names no library directory")?;
    Ok((include, libdir))
}

fn at_prefix(prefix: &Path) -> Result<(PathBuf, PathBuf), String> {
    let include = prefix.join("include");
    if !include.join("rdma/fabric.h").exists() {
        return Err(format!("{} has no rdma/fabric.h", include.display()));
    }
    let libdir = ["lib", "lib64"]
        .iter()
        .map(|name| prefix.join(name))
        .find(|dir| dir.join("libfabric.so").exists())
        .ok_or("no lib/libfabric.so or lib64/libfabric.so")?;
    Ok((include, libdir))
}

fn parse_api_version(header: &str) -> Option<(u32, u32)> {
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
