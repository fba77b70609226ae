//! Gives the fuzz binaries a run path to the UCX libraries that `rdmareg-ucx-sys`
//! linked (`rdmareg-ucx` links them), so they run without `LD_LIBRARY_PATH`.

fn main() {
    let libdir = std::env::var("DEP_UCP_LIBDIR").expect("rdmareg-ucx-sys publishes DEP_UCP_LIBDIR");
    println!("cargo::rustc-link-arg=-Wl,-rpath,{libdir}");
}
