//! `tuneq debug …`: reference computations for the PyTorch cross-checks in tests/reference.

use anyhow::Result;
use clap::Subcommand;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Subcommand)]
pub enum DebugCommand {
    /// Full-sequence logits for `input_ids` in a safetensors file.
    Logits {
        #[arg(long)]
        model: PathBuf,
        #[arg(long)]
        adapter: Option<PathBuf>,
        #[arg(long)]
        input_ids: PathBuf,
        #[arg(long)]
        out: PathBuf,
    },
    /// Loss (labels = input ids) and LoRA gradients of one batch.
    Grads {
        #[arg(long)]
        model: PathBuf,
        #[arg(long)]
        adapter: PathBuf,
        #[arg(long)]
        input_ids: PathBuf,
        #[arg(long)]
        out: PathBuf,
    },
}

pub fn run(cmd: DebugCommand) -> Result<ExitCode> {
    match cmd {
        DebugCommand::Logits {
            model,
            adapter,
            input_ids,
            out,
        } => {
            let m = tuneq_trainer::debug::load_model(&model, adapter.as_deref())?;
            tuneq_trainer::debug::write_logits(&m, &input_ids, &out)?;
        }
        DebugCommand::Grads {
            model,
            adapter,
            input_ids,
            out,
        } => {
            let m = tuneq_trainer::debug::load_model(&model, Some(&adapter))?;
            let loss = tuneq_trainer::debug::write_grads(&m, &input_ids, &out)?;
            println!("{}", serde_json::json!({"loss": loss}));
        }
    }
    Ok(ExitCode::SUCCESS)
}
