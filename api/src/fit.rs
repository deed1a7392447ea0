//! What a base model allows a job to ask for, decided at create so that a job that can
//! never train is refused with the numbers instead of failing (and being retried) later:
//! a sequence length within the model's positions, a LoRA rank within the adapted
//! projections' width, and the memory estimate placement compares with the pools'
//! ([`tuneq_pools::memory`]); then which pools can take the job, and at what cost.

use crate::error::{ApiError, ApiResult, Code};
use crate::state::AppState;
use tuneq_openapi::{FileObject, JobEstimate, TrainSpec};
use tuneq_pools::{Ask, ModelShape};

/// The projections `lora`'s targets wrap on a model of `shape`'s family
/// ([`tuneq_pools::Architecture::lora_targets`]); a projection the model does not have
/// (a Llama's `q_proj` on Phi-3, whose q, k and v are one `qkv_proj`) is refused naming
/// the field.
pub fn lora_targets(shape: &ModelShape, lora: &tuneq_openapi::LoraSpec) -> ApiResult<Vec<String>> {
    shape
        .architecture()
        .lora_targets(&lora.target_modules)
        .map_err(|wrong| {
            ApiError::invalid(
                "lora.target_modules",
                Code::InvalidValue,
                format!("lora.target_modules: {wrong}."),
            )
        })
}

/// Refuses what `shape` cannot give `ask`, naming the field and the model's limit.
pub fn check(shape: &ModelShape, model: &str, ask: &Ask<'_>) -> ApiResult<()> {
    if let Some(positions) = shape.max_position_embeddings
        && ask.max_seq_len > positions
    {
        return Err(ApiError::invalid(
            "hyperparameters.max_seq_len",
            Code::ExceedsModelContext,
            format!(
                "max_seq_len {} is longer than {model}'s {positions} positions.",
                ask.max_seq_len
            ),
        ));
    }
    let narrowest = ask
        .lora
        .target_modules
        .iter()
        .filter_map(|m| shape.projection(m).map(|(i, o)| (m, i.min(o))))
        .min_by_key(|(_, width)| *width);
    if let Some((module, width)) = narrowest
        && u64::from(ask.lora.r) > width
    {
        return Err(ApiError::invalid(
            "lora.r",
            Code::ExceedsProjectionWidth,
            format!(
                "lora.r {} is wider than {model}'s {module} ({width}); a rank above a projection's width adds nothing.",
                ask.lora.r
            ),
        ));
    }
    Ok(())
}

/// The memory an attempt needs, for placement: on a CPU pool (the fused step,
/// recomputing layers when the job allows it) and on a GPU pool (candle's graph).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MemoryNeeds {
    pub cpu: u64,
    pub gpu: u64,
}

/// The shape of `base` when its files are local and its `config.json` readable; None
/// otherwise (the trainer checks those models). A local model of an architecture tuneq
/// does not train is refused, naming it (registered before that was checked, or whose
/// folder changed since). Looked up once per request: a refused job's lighter settings
/// are checked against the same shape. The lookup ([`shape_of`]) runs on the blocking
/// pool, not on the request's runtime thread.
pub(crate) async fn local_shape(
    base: &crate::records::model::BaseModel,
) -> ApiResult<Option<ModelShape>> {
    let Ok(tuneq_storage::Location::Local(dir)) = tuneq_storage::Location::parse(&base.location)
    else {
        return Ok(None);
    };
    match tokio::task::spawn_blocking(move || shape_of(&dir)).await {
        Ok(Some(Ok(shape))) => Ok(Some(shape)),
        Ok(Some(Err(refusal))) => Err(unsupported_model(&base.id, &refusal)),
        Ok(None) | Err(_) => Ok(None),
    }
}

/// The refusal of a job on (or the registration of) a base model tuneq cannot train.
pub fn unsupported_model(model: &str, refusal: &tuneq_pools::Unsupported) -> ApiError {
    ApiError::invalid(
        "model",
        Code::UnsupportedModelArchitecture,
        format!("The base model {model:?} cannot be fine-tuned: {refusal}."),
    )
}

/// The files a shape is read from, as they were: each one's modification time and length,
/// None where it is missing.
type Stamps = [Option<(std::time::SystemTime, u64)>; 2];

/// How many model folders' shapes [`shape_of`] keeps; a full cache starts over.
const SHAPE_CACHE_ENTRIES: usize = 64;

fn stamps(dir: &std::path::Path) -> Stamps {
    ["config.json", "tokenizer.json"].map(|file| {
        let meta = std::fs::metadata(dir.join(file)).ok()?;
        Some((meta.modified().ok()?, meta.len()))
    })
}

/// The shape of the model in `dir`, read again only when its `config.json` or
/// `tokenizer.json` changed (modification time or length) since the last read: parsing a
/// real tokenizer file (2–20 MB) for its added tokens took 10–20 ms of every create.
/// Blocking. The stamps are taken before the read, so a file changed during it is read
/// again next time rather than kept stale.
fn shape_of(dir: &std::path::Path) -> Option<Result<ModelShape, tuneq_pools::Unsupported>> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    type Read = Option<Result<ModelShape, tuneq_pools::Unsupported>>;
    type Shapes = HashMap<std::path::PathBuf, (Stamps, Read)>;
    static SHAPES: OnceLock<Mutex<Shapes>> = OnceLock::new();
    let cache = SHAPES.get_or_init(Default::default);
    let now = stamps(dir);
    if let Some((_, shape)) = cache
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(dir)
        .filter(|(read_at, _)| *read_at == now)
    {
        return shape.clone();
    }
    let shape = ModelShape::read(dir);
    let mut shapes = cache.lock().unwrap_or_else(|e| e.into_inner());
    if shapes.len() >= SHAPE_CACHE_ENTRIES && !shapes.contains_key(dir) {
        shapes.clear();
    }
    shapes.insert(dir.to_path_buf(), (now, shape.clone()));
    shape
}

/// Refuses what the base model cannot give the job (context, projection width) and a
/// training file with nothing to learn at the job's sequence length; returns the memory
/// an attempt needs, for placement. Only models with a local `shape` (see
/// [`local_shape`]) are checked here (and estimated); the trainer checks the others.
pub(crate) fn check_job(
    base: &crate::records::model::BaseModel,
    shape: Option<&ModelShape>,
    spec: &TrainSpec,
    training: &FileObject,
) -> ApiResult<Option<MemoryNeeds>> {
    let h = &spec.hyperparameters;
    // The upload's statistics were counted at their own length, with some model's
    // tokenizer: they prove "nothing to learn" only for this model at a length no longer.
    if let Some(stats) = &training.validation.tokens
        && stats.model == base.id
        && stats.trained_tokens == 0
        && h.max_seq_len <= stats.max_seq_len
    {
        return Err(ApiError::invalid(
            "training_file",
            Code::NoTrainableTokens,
            format!(
                "No example of {} has a token to learn from at max_seq_len {} (every answer is cut off or empty); raise max_seq_len or fix the data.",
                training.id, h.max_seq_len
            ),
        ));
    }
    let Some(shape) = shape else {
        return Ok(None);
    };
    let ask = Ask {
        lora: &spec.lora,
        max_seq_len: u64::from(h.max_seq_len),
        batch_size: u64::from(h.batch_size) * spec.method.sequences_per_example(),
        dtype: spec.dtype,
        compute: spec.compute,
        checkpointing: spec.activation_checkpointing,
        dataset_tokens: tokens_to_process(training, &base.id, h.max_seq_len),
    };
    check(shape, &base.id, &ask)?;
    Ok(Some(MemoryNeeds {
        cpu: tuneq_pools::cpu_memory_needed(shape, &ask),
        gpu: tuneq_pools::gpu_memory_needed(shape, &ask),
    }))
}

/// The pools that can hold a fine-tune of `shape` at the default settings (LoRA,
/// sequence length, batch, dtype and checkpointing as a job that names none): those
/// placement would offer such a job, fastest first; none when none can.
pub(crate) fn pools_that_fit(state: &AppState, shape: &ModelShape) -> Vec<String> {
    let lora = tuneq_openapi::LoraSpec::default();
    let h = tuneq_openapi::train_spec::Hyperparameters::default();
    let ask = Ask {
        lora: &lora,
        max_seq_len: u64::from(h.max_seq_len),
        batch_size: u64::from(h.batch_size),
        dtype: Default::default(),
        compute: Default::default(),
        checkpointing: Default::default(),
        dataset_tokens: 0,
    };
    let needs = tuneq_pools::Needs {
        class: "any",
        memory_bytes: Some(tuneq_pools::cpu_memory_needed(shape, &ask)),
        accelerator_memory_bytes: Some(tuneq_pools::gpu_memory_needed(shape, &ask)),
        tokens: None,
        max_cost: None,
    };
    let speed = |pool: &str| state.pool_stats.speed(pool);
    tuneq_pools::plan(&state.config.pools, &needs, &speed)
        .map(|candidates| candidates.iter().map(|c| c.pool.name.clone()).collect())
        .unwrap_or_default()
}

/// The tokens one epoch over `training` puts through the model, for estimates: the
/// upload's count with this model's tokenizer when it was made at a length no shorter
/// than the job's (an upper bound then), else about four characters a token, at most
/// `max_seq_len` per example.
pub(crate) fn tokens_to_process(training: &FileObject, model: &str, max_seq_len: u32) -> u64 {
    let v = &training.validation;
    match &v.tokens {
        Some(t) if t.model == model && max_seq_len <= t.max_seq_len => t.tokens,
        _ => (v.characters / 4)
            .max(v.examples)
            .min(v.examples.saturating_mul(u64::from(max_seq_len))),
    }
}

/// Lighter settings of `spec` that need less memory and change nothing else the job
/// asked for, lightest last: bf16 frozen weights (unless it holds them in bf16 already),
/// recomputed activations where needed (if it turned that off), both. Each with the
/// field to blame and the advice, in the body's own terms.
pub(crate) fn lighter(spec: &TrainSpec) -> Vec<(&'static str, &'static str, TrainSpec)> {
    use tuneq_openapi::{ActivationCheckpointing, DtypeKind};
    let to_bf16 = spec.dtype.with_compute(spec.compute, false) != DtypeKind::Bf16;
    let to_auto = spec.activation_checkpointing == ActivationCheckpointing::Off;
    let with = |bf16: bool, auto: bool| TrainSpec {
        dtype: if bf16 { DtypeKind::Bf16 } else { spec.dtype },
        activation_checkpointing: if auto {
            ActivationCheckpointing::Auto
        } else {
            spec.activation_checkpointing
        },
        ..spec.clone()
    };
    let mut out = Vec::new();
    if to_bf16 {
        out.push(("dtype", r#""dtype": "bf16""#, with(true, false)));
    }
    if to_auto {
        out.push((
            "activation_checkpointing",
            r#""activation_checkpointing": "auto""#,
            with(false, true),
        ));
    }
    if to_bf16 && to_auto {
        out.push((
            "dtype",
            r#""dtype": "bf16" and "activation_checkpointing": "auto""#,
            with(true, true),
        ));
    }
    out
}

/// The pools a job may use, best first, and its estimate on the first; or the refusal,
/// naming the field and the figures.
pub(crate) fn place(
    state: &AppState,
    needs: &tuneq_pools::Needs<'_>,
) -> ApiResult<(Vec<String>, Option<JobEstimate>)> {
    let candidates = tuneq_pools::plan(&state.config.pools, needs, &|pool| {
        state.pool_stats.speed(pool)
    })
    .map_err(|refusal| {
        let code = match refusal {
            tuneq_pools::Refusal::NoHardware { .. } => Code::NoPoolFits,
            tuneq_pools::Refusal::DoesNotFit { .. } => Code::DoesNotFit,
            tuneq_pools::Refusal::OverBudget { .. } => Code::OverBudget,
        };
        ApiError::invalid(refusal.field(), code, refusal.to_string())
    })?;
    let pools: Vec<String> = candidates.iter().map(|c| c.pool.name.clone()).collect();
    let estimate = candidates.first().and_then(|first| {
        first.estimate.map(|e| JobEstimate {
            pool: first.pool.name.clone(),
            seconds: e.seconds,
            cost: e.cost,
            pools: pools.clone(),
        })
    });
    Ok((pools, estimate))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use tuneq_openapi::{DtypeKind, LoraSpec};

    fn small() -> ModelShape {
        serde_json::from_value(serde_json::json!({
            "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
            "max_position_embeddings": 512
        }))
        .unwrap()
    }

    fn ask(lora: &LoraSpec, max_seq_len: u64, batch_size: u64) -> Ask<'_> {
        Ask {
            lora,
            max_seq_len,
            batch_size,
            dtype: DtypeKind::F32,
            compute: tuneq_openapi::ComputeKind::F32,
            checkpointing: tuneq_openapi::ActivationCheckpointing::Auto,
            dataset_tokens: 0,
        }
    }

    /// A model folder whose files change is read again: a cached shape never outlives
    /// the files it was read from.
    #[test]
    fn a_changed_config_is_read_again() {
        let dir = tempfile::tempdir().unwrap();
        let config = |layers: u64| {
            serde_json::json!({
                "model_type": "llama", "hidden_size": 64, "intermediate_size": 172,
                "num_hidden_layers": layers, "num_attention_heads": 4, "vocab_size": 256
            })
            .to_string()
        };
        let read = |dir: &std::path::Path| shape_of(dir).unwrap().unwrap();
        assert!(shape_of(dir.path()).is_none(), "no config.json yet");
        std::fs::write(dir.path().join("config.json"), config(2)).unwrap();
        assert_eq!(read(dir.path()).num_hidden_layers, 2);
        assert_eq!(read(dir.path()).num_hidden_layers, 2);
        // A different length, whatever the clock's resolution.
        std::fs::write(dir.path().join("config.json"), config(12)).unwrap();
        let shape = read(dir.path());
        assert_eq!(shape.num_hidden_layers, 12);
        assert_eq!(shape.added_tokens, None);
        std::fs::write(
            dir.path().join("tokenizer.json"),
            r#"{"added_tokens": [{"id": 0, "content": "<s>"}]}"#,
        )
        .unwrap();
        assert_eq!(read(dir.path()).added_tokens, Some(1));
        // A folder that became another architecture's is refused, not kept as it was.
        std::fs::write(
            dir.path().join("config.json"),
            config(12).replace("\"llama\"", "\"phi\""),
        )
        .unwrap();
        let refusal = shape_of(dir.path()).unwrap().unwrap_err();
        assert_eq!(refusal.field(), "model_type");
    }

    #[test]
    fn the_model_bounds_sequence_length_and_rank() {
        let shape = small();
        let lora = LoraSpec::default();
        assert!(check(&shape, "m", &ask(&lora, 512, 4)).is_ok());
        let e = check(&shape, "m", &ask(&lora, 513, 4)).unwrap_err();
        assert_eq!(
            e.detail.param.as_deref(),
            Some("hyperparameters.max_seq_len")
        );
        // k_proj and v_proj are 64 → 32 wide (2 kv heads of 16).
        let wide = LoraSpec {
            r: 33,
            ..LoraSpec::default()
        };
        let e = check(&shape, "m", &ask(&wide, 128, 4)).unwrap_err();
        assert_eq!(e.detail.param.as_deref(), Some("lora.r"));
        assert!(e.detail.message.contains("k_proj"), "{}", e.detail.message);
        let only_mlp = LoraSpec {
            r: 33,
            target_modules: vec!["gate_proj".into()],
            ..LoraSpec::default()
        };
        assert!(check(&shape, "m", &ask(&only_mlp, 128, 4)).is_ok());
    }
}
