//! Row groups: the decoder layers of a step run on groups of whole sequences at once,
//! one rayon task per group, instead of one batch-wide call per product and row kernel.
//!
//! Why: a layer is some forty products and row kernels, each its own fork and join
//! across the pool when it runs batch-wide, about 300 a tiny-preset step, and on a
//! shared VM every join waits for the slowest vCPU. Two half batches run side by side
//! on one thread each took 20 % less time than the whole batch on both threads
//! (`llama_step`, tiny, alternated, on a noisy 2-vCPU VM). Sequences are independent
//! through a layer (attention never crosses rows), so a group runs a whole layer
//! without waiting for the others, and the pool joins twice a layer (forward and
//! backward) instead of some forty times. Inside a group the products split over the
//! group's share of the pool. Measured on `tuneq bench train --preset tiny --threads
//! 2`, six alternated pairs: +6 % median tokens/s (−2 to +17 %).
//!
//! **Same bits for any thread count.** How the rows are grouped depends on the batch's
//! shape alone ([`row_groups`]), never on the pool. Each group's LoRA gradients are
//! summed over its own tokens (the first group's straight into the caller's
//! gradients, the others' into a layer's worth of buffers of their own, from zero),
//! and when a layer is done the later groups' are added in group order. The loss, the
//! final norm and the head stay batch-wide. The dropout masks are drawn for the whole
//! batch in the usual order, a layer at a time, and each group takes its rows of them.
//!
//! **Memory:** the groups' scratch and saved state together are the batch's; on top,
//! the loss's normed input when there is more than one group (N × hidden), and one
//! layer's LoRA gradients for every group after the first (see [`super::step_bytes`]).
//! A model that widens bf16 weights for its products runs as one group, so that the
//! widening scratch, the size of the largest weight, is not repeated per group.

use std::ops::Range;

use rayon::prelude::*;

use super::forward::{ForwardWork, Saved};
use super::mask::StoredMask;
use super::validate::expect_len;
use super::{Batch, Model, PROJECTIONS, StepError};

/// At most this many groups, so that the extra gradient buffers stay few.
const MAX_GROUPS: usize = 4;

/// A group holds at least this many tokens (when the batch has them), so that its
/// products keep rows enough to amortise packing the weights.
const MIN_GROUP_TOKENS: usize = 256;

/// The most groups a batch of `tokens` tokens is split into, whatever its rows: one
/// when the step `widens` bf16 weights (its scratch, the size of the largest weight, is
/// not repeated per group).
pub(super) fn max_groups(tokens: usize, widens: bool) -> usize {
    if widens {
        return 1;
    }
    (tokens / MIN_GROUP_TOKENS).clamp(1, MAX_GROUPS)
}

/// The batch's rows in consecutive groups of as equal a size as they divide into:
/// [`max_groups`] of the tokens, and no more groups than rows. A function of the
/// batch's shape (and whether the step widens weights) only, so the arithmetic does not
/// follow the thread count.
pub(super) fn row_groups(rows: usize, len: usize, widens: bool) -> Vec<Range<usize>> {
    let count = max_groups(rows * len, widens).min(rows).max(1);
    let (base, extra) = (rows / count, rows % count);
    let mut first = 0;
    (0..count)
        .map(|g| {
            let size = base + usize::from(g < extra);
            first += size;
            first - size..first
        })
        .collect()
}

/// The rows `rows` of `batch`, as a batch of their own.
pub(super) fn sub_batch<'a>(batch: &Batch<'a>, rows: &Range<usize>) -> Batch<'a> {
    let tokens = rows.start * batch.len..rows.end * batch.len;
    Batch {
        ids: &batch.ids[tokens.clone()],
        rows: rows.len(),
        len: batch.len,
        targets: &batch.targets[tokens.clone()],
        positions: &batch.positions[tokens.clone()],
        starts: &batch.starts[tokens.clone()],
        window_starts: batch.window_starts.map(|w| &w[tokens]),
    }
}

/// `data` (rows of `width` elements, `len` of them per batch row) cut into each
/// group's rows.
pub(super) fn split_rows<'d>(
    mut data: &'d mut [f32],
    groups: &[Range<usize>],
    len: usize,
    width: usize,
) -> Vec<&'d mut [f32]> {
    groups
        .iter()
        .map(|rows| {
            let (head, tail) = std::mem::take(&mut data).split_at_mut(rows.len() * len * width);
            data = tail;
            head
        })
        .collect()
}

/// Runs `body` on every group's item, in parallel when there is more than one (a single
/// group runs on the calling thread, exactly as an ungrouped step).
pub(super) fn for_each<T: Send>(items: Vec<T>, body: impl Fn(T) + Sync + Send) {
    if items.len() == 1 {
        items.into_iter().for_each(body);
    } else {
        // Each group's products split over its share of the pool, not all of it.
        let share = rayon::current_num_threads().div_ceil(items.len());
        items
            .into_par_iter()
            .for_each(|item| crate::gemm::with_share(share, || body(item)));
    }
}

/// Layer `l`'s forward on every group: `x` is the batch's hidden state (N × hidden),
/// `saved` and `works` each group's, in group order.
pub(super) fn layer_forward(
    model: &Model<'_>,
    l: usize,
    batches: &[Batch<'_>],
    groups: &[Range<usize>],
    x: &mut [f32],
    saved: Vec<&mut Saved>,
    works: &mut [ForwardWork],
) {
    let xs = split_rows(x, groups, batches[0].len, model.dims.hidden);
    let items: Vec<_> = batches.iter().zip(xs).zip(saved).zip(works).collect();
    for_each(items, |(((b, x), s), work)| {
        super::forward::layer_forward(model, l, b, x, s, work);
    });
}

/// Draws layer `l`'s dropout masks for the whole batch (`n` tokens), in forward order
/// (q … down, the projections with LoRA), and puts each group's rows of them into its
/// `saved` (one per group, in group order); without dropout, clears them.
///
/// # Errors
/// [`StepError::Length`] when the source returns a mask of the wrong length.
pub(super) fn draw_layer_masks(
    model: &Model<'_>,
    l: usize,
    n: usize,
    dropout: &mut Option<super::MaskSource<'_>>,
    groups: &[Range<usize>],
    len: usize,
    saved: &mut [&mut Saved],
) -> Result<(), StepError> {
    for (p, proj) in model.layers[l].proj.iter().enumerate() {
        let source = dropout.as_mut().filter(|_| proj.lora.is_some());
        let Some(source) = source else {
            saved.iter_mut().for_each(|s| s.masks[p] = None);
            continue;
        };
        let i = model.dims.projection_shape(p).0;
        let mask = source(n, i);
        expect_len(
            || format!("dropout mask of layer {l} {}", PROJECTIONS[p]),
            mask.len(),
            n * i,
        )?;
        if let [only] = saved {
            only.masks[p] = Some(mask);
            continue;
        }
        for (s, rows) in saved.iter_mut().zip(groups) {
            let part = &mask[rows.start * len * i..rows.end * len * i];
            let mut own = s.masks[p].take().unwrap_or_default();
            own.clear();
            own.extend_from_slice(part);
            s.masks[p] = Some(own);
        }
    }
    Ok(())
}

/// A checkpointed layer's masks, as its forward drew them, per projection.
pub(super) type KeptMasks = [Option<StoredMask>; 7];

/// Packs the masks in `saved` for the layer's recomputation.
pub(super) fn keep_masks(saved: &Saved) -> KeptMasks {
    std::array::from_fn(|p| saved.masks[p].as_deref().map(StoredMask::pack))
}

/// Puts masks kept by [`keep_masks`] back into `saved`.
pub(super) fn restore_masks(kept: &KeptMasks, saved: &mut Saved) {
    for (p, kept) in kept.iter().enumerate() {
        saved.masks[p] = kept.as_ref().map(|m| {
            let mut buf = saved.masks[p].take().unwrap_or_default();
            m.unpack_into(&mut buf);
            buf
        });
    }
}

/// The indices of a layer's LoRA gradients in the step's gradient list, given its
/// [`gradient slots`](super::gradient_slots) (A at the slot, B right after).
pub(super) fn layer_gradients(slots: &[Option<usize>; 7]) -> impl Iterator<Item = usize> + Clone {
    slots.iter().flatten().flat_map(|&s| [s, s + 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_follow_the_batch_shape_only() {
        // Tokens per group at least 256, at most four groups, no more than the rows.
        assert_eq!(row_groups(4, 256, false), vec![0..1, 1..2, 2..3, 3..4]);
        assert_eq!(row_groups(1, 2048, false), vec![0..1]);
        assert_eq!(row_groups(8, 64, false), vec![0..4, 4..8]);
        assert_eq!(row_groups(7, 512, false), vec![0..2, 2..4, 4..6, 6..7]);
        assert_eq!(row_groups(3, 100, false), vec![0..3]);
        assert_eq!(row_groups(0, 256, false), vec![0..0]);
        assert!(max_groups(4 * 256, false) >= row_groups(4, 256, false).len());
        // A widening step is one group.
        assert_eq!(row_groups(4, 256, true), vec![0..4]);
    }

    #[test]
    fn rows_split_into_the_groups_rows() {
        let mut data: Vec<f32> = (0..7 * 2 * 3).map(|v| v as f32).collect();
        let groups = row_groups(7, 512, false);
        let parts = split_rows(&mut data, &groups, 2, 3);
        let lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
        assert_eq!(lens, vec![12, 12, 12, 6]);
        assert_eq!(parts[3][0], 36.0);
    }
}
