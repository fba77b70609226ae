//! Gives this crate's test binaries a run path to the UCX libraries that
//! `rdmareg-ucx-sys` linked, so they run without `LD_LIBRARY_PATH`.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_UCP_LIBDIR");
    // Empty when nothing is linked dynamically (docs.rs, `vendored`).
    let libdir = std::env::var("DEP_UCP_LIBDIR").unwrap_or_default();
    if !libdir.is_empty() {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{libdir}");
    }
}
