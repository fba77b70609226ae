//! Link stubs that make every dependent's binary find UCX with no run path
//! and no `LD_LIBRARY_PATH`.
//!
//! A build script's `rustc-link-arg` reaches only its own package's targets,
//! so this crate cannot give a dependent's binaries a run path. What it can
//! decide is the library each binary is linked against. For `libucp`,
//! `libucs` and `libuct` it builds, under `OUT_DIR`, a stub shared library
//! that defines the same dynamic symbols (empty bodies) and whose `SONAME`
//! is the absolute path of the real library. The linker copies a library's
//! `SONAME` into the binary's `DT_NEEDED`, so the binary names the real
//! library by absolute path and the dynamic loader opens exactly that file,
//! from `target/`, from a copy elsewhere, or under any environment. The
//! stubs are never loaded at run time: the loader only ever sees the real
//! path. UCX's own libraries find `libucm` and their transport modules
//! through their run path and beside themselves, as they always do.
//!
//! Building a stub needs the C compiler (`$CC`, else `cc`) and `nm`, which
//! come with the C toolchain UCX's build needs anyway.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The UCX libraries rdmareg's code calls directly.
pub const LINKED: [&str; 3] = ["ucp", "ucs", "uct"];

/// Builds the stubs for the libraries in `libdir` into `OUT_DIR/ucx-link`
/// and returns that directory.
pub fn build(libdir: &Path) -> Result<PathBuf, String> {
    let out = PathBuf::from(env::var_os("OUT_DIR").ok_or("cargo sets no OUT_DIR")?);
    let dir = out.join("ucx-link");
    if dir.exists() {
        fs::remove_dir_all(&dir).map_err(|e| format!("cannot clear {}: {e}", dir.display()))?;
    }
    fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let libdir = fs::canonicalize(libdir)
        .map_err(|e| format!("cannot resolve {}: {e}", libdir.display()))?;
    for name in LINKED {
        let real = real_library(&libdir, name)?;
        let source = dir.join(format!("lib{name}-stub.c"));
        fs::write(&source, stub_source(&defined_symbols(&real)?))
            .map_err(|e| format!("cannot write {}: {e}", source.display()))?;
        compile(&source, &real, &dir.join(format!("lib{name}.so")))?;
    }
    Ok(dir)
}

/// The file the loader should open for `lib<name>`: `lib<name>.so.0` (the
/// name UCX 1.x gives its `SONAME`) when it is there, else what
/// `lib<name>.so` resolves to.
fn real_library(libdir: &Path, name: &str) -> Result<PathBuf, String> {
    let versioned = libdir.join(format!("lib{name}.so.0"));
    if versioned.exists() {
        return Ok(versioned);
    }
    let plain = libdir.join(format!("lib{name}.so"));
    fs::canonicalize(&plain).map_err(|e| format!("cannot resolve {}: {e}", plain.display()))
}

/// A symbol the stub must define.
#[derive(Debug, PartialEq, Eq)]
enum Symbol {
    Function(String),
    Data { name: String, size: u64 },
}

/// The dynamic symbols `library` defines, read with `nm`.
fn defined_symbols(library: &Path) -> Result<Vec<Symbol>, String> {
    let nm = env::var_os("NM").unwrap_or_else(|| "nm".into());
    let output = Command::new(&nm)
        .args(["--dynamic", "--defined-only", "--print-size"])
        .arg(library)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", nm.to_string_lossy()))?;
    if !output.status.success() {
        return Err(format!(
            "nm failed on {}: {}",
            library.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    let symbols = parse_nm(&String::from_utf8_lossy(&output.stdout));
    if symbols.is_empty() {
        return Err(format!("nm lists no symbols in {}", library.display()));
    }
    Ok(symbols)
}

/// Parses `nm --dynamic --defined-only --print-size` output: lines of
/// `address [size] type name`.
fn parse_nm(text: &str) -> Vec<Symbol> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (size, kind, name) = match fields.as_slice() {
                [_, size, kind, name] => (u64::from_str_radix(size, 16).ok()?, *kind, *name),
                [_, kind, name] => (0, *kind, *name),
                _ => return None,
            };
            // Linker-defined and start-up symbols, and anything that is not
            // a plain C identifier (a versioned name), are not ours to define.
            let identifier = name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                && !name.starts_with('_')
                && !name.starts_with(|c: char| c.is_ascii_digit());
            if !identifier {
                return None;
            }
            match kind {
                "T" | "W" | "i" => Some(Symbol::Function(name.to_owned())),
                "D" | "B" | "R" | "V" | "G" | "S" => Some(Symbol::Data {
                    name: name.to_owned(),
                    size: size.max(1),
                }),
                _ => None,
            }
        })
        .collect()
}

/// C source defining every symbol: empty functions, zeroed data of the same
/// size.
fn stub_source(symbols: &[Symbol]) -> String {
    let mut source = String::from("/* Link stub generated by rdmareg-ucx-sys; never loaded. */\n");
    for symbol in symbols {
        match symbol {
            Symbol::Function(name) => writeln!(source, "void {name}(void) {{}}"),
            Symbol::Data { name, size } => writeln!(source, "char {name}[{size}];"),
        }
        .expect("writing to a String cannot fail");
    }
    source
}

fn compile(source: &Path, real: &Path, output: &Path) -> Result<(), String> {
    let cc = env::var_os("CC").unwrap_or_else(|| "cc".into());
    let result = Command::new(&cc)
        .args(["-shared", "-fPIC", "-nostdlib", "-o"])
        .arg(output)
        .arg(source)
        .arg(format!("-Wl,-soname,{}", real.display()))
        .output()
        .map_err(|e| format!("cannot run {}: {e}", cc.to_string_lossy()))?;
    if !result.status.success() {
        return Err(format!(
            "{} could not build {}: {}",
            cc.to_string_lossy(),
            output.display(),
            String::from_utf8_lossy(&result.stderr).trim()
        ));
    }
    Ok(())
}
