//! Answering chat requests (`/v1/chat/completions`): how many answers are generated at
//! once and how many models stay loaded.

use anyhow::Result;
use clap::Args;
use std::path::PathBuf;

/// The inference settings of a server that answers chat requests.
#[derive(Debug, Clone, Args)]
pub struct InferenceArgs {
    /// Answers generated at once at most; more are refused with 429 and `Retry-After`.
    #[arg(long, env = "TUNEQ_MAX_GENERATIONS", default_value_t = 8)]
    max_generations: usize,
    /// Answers one tenant may have generated at once; more of its requests are refused
    /// with 429 and `Retry-After` while other tenants still get slots. Default: all of
    /// `--max-generations` (one tenant may use every slot); a server shared by tenants
    /// sets it lower so that one tenant's burst cannot take every slot.
    #[arg(long, env = "TUNEQ_MAX_GENERATIONS_PER_TENANT")]
    max_generations_per_tenant: Option<usize>,
    /// Models (a base model with or without an adapter) kept loaded; others are loaded
    /// when asked for, the least recently used one giving way.
    #[arg(long, env = "TUNEQ_RESIDENT_MODELS", default_value_t = 4)]
    resident_models: usize,
    /// Answers of one model decoded together, one token each per batched step (1: each
    /// answer alone).
    #[arg(long, env = "TUNEQ_MAX_BATCH", default_value_t = 8)]
    max_batch: usize,
    /// Tokens one answer may have at most: a request without `max_tokens` gets up to
    /// this (or what the model's context leaves); one asking for more is refused.
    #[arg(long, env = "TUNEQ_MAX_ANSWER_TOKENS", default_value_t = 4096)]
    max_answer_tokens: usize,
    /// Adapters from the object store kept on local disk (in the cache folder) for the
    /// fine-tuned models answered most recently; the others' files are deleted and
    /// fetched again when asked for.
    #[arg(long, env = "TUNEQ_STAGED_ADAPTERS", default_value_t = 64)]
    staged_adapters: usize,
}

impl InferenceArgs {
    /// Inference staging remote models and adapters with `storage` into `cache`.
    pub fn inference(
        &self,
        storage: tuneq_storage::StorageConfig,
        cache: PathBuf,
    ) -> Result<tuneq_api::inference::Inference> {
        let per_tenant = self
            .max_generations_per_tenant
            .unwrap_or(self.max_generations);
        let counts = [
            self.max_generations,
            per_tenant,
            self.resident_models,
            self.max_batch,
            self.max_answer_tokens,
            self.staged_adapters,
        ];
        if counts.contains(&0) {
            anyhow::bail!(super::super::BadInput(
                "--max-generations, --max-generations-per-tenant, --resident-models, --max-batch, --max-answer-tokens and --staged-adapters must be at least 1".into()
            ));
        }
        let engine = tuneq_serve::EngineConfig {
            max_concurrent: self.max_generations,
            max_per_tenant: per_tenant,
            resident_models: self.resident_models,
            max_batch: self.max_batch,
            max_answer_tokens: self.max_answer_tokens,
        };
        let staging = tuneq_serve::Staging::new(storage, cache, self.staged_adapters)?;
        Ok(tuneq_api::inference::Inference::new(engine, staging))
    }
}
