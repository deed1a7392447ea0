use super::*;
use rand::{Rng, SeedableRng};

fn random(n: usize, seed: u64, range: f32) -> Vec<f32> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-range..range)).collect()
}

fn shape(batch: usize, seq: usize, heads: usize, kv_heads: usize, d: usize) -> AttentionShape {
    AttentionShape {
        batch,
        seq,
        heads,
        kv_heads,
        head_dim: d,
        scale: AttentionShape::head_scale(d),
        softcap: None,
    }
}

/// Segment starts for rows packed with segments of these lengths, one list per batch
/// row (each list sums to `seq`).
fn packed_starts(rows: &[&[usize]]) -> Vec<u32> {
    let mut starts = Vec::new();
    for segments in rows {
        let mut first = 0;
        for &len in *segments {
            starts.extend(std::iter::repeat_n(first as u32, len));
            first += len;
        }
    }
    starts
}

struct Reference {
    out: Vec<f64>,
    lse: Vec<f64>,
    d_qkv: Vec<f64>,
}

/// Attention in f64 with explicit loops, and its gradients given `d_out`, derived by
/// hand: with `s_j = σ·q·k_j` (σ the shape's scale, `1/√d` usually), soft-capped to
/// `c·tanh(s_j/c)` where the shape caps, `p = softmax(s)` over the visible keys and
/// `o = Σ_j p_j v_j`,
/// - `dv_j += p_j dO`, `dp_j = dO·v_j`;
/// - `ds_j = p_j (dp_j − Σ_l p_l dp_l)` (the softmax Jacobian), times the cap's
///   `1 − tanh²(s_j/c)`;
/// - `dq = Σ_j ds_j k_j·σ`, `dk_j += ds_j q·σ`.
fn reference(shape: &AttentionShape, qkv: &[f64], starts: &[u32], d_out: &[f64]) -> Reference {
    let (seq, nh, kv, d) = (shape.seq, shape.heads, shape.kv_heads, shape.head_dim);
    let (w, ow) = (shape.qkv_width(), shape.out_width());
    let scale = shape.scale as f64;
    let cap = shape.softcap.map(f64::from);
    let q = |t: usize, h: usize, c: usize| qkv[t * w + h * d + c];
    let k = |t: usize, g: usize, c: usize| qkv[t * w + (nh + g) * d + c];
    let v = |t: usize, g: usize, c: usize| qkv[t * w + (nh + kv + g) * d + c];
    let mut out = vec![0f64; shape.rows() * ow];
    let mut lse = vec![0f64; shape.lse_len()];
    let mut d_qkv = vec![0f64; qkv.len()];
    for b in 0..shape.batch {
        for h in 0..nh {
            let g = h / (nh / kv);
            for i in 0..seq {
                let t = b * seq + i;
                let keys: Vec<usize> = (starts[t] as usize..=i).map(|j| b * seq + j).collect();
                let raw: Vec<f64> = keys
                    .iter()
                    .map(|&u| (0..d).map(|c| q(t, h, c) * k(u, g, c)).sum::<f64>() * scale)
                    .collect();
                let s: Vec<f64> = match cap {
                    Some(c) => raw.iter().map(|x| c * (x / c).tanh()).collect(),
                    None => raw.clone(),
                };
                let slope = |j: usize| cap.map_or(1.0, |c| 1.0 - (raw[j] / c).tanh().powi(2));
                let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = s.iter().map(|x| (x - max).exp()).sum();
                let p: Vec<f64> = s.iter().map(|x| (x - max).exp() / sum).collect();
                lse[(b * nh + h) * seq + i] = max + sum.ln();
                for c in 0..d {
                    out[t * ow + h * d + c] =
                        keys.iter().zip(&p).map(|(&u, pj)| pj * v(u, g, c)).sum();
                }
                let d_o = &d_out[t * ow + h * d..][..d];
                let dp: Vec<f64> = keys
                    .iter()
                    .map(|&u| (0..d).map(|c| d_o[c] * v(u, g, c)).sum())
                    .collect();
                let delta: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for (j, &u) in keys.iter().enumerate() {
                    let ds = p[j] * (dp[j] - delta) * slope(j);
                    for c in 0..d {
                        d_qkv[t * w + h * d + c] += ds * k(u, g, c) * scale;
                        d_qkv[u * w + (nh + g) * d + c] += ds * q(t, h, c) * scale;
                        d_qkv[u * w + (nh + kv + g) * d + c] += p[j] * d_o[c];
                    }
                }
            }
        }
    }
    Reference { out, lse, d_qkv }
}

fn widen(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

fn largest(x: &[f64]) -> f64 {
    x.iter().fold(0f64, |m, v| m.max(v.abs()))
}

/// The largest difference, relative to the largest magnitude of `want` (or to
/// `floor`, if larger: a part whose exact value is 0 is judged against its whole).
fn relative_error_above(got: &[f32], want: &[f64], floor: f64) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = largest(want).max(floor).max(f64::MIN_POSITIVE);
    got.iter()
        .zip(want)
        .map(|(&g, w)| (g as f64 - w).abs())
        .fold(0f64, |m, e| {
            if e.is_nan() || m.is_nan() {
                f64::NAN
            } else {
                m.max(e)
            }
        })
        / scale
}

/// The largest difference, relative to the largest magnitude of `want`.
fn relative_error(got: &[f32], want: &[f64]) -> f64 {
    relative_error_above(got, want, 0.0)
}

/// Forward and backward of the kernel, with `out`, `lse` and `d_qkv` starting as NaN
/// so that anything left unwritten shows.
fn run(
    shape: &AttentionShape,
    qkv: &[f32],
    starts: &[u32],
    d_out: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut out = vec![f32::NAN; shape.rows() * shape.out_width()];
    let mut lse = vec![f32::NAN; shape.lse_len()];
    attention_forward(shape, qkv, starts, &mut out, &mut lse);
    let mut d_qkv = vec![f32::NAN; qkv.len()];
    attention_backward(shape, qkv, starts, &lse, d_out, &mut d_qkv);
    (out, lse, d_qkv)
}

fn inputs(shape: &AttentionShape, seed: u64) -> (Vec<f32>, Vec<f32>) {
    // Wide enough for peaked softmax rows, not only near-uniform ones.
    let qkv = random(shape.rows() * shape.qkv_width(), seed, 2.0);
    let d_out = random(shape.rows() * shape.out_width(), seed + 1, 1.0);
    (qkv, d_out)
}

/// Tolerance for forward and backward against f64, relative to the largest value.
const TOLERANCE: f64 = 1e-5;

/// Checks the kernel against [`reference`], in the default pool and on one thread (where
/// one scratch serves every task in turn).
fn check_against_reference(shape: AttentionShape, starts: &[u32], seed: u64) {
    let (qkv, d_out) = inputs(&shape, seed);
    let want = reference(&shape, &widen(&qkv), starts, &widen(&d_out));
    let one_thread = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("a pool");
    check_run(&shape, &want, run(&shape, &qkv, starts, &d_out));
    check_run(
        &shape,
        &want,
        one_thread.install(|| run(&shape, &qkv, starts, &d_out)),
    );
}

fn check_run(shape: &AttentionShape, want: &Reference, got: (Vec<f32>, Vec<f32>, Vec<f32>)) {
    let (out, lse, d_qkv) = got;
    for (what, got, want) in [
        ("out", &out, &want.out),
        ("lse", &lse, &want.lse),
        ("d_qkv", &d_qkv, &want.d_qkv),
    ] {
        let err = relative_error(got, want);
        assert!(err <= TOLERANCE, "{shape:?}: {what} off by {err:e}");
    }
    // Each part of d_qkv on its own, so a small part cannot hide under a large one
    // (a part that is exactly 0, as dq is with one visible key, against the whole).
    let whole = largest(&want.d_qkv);
    let (nh, kv, d) = (shape.heads, shape.kv_heads, shape.head_dim);
    for (what, cols) in [
        ("dq", 0..nh * d),
        ("dk", nh * d..(nh + kv) * d),
        ("dv", (nh + kv) * d..(nh + 2 * kv) * d),
    ] {
        let pick = |x: &[f32]| -> Vec<f32> {
            x.chunks(shape.qkv_width())
                .flat_map(|row| row[cols.clone()].to_vec())
                .collect()
        };
        let want: Vec<f64> = want
            .d_qkv
            .chunks(shape.qkv_width())
            .flat_map(|row| row[cols.clone()].to_vec())
            .collect();
        let floor = if largest(&want) == 0.0 { whole } else { 0.0 };
        let err = relative_error_above(&pick(&d_qkv), &want, floor);
        assert!(err <= TOLERANCE, "{shape:?}: {what} off by {err:e}");
    }
}

#[test]
fn forward_and_backward_match_the_naive_reference() {
    for (n, s) in [
        shape(2, 100, 4, 4, 16), // MHA
        shape(1, 130, 8, 4, 64), // GQA 8/4
        shape(2, 100, 4, 1, 64), // GQA 4/1
        shape(1, 130, 2, 2, 16),
        shape(1, 64, 2, 1, 16), // exactly one block
        shape(3, 1, 2, 1, 8),   // one token
    ]
    .into_iter()
    .enumerate()
    {
        check_against_reference(s, &vec![0; s.rows()], n as u64 * 10);
    }
}

/// Gemma's scores: a scale of its own (`query_pre_attn_scalar^(−1/2)`) and Gemma 2's
/// soft-cap, tight enough here that most scores bend.
#[test]
fn a_scale_of_its_own_and_a_soft_cap_match_the_naive_reference() {
    for (n, cap) in [None, Some(1.5), Some(50.0)].into_iter().enumerate() {
        let s = AttentionShape {
            scale: 0.2,
            softcap: cap,
            ..shape(2, 100, 4, 2, 16)
        };
        check_against_reference(s, &vec![0; s.rows()], 40 + n as u64);
        let packed = packed_starts(&[&[50, 30, 20], &[1, 98, 1]]);
        check_against_reference(s, &packed, 50 + n as u64);
    }
}

#[test]
fn packed_rows_match_the_naive_reference() {
    let s = shape(2, 130, 4, 2, 32);
    let starts = packed_starts(&[&[50, 30, 50], &[1, 128, 1]]);
    check_against_reference(s, &starts, 7);
}

/// A query that sees one key has softmax 1 whatever its score, so its dq is exactly 0:
/// backward must subtract P's own row sum of P∘dP, which then cancels dP exactly, not
/// rowsum(dO∘O), which rounds differently and leaves noise (up to 1e-7 of dq here, and
/// on a real model a third of a q_proj gradient's error against float64).
#[test]
fn a_query_that_sees_one_key_gets_exactly_zero_dq() {
    let s = shape(2, 40, 4, 2, 16);
    // Every token its own segment, and a row of ordinary causal attention whose first
    // query sees only itself.
    let starts: Vec<u32> = (0..s.seq as u32)
        .chain(std::iter::repeat_n(0, s.seq))
        .collect();
    let (qkv, d_out) = inputs(&s, 17);
    let (_, _, d_qkv) = run(&s, &qkv, &starts, &d_out);
    let dq_width = s.heads * s.head_dim;
    for (r, row) in d_qkv.chunks(s.qkv_width()).enumerate() {
        let alone = starts[r] as usize == r % s.seq;
        if alone {
            assert!(
                row[..dq_width].iter().all(|&x| x == 0.0),
                "row {r} sees one key but its dq is not 0: {:?}",
                &row[..4]
            );
        } else {
            assert!(
                row[..dq_width].iter().any(|&x| x != 0.0),
                "row {r}'s dq is all 0"
            );
        }
    }
}

/// The mask is defined per query: any `starts[i] ≤ i` works, not only the
/// non-decreasing starts that packing gives.
#[test]
fn arbitrary_starts_match_the_naive_reference() {
    let s = shape(2, 150, 4, 2, 16);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
    let starts: Vec<u32> = (0..s.rows())
        .map(|r| rng.random_range(0..=(r % s.seq) as u32))
        .collect();
    check_against_reference(s, &starts, 13);
}

/// The hand-derived gradients of the reference against central differences of its own
/// f64 forward, and the kernel's against central differences of the kernel.
#[test]
fn gradients_match_finite_differences() {
    let s = shape(1, 7, 2, 1, 3);
    let starts = packed_starts(&[&[4, 3]]);
    let (qkv, d_out) = inputs(&s, 3);
    let (qkv64, d_out64) = (widen(&qkv), widen(&d_out));
    let loss64 = |x: &[f64]| -> f64 {
        let r = reference(&s, x, &starts, &d_out64);
        r.out.iter().zip(&d_out64).map(|(a, b)| a * b).sum()
    };
    let loss32 = |x: &[f32]| -> f64 {
        let mut out = vec![0f32; s.rows() * s.out_width()];
        let mut lse = vec![0f32; s.lse_len()];
        attention_forward(&s, x, &starts, &mut out, &mut lse);
        out.iter().zip(&d_out64).map(|(&a, b)| a as f64 * b).sum()
    };
    let want = reference(&s, &qkv64, &starts, &d_out64).d_qkv;
    let (_, _, got) = run(&s, &qkv, &starts, &d_out);
    let largest = largest(&want);
    for e in 0..qkv.len() {
        let h = 1e-6;
        let (mut up, mut down) = (qkv64.clone(), qkv64.clone());
        up[e] += h;
        down[e] -= h;
        let fd = (loss64(&up) - loss64(&down)) / (2.0 * h);
        assert!(
            (fd - want[e]).abs() <= 1e-7 * largest,
            "reference d_qkv[{e}] = {} but finite differences give {fd}",
            want[e]
        );
        // In f32 the step has to be large enough to beat rounding.
        let h = 1e-2f32;
        let (mut up, mut down) = (qkv.clone(), qkv.clone());
        up[e] += h;
        down[e] -= h;
        let fd = (loss32(&up) - loss32(&down)) / (2.0 * h as f64);
        assert!(
            (fd - got[e] as f64).abs() <= 1e-3 * largest,
            "kernel d_qkv[{e}] = {} but finite differences give {fd}",
            got[e]
        );
    }
}

/// Copies token rows `first..first + len` of batch row `b` of a per-row buffer.
fn rows_of(x: &[f32], width: usize, seq: usize, b: usize, first: usize, len: usize) -> Vec<f32> {
    x[(b * seq + first) * width..(b * seq + first + len) * width].to_vec()
}

#[test]
fn a_packed_row_equals_its_sequences_run_alone() {
    let (nh, kv, d, seq) = (4, 2, 16, 130);
    let layout: [&[usize]; 2] = [&[37, 93], &[50, 30, 50]];
    let s = shape(2, seq, nh, kv, d);
    let starts = packed_starts(&layout);
    let (qkv, d_out) = inputs(&s, 11);
    let (out, lse, d_qkv) = run(&s, &qkv, &starts, &d_out);
    for (b, segments) in layout.iter().enumerate() {
        let mut first = 0;
        for &len in *segments {
            let alone = shape(1, len, nh, kv, d);
            let w = s.qkv_width();
            let ow = s.out_width();
            let (a_out, a_lse, a_dqkv) = run(
                &alone,
                &rows_of(&qkv, w, seq, b, first, len),
                &vec![0; len],
                &rows_of(&d_out, ow, seq, b, first, len),
            );
            let packed_lse: Vec<f32> = (0..nh)
                .flat_map(|h| lse[(b * nh + h) * seq + first..][..len].to_vec())
                .collect();
            for (what, packed, alone) in [
                ("out", rows_of(&out, ow, seq, b, first, len), a_out),
                ("lse", packed_lse, a_lse),
                ("d_qkv", rows_of(&d_qkv, w, seq, b, first, len), a_dqkv),
            ] {
                let err = relative_error(&packed, &widen(&alone));
                assert!(
                    err <= 1e-6,
                    "row {b}, segment at {first} (+{len}): {what} differs by {err:e}"
                );
            }
            first += len;
        }
    }
}

#[test]
fn the_result_does_not_depend_on_the_thread_count() {
    let s = shape(2, 200, 8, 4, 32);
    let starts = packed_starts(&[&[200], &[70, 100, 30]]);
    let (qkv, d_out) = inputs(&s, 5);
    let in_pool = |threads: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a pool")
            .install(|| run(&s, &qkv, &starts, &d_out))
    };
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let (out, lse, d_qkv) = in_pool(1);
    for threads in [2, 3] {
        let (o, l, g) = in_pool(threads);
        assert!(bits(&o) == bits(&out), "out with {threads} threads");
        assert!(bits(&l) == bits(&lse), "lse with {threads} threads");
        assert!(bits(&g) == bits(&d_qkv), "d_qkv with {threads} threads");
    }
}

#[test]
fn empty_batches_and_rows_do_nothing() {
    for s in [shape(0, 5, 4, 2, 8), shape(3, 0, 4, 2, 8)] {
        let (out, lse, d_qkv) = run(&s, &[], &[], &[]);
        assert!(out.is_empty() && lse.is_empty() && d_qkv.is_empty());
    }
}

#[test]
#[should_panic(expected = "after itself")]
fn a_segment_starting_after_its_row_is_refused() {
    let s = shape(1, 4, 1, 1, 2);
    let qkv = vec![0f32; s.rows() * s.qkv_width()];
    let mut out = vec![0f32; s.rows() * s.out_width()];
    let mut lse = vec![0f32; s.lse_len()];
    attention_forward(&s, &qkv, &[0, 0, 3, 2], &mut out, &mut lse);
}

#[test]
#[should_panic(expected = "cannot be grouped")]
fn heads_not_a_multiple_of_kv_heads_are_refused() {
    let s = shape(1, 2, 3, 2, 2);
    let qkv = vec![0f32; s.rows() * s.qkv_width()];
    let mut out = vec![0f32; s.rows() * s.out_width()];
    let mut lse = vec![0f32; s.lse_len()];
    attention_forward(&s, &qkv, &[0, 0], &mut out, &mut lse);
}

/// The attention's loops run 8 lanes wide where the CPU has AVX2 (`crate::simd`); the
/// baseline build of the same code gives the same bits, forward and backward, so a
/// checkpoint resumes bit-identically on either kind of CPU.
#[test]
fn the_avx2_build_of_the_loops_gives_the_baseline_bits() {
    use crate::simd::tests::{avx2_here, on_baseline};
    let s = shape(2, 150, 8, 4, 32);
    let starts = packed_starts(&[&[60, 90], &[150]]);
    let qkv = random(s.rows() * s.qkv_width(), 21, 2.0);
    let d_out = random(s.rows() * s.out_width(), 22, 1.0);
    let run = || {
        let mut out = vec![0f32; s.rows() * s.out_width()];
        let mut lse = vec![0f32; s.lse_len()];
        attention_forward(&s, &qkv, &starts, &mut out, &mut lse);
        let mut d_qkv = vec![0f32; qkv.len()];
        attention_backward(&s, &qkv, &starts, &lse, &d_out, &mut d_qkv);
        [out, lse, d_qkv].map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
    };
    let wide = run();
    let baseline = on_baseline(run);
    assert!(wide == baseline, "the AVX2 build changed the bits");
    eprintln!("AVX2 build exercised: {}", avx2_here());
}
