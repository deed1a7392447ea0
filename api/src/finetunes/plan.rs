//! A create request → everything decided about it: the fine-tune record, the
//! [`TrainSpec`] the queue job carries, and the pools it may run on. A request that can
//! never run is refused here with a 400 naming the field, before anything is written.

use super::range::check_range;
use crate::auth::Tenant;
use crate::error::{ApiError, ApiResult, Code};
use crate::records;
use crate::records::finetune::{FineTuneRecord, Parent};
use crate::records::model::BaseModel;
use crate::state::AppState;
use actix_web::http::StatusCode;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use tuneq_openapi::{
    AutoOrInt, AutoOrNumber, CheckpointPolicy, FileObject, FineTuneCreate, HyperparametersRequest,
    JobEstimate, JobHyperparameters, SamplingSpec, TrainSpec, TrainingMethod,
};
use tuneq_storage::layout::{self, Id};

/// Everything decided about a valid create request.
pub(super) struct Plan {
    /// The fine-tune record to write (its queue job id is set once enqueued).
    pub(super) record: FineTuneRecord,
    /// What the queue job carries.
    pub(super) spec: TrainSpec,
    /// The pools it may run on, in order of preference.
    pub(super) pools: Vec<String>,
    /// The MLflow runs to open for it (`integrations`), checked.
    pub(super) runs: Vec<tuneq_openapi::MlflowRunRequest>,
}

/// The method a request asks for, and the hyperparameters it gives: from `method`
/// (`supervised` or `dpo`) or the older top-level place.
fn requested_hyperparameters(
    body: &FineTuneCreate,
) -> ApiResult<(MethodKind, HyperparametersRequest)> {
    let Some(method) = &body.method else {
        return Ok((
            MethodKind::Supervised,
            body.hyperparameters.clone().unwrap_or_default(),
        ));
    };
    let (kind, given) = match method.kind.as_str() {
        "supervised" if method.dpo.is_none() && method.reinforcement.is_none() => (
            MethodKind::Supervised,
            method.supervised.as_ref().map(|s| &s.hyperparameters),
        ),
        "dpo" if method.supervised.is_none() && method.reinforcement.is_none() => (
            MethodKind::Dpo,
            method.dpo.as_ref().map(|d| &d.hyperparameters),
        ),
        "supervised" | "dpo" => {
            return Err(ApiError::invalid(
                "method",
                Code::ConflictingValues,
                format!(
                    "A {} method takes settings only under method.{}.",
                    method.kind, method.kind
                ),
            ));
        }
        other => {
            return Err(ApiError::invalid(
                "method.type",
                Code::UnsupportedMethod,
                format!(
                    "The supervised and dpo methods are offered, not `{}`.",
                    crate::quote::shown(other)
                ),
            ));
        }
    };
    match (given.cloned().flatten(), &body.hyperparameters) {
        (Some(_), Some(_)) => Err(ApiError::invalid(
            "hyperparameters",
            Code::ConflictingValues,
            format!(
                "Give hyperparameters either at the top level or in method.{}, not both.",
                method.kind
            ),
        )),
        (Some(h), None) => Ok((kind, h)),
        (None, top) => Ok((kind, top.clone().unwrap_or_default())),
    }
}

/// Which method a job runs, before its settings are resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MethodKind {
    Supervised,
    Dpo,
}

/// The learning-rate multiplier `"auto"` means: DPO moves a model that already
/// answers, and a tenth of the supervised rate keeps it near its reference.
fn auto_multiplier(kind: MethodKind) -> f64 {
    match kind {
        MethodKind::Supervised => 1.0,
        MethodKind::Dpo => 0.1,
    }
}

/// The method as the trainer runs it: DPO's β resolved (`"auto"`: 0.1); β given to
/// the supervised method is refused.
fn training_method(kind: MethodKind, h: &HyperparametersRequest) -> ApiResult<TrainingMethod> {
    match (kind, h.beta) {
        (MethodKind::Supervised, None) => Ok(TrainingMethod::Supervised),
        (MethodKind::Supervised, Some(_)) => Err(ApiError::invalid(
            "hyperparameters.beta",
            Code::InvalidValue,
            "beta is a setting of the dpo method; this job's method is supervised.",
        )),
        (MethodKind::Dpo, None | Some(AutoOrNumber::Auto(_))) => Ok(TrainingMethod::Dpo {
            beta: TrainingMethod::DEFAULT_BETA,
        }),
        (MethodKind::Dpo, Some(AutoOrNumber::Value(beta))) if beta > 0.0 && beta <= 10.0 => {
            Ok(TrainingMethod::Dpo { beta })
        }
        (MethodKind::Dpo, Some(AutoOrNumber::Value(beta))) => Err(ApiError::invalid(
            "hyperparameters.beta",
            Code::InvalidValue,
            format!(
                "beta must be more than 0 and at most 10, not {}.",
                crate::quote::shown(&beta.to_string())
            ),
        )),
    }
}

/// OpenAI's "auto" epochs: 3, moved so the run sees 100 to 25 000 examples, within 1–25.
fn auto_epochs(examples: u64) -> u64 {
    let examples = examples.max(1);
    let mut epochs = 3u64;
    if epochs * examples < 100 {
        epochs = 100u64.div_ceil(examples);
    }
    if epochs * examples > 25_000 {
        epochs = 25_000 / examples;
    }
    epochs.clamp(1, 25)
}

fn check_suffix(suffix: &str) -> ApiResult<()> {
    // It becomes a segment of the model name (`ft:base:tenant:suffix:id`): a segment
    // such as `..` reads as a path wherever names are used as one.
    let ok = suffix.len() <= 64
        && suffix.starts_with(|c: char| c.is_ascii_alphanumeric())
        && suffix
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !ok {
        return Err(ApiError::invalid(
            "suffix",
            Code::InvalidValue,
            "suffix must be 1 to 64 letters, digits, '-', '_' or '.', starting with a letter or digit.",
        ));
    }
    Ok(())
}

fn check_metadata(metadata: &BTreeMap<String, String>) -> ApiResult<()> {
    if metadata.len() > 16 {
        return Err(ApiError::invalid(
            "metadata",
            Code::InvalidValue,
            "metadata holds at most 16 pairs.",
        ));
    }
    for (key, value) in metadata {
        crate::text::check("metadata key", key, 64, false).map_err(|mut e| {
            e.detail.param = Some("metadata".into());
            e
        })?;
        if !value.is_empty() {
            crate::text::check(&format!("metadata.{key}"), value, 512, true)?;
        }
    }
    Ok(())
}

/// The tenant's uploaded file `id`, or a 400 naming `param` (also for a job's result
/// file, which is not a dataset).
async fn dataset(
    state: &AppState,
    tenant: &Tenant,
    param: &str,
    id: &str,
) -> ApiResult<tuneq_openapi::FileObject> {
    let file = uploaded(state, tenant, param, id).await?;
    if tuneq_openapi::FilePurpose::parse(&file.purpose)
        != Some(tuneq_openapi::FilePurpose::FineTune)
    {
        return Err(ApiError::invalid(
            param,
            Code::InvalidValue,
            format!(
                "{} is a job's result file (purpose {}), not a dataset uploaded for fine-tuning.",
                file.id, file.purpose
            ),
        ));
    }
    Ok(file)
}

/// The tenant's file `id`, or a 400 naming `param`.
async fn uploaded(
    state: &AppState,
    tenant: &Tenant,
    param: &str,
    id: &str,
) -> ApiResult<tuneq_openapi::FileObject> {
    records::file::find(&state.queue, &tenant.0, id)
        .await
        .map_err(|e| {
            if e.status == StatusCode::NOT_FOUND {
                ApiError::invalid(
                    param,
                    Code::FileNotFound,
                    format!(
                        "No uploaded file `{}`: upload it with POST /v1/files first.",
                        crate::quote::shown(id)
                    ),
                )
            } else {
                e
            }
        })
}

/// Decides everything about a create request, refusing one that can never run.
pub(super) async fn plan(
    state: &AppState,
    tenant: &Tenant,
    id: &str,
    body: &FineTuneCreate,
) -> ApiResult<Plan> {
    let Start { base, parent } = starting_point(state, tenant, body).await?;
    let (training, validation) = datasets(state, tenant, body).await?;
    let options = check_options(state, body)?;
    let mut choice = choose_hyperparameters(body, &base, training.validation.examples)?;
    if let Some((parent, _)) = &parent {
        choice.lora = continued_lora(body, parent)?;
    }
    for file in std::iter::once(&training).chain(validation.as_ref()) {
        check_records_fit_method(file, choice.method)?;
    }
    let files = JobFiles {
        training: &training,
        validation: validation.as_ref(),
    };
    let shape = crate::fit::local_shape(&base).await?;
    if let Some(shape) = &shape {
        // The targets as this model's projections (all seven of a Llama's mean Phi-3's
        // four fused ones), so that the job, its spec and its adapter name the same.
        choice.lora.target_modules = crate::fit::lora_targets(shape, &choice.lora)?;
    }
    let mut spec = job_spec(state, tenant, id, body, &base, files, &choice)?;
    spec.init_adapter = parent.as_ref().map(|(_, adapter)| adapter.clone());
    // A continued model keeps the template it was trained with; a base model's is the
    // one it was registered with.
    spec.chat_template = parent
        .as_ref()
        .map_or(base.template(), |(parent, _)| parent.template());
    let placing = Placing {
        base: &base,
        shape: shape.as_ref(),
        training: &training,
    };
    let (pools, estimate) = place_job(state, body, placing, &spec, &options, &choice).await?;
    let record = FineTuneRecord {
        id: id.to_string(),
        tenant: tenant.0.clone(),
        created_at: records::now_seconds(),
        model: body.model.clone(),
        base_model: (base.id != body.model).then(|| base.id.clone()),
        parent: parent.map(|(parent, _)| Parent {
            job: parent.id.clone(),
            name_base: parent.name_base().to_string(),
        }),
        training_file: training.id,
        validation_file: validation.map(|v| v.id),
        hyperparameters: JobHyperparameters {
            batch_size: choice.batch_size,
            learning_rate_multiplier: choice.multiplier,
            n_epochs: choice.n_epochs,
        },
        method: choice.method,
        learning_rate: choice.learning_rate,
        lora: choice.lora,
        seed: choice.seed,
        suffix: body.suffix.clone(),
        metadata: body.metadata.clone(),
        priority: options.priority,
        hardware: options.hardware,
        job_id: String::new(),
        request_hash: request_hash(body),
        outcome: None,
        webhook_url: options.webhook_url,
        webhook: None,
        max_cost: body.max_cost,
        estimate,
        dtype: Some(spec.dtype),
        activation_checkpointing: Some(spec.activation_checkpointing),
        compute: Some(spec.compute),
        chat_template: Some(spec.chat_template),
        integrations: Vec::new(),
    };
    Ok(Plan {
        record,
        spec,
        pools,
        runs: options.runs,
    })
}

/// Where a job starts: a registered base model, or one of the tenant's fine-tuned
/// models, whose adapter it goes on training.
struct Start {
    /// The base model trained.
    base: BaseModel,
    /// The job whose fine-tuned model is continued, and where its adapter is.
    parent: Option<(FineTuneRecord, String)>,
}

/// What the request's `model` names: a base model (by its id or an alias), or a
/// fine-tuned model of the tenant's (`ft:…`, succeeded and not deleted) or one of its
/// kept checkpoints (`ft:…:ckpt-step-N`) to continue from; another tenant's is not
/// found, as an unknown one is.
async fn starting_point(
    state: &AppState,
    tenant: &Tenant,
    body: &FineTuneCreate,
) -> ApiResult<Start> {
    if !body.model.starts_with("ft:") {
        let base = base_model(state, body).await?;
        return Ok(Start { base, parent: None });
    }
    let not_found = |message: String| ApiError::invalid("model", Code::ModelNotFound, message);
    let shown = crate::quote::shown(&body.model);
    let tuned = super::tuned::tuned_model(state, &tenant.0, &body.model)
        .await?
        .map_err(|why| {
            not_found(why.explain(
                &body.model,
                &format!(
                    "No fine-tuned model `{shown}` of yours to continue from: GET /v1/models lists them."
                ),
            ))
        })?;
    let adapter = state.store.uri(&tuned.adapter);
    Ok(Start {
        base: tuned.base,
        parent: Some((tuned.job, adapter)),
    })
}

/// The LoRA settings of a job continuing `parent`'s model: the parent's, or the
/// request's when they have the same shape (rank, alpha, rsLoRA and targets; dropout
/// may differ).
fn continued_lora(
    body: &FineTuneCreate,
    parent: &FineTuneRecord,
) -> ApiResult<tuneq_openapi::LoraSpec> {
    let Some(asked) = &body.lora else {
        return Ok(parent.lora.clone());
    };
    let shape = |l: &tuneq_openapi::LoraSpec| {
        let mut targets = l.target_modules.clone();
        targets.sort();
        // Every projection, whichever names say it (a Llama's seven are Phi-3's four).
        let fused = tuneq_openapi::FUSED_PROJECTIONS;
        if tuneq_openapi::projections::names_every_projection(&targets)
            || fused.iter().all(|p| targets.iter().any(|t| t == p))
        {
            targets = vec!["*".into()];
        }
        (l.r, l.alpha, l.rslora, targets)
    };
    if shape(asked) != shape(&parent.lora) {
        return Err(ApiError::invalid(
            "lora",
            Code::ConflictingValues,
            format!(
                "The model continued from has LoRA r {}, alpha {} on {}; a job continuing it trains the same adapter, so its lora must have the same rank, alpha, rslora and target_modules (or be left out).",
                parent.lora.r,
                parent.lora.alpha,
                parent.lora.target_modules.join(",")
            ),
        ));
    }
    Ok(asked.clone())
}

/// The registered base model a request names (by its id or an alias), or a 400 on
/// `model`.
async fn base_model(state: &AppState, body: &FineTuneCreate) -> ApiResult<BaseModel> {
    records::model::resolve(&state.queue, &state.config.model_aliases, &body.model)
        .await?
        .ok_or_else(|| {
            ApiError::invalid(
                "model",
                Code::ModelNotFound,
                format!(
                    "No base model `{}`: GET /v1/models lists the ones you can fine-tune.",
                    crate::quote::shown(&body.model)
                ),
            )
        })
}

/// Refuses a file whose records the method does not train on: preference pairs for the
/// supervised method (trained as conversations, they would teach the preferred answer
/// and drop the other), anything else for DPO (which compares two answers).
fn check_records_fit_method(file: &FileObject, method: TrainingMethod) -> ApiResult<()> {
    let pairs = file.validation.format == "preference";
    let message = match method {
        TrainingMethod::Supervised if pairs => format!(
            "{} holds preference pairs (input, preferred_output, non_preferred_output), which train with the dpo method; this job's method is supervised, which trains on chat, prompt/completion, alpaca or text records.",
            file.id
        ),
        TrainingMethod::Dpo { .. } if !pairs => format!(
            "{} holds {} records; the dpo method trains on preference pairs (input, preferred_output, non_preferred_output).",
            file.id, file.validation.format
        ),
        _ => return Ok(()),
    };
    Err(ApiError::invalid("method", Code::MethodMismatch, message))
}

/// The request's training file and, when given, its validation file (which must be
/// another file).
async fn datasets(
    state: &AppState,
    tenant: &Tenant,
    body: &FineTuneCreate,
) -> ApiResult<(FileObject, Option<FileObject>)> {
    let training = dataset(state, tenant, "training_file", &body.training_file).await?;
    let validation = match &body.validation_file {
        Some(v) if v == &body.training_file => {
            return Err(ApiError::invalid(
                "validation_file",
                Code::InvalidValue,
                "The validation file must not be the training file.",
            ));
        }
        Some(v) => Some(dataset(state, tenant, "validation_file", v).await?),
        None => None,
    };
    Ok((training, validation))
}

/// The request's options other than the training settings, checked.
struct Options {
    /// The MLflow runs asked for.
    runs: Vec<tuneq_openapi::MlflowRunRequest>,
    /// The webhook target as the url crate serialises it.
    webhook_url: Option<String>,
    /// The hardware class (`any` when not given).
    hardware: String,
    /// The queue priority, 0 to 9.
    priority: u8,
}

/// Checks the integrations, the webhook target, `max_cost`, the hardware class, the
/// priority, the suffix and the metadata, in that order.
fn check_options(state: &AppState, body: &FineTuneCreate) -> ApiResult<Options> {
    let runs = super::integrations::check(state, body)?;
    // The URL is kept as the url crate serialises it: what was checked is what is
    // later called, whichever parser reads the record.
    let webhook_url = match &body.webhook_url {
        Some(url) => Some(
            crate::webhook_target::check_url(url, &state.config.webhooks)
                .map_err(|reason| {
                    ApiError::invalid("webhook_url", Code::InvalidWebhookUrl, reason)
                })?
                .to_string(),
        ),
        None => None,
    };
    let hardware = body.hardware.clone().unwrap_or_else(|| "any".into());
    if let Some(max_cost) = body.max_cost
        && !(max_cost.is_finite() && max_cost > 0.0)
    {
        return Err(ApiError::invalid(
            "max_cost",
            Code::InvalidValue,
            format!(
                "max_cost must be a number above 0, not {}.",
                crate::quote::shown(&max_cost.to_string())
            ),
        ));
    }
    // The hardware class first: the cheapest refusal, before files are read.
    crate::fit::place(
        state,
        &tuneq_pools::Needs {
            class: &hardware,
            ..Default::default()
        },
    )?;
    let priority = check_range("priority", body.priority.unwrap_or(5), 0, 9)?;
    if let Some(suffix) = &body.suffix {
        check_suffix(suffix)?;
    }
    if let Some(metadata) = &body.metadata {
        check_metadata(metadata)?;
    }
    Ok(Options {
        runs,
        webhook_url,
        hardware,
        priority,
    })
}

/// The training settings a request resolves to ("auto" and defaults filled in).
struct Choice {
    /// What the job optimises.
    method: TrainingMethod,
    /// The hyperparameters as requested.
    requested: HyperparametersRequest,
    n_epochs: u64,
    batch_size: u64,
    multiplier: f64,
    learning_rate: f64,
    seed: u64,
    lora: tuneq_openapi::LoraSpec,
}

/// Resolves the requested hyperparameters for a training file of `examples` examples
/// on `base`, refusing values out of range.
fn choose_hyperparameters(
    body: &FineTuneCreate,
    base: &BaseModel,
    examples: u64,
) -> ApiResult<Choice> {
    let (kind, h) = requested_hyperparameters(body)?;
    let method = training_method(kind, &h)?;
    let n_epochs = match h.n_epochs {
        None | Some(AutoOrInt::Auto(_)) => auto_epochs(examples),
        Some(AutoOrInt::Value(n)) => check_range("hyperparameters.n_epochs", n, 1, 50)?,
    };
    let batch_size = match h.batch_size {
        None | Some(AutoOrInt::Auto(_)) => examples.clamp(1, 8),
        Some(AutoOrInt::Value(n)) => check_range("hyperparameters.batch_size", n, 1, 256)?,
    };
    let multiplier = match h.learning_rate_multiplier {
        None | Some(AutoOrNumber::Auto(_)) => auto_multiplier(kind),
        Some(AutoOrNumber::Value(m)) if (0.001..=10.0).contains(&m) => m,
        Some(AutoOrNumber::Value(m)) => {
            return Err(ApiError::invalid(
                "hyperparameters.learning_rate_multiplier",
                Code::InvalidValue,
                format!(
                    "learning_rate_multiplier must be 0.001 to 10, not {}.",
                    crate::quote::shown(&m.to_string())
                ),
            ));
        }
    };
    let learning_rate = h
        .learning_rate
        .unwrap_or(base.base_learning_rate * multiplier);
    let seed = body
        .seed
        .unwrap_or_else(|| u64::from(rand::random::<u32>()));
    Ok(Choice {
        method,
        requested: h,
        n_epochs,
        batch_size,
        multiplier,
        learning_rate,
        seed,
        lora: body.lora.clone().unwrap_or_default(),
    })
}

/// The job's data files.
#[derive(Clone, Copy)]
struct JobFiles<'a> {
    training: &'a FileObject,
    validation: Option<&'a FileObject>,
}

/// The [`TrainSpec`] the queue job carries, validated.
fn job_spec(
    state: &AppState,
    tenant: &Tenant,
    id: &str,
    body: &FineTuneCreate,
    base: &BaseModel,
    files: JobFiles<'_>,
    choice: &Choice,
) -> ApiResult<TrainSpec> {
    let tenant_id = Id::parse(&tenant.0).map_err(|_| ApiError::internal("tenant id"))?;
    let job_key = Id::parse(id).map_err(|_| ApiError::internal("job id"))?;
    let steps_per_epoch = files
        .training
        .validation
        .examples
        .div_ceil(choice.batch_size)
        .max(1);
    let n_epochs = choice.n_epochs;
    let mut spec = TrainSpec {
        model: base.location.clone(),
        training_files: vec![
            state
                .store
                .uri(&records::file::content_key(&tenant.0, &files.training.id)?),
        ],
        validation_file: match files.validation {
            Some(v) => Some(
                state
                    .store
                    .uri(&records::file::content_key(&tenant.0, &v.id)?),
            ),
            None => None,
        },
        output: state.store.uri(&layout::job_output(&tenant_id, &job_key)),
        dataset_format: Default::default(),
        chat_template: Default::default(),
        hyperparameters: Default::default(),
        lora: choice.lora.clone(),
        // Checkpoints about ten times per run (and every five minutes) bound what a
        // preemption can cost.
        checkpoint: CheckpointPolicy {
            every_steps: Some((steps_per_epoch * n_epochs / 10).max(1)),
            every_seconds: Some(300),
            keep_last: 2,
        },
        sampling: SamplingSpec {
            num_samples: 0,
            ..SamplingSpec::default()
        },
        device: Default::default(),
        dtype: body.dtype.unwrap_or(tuneq_openapi::DtypeKind::Auto),
        activation_checkpointing: body.activation_checkpointing.unwrap_or_default(),
        compute: body.compute.unwrap_or_default(),
        init_adapter: None,
        method: choice.method,
        model_identity: base.identity.clone(),
    };
    let h = &choice.requested;
    let hp = &mut spec.hyperparameters;
    hp.epochs = u32::try_from(n_epochs).unwrap_or(u32::MAX);
    hp.batch_size = u32::try_from(choice.batch_size).unwrap_or(u32::MAX);
    hp.learning_rate = choice.learning_rate;
    hp.seed = choice.seed;
    if let Some(len) = h.max_seq_len {
        hp.max_seq_len = check_range("hyperparameters.max_seq_len", len, 8, 32_768)?;
    }
    if let Some(warmup) = h.warmup_steps {
        let total_steps = steps_per_epoch * n_epochs;
        if warmup > total_steps {
            return Err(ApiError::invalid(
                "hyperparameters.warmup_steps",
                Code::InvalidValue,
                format!(
                    "warmup_steps {warmup} is more than the job's {total_steps} steps ({n_epochs} epoch(s) of {steps_per_epoch}); it would never reach its learning rate."
                ),
            ));
        }
        hp.warmup_steps = warmup;
    }
    if files.validation.is_some() {
        hp.eval_every_steps = spec.checkpoint.every_steps;
    }
    if h.early_stopping.is_some() && files.validation.is_none() {
        return Err(ApiError::invalid(
            "hyperparameters.early_stopping",
            Code::InvalidValue,
            "Early stopping watches the validation loss: give a validation_file.",
        ));
    }
    hp.early_stopping = h.early_stopping;
    if let Err(problems) = spec.validate() {
        return Err(spec_problems(&problems));
    }
    Ok(spec)
}

/// What a job is placed with: its base model, that model's shape where its files are
/// local, and its training file.
struct Placing<'a> {
    base: &'a BaseModel,
    shape: Option<&'a tuneq_pools::ModelShape>,
    training: &'a FileObject,
}

/// The pools the job may run on and its estimate; a job too large as asked is refused
/// naming the first of its own settings that would make it fit.
async fn place_job(
    state: &AppState,
    body: &FineTuneCreate,
    Placing {
        base,
        shape,
        training,
    }: Placing<'_>,
    spec: &TrainSpec,
    options: &Options,
    choice: &Choice,
) -> ApiResult<(Vec<String>, Option<JobEstimate>)> {
    let memory = crate::fit::check_job(base, shape, spec, training)?;
    let tokens =
        crate::fit::tokens_to_process(training, &base.id, spec.hyperparameters.max_seq_len)
            .saturating_mul(choice.n_epochs);
    let needs = |memory: Option<crate::fit::MemoryNeeds>| tuneq_pools::Needs {
        class: &options.hardware,
        memory_bytes: memory.map(|m| m.cpu),
        accelerator_memory_bytes: memory.map(|m| m.gpu),
        tokens: Some(tokens),
        max_cost: body.max_cost,
    };
    match crate::fit::place(state, &needs(memory)) {
        Ok(placed) => Ok(placed),
        // Too large as asked: say which of the job's own settings would make it fit.
        Err(refused) if refused.code() == Code::DoesNotFit => {
            for (param, advice, lighter) in crate::fit::lighter(spec) {
                let memory = crate::fit::check_job(base, shape, &lighter, training)?;
                if crate::fit::place(state, &needs(memory)).is_ok() {
                    return Err(ApiError::invalid(
                        param,
                        Code::DoesNotFit,
                        format!("{} With {advice} it fits.", refused.message()),
                    ));
                }
            }
            Err(refused)
        }
        Err(refused) => Err(refused),
    }
}

/// The answer to a spec that does not validate: the first problem's field, every
/// problem in the message.
fn spec_problems(problems: &[tuneq_openapi::SpecError]) -> ApiError {
    let param = problems.first().map_or_else(String::new, |first| {
        first
            .field
            .replace("hyperparameters.epochs", "hyperparameters.n_epochs")
    });
    ApiError::invalid(
        &param,
        Code::InvalidValue,
        problems
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; "),
    )
}

pub(super) fn request_hash(body: &FineTuneCreate) -> String {
    let canonical = serde_json::to_string(body).unwrap_or_default();
    hex::encode(Sha256::digest(canonical.as_bytes()))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn auto_epochs_follow_openais_rule() {
        assert_eq!(auto_epochs(10), 10);
        assert_eq!(auto_epochs(1), 25);
        assert_eq!(auto_epochs(50), 3);
        assert_eq!(auto_epochs(1_000), 3);
        assert_eq!(auto_epochs(10_000), 2);
        assert_eq!(auto_epochs(100_000), 1);
    }
}
