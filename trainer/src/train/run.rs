//! The run itself: [`run_with`] in four parts on a [`Run`] — prepare (inputs, model,
//! optimiser), resume (from the latest sound checkpoint), train (the step loop) and
//! finish (adapter, samples, manifest).

use super::*;

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
        let dtype = select_dtype(spec, &device);
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
        if train.examples.is_empty() && train.dropped > 0 {
            // Records parsed, but none kept a labelled token within max_seq_len.
            return Err(Error::Spec(vec![tuneq_openapi::SpecError {
                field: "hyperparameters.max_seq_len".into(),
                message: format!(
                    "no example of {} has a token to learn from at max_seq_len {max_len} (every answer is cut off or empty); raise max_seq_len or fix the data",
                    spec.training_files.join(", ")
                ),
            }]));
        }
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
                compute: spec.compute,
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
                peak_memory_bytes: None,
            });
            return Ok(Prepared::Done(Outcome::Finished {
                steps: done.metrics.steps,
                validation_loss: done.metrics.validation_loss,
            }));
        }

        let mut init_rng = batch::rng_for(h.seed, streams::LORA_INIT);
        // Built from the config checked above, not from a second read of config.json.
        let mut model = Llama::load_with_config(
            cfg,
            &model_dir,
            dtype,
            &device,
            Some((&settings, &mut init_rng)),
        )?;
        model.cpu_compute = cpu_compute(spec, &model)?;
        // The largest micro-batch: batch_size rows of the longest example (packing only
        // ever makes it smaller).
        let longest = train
            .examples
            .iter()
            .map(|e| e.input_ids.len())
            .max()
            .unwrap_or(1);
        model.checkpoint_layers = choose_checkpointing(spec, &model, &model_dir, longest, sink)?;
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
            compute: Some(crate::compute::ComputeEnv::detect(&self.model)),
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
        let fused =
            crate::fast::ComputePath::for_model(&self.model) == crate::fast::ComputePath::CpuFused;
        (j * accum..((j + 1) * accum).min(micro_per_epoch))
            .map(|m| {
                let idx = &order[m * bs..((m + 1) * bs).min(order.len())];
                let refs: Vec<&Example> = idx.iter().map(|&i| &train.examples[i]).collect();
                // The fused path packs each micro-batch's examples end to end: the same
                // examples and labelled tokens per step, without the padding.
                if fused {
                    batch::pack_batch(&refs, self.pad_id)
                } else {
                    make_batch(&refs, self.pad_id)
                }
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
            let lr = self.schedule.lr_at(self.step);
            let r = optimiser_step(
                &self.model,
                &mut self.opt,
                &batches,
                Some(StepDropout {
                    p: self.settings.dropout,
                    rng: &mut drop_rng,
                    record: None,
                }),
                self.h.max_grad_norm,
                lr,
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
            peak_memory_bytes: crate::bench::peak_resident_bytes(),
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

/// Whether to recompute each layer's activations: as the spec says, or, with `auto`,
/// when keeping them would pass the limit the launcher set for the micro-batch of
/// `batch_size` rows of `longest` tokens. On the fused CPU path that is the process's
/// limit (`TUNEQ_MEMORY_LIMIT_BYTES`) against what it holds now plus the step's bytes;
/// on candle's graph it is the accelerator's memory on CUDA
/// (`TUNEQ_ACCELERATOR_MEMORY_BYTES`) or the process's limit on the CPU graph, against
/// placement's own estimate of the graph. No limit: `auto` keeps the activations.
/// How the fused CPU path computes the frozen projections for `spec`. bf16 compute is
/// the fused path's: on CUDA the graph computes in the weights' dtype (bf16 already, as
/// `compute: bf16` asks), while the CPU graph (`TUNEQ_CPU_PATH=graph`) has no bf16
/// products to offer, so the run is refused there rather than run in f32 unasked.
fn cpu_compute(spec: &TrainSpec, model: &Llama) -> Result<tuneq_kernels::llama::Compute> {
    let fused = crate::fast::ComputePath::for_model(model) == crate::fast::ComputePath::CpuFused;
    match spec.compute {
        tuneq_openapi::ComputeKind::Bf16 if !fused && !model.device().is_cpu() => {
            Ok(tuneq_kernels::llama::Compute::F32)
        }
        tuneq_openapi::ComputeKind::Bf16 if !fused => {
            Err(Error::Spec(vec![tuneq_openapi::SpecError {
                field: "compute".into(),
                message: "bf16 compute runs on the fused CPU path, and TUNEQ_CPU_PATH=graph \
                      asks for candle's graph, which computes in f32 on the CPU"
                    .into(),
            }]))
        }
        kind => Ok(tuneq_pools::kernel_compute(kind)),
    }
}

fn choose_checkpointing(
    spec: &TrainSpec,
    model: &Llama,
    model_dir: &Path,
    longest: usize,
    sink: &mut dyn ProgressSink,
) -> Result<bool> {
    use tuneq_openapi::ActivationCheckpointing;
    let tokens = spec.hyperparameters.batch_size as usize * longest;
    let fused = crate::fast::ComputePath::for_model(model) == crate::fast::ComputePath::CpuFused;
    if !fused {
        return Ok(graph_checkpointing(spec, model, model_dir, longest, sink));
    }
    match spec.activation_checkpointing {
        ActivationCheckpointing::On => Ok(true),
        ActivationCheckpointing::Off => Ok(false),
        ActivationCheckpointing::Auto => {
            let Some(limit) = std::env::var(tuneq_openapi::launch::ENV_MEMORY_LIMIT_BYTES)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
            else {
                return Ok(false);
            };
            let dropout = spec.lora.dropout > 0.0;
            let resident = crate::bench::resident_bytes().unwrap_or(0);
            let keep = resident + crate::fast::step_bytes(model, tokens, dropout, false)?;
            if keep <= limit {
                return Ok(false);
            }
            let recompute = resident + crate::fast::step_bytes(model, tokens, dropout, true)?;
            sink.event(&TrainEvent::Warning {
                message: format!(
                    "activation checkpointing is on: a step of {tokens} tokens needs about {} MiB with its activations kept, over the limit of {} MiB, and about {} MiB recomputing them",
                    keep >> 20,
                    limit >> 20,
                    recompute >> 20
                ),
            });
            Ok(true)
        }
    }
}

/// [`choose_checkpointing`] on candle's graph.
fn graph_checkpointing(
    spec: &TrainSpec,
    model: &Llama,
    model_dir: &Path,
    longest: usize,
    sink: &mut dyn ProgressSink,
) -> bool {
    use tuneq_openapi::{ActivationCheckpointing, launch};
    let on_gpu = model.device().is_cuda();
    let limit_env = if on_gpu {
        launch::ENV_ACCELERATOR_MEMORY_BYTES
    } else {
        launch::ENV_MEMORY_LIMIT_BYTES
    };
    let limit = std::env::var(limit_env)
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok());
    // The model folder was just loaded from, so its config.json is there (and of an
    // architecture tuneq trains: the loader checked).
    let (Some(Ok(shape)), Some(limit), ActivationCheckpointing::Auto) = (
        tuneq_pools::ModelShape::read(model_dir),
        limit,
        spec.activation_checkpointing,
    ) else {
        return spec.activation_checkpointing == ActivationCheckpointing::On;
    };
    let ask = |checkpointing| tuneq_pools::Ask {
        lora: &spec.lora,
        max_seq_len: longest as u64,
        batch_size: u64::from(spec.hyperparameters.batch_size),
        dtype: spec.dtype,
        compute: spec.compute,
        checkpointing,
        dataset_tokens: 0,
    };
    let auto = ask(ActivationCheckpointing::Auto);
    if !tuneq_pools::graph_checkpointing(&shape, &auto, on_gpu, Some(limit)) {
        return false;
    }
    let bytes =
        |checkpointing| tuneq_pools::graph_memory_bytes(&shape, &ask(checkpointing), on_gpu);
    sink.event(&TrainEvent::Warning {
        message: format!(
            "activation checkpointing is on: a step of {} × {longest} tokens on {} needs about {} MiB with its activations kept, over the limit of {} MiB ({limit_env}), and about {} MiB recomputing them",
            spec.hyperparameters.batch_size,
            if on_gpu { "the GPU" } else { "the CPU graph" },
            bytes(ActivationCheckpointing::Off) >> 20,
            limit >> 20,
            bytes(ActivationCheckpointing::On) >> 20
        ),
    });
    true
}
