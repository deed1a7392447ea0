//! Loading a run's model: its folder checked against the tokenizer and the spec, the
//! fresh adapter, the CPU compute mode, and whether to recompute activations.

use super::inputs::EncodedData;
use crate::batch::{self, streams};
use crate::config::LlamaConfig;
use crate::data::Encoder;
use crate::error::{Error, Result};
use crate::lora::LoraSettings;
use crate::model::Llama;
use crate::progress::ProgressSink;
use candle_core::Device;
use std::path::Path;
use tuneq_openapi::{TrainEvent, TrainSpec};

/// The model folder's config and tokenizer, checked against each other and the spec.
/// The folder is checked before anything else reads from it, so a wrong path says
/// "config.json not found" rather than naming whichever file was read first.
pub(super) fn checked_model(spec: &TrainSpec, model_dir: &Path) -> Result<(LlamaConfig, Encoder)> {
    let h = &spec.hyperparameters;
    let cfg = LlamaConfig::load(model_dir)?;
    if h.max_seq_len as usize > cfg.max_position_embeddings() {
        return Err(Error::Spec(vec![tuneq_openapi::SpecError {
            field: "hyperparameters.max_seq_len".into(),
            message: format!(
                "{} exceeds the model's max_position_embeddings {}",
                h.max_seq_len,
                cfg.max_position_embeddings()
            ),
        }]));
    }
    let encoder = Encoder::from_model_dir(model_dir, spec.chat_template)?;
    let tokenizer_vocab = encoder.tokenizer().get_vocab_size(true);
    if tokenizer_vocab > cfg.vocab_size() {
        return Err(Error::Model {
            path: model_dir.display().to_string(),
            message: format!(
                "tokenizer.json has {tokenizer_vocab} tokens but config.json vocab_size is {}",
                cfg.vocab_size()
            ),
        });
    }
    Ok((cfg, encoder))
}

/// The model to load: its checked config and folder, and how to hold it.
pub(super) struct LoadedModel<'m> {
    pub(super) cfg: LlamaConfig,
    pub(super) dir: &'m Path,
    pub(super) dtype: candle_core::DType,
    pub(super) device: &'m Device,
    pub(super) settings: &'m LoraSettings,
    /// The adapter to start from (staged locally), instead of fresh factors.
    pub(super) init_adapter: Option<&'m Path>,
}

/// Loads the model with a fresh adapter (drawn from the seed's LoRA stream), its CPU
/// compute, and activation checkpointing chosen for the largest micro-batch.
pub(super) fn load_model(
    spec: &TrainSpec,
    m: LoadedModel<'_>,
    train: &EncodedData,
    sink: &mut dyn ProgressSink,
) -> Result<Llama> {
    let mut init_rng = batch::rng_for(spec.hyperparameters.seed, streams::LORA_INIT);
    // Built from the config checked above, not from a second read of config.json.
    let mut model = Llama::load_with_config(
        m.cfg,
        m.dir,
        m.dtype,
        m.device,
        Some((m.settings, &mut init_rng)),
    )?;
    if let Some(dir) = m.init_adapter {
        start_from(&mut model, m.settings, dir)?;
    }
    model.cpu_compute = cpu_compute(spec, &model)?;
    // The largest micro-batch: batch_size rows of the longest example (packing only
    // ever makes it smaller).
    let longest = train
        .examples
        .iter()
        .map(|e| e.input_ids.len())
        .max()
        .unwrap_or(1);
    model.checkpoint_layers = choose_checkpointing(spec, &model, m.dir, longest, sink)?;
    Ok(model)
}

/// Sets the LoRA factors to the adapter in `dir`, which must have the shape `settings`
/// asks for (rank, alpha, rsLoRA, target modules): another alpha or rank would start
/// from another function than the one the adapter learnt.
fn start_from(model: &mut Llama, settings: &LoraSettings, dir: &Path) -> Result<()> {
    let (found, tensors) = crate::peft::load_adapter(dir, model.device())?;
    let mut targets = found.targets.clone();
    let mut wanted = settings.targets.clone();
    targets.sort();
    wanted.sort();
    if (found.r, found.alpha, found.rslora, &targets)
        != (settings.r, settings.alpha, settings.rslora, &wanted)
    {
        return Err(Error::Spec(vec![tuneq_openapi::SpecError {
            field: "init_adapter".into(),
            message: format!(
                "the adapter has r {}, alpha {}, rslora {} on {}; this run asks for r {}, alpha {}, rslora {} on {}: give the run the adapter's LoRA settings",
                found.r,
                found.alpha,
                found.rslora,
                targets.join(","),
                settings.r,
                settings.alpha,
                settings.rslora,
                wanted.join(",")
            ),
        }]));
    }
    model.set_adapter(settings, &tensors, &dir.display().to_string())
}

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

/// Whether to recompute each layer's activations: as the spec says, or, with `auto`,
/// when keeping them would pass the limit the launcher set for the micro-batch of
/// `batch_size` rows of `longest` tokens. On the fused CPU path that is the process's
/// limit (`TUNEQ_MEMORY_LIMIT_BYTES`) against what it holds now plus the step's bytes;
/// on candle's graph it is the accelerator's memory on CUDA
/// (`TUNEQ_ACCELERATOR_MEMORY_BYTES`) or the process's limit on the CPU graph, against
/// placement's own estimate of the graph. No limit: `auto` keeps the activations.
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
        batch_size: u64::from(spec.hyperparameters.batch_size)
            * spec.method.sequences_per_example(),
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
