//! `tuneq bench …`: benchmarks whose last output line is one JSON object.

use anyhow::Result;
use clap::Subcommand;
use std::process::ExitCode;
use tuneq_trainer::bench::BenchOptions;
use tuneq_trainer::init::Preset;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// LoRA training throughput on a random model (compare with peer_lora_bench.py).
    Train {
        /// Model size.
        #[arg(long, default_value = "tiny")]
        preset: Preset,
        /// Sequences per step.
        #[arg(long, short = 'B', default_value_t = 4)]
        batch: usize,
        /// Tokens per sequence.
        #[arg(long, short = 'T', default_value_t = 256)]
        seq: usize,
        /// Timed steps.
        #[arg(long, short = 'N', default_value_t = 10)]
        steps: usize,
        /// Untimed warm-up steps.
        #[arg(long, default_value_t = 2)]
        warmup: usize,
        /// Learning rate.
        #[arg(long, default_value_t = 1e-4)]
        lr: f64,
        /// Seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
}

pub fn run(cmd: BenchCommand) -> Result<ExitCode> {
    match cmd {
        BenchCommand::Train {
            preset,
            batch,
            seq,
            steps,
            warmup,
            lr,
            seed,
        } => {
            let opts = BenchOptions {
                preset,
                batch,
                seq,
                steps,
                warmup,
                lr,
                seed,
            };
            let r = tuneq_trainer::bench::run(&opts, |line| eprintln!("{line}"))?;
            println!("{}", serde_json::to_string(&r)?);
        }
    }
    Ok(ExitCode::SUCCESS)
}
