//! GFLOP/s of the crate's `gemm` on the trainer's shapes, and the time of the fused
//! lm_head + cross-entropy on 1024 labelled rows, with a fixed thread count.
//!
//! ```text
//! CARGO_TARGET_DIR=/tmp/ktarget cargo run -p tuneq-kernels --example gemm_throughput [threads]
//! ```
//!
//! The dev profile builds this crate and matrixmultiply at `-O3`, so no `--release` is
//! needed. Each figure is the best of several runs (wall clock): on a shared machine the
//! best run is the one least disturbed. B is used as stored (`W`, d_out × d_in) and
//! transposed (`x·Wᵀ`, how the frozen weights are read in forward).

use std::time::{Duration, Instant};
use tuneq_kernels::loss::linear_cross_entropy;
use tuneq_kernels::{Mat, MatMut, backend, gemm};

/// M × N × K of `C = A·B`: the MLP's gate/up and down projections of the "small" model
/// (h 768, I 2048), its lm_head (V 32000), and a projection of "tiny" (h 256, I 688),
/// each on 1024 token rows.
const SHAPES: [(usize, usize, usize); 4] = [
    (1024, 2048, 768),
    (1024, 768, 2048),
    (1024, 32000, 768),
    (1024, 688, 256),
];

/// Deterministic values in [−1, 1) without a random-number crate.
fn data(n: usize, seed: u32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(2_654_435_761).max(1);
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        })
        .collect()
}

/// The fastest of `runs` calls of `f`, after one warm-up call.
fn best(runs: usize, mut f: impl FnMut()) -> Duration {
    f();
    (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .min()
        .unwrap_or_default()
}

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().expect("the thread count is a number"))
        .unwrap_or(2);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("a thread pool");
    println!("backend {}, {threads} threads", backend());
    pool.install(|| {
        for (m, n, k) in SHAPES {
            let a = data(m * k, 1);
            let b = data(k * n, 2);
            let mut c = vec![0f32; m * n];
            let flops = 2.0 * (m * n * k) as f64;
            let runs = if n > 10_000 { 3 } else { 7 };
            let mut line = format!("{m:>5} × {n:>5} × {k:>5}");
            for transposed in [false, true] {
                let b_view = if transposed {
                    Mat::new(&b, n, k).t()
                } else {
                    Mat::new(&b, k, n)
                };
                let t = best(runs, || {
                    gemm(
                        1.0,
                        Mat::new(&a, m, k),
                        b_view,
                        0.0,
                        MatMut::new(&mut c, m, n),
                    )
                });
                let name = if transposed { "A·Bᵀ" } else { "A·B " };
                line += &format!(
                    "   {name} {:7.1} GFLOP/s ({:6.1} ms)",
                    flops / t.as_secs_f64() / 1e9,
                    t.as_secs_f64() * 1e3
                );
            }
            println!("{line}");
        }

        // The fused loss: two GEMMs of 1024 × 32000 × 768 plus one exp per logit.
        let (rows, h, vocab) = (1024, 768, 32000);
        let hidden = data(rows * h, 3);
        let head: Vec<f32> = data(vocab * h, 4).iter().map(|x| x * 0.05).collect();
        let targets: Vec<i64> = (0..rows as i64).map(|r| (r * 7919) % vocab as i64).collect();
        let mut d_hidden = vec![0f32; rows * h];
        let scale = 1.0 / rows as f32;
        let flops = 4.0 * (rows * vocab * h) as f64;
        // The loss's logits GEMM alone, in its chunks of 128 rows (V = 32000): the rest of the
        // loss-only time is the softmax, the gathers and the buffers' first touch.
        let mut logits = vec![0f32; 128 * vocab];
        let t = best(3, || {
            for chunk in hidden.chunks(128 * h) {
                let m = chunk.len() / h;
                gemm(
                    1.0,
                    Mat::new(chunk, m, h),
                    Mat::new(&head, vocab, h).t(),
                    0.0,
                    MatMut::new(&mut logits[..m * vocab], m, vocab),
                );
            }
        });
        println!(
            "lm_head GEMM in chunks of 128 rows: {:6.1} ms ({:.1} GFLOP/s)",
            t.as_secs_f64() * 1e3,
            flops / 2.0 / t.as_secs_f64() / 1e9
        );
        for grad in [false, true] {
            let t = best(3, || {
                let d = grad.then_some(&mut d_hidden[..]);
                linear_cross_entropy(&hidden, h, &head, vocab, &targets, scale, d)
                    .expect("valid inputs");
            });
            let (what, flops) = if grad {
                ("loss + dH", flops)
            } else {
                ("loss only", flops / 2.0)
            };
            println!(
                "linear_cross_entropy {rows} rows, V {vocab}, h {h}, {what}: {:6.1} ms ({:.1} GFLOP/s)",
                t.as_secs_f64() * 1e3,
                flops / t.as_secs_f64() / 1e9
            );
        }
    });
}
