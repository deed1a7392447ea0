//! The training run: from a [`TrainSpec`] to a PEFT adapter, resumable at every checkpoint.
//!
//! One optimiser step = `gradient_accumulation_steps` micro-batches, each forward +
//! backward, gradients summed with token weighting (every micro-batch loss is divided by
//! the labelled-token count of the whole step, as Hugging Face does), clipped by global
//! norm, then one AdamW update at the scheduled learning rate. Which examples form a step
//! follows from the seed, the epoch and the step number alone, so a run restarted from a
//! checkpoint replays the same trajectory bit for bit (same thread count).

use crate::batch::{self, Batch, make_batch, streams};
use crate::checkpoint::{self, RngState, TrainerState};
use crate::data::{Encoder, Example, ParsedDataset, Record};
use crate::error::{Error, Result};
use crate::lora::{DropoutCtx, LoraSettings};
use crate::model::Llama;
use crate::optim::{AdamW, AdamWConfig, global_norm};
use crate::progress::ProgressSink;
use crate::remote::Storage;
use crate::schedule::LrSchedule;
use candle_core::{DType, Device, Tensor};
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;
use tuneq_openapi::{StepMetrics, TrainEvent, TrainSpec};

/// How a run ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Training finished; the adapter is in the output.
    Finished {
        /// Optimiser steps.
        steps: u64,
        /// Final validation loss, when a validation file was given.
        validation_loss: Option<f64>,
    },
    /// A stop was requested; a checkpoint at `step` was committed.
    Interrupted {
        /// The checkpoint's step.
        step: u64,
    },
}

/// The compute device for a spec, or a clear error where it is not available.
pub fn select_device(kind: tuneq_openapi::DeviceKind) -> Result<Device> {
    match kind {
        tuneq_openapi::DeviceKind::Cpu => Ok(Device::Cpu),
        tuneq_openapi::DeviceKind::Cuda => {
            if cfg!(feature = "cuda") {
                Device::new_cuda(0).map_err(|e| Error::Device(format!("CUDA device 0: {e}")))
            } else {
                Err(Error::Device(
                    "this tuneq was built without CUDA; rebuild with `--features cuda`".into(),
                ))
            }
        }
    }
}

/// Whether this build has CUDA support and a CUDA device 0 answers.
pub fn cuda_available() -> bool {
    cfg!(feature = "cuda") && Device::new_cuda(0).is_ok()
}

/// The dtype the frozen weights are held in on `device` (`auto`: bf16 on CUDA, f32 on
/// the CPU). With bf16 on the CPU they are stored in bf16 and widened exactly where the
/// fused step uses them (f32 compute at half the weights' memory); on CUDA candle's
/// graph computes in bf16.
pub fn select_dtype(spec: &TrainSpec, device: &Device) -> DType {
    match spec.weights_dtype(device.is_cuda()) {
        tuneq_openapi::DtypeKind::Bf16 => DType::BF16,
        _ => DType::F32,
    }
}

/// LoRA settings of a spec.
pub fn lora_settings(spec: &TrainSpec) -> LoraSettings {
    LoraSettings {
        r: spec.lora.r as usize,
        alpha: spec.lora.alpha,
        dropout: spec.lora.dropout,
        targets: spec.lora.target_modules.clone(),
        rslora: spec.lora.rslora,
    }
}

/// Tokenised data of one or more files.
pub struct EncodedData {
    /// Examples that carry at least one label.
    pub examples: Vec<Example>,
    /// Records, parallel to the files' order (for sample prompts).
    pub records: Vec<Record>,
    /// Detected or given format of the first file.
    pub format: tuneq_openapi::DatasetFormat,
    /// Examples that were cut to `max_seq_len`.
    pub truncated: usize,
    /// Examples dropped because nothing was left to learn after truncation.
    pub dropped: usize,
    /// SHA-256 of each file, in order.
    pub sha256: Vec<String>,
}

/// Reads, validates and tokenises `files`. Every bad line of every file is reported.
pub fn encode_files(
    encoder: &Encoder,
    files: &[PathBuf],
    format: tuneq_openapi::DatasetFormat,
    max_len: usize,
) -> Result<EncodedData> {
    let mut parsed: Vec<ParsedDataset> = Vec::new();
    let mut errors = Vec::new();
    for f in files {
        match crate::data::read_jsonl(f, format) {
            Ok(p) => parsed.push(p),
            Err(e) => errors.push(e),
        }
    }
    match errors.len() {
        0 => {}
        1 => return Err(Error::Data(errors.remove(0))),
        _ => return Err(Error::Datasets(errors)),
    }
    let mut out = EncodedData {
        examples: Vec::new(),
        records: Vec::new(),
        format: parsed.first().map(|p| p.format).unwrap_or(format),
        truncated: 0,
        dropped: 0,
        sha256: files
            .iter()
            .map(|f| checkpoint::sha256_file(f))
            .collect::<Result<_>>()?,
    };
    for p in parsed {
        for r in p.records {
            let (ex, full_len) = encoder.encode_with_length(&r, max_len)?;
            if full_len > max_len {
                out.truncated += 1;
            }
            if ex.labels.iter().skip(1).any(|&l| l >= 0) {
                out.examples.push(ex);
                out.records.push(r);
            } else {
                out.dropped += 1;
            }
        }
    }
    Ok(out)
}

/// Everything that determines the trajectory, hashed: a checkpoint from a different spec,
/// dataset or model is never resumed.
#[derive(Serialize)]
struct Fingerprint<'a> {
    hyperparameters: &'a tuneq_openapi::Hyperparameters,
    lora: &'a tuneq_openapi::LoraSpec,
    dataset_format: tuneq_openapi::DatasetFormat,
    chat_template: tuneq_openapi::ChatTemplateChoice,
    dtype: tuneq_openapi::DtypeKind,
    /// Left out when f32, so that fingerprints from before the field stay the same.
    #[serde(skip_serializing_if = "tuneq_openapi::ComputeKind::is_f32")]
    compute: tuneq_openapi::ComputeKind,
    train_sha256: &'a [String],
    model_sha256: &'a str,
}

/// SHA-256 over the model's config and weight files (the base model's identity).
pub fn model_sha256(model_dir: &Path) -> Result<String> {
    let mut h = Sha256::new();
    let mut files = vec![model_dir.join("config.json")];
    files.extend(crate::weights::weight_files(model_dir)?);
    for f in files {
        h.update(checkpoint::sha256_file(&f)?.as_bytes());
    }
    Ok(hex::encode(h.finalize()))
}

/// Requests a checkpoint-and-exit (SIGTERM/SIGINT handlers set it).
#[derive(Debug, Clone, Default)]
pub struct StopFlag(Arc<AtomicBool>);

impl StopFlag {
    /// A flag that is not set.
    pub fn new() -> Self {
        Self::default()
    }
    /// The shared atomic, for signal handlers.
    pub fn atomic(&self) -> Arc<AtomicBool> {
        self.0.clone()
    }
    /// Whether a stop was requested.
    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
    /// Requests a stop.
    pub fn set(&self) {
        self.0.store(true, Ordering::SeqCst)
    }
}

/// Loss and gradients of one optimiser step.
pub struct StepResult {
    /// Mean loss over labelled tokens.
    pub loss: f64,
    /// Summed gradients, one per trainable tensor.
    pub grads: Vec<Tensor>,
    /// Non-padding tokens.
    pub tokens: usize,
}

/// Dropout for one optimiser step: the probability, the step's stream, and optionally
/// where to record the masks drawn (see [`DropoutCtx::record`]).
pub struct StepDropout<'a> {
    /// Probability of zeroing a LoRA input element.
    pub p: f64,
    /// The step's stream.
    pub rng: &'a mut rand_chacha::ChaCha20Rng,
    /// Receives every mask, micro-batch by micro-batch.
    pub record: Option<&'a mut Vec<Tensor>>,
}

/// Runs forward and backward over `batches` (the micro-batches of one step), on the
/// model's compute path ([`crate::fast::ComputePath::for_model`]).
pub fn accumulate(
    model: &Llama,
    batches: &[Batch],
    dropout: Option<StepDropout<'_>>,
) -> Result<StepResult> {
    match crate::fast::ComputePath::for_model(model) {
        crate::fast::ComputePath::CpuFused => crate::fast::accumulate(model, batches, dropout),
        crate::fast::ComputePath::Graph => accumulate_on_graph(model, batches, dropout),
    }
}

/// [`accumulate`] through candle's autograd graph (the CUDA path and the test oracle).
pub fn accumulate_on_graph(
    model: &Llama,
    batches: &[Batch],
    mut dropout: Option<StepDropout<'_>>,
) -> Result<StepResult> {
    let vars = model.lora_vars();
    let denom = batches.iter().map(|b| b.labelled).sum::<usize>().max(1) as f64;
    let mut grads: Vec<Option<Tensor>> = vec![None; vars.len()];
    let mut loss = 0f64;
    let mut tokens = 0;
    for b in batches {
        if b.packing.is_some() {
            return Err(Error::Model {
                path: "training step".into(),
                message: "a packed batch reached candle's graph, which has no block-diagonal mask"
                    .into(),
            });
        }
        let ids = Tensor::from_vec(b.ids.clone(), (b.rows, b.len), model.device())?;
        let dropout = dropout.as_mut().filter(|d| d.p > 0.0);
        let l = if model.checkpoint_layers {
            checkpointed_on_graph(model, &ids, b, denom, dropout, &vars, &mut grads)?
        } else {
            let mut ctx = dropout.map(|d| DropoutCtx {
                p: d.p,
                rng: &mut *d.rng,
                record: d.record.as_deref_mut(),
                replay: None,
            });
            let hidden = model.hidden_states(&ids, ctx.as_mut())?;
            let logits = model.logits(&hidden)?;
            let l = crate::ops::masked_cross_entropy(&logits, &b.targets, denom)?;
            let mut store = l.backward()?;
            add_grads(&mut grads, &vars, &mut store)?;
            l.to_scalar::<f32>()?
        };
        loss += l as f64;
        tokens += b.tokens;
    }
    let grads = grads
        .into_iter()
        .zip(&vars)
        .map(|(g, v)| g.map_or_else(|| v.var.as_tensor().zeros_like(), Ok))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(StepResult {
        loss,
        grads,
        tokens,
    })
}

/// Adds the gradients `store` holds for `vars` into `grads`.
fn add_grads(
    grads: &mut [Option<Tensor>],
    vars: &[crate::model::NamedVar],
    store: &mut candle_core::backprop::GradStore,
) -> Result<()> {
    for (slot, v) in grads.iter_mut().zip(vars) {
        let g = store.remove(v.var.as_tensor());
        *slot = match (slot.take(), g) {
            (Some(acc), Some(g)) => Some((acc + g)?),
            (None, g) => g,
            (acc, None) => acc,
        };
    }
    Ok(())
}

/// One micro-batch on candle's graph with per-layer activation checkpointing, for the
/// CUDA path (and the CPU graph): the forward keeps only each layer's input and the
/// dropout masks it drew, dropping the layer's graph; the backward reruns each layer in
/// reverse on its stored input with the same masks and backpropagates
/// `sum(layer(x) ∘ g)`, whose gradient is the layer's with `g` arriving from above.
/// Returns the micro-batch's loss; adds its gradients into `grads`.
fn checkpointed_on_graph(
    model: &Llama,
    ids: &Tensor,
    b: &Batch,
    denom: f64,
    mut dropout: Option<&mut StepDropout<'_>>,
    vars: &[crate::model::NamedVar],
    grads: &mut [Option<Tensor>],
) -> Result<f32> {
    let (cos, sin) = model.rope_prefix(b.len)?;
    let lowest = model
        .layers
        .iter()
        .position(|l| l.projections.iter().any(|p| p.lora.is_some()))
        .unwrap_or(model.layers.len());
    let mut x = model.embed(ids)?.detach();
    let mut inputs = Vec::with_capacity(model.layers.len());
    let mut masks: Vec<Vec<Tensor>> = Vec::with_capacity(model.layers.len());
    for layer in &model.layers {
        let mut drawn = Vec::new();
        let mut ctx = dropout.as_mut().map(|d| DropoutCtx {
            p: d.p,
            rng: &mut *d.rng,
            record: Some(&mut drawn),
            replay: None,
        });
        let y = model.layer_forward(layer, &x, (&cos, &sin), ctx.as_mut(), None)?;
        if let Some(record) = dropout.as_mut().and_then(|d| d.record.as_deref_mut()) {
            record.extend(drawn.iter().cloned());
        }
        inputs.push(x);
        masks.push(drawn);
        // Detached: the layer's graph (every intermediate it made) is dropped here.
        x = y.detach();
    }
    let top = candle_core::Var::from_tensor(&x)?;
    let logits = model.logits(&model.final_norm(top.as_tensor())?)?;
    let l = crate::ops::masked_cross_entropy(&logits, &b.targets, denom)?;
    let mut store = l.backward()?;
    let Some(mut g) = store.remove(top.as_tensor()) else {
        return Ok(l.to_scalar::<f32>()?);
    };
    for (i, layer) in model.layers.iter().enumerate().rev() {
        if i < lowest {
            break;
        }
        let input = candle_core::Var::from_tensor(&inputs[i])?;
        let mut replay: std::collections::VecDeque<Tensor> = std::mem::take(&mut masks[i]).into();
        let mut ctx = dropout.as_mut().map(|d| DropoutCtx {
            p: d.p,
            rng: &mut *d.rng,
            record: None,
            replay: Some(&mut replay),
        });
        let y = model.layer_forward(layer, input.as_tensor(), (&cos, &sin), ctx.as_mut(), None)?;
        let surrogate = (y * g.detach())?.sum_all()?;
        let mut store = surrogate.backward()?;
        add_grads(grads, vars, &mut store)?;
        match store.remove(input.as_tensor()) {
            Some(next) => g = next,
            None => break,
        }
    }
    Ok(l.to_scalar::<f32>()?)
}

/// What one optimiser step did.
#[derive(Debug, Clone, Copy)]
pub struct Stepped {
    /// Mean loss over the step's labelled tokens (before the update).
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Non-padding tokens.
    pub tokens: usize,
}

/// One optimiser step: forward and backward over the micro-batches, clipping by global
/// norm (`max_grad_norm` ≤ 0 turns it off, as in Hugging Face), then AdamW at `lr`.
/// A non-finite loss is refused before anything is updated.
pub fn optimiser_step(
    model: &Llama,
    opt: &mut AdamW,
    batches: &[Batch],
    dropout: Option<StepDropout<'_>>,
    max_grad_norm: f64,
    lr: f64,
) -> Result<Stepped> {
    let r = accumulate(model, batches, dropout)?;
    if !r.loss.is_finite() {
        return Err(Error::Diverged {
            step: opt.step_count() + 1,
            loss: r.loss,
        });
    }
    let grad_norm = global_norm(&r.grads)?;
    let clip = if max_grad_norm > 0.0 {
        (max_grad_norm / (grad_norm + 1e-6)).min(1.0)
    } else {
        1.0
    };
    opt.step(&r.grads, lr, clip)?;
    Ok(Stepped {
        loss: r.loss,
        grad_norm,
        tokens: r.tokens,
    })
}

/// Mean loss over every labelled token of `examples`, without dropout.
pub fn evaluate(
    model: &Llama,
    examples: &[Example],
    batch_size: usize,
    pad_id: u32,
) -> Result<f64> {
    let total: usize = examples
        .iter()
        .map(|e| e.labels.iter().skip(1).filter(|&&l| l >= 0).count())
        .sum();
    if total == 0 {
        return Ok(f64::NAN);
    }
    let fused = crate::fast::ComputePath::for_model(model) == crate::fast::ComputePath::CpuFused;
    let mut loss = 0f64;
    for chunk in examples.chunks(batch_size.max(1)) {
        let refs: Vec<&Example> = chunk.iter().collect();
        if fused {
            let b = crate::batch::pack_batch(&refs, pad_id);
            loss += crate::fast::loss(model, &b, total as f64)? as f32 as f64;
            continue;
        }
        let b = make_batch(&refs, pad_id);
        let ids = Tensor::from_vec(b.ids.clone(), (b.rows, b.len), model.device())?;
        let hidden = model.hidden_states(&ids, None)?;
        let l =
            crate::ops::masked_cross_entropy(&model.logits(&hidden)?, &b.targets, total as f64)?;
        loss += l.to_scalar::<f32>()? as f64;
    }
    Ok(loss)
}

/// Optimiser steps per epoch and in total for `n` examples.
pub fn plan(n: usize, spec: &TrainSpec) -> (u64, u64) {
    let h = &spec.hyperparameters;
    let micro = n.div_ceil(h.batch_size as usize) as u64;
    let per_epoch = micro.div_ceil(h.gradient_accumulation_steps as u64).max(1);
    let total = per_epoch * h.epochs as u64;
    (per_epoch, h.max_steps.map_or(total, |m| m.min(total)))
}

/// The final record of a run, `manifest.json` in the output.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct RunManifest {
    /// `succeeded`.
    pub status: String,
    /// The spec as run.
    pub spec: TrainSpec,
    /// Base model identity.
    pub base_model: Lineage,
    /// Training files' identity.
    pub training_files: Vec<Lineage>,
    /// Validation file identity.
    pub validation_file: Option<Lineage>,
    /// Seed.
    pub seed: u64,
    /// Run fingerprint (equal fingerprints train identical adapters).
    pub fingerprint: String,
    /// Final figures.
    pub metrics: FinalMetrics,
    /// Files of the adapter and their digests.
    pub adapter_files: Vec<checkpoint::ManifestEntry>,
    /// tuneq version.
    pub trainer_version: String,
}

/// A location and its SHA-256.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct Lineage {
    /// Where it was read from.
    pub location: String,
    /// Hex SHA-256 (for a model: over config.json and weight files).
    pub sha256: String,
}

/// Final figures of a run.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct FinalMetrics {
    /// Optimiser steps.
    pub steps: u64,
    /// Loss of the last step.
    pub train_loss: Option<f64>,
    /// Validation loss before training (the base model with a zero LoRA update).
    pub base_validation_loss: Option<f64>,
    /// Validation loss after training.
    pub validation_loss: Option<f64>,
    /// Non-padding tokens processed.
    pub trained_tokens: u64,
    /// Training examples.
    pub train_examples: u64,
    /// Validation examples.
    pub validation_examples: u64,
}

fn json_line<T: Serialize>(v: &T) -> Result<String> {
    serde_json::to_string(v).map_err(|source| Error::Json {
        path: "metrics".into(),
        source,
    })
}

/// Appends lines to `metrics.jsonl`, first cutting it back to `keep_through` steps on resume.
struct MetricsFile {
    path: PathBuf,
}

impl MetricsFile {
    fn open(output: &Path, keep_through: u64) -> Result<Self> {
        let path = output.join("metrics.jsonl");
        let kept: Vec<String> = match std::fs::read_to_string(&path) {
            Ok(s) => s
                .lines()
                .filter(|l| {
                    serde_json::from_str::<serde_json::Value>(l)
                        .ok()
                        .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
                        .is_some_and(|s| s <= keep_through)
                })
                .map(|l| format!("{l}\n"))
                .collect(),
            Err(_) => Vec::new(),
        };
        tuneq_storage::local::write_atomic(&path, kept.concat().as_bytes())?;
        Ok(Self { path })
    }

    fn append(&self, line: &str) -> Result<()> {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&self.path)
            .map_err(Error::io(&self.path))?;
        writeln!(f, "{line}").map_err(Error::io(&self.path))
    }
}

/// Computes validation loss after `step` and records it in `metrics.jsonl` and the progress stream.
fn validate(
    model: &Llama,
    examples: &[Example],
    batch_size: usize,
    pad_id: u32,
    step: u64,
    metrics: &MetricsFile,
    sink: &mut dyn ProgressSink,
) -> Result<f64> {
    let loss = evaluate(model, examples, batch_size, pad_id)?;
    metrics.append(&json_line(
        &serde_json::json!({"step": step, "validation_loss": loss}),
    )?)?;
    sink.event(&TrainEvent::Eval {
        step,
        validation_loss: loss,
    });
    Ok(loss)
}

mod run;

pub use run::run_with;

/// Runs `spec` with local files and the default storage settings (see [`run_with`]).
pub fn run(spec: &TrainSpec, sink: &mut dyn ProgressSink, stop: &StopFlag) -> Result<Outcome> {
    let storage = Storage::new(
        tuneq_storage::StorageConfig::default(),
        Storage::default_cache_dir(),
    )?;
    run_with(spec, &storage, sink, stop)
}
