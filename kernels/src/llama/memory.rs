//! How much memory a step holds: the lengths the step allocates its buffers with, and
//! [`step_bytes`], which adds them up for a node's budget.

use super::forward::saved_lengths;
use super::mask::packed_mask_bytes;
use super::{Compute, Dims};

/// The widest projection input, for the masked-input scratch.
pub(super) fn widest_input(d: &Dims) -> usize {
    (0..7).map(|p| d.projection_shape(p).0).max().unwrap_or(0)
}

/// The widest side (input or output) of any projection: the rounded operand of a
/// bf16-compute product is N × this at most (`x` forward, `dY` backward).
pub(super) fn widest_side(d: &Dims) -> usize {
    (0..7)
        .map(|p| {
            let (i, o) = d.projection_shape(p);
            i.max(o)
        })
        .max()
        .unwrap_or(0)
}

/// The length of the widening scratch: the largest of the bf16 frozen matrices a step
/// widens whole, the head (`vocab × hidden`) when `head_bf16` and each projection `p` of
/// `bf16_projections` (`out × in`); 0 when there are none, so an all-f32 model
/// allocates nothing for it. The embedding is widened row by row into the hidden state
/// and needs none.
pub(super) fn widening_len(
    d: &Dims,
    head_bf16: bool,
    bf16_projections: impl IntoIterator<Item = usize>,
) -> usize {
    let head = if head_bf16 { d.vocab * d.hidden } else { 0 };
    bf16_projections
        .into_iter()
        .map(|p| {
            let (i, o) = d.projection_shape(p);
            i * o
        })
        .fold(head, usize::max)
}

/// The lengths of the forward scratch ([`ForwardWork`](super::forward::ForwardWork)'s `hn`, `act`, `xd`).
pub(super) fn forward_work_lengths(d: &Dims, n: usize, dropout: bool) -> [usize; 3] {
    let masked = if dropout { n * widest_input(d) } else { 0 };
    [n * d.hidden, n * d.intermediate, masked]
}

/// The lengths of the buffers only the backward allocates: `dx`, then
/// [`BackwardWork`](super::backward::BackwardWork)'s `d_act`, `d_gu`, `d_attn`, `d_qkv`, then [`LoraWork`](super::backward::LoraWork)'s `du`,
/// `tmp` and `grad` (its `xd` is the forward's). `ranks`: per layer and projection.
pub(super) fn backward_lengths(
    d: &Dims,
    n: usize,
    ranks: &[[usize; 7]],
    dropout: bool,
) -> [usize; 8] {
    let (mut rank, mut grad) = (0, 0);
    for layer in ranks {
        for (p, &r) in layer.iter().enumerate() {
            if r > 0 {
                let (i, o) = d.projection_shape(p);
                rank = rank.max(r);
                grad = grad.max(r * i.max(o));
            }
        }
    }
    let masked = if dropout { n * widest_input(d) } else { 0 };
    [
        n * d.hidden,
        n * d.intermediate,
        n * 2 * d.intermediate,
        n * d.heads * d.head_dim,
        n * d.qkv_width(),
        n * rank,
        masked,
        grad,
    ]
}

/// The elements of a layer's LoRA factors (A: r × in, B: out × r, per projection of
/// rank `ranks[p]`), and so of their gradients.
fn lora_len(d: &Dims, ranks: &[usize; 7]) -> usize {
    (0..7)
        .map(|p| {
            let (i, o) = d.projection_shape(p);
            ranks[p] * (i + o)
        })
        .sum()
}

/// Per projection, the largest rank over the layers (a shared [`Saved`](super::forward::Saved)'s `u` sizes).
pub(super) fn max_ranks(ranks: &[[usize; 7]]) -> [usize; 7] {
    let mut top = [0; 7];
    for layer in ranks {
        for (t, &r) in top.iter_mut().zip(layer) {
            *t = (*t).max(r);
        }
    }
    top
}

/// The most bytes [`forward_backward_with`](super::forward_backward_with) holds at once for a micro-batch of `tokens`
/// tokens (rows × len), every one labelled (fewer labels only shrink the loss's chunk
/// buffers), with LoRA ranks `ranks` (per layer, per projection in [`PROJECTIONS`](super::PROJECTIONS)
/// order, 0 for none; see [`Model::lora_ranks`](super::Model::lora_ranks)), with or without dropout and
/// checkpointing. For choosing checkpointing and a micro-batch size against the memory
/// of a node.
///
/// Counted: the hidden state, the saved forward state (every layer's, or with
/// checkpointing the layer inputs, the packed masks and one layer's state), the
/// forward scratch, the final norm's state and the hidden-state gradient, and then the
/// larger of the loss's chunk buffers and the backward scratch (the two are never
/// alive together), all from the same length helpers the step allocates with. The
/// step's row groups add the loss's own normed input (N × hidden) and, per group after
/// the first, one layer's LoRA gradients and a gradient scratch; counted for as many
/// groups as `tokens` can make, an upper bound when the batch has fewer rows. Not
/// counted: the model and the gradients (the caller's), and the kernels' transient
/// buffers: attention's task lists (48 bytes per token and kv head in the backward),
/// its scratch of about `(4·head_dim + 128)·seq` floats per running thread, and the GEMM
/// library's packing (1–3 % of the total in `tests/step_bytes.rs`; more with long rows
/// on many threads). With dropout, masks the source draws as anything but `0` and one
/// keep value are kept whole rather than packed, and are not counted that way here.
/// With checkpointing and layers of different LoRA shapes, the one-layer terms take
/// the largest layer's, so the figure is then an upper bound.
///
/// `frozen_bf16`: the projections and the head are stored as bf16 ([`Frozen::Bf16`](super::Frozen::Bf16)),
/// which adds the one f32 scratch they are widened into, live for the whole step:
/// `4·max(vocab·hidden, largest projection)` bytes (0.5 GiB at 7B, against the 13.5
/// GiB bf16 saves). A model with only some of them in bf16 needs at most that; the
/// embedding's storage costs nothing here either way.
///
/// `compute`: [`Compute::Bf16`] adds the rounded activation operand, `4·N·widest side`
/// bytes (2 on a oneMKL build with bf16 weights, whose bf16 GEMM takes it as bf16 and
/// the weights as stored), and, for f32-stored projections, the scratch they are
/// rounded into. The crate's own bf16 kernels, on a CPU with AVX512-BF16, need as
/// little as oneMKL: counted when this machine has them ([`step_bytes_on_any_cpu`]
/// counts the widened operands wherever oneMKL does not take them).
pub fn step_bytes(
    dims: &Dims,
    tokens: usize,
    ranks: &[[usize; 7]],
    dropout: bool,
    checkpoint_layers: bool,
    frozen_bf16: bool,
    compute: Compute,
) -> u64 {
    let bf16_gemm = super::frozen::uses_bf16_gemm(compute, frozen_bf16);
    let head_as_stored = super::frozen::head_as_stored(compute, frozen_bf16);
    let step = (dims, tokens, ranks, dropout, checkpoint_layers);
    step_bytes_with(step, frozen_bf16, compute, (bf16_gemm, head_as_stored))
}

/// [`step_bytes`] on whichever x86 or Arm CPU the step will run: in bf16 compute, the
/// widened operands unless this is a oneMKL build, since only some CPUs have the own
/// bf16 kernels. An upper bound by at most `4·max(largest projection, head) + 2·N·widest
/// side` bytes where the node's CPU has them. What placement counts, as it does not know the
/// node's CPU.
pub fn step_bytes_on_any_cpu(
    dims: &Dims,
    tokens: usize,
    ranks: &[[usize; 7]],
    dropout: bool,
    checkpoint_layers: bool,
    frozen_bf16: bool,
    compute: Compute,
) -> u64 {
    let bf16_gemm = super::frozen::uses_mkl_bf16(compute, frozen_bf16);
    let step = (dims, tokens, ranks, dropout, checkpoint_layers);
    step_bytes_with(step, frozen_bf16, compute, (bf16_gemm, false))
}

/// [`step_bytes`] for a step whose bf16 products, in bf16 compute, take the weights as
/// stored and the operand as bf16 (`bf16_gemm`) or widen both, and whose head the own
/// bf16 kernels take as stored (`head_as_stored`) or not.
fn step_bytes_with(
    (dims, tokens, ranks, dropout, checkpoint_layers): (&Dims, usize, &[[usize; 7]], bool, bool),
    frozen_bf16: bool,
    compute: Compute,
    (bf16_gemm, head_as_stored): (bool, bool),
) -> u64 {
    let (d, n) = (dims, tokens);
    if n == 0 {
        return 0;
    }
    let f32s = |len: usize| 4 * len as u64;
    let mask_len = |p: usize| n * d.projection_shape(p).0;
    let masks = |layer: &[usize; 7]| -> usize {
        (0..7)
            .filter(|&p| dropout && layer[p] > 0)
            .map(mask_len)
            .sum()
    };
    let saved = |r: &[usize; 7]| -> usize {
        saved_lengths(d, n).iter().sum::<usize>() + r.iter().map(|r| n * r).sum::<usize>()
    };
    let lowest = ranks.iter().position(|r| r.iter().any(|&r| r > 0));
    let state = if checkpoint_layers {
        let kept = &ranks[lowest.unwrap_or(ranks.len())..];
        let one_layer = saved(&max_ranks(ranks)) + ranks.iter().map(masks).max().unwrap_or(0);
        let packed: u64 = kept
            .iter()
            .flat_map(|layer| (0..7).filter(|&p| dropout && layer[p] > 0))
            .map(|p| packed_mask_bytes(mask_len(p)))
            .sum();
        f32s(one_layer + kept.len() * n * d.hidden) + packed
    } else {
        ranks.iter().map(|r| f32s(saved(r) + masks(r))).sum()
    };
    // x, the forward scratch, the final norm's 1/rms and the hidden-state gradient.
    let forward: usize = forward_work_lengths(d, n, dropout).iter().sum();
    let projections = if bf16_gemm { 0..0 } else { 0..7 };
    let widening = match (frozen_bf16, compute) {
        (true, Compute::F32) => widening_len(d, true, projections),
        // The head: widened, or rounded from f32, unless taken as stored.
        (_, Compute::Bf16) => widening_len(d, !head_as_stored, projections),
        (false, Compute::F32) => 0,
    };
    let rounded = match compute {
        Compute::F32 => 0,
        // As bf16 (oneMKL) or bf16 pairs (the own kernels, `⌈widest/2⌉` per row).
        Compute::Bf16 if bf16_gemm => 4 * (n * widest_side(d).div_ceil(2)) as u64,
        Compute::Bf16 => 4 * (n * widest_side(d)) as u64,
    };
    let common = state + f32s(n * d.hidden + forward + widening + n + n * d.hidden) + rounded;
    // Row groups (see `groups`). With more than one, the loss's normed input is its own,
    // and every later group holds one layer's LoRA gradients and its own gradient
    // scratch during the backward.
    let later = super::groups::max_groups(n, widening > 0) - 1;
    let ce = crate::loss::scratch_bytes(d.hidden, d.vocab, n, true)
        + if later > 0 { f32s(n * d.hidden) } else { 0 };
    let backward = match lowest {
        Some(_) => {
            let lengths = backward_lengths(d, n, ranks, dropout);
            let layer_gradients = ranks.iter().map(|r| lora_len(d, r)).max().unwrap_or(0);
            f32s(lengths.iter().sum::<usize>() + later * (layer_gradients + lengths[7]))
        }
        None => 0,
    };
    common + ce.max(backward)
}
