//! Tells the code whether UCX is the static vendored build.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(ucx_vendored)");
    if std::env::var("DEP_UCP_VENDORED").is_ok_and(|v| v == "1") {
        println!("cargo::rustc-cfg=ucx_vendored");
    }
}
