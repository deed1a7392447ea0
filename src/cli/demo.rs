//! `tuneq train --demo`: a complete fine-tune with nothing but the binary — a tiny random
//! Llama written on first use and a small synthetic task shipped inside the binary.

use anyhow::{Context, Result};
use std::path::PathBuf;

const DEMO_TRAIN: &str = include_str!("../../examples/data/tiny-task-train.jsonl");
const DEMO_VALIDATION: &str = include_str!("../../examples/data/tiny-task-val.jsonl");

/// The demo's working folder: `$TUNEQ_DEMO_DIR`, or `.tuneq/demo` in the current directory.
fn demo_dir() -> PathBuf {
    std::env::var_os("TUNEQ_DEMO_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(".tuneq/demo"))
}

/// Prepares the demo model, data and spec file, and returns the spec file's path: the
/// ordinary path then reads it as it would any `--spec`, so every flag overrides it.
pub fn prepare() -> Result<PathBuf> {
    let dir = demo_dir();
    let model = dir.join("model");
    if !model.join("config.json").is_file() {
        eprintln!("writing the tiny demo model to {}", model.display());
        tuneq_trainer::init::write_model(&tuneq_trainer::init::InitOptions::demo(), &model)?;
    }
    let data = dir.join("data");
    std::fs::create_dir_all(&data).with_context(|| format!("cannot create {}", data.display()))?;
    std::fs::write(data.join("train.jsonl"), DEMO_TRAIN)?;
    std::fs::write(data.join("validation.jsonl"), DEMO_VALIDATION)?;
    let spec = serde_json::json!({
        "model": model.display().to_string(),
        "training_file": data.join("train.jsonl").display().to_string(),
        "validation_file": data.join("validation.jsonl").display().to_string(),
        "output": dir.join("output").display().to_string(),
        "hyperparameters": {"epochs": 4, "batch_size": 8, "learning_rate": 2e-3, "warmup_steps": 5, "max_seq_len": 128, "seed": 0},
        "lora": {"r": 8, "alpha": 16.0},
        "checkpoint": {"every_steps": 25},
        "sampling": {"num_samples": 4, "max_new_tokens": 24}
    });
    let spec_path = dir.join("spec.json");
    std::fs::write(&spec_path, serde_json::to_vec_pretty(&spec)?)?;
    Ok(spec_path)
}
