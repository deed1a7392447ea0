//! `tuneq bench serve`: decode throughput and time to first token of concurrent
//! answers in the engine, as the server runs them (compare with the transformers + PEFT
//! peer in `scripts/bench_serve.py`, on the same model, adapter, prompts and threads).
//!
//! Every answer is greedy and exactly `max_new_tokens` long (the end-of-turn tokens
//! are biased away, as the peer's `min_new_tokens` does), so both sides do the same
//! work. The answers start together; time to first token is from that start to an
//! answer's first token, so with several answers it includes waiting for the others'
//! prompts.

use crate::engine::{Engine, EngineConfig, ServedModel};
use crate::error::Result;
use crate::generation::GenerationRequest;
use crate::model::ModelKey;
use crate::sampling::Sampling;
use serde::Serialize;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// What to measure.
#[derive(Debug, Clone)]
pub struct ServeBenchOptions {
    /// The model (and adapter) to serve.
    pub model: ModelKey,
    /// User messages, one per answer (reused round-robin past the last).
    pub prompts: Vec<String>,
    /// Answers at once.
    pub concurrency: usize,
    /// Tokens per answer.
    pub max_new_tokens: usize,
    /// Decode the answers together (the server's way) or each alone on its thread.
    pub batched: bool,
}

/// What one measurement found.
#[derive(Debug, Clone, Serialize)]
pub struct ServeBenchResult {
    /// Answers at once.
    pub concurrency: usize,
    /// Whether they were decoded together.
    pub batched: bool,
    /// Tokens generated over all answers.
    pub tokens: usize,
    /// From the start to the last answer's end.
    pub wall_s: f64,
    /// Generated tokens per second over all answers.
    pub tokens_per_s: f64,
    /// Median time to an answer's first token.
    pub ttft_ms_median: f64,
}

/// Loads the model, warms it up, and measures one round of `concurrency` answers.
pub fn run(opts: &ServeBenchOptions) -> Result<ServeBenchResult> {
    let concurrency = opts.concurrency.max(1);
    let engine = Engine::new(EngineConfig {
        max_concurrent: concurrency,
        max_per_tenant: concurrency,
        resident_models: 1,
        max_batch: if opts.batched { concurrency } else { 1 },
        max_answer_tokens: opts.max_new_tokens,
    });
    let model = engine.model(&opts.model)?;
    let no_end = Sampling {
        logit_bias: model.stop_ids().iter().map(|&id| (id, -100.0)).collect(),
        ..Sampling::greedy()
    };
    let requests = (0..concurrency)
        .map(|i| {
            let prompt = &opts.prompts[i % opts.prompts.len().max(1)];
            let message = tuneq_dataset::Message::new(tuneq_dataset::Role::User, prompt.clone());
            Ok(GenerationRequest {
                prompt: model.chat_prompt(&[message], &[], &Default::default(), "")?,
                max_new_tokens: opts.max_new_tokens,
                sampling: no_end.clone(),
                seed: 0,
                stop: Vec::new(),
                markers: Vec::new(),
                logprobs: None,
                format: None,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    // Warm-up: the first answer pays for lazy setup (the decode loop, allocations).
    let mut warm = requests[0].clone();
    warm.max_new_tokens = 2;
    answer(&model, &warm, opts.batched, Instant::now())?;
    let barrier = Arc::new(Barrier::new(concurrency));
    let start = Instant::now();
    let runs: Vec<_> = requests
        .into_iter()
        .map(|request| {
            let (model, barrier) = (model.clone(), barrier.clone());
            let batched = opts.batched;
            std::thread::spawn(move || {
                barrier.wait();
                answer(&model, &request, batched, start)
            })
        })
        .collect();
    let mut tokens = 0;
    let mut first = Vec::new();
    let mut end = Duration::ZERO;
    for run in runs {
        let (n, ttft, took) = run.join().map_err(|_| {
            crate::error::ServeError::Decode("a benchmark thread panicked".into())
        })??;
        tokens += n;
        first.push(ttft.as_secs_f64() * 1e3);
        end = end.max(took);
    }
    first.sort_by(f64::total_cmp);
    let wall_s = end.as_secs_f64();
    Ok(ServeBenchResult {
        concurrency,
        batched: opts.batched,
        tokens,
        wall_s,
        tokens_per_s: tokens as f64 / wall_s.max(1e-9),
        ttft_ms_median: first[first.len() / 2],
    })
}

/// One answer: its tokens, the time from `start` to its first token and to its end.
fn answer(
    model: &Arc<ServedModel>,
    request: &GenerationRequest,
    batched: bool,
    start: Instant,
) -> Result<(usize, Duration, Duration)> {
    let mut first = None;
    let mut on_piece = |_| {
        first.get_or_insert_with(|| start.elapsed());
        true
    };
    let generated = match batched {
        true => model.generate(request, &mut on_piece)?,
        false => model.generate_alone(request, &mut on_piece)?,
    };
    let took = start.elapsed();
    Ok((generated.tokens, first.unwrap_or(took), took))
}
