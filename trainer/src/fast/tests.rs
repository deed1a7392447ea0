use super::*;
use crate::init::{InitOptions, Preset, preset_config};
use crate::lora::LoraSettings;
use rand::{Rng, SeedableRng};

/// A tiny-preset model with LoRA on `targets` and every B drawn non-zero, so every
/// gradient depends on the whole adapter.
fn model(targets: &[&str], tie: bool, llama3_rope: bool, kv_heads: usize) -> Llama {
    build(LLAMA, targets, tie, llama3_rope, kv_heads, None, None)
}

const LLAMA: tuneq_pools::Architecture = tuneq_pools::Architecture::Llama;

/// [`model`] of another family.
fn model_of(architecture: tuneq_pools::Architecture, targets: &[&str]) -> Llama {
    build(architecture, targets, false, false, 4, None, None)
}

/// A Mistral whose sliding window of `window` positions binds on the tests' rows.
fn windowed_mistral(targets: &[&str], window: u64) -> Llama {
    let mistral = tuneq_pools::Architecture::Mistral;
    build(mistral, targets, false, false, 4, None, Some(window))
}

/// [`model`] of `architecture`, or with `bf16_held_as`, the same model with every
/// frozen tensor rounded to bf16 and held in that dtype (bf16 itself, or its exact
/// f32 widening); with `window`, a sliding window of that many positions.
fn build(
    architecture: tuneq_pools::Architecture,
    targets: &[&str],
    tie: bool,
    llama3_rope: bool,
    kv_heads: usize,
    bf16_held_as: Option<DType>,
    window: Option<u64>,
) -> Llama {
    let opts = InitOptions {
        preset: Preset::Tiny,
        seed: 3,
        shards: 1,
        tie_embeddings: tie,
        llama3_rope,
        architecture,
    };
    let mut cfg = preset_config(&opts);
    cfg.shape.num_key_value_heads = Some(kv_heads as u64);
    cfg.shape.sliding_window = window.or(cfg.shape.sliding_window);
    let settings = LoraSettings {
        r: 4,
        alpha: 8.0,
        dropout: 0.0,
        targets: targets.iter().map(|t| t.to_string()).collect(),
        rslora: false,
    };
    let mut weights = crate::init::random_weights(&cfg, 3).expect("weights");
    let dtype = bf16_held_as.unwrap_or(DType::F32);
    if bf16_held_as.is_some() {
        for (_, t) in &mut weights {
            *t = t
                .to_dtype(DType::BF16)
                .and_then(|b| b.to_dtype(dtype))
                .expect("rounded");
        }
    }
    let mut map = crate::weights::WeightMap::from_tensors(weights, "random");
    let mut rng = crate::batch::rng_for(5, 0);
    let m = Llama::from_weights(
        cfg,
        &mut map,
        dtype,
        &Device::Cpu,
        Some((&settings, &mut rng)),
    )
    .expect("model");
    fill_b(&m);
    m
}

/// Draws every LoRA B non-zero (the same values for models of the same shape).
fn fill_b(m: &Llama) {
    let mut fill = rand_chacha::ChaCha8Rng::seed_from_u64(9);
    for v in m
        .lora_vars()
        .iter()
        .filter(|v| v.name.ends_with("lora_B.weight"))
    {
        let values: Vec<f32> = (0..v.var.elem_count())
            .map(|_| fill.random_range(-0.05..0.05))
            .collect();
        v.var
            .set(&Tensor::from_vec(values, v.var.shape(), &Device::Cpu).expect("B"))
            .expect("set B");
    }
}

/// Two micro-batches: right-padded rows with unlabelled prompts.
/// Two micro-batches of two padded rows, of the examples' lengths in pairs.
fn batches(vocab: u32, lens: [usize; 4]) -> Vec<Batch> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let mut examples = Vec::new();
    for len in lens {
        let ids: Vec<u32> = (0..len).map(|_| rng.random_range(1..vocab)).collect();
        let prompt = len / 3;
        let labels = ids
            .iter()
            .enumerate()
            .map(|(i, &t)| if i < prompt { -100 } else { t as i64 })
            .collect();
        examples.push(crate::data::Example {
            input_ids: ids,
            labels,
        });
    }
    examples
        .chunks(2)
        .map(|pair| crate::batch::make_batch(&pair.iter().collect::<Vec<_>>(), 0))
        .collect()
}

/// Short rows: the step runs its layers batch-wide.
const SHORT: [usize; 4] = [40, 23, 31, 17];

/// Rows of 260 and 256 tokens: two row groups per micro-batch (see
/// `tuneq_kernels::llama`'s row groups).
const GROUPED: [usize; 4] = [260, 200, 150, 256];

fn compare(name: &str, m: &Llama, dropout: f64, lens: [usize; 4]) {
    compare_within(name, m, dropout, lens, 1e-5);
}

/// [`compare`] with the loss and every gradient within `tolerance` (relative to the
/// graph's loss and to each gradient's largest entry).
fn compare_within(name: &str, m: &Llama, dropout: f64, lens: [usize; 4], tolerance: f64) {
    let data = batches(m.cfg.vocab_size() as u32, lens);
    let run = |fused: bool| {
        let mut rng = crate::batch::rng_for(7, crate::batch::streams::DROPOUT);
        let mut masks = Vec::new();
        let d = Some(StepDropout {
            p: dropout,
            rng: &mut rng,
            record: Some(&mut masks),
        });
        let r = if fused {
            accumulate(m, &data, d, Objective::CrossEntropy)
        } else {
            crate::train::accumulate_on_graph(m, &data, d)
        };
        (r.expect("a step"), masks)
    };
    let ((fast, fast_masks), (graph, graph_masks)) = (run(true), run(false));
    assert_eq!(fast_masks.len(), graph_masks.len(), "{name}: masks drawn");
    for (a, b) in fast_masks.iter().zip(&graph_masks) {
        let diff = (a - b)
            .and_then(|d| d.abs()?.max_all()?.to_scalar::<f32>())
            .expect("diff");
        assert_eq!(diff, 0.0, "{name}: the paths drew different dropout masks");
    }
    let loss_err = (fast.loss - graph.loss).abs() / graph.loss.abs();
    assert!(
        loss_err <= tolerance,
        "{name}: loss {} vs graph {} ({loss_err:.1e})",
        fast.loss,
        graph.loss
    );
    let mut worst = 0f64;
    for (v, (f, g)) in m
        .lora_vars()
        .iter()
        .zip(fast.grads.iter().zip(&graph.grads))
    {
        let (err, scale) = max_error_and_scale(f, g);
        assert!(
            scale > 0.0,
            "{name}: {} has a zero gradient; the check would be vacuous",
            v.name
        );
        let rel = err / scale;
        worst = worst.max(rel);
        assert!(
            rel <= tolerance,
            "{name}: {} differs from the graph by {rel:.1e} of its largest entry",
            v.name
        );
    }
    eprintln!("{name}: loss rel {loss_err:.1e}, worst gradient rel {worst:.1e}");
}

/// `max |got − want|` and `max |want|`.
fn max_error_and_scale(got: &Tensor, want: &Tensor) -> (f64, f64) {
    let max_abs = |t: candle_core::Result<Tensor>| {
        t.and_then(|t| t.abs()?.max_all()?.to_scalar::<f32>())
            .expect("max") as f64
    };
    (max_abs(got - want), max_abs(Ok(want.clone())))
}

#[test]
fn fast_path_matches_the_graph() {
    let all = tuneq_openapi::train_spec::ALL_TARGET_MODULES;
    compare(
        "all seven, GQA 8/4",
        &model(&all, false, false, 4),
        0.0,
        SHORT,
    );
    compare(
        "q and v, MHA, tied, llama3 rope",
        &model(&["q_proj", "v_proj"], true, true, 8),
        0.0,
        SHORT,
    );
    compare(
        "Qwen2 (q/k/v biases), all seven",
        &model_of(tuneq_pools::Architecture::Qwen2, &all),
        0.0,
        SHORT,
    );
    compare(
        "Qwen3 (q/k head norms), all seven, row groups",
        &model_of(tuneq_pools::Architecture::Qwen3, &all),
        0.0,
        GROUPED,
    );
    // Phi-3: fused qkv and gate_up as the kernels' parts, three quarters of each
    // head rotated, LongRoPE's short tables for one micro-batch (31 positions) and
    // its long ones for the other (40, past its context of 32).
    let phi3 = tuneq_pools::Architecture::Phi3;
    compare(
        "Phi-3 (fused projections, partial RoPE, LongRoPE), all four",
        &model_of(phi3, &tuneq_openapi::FUSED_PROJECTIONS),
        0.0,
        SHORT,
    );
    compare(
        "Phi-3 qkv and down, dropout 0.1 (one mask per fused projection), row groups",
        &model_of(phi3, &["qkv_proj", "down_proj"]),
        0.1,
        GROUPED,
    );
    compare(
        "Mistral, a window of 24 positions, row groups",
        &windowed_mistral(&all, 24),
        0.0,
        GROUPED,
    );
    let dropping = model(&all, false, false, 2);
    compare("all seven, dropout 0.1", &dropping, 0.1, SHORT);
    compare(
        "all seven, dropout 0.1, row groups",
        &dropping,
        0.1,
        GROUPED,
    );
}

/// Gemma 2 and 3 on the fused kernels: `(1 + w)` norms before and after each half,
/// GeGLU, √hidden embeddings, `query_pre_attn_scalar`, Gemma 2's soft-capped scores and
/// logits, Gemma 3's q/k norms and the local RoPE base of its sliding layers, and a
/// window of 24 positions on the sliding layers only.
///
/// Gemma 3's tiny model is less well conditioned than the others: against the same
/// graph run on f64 weights, the graph's own f32 gradients were 1.5e-5 off (the fused
/// path's 1.7e-5; Gemma 2's 1.7e-6 and 1.8e-6), so the two f32 paths are held to 3e-5
/// of each other there.
#[test]
fn gemma_on_the_fast_path_matches_the_graph() {
    let all = tuneq_openapi::train_spec::ALL_TARGET_MODULES;
    for (architecture, tolerance) in [
        (tuneq_pools::Architecture::Gemma2, 1e-5),
        (tuneq_pools::Architecture::Gemma3, 3e-5),
    ] {
        let name = architecture.model_type();
        let compare = |what: &str, m: &Llama, dropout: f64, lens: [usize; 4]| {
            compare_within(&format!("{name}, {what}"), m, dropout, lens, tolerance)
        };
        let windowed =
            |targets: &[&str]| build(architecture, targets, false, false, 4, None, Some(24));
        compare("window 24, all seven", &windowed(&all), 0.0, SHORT);
        compare(
            "window 24, q and v, dropout 0.1, row groups",
            &windowed(&["q_proj", "v_proj"]),
            0.1,
            GROUPED,
        );
        compare(
            "no binding window, all seven, row groups",
            &model_of(architecture, &all),
            0.0,
            GROUPED,
        );
    }
}

#[test]
fn a_packed_micro_batch_gives_the_padded_batch_s_loss_and_gradients() {
    let all = tuneq_openapi::train_spec::ALL_TARGET_MODULES;
    // A window of 16 positions binds inside the longer examples' segments.
    for m in [model(&all, false, false, 4), windowed_mistral(&all, 16)] {
        packed_matches_padded(&m);
    }
}

fn packed_matches_padded(m: &Llama) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(12);
    let examples: Vec<crate::data::Example> = [48usize, 9, 20, 13, 30, 6]
        .iter()
        .map(|&len| {
            let ids: Vec<u32> = (0..len).map(|_| rng.random_range(1..4096)).collect();
            let labels = ids
                .iter()
                .enumerate()
                .map(|(i, &t)| if i < 2 { -100 } else { t as i64 })
                .collect();
            crate::data::Example {
                input_ids: ids,
                labels,
            }
        })
        .collect();
    let refs: Vec<_> = examples.iter().collect();
    let padded = crate::batch::make_batch(&refs, 0);
    let packed = crate::batch::pack_batch(&refs, 0);
    assert!(
        packed.rows * packed.len < padded.rows * padded.len,
        "packing saved nothing"
    );
    let step = |batch: &Batch| {
        accumulate(
            m,
            std::slice::from_ref(batch),
            None,
            Objective::CrossEntropy,
        )
        .expect("a step")
    };
    let (a, b) = (step(&padded), step(&packed));
    assert!(
        (a.loss - b.loss).abs() <= 1e-6 * a.loss.abs(),
        "{} vs {}",
        a.loss,
        b.loss
    );
    for (v, (x, y)) in m.lora_vars().iter().zip(a.grads.iter().zip(&b.grads)) {
        let (err, scale) = max_error_and_scale(y, x);
        assert!(
            err <= 1e-5 * scale,
            "{}: packed differs by {err} (max {scale})",
            v.name
        );
    }
    let graph = crate::train::accumulate_on_graph(m, std::slice::from_ref(&packed), None);
    assert!(graph.is_err(), "the graph must refuse a packed batch");
}

#[test]
fn checkpointing_layers_changes_no_bit() {
    let all = tuneq_openapi::train_spec::ALL_TARGET_MODULES;
    let mut m = model(&all, false, false, 4);
    let data = batches(m.cfg.vocab_size() as u32, SHORT);
    let run = |m: &Llama| {
        let mut rng = crate::batch::rng_for(7, crate::batch::streams::DROPOUT);
        let d = Some(StepDropout {
            p: 0.1,
            rng: &mut rng,
            record: None,
        });
        accumulate(m, &data, d, Objective::CrossEntropy).expect("a step")
    };
    let kept = run(&m);
    m.checkpoint_layers = true;
    let recomputed = run(&m);
    assert_eq!(kept.loss.to_bits(), recomputed.loss.to_bits());
    for (a, b) in kept.grads.iter().zip(&recomputed.grads) {
        let (a, b) = (
            a.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("a"),
            b.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("b"),
        );
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "a gradient changed"
        );
    }
    let (without, with) = (
        step_bytes(&m, 512, true, false).expect("bytes"),
        step_bytes(&m, 512, true, true).expect("bytes"),
    );
    assert!(
        with < without / 2,
        "checkpointing should hold far less: {with} vs {without}"
    );
}

/// The evaluation loss, and the tokens ranked right, of the fused path and the graph;
/// every other labelled token's target is made the model's own first choice, so
/// that a count of none would show.
#[test]
fn evaluation_loss_and_token_accuracy_match_the_graph() {
    let m = model(&["q_proj", "down_proj"], false, false, 4);
    let mut hits = 0;
    for mut b in batches(m.cfg.vocab_size() as u32, SHORT) {
        let ids = Tensor::from_vec(b.ids.clone(), (b.rows, b.len), &Device::Cpu).expect("ids");
        let hidden = m.hidden_states(&ids, None).expect("hidden");
        let logits = m.logits(&hidden).expect("logits");
        let first: Vec<u32> = logits
            .argmax(candle_core::D::Minus1)
            .and_then(|t| t.to_vec1())
            .expect("argmax");
        let mut chosen = 0;
        for (r, t) in b.targets.iter_mut().enumerate() {
            if *t >= 0 && r % 2 == 0 {
                *t = i64::from(first[r]);
                chosen += 1;
            }
        }
        let (fast, correct) = loss(&m, &b, 57.0).expect("fast loss");
        let graph = crate::ops::masked_cross_entropy(&logits, &b.targets, 57.0)
            .and_then(|l| l.to_scalar::<f32>())
            .expect("graph loss") as f64;
        assert!(
            (fast - graph).abs() <= 1e-5 * graph.abs(),
            "{fast} vs {graph}"
        );
        let on_graph = crate::ops::top1_hits(&logits, &b.targets).expect("hits");
        assert_eq!(correct, on_graph);
        assert!(correct >= chosen && correct <= b.labelled as u64);
        hits += correct;
    }
    assert!(hits > 0);
}

#[test]
fn bf16_weights_train_bit_for_bit_as_their_f32_widening() {
    let all = tuneq_openapi::train_spec::ALL_TARGET_MODULES;
    for tie in [false, true] {
        let wide = build(LLAMA, &all, tie, false, 4, Some(DType::F32), None);
        let narrow = build(LLAMA, &all, tie, false, 4, Some(DType::BF16), None);
        assert_eq!(ComputePath::for_model(&narrow), ComputePath::CpuFused);
        let data = batches(wide.cfg.vocab_size() as u32, SHORT);
        let (a, b) = (
            accumulate(&wide, &data, None, Objective::CrossEntropy).expect("f32 step"),
            accumulate(&narrow, &data, None, Objective::CrossEntropy).expect("bf16 step"),
        );
        assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "tie {tie}: loss");
        for (x, y) in a.grads.iter().zip(&b.grads) {
            let (x, y) = (
                x.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("x"),
                y.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("y"),
            );
            assert!(x.iter().any(|v| *v != 0.0), "tie {tie}: a zero gradient");
            let same = x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits());
            assert!(same, "tie {tie}: bf16 storage changed a gradient");
        }
        let (la, lb) = (
            loss(&wide, &data[0], 9.0).expect("f32 loss"),
            loss(&narrow, &data[0], 9.0).expect("bf16 loss"),
        );
        assert_eq!(la.0.to_bits(), lb.0.to_bits(), "tie {tie}: evaluation loss");
        assert_eq!(la.1, lb.1, "tie {tie}: tokens ranked right");
        let bytes = |m: &Llama| step_bytes(m, 512, false, false).expect("bytes");
        assert!(
            bytes(&narrow) > bytes(&wide),
            "the widening buffer is counted"
        );
    }
}

#[test]
fn checkpointing_on_the_graph_gives_the_graph_s_gradients_and_masks() {
    let all = tuneq_openapi::train_spec::ALL_TARGET_MODULES;
    let mut m = model(&all, false, false, 4);
    let data = batches(m.cfg.vocab_size() as u32, SHORT);
    let mut run = |checkpoint: bool| {
        m.checkpoint_layers = checkpoint;
        let mut rng = crate::batch::rng_for(7, crate::batch::streams::DROPOUT);
        let mut masks = Vec::new();
        let d = Some(StepDropout {
            p: 0.1,
            rng: &mut rng,
            record: Some(&mut masks),
        });
        let r = crate::train::accumulate_on_graph(&m, &data, d).expect("a step");
        (r, masks)
    };
    let ((kept, kept_masks), (recomputed, recomputed_masks)) = (run(false), run(true));
    assert_eq!(kept_masks.len(), recomputed_masks.len());
    assert!(!kept_masks.is_empty());
    for (a, b) in kept_masks.iter().zip(&recomputed_masks) {
        let diff = (a - b)
            .and_then(|d| d.abs()?.max_all()?.to_scalar::<f32>())
            .expect("diff");
        assert_eq!(diff, 0.0, "checkpointing drew different masks");
    }
    assert!(
        (kept.loss - recomputed.loss).abs() <= 1e-7 * kept.loss.abs(),
        "{} vs {}",
        kept.loss,
        recomputed.loss
    );
    for (v, (a, b)) in m
        .lora_vars()
        .iter()
        .zip(kept.grads.iter().zip(&recomputed.grads))
    {
        let (err, scale) = max_error_and_scale(b, a);
        assert!(scale > 0.0, "{}: a zero gradient", v.name);
        assert!(
            err <= 1e-6 * scale,
            "{}: recomputing moved the gradient by {:.1e} of its largest entry",
            v.name,
            err / scale
        );
    }
}
