//! Gives this crate's test binaries a run path to the UCX libraries that
//! `rdmareg-ucx-sys` linked, so they run without `LD_LIBRARY_PATH`.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_UCP_LIBDIR");
    let libdir = std::env::var("DEP_UCP_LIBDIR")
        .expect("rdmareg-ucx-sys publishes DEP_UCP_LIBDIR to its direct dependents");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{libdir}");
}
