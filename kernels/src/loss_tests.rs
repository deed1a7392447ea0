//! Tests of the fused head and loss (`super` is `crate::loss`).
use super::*;
use crate::testing::random;
use rand::{Rng, SeedableRng};

/// The naive computation in f64: logits, log-softmax, the scaled loss, and
/// dH = Σ_v (p_v − [v = t])·scale·W_v. Also, per element of dH, the size of its
/// terms Σ_v |G_v·W_vj|, which bounds the rounding of the f32 sum; and per labelled
/// row, |logsumexp| + |l_t|, which bounds the rounding of its loss.
struct Reference {
    /// Labelled rows whose target has the largest logit.
    hits: u64,
    loss: f64,
    loss_size: f64,
    dh: Vec<f64>,
    dh_size: Vec<f64>,
}

/// The logits of `head` (`vocab` rows), not soft-capped.
fn uncapped(head: Head<'_>, vocab: usize) -> Logits<'_> {
    Logits {
        head,
        vocab,
        softcap: None,
    }
}

/// The [`Reference`] of `hidden` against the head `w`, row `r` weighted by
/// `scale_of(r)`; with `cap = Some(c)`, on logits soft-capped to `c·tanh(l/c)` (the
/// gradient of each logit then carries `1 − tanh²(l/c)`).
fn reference(
    hidden: &[f32],
    h: usize,
    w: &[f32],
    vocab: usize,
    targets: &[i64],
    scale_of: impl Fn(usize) -> f32,
    cap: Option<f64>,
) -> Reference {
    let mut out = Reference {
        hits: 0,
        loss: 0.0,
        loss_size: 0.0,
        dh: vec![0.0; targets.len() * h],
        dh_size: vec![0.0; targets.len() * h],
    };
    for (r, &t) in targets.iter().enumerate() {
        if t < 0 {
            continue;
        }
        let t = t as usize;
        let scale = scale_of(r) as f64;
        let x = &hidden[r * h..(r + 1) * h];
        let logits: Vec<f64> = (0..vocab)
            .map(|v| {
                (0..h)
                    .map(|j| x[j] as f64 * w[v * h + j] as f64)
                    .sum::<f64>()
            })
            .collect();
        let slopes: Vec<f64> = match cap {
            Some(c) => logits
                .iter()
                .map(|l| 1.0 - (l / c).tanh().powi(2))
                .collect(),
            None => vec![1.0; vocab],
        };
        let logits: Vec<f64> = match cap {
            Some(c) => logits.iter().map(|l| c * (l / c).tanh()).collect(),
            None => logits,
        };
        let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + logits.iter().map(|l| (l - m).exp()).sum::<f64>().ln();
        out.hits += u64::from(logits[t] >= m);
        let log_softmax: Vec<f64> = logits.iter().map(|l| l - lse).collect();
        out.loss -= scale * log_softmax[t];
        out.loss_size += (scale * (lse.abs() + logits[t].abs())).abs();
        for (v, lsm) in log_softmax.iter().enumerate() {
            let g = (lsm.exp() - if v == t { 1.0 } else { 0.0 }) * scale * slopes[v];
            for j in 0..h {
                out.dh[r * h + j] += g * w[v * h + j] as f64;
                out.dh_size[r * h + j] += (g * w[v * h + j] as f64).abs();
            }
        }
    }
    out
}

/// Targets for `n` rows: every `gap`-th row unlabelled (none if `gap` is 0), the
/// others cycling through the vocabulary including its first and last ids.
fn targets(n: usize, vocab: usize, gap: usize) -> Vec<i64> {
    (0..n)
        .map(|r| {
            if gap > 0 && r % gap == gap - 1 {
                -100
            } else {
                ((r * 7919) % vocab) as i64
            }
        })
        .collect()
}

fn check(n: usize, h: usize, vocab: usize, gap: usize, spread: f32) {
    let hidden = random(n * h, 1, spread);
    let w = random(vocab * h, 2, 0.5);
    let t = targets(n, vocab, gap);
    let scale = 1.0 / 37.0;
    let want = reference(&hidden, h, &w, vocab, &t, |_| scale, None);
    let mut dh = vec![f32::NAN; n * h];
    let got = linear_cross_entropy(&hidden, h, &w, vocab, &t, scale, Some(&mut dh))
        .expect("valid inputs");
    let at = format!("{n} rows, h {h}, vocab {vocab}, gap {gap}, spread {spread}");
    // Each row's loss is lse − l_t from f32 logits: relative to the size of those
    // terms, not to the (possibly small) difference. Measured ≤ 1e-8 of it; 1e-6
    // still catches a 1e-5 relative slip in either term.
    assert!(
        (got - want.loss).abs() <= 1e-6 * want.loss_size,
        "{at}: loss {got} vs {}",
        want.loss
    );
    // dH is a sum over the vocabulary with cancelling terms: relative to Σ|terms|.
    // Measured ≤ 7e-7 of it for logits of order 1, 4e-6 for logits in the hundreds
    // (where f32 logits carry absolute errors ~1e-5 into the softmax).
    for i in 0..n * h {
        assert!(
            (dh[i] as f64 - want.dh[i]).abs() <= 1e-5 * want.dh_size[i],
            "{at}: dH[{i}] (row {}) {} vs {}",
            i / h,
            dh[i],
            want.dh[i]
        );
        if t[i / h] < 0 {
            assert_eq!(
                dh[i].to_bits(),
                0,
                "{at}: unlabelled row {} not zero",
                i / h
            );
        }
    }
    // Evaluation gives the same loss, bit for bit, and needs no gradient buffer.
    let eval = linear_cross_entropy(&hidden, h, &w, vocab, &t, scale, None).expect("valid");
    assert_eq!(eval.to_bits(), got.to_bits(), "{at}: evaluation loss");
}

/// The row softmax runs 8 lanes wide where the CPU has AVX2 (`crate::simd`); the
/// baseline build gives the same loss and gradient bits.
/// Weights per row (a preference loss's, of either sign): the sum is Σ wᵣ·CEᵣ, each
/// row's gradient is scaled by its own weight, and every row's unweighted loss is
/// written out (0 for unlabelled rows), against the f64 reference.
#[test]
fn rows_weighted_apart_give_each_row_its_own_scale() {
    let (n, h, vocab) = (300, 24, 97);
    let hidden = random(n * h, 3, 2.0);
    let w = random(vocab * h, 4, 0.5);
    let t = targets(n, vocab, 5);
    let weights: Vec<f32> = (0..n).map(|r| (r as f32 - 150.0) / 900.0).collect();
    let want = reference(&hidden, h, &w, vocab, &t, |r| weights[r], None);
    let mut dh = vec![f32::NAN; n * h];
    let mut losses = vec![f64::NAN; n];
    let mut hits = u64::MAX;
    let outputs = LossOutputs {
        d_hidden: Some(&mut dh),
        row_losses: Some(&mut losses),
        correct: Some(&mut hits),
    };
    let head = Head::F32(&w);
    let got = linear_cross_entropy_with(
        &hidden,
        h,
        uncapped(head, vocab),
        &t,
        RowWeights::PerRow(&weights),
        outputs,
    )
    .expect("valid inputs");
    assert!(
        (got - want.loss).abs() <= 1e-6 * want.loss_size,
        "weighted loss {got} vs {}",
        want.loss
    );
    for (i, (&got, (&want, &size))) in dh.iter().zip(want.dh.iter().zip(&want.dh_size)).enumerate()
    {
        assert!(
            (got as f64 - want).abs() <= 1e-5 * size + 1e-12,
            "dH[{i}] {got} vs {want}"
        );
    }
    assert_eq!(hits, want.hits, "tokens ranked right");
    assert!(hits > 0 && hits < t.iter().filter(|&&t| t >= 0).count() as u64);
    let unit = reference(&hidden, h, &w, vocab, &t, |_| 1.0, None);
    let mut sum = 0.0;
    for (r, (&loss, &target)) in losses.iter().zip(&t).enumerate() {
        if target < 0 {
            assert_eq!(loss, 0.0, "unlabelled row {r}");
        }
        sum += loss;
    }
    assert!(
        (sum - unit.loss).abs() <= 1e-6 * unit.loss_size,
        "{sum} vs {}",
        unit.loss
    );
    let short = [0f32; 3];
    let refused = linear_cross_entropy_with(
        &hidden,
        h,
        uncapped(head, vocab),
        &t,
        RowWeights::PerRow(&short),
        LossOutputs::default(),
    );
    assert!(matches!(
        refused,
        Err(LossError::Length {
            buffer: "weights",
            ..
        })
    ));
}

#[test]
fn the_avx2_build_of_the_row_softmax_gives_the_baseline_bits() {
    use crate::simd::tests::{avx2_here, on_baseline, on_wide};
    if !avx2_here() {
        eprintln!(
            "skipped: this CPU lacks AVX2 or FMA, so only the baseline build runs here and \
             there is no AVX2 build to compare (the loss's other tests check the baseline)"
        );
        return;
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(31);
    let (n, h, vocab) = (40, 24, 301);
    let hidden: Vec<f32> = (0..n * h).map(|_| rng.random_range(-2.0..2.0)).collect();
    let w: Vec<f32> = (0..vocab * h)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let targets: Vec<i64> = (0..n as i64).map(|i| (i * 7) % vocab as i64 - 3).collect();
    let run = || {
        let mut d = vec![0f32; n * h];
        let loss = linear_cross_entropy(&hidden, h, &w, vocab, &targets, 0.1, Some(&mut d))
            .expect("valid");
        (
            loss.to_bits(),
            d.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        )
    };
    let wide = on_wide(run);
    assert!(wide == on_baseline(run), "the AVX2 build changed the bits");
}

/// bf16 compute's head rounds both operands of both products: the hidden rows
/// before `H·Wᵀ` and the logit gradients before `G·W`. With a permutation for the
/// head (V = h, odd, so the pairs end in a lone element; not symmetric, so a
/// transposed product would show) every product has one non-zero term and is exact,
/// so the bf16 paths must give the f32 path's loss on the rounded hidden rows, and
/// its hidden-state gradient rounded, bit for bit (in one chunk: so small a head takes
/// 1024 rows at once).
#[test]
fn the_bf16_head_rounds_the_hidden_rows_and_the_logit_gradients() {
    let (n, h) = (150, 37);
    let vocab = h;
    let permutation = |v: usize| (5 * v + 3) % vocab;
    let mut head = vec![0f32; vocab * h];
    for v in 0..vocab {
        head[v * h + permutation(v)] = 1.0;
    }
    let hidden = random(n * h, 9, 3.0);
    let rounded: Vec<f32> = hidden.iter().map(|&x| crate::bf16::rounded(x)).collect();
    assert_ne!(hidden, rounded);
    let t = targets(n, vocab, 4);
    let scale = 1.0 / 113.0;
    let run = |head: Head<'_>, hidden: &[f32]| {
        let mut dh = vec![f32::NAN; n * h];
        let weights = RowWeights::Uniform(scale);
        let outputs = LossOutputs {
            d_hidden: Some(&mut dh),
            row_losses: None,
            correct: None,
        };
        let loss =
            linear_cross_entropy_with(hidden, h, uncapped(head, vocab), &t, weights, outputs)
                .expect("valid inputs");
        let outputs = LossOutputs::default();
        let eval =
            linear_cross_entropy_with(hidden, h, uncapped(head, vocab), &t, weights, outputs)
                .expect("valid inputs");
        assert_eq!(loss.to_bits(), eval.to_bits(), "evaluation loss");
        (
            loss.to_bits(),
            dh.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        )
    };
    let (loss, dh) = run(Head::F32(&head), &rounded);
    let dh_rounded: Vec<u32> = dh
        .iter()
        .map(|&b| crate::bf16::rounded_bits(f32::from_bits(b)))
        .collect();
    assert_ne!(dh, dh_rounded, "the gradient was already bf16");
    let want = (loss, dh_rounded);
    assert!(
        run(Head::Bf16Values(&head), &hidden) == want,
        "widened bf16 head"
    );
    if crate::gemm::own_bf16_kernels() {
        let stored: Vec<half::bf16> = head.iter().map(|&x| half::bf16::from_f32(x)).collect();
        assert!(
            run(Head::Bf16(&stored), &hidden) == want,
            "bf16 kernels' head"
        );
    }
}

#[test]
fn matches_the_f64_reference_with_and_without_labels() {
    check(7, 16, 50, 3, 1.0);
    check(1, 1, 1, 0, 1.0);
    check(5, 8, 33, 2, 1.0);
}

#[test]
fn chunks_hold_about_16_mib_of_logits_in_64_row_steps() {
    assert_eq!(chunk_rows(4096), 1024);
    assert_eq!(chunk_rows(32000), 128);
    assert_eq!(chunk_rows(128_256), MIN_CHUNK_ROWS);
    assert_eq!(chunk_rows(10_000), 384);
    assert_eq!(chunk_rows(1), MAX_CHUNK_ROWS);
    assert_eq!(chunk_rows(0), MAX_CHUNK_ROWS);
}

#[test]
fn matches_the_f64_reference_across_chunk_boundaries() {
    // The largest vocabulary with the fewest rows per chunk (128).
    let vocab = CHUNK_LOGITS / MIN_CHUNK_ROWS;
    assert_eq!(chunk_rows(vocab), 128);
    // 300 labelled rows: chunks of 128, 128, 44. Then 240 labelled (128 + 112).
    check(300, 8, vocab, 0, 1.0);
    check(300, 8, vocab, 5, 1.0);
    // 129 labelled rows: a chunk of one.
    check(129, 4, vocab, 0, 1.0);
    // Chunks of 1024 rows (a small vocabulary): 1100 rows, 1024 + 76.
    assert_eq!(chunk_rows(200), 1024);
    check(1100, 16, 200, 0, 1.0);
}

#[test]
fn large_logits_neither_overflow_nor_lose_the_gradient() {
    // Logits in the hundreds: exp without the max shift would overflow.
    check(20, 16, 64, 4, 100.0);
}

#[test]
fn all_rows_unlabelled_give_zero_loss_and_zero_gradient() {
    let (n, h, vocab) = (10, 6, 9);
    let hidden = random(n * h, 3, 1.0);
    let w = random(vocab * h, 4, 1.0);
    let mut dh = vec![f32::NAN; n * h];
    let loss = linear_cross_entropy(&hidden, h, &w, vocab, &[-100; 10], 0.5, Some(&mut dh))
        .expect("valid inputs");
    assert_eq!(loss, 0.0);
    assert!(dh.iter().all(|x| x.to_bits() == 0), "{dh:?}");
}

#[test]
fn the_gradient_agrees_with_finite_differences() {
    let (n, h, vocab) = (3, 4, 6);
    let hidden = random(n * h, 5, 1.0);
    let w = random(vocab * h, 6, 1.0);
    let t = [2i64, -1, 5];
    let scale = 0.5;
    let loss =
        |x: &[f32]| linear_cross_entropy(x, h, &w, vocab, &t, scale, None).expect("valid inputs");
    let mut dh = vec![0f32; n * h];
    linear_cross_entropy(&hidden, h, &w, vocab, &t, scale, Some(&mut dh)).expect("valid");
    // Central differences of the kernel's own f32 loss, step 1e-2: truncation error
    // ~1e-5 here, f32 rounding of the loss ~1e-7/1e-2, so 1e-4 is a fair bound.
    let eps = 1e-2f32;
    for i in 0..n * h {
        let (mut plus, mut minus) = (hidden.clone(), hidden.clone());
        plus[i] += eps;
        minus[i] -= eps;
        let fd = (loss(&plus) - loss(&minus)) / (2.0 * eps as f64);
        assert!(
            (fd - dh[i] as f64).abs() <= 1e-4,
            "dH[{i}]: {} vs finite difference {fd}",
            dh[i]
        );
    }
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    let (n, h, vocab) = (300, 40, 300);
    let hidden = random(n * h, 7, 1.0);
    let w = random(vocab * h, 8, 0.5);
    let t = targets(n, vocab, 7);
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a pool");
        let mut dh = vec![0f32; n * h];
        let loss = pool
            .install(|| linear_cross_entropy(&hidden, h, &w, vocab, &t, 0.01, Some(&mut dh)))
            .expect("valid inputs");
        (
            loss.to_bits(),
            dh.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        )
    };
    let one = run(1);
    assert_eq!(one, run(2));
    assert_eq!(one, run(3));
}

#[test]
fn bad_inputs_are_refused_before_anything_is_written() {
    let (h, vocab) = (2, 3);
    let hidden = [0.5f32; 6];
    let w = [0.1f32; 6];
    let mut dh = [7f32; 6];
    let err = linear_cross_entropy(&hidden, h, &w, vocab, &[0, -100, 3], 1.0, Some(&mut dh));
    assert_eq!(
        err,
        Err(LossError::TargetOutOfVocabulary {
            row: 2,
            target: 3,
            vocab: 3
        })
    );
    assert_eq!(dh, [7.0; 6], "d_hidden was written");
    let err = linear_cross_entropy(&hidden, h, &w, vocab, &[0, 1], 1.0, None);
    assert!(
        matches!(
            err,
            Err(LossError::Length {
                buffer: "hidden",
                ..
            })
        ),
        "{err:?}"
    );
    let err = linear_cross_entropy(&hidden, h, &w[..5], vocab, &[0, 1, 2], 1.0, None);
    assert!(
        matches!(
            err,
            Err(LossError::Length {
                buffer: "lm_head",
                ..
            })
        ),
        "{err:?}"
    );
    let err = linear_cross_entropy(&hidden, h, &w, vocab, &[0, 1, 2], 1.0, Some(&mut dh[..4]));
    assert!(
        matches!(
            err,
            Err(LossError::Length {
                buffer: "d_hidden",
                ..
            })
        ),
        "{err:?}"
    );
}

/// Gemma 2's soft-capped logits: the loss of `c·tanh(l/c)` and the gradient back
/// through the cap, against f64, with and without the gradient's pass.
#[test]
fn soft_capped_logits_match_the_f64_reference() {
    let (n, h, vocab) = (150, 24, 300);
    let hidden = random(n * h, 11, 3.0);
    let w = random(vocab * h, 12, 0.5);
    let t = targets(n, vocab, 7);
    let scale = 1.0 / 91.0;
    for cap in [2.0f32, 30.0] {
        let want = reference(&hidden, h, &w, vocab, &t, |_| scale, Some(cap as f64));
        let logits = Logits {
            head: Head::F32(&w),
            vocab,
            softcap: Some(cap),
        };
        let mut dh = vec![f32::NAN; n * h];
        let mut hits = 0;
        let outputs = LossOutputs {
            d_hidden: Some(&mut dh),
            row_losses: None,
            correct: Some(&mut hits),
        };
        let weights = RowWeights::Uniform(scale);
        let got = linear_cross_entropy_with(&hidden, h, logits, &t, weights, outputs)
            .expect("valid inputs");
        assert!(
            (got - want.loss).abs() <= 1e-6 * want.loss_size,
            "cap {cap}: loss {got} vs {}",
            want.loss
        );
        let expected = want.dh.iter().zip(&want.dh_size);
        for (i, (&got, (&want, &size))) in dh.iter().zip(expected).enumerate() {
            assert!(
                (got as f64 - want).abs() <= 1e-5 * size + 1e-12,
                "cap {cap}: dH[{i}] {got} vs {want}"
            );
        }
        assert_eq!(hits, want.hits, "cap {cap}: tokens ranked right");
        let eval =
            linear_cross_entropy_with(&hidden, h, logits, &t, weights, LossOutputs::default())
                .expect("valid inputs");
        assert_eq!(eval.to_bits(), got.to_bits(), "cap {cap}: evaluation loss");
    }
}
