//! Gives this crate's test binaries a run path to the UCX libraries that
//! `rdmareg-ucx-sys` linked, so they run without `LD_LIBRARY_PATH` even
//! outside cargo, and tells the code whether UCX is the static vendored
//! build.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(ucx_vendored)");
    let libdir = std::env::var("DEP_UCP_LIBDIR")
        .expect("rdmareg-ucx-sys publishes DEP_UCP_LIBDIR to its direct dependents");
    // Empty when nothing was linked dynamically (docs.rs, or the static
    // vendored build).
    if !libdir.is_empty() {
        println!("cargo::rustc-link-arg=-Wl,-rpath,{libdir}");
    }
    if std::env::var("DEP_UCP_VENDORED").is_ok_and(|v| v == "1") {
        println!("cargo::rustc-cfg=ucx_vendored");
    }
}
