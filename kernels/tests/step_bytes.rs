//! [`step_bytes`] against what a step really allocates: a counting global allocator
//! records the peak of live heap bytes during `forward_backward_with`. Its own binary
//! with one test, so that no other test allocates meanwhile; on a one-thread pool, so
//! that the kernels' per-job scratch is made one at a time. Once with f32 frozen
//! weights and once with the same weights stored as bf16 (which adds the widening
//! scratch, and runs the layers as one row group).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use half::bf16;
use rand::{Rng, SeedableRng};
use tuneq_kernels::llama::{
    Compute, Dims, Frozen, Layer, Lora, MaskSource, Model, OwnedBatch, Projection, StepOptions,
    forward_backward_with, step_bytes, step_bytes_on_any_cpu,
};

/// The system allocator, counting live bytes and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to `System` unchanged; the counters are only
// arithmetic on the sizes.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
        PEAK.fetch_max(live, Ordering::Relaxed);
        // SAFETY: the caller's contract is `System`'s.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size >= layout.size() {
            let grow = new_size - layout.size();
            let live = LIVE.fetch_add(grow, Ordering::Relaxed) + grow;
            PEAK.fetch_max(live, Ordering::Relaxed);
        } else {
            LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
        }
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn step_bytes_is_what_a_step_allocates() {
    let dims = Dims {
        vocab: 300,
        hidden: 64,
        intermediate: 176,
        layers: 3,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        rotary_dim: 16,
        rms_eps: 1e-5,
        qk_norm: false,
        gemma: None,
    };
    let (rows, len, r) = (4, 128, 4);
    let n = rows * len;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let mut random = |n: usize, bound: f32| -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-bound..bound)).collect()
    };
    let (v, h) = (dims.vocab, dims.hidden);
    let embed = random(v * h, 1.0);
    let lm_head = random(v * h, 0.1);
    let ones = vec![1f32; h];
    let weights: Vec<Vec<Vec<f32>>> = (0..dims.layers)
        .map(|_| {
            (0..7)
                .map(|p| {
                    let (i, o) = dims.projection_shape(p);
                    random(o * i, 1.0 / (i as f32).sqrt())
                })
                .collect()
        })
        .collect();
    let factors: Vec<Vec<(Vec<f32>, Vec<f32>)>> = (0..dims.layers)
        .map(|_| {
            (0..7)
                .map(|p| {
                    let (i, o) = dims.projection_shape(p);
                    (random(r * i, 0.1), random(o * r, 0.1))
                })
                .collect()
        })
        .collect();
    let half = dims.head_dim / 2;
    let cos = vec![1f32; len * half];
    let sin = vec![0f32; len * half];
    let to_bf16 = |w: &[f32]| -> Vec<bf16> { w.iter().map(|&x| bf16::from_f32(x)).collect() };
    let (embed16, lm_head16) = (to_bf16(&embed), to_bf16(&lm_head));
    let weights16: Vec<Vec<Vec<bf16>>> = weights
        .iter()
        .map(|l| l.iter().map(|w| to_bf16(w)).collect())
        .collect();
    let layers = |frozen_bf16: bool| -> Vec<Layer<'_>> {
        (0..dims.layers)
            .map(|l| Layer {
                qk_norm: None,
                gemma: None,
                input_norm: &ones,
                post_norm: &ones,
                proj: std::array::from_fn(|p| Projection {
                    bias: None,
                    weight: if frozen_bf16 {
                        Frozen::Bf16(&weights16[l][p])
                    } else {
                        Frozen::F32(&weights[l][p])
                    },
                    lora: Some(Lora {
                        a: &factors[l][p].0,
                        b: &factors[l][p].1,
                        r,
                        scale: 2.0,
                    }),
                }),
            })
            .collect()
    };
    let model = |frozen_bf16: bool, compute: Compute| Model {
        dims,
        embed: if frozen_bf16 {
            Frozen::Bf16(&embed16)
        } else {
            Frozen::F32(&embed)
        },
        layers: layers(frozen_bf16),
        norm: &ones,
        lm_head: if frozen_bf16 {
            Frozen::Bf16(&lm_head16)
        } else {
            Frozen::F32(&lm_head)
        },
        cos: &cos,
        sin: &sin,
        local_rope: None,
        compute,
    };
    let (f32_model, bf16_model) = (model(false, Compute::F32), model(true, Compute::F32));
    let bf16_compute_model = model(true, Compute::Bf16);
    let model = &f32_model;
    let ids: Vec<u32> = (0..n).map(|i| (i * 7 % v) as u32).collect();
    let targets: Vec<i64> = (0..n).map(|i| (i * 11 % v) as i64).collect();
    let owned = OwnedBatch::unpacked(ids, targets, rows, len);
    let batch = owned.view();
    let mut grads: Vec<Vec<f32>> = model
        .lora_lengths()
        .into_iter()
        .map(|len| vec![0f32; len])
        .collect();
    let ranks = model.lora_ranks();
    assert_eq!(bf16_model.frozen_bytes() * 2, f32_model.frozen_bytes());
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("a pool");
    let mut run = |model: &Model<'_>, dropout: bool, checkpoint_layers: bool| -> u64 {
        pool.install(|| {
            let mut k = 0u32;
            // Two-valued masks, made on demand: the step holds them, the source does not.
            let mut source = |rows: usize, inputs: usize| -> Vec<f32> {
                k += 1;
                (0..rows * inputs)
                    .map(|i| {
                        if (i as u32 ^ k).is_multiple_of(7) {
                            0.0
                        } else {
                            1.25
                        }
                    })
                    .collect()
            };
            let dropout: Option<MaskSource<'_>> = dropout.then_some(&mut source);
            let options = StepOptions { checkpoint_layers };
            let base = LIVE.load(Ordering::Relaxed);
            PEAK.store(base, Ordering::Relaxed);
            forward_backward_with(model, &batch, 0.01, dropout, &mut grads, options)
                .expect("a step");
            (PEAK.load(Ordering::Relaxed) - base) as u64
        })
    };
    run(model, false, false); // warms the pool and the allocator's bookkeeping
    let mut counts = vec![];
    for (frozen_bf16, model) in [
        (false, &f32_model),
        (true, &bf16_model),
        (true, &bf16_compute_model),
    ] {
        for dropout in [false, true] {
            for checkpoint in [false, true] {
                let counted = step_bytes(
                    &dims,
                    n,
                    &ranks,
                    dropout,
                    checkpoint,
                    frozen_bf16,
                    model.compute,
                );
                let measured = run(model, dropout, checkpoint);
                let extra = measured as f64 / counted as f64 - 1.0;
                eprintln!(
                    "bf16 {frozen_bf16}, {:?} compute, dropout {dropout}, checkpoint \
                     {checkpoint}: step_bytes {counted}, measured peak {measured} ({:+.2} %)",
                    model.compute,
                    100.0 * extra
                );
                // Everything counted is live at the peak; what is not counted is the
                // kernels' small transient scratch.
                assert!(measured >= counted, "{measured} < {counted}");
                assert!(extra < 0.05, "{measured} is more than 5 % over {counted}");
                counts.push(counted);
            }
        }
    }
    // A step without widened weights runs its layers on row groups: two here (512
    // tokens of 4 rows), the second holding one layer's LoRA gradients (r·(in + out) per
    // projection) and a gradient scratch (r × the widest side) during the backward,
    // which is this small model's peak.
    let layer_lora: usize = (0..7)
        .map(|p| {
            let (i, o) = dims.projection_shape(p);
            r * (i + o)
        })
        .sum();
    let grouped = 4 * (layer_lora + r * dims.intermediate) as u64;
    // The bf16 steps hold the widening scratch on top of the f32 ones: the head's
    // vocab × hidden floats here, the largest frozen matrix; and run as one group. (Each
    // step's own peak was checked against its count above; the uncounted packing
    // buffers differ between grouped and ungrouped steps, so peaks are not compared.)
    let widening = 4 * (dims.vocab * dims.hidden) as u64;
    for k in 0..4 {
        let (f32_counted, bf16_counted) = (counts[k], counts[k + 4]);
        assert_eq!(bf16_counted + grouped - f32_counted, widening);
    }
    // bf16 compute adds the rounded activation operand, N × the widest projection side
    // (the intermediate width here): f32 where the operands are widened, bf16 (as bf16
    // pairs for the own AVX512-BF16 kernels) where a bf16 GEMM takes them. The widening
    // scratch stays the head's, except where the own kernels take the head as stored
    // too: then nothing is widened.
    let backend = tuneq_kernels::bf16_backend();
    let widened = backend.ends_with("on widened bf16 operands");
    let rounded = 4
        * (n * if widened {
            dims.intermediate
        } else {
            dims.intermediate.div_ceil(2)
        }) as u64;
    // With nothing widened the bf16-compute step runs on row groups too.
    let (head_unwidened, compute_grouped) = if backend.contains("vdpbf16ps") {
        (widening, grouped)
    } else {
        (0, 0)
    };
    for k in 0..4 {
        let (bf16_counted, compute_counted) = (counts[k + 4], counts[k + 8]);
        assert_eq!(
            compute_counted + head_unwidened,
            bf16_counted + rounded + compute_grouped
        );
    }
    // Placement's figure, for a node whose CPU it does not know, is at least what a step
    // here allocates, and the same where this machine widens the operands too.
    for dropout in [false, true] {
        for checkpoint in [false, true] {
            let here = step_bytes(&dims, n, &ranks, dropout, checkpoint, true, Compute::Bf16);
            let any =
                step_bytes_on_any_cpu(&dims, n, &ranks, dropout, checkpoint, true, Compute::Bf16);
            assert!(any >= here, "{any} < {here}");
            assert!(!widened || any == here, "{any} ≠ {here}");
        }
    }
}
