//! Link the rdmareg binary with a run path to the UCX it was built against,
//! so it runs without `LD_LIBRARY_PATH`.
fn main() {
    if let Ok(libdir) = std::env::var("DEP_UCP_LIBDIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{libdir}");
    }
}
