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

/// The dtype for a spec on `device`: bf16 on CPU is refused because candle widens it to
/// f32 for every matmul (slower, no memory saved during compute).
pub fn select_dtype(kind: tuneq_openapi::DtypeKind, device: &Device) -> Result<DType> {
    match (kind, device.is_cpu()) {
        (tuneq_openapi::DtypeKind::F32, _) => Ok(DType::F32),
        (tuneq_openapi::DtypeKind::Bf16, false) => Ok(DType::BF16),
        (tuneq_openapi::DtypeKind::Bf16, true) => {
            Err(Error::Spec(vec![tuneq_openapi::SpecError {
                field: "dtype".into(),
                message: "bf16 is only supported on cuda; use f32 on cpu".into(),
            }]))
        }
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

/// Runs forward and backward over `batches` (the micro-batches of one step).
pub fn accumulate(
    model: &Llama,
    batches: &[Batch],
    dropout: Option<(f64, &mut rand_chacha::ChaCha20Rng)>,
) -> Result<StepResult> {
    let vars = model.lora_vars();
    let denom = batches.iter().map(|b| b.labelled).sum::<usize>().max(1) as f64;
    let mut grads: Vec<Option<Tensor>> = vec![None; vars.len()];
    let mut loss = 0f64;
    let mut tokens = 0;
    let mut dropout = dropout;
    for b in batches {
        let ids = Tensor::from_vec(b.ids.clone(), (b.rows, b.len), model.device())?;
        let mut ctx = dropout
            .as_mut()
            .filter(|(p, _)| *p > 0.0)
            .map(|(p, rng)| DropoutCtx { p: *p, rng });
        let hidden = model.hidden_states(&ids, ctx.as_mut())?;
        let logits = model.logits(&hidden)?;
        let l = crate::ops::masked_cross_entropy(&logits, &b.targets, denom)?;
        loss += l.to_scalar::<f32>()? as f64;
        let mut store = l.backward()?;
        for (slot, v) in grads.iter_mut().zip(&vars) {
            let g = store.remove(v.var.as_tensor());
            *slot = match (slot.take(), g) {
                (Some(acc), Some(g)) => Some((acc + g)?),
                (None, g) => g,
                (acc, None) => acc,
            };
        }
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
    let mut loss = 0f64;
    for chunk in examples.chunks(batch_size.max(1)) {
        let refs: Vec<&Example> = chunk.iter().collect();
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

/// Runs `spec` with local files and the default storage settings (see [`run_with`]).
pub fn run(spec: &TrainSpec, sink: &mut dyn ProgressSink, stop: &StopFlag) -> Result<Outcome> {
    let storage = Storage::new(
        tuneq_storage::StorageConfig::default(),
        Storage::default_cache_dir(),
    )?;
    run_with(spec, &storage, sink, stop)
}

/// Runs `spec` to completion or until `stop` is set, reporting to `sink`. Remote
/// (`s3://`, `gs://`) models and datasets are staged through `storage`, and a remote
/// output is mirrored there as checkpoints and the adapter are committed.
///
/// In four parts: [`Run::prepare`] (inputs, model, optimiser), [`Run::resume`] (from
/// the latest sound checkpoint), [`Run::train`] (the step loop) and [`Run::finish`]
/// (adapter, samples, manifest).
pub fn run_with(
    spec: &TrainSpec,
    storage: &Storage,
    sink: &mut dyn ProgressSink,
    stop: &StopFlag,
) -> Result<Outcome> {
    let mut run = match Run::prepare(spec, storage, sink)? {
        Prepared::Done(outcome) => return Ok(outcome),
        Prepared::Ready(run) => *run,
    };
    run.resume(sink)?;
    if stop.is_set() {
        // Stopped while loading: nothing new to save; the latest checkpoint (if any) stands.
        sink.event(&TrainEvent::Interrupted { step: run.step });
        return Ok(Outcome::Interrupted { step: run.step });
    }
    let metrics = run.start(sink)?;
    if let Some(step) = run.train(&metrics, sink, stop)? {
        return Ok(Outcome::Interrupted { step });
    }
    run.finish(&metrics, sink, stop)
}

/// What [`Run::prepare`] found.
enum Prepared<'a> {
    /// A finished run with the same fingerprint is in the output: nothing to do.
    Done(Outcome),
    /// Ready to train (boxed: a run is large next to an outcome).
    Ready(Box<Run<'a>>),
}

/// One training run: its inputs, model and optimiser, and where it stands.
struct Run<'a> {
    spec: &'a TrainSpec,
    h: tuneq_openapi::Hyperparameters,
    /// The output location (its local folder, mirrored when remote).
    out: crate::remote::Output,
    /// `out`'s local folder.
    output: PathBuf,
    settings: LoraSettings,
    device: Device,
    encoder: Encoder,
    train: EncodedData,
    val: Option<EncodedData>,
    pad_id: u32,
    model_sha: String,
    fingerprint: String,
    model: Llama,
    opt: AdamW,
    trainable: u64,
    per_epoch: u64,
    total: u64,
    schedule: LrSchedule,
    threads: usize,
    base_val_loss: Option<f64>,
    /// Optimiser steps done.
    step: u64,
    /// Non-padding tokens trained on.
    tokens_seen: u64,
    /// Loss of the last step.
    last_loss: Option<f64>,
}

impl<'a> Run<'a> {
    /// Stages and checks the inputs, encodes the data, fingerprints the run, restores a
    /// remote output, and (unless the output holds this run finished) loads the model
    /// with a fresh adapter and optimiser and measures the base validation loss.
    fn prepare(
        spec: &'a TrainSpec,
        storage: &Storage,
        sink: &mut dyn ProgressSink,
    ) -> Result<Prepared<'a>> {
        spec.validate().map_err(Error::Spec)?;
        let h = spec.hyperparameters.clone();
        let model_dir = storage.input_dir("model", &spec.model)?;
        let out = storage.output("output", &spec.output)?;
        let output = out.local.clone();
        let train_files = spec
            .training_files
            .iter()
            .map(|f| storage.input_file("training_files", f))
            .collect::<Result<Vec<_>>>()?;
        let val_file = spec
            .validation_file
            .as_deref()
            .map(|f| storage.input_file("validation_file", f))
            .transpose()?;
        let device = select_device(spec.device)?;
        let dtype = select_dtype(spec.dtype, &device)?;
        let settings = lora_settings(spec);

        // The model folder is checked before anything else reads from it, so a wrong path
        // says "config.json not found" rather than naming whichever file was read first.
        let cfg = crate::config::LlamaConfig::load(&model_dir)?;
        if h.max_seq_len as usize > cfg.max_position_embeddings {
            return Err(Error::Spec(vec![tuneq_openapi::SpecError {
                field: "hyperparameters.max_seq_len".into(),
                message: format!(
                    "{} exceeds the model's max_position_embeddings {}",
                    h.max_seq_len, cfg.max_position_embeddings
                ),
            }]));
        }
        let encoder = Encoder::from_model_dir(&model_dir, spec.chat_template)?;
        let tokenizer_vocab = encoder.tokenizer().get_vocab_size(true);
        if tokenizer_vocab > cfg.vocab_size {
            return Err(Error::Model {
                path: model_dir.display().to_string(),
                message: format!(
                    "tokenizer.json has {tokenizer_vocab} tokens but config.json vocab_size is {}",
                    cfg.vocab_size
                ),
            });
        }
        let max_len = h.max_seq_len as usize;
        let train = encode_files(&encoder, &train_files, spec.dataset_format, max_len)?;
        let val = match &val_file {
            Some(f) => Some(encode_files(
                &encoder,
                std::slice::from_ref(f),
                spec.dataset_format,
                max_len,
            )?),
            None => None,
        };
        if train.examples.is_empty() {
            return Err(Error::Data(crate::data::DataError::Empty {
                file: spec.training_files.join(", "),
            }));
        }
        for (what, d) in [("training", Some(&train)), ("validation", val.as_ref())] {
            let Some(d) = d else { continue };
            if d.truncated > 0 {
                sink.event(&TrainEvent::Warning {
                    message: format!(
                        "{} {what} examples were longer than max_seq_len {max_len} and were truncated",
                        d.truncated
                    ),
                });
            }
            if d.dropped > 0 {
                sink.event(&TrainEvent::Warning {
                    message: format!("{} {what} examples had no trainable tokens left after truncation and were skipped", d.dropped),
                });
            }
        }
        let pad_id = encoder.eos_token_id().unwrap_or(0);

        let model_sha = model_sha256(&model_dir)?;
        let fingerprint = {
            let fp = Fingerprint {
                hyperparameters: &h,
                lora: &spec.lora,
                dataset_format: spec.dataset_format,
                chat_template: spec.chat_template,
                dtype: spec.dtype,
                train_sha256: &train.sha256,
                model_sha256: &model_sha,
            };
            hex::encode(Sha256::digest(json_line(&fp)?.as_bytes()))
        };

        // A replacement machine starts from what earlier attempts committed remotely.
        for note in out.restore()? {
            tracing::info!(output = %out.display(""), "{note}");
        }

        // A finished run with the same fingerprint has nothing left to do.
        if let Ok(done) = crate::error::read_json::<RunManifest>(&output.join("manifest.json"))
            && done.fingerprint == fingerprint
            && done.status == "succeeded"
            && output.join(crate::peft::ADAPTER_WEIGHTS).is_file()
        {
            sink.event(&TrainEvent::Finished {
                step: done.metrics.steps,
                adapter: out.display(""),
                train_loss: done.metrics.train_loss,
                validation_loss: done.metrics.validation_loss,
                trained_tokens: done.metrics.trained_tokens,
            });
            return Ok(Prepared::Done(Outcome::Finished {
                steps: done.metrics.steps,
                validation_loss: done.metrics.validation_loss,
            }));
        }

        let mut init_rng = batch::rng_for(h.seed, streams::LORA_INIT);
        let model = Llama::load(&model_dir, dtype, &device, Some((&settings, &mut init_rng)))?;
        let vars = model.lora_vars();
        let trainable: u64 = vars.iter().map(|v| v.var.elem_count() as u64).sum();
        let opt = AdamW::new(vars, adamw_config(&h))?;
        let (per_epoch, total) = plan(train.examples.len(), spec);
        let schedule = LrSchedule {
            peak: h.learning_rate,
            warmup: h.warmup_steps,
            total,
            kind: h.scheduler,
        };
        let threads = candle_core::utils::get_num_threads();

        std::fs::create_dir_all(&output).map_err(Error::io(&output))?;
        let base_val_loss = match &val {
            Some(v) if !v.examples.is_empty() => Some(evaluate(
                &model,
                &v.examples,
                h.batch_size as usize,
                pad_id,
            )?),
            _ => None,
        };
        Ok(Prepared::Ready(Box::new(Run {
            spec,
            h,
            out,
            output,
            settings,
            device,
            encoder,
            train,
            val,
            pad_id,
            model_sha,
            fingerprint,
            model,
            opt,
            trainable,
            per_epoch,
            total,
            schedule,
            threads,
            base_val_loss,
            step: 0,
            tokens_seen: 0,
            last_loss: None,
        })))
    }

    /// Continues from the output's latest sound checkpoint, if any: its adapter, its
    /// optimiser moments and its place. Damaged checkpoints are skipped with a warning;
    /// one of another run is refused.
    fn resume(&mut self, sink: &mut dyn ProgressSink) -> Result<()> {
        let mut warnings = Vec::new();
        let latest = checkpoint::latest(&self.output, &self.device, |w| warnings.push(w))?;
        for w in warnings {
            sink.event(&TrainEvent::Warning { message: w });
        }
        let Some(ck) = latest else {
            return Ok(());
        };
        if ck.state.fingerprint != self.fingerprint {
            return Err(Error::Checkpoint {
                path: ck.dir.display().to_string(),
                message: "it belongs to a run with a different spec, dataset or model; use a new output location".into(),
            });
        }
        if ck.state.threads != self.threads {
            sink.event(&TrainEvent::Warning {
                message: format!(
                    "checkpoint was written with {} compute threads, resuming with {}: the result will not be bit-identical",
                    ck.state.threads, self.threads
                ),
            });
        }
        self.model
            .set_adapter(&self.settings, &ck.adapter, &ck.dir.display().to_string())?;
        self.opt = AdamW::new(self.model.lora_vars(), adamw_config(&self.h))?;
        self.opt.restore(
            &ck.optimizer,
            ck.state.global_step,
            &self.device,
            &ck.dir.display().to_string(),
        )?;
        self.step = ck.state.global_step;
        self.tokens_seen = ck.state.tokens_seen;
        self.last_loss = ck.state.last_loss;
        sink.event(&TrainEvent::Resumed {
            step: self.step,
            checkpoint: ck.dir.display().to_string(),
        });
        Ok(())
    }

    /// Opens `metrics.jsonl` (cut back to the current step) and says the run started.
    fn start(&self, sink: &mut dyn ProgressSink) -> Result<MetricsFile> {
        let metrics = MetricsFile::open(&self.output, self.step)?;
        sink.event(&TrainEvent::Started {
            total_steps: self.total,
            start_step: self.step,
            train_examples: self.train.examples.len() as u64,
            validation_examples: self.val.as_ref().map_or(0, |v| v.examples.len() as u64),
            trainable_params: self.trainable,
            dataset_format: serde_json::to_value(self.train.format)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default(),
        });
        Ok(metrics)
    }

    /// The trainer state at the current step, as a checkpoint records it.
    fn state(&self) -> TrainerState {
        let (h, step) = (&self.h, self.step);
        TrainerState {
            global_step: step,
            epoch: (step / self.per_epoch) as u32,
            tokens_seen: self.tokens_seen,
            last_loss: self.last_loss,
            fingerprint: self.fingerprint.clone(),
            rng: RngState {
                algorithm: "chacha20".into(),
                seed: h.seed,
                shuffle_stream: streams::SHUFFLE + step / self.per_epoch,
                dropout_stream: streams::DROPOUT + step,
            },
            threads: self.threads,
            trainer_version: env!("CARGO_PKG_VERSION").into(),
        }
    }

    /// Writes a checkpoint of the current step, prunes old ones, mirrors it to a remote
    /// output and reports it.
    fn commit(&self, sink: &mut dyn ProgressSink) -> Result<()> {
        let state = self.state();
        let keep = self.spec.checkpoint.keep_last as usize;
        let dir = checkpoint::write(
            &self.output,
            &self.model,
            &self.settings,
            &self.spec.model,
            &self.opt,
            &state,
        )?;
        checkpoint::prune(&self.output, keep)?;
        self.out.push_checkpoint(&dir, keep)?;
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        sink.event(&TrainEvent::Checkpoint {
            step: state.global_step,
            location: self
                .out
                .display(&format!("{}/{name}", checkpoint::CHECKPOINTS_DIR)),
        });
        Ok(())
    }

    /// The micro-batches of the current optimiser step, given its epoch's example `order`.
    fn batches(&self, order: &[usize]) -> Vec<Batch> {
        let (h, train) = (&self.h, &self.train);
        let micro_per_epoch = train.examples.len().div_ceil(h.batch_size as usize);
        let j = (self.step % self.per_epoch) as usize;
        let accum = h.gradient_accumulation_steps as usize;
        let bs = h.batch_size as usize;
        (j * accum..((j + 1) * accum).min(micro_per_epoch))
            .map(|m| {
                let idx = &order[m * bs..((m + 1) * bs).min(order.len())];
                let refs: Vec<&Example> = idx.iter().map(|&i| &train.examples[i]).collect();
                make_batch(&refs, self.pad_id)
            })
            .collect()
    }

    /// Runs optimiser steps until the last one, checkpointing and validating as the spec
    /// says. A stop commits a checkpoint of the current step and returns that step.
    fn train(
        &mut self,
        metrics: &MetricsFile,
        sink: &mut dyn ProgressSink,
        stop: &StopFlag,
    ) -> Result<Option<u64>> {
        let started = Instant::now();
        let start_step = self.step;
        let mut last_ckpt = Instant::now();
        let mut order_epoch = u32::MAX;
        let mut order = Vec::new();
        let total = self.total;
        while self.step < total {
            if stop.is_set() {
                self.commit(sink)?;
                sink.event(&TrainEvent::Interrupted { step: self.step });
                return Ok(Some(self.step));
            }
            let epoch = (self.step / self.per_epoch) as u32;
            if epoch != order_epoch {
                order = batch::epoch_order(self.train.examples.len(), self.h.seed, epoch);
                order_epoch = epoch;
            }
            let batches = self.batches(&order);
            let t0 = Instant::now();
            let mut drop_rng = batch::rng_for(self.h.seed, streams::DROPOUT + self.step);
            let r = accumulate(
                &self.model,
                &batches,
                Some((self.settings.dropout, &mut drop_rng)),
            )?;
            if !r.loss.is_finite() {
                return Err(Error::Diverged {
                    step: self.step + 1,
                    loss: r.loss,
                });
            }
            let norm = global_norm(&r.grads)?;
            let clip = if self.h.max_grad_norm > 0.0 {
                (self.h.max_grad_norm / (norm + 1e-6)).min(1.0)
            } else {
                1.0
            };
            let lr = self.schedule.lr_at(self.step);
            self.opt.step(&r.grads, lr, clip)?;
            self.step += 1;
            self.tokens_seen += r.tokens as u64;
            self.last_loss = Some(r.loss);
            let step = self.step;
            let dt = t0.elapsed().as_secs_f64();
            let elapsed = started.elapsed().as_secs_f64();
            let per_step = elapsed / (step - start_step) as f64;
            let m = StepMetrics {
                step,
                total_steps: total,
                epoch,
                loss: r.loss,
                lr,
                grad_norm: norm,
                tokens_per_s: r.tokens as f64 / dt.max(1e-9),
                elapsed_s: elapsed,
                eta_s: per_step * (total - step) as f64,
                tokens_seen: self.tokens_seen,
            };
            metrics.append(&json_line(&m)?)?;
            sink.event(&TrainEvent::Step(m));
            if let (Some(every), Some(v)) = (self.h.eval_every_steps, &self.val)
                && step.is_multiple_of(every)
                && step < total
                && !v.examples.is_empty()
            {
                let bs = self.h.batch_size as usize;
                validate(
                    &self.model,
                    &v.examples,
                    bs,
                    self.pad_id,
                    step,
                    metrics,
                    sink,
                )?;
            }
            let by_steps = self
                .spec
                .checkpoint
                .every_steps
                .is_some_and(|n| step.is_multiple_of(n));
            let by_time = self
                .spec
                .checkpoint
                .every_seconds
                .is_some_and(|s| last_ckpt.elapsed().as_secs() >= s);
            if (by_steps || by_time) && step < total {
                self.commit(sink)?;
                last_ckpt = Instant::now();
            }
        }
        Ok(None)
    }

    /// After the last step: the final validation loss, a last checkpoint, the adapter,
    /// samples (skipped on a stop request) and the manifest, then the remote mirror.
    fn finish(
        self,
        metrics: &MetricsFile,
        sink: &mut dyn ProgressSink,
        stop: &StopFlag,
    ) -> Result<Outcome> {
        let (spec, h, output) = (self.spec, &self.h, &self.output);
        let mut val_loss = None;
        if let Some(v) = &self.val
            && !v.examples.is_empty()
        {
            let l = validate(
                &self.model,
                &v.examples,
                h.batch_size as usize,
                self.pad_id,
                self.step,
                metrics,
                sink,
            )?;
            val_loss = Some(l);
        }
        // The last checkpoint makes a kill during export or sampling cheap to recover from.
        self.commit(sink)?;
        crate::peft::save_adapter(&self.model, &self.settings, &spec.model, output)?;

        let sample_source = self
            .val
            .as_ref()
            .filter(|v| !v.records.is_empty())
            .unwrap_or(&self.train);
        // Samples are a courtesy: a stop request skips them rather than delaying the exit.
        let num_samples = if stop.is_set() {
            0
        } else {
            spec.sampling.num_samples as usize
        };
        let samples = crate::generate::sample_records(
            &self.model,
            &self.encoder,
            &sample_source.records,
            num_samples,
            spec.sampling.max_new_tokens as usize,
        )?;
        let mut lines = String::new();
        for s in &samples {
            lines.push_str(&json_line(s)?);
            lines.push('\n');
            sink.event(&TrainEvent::Sample {
                index: s.index as u64,
                prompt: s.prompt.clone(),
                completion: s.completion.clone(),
                reference: s.reference.clone(),
            });
        }
        tuneq_storage::local::write_atomic(&output.join("samples.jsonl"), lines.as_bytes())?;

        let mut adapter_files = Vec::new();
        for f in [crate::peft::ADAPTER_CONFIG, crate::peft::ADAPTER_WEIGHTS] {
            let p = output.join(f);
            let size = std::fs::metadata(&p).map_err(Error::io(&p))?.len();
            adapter_files.push(checkpoint::ManifestEntry {
                name: f.into(),
                size,
                sha256: checkpoint::sha256_file(&p)?,
            });
        }
        let (step, tokens_seen, last_loss) = (self.step, self.tokens_seen, self.last_loss);
        let manifest =
            RunManifest {
                status: "succeeded".into(),
                spec: spec.clone(),
                base_model: Lineage {
                    location: spec.model.clone(),
                    sha256: self.model_sha,
                },
                training_files: spec
                    .training_files
                    .iter()
                    .zip(&self.train.sha256)
                    .map(|(l, s)| Lineage {
                        location: l.clone(),
                        sha256: s.clone(),
                    })
                    .collect(),
                validation_file: spec.validation_file.as_ref().zip(self.val.as_ref()).map(
                    |(l, v)| Lineage {
                        location: l.clone(),
                        sha256: v.sha256.first().cloned().unwrap_or_default(),
                    },
                ),
                seed: h.seed,
                fingerprint: self.fingerprint,
                metrics: FinalMetrics {
                    steps: step,
                    train_loss: last_loss,
                    base_validation_loss: self.base_val_loss,
                    validation_loss: val_loss,
                    trained_tokens: tokens_seen,
                    train_examples: self.train.examples.len() as u64,
                    validation_examples: self.val.as_ref().map_or(0, |v| v.examples.len() as u64),
                },
                adapter_files,
                trainer_version: env!("CARGO_PKG_VERSION").into(),
            };
        let json = serde_json::to_vec_pretty(&manifest).map_err(|source| Error::Json {
            path: "manifest.json".into(),
            source,
        })?;
        tuneq_storage::local::write_atomic(&output.join("manifest.json"), &json)?;
        self.out.push_final()?;
        sink.event(&TrainEvent::Finished {
            step,
            adapter: self.out.display(""),
            train_loss: last_loss,
            validation_loss: val_loss,
            trained_tokens: tokens_seen,
        });
        Ok(Outcome::Finished {
            steps: step,
            validation_loss: val_loss,
        })
    }
}

/// The optimiser's settings for `h` (the same at the start and on resume).
fn adamw_config(h: &tuneq_openapi::Hyperparameters) -> AdamWConfig {
    AdamWConfig {
        weight_decay: h.weight_decay,
        ..Default::default()
    }
}
