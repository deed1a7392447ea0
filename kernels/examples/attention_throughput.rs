//! Times fused attention forward and backward on the benchmark presets' shapes.
//!
//! `cargo run --release -p tuneq-kernels --example attention_throughput [iterations]
//! [small|tiny]`;
//! set `RAYON_NUM_THREADS` to choose the pool. Prints the median milliseconds per call
//! and the GFLOP/s of the causal half of the products (forward: S and P·V; backward:
//! S again, dV, dP, dQ and dK).

use std::time::Instant;

use rand::{Rng, SeedableRng};
use tuneq_kernels::attention::{AttentionShape, attention_backward, attention_forward};

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn main() {
    let iterations: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let only = std::env::args().nth(2);
    println!(
        "rayon threads: {}, {iterations} iterations, median ms",
        rayon::current_num_threads()
    );
    for (name, heads, kv_heads, head_dim) in [("small", 12, 12, 64), ("tiny", 8, 4, 32)] {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let shape = AttentionShape {
            batch: 4,
            seq: 256,
            heads,
            kv_heads,
            head_dim,
            scale: AttentionShape::head_scale(head_dim),
            softcap: None,
        };
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let mut random =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0..1.0)).collect() };
        let qkv = random(shape.rows() * shape.qkv_width());
        let d_out = random(shape.rows() * shape.out_width());
        let starts = vec![0u32; shape.rows()];
        let mut out = vec![0f32; shape.rows() * shape.out_width()];
        let mut lse = vec![0f32; shape.lse_len()];
        let mut d_qkv = vec![0f32; qkv.len()];
        let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
        for i in 0..iterations + 2 {
            let t0 = Instant::now();
            attention_forward(&shape, &qkv, &starts, &mut out, &mut lse);
            let t1 = Instant::now();
            attention_backward(&shape, &qkv, &starts, &lse, &d_out, &mut d_qkv);
            let t2 = Instant::now();
            if i >= 2 {
                fwd.push((t1 - t0).as_secs_f64() * 1e3);
                bwd.push((t2 - t1).as_secs_f64() * 1e3);
            }
        }
        let (f, b) = (median(fwd), median(bwd));
        // One causal T×T×d product: T²·d multiply-adds, i.e. T²·d FLOPs at half of 2·T²·d.
        let t = shape.seq as f64;
        let product = (shape.batch * heads) as f64 * t * t * head_dim as f64;
        println!(
            "{name:5} (batch 4, seq 256, heads {heads}/{kv_heads}, head_dim {head_dim}): \
             forward {f:.2} ms ({:.1} GFLOP/s), backward {b:.2} ms ({:.1} GFLOP/s), \
             total {:.2} ms",
            2.0 * product / f / 1e6,
            5.0 * product / b / 1e6,
            f + b
        );
    }
}
