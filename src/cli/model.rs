//! `tuneq model …`: model utilities.

use anyhow::Result;
use clap::Subcommand;
use std::path::PathBuf;
use std::process::ExitCode;
use tuneq_trainer::init::{InitOptions, Preset};

#[derive(Subcommand)]
pub enum ModelCommand {
    /// Write a Hugging Face–layout Llama with random weights and a real BPE tokenizer.
    Init {
        /// Size: tiny (≈5 M parameters), small (≈134 M) or smollm2-135m (SmolLM2-135M's
        /// shape, tied embeddings).
        #[arg(long, default_value = "tiny")]
        preset: Preset,
        /// Seed of the random weights.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Output folder.
        #[arg(long)]
        out: PathBuf,
        /// Split the weights into this many safetensors shards (with an index).
        #[arg(long, default_value_t = 1)]
        shards: usize,
        /// Share the embedding matrix with lm_head (no lm_head.weight).
        #[arg(long)]
        tie_embeddings: bool,
        /// Add a Llama 3 rope_scaling block to the config.
        #[arg(long)]
        llama3_rope: bool,
    },
}

pub fn run(cmd: ModelCommand) -> Result<ExitCode> {
    match cmd {
        ModelCommand::Init {
            preset,
            seed,
            out,
            shards,
            tie_embeddings,
            llama3_rope,
        } => {
            let opts = InitOptions {
                preset,
                seed,
                shards,
                tie_embeddings,
                llama3_rope,
            };
            let cfg = tuneq_trainer::init::write_model(&opts, &out)?;
            println!(
                "{}",
                serde_json::json!({
                    "model": out.display().to_string(),
                    "vocab_size": cfg.vocab_size,
                    "hidden_size": cfg.hidden_size,
                    "num_hidden_layers": cfg.num_hidden_layers,
                    "shards": shards,
                    "tie_word_embeddings": cfg.tie_word_embeddings,
                })
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}
