//! Links a BLAS when the `blas` feature is on: OpenBLAS from the system (Debian's
//! `libopenblas-dev`) by default, or oneMKL's `libmkl_rt` with `TUNEQ_BLAS=mkl` and
//! `TUNEQ_BLAS_LIB_DIR` pointing at its `lib` folder (e.g. the PyPI `mkl` wheel that
//! `scripts/setup-blas mkl` installs). Without the feature nothing is linked.

fn main() {
    println!("cargo:rerun-if-env-changed=TUNEQ_BLAS");
    println!("cargo:rerun-if-env-changed=TUNEQ_BLAS_LIB_DIR");
    println!("cargo::rustc-check-cfg=cfg(tuneq_blas_mkl)");
    if std::env::var_os("CARGO_FEATURE_BLAS").is_none() {
        return;
    }
    let which = std::env::var("TUNEQ_BLAS").unwrap_or_else(|_| "openblas".into());
    if let Ok(dir) = std::env::var("TUNEQ_BLAS_LIB_DIR") {
        println!("cargo:rustc-link-search=native={dir}");
        // Found at run time by this package's tests; a dependency's link arguments do
        // not reach other packages' binaries, so `tuneq` sets its own (root build.rs).
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
    match which.as_str() {
        "openblas" => println!("cargo:rustc-link-lib=dylib=openblas"),
        "mkl" => {
            println!("cargo:rustc-link-lib=dylib=mkl_rt");
            println!("cargo:rustc-cfg=tuneq_blas_mkl");
        }
        other => panic!("TUNEQ_BLAS must be openblas or mkl, not {other:?}"),
    }
}
