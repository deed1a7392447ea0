use super::mask::{StoredMask, packed_mask_bytes};
use super::*;
use rand::{Rng, SeedableRng};

mod bf16;
mod bf16_compute;
mod groups;
mod oracle;
use oracle::*;

#[test]
fn gradients_match_finite_differences_with_lora_on_all_seven() {
    let m = Owned::random(tiny_dims(), &[ALL], 2, 5);
    let b = tiny_batch(m.dims.vocab, 6);
    let (loss_err, grad_err) = check_gradients(&m, &b, &[]);
    eprintln!("all seven: loss {loss_err:e}, gradients {grad_err:e} of their max");
}

#[test]
fn gradients_match_finite_differences_with_lora_on_q_and_v() {
    let m = Owned::random(tiny_dims(), &[QV], 2, 7);
    let b = tiny_batch(m.dims.vocab, 8);
    let (loss_err, grad_err) = check_gradients(&m, &b, &[]);
    eprintln!("q and v: loss {loss_err:e}, gradients {grad_err:e} of their max");
}

/// Qwen2's decoder: biases on q, k and v move the activations every gradient flows
/// through (and take none themselves: they are frozen).
#[test]
fn gradients_match_finite_differences_with_biases_on_q_k_and_v() {
    let m = Owned::random(tiny_dims(), &[ALL], 2, 11).with_qkv_bias(12);
    let b = tiny_batch(m.dims.vocab, 13);
    let (loss_err, grad_err) = check_gradients(&m, &b, &[]);
    eprintln!("q/k/v biases: loss {loss_err:e}, gradients {grad_err:e} of their max");
    let unbiased = Owned::random(tiny_dims(), &[ALL], 2, 11);
    let scale = 1.0 / b.labelled() as f32;
    let (with, without) = (
        loss(&m.view(), &b.view(), scale).expect("loss"),
        loss(&unbiased.view(), &b.view(), scale).expect("loss"),
    );
    assert!(
        (with - without).abs() > 1e-3,
        "the biases change nothing: {with} vs {without}"
    );
}

/// Qwen3's decoder: each q and k head RMS-normalised (and scaled) before RoPE, so the q
/// and k gradients flow back through the norms.
#[test]
fn gradients_match_finite_differences_with_qk_norms() {
    let m = Owned::random(tiny_dims(), &[ALL], 2, 14).with_qk_norm(15);
    let b = tiny_batch(m.dims.vocab, 16);
    let (loss_err, grad_err) = check_gradients(&m, &b, &[]);
    eprintln!("q/k norms: loss {loss_err:e}, gradients {grad_err:e} of their max");
}

/// A layer's q/k norms must agree with the dimensions: a model that has them where the
/// dimensions say none (or the other way round) is refused, not half-applied.
#[test]
fn q_k_norms_that_disagree_with_the_dimensions_are_refused() {
    let normed = Owned::random(tiny_dims(), &[ALL], 2, 14).with_qk_norm(15);
    let b = tiny_batch(normed.dims.vocab, 16);
    let mut view = normed.view();
    view.dims.qk_norm = false;
    assert!(matches!(
        loss(&view, &b.view(), 1.0),
        Err(StepError::Dims(_))
    ));
    let plain = Owned::random(tiny_dims(), &[ALL], 2, 14);
    let mut view = plain.view();
    view.dims.qk_norm = true;
    assert!(matches!(
        loss(&view, &b.view(), 1.0),
        Err(StepError::Dims(_))
    ));
}

/// LoRA only above layer 0 (the layers below get no backward at all), and a rank
/// of 3 on a third layer.
#[test]
fn gradients_match_finite_differences_with_lora_only_in_upper_layers() {
    let dims = Dims {
        layers: 3,
        ..tiny_dims()
    };
    let m = Owned::random(
        dims,
        &[NONE, [false, true, false, true, false, false, true], ALL],
        3,
        9,
    );
    let b = tiny_batch(m.dims.vocab, 10);
    let (loss_err, grad_err) = check_gradients(&m, &b, &[]);
    eprintln!("upper layers: loss {loss_err:e}, gradients {grad_err:e} of their max");
}

/// Dropout masks (0 or 1/(1 − p)) for every adapted projection of `m`, in forward
/// order, each `n × in`.
fn dropout_masks(m: &Owned, n: usize, p: f64, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let keep = (1.0 / (1.0 - p)) as f32;
    let mut masks = vec![];
    for targets in &m.targets {
        for (proj, _) in targets.iter().enumerate().filter(|&(_, &t)| t) {
            let i = m.dims.projection_shape(proj).0;
            masks.push(
                (0..n * i)
                    .map(|_| if rng.random::<f64>() < p { 0.0 } else { keep })
                    .collect(),
            );
        }
    }
    masks
}

#[test]
fn gradients_match_finite_differences_with_dropout() {
    for (targets, seed) in [(ALL, 20), (QV, 21)] {
        let m = Owned::random(tiny_dims(), &[targets], 2, seed);
        let b = tiny_batch(m.dims.vocab, seed + 10);
        let masks = dropout_masks(&m, b.rows * b.len, 0.3, seed + 20);
        let (loss_err, grad_err) = check_gradients(&m, &b, &masks);
        eprintln!("dropout: loss {loss_err:e}, gradients {grad_err:e} of their max");
        // The masks matter: without them the loss is another.
        let plain = reference_loss(&m, &m.lora64(), &b, 1.0, &[]);
        let masked = reference_loss(&m, &m.lora64(), &b, 1.0, &masks);
        assert!((plain - masked).abs() > 1e-3 * plain.abs());
    }
}

/// One draw per adapted projection, in forward order, with its shape, with and
/// without checkpointing; a mask of the wrong length is an error and nothing is
/// added.
#[test]
fn masks_are_drawn_in_forward_order() {
    let dims = Dims {
        layers: 3,
        ..tiny_dims()
    };
    let layers = [ALL, NONE, [false, false, false, true, false, true, true]];
    let m = Owned::random(dims, &layers, 2, 22);
    let b = tiny_batch(m.dims.vocab, 23);
    let n = b.rows * b.len;
    let (h, q, i) = (16, 16, 24);
    let want = [
        (n, h),
        (n, h),
        (n, h),
        (n, q),
        (n, h),
        (n, h),
        (n, i),
        (n, q),
        (n, h),
        (n, i),
    ];
    for checkpoint_layers in [false, true] {
        let options = StepOptions { checkpoint_layers };
        let step = |dropout: Option<MaskSource<'_>>, grads: &mut [Vec<f32>]| {
            forward_backward_with(&m.view(), &b.view(), 0.1, dropout, grads, options)
        };
        // Checkpointing replays the stored masks: nothing is drawn twice.
        let mut calls = vec![];
        let mut source = |rows: usize, inputs: usize| {
            calls.push((rows, inputs));
            vec![1.0; rows * inputs]
        };
        let mut grads = m.zero_grads();
        let with_ones = step(Some(&mut source), &mut grads).expect("a step");
        assert_eq!(calls, want);
        // Masks of ones change nothing.
        let mut plain = m.zero_grads();
        let without = step(None, &mut plain).expect("a step");
        assert_eq!(with_ones, without);
        assert_eq!(grads, plain);

        for bad in [5, 10] {
            let mut count = 0;
            let mut short = |rows: usize, inputs: usize| {
                count += 1;
                vec![1.0; rows * inputs - usize::from(count == bad)]
            };
            let mut grads: Vec<Vec<f32>> = m
                .zero_grads()
                .into_iter()
                .map(|g| vec![7.0; g.len()])
                .collect();
            let err = step(Some(&mut short), &mut grads).expect_err("a short mask");
            eprintln!("{err}");
            assert!(grads.iter().flatten().all(|&v| v == 7.0));
        }
    }
}

/// A batch without labels or without tokens: a zero loss, and nothing added.
#[test]
fn empty_and_unlabelled_batches_add_nothing() {
    let m = Owned::random(tiny_dims(), &[ALL], 2, 24);
    let mut b = tiny_batch(m.dims.vocab, 25);
    b.targets.fill(-100);
    let mut grads: Vec<Vec<f32>> = m
        .zero_grads()
        .into_iter()
        .map(|g| vec![0.5; g.len()])
        .collect();
    let l = forward_backward(&m.view(), &b.view(), 1.0, None, &mut grads).expect("a step");
    assert_eq!(l, 0.0);
    assert_eq!(loss(&m.view(), &b.view(), 1.0), Ok(0.0));
    let empty = OwnedBatch {
        ids: vec![],
        rows: 0,
        len: 9,
        targets: vec![],
        positions: vec![],
        starts: vec![],
    };
    let l = forward_backward(&m.view(), &empty.view(), 1.0, None, &mut grads).expect("a step");
    assert_eq!(l, 0.0);
    assert_eq!(loss(&m.view(), &empty.view(), 1.0), Ok(0.0));
    assert!(grads.iter().flatten().all(|&v| v == 0.5));
}

#[test]
fn micro_batches_accumulate() {
    let m = Owned::random(tiny_dims(), &[ALL], 2, 11);
    let (b1, b2) = (tiny_batch(m.dims.vocab, 12), tiny_batch(m.dims.vocab, 13));
    let scale = 1.0 / (b1.labelled() + b2.labelled()) as f32;
    let run = |batches: &[&OwnedBatch]| {
        let mut grads = m.zero_grads();
        let losses: Vec<f64> = batches
            .iter()
            .map(|b| {
                forward_backward(&m.view(), &b.view(), scale, None, &mut grads).expect("a step")
            })
            .collect();
        (losses, grads)
    };
    let (one, g1) = run(&[&b1]);
    let (two, g2) = run(&[&b2]);
    let (both, g) = run(&[&b1, &b2]);
    assert_eq!(both, [one[0], two[0]]);
    for (t, ((g, g1), g2)) in g.iter().zip(&g1).zip(&g2).enumerate() {
        for (e, ((&g, &a), &b)) in g.iter().zip(g1).zip(g2).enumerate() {
            assert_eq!(g.to_bits(), (a + b).to_bits(), "tensor {t}[{e}]");
        }
    }
    assert!(g1.iter().flatten().any(|&v| v != 0.0));
}

/// A weighted step sees the forward's own token losses (their sum is the mean step's
/// loss over its scale), and gives each token its weight's gradient: with every weight
/// the mean step's scale its gradients are the mean step's bit for bit, with the
/// opposite sign they are negated bit for bit, and weights of zero add nothing. The
/// token losses of a step without gradients are the same.
#[test]
fn a_weighted_step_weighs_each_token_by_what_it_is_told() {
    let (m, b) = larger_case();
    let scale = 1.0 / b.labelled() as f32;
    let mut mean = m.zero_grads();
    let loss = forward_backward(&m.view(), &b.view(), scale, None, &mut mean).expect("a step");
    let weighted = |weight: f32| {
        let mut grads = m.zero_grads();
        let mut seen = Vec::new();
        let mut weigh = |losses: &[f64]| {
            seen = losses.to_vec();
            vec![weight; losses.len()]
        };
        let options = StepOptions::default();
        forward_backward_weighted(&m.view(), &b.view(), &mut weigh, None, &mut grads, options)
            .expect("a weighted step");
        (grads, seen)
    };
    let (same, losses) = weighted(scale);
    assert_eq!(same, mean);
    assert_eq!(losses.len(), b.targets.len());
    for (loss, &t) in losses.iter().zip(&b.targets) {
        assert!(t >= 0 || *loss == 0.0);
    }
    let total: f64 = losses.iter().sum();
    assert!((total * scale as f64 - loss).abs() < 1e-9 * loss.abs());
    assert_eq!(
        token_losses(&m.view(), &b.view()).expect("token losses"),
        losses
    );
    let (negated, _) = weighted(-scale);
    for (n, g) in negated.iter().flatten().zip(mean.iter().flatten()) {
        assert_eq!(n.to_bits(), (-g).to_bits());
    }
    let (none, _) = weighted(0.0);
    assert!(none.iter().flatten().all(|&v| v == 0.0));
    let mut wrong = |losses: &[f64]| vec![1.0; losses.len() - 1];
    let mut grads = m.zero_grads();
    let options = StepOptions::default();
    forward_backward_weighted(&m.view(), &b.view(), &mut wrong, None, &mut grads, options)
        .expect_err("one weight short");
    assert!(grads.iter().flatten().all(|&v| v == 0.0));
}

/// A larger model and batch, so that GEMMs split into several blocks and attention
/// into several query blocks.
fn larger_case() -> (Owned, OwnedBatch) {
    let dims = Dims {
        vocab: 200,
        hidden: 32,
        intermediate: 144,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
        rotary_dim: 8,
        rms_eps: 1e-6,
        qk_norm: false,
        gemma: None,
    };
    let m = Owned::random(dims, &[ALL], 4, 14);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(15);
    let (rows, len) = (3, 70);
    let ids = (0..rows * len).map(|_| rng.random_range(0..200)).collect();
    let targets = (0..rows * len)
        .map(|i| {
            if i % 5 == 0 {
                -100
            } else {
                rng.random_range(0..200)
            }
        })
        .collect();
    let b = OwnedBatch::unpacked(ids, targets, rows, len);
    (m, b)
}

/// The same bits on 1 and 2 threads.
#[test]
fn results_do_not_depend_on_the_thread_count() {
    for (m, b) in [larger_case(), groups::grouped_case()] {
        same_bits_on_any_thread_count(&m, &b);
    }
}

/// The loss, the evaluation loss and the gradients of a step on `b`: the same bits on
/// 1, 2 and 3 threads (the step's row groups, if any, fewer, as many and more than the
/// threads).
fn same_bits_on_any_thread_count(m: &Owned, b: &OwnedBatch) {
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a pool");
        pool.install(|| {
            let mut grads = m.zero_grads();
            let loss =
                forward_backward(&m.view(), &b.view(), 0.01, None, &mut grads).expect("a step");
            let eval = loss_only(m, b);
            let bits: Vec<Vec<u32>> = grads
                .iter()
                .map(|g| g.iter().map(|v| v.to_bits()).collect())
                .collect();
            (loss.to_bits(), eval.to_bits(), bits)
        })
    };
    let one = run(1);
    assert_eq!(
        one.0, one.1,
        "the evaluation loss differs from the training one"
    );
    assert_eq!(one, run(2));
    assert_eq!(one, run(3));
}

fn loss_only(m: &Owned, b: &OwnedBatch) -> f64 {
    loss(&m.view(), &b.view(), 0.01).expect("a loss")
}

#[test]
fn bad_gradient_buffers_are_errors_and_nothing_is_added() {
    let m = Owned::random(tiny_dims(), &[QV], 2, 16);
    let b = tiny_batch(m.dims.vocab, 17);
    let model = m.view();
    let mut grads = m.zero_grads();
    grads.pop();
    let err =
        forward_backward(&model, &b.view(), 1.0, None, &mut grads).expect_err("a missing gradient");
    eprintln!("{err}");
    let mut grads = m.zero_grads();
    grads[2].push(0.0);
    let err =
        forward_backward(&model, &b.view(), 1.0, None, &mut grads).expect_err("a long gradient");
    eprintln!("{err}");
    // A bad batch: the gradients are left as they were.
    let mut grads: Vec<Vec<f32>> = m
        .zero_grads()
        .into_iter()
        .map(|g| vec![7.0; g.len()])
        .collect();
    let mut bad = tiny_batch(m.dims.vocab, 17);
    bad.targets[3] = 1000;
    assert!(forward_backward(&model, &bad.view(), 1.0, None, &mut grads).is_err());
    assert!(grads.iter().flatten().all(|&v| v == 7.0));
}

#[test]
fn the_loss_matches_the_f64_reference() {
    for (targets, seed) in [
        (ALL, 1),
        ([true, false, true, false, false, false, false], 2),
    ] {
        let m = Owned::random(tiny_dims(), &[targets], 2, seed);
        let b = tiny_batch(m.dims.vocab, seed + 10);
        let scale = 1.0 / b.labelled() as f32;
        let got = loss(&m.view(), &b.view(), scale).expect("a loss");
        let want = reference_loss(&m, &m.lora64(), &b, scale as f64, &[]);
        let err = (got - want).abs() / want.abs();
        eprintln!("loss {got} vs {want}: relative error {err:e}");
        assert!(err <= 1e-5, "loss {got} vs {want}: {err:e}");
    }
}

#[test]
fn bad_inputs_are_errors() {
    let m = Owned::random(tiny_dims(), &[ALL], 2, 3);
    let model = m.view();
    let good = tiny_batch(m.dims.vocab, 4);
    assert!(loss(&model, &good.view(), 1.0).is_ok());
    let check = |change: &dyn Fn(&mut OwnedBatch), what: &str| {
        let mut b = tiny_batch(m.dims.vocab, 4);
        change(&mut b);
        let err = loss(&model, &b.view(), 1.0).expect_err(what);
        eprintln!("{what}: {err}");
    };
    check(&|b| b.ids[5] = 61, "a token past the vocabulary");
    check(&|b| b.targets[7] = 61, "a target past the vocabulary");
    check(&|b| b.positions[2] = 128, "a position past the tables");
    check(&|b| b.starts[10] = 2, "a segment starting after its token");
    check(&|b| b.ids.pop().map_or((), drop), "too few ids");
    check(&|b| b.targets.push(0), "too many targets");
    check(&|b| b.rows = 3, "rows that the buffers do not hold");

    let bad_model = |change: &dyn Fn(&mut Model<'_>), what: &str| {
        let mut model = m.view();
        change(&mut model);
        let err = loss(&model, &good.view(), 1.0).expect_err(what);
        eprintln!("{what}: {err}");
    };
    // Every element but the first.
    fn tail(f: Frozen<'_>) -> Frozen<'_> {
        match f {
            Frozen::F32(w) => Frozen::F32(&w[1..]),
            Frozen::Bf16(w) => Frozen::Bf16(&w[1..]),
        }
    }
    bad_model(&|m| m.dims.layers = 3, "a missing layer");
    bad_model(&|m| m.dims.kv_heads = 3, "heads not a multiple of kv heads");
    bad_model(&|m| m.dims.head_dim = 3, "an odd head_dim");
    bad_model(&|m| m.embed = tail(m.embed), "a short embedding");
    bad_model(&|m| m.sin = &m.sin[2..], "tables of different lengths");
    bad_model(
        &|m| m.layers[1].proj[5].weight = tail(m.layers[1].proj[5].weight),
        "a short weight",
    );
    // bf16 storage is checked the same way, by elements.
    let short_head = vec![half::bf16::ZERO; m.lm_head.len() - 1];
    let long_down = vec![half::bf16::ONE; m.weights[0][6].len() + 1];
    let mut model = m.view();
    model.lm_head = Frozen::Bf16(&short_head);
    let err = loss(&model, &good.view(), 1.0).expect_err("a short bf16 head");
    eprintln!("a short bf16 head: {err}");
    let mut model = m.view();
    model.layers[0].proj[6].weight = Frozen::Bf16(&long_down);
    let err = loss(&model, &good.view(), 1.0).expect_err("a long bf16 weight");
    eprintln!("a long bf16 weight: {err}");
    bad_model(
        &|m| {
            if let Some(l) = m.layers[0].proj[2].lora.as_mut() {
                l.r = 3;
            }
        },
        "a LoRA rank its factors do not have",
    );
}
/// Everything a step yields, as bits: per micro-batch the training loss and the
/// evaluation loss ([`loss`]), then the accumulated gradients.
type Bits = (Vec<u64>, Vec<u64>, Vec<Vec<u32>>);

/// Two accumulating micro-batches on a pool of `threads`, with `masks[k]` the dropout
/// masks of micro-batch `k` in forward order (none: no dropout), plus the evaluation
/// loss of each: their bits.
fn step_bits(
    model: &Model<'_>,
    batches: &[&OwnedBatch],
    masks: &[Vec<Vec<f32>>],
    threads: usize,
    checkpoint_layers: bool,
) -> Bits {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("a pool");
    let scale = 1.0 / batches.iter().map(|b| b.labelled()).sum::<usize>() as f32;
    pool.install(|| {
        let mut grads: Vec<Vec<f32>> = model
            .lora_lengths()
            .into_iter()
            .map(|len| vec![0.0; len])
            .collect();
        let (mut losses, mut evals) = (vec![], vec![]);
        for (k, b) in batches.iter().enumerate() {
            let options = StepOptions { checkpoint_layers };
            let step_masks = masks.get(k).map(Vec::as_slice).unwrap_or_default();
            let l = with_masks(step_masks, |dropout| {
                forward_backward_with(model, &b.view(), scale, dropout, &mut grads, options)
            })
            .expect("a step")
            .loss;
            losses.push(l.to_bits());
            evals.push(loss(model, &b.view(), scale).expect("a loss").to_bits());
        }
        assert!(grads.iter().flatten().any(|&v| v != 0.0));
        let bits = grads
            .iter()
            .map(|g| g.iter().map(|v| v.to_bits()).collect())
            .collect();
        (losses, evals, bits)
    })
}

/// Masks that are not two-valued (0, −0, and two keep values), which a checkpointed
/// step must keep whole.
fn odd_masks(m: &Owned, n: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    dropout_masks(m, n, 0.3, seed)
        .into_iter()
        .map(|mask| {
            mask.into_iter()
                .map(|v| match rng.random_range(0..10) {
                    0 => -0.0,
                    1 => 1.25,
                    _ => v,
                })
                .collect()
        })
        .collect()
}

/// Checkpointing recomputes each layer's forward with the same code, inputs and masks,
/// so the losses and the accumulated gradients are the same bits as without it: on
/// the oracle-checked models (GQA; LoRA on all seven, on q and v, and only above
/// layer 0 with a gap), without dropout, with two-valued (packed) masks and with odd
/// (kept whole) masks, over two micro-batches, on 1 and 2 threads; and on a model
/// large enough that the kernels split into several blocks, with a batch of one row
/// group and one of two.
#[test]
fn checkpointing_gives_the_same_bits() {
    let three = Dims {
        layers: 3,
        ..tiny_dims()
    };
    let upper = [NONE, [false, true, false, true, false, false, true], ALL];
    let models = [
        Owned::random(tiny_dims(), &[ALL], 2, 30),
        Owned::random(tiny_dims(), &[QV], 2, 31),
        Owned::random(three, &upper, 3, 32),
    ];
    for (k, m) in models.iter().enumerate() {
        let seed = 40 + 10 * k as u64;
        let (b1, b2) = (
            tiny_batch(m.dims.vocab, seed),
            tiny_batch(m.dims.vocab, seed + 1),
        );
        let n = b1.rows * b1.len;
        let drawn = [
            dropout_masks(m, n, 0.3, seed + 2),
            dropout_masks(m, n, 0.3, seed + 3),
        ];
        let odd = [odd_masks(m, n, seed + 4), odd_masks(m, n, seed + 5)];
        for masks in [&[][..], &drawn[..], &odd[..]] {
            let plain = step_bits(&m.view(), &[&b1, &b2], masks, 1, false);
            for threads in [1, 2] {
                let checkpointed = step_bits(&m.view(), &[&b1, &b2], masks, threads, true);
                assert!(
                    plain == checkpointed,
                    "model {k}, {} masks, {threads} threads: checkpointing changed the bits",
                    masks.len()
                );
            }
        }
    }
    for (m, b) in [larger_case(), groups::grouped_case()] {
        let masks = [dropout_masks(&m, b.rows * b.len, 0.1, 33)];
        for masks in [&[][..], &masks[..]] {
            let plain = step_bits(&m.view(), &[&b], masks, 2, false);
            assert!(plain == step_bits(&m.view(), &[&b], masks, 2, true));
            assert!(plain == step_bits(&m.view(), &[&b], masks, 1, true));
        }
    }
}

/// A stored mask unpacks to the bits drawn: two-valued masks pack to a bit each
/// (any length, all zeros too), anything else is kept whole.
#[test]
fn stored_masks_unpack_to_the_drawn_bits() {
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let keep = 1.0 / 0.9f32;
    let two: Vec<f32> = (0..131)
        .map(|i| if i % 3 == 0 { 0.0 } else { keep })
        .collect();
    let cases = [
        (two.clone(), true),
        (vec![0.0; 70], true),
        (vec![keep; 64], true),
        (vec![], true),
        ([&two[..5], &[-0.0], &two[6..]].concat(), false),
        ([&two[..5], &[2.0], &two[6..]].concat(), false),
    ];
    let mut out = vec![9.0; 3];
    for (mask, packed) in cases {
        let stored = StoredMask::pack(&mask);
        assert_eq!(
            matches!(stored, StoredMask::Bits { .. }),
            packed,
            "{mask:?}"
        );
        stored.unpack_into(&mut out);
        assert_eq!(bits(&out), bits(&mask));
    }
}

/// What the step holds, by [`step_bytes`]: checkpointing keeps one layer's state and
/// the layer inputs; the 7B figures for the module notes.
#[test]
fn step_bytes_shrinks_with_checkpointing() {
    let llama7b = llama7b();
    let ranks = vec![[8; 7]; 32];
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    for dropout in [false, true] {
        let full = step_bytes(&llama7b, 2048, &ranks, dropout, false, false, Compute::F32);
        let ckpt = step_bytes(&llama7b, 2048, &ranks, dropout, true, false, Compute::F32);
        eprintln!(
            "7B, 2048 tokens, r = 8 on all seven, dropout {dropout}: {:.2} GiB, checkpointed {:.2} GiB",
            gib(full),
            gib(ckpt)
        );
        assert!(ckpt * 4 < full);
    }
    // The layer inputs dominate what a checkpointed step keeps per layer.
    let d = tiny_dims();
    let ranks = vec![ALL.map(|t| 2 * usize::from(t)); d.layers];
    let one = step_bytes(&d, 100, &ranks, true, true, false, Compute::F32);
    let more = step_bytes(
        &Dims { layers: 3, ..d },
        100,
        &[ranks[0]; 3],
        true,
        true,
        false,
        Compute::F32,
    );
    let packed: u64 = (0..7)
        .map(|p| packed_mask_bytes(100 * d.projection_shape(p).0))
        .sum();
    assert_eq!(more - one, 4 * 100 * d.hidden as u64 + packed);
    assert_eq!(
        step_bytes(&d, 0, &ranks, true, true, false, Compute::F32),
        0
    );
    // No LoRA: no backward, no inputs kept.
    let none = vec![[0; 7]; d.layers];
    assert!(
        step_bytes(&d, 100, &none, false, true, false, Compute::F32)
            < step_bytes(&d, 100, &none, false, false, false, Compute::F32)
    );
}
