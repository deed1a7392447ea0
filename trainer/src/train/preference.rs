//! DPO's data in a run: micro-batches of pairs, and each pair's log-probabilities under
//! a model without gradients (the frozen reference, and the policy for validation).

use crate::batch::{Batch, make_batch};
use crate::data::{EncodedPair, Example};
use crate::dpo::{DpoStep, PairLogps, row_logps};
use crate::error::Result;
use crate::fast::ComputePath;
use crate::model::Llama;
use candle_core::Tensor;

/// A micro-batch of pairs as [`crate::dpo`] lays it out: the preferred sequences, then
/// the others in the same order, one a row, right-padded (rows are never packed: each
/// is one sequence, whose log-probability is its row's sum).
pub fn pair_batch(pairs: &[&EncodedPair], pad_id: u32) -> Batch {
    let rows: Vec<&Example> = pairs
        .iter()
        .map(|p| &p.chosen)
        .chain(pairs.iter().map(|p| &p.rejected))
        .collect();
    make_batch(&rows, pad_id)
}

/// Each pair's log-probabilities under `model` as it stands, without dropout or
/// gradients, `batch_size` pairs at a time. At the start of a run the model is the
/// reference (the base model, or the adapter the run continues).
pub fn pair_logps(
    model: &Llama,
    pairs: &[EncodedPair],
    batch_size: usize,
    pad_id: u32,
) -> Result<Vec<PairLogps>> {
    let mut out = Vec::with_capacity(pairs.len());
    for chunk in pairs.chunks(batch_size.max(1)) {
        let refs: Vec<&EncodedPair> = chunk.iter().collect();
        let b = pair_batch(&refs, pad_id);
        let logps = row_logps(&token_losses(model, &b)?, b.len);
        let k = chunk.len();
        out.extend((0..k).map(|i| [logps[i], logps[k + i]]));
    }
    Ok(out)
}

/// The mean DPO loss of `pairs` under `model` against their `reference`
/// log-probabilities (the validation loss of a DPO run).
pub fn dpo_loss(
    model: &Llama,
    pairs: &[EncodedPair],
    reference: &[PairLogps],
    (beta, batch_size, pad_id): (f64, usize, u32),
) -> Result<f64> {
    let policy = pair_logps(model, pairs, batch_size, pad_id)?;
    let mut step = DpoStep::new(beta, pairs.len());
    for (&policy, &reference) in policy.iter().zip(reference) {
        step.add_pair(policy, reference);
    }
    Ok(step.finish().0)
}

/// Every position's loss of `b` on the model's compute path.
fn token_losses(model: &Llama, b: &Batch) -> Result<Vec<f64>> {
    if ComputePath::for_model(model) == ComputePath::CpuFused {
        return crate::fast::token_losses(model, b);
    }
    let ids = Tensor::from_vec(b.ids.clone(), (b.rows, b.len), model.device())?;
    let logits = model.logits(&model.hidden_states(&ids, None)?)?;
    Ok(crate::ops::token_losses(&logits, &b.targets)?)
}
