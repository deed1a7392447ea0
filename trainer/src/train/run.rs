//! The run itself: [`run_with`] in four parts on a [`Run`] — prepare (inputs, model,
//! optimiser), resume (from the latest sound checkpoint), train (the step loop) and
//! finish (adapter, samples, manifest).

use super::early_stop::Verdict;
use super::evaluation::{Heldout, validate};
use super::inputs::{EncodedData, adapter_sha256, encode_data, fingerprint, model_sha256};
use super::loading::{LoadedModel, checked_model, load_model};
use super::manifest::{FinalMetrics, Lineage, RunManifest, adapter_files, finished_before};
use super::metrics::{MetricsFile, json_line};
use super::optimiser::{Update, optimiser_step};
use super::preference::{pair_batch, pair_logps};
use super::spec::{lora_settings, plan};
use super::{Outcome, StopFlag, select_device, select_dtype};
use crate::batch::{self, Batch, make_batch, streams};
use crate::checkpoint::{self, EarlyStopState, RngState, TrainerState};
use crate::data::{EncodedPair, Encoder, Example};
use crate::dpo::PairLogps;
use crate::error::{Error, Result};
use crate::lora::LoraSettings;
use crate::model::Llama;
use crate::optim::{AdamW, AdamWConfig};
use crate::progress::ProgressSink;
use crate::remote::Storage;
use crate::schedule::LrSchedule;
use crate::step::{Objective, StepDropout};
use candle_core::Device;
use std::path::PathBuf;
use std::time::Instant;
use tuneq_openapi::{StepMetrics, TrainEvent, TrainSpec, TrainingMethod};

/// Runs `spec` to completion or until `stop` is set, reporting to `sink`. Remote
/// (`s3://`, `gs://`) models and datasets are staged through `storage`, and a remote
/// output is mirrored there as checkpoints and the adapter are committed.
///
/// In four parts: `Run::prepare` (inputs, model, optimiser), `Run::resume` (from
/// the latest sound checkpoint), `Run::train` (the step loop) and `Run::finish`
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
    /// DPO: each training pair's and each validation pair's log-probabilities under
    /// the reference (the model the run starts from), computed before any step and
    /// again on every resume, from the same starting model: empty otherwise.
    reference: References,
    /// Early stopping's watch (see [`super::early_stop`]).
    early: Option<EarlyStopState>,
    /// The last validation of this attempt: its step and loss.
    validated: Option<(u64, f64)>,
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
        let init_adapter = spec
            .init_adapter
            .as_deref()
            .map(|a| storage.input_adapter("init_adapter", a))
            .transpose()?;
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
        let dtype = select_dtype(spec, &device);
        let (cfg, encoder) = checked_model(spec, &model_dir)?;
        let settings = lora_settings(spec, cfg.architecture())?;
        let (train, val) = encode_data(spec, &encoder, &train_files, val_file.as_ref(), sink)?;
        let pad_id = encoder.eos_token_id().unwrap_or(0);
        let model_sha = model_sha256(spec, &model_dir, sink)?;
        let init_sha = init_adapter.as_deref().map(adapter_sha256).transpose()?;
        let fingerprint = fingerprint(spec, &train, &model_sha, init_sha.as_deref())?;
        // A replacement machine starts from what earlier attempts committed remotely.
        for note in out.restore()? {
            tracing::info!(output = %out.display(""), "{note}");
        }
        if let Some(done) = finished_before(&out, &fingerprint, sink) {
            return Ok(Prepared::Done(done));
        }
        let loaded = LoadedModel {
            cfg,
            dir: &model_dir,
            dtype,
            device: &device,
            settings: &settings,
            init_adapter: init_adapter.as_deref(),
        };
        let model = load_model(spec, loaded, &train, sink)?;
        let vars = model.lora_vars();
        let trainable: u64 = vars.iter().map(|v| v.var.elem_count() as u64).sum();
        let opt = AdamW::new(vars, adamw_config(&h))?;
        let (per_epoch, total) = plan(train.items(), spec);
        let schedule = LrSchedule {
            peak: h.learning_rate,
            warmup: h.warmup_steps,
            total,
            kind: h.scheduler,
        };
        let threads = candle_core::utils::get_num_threads();

        std::fs::create_dir_all(&output).map_err(Error::io(&output))?;
        let reference = References::of(spec, &model, (&train, val.as_ref()), pad_id)?;
        let base_val_loss = match heldout(spec, val.as_ref(), &reference) {
            Some(data) => Some(data.evaluate(&model, h.batch_size as usize, pad_id)?.loss),
            None => None,
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
            reference,
            early: None,
            validated: None,
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
        let here = crate::compute::ComputeEnv::detect(&self.model);
        let changed = match &ck.state.compute {
            Some(then) => here.difference(then),
            None => Some("the checkpoint does not record its compute backend".into()),
        };
        if let Some(changed) = changed {
            sink.event(&TrainEvent::Warning {
                message: format!(
                    "resuming on a different compute environment ({changed}): the result will not be bit-identical to an uninterrupted run"
                ),
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
        self.early = ck.state.early_stopping;
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
            train_examples: self.train.items() as u64,
            validation_examples: self.val.as_ref().map_or(0, |v| v.items() as u64),
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
            compute: Some(crate::compute::ComputeEnv::detect(&self.model)),
            trainer_version: env!("CARGO_PKG_VERSION").into(),
            early_stopping: self.early,
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
        let best = self.early.map(|e| e.best_step);
        checkpoint::prune(&self.output, keep, best)?;
        self.out.push_checkpoint(&dir, keep, best)?;
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

    /// The micro-batches of the current optimiser step, given its epoch's `order` (of
    /// examples, or of pairs for DPO), and for DPO each micro-batch's pairs' reference
    /// log-probabilities.
    fn batches(&self, order: &[usize]) -> (Vec<Batch>, Vec<Vec<PairLogps>>) {
        let (h, train) = (&self.h, &self.train);
        let micro_per_epoch = train.items().div_ceil(h.batch_size as usize);
        let j = (self.step % self.per_epoch) as usize;
        let accum = h.gradient_accumulation_steps as usize;
        let bs = h.batch_size as usize;
        let fused =
            crate::fast::ComputePath::for_model(&self.model) == crate::fast::ComputePath::CpuFused;
        let mut references = Vec::new();
        let batches = (j * accum..((j + 1) * accum).min(micro_per_epoch))
            .map(|m| {
                let idx = &order[m * bs..((m + 1) * bs).min(order.len())];
                if !self.reference.train.is_empty() {
                    references.push(idx.iter().map(|&i| self.reference.train[i]).collect());
                    let pairs: Vec<&EncodedPair> = idx.iter().map(|&i| &train.pairs[i]).collect();
                    return pair_batch(&pairs, self.pad_id);
                }
                let refs: Vec<&Example> = idx.iter().map(|&i| &train.examples[i]).collect();
                // The fused path packs each micro-batch's examples end to end: the same
                // examples and labelled tokens per step, without the padding.
                if fused {
                    batch::pack_batch(&refs, self.pad_id)
                } else {
                    make_batch(&refs, self.pad_id)
                }
            })
            .collect();
        (batches, references)
    }

    /// What the step minimises, with `references` from [`Run::batches`].
    fn objective<'r>(&self, references: &'r [Vec<PairLogps>]) -> Objective<'r> {
        match self.spec.method {
            TrainingMethod::Supervised => Objective::CrossEntropy,
            TrainingMethod::Dpo { beta } => Objective::Dpo {
                beta,
                reference: references,
            },
        }
    }

    /// The validation data and how its loss is taken, when there is any.
    fn heldout(&self) -> Option<Heldout<'_>> {
        heldout(self.spec, self.val.as_ref(), &self.reference)
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
        while self.step < total && !self.stopped_early() {
            if stop.is_set() {
                self.commit(sink)?;
                sink.event(&TrainEvent::Interrupted { step: self.step });
                return Ok(Some(self.step));
            }
            let epoch = (self.step / self.per_epoch) as u32;
            if epoch != order_epoch {
                order = batch::epoch_order(self.train.items(), self.h.seed, epoch);
                order_epoch = epoch;
            }
            let (batches, references) = self.batches(&order);
            let t0 = Instant::now();
            let mut drop_rng = batch::rng_for(self.h.seed, streams::DROPOUT + self.step);
            let lr = self.schedule.lr_at(self.step);
            let objective = self.objective(&references);
            let r = optimiser_step(
                &self.model,
                &mut self.opt,
                &batches,
                Some(StepDropout {
                    p: self.settings.dropout,
                    rng: &mut drop_rng,
                    record: None,
                }),
                Update {
                    objective,
                    max_grad_norm: self.h.max_grad_norm,
                    lr,
                },
            )?;
            let norm = r.grad_norm;
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
                token_accuracy: r.token_accuracy,
                preference: r.preference,
            };
            metrics.append(&json_line(&m)?)?;
            sink.event(&TrainEvent::Step(m));
            if self.after_step(metrics, sink, &mut last_ckpt)? == Verdict::Stop {
                break;
            }
        }
        Ok(None)
    }

    /// After a step that is not the last: the validation the spec asks for (with early
    /// stopping's verdict on it: a new best is checkpointed at once) and the checkpoint
    /// it asks for. Returns [`Verdict::Stop`] when early stopping ends training.
    fn after_step(
        &mut self,
        metrics: &MetricsFile,
        sink: &mut dyn ProgressSink,
        last_ckpt: &mut Instant,
    ) -> Result<Verdict> {
        let step = self.step;
        if step >= self.total {
            return Ok(Verdict::Waiting);
        }
        if let (Some(every), Some(data)) = (self.h.eval_every_steps, self.heldout())
            && step.is_multiple_of(every)
        {
            let at = (self.h.batch_size as usize, self.pad_id);
            let loss = validate(&self.model, data, at, step, metrics, sink)?;
            self.validated = Some((step, loss));
            match self.watch(step, loss) {
                // The best step's checkpoint is the one the run may end up keeping.
                Some(Verdict::Improved) => {
                    self.commit(sink)?;
                    *last_ckpt = Instant::now();
                    return Ok(Verdict::Improved);
                }
                Some(Verdict::Stop) => return Ok(Verdict::Stop),
                Some(Verdict::Waiting) | None => {}
            }
        }
        let policy = &self.spec.checkpoint;
        let by_steps = policy.every_steps.is_some_and(|n| step.is_multiple_of(n));
        let by_time = policy
            .every_seconds
            .is_some_and(|s| last_ckpt.elapsed().as_secs() >= s);
        if by_steps || by_time {
            self.commit(sink)?;
            *last_ckpt = Instant::now();
        }
        Ok(Verdict::Waiting)
    }

    /// Early stopping's verdict on the validation loss of `step`, when the run stops early.
    fn watch(&mut self, step: u64, loss: f64) -> Option<Verdict> {
        let rule = self.h.early_stopping?;
        Some(super::early_stop::observe(
            &mut self.early,
            rule,
            step,
            loss,
        ))
    }

    /// Whether early stopping ended training (patience used up).
    fn stopped_early(&self) -> bool {
        match (self.h.early_stopping, self.early) {
            (Some(rule), Some(state)) => state.without_improvement >= rule.patience,
            _ => false,
        }
    }

    /// With early stopping, makes the best validated step's adapter the model's (the
    /// final validation `val_loss` counting as one more) and says so; returns the
    /// validation loss of the adapter kept.
    fn keep_best(
        &mut self,
        val_loss: Option<f64>,
        sink: &mut dyn ProgressSink,
    ) -> Result<Option<f64>> {
        let (Some(rule), Some(best)) = (self.h.early_stopping, self.early) else {
            return Ok(val_loss);
        };
        let (best_step, best_loss) = match val_loss {
            Some(l) if l.is_finite() && l < best.best_loss - rule.min_delta => {
                self.early = Some(EarlyStopState {
                    best_step: self.step,
                    best_loss: l,
                    without_improvement: 0,
                });
                (self.step, l)
            }
            _ if best.best_step == self.step => (self.step, best.best_loss),
            _ => {
                let (dir, adapter) =
                    checkpoint::adapter_of_step(&self.output, best.best_step, &self.device)?;
                self.model
                    .set_adapter(&self.settings, &adapter, &dir.display().to_string())?;
                (best.best_step, best.best_loss)
            }
        };
        sink.event(&TrainEvent::EarlyStopped {
            stopped_at: (self.step < self.total).then_some(self.step),
            best_step,
            best_validation_loss: best_loss,
        });
        Ok(Some(best_loss))
    }

    /// After the last step: the final validation loss, a last checkpoint, the adapter
    /// (with early stopping, the best validated step's), samples (skipped on a stop
    /// request) and the manifest, then the remote mirror.
    fn finish(
        mut self,
        metrics: &MetricsFile,
        sink: &mut dyn ProgressSink,
        stop: &StopFlag,
    ) -> Result<Outcome> {
        let val_loss = self.final_validation(metrics, sink)?;
        metrics.write_results_csv()?;
        // The last checkpoint makes a kill during export or sampling cheap to recover from.
        self.commit(sink)?;
        let val_loss = self.keep_best(val_loss, sink)?;
        let (spec, output) = (self.spec, &self.output);
        crate::peft::save_adapter(&self.model, &self.settings, &spec.model, output)?;
        self.write_samples(stop, sink)?;
        let manifest = self.manifest(val_loss, adapter_files(output)?);
        let json = serde_json::to_vec_pretty(&manifest).map_err(|source| Error::Json {
            path: "manifest.json".into(),
            source,
        })?;
        tuneq_storage::local::write_atomic(&output.join("manifest.json"), &json)?;
        self.out.push_final()?;
        let (step, tokens_seen, last_loss) = (self.step, self.tokens_seen, self.last_loss);
        sink.event(&TrainEvent::Finished {
            step,
            adapter: self.out.display(""),
            train_loss: last_loss,
            validation_loss: val_loss,
            trained_tokens: tokens_seen,
            peak_memory_bytes: crate::bench::peak_resident_bytes(),
        });
        Ok(Outcome::Finished {
            steps: step,
            validation_loss: val_loss,
        })
    }

    /// The validation loss after the last step (recorded like every evaluation, unless
    /// the step was just validated), when there is validation data.
    fn final_validation(
        &self,
        metrics: &MetricsFile,
        sink: &mut dyn ProgressSink,
    ) -> Result<Option<f64>> {
        let Some(data) = self.heldout() else {
            return Ok(None);
        };
        // A run early stopping ended has just validated its last step.
        if let Some((_, loss)) = self.validated.filter(|v| v.0 == self.step) {
            return Ok(Some(loss));
        }
        let at = (self.h.batch_size as usize, self.pad_id);
        let l = validate(&self.model, data, at, self.step, metrics, sink)?;
        Ok(Some(l))
    }

    /// Generates the spec's samples (from the validation records, else the training
    /// ones) into `samples.jsonl` and the progress stream. Samples are a courtesy: a
    /// stop request skips them rather than delaying the exit.
    fn write_samples(&self, stop: &StopFlag, sink: &mut dyn ProgressSink) -> Result<()> {
        let spec = self.spec;
        let sample_source = self
            .val
            .as_ref()
            .filter(|v| !v.records.is_empty())
            .unwrap_or(&self.train);
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
        tuneq_storage::local::write_atomic(&self.output.join("samples.jsonl"), lines.as_bytes())?;
        Ok(())
    }

    /// The run's final record: its spec, inputs' identity, figures and adapter files.
    fn manifest(
        &self,
        val_loss: Option<f64>,
        adapter_files: Vec<checkpoint::ManifestEntry>,
    ) -> RunManifest {
        let spec = self.spec;
        RunManifest {
            status: super::manifest::RunStatus::Succeeded,
            spec: spec.clone(),
            base_model: Lineage {
                location: spec.model.clone(),
                sha256: self.model_sha.clone(),
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
            validation_file: spec
                .validation_file
                .as_ref()
                .zip(self.val.as_ref())
                .map(|(l, v)| Lineage {
                    location: l.clone(),
                    sha256: v.sha256.first().cloned().unwrap_or_default(),
                }),
            seed: self.h.seed,
            fingerprint: self.fingerprint.clone(),
            metrics: FinalMetrics {
                steps: self.step,
                train_loss: self.last_loss,
                base_validation_loss: self.base_val_loss,
                validation_loss: val_loss,
                trained_tokens: self.tokens_seen,
                train_examples: self.train.items() as u64,
                validation_examples: self.val.as_ref().map_or(0, |v| v.items() as u64),
            },
            adapter_files,
            early_stopping: self
                .early
                .filter(|_| self.h.early_stopping.is_some())
                .map(|e| super::manifest::EarlyStopped {
                    stopped_at: (self.step < self.total).then_some(self.step),
                    best_step: e.best_step,
                    best_validation_loss: e.best_loss,
                }),
            trainer_version: env!("CARGO_PKG_VERSION").into(),
        }
    }
}

/// A DPO run's reference log-probabilities, per training pair and per validation pair.
#[derive(Debug, Default)]
struct References {
    train: Vec<PairLogps>,
    validation: Vec<PairLogps>,
}

impl References {
    /// For a DPO run, the pairs' log-probabilities under `model` as loaded (the run's
    /// starting point); nothing for a supervised one.
    fn of(
        spec: &TrainSpec,
        model: &Llama,
        (train, val): (&EncodedData, Option<&EncodedData>),
        pad_id: u32,
    ) -> Result<Self> {
        if spec.method.is_supervised() {
            return Ok(Self::default());
        }
        let bs = spec.hyperparameters.batch_size as usize;
        Ok(Self {
            train: pair_logps(model, &train.pairs, bs, pad_id)?,
            validation: match val {
                Some(v) => pair_logps(model, &v.pairs, bs, pad_id)?,
                None => Vec::new(),
            },
        })
    }
}

/// The validation data of `spec`'s run and how its loss is taken, when there is any.
fn heldout<'d>(
    spec: &TrainSpec,
    val: Option<&'d EncodedData>,
    reference: &'d References,
) -> Option<Heldout<'d>> {
    let data = match spec.method {
        TrainingMethod::Supervised => Heldout::Examples(&val?.examples),
        TrainingMethod::Dpo { beta } => Heldout::Pairs {
            pairs: &val?.pairs,
            reference: &reference.validation,
            beta,
        },
    };
    (!data.is_empty()).then_some(data)
}

/// The optimiser's settings for `h` (the same at the start and on resume).
fn adamw_config(h: &tuneq_openapi::Hyperparameters) -> AdamWConfig {
    AdamWConfig {
        weight_decay: h.weight_decay,
        ..Default::default()
    }
}
