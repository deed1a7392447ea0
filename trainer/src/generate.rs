//! Greedy generation with the (adapted) model: samples after training and `tuneq generate`.
//!
//! Each new token re-runs the whole sequence (no KV cache yet): simple and exact, and
//! fast enough for a handful of 64-token samples on the models tuneq trains on CPU.

use crate::data::{Encoder, Record};
use crate::error::Result;
use crate::model::Llama;
use candle_core::{D, Tensor};
use serde::Serialize;

/// One generated sample, a line of `samples.jsonl`.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    /// Index of the record it came from.
    pub index: usize,
    /// The rendered prompt.
    pub prompt: String,
    /// The model's greedy completion.
    pub completion: String,
    /// The dataset's answer.
    pub reference: String,
}

/// Greedily extends `prompt` by up to `max_new` tokens, stopping at any of `stop` ids.
pub fn greedy(model: &Llama, prompt: &[u32], max_new: usize, stop: &[u32]) -> Result<Vec<u32>> {
    let mut ids = prompt.to_vec();
    let limit = model.cfg.max_position_embeddings;
    let mut out = Vec::new();
    for _ in 0..max_new {
        if ids.len() >= limit || ids.is_empty() {
            break;
        }
        let input = Tensor::from_vec(ids.clone(), (1, ids.len()), model.device())?;
        let hidden = model.hidden_states(&input, None)?;
        let last = hidden.narrow(1, ids.len() - 1, 1)?;
        let logits = model.logits(&last)?;
        let next = logits.argmax(D::Minus1)?.flatten_all()?.to_vec1::<u32>()?;
        let Some(&next) = next.first() else { break };
        if stop.contains(&next) {
            break;
        }
        ids.push(next);
        out.push(next);
    }
    Ok(out)
}

/// Completions for the first `n` records.
pub fn sample_records(
    model: &Llama,
    encoder: &Encoder,
    records: &[Record],
    n: usize,
    max_new: usize,
) -> Result<Vec<Sample>> {
    let stop = stop_ids(model, encoder);
    let mut out = Vec::new();
    for (index, r) in records.iter().enumerate().take(n) {
        let (ids, prompt, reference) = encoder.prompt_for_sampling(r)?;
        let generated = greedy(model, &ids, max_new, &stop)?;
        out.push(Sample {
            index,
            prompt,
            completion: encoder.decode(&generated)?,
            reference,
        });
    }
    Ok(out)
}

/// Tokens that end a reply: the model's configured eos ids and the tokenizer's
/// end-of-turn tokens (eos, `<|im_end|>`, `<|eot_id|>`, …).
pub fn stop_ids(model: &Llama, encoder: &Encoder) -> Vec<u32> {
    let mut ids: Vec<u32> = model
        .cfg
        .eos_token_id
        .as_ref()
        .map(|e| e.ids())
        .unwrap_or_default();
    ids.extend(encoder.stop_token_ids());
    ids.sort_unstable();
    ids.dedup();
    ids
}
