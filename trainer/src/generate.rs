//! Greedy generation with the (adapted) model: samples after training and `tuneq generate`.
//!
//! The prompt is run once to fill a key/value cache, then each new token costs one
//! token's forward pass against the cache ([`Llama::forward_cached`]), instead of
//! re-running the whole sequence per token.

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
    let limit = model.cfg.max_position_embeddings();
    let mut out = Vec::new();
    if prompt.is_empty() || prompt.len() >= limit {
        return Ok(out);
    }
    let mut cache = model.new_cache();
    let mut logits = model.forward_cached(prompt, &mut cache)?;
    for _ in 0..max_new {
        let next = argmax(&logits)?;
        if stop.contains(&next) {
            break;
        }
        out.push(next);
        if cache.len() >= limit || out.len() == max_new {
            break;
        }
        logits = model.forward_cached(&[next], &mut cache)?;
    }
    Ok(out)
}

/// The index of the largest logit.
fn argmax(logits: &Tensor) -> Result<u32> {
    Ok(logits.argmax(D::Minus1)?.to_scalar::<u32>()?)
}

/// [`greedy`] without the cache, re-running the whole sequence for every token: the
/// reference the cached path is tested against.
pub fn greedy_recomputing(
    model: &Llama,
    prompt: &[u32],
    max_new: usize,
    stop: &[u32],
) -> Result<Vec<u32>> {
    let mut ids = prompt.to_vec();
    let limit = model.cfg.max_position_embeddings();
    let mut out = Vec::new();
    for _ in 0..max_new {
        if ids.len() >= limit || ids.is_empty() {
            break;
        }
        let input = Tensor::from_vec(ids.clone(), (1, ids.len()), model.device())?;
        let hidden = model.hidden_states(&input, None)?;
        let last = hidden.narrow(1, ids.len() - 1, 1)?;
        let next = argmax(&model.logits(&last)?.flatten_all()?)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::init::{InitOptions, Preset, preset_config};
    use candle_core::Device;

    fn tiny(kv_heads: usize) -> Llama {
        let opts = InitOptions {
            preset: Preset::Tiny,
            seed: 4,
            shards: 1,
            tie_embeddings: false,
            llama3_rope: true,
            architecture: tuneq_pools::Architecture::Llama,
        };
        let mut cfg = preset_config(&opts);
        cfg.shape.num_key_value_heads = Some(kv_heads as u64);
        crate::init::random_model(cfg, 4, None).expect("model")
    }

    #[test]
    fn cached_logits_equal_the_full_forward_at_every_position() {
        let m = tiny(4);
        let ids: Vec<u32> = (0..40).map(|i| (i * 97 + 13) % 4096).collect();
        let full = m
            .forward(&Tensor::from_vec(ids.clone(), (1, ids.len()), &Device::Cpu).expect("ids"))
            .expect("forward");
        let mut cache = m.new_cache();
        // A 25-token prompt, then one token at a time.
        let check = |upto: usize, logits: Tensor| {
            let want = full.get(0).and_then(|r| r.get(upto - 1)).expect("row");
            let diff = (logits - want)
                .and_then(|d| d.abs()?.max_all()?.to_scalar::<f32>())
                .expect("diff");
            assert!(
                diff < 1e-4,
                "position {upto}: cached logits differ by {diff}"
            );
        };
        check(
            25,
            m.forward_cached(&ids[..25], &mut cache).expect("prefill"),
        );
        for i in 25..ids.len() {
            check(
                i + 1,
                m.forward_cached(&ids[i..=i], &mut cache).expect("step"),
            );
        }
        assert_eq!(cache.len(), ids.len());
    }

    #[test]
    fn greedy_with_the_cache_generates_what_recomputing_generates() {
        for kv in [8, 2] {
            let m = tiny(kv);
            let prompt: Vec<u32> = (0..12).map(|i| (i * 31 + 5) % 4096).collect();
            let t0 = std::time::Instant::now();
            let cached = greedy(&m, &prompt, 48, &[]).expect("cached");
            let t1 = std::time::Instant::now();
            let recomputed = greedy_recomputing(&m, &prompt, 48, &[]).expect("recomputed");
            let t2 = std::time::Instant::now();
            assert_eq!(cached.len(), 48);
            assert_eq!(cached, recomputed, "kv heads {kv}");
            eprintln!(
                "48 tokens: cached {:.0} tokens/s, recomputing {:.0} tokens/s",
                48.0 / (t1 - t0).as_secs_f64(),
                48.0 / (t2 - t1).as_secs_f64()
            );
        }
    }

    #[test]
    fn a_cache_past_the_context_is_refused() {
        let m = tiny(4);
        let mut cache = m.new_cache();
        let too_long = vec![1u32; m.cfg.max_position_embeddings() + 1];
        assert!(m.forward_cached(&too_long, &mut cache).is_err());
        assert!(m.forward_cached(&[], &mut cache).is_err());
    }
}
