//! `cargo xtask bindgen [--check]`: regenerate the committed `rdmareg-ucx-sys`
//! bindings, or check that they are current.
//!
//! The bindings are committed so that building the workspace needs no
//! libclang; only this task does. It installs libclang (`libclang-dev` via
//! apt) when none is found and `LIBCLANG_PATH` is unset. Generation uses the
//! UCX that `cargo xtask ucx` resolves, so with no `RDMAREG_UCX_DIR` set it is the
//! pinned 1.22.0 — the version named in the file's header.
//!
//! The allowlist is the UCP surface the engine uses and nothing more:
//! context, worker and endpoint lifecycle, wake-up, memory mapping, remote
//! keys, GET, active messages (the owner-served reads), flush, request
//! handling and status strings, with every
//! parameter struct, field-mask enum and flag those calls take. C enums
//! become plain constants under their C names (`UCS_OK`, `UCP_FEATURE_RMA`)
//! so values UCX returns that these headers do not list are still valid Rust.

use std::fs;
use std::path::{Path, PathBuf};

use bindgen::callbacks::ParseCallbacks;
use bindgen::{EnumVariation, Formatter, RustEdition, RustTarget};

use crate::ucx::{self, Ucx};
use crate::util::{Context, Error, Result, bail, workspace_root};

/// Functions the engine calls.
const FUNCTIONS: &[&str] = &[
    // Context.
    "ucp_config_read",
    "ucp_config_release",
    "ucp_config_modify",
    "ucp_init_version",
    "ucp_cleanup",
    "ucp_context_query",
    "ucp_get_version",
    "ucp_get_version_string",
    // Worker and its wake-up.
    "ucp_worker_create",
    "ucp_worker_destroy",
    "ucp_worker_query",
    "ucp_worker_get_address",
    "ucp_worker_release_address",
    "ucp_worker_progress",
    "ucp_worker_arm",
    "ucp_worker_signal",
    "ucp_worker_get_efd",
    "ucp_worker_flush_nbx",
    // Endpoints.
    "ucp_ep_create",
    "ucp_ep_close_nbx",
    "ucp_ep_flush_nbx",
    "ucp_ep_query",
    // Memory and remote keys.
    "ucp_mem_map",
    "ucp_mem_unmap",
    "ucp_mem_query",
    "ucp_rkey_pack",
    "ucp_rkey_buffer_release",
    "ucp_ep_rkey_unpack",
    "ucp_rkey_destroy",
    // Transfers and requests.
    "ucp_get_nbx",
    // Raw-peer tests send an emulated PUT to prove an engine refuses it.
    "ucp_put_nbx",
    // Owner-served reads: active messages and their rendezvous receive.
    "ucp_worker_set_am_recv_handler",
    "ucp_am_send_nbx",
    "ucp_am_recv_data_nbx",
    "ucp_am_data_release",
    "ucp_request_check_status",
    "ucp_request_cancel",
    "ucp_request_free",
    // Status.
    "ucs_status_string",
];

/// Types not reachable from the functions' signatures: the enums whose
/// values go into `field_mask`, `features`, `flags` and mode fields.
const TYPES: &[&str] = &[
    "ucs_status_t",
    "ucs_thread_mode_t",
    "ucs_memory_type",
    "ucp_params_field",
    "ucp_feature",
    "ucp_context_attr_field",
    "ucp_worker_params_field",
    "ucp_worker_flags_t",
    "ucp_worker_attr_field",
    "ucp_worker_address_flags_t",
    "ucp_wakeup_event_types",
    "ucp_ep_params_field",
    "ucp_ep_params_flags_field",
    "ucp_ep_close_flags_t",
    "ucp_ep_attr_field",
    "ucp_ep_attr_t",
    "ucp_err_handling_mode_t",
    "ucp_mem_map_params_field",
    "ucp_mem_attr_field",
    "ucp_op_attr_t",
    "ucp_req_attr_field",
    "ucp_am_handler_param_field",
    "ucp_am_cb_flags",
    "ucp_send_am_flags",
    "ucp_am_recv_attr_t",
    "ucp_dt_type",
    "ucp_dt_iov_t",
];

/// Constants: the API version the headers declare, and the members of the
/// anonymous `ucp_mem_map` flag and protection enums.
const VARS: &[&str] = &["UCP_API_MAJOR", "UCP_API_MINOR", "UCP_MEM_MAP_.*"];

/// `crates/rdmareg-ucx-sys/src/bindings.rs`.
pub fn bindings_path() -> PathBuf {
    workspace_root().join("crates/rdmareg-ucx-sys/src/bindings.rs")
}

/// `cargo xtask bindgen [--check]`.
pub fn run_task(args: &[String]) -> Result<()> {
    let check = match args {
        [] => false,
        [flag] if flag == "--check" => true,
        _ => bail!("usage: cargo xtask bindgen [--check]"),
    };
    use crate::native::{self, Need};
    native::ensure(&[Need::Ucx, Need::Libclang])?;
    let ucx = ucx::find()?;
    let release = ucx.describe_version();
    let generated = generate(&ucx, &release)?;
    let path = bindings_path();
    if check {
        check_current(&path, &generated, &release)
    } else {
        fs::write(&path, &generated).context(format!("cannot write {}", path.display()))?;
        println!(
            "wrote {} from UCX {release} at {}",
            path.display(),
            ucx.prefix.display()
        );
        Ok(())
    }
}

/// Fails, naming the fix, unless `path` holds exactly `generated`.
fn check_current(path: &Path, generated: &str, release: &str) -> Result<()> {
    let committed = fs::read_to_string(path).context(format!("cannot read {}", path.display()))?;
    if committed == generated {
        println!("{} is current (UCX {release})", path.display());
        return Ok(());
    }
    let committed_header = committed.lines().next().unwrap_or("");
    let generated_header = generated.lines().next().unwrap_or("");
    if committed_header != generated_header {
        bail!(
            "{} is stale or was generated from another UCX:\n  committed: {committed_header}\n  \
             generated: {generated_header}\nRun `cargo xtask bindgen` (with RDMAREG_UCX_DIR unset to use the pinned UCX).",
            path.display()
        );
    }
    let line = committed
        .lines()
        .zip(generated.lines())
        .position(|(a, b)| a != b)
        .unwrap_or_else(|| committed.lines().count().min(generated.lines().count()))
        + 1;
    bail!(
        "{} is stale (first difference at line {line}); run `cargo xtask bindgen` and commit the result",
        path.display()
    );
}

/// Runs bindgen over `ucp/api/ucp.h` of `ucx`.
fn generate(ucx: &Ucx, release: &str) -> Result<String> {
    let mut builder = bindgen::Builder::default()
        .header_contents("ucx_sys_wrapper.h", "#include <ucp/api/ucp.h>\n")
        .clang_arg(format!("-I{}", ucx.include_dir.display()))
        .rust_target(RustTarget::stable(85, 0).map_err(|e| Error::msg(e.to_string()))?)
        .rust_edition(RustEdition::Edition2024)
        .formatter(Formatter::Prettyplease)
        .raw_line(format!(
            "// Generated by `cargo xtask bindgen` from UCX {release} (ucp/api/ucp.h); do not edit."
        ))
        .raw_line("// Target: x86_64 Linux, LP64. Regenerate after changing the allowlist in xtask/src/bindgen.rs.")
        .default_enum_style(EnumVariation::Consts)
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(true)
        .merge_extern_blocks(true)
        .sort_semantically(true)
        .generate_comments(true)
        .parse_callbacks(Box::new(DocCommentsAsText));
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
            ucx.include_dir.display()
        ))
    })?;
    Ok(bindings.to_string())
}

/// Keeps UCX's Doxygen comments as documentation without letting rustdoc
/// read them as Markdown: their indented lines would become doctests and
/// their `[in]`/`[out]` markers broken intra-doc links.
#[derive(Debug)]
struct DocCommentsAsText;

impl ParseCallbacks for DocCommentsAsText {
    fn process_comment(&self, comment: &str) -> Option<String> {
        let body = comment.trim().replace("```", "'''");
        Some(format!("```text\n{body}\n```"))
    }
}

/// Makes sure bindgen can load a libclang, installing `libclang-dev` when
/// there is none and `LIBCLANG_PATH` is unset.
pub fn ensure_libclang() -> Result<()> {
    if std::env::var_os("LIBCLANG_PATH").is_some() {
        return Ok(());
    }
    if let Some(found) = find_libclang() {
        eprintln!("using libclang at {}", found.display());
        return Ok(());
    }
    eprintln!("libclang not found; installing libclang-dev with apt-get");
    crate::native::apt_install(&["libclang-dev"])
        .map_err(|e| {
            Error::msg(format!(
                "cannot install libclang-dev ({e}).\nInstall libclang yourself (e.g. `apt-get install libclang-dev`) \
                 or set LIBCLANG_PATH to the directory holding libclang.so"
            ))
        })?;
    match find_libclang() {
        Some(found) => {
            eprintln!("using libclang at {}", found.display());
            Ok(())
        }
        None => bail!(
            "libclang-dev was installed but no libclang.so appeared under /usr/lib/llvm-*/lib"
        ),
    }
}

/// A libclang shared library (the C API, not `libclang-cpp`) in an LLVM
/// install under `/usr/lib/llvm-*/lib` that also has clang's own headers
/// (`stddef.h` and friends), without which parsing the UCX headers fails.
pub fn find_libclang() -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = fs::read_dir("/usr/lib")
        .ok()?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| {
            path.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("llvm-"))
        })
        .map(|path| path.join("lib"))
        .filter(|lib| has_clang_headers(lib))
        .filter_map(|lib| fs::read_dir(lib).ok())
        .flatten()
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| {
            path.file_name()
                .is_some_and(|name| is_libclang(&name.to_string_lossy()))
        })
        .collect();
    candidates.sort();
    candidates.pop()
}

/// Whether `llvm_lib/clang/<version>/include/stddef.h` exists.
fn has_clang_headers(llvm_lib: &Path) -> bool {
    fs::read_dir(llvm_lib.join("clang"))
        .into_iter()
        .flatten()
        .filter_map(|entry| entry.ok())
        .any(|entry| entry.path().join("include/stddef.h").is_file())
}

/// `libclang.so`, `libclang.so.1`, `libclang-14.so.1` — but not `libclang-cpp.so.14`.
fn is_libclang(file_name: &str) -> bool {
    (file_name.starts_with("libclang.so") || file_name.starts_with("libclang-"))
        && file_name.contains(".so")
        && !file_name.starts_with("libclang-cpp")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libclang_c_api_names_are_recognised() {
        assert!(is_libclang("libclang.so"));
        assert!(is_libclang("libclang.so.1"));
        assert!(is_libclang("libclang-14.so.1"));
    }

    #[test]
    fn libclang_cpp_and_unrelated_files_are_not_libclang() {
        assert!(!is_libclang("libclang-cpp.so.14"));
        assert!(!is_libclang("libclangBasic.a"));
        assert!(!is_libclang("libclang-14.a"));
    }

    #[test]
    fn doc_comments_are_fenced_as_plain_text() {
        let fenced = DocCommentsAsText
            .process_comment("@brief Map memory.\n    indented ```x```\n@param [in] context")
            .unwrap();
        assert!(fenced.starts_with("```text\n@brief Map memory."));
        assert!(fenced.ends_with("@param [in] context\n```"));
        assert_eq!(fenced.matches("```").count(), 2, "{fenced}");
    }

    #[test]
    fn the_check_names_the_line_where_committed_bindings_differ() {
        let dir = std::env::temp_dir().join(format!("xtask-bindgen-check-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bindings.rs");
        fs::write(&path, "// header\nline a\nline b\n").unwrap();
        let current = check_current(&path, "// header\nline a\nline b\n", "1.22.0");
        let stale = check_current(&path, "// header\nline a\nline c\n", "1.22.0");
        let other_ucx = check_current(&path, "// other header\nline a\nline b\n", "1.23.0");
        fs::remove_dir_all(&dir).unwrap();
        assert!(current.is_ok());
        assert!(stale.unwrap_err().to_string().contains("line 3"));
        assert!(other_ucx.unwrap_err().to_string().contains("another UCX"));
    }
}
