//! `tuneq queue`: maintenance of the embedded queue file.

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Subcommand)]
pub enum QueueCommand {
    /// Repair a damaged embedded queue file (one that `tuneq up` refuses with "is damaged
    /// at byte …"): copy it aside, keep every intact record and report what was
    /// dropped. Stop `tuneq up` first; restoring a backup loses less, if you have one.
    Repair(RepairArgs),
}

#[derive(Args)]
#[group(required = true, multiple = false)]
pub struct RepairArgs {
    /// The data directory of `tuneq up` (the queue file is `<data-dir>/queue.db`).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// The queue file itself.
    #[arg(long)]
    file: Option<PathBuf>,
}

pub fn run(command: QueueCommand) -> Result<ExitCode> {
    match command {
        QueueCommand::Repair(args) => repair(args),
    }
}

fn repair(args: RepairArgs) -> Result<ExitCode> {
    let file = match (args.file, args.data_dir) {
        (Some(file), _) => file,
        (None, Some(dir)) => dir.join(super::up::QUEUE_FILE),
        // clap's group requires one of them.
        (None, None) => anyhow::bail!("give --data-dir or --file"),
    };
    let report = tuneq_queue::embedded::repair(&file)
        .with_context(|| format!("cannot repair {}", file.display()))?;
    match &report.original_copy {
        None => eprintln!(
            "{}: nothing to repair ({} records, all intact)",
            file.display(),
            report.kept_records
        ),
        Some(copy) => eprintln!(
            "{}: repaired; kept {} intact records, dropped {} bytes in {} place(s); the \
             original is at {}. Records lost with the damage are gone: check the queue \
             (jobs, files) before relying on it.",
            file.display(),
            report.kept_records,
            report.dropped_bytes(),
            report.dropped.len(),
            copy.display()
        ),
    }
    let dropped: Vec<_> = report
        .dropped
        .iter()
        .map(|d| serde_json::json!({"start": d.start, "end": d.end, "records": d.records}))
        .collect();
    println!(
        "{}",
        serde_json::json!({
            "file": file.display().to_string(),
            "repaired": report.original_copy.is_some(),
            "original_copy": report.original_copy.as_ref().map(|p| p.display().to_string()),
            "kept_records": report.kept_records,
            "dropped_bytes": report.dropped_bytes(),
            "dropped": dropped,
        })
    );
    Ok(ExitCode::SUCCESS)
}
