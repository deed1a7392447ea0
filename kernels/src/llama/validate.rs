//! Checking a step's inputs before anything is computed: the model's shapes, the
//! batch's ids, targets, positions and segment starts, and the gradient buffers.

use super::{Batch, Dims, Model, PROJECTIONS};
use crate::loss::LossError;

/// Why a step refused its inputs. Nothing is added to the gradients when it does.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StepError {
    /// The architecture is inconsistent.
    #[error("invalid dimensions: {0}")]
    Dims(String),
    /// A buffer's length does not match the dimensions.
    #[error("{what} holds {len} elements where {expected} were expected")]
    Length {
        /// Which buffer.
        what: String,
        /// Its length.
        len: usize,
        /// The length the dimensions imply.
        expected: usize,
    },
    /// A token id is not a row of the embedding.
    #[error("token {id} at index {index} is outside the vocabulary of {vocab}")]
    TokenOutOfVocabulary {
        /// Index in the flattened batch.
        index: usize,
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A target id is not a row of the head.
    #[error("target {target} at index {index} is outside the vocabulary of {vocab}")]
    TargetOutOfVocabulary {
        /// Index in the flattened batch.
        index: usize,
        /// The target.
        target: i64,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A position is past the RoPE tables.
    #[error("position {position} at index {index} is past the RoPE tables' {max_pos} positions")]
    PositionOutOfRange {
        /// Index in the flattened batch.
        index: usize,
        /// The position.
        position: u32,
        /// Positions in the tables.
        max_pos: usize,
    },
    /// A token's segment starts after the token.
    #[error("token {index} (column {column} of its row) starts its segment at {start}")]
    SegmentStart {
        /// Index in the flattened batch.
        index: usize,
        /// Its column in its row.
        column: usize,
        /// The start given.
        start: u32,
    },
    /// The gradient list does not hold one buffer per LoRA tensor.
    #[error("{got} gradient buffers for {expected} LoRA tensors")]
    GradientCount {
        /// Buffers given.
        got: usize,
        /// LoRA tensors in the model.
        expected: usize,
    },
    /// The loss refused its inputs (not expected after the checks above).
    #[error(transparent)]
    Loss(#[from] LossError),
}

/// `Ok` when buffer `what` holds the `expected` length.
pub(super) fn expect_len(
    what: impl FnOnce() -> String,
    len: usize,
    expected: usize,
) -> Result<(), StepError> {
    if len == expected {
        Ok(())
    } else {
        Err(StepError::Length {
            what: what(),
            len,
            expected,
        })
    }
}

/// Checks the model's and the batch's shapes and contents.
pub(super) fn validate(model: &Model<'_>, batch: &Batch<'_>) -> Result<(), StepError> {
    let d = &model.dims;
    check_dims(d)?;
    let (v, h) = (d.vocab, d.hidden);
    expect_len(|| "embed".into(), model.embed.len(), v * h)?;
    expect_len(|| "lm_head".into(), model.lm_head.len(), v * h)?;
    expect_len(|| "norm".into(), model.norm.len(), h)?;
    expect_len(|| "layers".into(), model.layers.len(), d.layers)?;
    check_layers(model)?;
    let max_pos = rope_positions(model)?;
    check_batch(batch, v, max_pos)
}

/// The architecture is consistent: non-empty widths, query heads grouped over the kv
/// heads, an even head width.
fn check_dims(d: &Dims) -> Result<(), StepError> {
    let bad = |m: String| Err(StepError::Dims(m));
    if d.vocab == 0 || d.hidden == 0 || d.intermediate == 0 {
        return bad(format!(
            "{d:?} has an empty vocabulary, hidden or intermediate width"
        ));
    }
    if d.heads == 0 || d.kv_heads == 0 || !d.heads.is_multiple_of(d.kv_heads) {
        return bad(format!(
            "{} query heads cannot be grouped over {} kv heads",
            d.heads, d.kv_heads
        ));
    }
    if d.head_dim == 0 || !d.head_dim.is_multiple_of(2) {
        return bad(format!("head_dim {} must be even and positive", d.head_dim));
    }
    if d.rotary_dim == 0 || !d.rotary_dim.is_multiple_of(2) || d.rotary_dim > d.head_dim {
        return bad(format!(
            "rotary_dim {} must be even, positive and at most head_dim {}",
            d.rotary_dim, d.head_dim
        ));
    }
    Ok(())
}

/// Every layer's norms, weights and LoRA factors have the lengths the dimensions imply.
fn check_layers(model: &Model<'_>) -> Result<(), StepError> {
    let d = &model.dims;
    let h = d.hidden;
    for (l, layer) in model.layers.iter().enumerate() {
        expect_len(
            || format!("layer {l} input_norm"),
            layer.input_norm.len(),
            h,
        )?;
        expect_len(|| format!("layer {l} post_norm"), layer.post_norm.len(), h)?;
        match (layer.qk_norm, d.qk_norm) {
            (Some(norm), true) => {
                expect_len(|| format!("layer {l} q_norm"), norm.q.len(), d.head_dim)?;
                expect_len(|| format!("layer {l} k_norm"), norm.k.len(), d.head_dim)?;
            }
            (None, false) => {}
            (has, _) => {
                return Err(StepError::Dims(format!(
                    "layer {l} {} q/k norms but the dimensions say {}",
                    if has.is_some() { "has" } else { "lacks" },
                    d.qk_norm
                )));
            }
        }
        match (layer.gemma, d.gemma) {
            (Some(g), Some(_)) => {
                expect_len(
                    || format!("layer {l} post_attention_layernorm"),
                    g.after_attention.len(),
                    h,
                )?;
                expect_len(
                    || format!("layer {l} post_feedforward_layernorm"),
                    g.after_mlp.len(),
                    h,
                )?;
            }
            (None, None) => {}
            (has, _) => {
                return Err(StepError::Dims(format!(
                    "layer {l} {} a Gemma's output norms but the dimensions {}",
                    if has.is_some() { "has" } else { "lacks" },
                    if has.is_some() {
                        "are not a Gemma's"
                    } else {
                        "are a Gemma's"
                    }
                )));
            }
        }
        for (p, proj) in layer.proj.iter().enumerate() {
            let (i, o) = d.projection_shape(p);
            let name = PROJECTIONS[p];
            expect_len(
                || format!("layer {l} {name} weight"),
                proj.weight.len(),
                o * i,
            )?;
            if let Some(lora) = &proj.lora {
                expect_len(
                    || format!("layer {l} {name} lora A (rank {})", lora.r),
                    lora.a.len(),
                    lora.r * i,
                )?;
                expect_len(
                    || format!("layer {l} {name} lora B (rank {})", lora.r),
                    lora.b.len(),
                    o * lora.r,
                )?;
            }
        }
    }
    Ok(())
}

/// The positions the RoPE tables hold, after checking their shape.
fn rope_positions(model: &Model<'_>) -> Result<usize, StepError> {
    let d = &model.dims;
    let bad = |m: String| Err(StepError::Dims(m));
    let half = d.rotary_dim / 2;
    expect_len(|| "sin".into(), model.sin.len(), model.cos.len())?;
    if let Some((cos, sin)) = model.local_rope {
        expect_len(|| "local RoPE cos".into(), cos.len(), model.cos.len())?;
        expect_len(|| "local RoPE sin".into(), sin.len(), model.cos.len())?;
    }
    if !model.cos.len().is_multiple_of(half) {
        return bad(format!(
            "RoPE tables of {} are not rows of rotary_dim/2 = {half}",
            model.cos.len()
        ));
    }
    Ok(model.cos.len() / half)
}

/// The batch's buffers have `rows·len` elements, and every id, target, position and
/// segment start is in range (`v`: the vocabulary, `max_pos`: the RoPE tables' rows).
fn check_batch(batch: &Batch<'_>, v: usize, max_pos: usize) -> Result<(), StepError> {
    let n = batch.rows * batch.len;
    expect_len(|| "ids".into(), batch.ids.len(), n)?;
    expect_len(|| "targets".into(), batch.targets.len(), n)?;
    expect_len(|| "positions".into(), batch.positions.len(), n)?;
    expect_len(|| "starts".into(), batch.starts.len(), n)?;
    if let Some((index, &id)) = batch
        .ids
        .iter()
        .enumerate()
        .find(|&(_, &id)| id as usize >= v)
    {
        return Err(StepError::TokenOutOfVocabulary {
            index,
            id,
            vocab: v,
        });
    }
    if let Some((index, &target)) = batch
        .targets
        .iter()
        .enumerate()
        .find(|&(_, &t)| t >= 0 && t as u64 >= v as u64)
    {
        return Err(StepError::TargetOutOfVocabulary {
            index,
            target,
            vocab: v,
        });
    }
    if let Some((index, &position)) = batch
        .positions
        .iter()
        .enumerate()
        .find(|&(_, &p)| p as usize >= max_pos)
    {
        return Err(StepError::PositionOutOfRange {
            index,
            position,
            max_pos,
        });
    }
    let window = batch.window_starts.unwrap_or_default();
    if let Some(w) = batch.window_starts {
        expect_len(|| "window_starts".into(), w.len(), n)?;
    }
    if let Some((index, &start)) = batch
        .starts
        .iter()
        .chain(window)
        .enumerate()
        .find(|&(i, &s)| s as usize > (i % n.max(1)) % batch.len)
    {
        return Err(StepError::SegmentStart {
            index: index % n.max(1),
            column: (index % n.max(1)) % batch.len,
            start,
        });
    }
    Ok(())
}

/// The index of each LoRA projection's A gradient in the gradient list (B follows it),
/// after checking the list against the model.
pub(super) fn gradient_slots(
    model: &Model<'_>,
    grads: &[Vec<f32>],
) -> Result<Vec<[Option<usize>; 7]>, StepError> {
    let lengths = model.lora_lengths();
    if grads.len() != lengths.len() {
        return Err(StepError::GradientCount {
            got: grads.len(),
            expected: lengths.len(),
        });
    }
    let mut slots = Vec::with_capacity(model.layers.len());
    let mut next = 0;
    for (l, layer) in model.layers.iter().enumerate() {
        let mut s = [None; 7];
        for (p, proj) in layer.proj.iter().enumerate() {
            if proj.lora.is_some() {
                for (k, ab) in ["A", "B"].iter().enumerate() {
                    expect_len(
                        || format!("gradient of layer {l} {} lora {ab}", PROJECTIONS[p]),
                        grads[next + k].len(),
                        lengths[next + k],
                    )?;
                }
                s[p] = Some(next);
                next += 2;
            }
        }
        slots.push(s);
    }
    Ok(slots)
}
