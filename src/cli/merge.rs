//! `tuneq merge`: write a model with the adapter folded into its weights.

use anyhow::Result;
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args)]
pub struct MergeArgs {
    /// Base model folder.
    #[arg(long)]
    model: PathBuf,
    /// PEFT adapter folder.
    #[arg(long)]
    adapter: PathBuf,
    /// Output folder for the merged model.
    #[arg(long)]
    out: PathBuf,
}

pub fn run(args: MergeArgs) -> Result<ExitCode> {
    let n = tuneq_trainer::merge::merge(&args.model, &args.adapter, &args.out)?;
    println!(
        "{}",
        serde_json::json!({"merged_projections": n, "out": args.out.display().to_string()})
    );
    Ok(ExitCode::SUCCESS)
}
