//! `POST /v1/chat/completions`: answers from a base model or one of the tenant's
//! fine-tuned models (or checkpoints), whole or streamed, as OpenAI's API gives them.
//!
//! The request is checked ([`request`]), its model found (a registered base model or
//! alias; a fine-tuned model of the tenant's — another tenant's is not found, as an
//! unknown one is), a generation slot taken (none free: 429 with `Retry-After`), and
//! the model staged, loaded and prompted off the async threads. Then the answer is
//! generated whole ([`answer`]) or streamed as server-sent chunks ([`stream`]).
//! Tokens read and written are counted per tenant for `/metrics`.

mod answer;
mod holdback;
mod request;
mod responses;
mod stream;

pub(crate) use responses::{__path_create_response, create_response};

use crate::auth::Tenant;
use crate::error::{ApiError, ApiResult, Code};
use crate::finetunes::tuned::tuned_model;
use crate::inference::Inference;
use crate::refusals::GenerationRefused;
use crate::state::AppState;
use actix_web::{HttpResponse, web};
use request::ChatPlan;
use std::sync::Arc;
use tuneq_openapi::{ChatChoice, ChatCompletion, ChatCompletionRequest, Usage};
use tuneq_serve::{GenerationRequest, ModelKey, ServeError, ServedModel};

/// `retry-after` of a request refused because every generation slot is busy.
const BUSY_RETRY_AFTER_S: u64 = 1;

/// A model that is ready to answer: loaded, with the request's prompt rendered and
/// checked against its context.
struct Prepared {
    model: Arc<ServedModel>,
    prompt: Vec<u32>,
    max_new_tokens: usize,
    /// What the answer must be (JSON, tool calls), enforced while generating.
    format: Option<tuneq_serve::AnswerFormat>,
    /// The start of the answer the request forces, where no grammar can (a model whose
    /// vocabulary the grammar engine does not read, asked for a call).
    prefill: String,
    /// Whether an answer's opening reasoning block is kept apart from its content (the
    /// model's template writes them, and nothing was prefilled).
    reasons: bool,
}

impl Prepared {
    /// What to generate for choice `index` of `plan`.
    fn request(&self, plan: &ChatPlan, index: u32) -> GenerationRequest {
        GenerationRequest {
            prompt: self.prompt.clone(),
            max_new_tokens: self.max_new_tokens,
            sampling: plan.sampling.clone(),
            seed: plan.seed.wrapping_add(u64::from(index)),
            stop: plan.stop.clone(),
            markers: plan.markers(),
            logprobs: plan.logprobs,
            format: self.format.clone(),
        }
    }
}

/// An answer's identity: its id, its time, the engine's build.
struct Stamp {
    id: String,
    created: u64,
    fingerprint: String,
}

impl Stamp {
    fn new() -> Self {
        Self {
            id: format!("chatcmpl-{}", random_id(24)),
            created: crate::records::now_seconds(),
            fingerprint: format!("tuneq-{}", env!("CARGO_PKG_VERSION")),
        }
    }
}

/// `len` random letters and digits.
pub(crate) fn random_id(len: usize) -> String {
    use rand::Rng;
    rand::rng()
        .sample_iter(rand::distr::Alphanumeric)
        .take(len)
        .map(char::from)
        .collect()
}

/// An answer from a base model or a fine-tuned one.
#[utoipa::path(post, path = "/v1/chat/completions", tag = "chat",
    operation_id = "create_chat_completion",
    request_body = ChatCompletionRequest,
    responses(
        (status = 200, description = "The answer; with `stream`, server-sent `chat.completion.chunk` objects ending with `data: [DONE]`",
            content(
                (ChatCompletion = "application/json"),
                (String = "text/event-stream"),
            )),
        GenerationRefused,
    ))]
pub(crate) async fn completions(
    state: web::Data<AppState>,
    tenant: Tenant,
    body: crate::body::JsonBody<ChatCompletionRequest>,
) -> ApiResult<HttpResponse> {
    let plan = request::plan(body.0)?;
    let Started {
        inference,
        slot,
        prepared,
        span,
    } = start(&state, &tenant, &plan, "chat_completion").await?;
    if plan.stream {
        let sink = {
            let plan = plan.clone();
            move |events| stream::ChunkWriter::new(events, &plan)
        };
        return Ok(stream::respond(
            inference, slot, prepared, plan, tenant.0, span, sink,
        ));
    }
    let (plan, stamp) = (Arc::new(plan), Stamp::new());
    let (choices, usage) = generate_whole(slot, prepared, plan.clone(), span).await?;
    inference.count(&tenant.0, usage);
    Ok(HttpResponse::Ok().json(ChatCompletion {
        id: stamp.id,
        object: "chat.completion".into(),
        created: stamp.created,
        model: plan.model.clone(),
        choices,
        usage,
        system_fingerprint: stamp.fingerprint,
    }))
}

/// A request ready to generate: its slot taken, its model loaded, its prompt checked.
struct Started {
    inference: Arc<Inference>,
    slot: tuneq_serve::Slot,
    prepared: Prepared,
    span: tracing::Span,
}

/// Finds `plan`'s model, takes a generation slot (none free: 429) and prepares the
/// model and prompt off the async threads.
async fn start(
    state: &AppState,
    tenant: &Tenant,
    plan: &ChatPlan,
    what: &'static str,
) -> ApiResult<Started> {
    let Some(inference) = state.inference.clone() else {
        return Err(ApiError::new(
            Code::InferenceUnavailable,
            "This server does not serve models; send chat requests to the tuneq serve deployment.",
        ));
    };
    let files = model_files(state, &tenant.0, &plan.model).await?;
    let slot = inference
        .engine()
        .try_slot(&tenant.0)
        .map_err(serve_error)?;
    let span = tracing::info_span!("generate", request = what, tenant = %tenant.0,
        model = %plan.model, stream = plan.stream, n = plan.n);
    let prepared = {
        let (inference, plan, span) = (inference.clone(), plan.clone(), span.clone());
        let work = move || span.in_scope(|| prepare(&inference, files, &plan));
        crate::blocking::run("model preparation", work).await??
    };
    Ok(Started {
        inference,
        slot,
        prepared,
        span,
    })
}

/// Every choice of `plan`, generated whole on a blocking thread that holds `slot`. When
/// the request is dropped before the answer is done (its client left), generation stops
/// at the next token and the slot is given back.
async fn generate_whole(
    slot: tuneq_serve::Slot,
    prepared: Prepared,
    plan: Arc<ChatPlan>,
    span: tracing::Span,
) -> ApiResult<(Vec<ChatChoice>, Usage)> {
    let left = ClientLeft::default();
    let watch = left.0.clone();
    crate::blocking::run("generation", move || {
        let _slot = slot;
        let still_waiting = || !watch.load(std::sync::atomic::Ordering::Relaxed);
        span.in_scope(|| generate_all(&prepared, &plan, &still_waiting))
    })
    .await?
}

/// Set when the request waiting for an answer is dropped — actix drops a request's
/// future when its client leaves — so that the generating thread stops.
#[derive(Debug, Default)]
struct ClientLeft(Arc<std::sync::atomic::AtomicBool>);

impl Drop for ClientLeft {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Every choice of `plan`, generated whole, and the tokens used; stops when
/// `still_waiting` says the caller left.
fn generate_all(
    prepared: &Prepared,
    plan: &ChatPlan,
    still_waiting: &dyn Fn() -> bool,
) -> ApiResult<(Vec<ChatChoice>, Usage)> {
    let mut choices = Vec::new();
    let mut completion = 0;
    for index in 0..plan.n {
        let generated = prepared
            .model
            .generate(&prepared.request(plan, index), &mut |_| still_waiting())
            .map_err(serve_error)?;
        completion += generated.tokens as u64;
        let reading = answer::read(plan, &prepared.prefill, &generated, prepared.reasons);
        choices.push(ChatChoice {
            index,
            message: reading.message(),
            logprobs: plan.logprobs.map(|_| answer::logprobs(&generated.logprobs)),
            finish_reason: reading.finish,
        });
    }
    Ok((choices, usage(prepared, completion)))
}

/// A request's usage: its prompt once, every choice's tokens.
fn usage(prepared: &Prepared, completion_tokens: u64) -> Usage {
    let prompt_tokens = prepared.prompt.len() as u64;
    Usage {
        prompt_tokens,
        completion_tokens,
        total_tokens: prompt_tokens + completion_tokens,
    }
}

/// The local folders of the model `name` stands for, staged from where they are kept.
async fn model_files(state: &AppState, tenant: &str, name: &str) -> ApiResult<Staged> {
    let not_found = |message: String| {
        let mut e = ApiError::new(Code::NotFound, message);
        e.detail.param = Some("model".into());
        e
    };
    let shown = crate::quote::shown(name);
    if !name.starts_with("ft:") {
        return match crate::records::model::resolve(&state.queue, &state.config.model_aliases, name)
            .await?
        {
            Some(base) => Ok(Staged {
                template: base.template(),
                base: base.location,
                adapter: None,
            }),
            None => Err(not_found(format!(
                "The model `{shown}` does not exist: GET /v1/models lists the models you can use."
            ))),
        };
    }
    let tuned = tuned_model(state, tenant, name).await?.map_err(|why| {
        not_found(why.explain(
            name,
            &format!(
                "The model `{shown}` does not exist: GET /v1/models lists the models you can use."
            ),
        ))
    })?;
    Ok(Staged {
        base: tuned.base.location,
        adapter: Some(state.store.uri(&tuned.adapter)),
        // What it was trained with, whatever its base is registered with now.
        template: tuned.job.template(),
    })
}

/// Where a model's files are kept: the base model's location, the adapter's URI; and
/// the chat template it answers with.
#[derive(Debug, Clone)]
struct Staged {
    base: String,
    adapter: Option<String>,
    template: tuneq_openapi::ChatTemplateChoice,
}

/// Stages and loads the model, renders the prompt and checks it (and `max_tokens`)
/// against the model's context.
fn prepare(inference: &Inference, files: Staged, plan: &ChatPlan) -> ApiResult<Prepared> {
    let key = ModelKey {
        base: inference.staging().base(&files.base).map_err(serve_error)?,
        adapter: files
            .adapter
            .map(|uri| inference.staging().adapter(&uri))
            .transpose()
            .map_err(serve_error)?,
        template: files.template,
    };
    let model = inference.engine().model(&key).map_err(serve_error)?;
    let syntax = model.call_syntax(&plan.conversation.tools);
    let (format, prefill) = match plan.answer_format(syntax) {
        None => (None, String::new()),
        Some(format) => match model.json_grammars() {
            Ok(grammars) => {
                // Refused now, before a slot's worth of generation: a schema the grammar
                // engine rejects.
                if let Err(e) = grammars.constrain(&format) {
                    return Err(format_refused(grammars, plan, e));
                }
                (Some(format), String::new())
            }
            Err(e) if plan.json.is_some() => {
                return Err(ApiError::invalid(
                    "response_format",
                    Code::InvalidValue,
                    e.to_string(),
                ));
            }
            // Calls without a grammar: the answer is made to open one.
            Err(_) => (None, plan.prefill(syntax)),
        },
    };
    let prompt = model
        .chat_prompt(
            &plan.conversation.messages,
            &plan.conversation.tools,
            &plan.template_variables,
            &prefill,
        )
        .map_err(|e| match e {
            ServeError::Text(tuneq_dataset::DataError::Template(message)) => ApiError::invalid(
                "messages",
                Code::InvalidValue,
                format!("The model's chat template refused the conversation: {message}"),
            ),
            other => serve_error(other),
        })?;
    let context = model.context_length();
    let room = context.saturating_sub(prompt.len());
    if room == 0 {
        return Err(ApiError::invalid(
            "messages",
            Code::ContextLengthExceeded,
            format!(
                "The conversation is {} tokens; the model's context holds {context}, and the answer needs room.",
                prompt.len()
            ),
        ));
    }
    let cap = inference.engine().config().max_answer_tokens;
    let max_new_tokens = match plan.max_new_tokens {
        Some(asked) if asked > room => {
            return Err(ApiError::invalid(
                "max_tokens",
                Code::ContextLengthExceeded,
                format!(
                    "The conversation is {} tokens and max_tokens asks for {asked}: together past the model's context of {context}.",
                    prompt.len()
                ),
            ));
        }
        Some(asked) if asked > cap => {
            return Err(ApiError::invalid(
                "max_tokens",
                Code::InvalidValue,
                format!("This server generates at most {cap} tokens per answer."),
            ));
        }
        Some(asked) => asked,
        None => room.min(cap),
    };
    Ok(Prepared {
        reasons: model.encoder().template().writes_reasoning() && prefill.is_empty(),
        model,
        prompt,
        max_new_tokens,
        format,
        prefill,
    })
}

/// A format the grammar engine refused (`error`), as the client sees it: naming the
/// schema at fault — the `response_format`'s, or a strict tool's parameters.
fn format_refused(
    grammars: &tuneq_serve::json_format::JsonGrammars,
    plan: &ChatPlan,
    error: ServeError,
) -> ApiError {
    use tuneq_serve::{AnswerFormat, CallableTool};
    let refuses = |format: AnswerFormat| grammars.constrain(&format).err();
    let (param, error) = match plan
        .json
        .clone()
        .and_then(|json| refuses(AnswerFormat::Json(json)))
    {
        Some(e) => ("response_format.json_schema.schema".to_string(), e),
        None => plan
            .conversation
            .tools
            .iter()
            .enumerate()
            .find_map(|(i, tool)| {
                let arguments = CallableTool::of_declared(tool)?.arguments;
                let e = refuses(AnswerFormat::Json(tuneq_serve::JsonFormat::Schema(
                    arguments,
                )))?;
                Some((format!("tools[{i}].function.parameters"), e))
            })
            .unwrap_or(("tools".to_string(), error)),
    };
    ApiError::invalid(
        &param,
        Code::InvalidValue,
        format!("The schema cannot be enforced: {error}"),
    )
}

/// An engine error as the client sees it (the details of the server's own failures
/// stay in its log).
fn serve_error(e: ServeError) -> ApiError {
    match e {
        ServeError::Busy(max) => ApiError::too_many(
            Code::TooManyGenerations,
            format!("All {max} generation slots are busy; retry shortly."),
            BUSY_RETRY_AFTER_S,
        ),
        ServeError::TenantBusy(max) => ApiError::too_many(
            Code::TooManyGenerations,
            format!(
                "This tenant already has {max} answers being generated, its share of the \
                 server's slots; retry when one ends."
            ),
            BUSY_RETRY_AFTER_S,
        ),
        ServeError::PromptTooLong { tokens, context } => ApiError::invalid(
            "messages",
            Code::ContextLengthExceeded,
            format!("The conversation is {tokens} tokens; the model's context holds {context}."),
        ),
        ServeError::Abandoned => {
            // No one reads this answer: not a failure of the server's.
            tracing::debug!("the client left before its answer was done");
            ApiError::new(
                Code::InternalError,
                "The client left before its answer was done.",
            )
        }
        other => {
            tracing::error!(error = %other, "generation failed");
            ApiError::internal("generation")
        }
    }
}
