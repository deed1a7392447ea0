//! Phi-3's fused projections as the kernels' seven.
//!
//! The kernels keep a layer as seven projections, q, k and v writing one qkv buffer side
//! by side and gate and up one `[gate | up]` buffer. Phi-3 stores q, k and v as the row
//! blocks of one `qkv_proj` matrix, and gate and up as the halves of one `gate_up_proj`,
//! so each part is a view of its rows, in place. LoRA wraps the fused matrix whole (as
//! PEFT does): one A for the three (or two) parts, and B's row blocks, one per part. The
//! kernels run the parts as separate branches that share A: the same update, row for
//! row, with A's product recomputed per part (r columns each). Their gradients fold back:
//! A's is the sum of the parts' (the chain rule through the shared factor), B's the
//! parts' row blocks in order. A dropout mask is drawn once for a fused projection and
//! given to each of its parts, as PEFT draws one for its input.

use super::{Held, HeldAt, LoraIdx};
use crate::error::Result;
use crate::lora::LoraLinear;
use crate::model::{Layer, Roles};
use std::ops::Range;

/// One kernel projection's weight, bias and LoRA in [`Held`].
pub(super) type HeldProjection = (HeldAt, Option<HeldAt>, Option<LoraIdx>);

/// The kernels' seven projections of `layer`, held in `held`: each as it is, or the
/// parts of a fused one (`q_width`, `kv_width`: the widths of q and of k or v).
pub(super) fn kernel_projections<'t>(
    held: &mut Held<'t>,
    layer: &'t Layer,
    (q_width, kv_width): (usize, usize),
) -> Result<Vec<HeldProjection>> {
    let mut out = Vec::with_capacity(7);
    match layer.roles()? {
        Roles::Separate(all) => {
            for lin in all {
                out.push(part(held, lin, None)?);
            }
        }
        Roles::Fused([qkv, o, gate_up, down]) => {
            let inter = gate_up.weight.dim(0)? / 2;
            for rows in qkv_parts(q_width, kv_width) {
                out.push(part(held, qkv, Some(rows))?);
            }
            out.push(part(held, o, None)?);
            for rows in [0..inter, inter..2 * inter] {
                out.push(part(held, gate_up, Some(rows))?);
            }
            out.push(part(held, down, None)?);
        }
    }
    Ok(out)
}

/// The row blocks of q, k and v in a fused qkv matrix.
fn qkv_parts(q_width: usize, kv_width: usize) -> [Range<usize>; 3] {
    [
        0..q_width,
        q_width..q_width + kv_width,
        q_width + kv_width..q_width + 2 * kv_width,
    ]
}

/// `lin` held whole, or the part of its output `rows` (its weight's and bias's rows, its
/// LoRA's whole A and B's rows).
fn part<'t>(
    held: &mut Held<'t>,
    lin: &'t LoraLinear,
    rows: Option<Range<usize>>,
) -> Result<HeldProjection> {
    let weight = held.hold_rows(&lin.weight, rows.clone())?;
    let bias = match &lin.bias {
        Some(b) if rows.is_none() => Some(held.hold_f32(b)?),
        Some(b) => Some(held.hold_rows(b, rows.clone())?),
        None => None,
    };
    let lora = match &lin.lora {
        Some(l) => Some(LoraIdx {
            a: held.hold(l.a.as_tensor())?,
            b: held.hold_rows(l.b.as_tensor(), rows)?,
            r: l.a.dim(0)?,
            scale: lin.scale as f32,
        }),
        None => None,
    };
    Ok((weight, bias, lora))
}

/// Where each of the kernels' LoRA gradients (layer by layer, projection by
/// projection, A then B, for the adapted ones) adds into the model's own
/// ([`crate::model::Llama::lora_vars`] order): the variable and the offset in it.
pub(super) fn gradient_targets(layers: &[Layer]) -> Result<Vec<(usize, usize)>> {
    let mut out = Vec::new();
    let mut var = 0;
    for layer in layers {
        let parts: Vec<(&LoraLinear, Vec<usize>)> = match layer.roles()? {
            Roles::Separate(all) => all.iter().map(|lin| (*lin, vec![0])).collect(),
            Roles::Fused([qkv, o, gate_up, down]) => {
                // o reads the queries' width; k and v share the rest.
                let (width, q) = (qkv.weight.dim(0)?, o.weight.dim(1)?);
                let (kv, half) = ((width - q) / 2, gate_up.weight.dim(0)? / 2);
                vec![
                    (qkv, qkv_parts(q, kv).map(|r| r.start).to_vec()),
                    (o, vec![0]),
                    (gate_up, vec![0, half]),
                    (down, vec![0]),
                ]
            }
        };
        for (lin, starts) in parts {
            let Some(lora) = &lin.lora else {
                continue;
            };
            let r = lora.a.dim(0)?;
            for start in starts {
                out.push((var, 0));
                out.push((var + 1, start * r));
            }
            var += 2;
        }
    }
    Ok(out)
}

/// For each mask the kernels ask for (layer by layer, per adapted projection), whether
/// it is the mask just drawn again: a fused projection's later parts take its first
/// part's.
pub(super) fn repeated_masks(layers: &[Layer]) -> Result<Vec<bool>> {
    let mut out = Vec::new();
    for layer in layers {
        match layer.roles()? {
            Roles::Separate(all) => {
                out.extend(all.iter().filter(|l| l.lora.is_some()).map(|_| false))
            }
            Roles::Fused(all) => {
                for (lin, parts) in all.iter().zip([3, 1, 2, 1]) {
                    if lin.lora.is_some() {
                        out.extend((0..parts).map(|i| i > 0));
                    }
                }
            }
        }
    }
    Ok(out)
}
