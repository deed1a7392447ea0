//! With the `blas` feature and `TUNEQ_BLAS_LIB_DIR` (a BLAS outside the system's library
//! path, such as the oneMKL wheel `scripts/setup-blas mkl` unpacks), records that folder
//! as the binary's run-time search path. The kernels' build script links the library,
//! but a dependency's link arguments do not reach the final binary.

fn main() {
    println!("cargo:rerun-if-env-changed=TUNEQ_BLAS_LIB_DIR");
    if std::env::var_os("CARGO_FEATURE_BLAS").is_none() {
        return;
    }
    if let Ok(dir) = std::env::var("TUNEQ_BLAS_LIB_DIR") {
        println!("cargo:rustc-link-arg-bins=-Wl,-rpath,{dir}");
    }
}
