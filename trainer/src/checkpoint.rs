//! Checkpoints: everything needed to continue a run exactly where it stopped.
//!
//! A checkpoint is a folder `checkpoints/step-NNNNNNNN/` holding the PEFT adapter,
//! the optimiser moments (`optimizer.safetensors`), and `trainer_state.json` (step,
//! data cursor, RNG streams, run fingerprint). It is written into a hidden temporary
//! folder, its `manifest.json` (sizes and SHA-256 of every file) is written last, and
//! the folder is renamed into place. Resume takes only folders whose manifest exists
//! and whose files match it, so a trainer killed mid-write leaves nothing resume would take.

use crate::error::{Error, Result};
use crate::lora::LoraSettings;
use crate::model::Llama;
use crate::optim::AdamW;
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Folder (under the output) that holds checkpoints.
pub const CHECKPOINTS_DIR: &str = tuneq_storage::layout::CHECKPOINTS_DIR;
const STATE_FILE: &str = "trainer_state.json";
const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const MANIFEST_FILE: &str = "manifest.json";

/// The resumable state besides tensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimiser steps completed.
    pub global_step: u64,
    /// The epoch the next step belongs to (data cursor: with `global_step` it fixes the next batch).
    pub epoch: u32,
    /// Non-padding tokens processed so far.
    pub tokens_seen: u64,
    /// Training loss of the last step.
    pub last_loss: Option<f64>,
    /// Fingerprint of everything that determines the trajectory (spec, data, model).
    pub fingerprint: String,
    /// RNG streams: ChaCha20 with `seed`; stream numbers are derived from the step and epoch.
    pub rng: RngState,
    /// Compute threads; the summation order of CPU kernels depends on it.
    pub threads: usize,
    /// The compute path, GEMM library and CPU features (absent in checkpoints written
    /// before tuneq recorded them).
    #[serde(default)]
    pub compute: Option<crate::compute::ComputeEnv>,
    /// Version of the trainer that wrote it.
    pub trainer_version: String,
    /// Early stopping's watch so far (absent when the run does not stop early, or has
    /// not validated yet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub early_stopping: Option<EarlyStopState>,
}

/// Where early stopping stands: the best validation so far and the validations since.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EarlyStopState {
    /// The best validated step (its checkpoint is kept whatever `keep_last` says).
    pub best_step: u64,
    /// Its validation loss.
    pub best_loss: f64,
    /// Validations since then that did not improve on it.
    pub without_improvement: u32,
}

/// How every random draw of a run can be replayed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RngState {
    /// Always `chacha20`.
    pub algorithm: String,
    /// The run's seed.
    pub seed: u64,
    /// Shuffle stream of the next epoch.
    pub shuffle_stream: u64,
    /// Dropout stream of the next step.
    pub dropout_stream: u64,
}

/// One file of a committed checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ManifestEntry {
    /// File name inside the checkpoint folder.
    pub name: String,
    /// Bytes.
    pub size: u64,
    /// Hex SHA-256.
    pub sha256: String,
}

/// Written last; its presence is what makes a checkpoint complete.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointManifest {
    /// Optimiser steps completed.
    pub step: u64,
    /// Every file and its digest.
    pub files: Vec<ManifestEntry>,
}

/// A complete checkpoint read back from disk.
pub struct LoadedCheckpoint {
    /// Its folder.
    pub dir: PathBuf,
    /// Scalars and cursor.
    pub state: TrainerState,
    /// Adapter tensors by PEFT key.
    pub adapter: HashMap<String, Tensor>,
    /// Optimiser moments.
    pub optimizer: HashMap<String, Tensor>,
}

/// Hex SHA-256 of a file, streamed.
pub fn sha256_file(path: &Path) -> Result<String> {
    tuneq_pools::folder::sha256_file(path).map_err(|e| match e {
        tuneq_pools::folder::FolderError::Io { source, .. } => Error::io(path)(source),
        other => Error::Model {
            path: path.display().to_string(),
            message: other.to_string(),
        },
    })
}

fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// Writes and commits the checkpoint for `state.global_step`; returns its folder.
pub fn write(
    output: &Path,
    model: &Llama,
    settings: &LoraSettings,
    base: &str,
    optimizer: &AdamW,
    state: &TrainerState,
) -> Result<PathBuf> {
    let root = output.join(CHECKPOINTS_DIR);
    let name = step_dir_name(state.global_step);
    let final_dir = root.join(&name);
    let tmp = root.join(format!(".tmp-{name}-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(Error::io(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(Error::io(&tmp))?;
    crate::peft::save_adapter(model, settings, base, &tmp)?;
    crate::weights::save_safetensors(&tmp.join(OPTIMIZER_FILE), &optimizer.state_tensors())?;
    let state_json = serde_json::to_vec_pretty(state).map_err(|source| Error::Json {
        path: STATE_FILE.into(),
        source,
    })?;
    tuneq_storage::local::write_atomic(&tmp.join(STATE_FILE), &state_json)?;
    let mut files = Vec::new();
    for f in [
        crate::peft::ADAPTER_CONFIG,
        crate::peft::ADAPTER_WEIGHTS,
        OPTIMIZER_FILE,
        STATE_FILE,
    ] {
        let p = tmp.join(f);
        let size = std::fs::metadata(&p).map_err(Error::io(&p))?.len();
        files.push(ManifestEntry {
            name: f.to_string(),
            size,
            sha256: sha256_file(&p)?,
        });
    }
    let manifest = CheckpointManifest {
        step: state.global_step,
        files,
    };
    let json = serde_json::to_vec_pretty(&manifest).map_err(|source| Error::Json {
        path: MANIFEST_FILE.into(),
        source,
    })?;
    tuneq_storage::local::write_atomic(&tmp.join(MANIFEST_FILE), &json)?;
    if final_dir.exists() {
        std::fs::remove_dir_all(&final_dir).map_err(Error::io(&final_dir))?;
    }
    std::fs::rename(&tmp, &final_dir).map_err(Error::io(&final_dir))?;
    sync_dir(&root);
    Ok(final_dir)
}

fn sync_dir(dir: &Path) {
    // Makes the rename durable; failure only weakens durability, never correctness of resume.
    if let Ok(f) = std::fs::File::open(dir) {
        let _ = f.sync_all();
    }
}

/// Complete checkpoints under `output`, newest first (incomplete or damaged ones skipped).
pub fn complete_checkpoints(output: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let root = output.join(CHECKPOINTS_DIR);
    let entries = match std::fs::read_dir(&root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(Error::Io {
                path: root.display().to_string(),
                source,
            });
        }
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(Error::io(&root))?;
        let name = entry.file_name().to_string_lossy().to_string();
        let Some(step) = name
            .strip_prefix("step-")
            .and_then(|s| s.parse::<u64>().ok())
        else {
            continue;
        };
        if entry.path().join(MANIFEST_FILE).is_file() {
            out.push((step, entry.path()));
        }
    }
    out.sort_by_key(|c| std::cmp::Reverse(c.0));
    Ok(out)
}

/// Checks a checkpoint folder's files against its manifest.
fn verify(dir: &Path) -> std::result::Result<CheckpointManifest, String> {
    let bytes = std::fs::read(dir.join(MANIFEST_FILE)).map_err(|e| e.to_string())?;
    let manifest: CheckpointManifest = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
    for f in &manifest.files {
        let p = dir.join(&f.name);
        let size = std::fs::metadata(&p)
            .map_err(|e| format!("{}: {e}", f.name))?
            .len();
        if size != f.size {
            return Err(format!(
                "{} has {size} bytes, manifest says {}",
                f.name, f.size
            ));
        }
        if sha256_file(&p).map_err(|e| e.to_string())? != f.sha256 {
            return Err(format!("{} does not match its SHA-256", f.name));
        }
    }
    Ok(manifest)
}

/// The newest checkpoint that is complete and intact. Damaged ones are reported through
/// `warn` and skipped.
pub fn latest(
    output: &Path,
    device: &Device,
    mut warn: impl FnMut(String),
) -> Result<Option<LoadedCheckpoint>> {
    for (_, dir) in complete_checkpoints(output)? {
        if let Err(why) = verify(&dir) {
            warn(format!(
                "skipping damaged checkpoint {}: {why}",
                dir.display()
            ));
            continue;
        }
        let state: TrainerState = crate::error::read_json(&dir.join(STATE_FILE))?;
        let adapter =
            crate::weights::load_safetensors(&dir.join(crate::peft::ADAPTER_WEIGHTS), device)?;
        let optimizer = crate::weights::load_safetensors(&dir.join(OPTIMIZER_FILE), device)?;
        return Ok(Some(LoadedCheckpoint {
            dir,
            state,
            adapter,
            optimizer,
        }));
    }
    Ok(None)
}

/// The adapter tensors of the checkpoint of `step`, verified, with its folder.
///
/// # Errors
/// [`Error::Checkpoint`] when there is no such complete checkpoint or it is damaged.
pub fn adapter_of_step(
    output: &Path,
    step: u64,
    device: &Device,
) -> Result<(PathBuf, HashMap<String, Tensor>)> {
    let dir = output.join(CHECKPOINTS_DIR).join(step_dir_name(step));
    verify(&dir).map_err(|message| Error::Checkpoint {
        path: dir.display().to_string(),
        message,
    })?;
    let adapter =
        crate::weights::load_safetensors(&dir.join(crate::peft::ADAPTER_WEIGHTS), device)?;
    Ok((dir, adapter))
}

/// Deletes all but the newest `keep` complete checkpoints and the one of step `protect`
/// (early stopping's best), and stale temporary folders.
pub fn prune(output: &Path, keep: usize, protect: Option<u64>) -> Result<()> {
    let old = complete_checkpoints(output)?.into_iter().skip(keep);
    for (_, dir) in old.filter(|(step, _)| Some(*step) != protect) {
        std::fs::remove_dir_all(&dir).map_err(Error::io(&dir))?;
    }
    let root = output.join(CHECKPOINTS_DIR);
    if let Ok(entries) = std::fs::read_dir(&root) {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with(".tmp-") {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    Ok(())
}
