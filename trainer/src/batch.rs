//! Turning tokenised examples into padded micro-batches, in a replayable order.
//!
//! The order of examples depends only on the seed and the epoch (a ChaCha20 stream per
//! epoch), so a resumed run knows exactly which batch comes next from the step number.

use crate::data::Example;
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha20Rng;

/// RNG stream numbers: one namespace per purpose so draws never overlap.
pub mod streams {
    /// LoRA A initialisation.
    pub const LORA_INIT: u64 = 0;
    /// Shuffling, plus the epoch number.
    pub const SHUFFLE: u64 = 1 << 32;
    /// Dropout, plus the optimiser step.
    pub const DROPOUT: u64 = 2 << 32;
}

/// A ChaCha20 generator for `seed` on `stream`.
pub fn rng_for(seed: u64, stream: u64) -> ChaCha20Rng {
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    rng.set_stream(stream);
    rng
}

/// The order examples are visited in during `epoch`.
pub fn epoch_order(n: usize, seed: u64, epoch: u32) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(&mut rng_for(seed, streams::SHUFFLE + epoch as u64));
    order
}

/// A right-padded micro-batch with next-token targets.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Token ids, row-major (rows × len).
    pub ids: Vec<u32>,
    /// Rows.
    pub rows: usize,
    /// Padded length.
    pub len: usize,
    /// Target for each position: the label of the next token, or −100.
    pub targets: Vec<i64>,
    /// Positions that are real tokens (not padding).
    pub tokens: usize,
    /// Positions that carry a loss.
    pub labelled: usize,
    /// Where several examples share a row (see [`pack_batch`]); `None` for one example
    /// per row from position 0.
    pub packing: Option<Packing>,
}

impl Batch {
    /// A batch whose labelled count is read from its targets.
    fn counted(
        ids: Vec<u32>,
        rows: usize,
        len: usize,
        targets: Vec<i64>,
        tokens: usize,
        packing: Option<Packing>,
    ) -> Batch {
        let labelled = targets.iter().filter(|&&t| t >= 0).count();
        Batch {
            ids,
            rows,
            len,
            targets,
            tokens,
            labelled,
            packing,
        }
    }
}

/// The length of the longest example, at least 1: a batch's row length.
fn longest(examples: &[&Example]) -> usize {
    examples
        .iter()
        .map(|e| e.input_ids.len())
        .max()
        .unwrap_or(0)
        .max(1)
}

/// The layout of a packed batch, one entry per position: its position within its own
/// example (RoPE restarts at 0), and the index in the row where its example starts, so
/// attention sees only its own example (a block-diagonal causal mask).
#[derive(Debug, Clone, PartialEq)]
pub struct Packing {
    /// Position of each token within its example.
    pub positions: Vec<u32>,
    /// Row index of the first token of each token's example.
    pub starts: Vec<u32>,
}

/// The denominator of a step's mean loss over `batches` (its micro-batches): their
/// labelled tokens, at least one.
pub fn labelled_denominator(batches: &[Batch]) -> f64 {
    batches.iter().map(|b| b.labelled).sum::<usize>().max(1) as f64
}

/// Pads `examples` to the longest and shifts labels by one (position i predicts i+1).
/// Right padding keeps real tokens at the same positions, so the causal mask alone
/// keeps padding out of every real token's attention.
pub fn make_batch(examples: &[&Example], pad_id: u32) -> Batch {
    let rows = examples.len();
    let len = longest(examples);
    let mut ids = vec![pad_id; rows * len];
    let mut targets = vec![-100i64; rows * len];
    let mut tokens = 0;
    for (r, e) in examples.iter().enumerate() {
        ids[r * len..r * len + e.input_ids.len()].copy_from_slice(&e.input_ids);
        tokens += e.input_ids.len();
        for i in 0..e.input_ids.len().saturating_sub(1) {
            targets[r * len + i] = e.labels[i + 1];
        }
    }
    Batch::counted(ids, rows, len, targets, tokens, None)
}

/// The same micro-batch as [`make_batch`] with the padding squeezed out: examples, in
/// order, are laid end to end into the first row with room for them (rows as long as the
/// longest example), each with its own positions and attention block. The examples, the
/// targets of every real token and the labelled count are those of the padded batch, so
/// the loss and gradients are the same up to rounding; only rows of padding disappear.
/// Only the fused CPU path reads [`Packing`].
pub fn pack_batch(examples: &[&Example], pad_id: u32) -> Batch {
    let len = longest(examples);
    // First fit, in order: row r holds `fill[r]` tokens so far.
    let mut fill: Vec<usize> = Vec::new();
    let mut placed = Vec::with_capacity(examples.len());
    for e in examples {
        let n = e.input_ids.len();
        let row = match fill.iter().position(|&used| used + n <= len) {
            Some(row) => row,
            None => {
                fill.push(0);
                fill.len() - 1
            }
        };
        placed.push((row, fill[row]));
        fill[row] += n;
    }
    let rows = fill.len().max(1);
    let mut ids = vec![pad_id; rows * len];
    let mut targets = vec![-100i64; rows * len];
    let mut positions: Vec<u32> = (0..rows * len).map(|k| (k % len) as u32).collect();
    let mut starts: Vec<u32> = (0..rows * len).map(|k| (k % len) as u32).collect();
    let mut tokens = 0;
    for (e, &(row, at)) in examples.iter().zip(&placed) {
        let base = row * len + at;
        let n = e.input_ids.len();
        ids[base..base + n].copy_from_slice(&e.input_ids);
        tokens += n;
        for i in 0..n {
            positions[base + i] = i as u32;
            starts[base + i] = at as u32;
            if i + 1 < n {
                targets[base + i] = e.labels[i + 1];
            }
        }
    }
    // Padding after the last example of a row sees only itself.
    for (row, &used) in fill.iter().enumerate() {
        for k in used..len {
            positions[row * len + k] = 0;
        }
    }
    let packing = Some(Packing { positions, starts });
    Batch::counted(ids, rows, len, targets, tokens, packing)
}

/// A batch of full rows with every next token as a target (`labels = input_ids`, the
/// Hugging Face causal-LM convention): for benchmarks and the PyTorch cross-checks.
pub fn lm_batch(ids: Vec<u32>, rows: usize, len: usize) -> Batch {
    let targets = (0..rows * len)
        .map(|k| {
            if k % len + 1 < len {
                ids[k + 1] as i64
            } else {
                -100
            }
        })
        .collect();
    Batch {
        ids,
        rows,
        len,
        targets,
        tokens: rows * len,
        labelled: rows * len.saturating_sub(1),
        packing: None,
    }
}

/// A batch from token ids and Hugging Face style labels (unshifted, −100 where no loss),
/// both `rows × len`: position i is trained to predict `labels[i + 1]`. `attention`
/// marks real tokens (1) and right padding (0).
pub fn labelled_batch(
    ids: Vec<u32>,
    labels: &[i64],
    attention: &[i64],
    rows: usize,
    len: usize,
) -> Batch {
    let targets: Vec<i64> = (0..rows * len)
        .map(|k| {
            if k % len + 1 < len && labels[k + 1] >= 0 {
                labels[k + 1]
            } else {
                -100
            }
        })
        .collect();
    let tokens = attention.iter().filter(|&&a| a != 0).count();
    Batch::counted(ids, rows, len, targets, tokens, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_pad_right_and_shift_labels() {
        let a = Example {
            input_ids: vec![1, 2, 3],
            labels: vec![-100, 2, 3],
        };
        let b = Example {
            input_ids: vec![4, 5],
            labels: vec![-100, 5],
        };
        let batch = make_batch(&[&a, &b], 0);
        assert_eq!(batch.ids, vec![1, 2, 3, 4, 5, 0]);
        assert_eq!(batch.targets, vec![2, 3, -100, 5, -100, -100]);
        assert_eq!((batch.tokens, batch.labelled), (5, 3));
    }

    #[test]
    fn packing_keeps_every_target_and_drops_only_padding() {
        let ex = |ids: &[u32]| Example {
            input_ids: ids.to_vec(),
            labels: ids.iter().map(|&t| t as i64).collect(),
        };
        let (a, b, c) = (ex(&[1, 2, 3, 4]), ex(&[5, 6]), ex(&[7, 8]));
        let packed = pack_batch(&[&a, &b, &c], 0);
        let padded = make_batch(&[&a, &b, &c], 0);
        assert_eq!(
            (packed.rows, packed.len),
            (2, 4),
            "b and c share the second row"
        );
        assert_eq!(packed.ids, vec![1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(packed.targets, vec![2, 3, 4, -100, 6, -100, 8, -100]);
        let layout = packed.packing.as_ref().expect("packed");
        assert_eq!(layout.positions, vec![0, 1, 2, 3, 0, 1, 0, 1]);
        assert_eq!(layout.starts, vec![0, 0, 0, 0, 0, 0, 2, 2]);
        assert_eq!(
            (packed.tokens, packed.labelled),
            (padded.tokens, padded.labelled)
        );
        let mut want: Vec<i64> = padded.targets.iter().copied().filter(|&t| t >= 0).collect();
        let mut got: Vec<i64> = packed.targets.iter().copied().filter(|&t| t >= 0).collect();
        want.sort();
        got.sort();
        assert_eq!(got, want);
    }

    #[test]
    fn epoch_order_is_a_replayable_permutation() {
        let o = epoch_order(50, 7, 1);
        assert_eq!(o, epoch_order(50, 7, 1));
        assert_ne!(o, epoch_order(50, 7, 2));
        let mut s = o.clone();
        s.sort();
        assert_eq!(s, (0..50).collect::<Vec<_>>());
    }
}
