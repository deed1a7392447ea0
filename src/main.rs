//! The `tuneq` binary: wires the crates into commands. Logic lives in the libraries.

use mimalloc::MiMalloc;

/// mimalloc instead of glibc malloc: training allocates and frees large tensors every
/// step, and glibc serves each with a fresh mmap (page faults + zeroing); measured up to
/// 2× faster steps (see docs/trainer-speed.md and the README benchmark).
#[global_allocator]
static GLOBAL: MiMalloc = MiMalloc;

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
