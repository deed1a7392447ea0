//! Forward and backward over a step's micro-batches, on the fused kernels or on
//! candle's autograd graph (with or without per-layer checkpointing).

use crate::batch::Batch;
use crate::error::{Error, Result};
use crate::lora::DropoutCtx;
use crate::model::Llama;
use crate::step::{Objective, StepDropout, StepResult, Tally};
use candle_core::Tensor;

/// Runs forward and backward over `batches` (the micro-batches of one step), on the
/// model's compute path ([`crate::fast::ComputePath::for_model`]), for the mean
/// cross-entropy.
pub fn accumulate(
    model: &Llama,
    batches: &[Batch],
    dropout: Option<StepDropout<'_>>,
) -> Result<StepResult> {
    accumulate_for(model, batches, dropout, Objective::CrossEntropy)
}

/// [`accumulate`] for `objective`.
pub fn accumulate_for(
    model: &Llama,
    batches: &[Batch],
    dropout: Option<StepDropout<'_>>,
    objective: Objective<'_>,
) -> Result<StepResult> {
    match crate::fast::ComputePath::for_model(model) {
        crate::fast::ComputePath::CpuFused => {
            crate::fast::accumulate(model, batches, dropout, objective)
        }
        crate::fast::ComputePath::Graph => {
            accumulate_on_graph_for(model, batches, dropout, objective)
        }
    }
}

/// [`accumulate`] through candle's autograd graph (the CUDA path and the test oracle).
pub fn accumulate_on_graph(
    model: &Llama,
    batches: &[Batch],
    dropout: Option<StepDropout<'_>>,
) -> Result<StepResult> {
    accumulate_on_graph_for(model, batches, dropout, Objective::CrossEntropy)
}

/// [`accumulate_on_graph`] for `objective`. DPO weighs each token's cross-entropy by
/// what [`crate::dpo::DpoStep::weigh`] makes of the forward's own token losses.
fn accumulate_on_graph_for(
    model: &Llama,
    batches: &[Batch],
    mut dropout: Option<StepDropout<'_>>,
    objective: Objective<'_>,
) -> Result<StepResult> {
    let vars = model.lora_vars();
    let denom = crate::batch::labelled_denominator(batches);
    let mut grads: Vec<Option<Tensor>> = vec![None; vars.len()];
    let mut tally = Tally::default();
    let mut dpo = objective.dpo();
    for (m, b) in batches.iter().enumerate() {
        if b.packing.is_some() {
            return Err(graph_refuses(
                "a packed batch reached candle's graph, which has no block-diagonal mask",
            ));
        }
        let ids = Tensor::from_vec(b.ids.clone(), (b.rows, b.len), model.device())?;
        let dropout = dropout.as_mut().filter(|d| d.p > 0.0);
        let l = if model.checkpoint_layers {
            if dpo.is_some() {
                return Err(graph_refuses(
                    "DPO on candle's graph runs without activation checkpointing; set activation_checkpointing to off",
                ));
            }
            let (l, correct) =
                checkpointed_on_graph(model, &ids, b, denom, dropout, &vars, &mut grads)?;
            tally.correct += correct;
            l
        } else {
            let mut ctx = dropout.map(|d| DropoutCtx {
                p: d.p,
                rng: &mut *d.rng,
                record: d.record.as_deref_mut(),
                replay: None,
            });
            let hidden = model.hidden_states(&ids, ctx.as_mut())?;
            let logits = model.logits(&hidden)?;
            tally.correct += crate::ops::top1_hits(&logits, &b.targets)?;
            let l = match dpo.as_mut() {
                Some((step, reference)) => {
                    let losses = crate::ops::token_losses(&logits, &b.targets)?;
                    let weights = step.weigh(&losses, b.len, &reference[m]);
                    crate::ops::weighted_cross_entropy(&logits, &b.targets, weights)?
                }
                None => crate::ops::masked_cross_entropy(&logits, &b.targets, denom)?,
            };
            let mut store = l.backward()?;
            add_grads(&mut grads, &vars, &mut store)?;
            l.to_scalar::<f32>()?
        };
        tally.loss += l as f64;
        tally.tokens += b.tokens;
        tally.labelled += b.labelled;
    }
    let grads = grads
        .into_iter()
        .zip(&vars)
        .map(|(g, v)| g.map_or_else(|| v.var.as_tensor().zeros_like(), Ok))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(StepResult::new(tally, grads, dpo.map(|(step, _)| step)))
}

/// A step candle's graph cannot take.
fn graph_refuses(message: &str) -> Error {
    Error::Model {
        path: "training step".into(),
        message: message.into(),
    }
}

/// Adds the gradients `store` holds for `vars` into `grads`.
fn add_grads(
    grads: &mut [Option<Tensor>],
    vars: &[crate::model::NamedVar],
    store: &mut candle_core::backprop::GradStore,
) -> Result<()> {
    for (slot, v) in grads.iter_mut().zip(vars) {
        let g = store.remove(v.var.as_tensor());
        *slot = match (slot.take(), g) {
            (Some(acc), Some(g)) => Some((acc + g)?),
            (None, g) => g,
            (acc, None) => acc,
        };
    }
    Ok(())
}

/// One micro-batch on candle's graph with per-layer activation checkpointing, for the
/// CUDA path (and the CPU graph): the forward keeps only each layer's input and the
/// dropout masks it drew, dropping the layer's graph; the backward reruns each layer in
/// reverse on its stored input with the same masks and backpropagates
/// `sum(layer(x) ∘ g)`, whose gradient is the layer's with `g` arriving from above.
/// Returns the micro-batch's loss and its labelled tokens whose target has the largest
/// logit; adds its gradients into `grads`.
fn checkpointed_on_graph(
    model: &Llama,
    ids: &Tensor,
    b: &Batch,
    denom: f64,
    mut dropout: Option<&mut StepDropout<'_>>,
    vars: &[crate::model::NamedVar],
    grads: &mut [Option<Tensor>],
) -> Result<(f32, u64)> {
    let rope = model.rope_prefix(b.len)?;
    let lowest = model
        .layers
        .iter()
        .position(|l| l.projections.iter().any(|p| p.lora.is_some()))
        .unwrap_or(model.layers.len());
    let mut x = model.embed(ids)?.detach();
    let mut inputs = Vec::with_capacity(model.layers.len());
    let mut masks: Vec<Vec<Tensor>> = Vec::with_capacity(model.layers.len());
    for layer in &model.layers {
        let mut drawn = Vec::new();
        let mut ctx = dropout.as_mut().map(|d| DropoutCtx {
            p: d.p,
            rng: &mut *d.rng,
            record: Some(&mut drawn),
            replay: None,
        });
        let y = model.layer_forward(layer, &x, &rope, ctx.as_mut(), None)?;
        if let Some(record) = dropout.as_mut().and_then(|d| d.record.as_deref_mut()) {
            record.extend(drawn.iter().cloned());
        }
        inputs.push(x);
        masks.push(drawn);
        // Detached: the layer's graph (every intermediate it made) is dropped here.
        x = y.detach();
    }
    let top = candle_core::Var::from_tensor(&x)?;
    let logits = model.logits(&model.final_norm(top.as_tensor())?)?;
    let correct = crate::ops::top1_hits(&logits, &b.targets)?;
    let l = crate::ops::masked_cross_entropy(&logits, &b.targets, denom)?;
    let mut store = l.backward()?;
    let Some(mut g) = store.remove(top.as_tensor()) else {
        return Ok((l.to_scalar::<f32>()?, correct));
    };
    for (i, layer) in model.layers.iter().enumerate().rev() {
        if i < lowest {
            break;
        }
        let input = candle_core::Var::from_tensor(&inputs[i])?;
        let mut replay: std::collections::VecDeque<Tensor> = std::mem::take(&mut masks[i]).into();
        let mut ctx = dropout.as_mut().map(|d| DropoutCtx {
            p: d.p,
            rng: &mut *d.rng,
            record: None,
            replay: Some(&mut replay),
        });
        let y = model.layer_forward(layer, input.as_tensor(), &rope, ctx.as_mut(), None)?;
        let surrogate = (y * g.detach())?.sum_all()?;
        let mut store = surrogate.backward()?;
        add_grads(grads, vars, &mut store)?;
        match store.remove(input.as_tensor()) {
            Some(next) => g = next,
            None => break,
        }
    }
    Ok((l.to_scalar::<f32>()?, correct))
}
