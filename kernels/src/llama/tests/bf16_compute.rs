//! bf16 compute ([`Compute::Bf16`]): the frozen products take bf16 operands and
//! accumulate in f32. Checked at the product (against an f64 product of the rounded
//! operands), and over whole steps: deterministic, unchanged by checkpointing, close to
//! the f32 step but not equal to it.

use super::super::frozen::{FrozenWork, ROUNDED_OPERANDS};
use super::*;
use crate::bf16::rounded_bits;
use crate::gemm::{Mat, MatMut};
use half::bf16;

/// Rounding agrees with `half`'s (to nearest, ties to even) around every bf16 value:
/// on it, half an ulp away either side (the ties), and one f32 ulp inside and outside
/// of those, which covers overflow to infinity, subnormals and both zeros.
#[test]
fn rounding_to_bf16_is_to_nearest_even() {
    for bits in 0..=u16::MAX {
        let base = u32::from(bits) << 16;
        if f32::from_bits(base).is_nan() {
            let got = f32::from_bits(rounded_bits(f32::from_bits(base | 1)));
            assert!(got.is_nan(), "{bits:#06x}: a NaN rounded to a number");
            assert_eq!(got.is_sign_negative(), bits & 0x8000 != 0);
            continue;
        }
        for offset in [0u32, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF] {
            let x = f32::from_bits(base.wrapping_add(offset));
            if x.is_nan() {
                continue;
            }
            let want = bf16::from_f32(x).to_f32();
            let got = f32::from_bits(rounded_bits(x));
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "{x:e} ({:#010x}) rounded to {got:e}, half says {want:e}",
                x.to_bits()
            );
        }
    }
}

/// One frozen product in bf16 compute, forward (`A·Wᵀ`) and backward (`A·W`), with
/// the weight stored as f32 or as bf16 (which the own bf16 kernels take where the CPU
/// has them), A read through a strided view, and `β` = 0 and 1: within f32 accumulation
/// of the f64 product of the operands rounded to bf16, and visibly different from the
/// f32 product. The second shape has an odd `k` either way, more than one block of `k`
/// and of C's columns, and tiles at the edges.
#[test]
fn a_bf16_product_is_the_product_of_the_rounded_operands() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(71);
    for (m, rows, cols) in [(37, 48, 150), (29, 61, 1031)] {
        product_of_rounded_operands(&mut rng, m, rows, cols);
    }
}

fn product_of_rounded_operands(
    rng: &mut rand_chacha::ChaCha8Rng,
    m: usize,
    rows: usize,
    cols: usize,
) {
    let w = random(rows * cols, rng, -1.0, 1.0);
    let w16: Vec<bf16> = w.iter().map(|&x| bf16::from_f32(x)).collect();
    let round = |x: f32| f64::from(bf16::from_f32(x).to_f32());
    for transposed in [true, false] {
        let (k, n) = if transposed {
            (cols, rows)
        } else {
            (rows, cols)
        };
        // A is a column block of a wider buffer, as dq is of [dq | dk | dv].
        let stride = k + 9;
        let a = random(m * stride, rng, -2.0, 2.0);
        let c0 = random(m * n, rng, -1.0, 1.0);
        for beta in [0.0f32, 1.0] {
            let want: Vec<f64> = (0..m * n)
                .map(|e| {
                    let (i, j) = (e / n, e % n);
                    let dot: f64 = (0..k)
                        .map(|t| {
                            let wv = if transposed {
                                w[j * cols + t]
                            } else {
                                w[t * cols + j]
                            };
                            round(a[i * stride + t]) * round(wv)
                        })
                        .sum();
                    dot + f64::from(beta) * f64::from(c0[e])
                })
                .collect();
            for weight in [Frozen::F32(&w), Frozen::Bf16(&w16)] {
                let mut work =
                    FrozenWork::new(Compute::Bf16, rows * cols, (m, k.max(n)), weight.is_bf16());
                let mut c = c0.clone();
                work.product(
                    Mat::strided(&a, m, k, stride, 1),
                    weight,
                    (rows, cols),
                    transposed,
                    beta,
                    MatMut::new(&mut c, m, n),
                );
                let scale = want.iter().fold(0f64, |s, v| s.max(v.abs()));
                let worst = c
                    .iter()
                    .zip(&want)
                    .map(|(&g, &w)| (f64::from(g) - w).abs() / scale)
                    .fold(0.0, f64::max);
                assert!(
                    worst < 1e-6,
                    "transposed {transposed}, β {beta}, bf16 storage {}: {worst:e}",
                    weight.is_bf16()
                );
                let mut f32_work = FrozenWork::new(Compute::F32, rows * cols, (0, 0), false);
                let mut exact = c0.clone();
                f32_work.product(
                    Mat::strided(&a, m, k, stride, 1),
                    Frozen::F32(&w),
                    (rows, cols),
                    transposed,
                    beta,
                    MatMut::new(&mut exact, m, n),
                );
                let moved = exact
                    .iter()
                    .zip(&c)
                    .map(|(&e, &g)| f64::from((e - g).abs()) / scale)
                    .fold(0.0, f64::max);
                assert!(moved > 1e-4, "bf16 compute left the f32 product as it was");
            }
        }
    }
}

/// The loss and gradients of a bf16-compute step, against the f32 step on the same
/// (bf16-valued) weights: relative distances of bf16 rounding (≤ 3 %, and not 0).
fn distance_from_f32(m: &Owned, b: &OwnedBatch, masks: &[Vec<Vec<f32>>]) -> (f64, f64) {
    let mut f32_view = m.view();
    let f32_bits = step_bits(&f32_view, &[b], masks, 2, false);
    f32_view.compute = Compute::Bf16;
    let bf16_bits = step_bits(&f32_view, &[b], masks, 2, false);
    let value = |bits: u32| f64::from(f32::from_bits(bits));
    let loss = (f64::from_bits(f32_bits.0[0]) - f64::from_bits(bf16_bits.0[0])).abs()
        / f64::from_bits(f32_bits.0[0]).abs();
    let mut worst: f64 = 0.0;
    for (want, got) in f32_bits.2.iter().zip(&bf16_bits.2) {
        let norm = want.iter().map(|&v| value(v).powi(2)).sum::<f64>().sqrt();
        let diff = want
            .iter()
            .zip(got)
            .map(|(&w, &g)| (value(w) - value(g)).powi(2))
            .sum::<f64>()
            .sqrt();
        worst = worst.max(diff / norm);
    }
    (loss, worst)
}

#[test]
fn a_bf16_compute_step_is_close_to_the_f32_step() {
    for (targets, seed) in [(&[ALL][..], 81), (&[QV][..], 82)] {
        let m = Owned::random(tiny_dims(), targets, 2, seed);
        let b = tiny_batch(m.dims.vocab, seed + 1);
        let masks = [dropout_masks(&m, b.rows * b.len, 0.2, seed + 2)];
        for masks in [&[][..], &masks[..]] {
            let (loss, grads) = distance_from_f32(&m, &b, masks);
            eprintln!("bf16 compute vs f32: loss {loss:.1e}, worst gradient {grads:.1e} (L2)");
            assert!(loss > 0.0 && loss < 1e-2, "loss moved by {loss:e}");
            assert!(grads > 1e-6 && grads < 3e-2, "gradients moved by {grads:e}");
        }
    }
}

/// bf16 compute keeps the step's determinism: the same bits on 1 and 3 threads, with
/// and without checkpointing, with the weights stored as f32 or as bf16 (rounded on
/// the fly or as stored: the same values).
#[test]
fn bf16_compute_does_not_depend_on_threads_checkpointing_or_storage() {
    let (mut m, b) = larger_case();
    let w16: Vec<[Vec<bf16>; 7]> = m
        .weights
        .iter_mut()
        .map(|w| {
            std::array::from_fn(|p| {
                let r: Vec<bf16> = w[p].iter().map(|&x| bf16::from_f32(x)).collect();
                for (x, &h) in w[p].iter_mut().zip(&r) {
                    *x = h.to_f32();
                }
                r
            })
        })
        .collect();
    let masks = [dropout_masks(&m, b.rows * b.len, 0.1, 83)];
    let mut f32_stored = m.view();
    f32_stored.compute = Compute::Bf16;
    let mut bf16_stored = f32_stored.clone();
    for (layer, w) in bf16_stored.layers.iter_mut().zip(&w16) {
        for (p, proj) in layer.proj.iter_mut().enumerate() {
            proj.weight = Frozen::Bf16(&w[p]);
        }
    }
    for masks in [&[][..], &masks[..]] {
        let want = step_bits(&f32_stored, &[&b], masks, 1, false);
        assert!(
            want == step_bits(&f32_stored, &[&b], masks, 3, false),
            "1 vs 3 threads"
        );
        assert!(
            want == step_bits(&f32_stored, &[&b], masks, 3, true),
            "checkpointing"
        );
        let stored = step_bits(&bf16_stored, &[&b], masks, 3, true);
        // A bf16 GEMM (oneMKL's, or the own kernels with AVX512-BF16) takes bf16-stored
        // weights, summing in its own order; only where both storages are widened into
        // the f32 GEMM are the bits the same.
        if crate::bf16_backend().ends_with("on widened bf16 operands") {
            assert!(want == stored, "bf16 storage");
        }
        assert!(
            stored == step_bits(&bf16_stored, &[&b], masks, 1, false),
            "1 vs 3 threads, bf16 storage"
        );
    }
}

/// Every frozen product of a step takes its operand rounded, in the step's order: each
/// layer's seven projections forward (the input, N × in), then from the top layer down
/// the gradients they are given (N × out), except q/k/v of the lowest layer with LoRA
/// (nothing below needs their input gradient). With checkpointing the backward is the
/// same and each layer's forward is run again before it. The product itself is checked
/// by `a_bf16_product_is_the_product_of_the_rounded_operands`; together they cover what
/// the end-to-end comparison with PyTorch cannot resolve (its noise is as large as either
/// side's rounding).
#[test]
fn every_frozen_product_of_a_step_rounds_its_operand() {
    let m = Owned::random(tiny_dims(), &[ALL], 2, 91);
    let b = tiny_batch(m.dims.vocab, 92);
    let d = &m.dims;
    let n = b.rows * b.len;
    let order = [Q, K, V, O, GATE, UP, DOWN];
    let forward: Vec<_> = order
        .iter()
        .map(|&p| (true, n, d.projection_shape(p).0))
        .collect();
    let backward = |l: usize| {
        let ps: &[usize] = if l == 0 {
            &[DOWN, GATE, UP, O]
        } else {
            &[DOWN, GATE, UP, O, Q, K, V]
        };
        ps.iter()
            .map(|&p| (false, n, d.projection_shape(p).1))
            .collect::<Vec<_>>()
    };
    let mut view = m.view();
    view.compute = Compute::Bf16;
    let scale = 1.0 / b.labelled() as f32;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("a pool");
    for checkpoint_layers in [false, true] {
        // The products run on the thread that calls the step (their insides fan out).
        let log = pool.install(|| {
            ROUNDED_OPERANDS.with_borrow_mut(Vec::clear);
            let mut grads: Vec<Vec<f32>> = view
                .lora_lengths()
                .into_iter()
                .map(|len| vec![0.0; len])
                .collect();
            let options = StepOptions { checkpoint_layers };
            forward_backward_with(&view, &b.view(), scale, None, &mut grads, options)
                .expect("a step");
            ROUNDED_OPERANDS.with_borrow_mut(std::mem::take)
        });
        let mut want: Vec<_> = (0..d.layers).flat_map(|_| forward.clone()).collect();
        for l in (0..d.layers).rev() {
            if checkpoint_layers {
                want.extend(forward.iter().copied());
            }
            want.extend(backward(l));
        }
        assert_eq!(log, want, "checkpointing {checkpoint_layers}");
    }
}
