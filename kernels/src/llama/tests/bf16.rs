//! Frozen weights stored as bf16: widening is exact, so a step on bf16 storage must give
//! the bits of the same step on the f32 widening of those values.

use super::super::frozen::{widen, widen_one};
use super::*;
use half::bf16;

/// Which frozen matrices a view lends as bf16 (the others as their f32 widening).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Storage {
    F32,
    Bf16,
    ProjectionsOnly,
    EmbedAndHeadOnly,
}

/// An [`Owned`] model whose frozen matrices are rounded to bf16: `m` holds their f32
/// widening, the other fields the bf16 values themselves.
struct Rounded {
    m: Owned,
    embed: Vec<bf16>,
    lm_head: Vec<bf16>,
    weights: Vec<[Vec<bf16>; 7]>,
    /// The head is the embedding (one slice lent for both).
    tied: bool,
}

/// Rounds `v` to bf16 in place (to nearest, ties to even) and returns the bf16 values.
fn round(v: &mut [f32]) -> Vec<bf16> {
    let b: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
    for (x, &b) in v.iter_mut().zip(&b) {
        *x = b.to_f32();
    }
    b
}

impl Rounded {
    fn new(mut m: Owned, tied: bool) -> Self {
        if tied {
            m.lm_head = m.embed.clone();
        }
        let embed = round(&mut m.embed);
        let lm_head = round(&mut m.lm_head);
        let weights = m
            .weights
            .iter_mut()
            .map(|w| std::array::from_fn(|p| round(&mut w[p])))
            .collect();
        Self {
            m,
            embed,
            lm_head,
            weights,
            tied,
        }
    }

    fn view(&self, storage: Storage) -> Model<'_> {
        let mut model = self.m.view();
        let (proj, top) = match storage {
            Storage::F32 => (false, false),
            Storage::Bf16 => (true, true),
            Storage::ProjectionsOnly => (true, false),
            Storage::EmbedAndHeadOnly => (false, true),
        };
        if top {
            model.embed = Frozen::Bf16(&self.embed);
            model.lm_head = Frozen::Bf16(&self.lm_head);
        }
        if self.tied {
            model.lm_head = model.embed;
        }
        if proj {
            for (layer, w) in model.layers.iter_mut().zip(&self.weights) {
                for (p, proj) in layer.proj.iter_mut().enumerate() {
                    proj.weight = Frozen::Bf16(&w[p]);
                }
            }
        }
        model
    }
}

/// GQA models with LoRA on all seven, on q and v, and only above layer 0; untied and
/// tied (the head is the embedding's slice); every frozen matrix in bf16, only the
/// projections, only the embedding and head: the losses (training and evaluation) and
/// the gradients are the bits of the f32 widening, without and with checkpointing,
/// without and with dropout.
#[test]
fn bf16_weights_give_the_same_bits_as_their_f32_widening() {
    let three = Dims {
        layers: 3,
        ..tiny_dims()
    };
    let upper = [NONE, [false, true, false, true, false, false, true], ALL];
    let models = [
        (tiny_dims(), &[ALL][..], 2, 60),
        (tiny_dims(), &[QV][..], 2, 61),
        (three, &upper[..], 3, 62),
    ];
    for (k, &(dims, targets, r, seed)) in models.iter().enumerate() {
        for tied in [false, true] {
            let rounded = Rounded::new(Owned::random(dims, targets, r, seed), tied);
            let m = &rounded.m;
            let (b1, b2) = (
                tiny_batch(m.dims.vocab, seed + 1),
                tiny_batch(m.dims.vocab, seed + 2),
            );
            let n = b1.rows * b1.len;
            let drawn = [
                dropout_masks(m, n, 0.3, seed + 3),
                dropout_masks(m, n, 0.3, seed + 4),
            ];
            let f32_view = rounded.view(Storage::F32);
            for masks in [&[][..], &drawn[..]] {
                for checkpoint in [false, true] {
                    let want = step_bits(&f32_view, &[&b1, &b2], masks, 1, checkpoint);
                    for storage in [
                        Storage::Bf16,
                        Storage::ProjectionsOnly,
                        Storage::EmbedAndHeadOnly,
                    ] {
                        let got =
                            step_bits(&rounded.view(storage), &[&b1, &b2], masks, 1, checkpoint);
                        assert!(
                            got == want,
                            "model {k}, tied {tied}, {storage:?}, {} masks, checkpoint \
                             {checkpoint}: bf16 storage changed the bits",
                            masks.len()
                        );
                    }
                }
            }
        }
    }
}

/// The bf16 path's bits on 1 and 3 threads are the same, and those of the f32
/// widening, on a model large enough that the GEMMs and attention split into blocks.
#[test]
fn bf16_results_do_not_depend_on_the_thread_count() {
    let (m, b) = larger_case();
    let masks = [dropout_masks(&m, b.rows * b.len, 0.1, 63)];
    for tied in [false, true] {
        // The same model again, rounded.
        let rounded = Rounded::new(larger_case().0, tied);
        let bf16 = rounded.view(Storage::Bf16);
        for masks in [&[][..], &masks[..]] {
            for checkpoint in [false, true] {
                let one = step_bits(&bf16, &[&b], masks, 1, checkpoint);
                assert!(
                    one == step_bits(&bf16, &[&b], masks, 3, checkpoint),
                    "1 vs 3 threads"
                );
                let f32 = step_bits(&rounded.view(Storage::F32), &[&b], masks, 3, checkpoint);
                assert!(one == f32, "bf16 vs its f32 widening");
            }
        }
    }
}

/// Widening is exact on every bf16 bit pattern: the f32 whose top half it is
/// (subnormals, ±0, ±∞ and every NaN payload kept), which is `half`'s `to_f32` for
/// every non-NaN; across the parallel split (several chunks and a ragged tail), and
/// through `Frozen`'s whole-matrix and row paths.
#[test]
fn widening_is_exact_on_every_bit_pattern() {
    let all: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
    let src: Vec<bf16> = all
        .iter()
        .cycle()
        .take(3 * all.len() + 17)
        .copied()
        .collect();
    let mut out = vec![f32::NAN; src.len()];
    widen(&src, &mut out);
    for (&b, &f) in src.iter().zip(&out) {
        let bits = b.to_bits();
        assert_eq!(f.to_bits(), u32::from(bits) << 16, "{bits:#06x}");
        if b.is_nan() {
            assert!(f.is_nan(), "{bits:#06x}");
        } else {
            assert_eq!(f.to_bits(), b.to_f32().to_bits(), "{bits:#06x}");
        }
    }
    let edges = [
        (0x0001, 2f32.powi(-133)),                      // the smallest subnormal
        (0x807f, -(2f32.powi(-126) - 2f32.powi(-133))), // the largest negative subnormal
        (0x0080, f32::MIN_POSITIVE),
        (0x7f7f, 3.389_531_4e38), // the largest finite
        (0x7f80, f32::INFINITY),
        (0xff80, f32::NEG_INFINITY),
        (0x3f80, 1.0),
        (0x0000, 0.0),
    ];
    for (bits, want) in edges {
        assert_eq!(widen_one(bf16::from_bits(bits)).to_bits(), want.to_bits());
    }
    let neg_zero = widen_one(bf16::from_bits(0x8000));
    assert!(neg_zero == 0.0 && neg_zero.is_sign_negative());
    // A signalling NaN keeps its payload (half's to_f32 would set the quiet bit).
    for bits in [0x7f81, 0xff81, 0x7fc1, 0xffff] {
        let f = widen_one(bf16::from_bits(bits));
        assert!(f.is_nan());
        assert_eq!(f.to_bits(), u32::from(bits) << 16);
    }
    let frozen = Frozen::Bf16(&src);
    let mut scratch = vec![0f32; src.len() + 5];
    assert_eq!(
        frozen
            .as_f32(&mut scratch)
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>(),
        out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    let mut row = vec![0f32; 100];
    frozen.copy_to(65_500, &mut row);
    assert!(
        row.iter()
            .zip(&out[65_500..])
            .all(|(a, b)| a.to_bits() == b.to_bits())
    );
}

/// What the frozen matrices take as stored, and what the widening scratch adds to a
/// step by [`step_bytes`].
#[test]
fn bf16_storage_halves_the_frozen_bytes() {
    let rounded = Rounded::new(Owned::random(tiny_dims(), &[ALL], 2, 64), false);
    let f32_bytes = rounded.view(Storage::F32).frozen_bytes();
    assert_eq!(rounded.view(Storage::Bf16).frozen_bytes() * 2, f32_bytes);
    let d = tiny_dims();
    let matrices = 2 * d.vocab * d.hidden
        + d.layers
            * (0..7)
                .map(|p| d.projection_shape(p))
                .map(|(i, o)| i * o)
                .sum::<usize>();
    assert_eq!(f32_bytes, 4 * matrices as u64);
    // A tied head is the embedding's storage: counted once.
    let tied = Rounded::new(Owned::random(tiny_dims(), &[ALL], 2, 64), true);
    let tied_bytes = tied.view(Storage::Bf16).frozen_bytes();
    assert_eq!(tied_bytes, 2 * (matrices - d.vocab * d.hidden) as u64);
    // At 7B the scratch is the head's f32 widening, 4·32000·4096 bytes, in one group.
    let llama7b = llama7b();
    let ranks = vec![[8; 7]; 32];
    for (dropout, checkpoint) in [(false, false), (true, true)] {
        let f32 = step_bytes(
            &llama7b,
            2048,
            &ranks,
            dropout,
            checkpoint,
            false,
            Compute::F32,
        );
        let bf16 = step_bytes(
            &llama7b,
            2048,
            &ranks,
            dropout,
            checkpoint,
            true,
            Compute::F32,
        );
        // Less what the f32 step's row groups hold that the one-group bf16 step does
        // not: three later groups' LoRA gradients of one layer and gradient scratch.
        let layer_lora = 4 * 8 * (4096 + 4096) + 3 * 8 * (4096 + 11008);
        let grouped = 4 * 3 * (layer_lora + 8 * 11008);
        assert_eq!(bf16 - f32, 4 * 32000 * 4096 - grouped);
    }
    // When a projection is the largest matrix, it sets the scratch.
    let wide = Dims {
        vocab: 10,
        ..tiny_dims()
    };
    let (ranks, i) = (vec![[2; 7]; 2], wide.intermediate * wide.hidden);
    assert_eq!(
        step_bytes(&wide, 50, &ranks, false, false, true, Compute::F32)
            - step_bytes(&wide, 50, &ranks, false, false, false, Compute::F32),
        4 * i as u64
    );
}
