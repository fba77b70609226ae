//! Gives this crate's test binaries a run path to the UCX libraries that
//! `ucx-sys` linked, so they run without `LD_LIBRARY_PATH`.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_UCP_LIBDIR");
    if let Ok(libdir) = std::env::var("DEP_UCP_LIBDIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{libdir}");
    }
}
