//! The step's driver: the forward over every layer (row groups, checkpointing), the
//! loss, and the backward in reverse, as the crate notes describe.

use super::backward::{BackwardWork, LoraWork, layer_backward};
use super::forward::{ForwardWork, Saved, embed, layer_forward};
use super::frozen;
use super::groups;
use super::memory::{backward_lengths, max_ranks};
use super::validate::{gradient_slots, validate};
use super::{Batch, MaskSource, Model, StepError};
use crate::loss::{LossOutputs, RowWeights, linear_cross_entropy_with};
use crate::norm::{rms_norm_backward, rms_norm_forward};

/// How a step trades memory for time. The default is the fastest: every layer's forward
/// state is kept for its backward.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepOptions {
    /// Activation checkpointing per layer: the forward keeps only each layer's input
    /// (N × hidden) and its dropout masks, and the backward recomputes the layer's
    /// forward state into one shared set of buffers right before the layer's backward.
    /// One more forward of the layers with a backward (about a third more compute) for
    /// a saved state of `layers × N × hidden` instead of every layer's (see
    /// [`step_bytes`](super::step_bytes)). Results are bit-identical either way: the recomputation runs
    /// the same code on the same inputs and masks.
    pub checkpoint_layers: bool,
}

/// Forward and backward of one micro-batch with the default [`StepOptions`] (every
/// layer's state kept); see [`forward_backward_with`].
///
/// # Errors
/// As [`forward_backward_with`].
pub fn forward_backward(
    model: &Model<'_>,
    batch: &Batch<'_>,
    scale: f32,
    dropout: Option<MaskSource<'_>>,
    grads: &mut [Vec<f32>],
) -> Result<f64, StepError> {
    forward_backward_with(model, batch, scale, dropout, grads, StepOptions::default())
        .map(|step| step.loss)
}

/// What a step measured.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepLoss {
    /// The loss ([`forward_backward_with`]'s or [`forward_backward_weighted`]'s).
    pub loss: f64,
    /// The labelled tokens whose target has the largest logit: token accuracy's
    /// numerator (the denominator is the labelled-token count).
    pub correct: u64,
}

/// Forward and backward of one micro-batch: returns `scale·Σ CE` over the labelled
/// tokens (`scale` is 1/the labelled-token count of the whole optimiser step) and ADDS
/// each LoRA gradient into `grads`, one buffer per LoRA tensor in the order layer,
/// projection (q … down), A then B, only for projections with LoRA (see
/// [`Model::lora_lengths`]), so that micro-batches accumulate.
///
/// With `dropout`, a mask is drawn for every adapted projection in forward order (see
/// [`MaskSource`]) and applied to the LoRA branch's input, as `trainer::lora` does.
///
/// Memory: see [`step_bytes`](super::step_bytes); `options.checkpoint_layers` trades a second forward of
/// the adapted layers for keeping one layer's state instead of all of them. The loss
/// and the gradients' bits do not depend on it.
///
/// # Errors
/// [`StepError`] when the model, the batch, the gradient buffers or a drawn mask do not
/// fit together, or an id, target, position or segment start is out of range. Nothing is
/// added to `grads` then.
pub fn forward_backward_with(
    model: &Model<'_>,
    batch: &Batch<'_>,
    scale: f32,
    dropout: Option<MaskSource<'_>>,
    grads: &mut [Vec<f32>],
    options: StepOptions,
) -> Result<StepLoss, StepError> {
    let objective = Objective::Mean(scale);
    step(model, batch, objective, dropout, grads, options)
}

/// Chooses each token's weight from every token's loss: see [`forward_backward_weighted`].
pub type Weigh<'w> = &'w mut dyn FnMut(&[f64]) -> Vec<f32>;

/// Forward and backward of one micro-batch for a loss over whole sequences (a preference
/// loss such as DPO's), whose gradient with respect to each token's log-probability
/// depends on the log-probabilities of this very forward. After the forward, `weigh` is
/// given every token's loss `−log p(target)` (one per position, 0 where the target is
/// negative) and returns one weight per position: the sequence loss's gradient with
/// respect to that token's loss. The head then runs again with those weights for the
/// gradient, which flows back through the layers as in [`forward_backward_with`] (and
/// is ADDED into `grads`, with the same dropout and checkpointing). Returns
/// `Σ weight·loss`. Costs one more pass of the head than a mean-loss step.
///
/// # Errors
/// As [`forward_backward_with`]; also when `weigh` returns a number of weights other
/// than the batch's positions.
pub fn forward_backward_weighted(
    model: &Model<'_>,
    batch: &Batch<'_>,
    weigh: Weigh<'_>,
    dropout: Option<MaskSource<'_>>,
    grads: &mut [Vec<f32>],
    options: StepOptions,
) -> Result<StepLoss, StepError> {
    let objective = Objective::Weighted(weigh);
    step(model, batch, objective, dropout, grads, options)
}

/// What a step's loss is.
enum Objective<'w> {
    /// The mean cross-entropy: every labelled token by `scale`.
    Mean(f32),
    /// Token weights chosen from the forward's own token losses.
    Weighted(Weigh<'w>),
}

/// [`forward_backward_with`] and [`forward_backward_weighted`]: the step for either
/// objective.
fn step(
    model: &Model<'_>,
    batch: &Batch<'_>,
    objective: Objective<'_>,
    dropout: Option<MaskSource<'_>>,
    grads: &mut [Vec<f32>],
    options: StepOptions,
) -> Result<StepLoss, StepError> {
    validate(model, batch)?;
    let slots = gradient_slots(model, grads)?;
    let d = &model.dims;
    let (n, h) = (batch.rows * batch.len, d.hidden);
    if n == 0 {
        return Ok(StepLoss::default());
    }
    let ranks = model.lora_ranks();
    let with_dropout = dropout.is_some();
    // Layers below the lowest one with LoRA need no backward at all.
    let lowest = slots.iter().position(|s| s.iter().any(Option::is_some));
    let rows = model.row_groups(batch);
    let plan = Plan {
        checkpoint: options.checkpoint_layers,
        keep_from: lowest.unwrap_or(model.layers.len()),
        batches: rows.iter().map(|r| groups::sub_batch(batch, r)).collect(),
        rows,
        len: batch.len,
    };
    let mut x = embed(model, batch.ids);
    let mut state = forward_layers(model, &plan, &ranks, dropout, &mut x)?;
    let (hn, inv) = final_norm(model, &x, &mut state.works);
    let mut d_hidden = vec![0f32; n * h];
    let head = model.logits(frozen::loss_head(
        model.lm_head,
        model.compute,
        &mut state.works[0].frozen.widened,
    ));
    let chosen: Vec<f32>;
    let weights = match objective {
        Objective::Mean(scale) => RowWeights::Uniform(scale),
        Objective::Weighted(weigh) => {
            let mut losses = vec![0f64; n];
            let outputs = LossOutputs {
                d_hidden: None,
                row_losses: Some(&mut losses),
                correct: None,
            };
            let unit = RowWeights::Uniform(1.0);
            linear_cross_entropy_with(&hn, h, head, batch.targets, unit, outputs)?;
            chosen = weigh(&losses);
            RowWeights::PerRow(&chosen)
        }
    };
    let mut correct = 0;
    let outputs = LossOutputs {
        d_hidden: Some(&mut d_hidden),
        row_losses: None,
        correct: Some(&mut correct),
    };
    let loss = linear_cross_entropy_with(&hn, h, head, batch.targets, weights, outputs)?;
    let measured = StepLoss { loss, correct };
    let Some(lowest) = lowest else {
        return Ok(measured);
    };
    if batch.targets.iter().all(|&t| t < 0) {
        return Ok(measured);
    }
    let mut dx = vec![0f32; n * h];
    rms_norm_backward(&x, model.norm, &inv, &d_hidden, &mut dx, false);
    let works = std::mem::take(&mut state.works);
    let mut backs = backward_works(
        model,
        &plan,
        &ranks,
        with_dropout,
        works,
        (hn, d_hidden, inv),
    );
    backward_layers(
        model, &plan, &slots, lowest, &mut dx, &mut state, &mut backs, grads,
    );
    Ok(measured)
}

/// How a step runs its layers: its row groups, each as a batch of its own, and whether
/// the forward keeps only the layer inputs (from `keep_from` up) for a recomputation.
struct Plan<'b> {
    /// Activation checkpointing per layer.
    checkpoint: bool,
    /// The lowest layer with LoRA (every layer's count when none has): the forward
    /// keeps the inputs and masks of the layers from here up when checkpointing.
    keep_from: usize,
    /// Each group's rows of the batch.
    rows: Vec<std::ops::Range<usize>>,
    /// Each group's rows as a batch.
    batches: Vec<Batch<'b>>,
    /// Tokens per row.
    len: usize,
}

impl Plan<'_> {
    /// Which of a group's `Saved` layer `l` uses: its own, or the shared one with
    /// checkpointing.
    #[inline]
    fn layer_slot(&self, l: usize) -> usize {
        if self.checkpoint { 0 } else { l }
    }
}

/// What the forward leaves for the loss and the backward.
struct Forward {
    /// Per group: the forward scratch.
    works: Vec<ForwardWork>,
    /// Per group: one `Saved` per layer, or with checkpointing one shared by all.
    saved: Vec<Vec<Saved>>,
    /// With checkpointing, per layer from `keep_from` up: its input (batch-wide).
    inputs: Vec<Vec<f32>>,
    /// With checkpointing, per layer from `keep_from` up: each group's masks.
    kept: Vec<Vec<groups::KeptMasks>>,
}

/// The forward of every layer on the hidden state `x` (N × hidden, embedded), drawing
/// the dropout masks layer by layer in forward order.
fn forward_layers(
    model: &Model<'_>,
    plan: &Plan<'_>,
    ranks: &[[usize; 7]],
    dropout: Option<MaskSource<'_>>,
    x: &mut [f32],
) -> Result<Forward, StepError> {
    let d = &model.dims;
    let (n, len) = (x.len() / d.hidden, plan.len);
    let with_dropout = dropout.is_some();
    let mut dropout = dropout;
    // Per group: the forward scratch and, without checkpointing, one `Saved` per layer;
    // with it, one shared by all layers, and per layer from `lowest` up its input
    // (batch-wide) and its masks.
    let (mut works, mut saved): (Vec<ForwardWork>, Vec<Vec<Saved>>) = plan
        .batches
        .iter()
        .map(|b| {
            let tokens = b.rows * len;
            let saved = if plan.checkpoint {
                vec![Saved::new(d, tokens, &max_ranks(ranks))]
            } else {
                ranks.iter().map(|r| Saved::new(d, tokens, r)).collect()
            };
            (model.forward_work(tokens, with_dropout), saved)
        })
        .unzip();
    let mut inputs: Vec<Vec<f32>> = Vec::new();
    let mut kept: Vec<Vec<groups::KeptMasks>> = Vec::new();
    for l in 0..model.layers.len() {
        let keeps = plan.checkpoint && l >= plan.keep_from;
        if keeps {
            inputs.push(x.to_vec());
        }
        let mut layer_saved: Vec<&mut Saved> = saved
            .iter_mut()
            .map(|s| &mut s[plan.layer_slot(l)])
            .collect();
        groups::draw_layer_masks(model, l, n, &mut dropout, &plan.rows, len, &mut layer_saved)?;
        groups::layer_forward(
            model,
            l,
            &plan.batches,
            &plan.rows,
            x,
            layer_saved,
            &mut works,
        );
        if keeps {
            kept.push(saved.iter().map(|s| groups::keep_masks(&s[0])).collect());
        }
    }
    Ok(Forward {
        works,
        saved,
        inputs,
        kept,
    })
}

/// Each group's backward scratch, taking over its forward scratch. One group takes over
/// the batch-wide buffers (`hn`, `d_hidden`, `inv`), as an ungrouped step does; with
/// more, they are freed before the groups' own are made.
fn backward_works(
    model: &Model<'_>,
    plan: &Plan<'_>,
    ranks: &[[usize; 7]],
    with_dropout: bool,
    works: Vec<ForwardWork>,
    (hn, d_hidden, inv): (Vec<f32>, Vec<f32>, Vec<f32>),
) -> Vec<BackwardWork> {
    let (d, h, len) = (&model.dims, model.dims.hidden, plan.len);
    let (mut hn, mut d_hidden, mut inv) = (Some(hn), Some(d_hidden), Some(inv));
    if works.len() > 1 {
        (hn, d_hidden, inv) = (None, None, None);
    }
    works
        .into_iter()
        .zip(&plan.batches)
        .map(|(work, b)| {
            let tokens = b.rows * len;
            let [_, d_act, d_gu, d_attn, d_qkv, du, tmp, grad] =
                backward_lengths(d, tokens, ranks, with_dropout).map(|len| vec![0f32; len]);
            BackwardWork {
                hn: hn.take().unwrap_or_else(|| vec![0f32; tokens * h]),
                inv: inv.take().unwrap_or_else(|| vec![0f32; tokens]),
                act: work.act,
                d_act,
                d_gu,
                d_hn: d_hidden.take().unwrap_or_else(|| vec![0f32; tokens * h]),
                d_attn,
                d_qkv,
                lora: LoraWork {
                    du,
                    xd: work.xd,
                    tmp,
                    grad,
                },
                frozen: work.frozen,
            }
        })
        .collect()
}

/// The backward of the layers from the top down to `lowest`, each on every group at
/// once: `dx` is the hidden-state gradient (N × hidden). Every group after the first
/// sums a layer's gradients from zero into buffers of its own, added into `grads` in
/// group order once the layer is done.
#[allow(clippy::too_many_arguments)]
fn backward_layers(
    model: &Model<'_>,
    plan: &Plan<'_>,
    slots: &[[Option<usize>; 7]],
    lowest: usize,
    dx: &mut [f32],
    state: &mut Forward,
    backs: &mut [BackwardWork],
    grads: &mut [Vec<f32>],
) {
    let (h, len) = (model.dims.hidden, plan.len);
    let mut later_grads: Vec<Vec<Vec<f32>>> = (1..plan.batches.len())
        .map(|_| vec![Vec::new(); grads.len()])
        .collect();
    for l in (lowest..model.layers.len()).rev() {
        let mut input = if plan.checkpoint {
            state.inputs.pop()
        } else {
            None
        };
        let layer_kept = if plan.checkpoint {
            state.kept.pop()
        } else {
            None
        };
        let layer_gradients = groups::layer_gradients(&slots[l]);
        for later in &mut later_grads {
            for s in layer_gradients.clone() {
                later[s] = vec![0f32; grads[s].len()];
            }
        }
        let group_grads =
            std::iter::once(&mut *grads).chain(later_grads.iter_mut().map(Vec::as_mut_slice));
        let inputs_of = input
            .as_mut()
            .map(|input| groups::split_rows(input, &plan.rows, len, h));
        let mut inputs_of = inputs_of.map(Vec::into_iter);
        let items: Vec<_> = plan
            .batches
            .iter()
            .enumerate()
            .zip(groups::split_rows(dx, &plan.rows, len, h))
            .zip(state.saved.iter_mut())
            .zip(backs.iter_mut())
            .zip(group_grads)
            .map(|(((((g, b), dx), s), work), grads)| {
                let input = inputs_of.as_mut().and_then(Iterator::next);
                (g, b, dx, &mut s[plan.layer_slot(l)], work, grads, input)
            })
            .collect();
        let slots = &slots[l];
        let layer_kept = layer_kept.as_deref();
        groups::for_each(items, |(g, b, dx, s, work, grads, input)| {
            if let (Some(input), Some(kept)) = (input, layer_kept) {
                recompute_forward(model, l, b, input, &kept[g], s, work);
            }
            layer_backward(model, l, b, s, dx, work, grads, l == lowest, slots);
        });
        for later in &mut later_grads {
            for s in layer_gradients.clone() {
                super::add(&mut grads[s], &std::mem::take(&mut later[s]));
            }
        }
    }
}

/// Recomputes layer `l`'s forward state into `s` from its `input` and its `kept` masks,
/// with the backward's buffers lent as the forward's scratch (the backward recomputes
/// what it needs of them itself).
#[inline]
fn recompute_forward(
    model: &Model<'_>,
    l: usize,
    b: &Batch<'_>,
    input: &mut [f32],
    kept: &groups::KeptMasks,
    s: &mut Saved,
    work: &mut BackwardWork,
) {
    groups::restore_masks(kept, s);
    let mut lent = ForwardWork {
        hn: std::mem::take(&mut work.hn),
        act: std::mem::take(&mut work.act),
        xd: std::mem::take(&mut work.lora.xd),
        frozen: std::mem::take(&mut work.frozen),
    };
    layer_forward(model, l, b, input, s, &mut lent);
    (work.hn, work.act, work.lora.xd) = (lent.hn, lent.act, lent.xd);
    work.frozen = lent.frozen;
}

/// The final norm of the hidden state `x` (N × hidden), batch-wide, and its 1/rms. With
/// one row group its normed-input scratch is lent (it holds N rows), as an ungrouped step
/// does; with more, the normed input has a buffer of its own.
fn final_norm(model: &Model<'_>, x: &[f32], works: &mut [ForwardWork]) -> (Vec<f32>, Vec<f32>) {
    let h = model.dims.hidden;
    let mut inv = vec![0f32; x.len() / h];
    let mut hn = match works {
        [only] => std::mem::take(&mut only.hn),
        _ => vec![0f32; x.len()],
    };
    rms_norm_forward(x, model.norm, model.dims.rms_eps, &mut hn, &mut inv);
    (hn, inv)
}

/// The loss only, for evaluation: `scale·Σ CE` over the labelled tokens, without dropout
/// and without any gradient work. Layers reuse one set of buffers per row group.
///
/// # Errors
/// [`StepError`] when the model or batch is inconsistent; see [`forward_backward`].
pub fn loss(model: &Model<'_>, batch: &Batch<'_>, scale: f32) -> Result<f64, StepError> {
    evaluate(model, batch, scale, None).map(|e| e.loss)
}

/// [`loss`] with the labelled tokens whose target has the largest logit (validation's
/// token accuracy).
///
/// # Errors
/// As [`loss`].
pub fn loss_and_correct(
    model: &Model<'_>,
    batch: &Batch<'_>,
    scale: f32,
) -> Result<StepLoss, StepError> {
    evaluate(model, batch, scale, None)
}

/// Every position's loss `−log p(target)` (0 where the target is negative), without
/// dropout and without any gradient work: what a preference loss sums per sequence for
/// its reference model.
///
/// # Errors
/// [`StepError`] when the model or batch is inconsistent; see [`forward_backward`].
pub fn token_losses(model: &Model<'_>, batch: &Batch<'_>) -> Result<Vec<f64>, StepError> {
    let mut losses = vec![0f64; batch.rows * batch.len];
    evaluate(model, batch, 1.0, Some(&mut losses))?;
    Ok(losses)
}

/// The forward without gradients: `scale·Σ CE` and the tokens ranked right, and with
/// `row_losses` each position's loss.
fn evaluate(
    model: &Model<'_>,
    batch: &Batch<'_>,
    scale: f32,
    row_losses: Option<&mut [f64]>,
) -> Result<StepLoss, StepError> {
    validate(model, batch)?;
    let d = &model.dims;
    let (n, h, len) = (batch.rows * batch.len, d.hidden, batch.len);
    if n == 0 {
        return Ok(StepLoss::default());
    }
    let rows = model.row_groups(batch);
    let batches: Vec<Batch<'_>> = rows.iter().map(|r| groups::sub_batch(batch, r)).collect();
    let mut x = embed(model, batch.ids);
    let ranks = max_ranks(&model.lora_ranks());
    let (mut works, mut saved): (Vec<ForwardWork>, Vec<Saved>) = batches
        .iter()
        .map(|b| {
            let tokens = b.rows * len;
            (
                model.forward_work(tokens, false),
                Saved::new(d, tokens, &ranks),
            )
        })
        .unzip();
    for l in 0..model.layers.len() {
        let layer_saved = saved.iter_mut().collect();
        groups::layer_forward(model, l, &batches, &rows, &mut x, layer_saved, &mut works);
    }
    let (hn, _) = final_norm(model, &x, &mut works);
    let mut correct = 0;
    let loss = linear_cross_entropy_with(
        &hn,
        h,
        model.logits(frozen::loss_head(
            model.lm_head,
            model.compute,
            &mut works[0].frozen.widened,
        )),
        batch.targets,
        RowWeights::Uniform(scale),
        LossOutputs {
            d_hidden: None,
            row_losses,
            correct: Some(&mut correct),
        },
    )?;
    Ok(StepLoss { loss, correct })
}
