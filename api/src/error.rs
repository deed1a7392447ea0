//! The API's errors: every one answers with a status and OpenAI's error body
//! (`{"error": {"message", "type", "param", "code"}}`), never a bare string, and never
//! a 409 (OpenAI's SDKs retry 409s).

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use tuneq_openapi::{ErrorBody, ErrorDetail, LineProblem};
use tuneq_queue::QueueError;

/// Declares [`Code`]: each error code once, with its HTTP status and what it means. The
/// doc comment of a code is its description, here and in the OpenAPI document.
macro_rules! codes {
    ($( $(#[doc = $doc:literal])+ $variant:ident = ($status:ident, $code:literal), )*) => {
        /// What went wrong, as the `code` of OpenAI's error body: stable, for programs to
        /// act on (the message is for people). Each code has one HTTP status.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Code {
            $( $(#[doc = $doc])+ $variant, )*
        }

        impl Code {
            /// Every code, in the order declared.
            pub const ALL: &'static [Code] = &[$(Code::$variant),*];

            /// The code as the error body carries it (`invalid_value`).
            pub fn as_str(self) -> &'static str {
                match self { $(Code::$variant => $code,)* }
            }

            /// The HTTP status every error with this code answers.
            pub fn status(self) -> StatusCode {
                match self { $(Code::$variant => StatusCode::$status,)* }
            }

            /// What the code means (its doc comment).
            pub fn description(self) -> &'static str {
                match self { $(Code::$variant => concat!($($doc),+),)* }
            }
        }
    };
}

codes! {
    /// A value is out of range or malformed; `param` names it.
    InvalidValue = (BAD_REQUEST, "invalid_value"),
    /// Two values given together contradict each other; `param` names one.
    ConflictingValues = (BAD_REQUEST, "conflicting_values"),
    /// The JSON body does not parse or does not have the expected shape.
    InvalidJson = (BAD_REQUEST, "invalid_json"),
    /// The query string does not parse.
    InvalidQuery = (BAD_REQUEST, "invalid_query"),
    /// A path segment does not parse.
    InvalidPath = (BAD_REQUEST, "invalid_path"),
    /// A pagination cursor (`after`) is not an item of this list.
    InvalidCursor = (BAD_REQUEST, "invalid_cursor"),
    /// The request has more than one `Authorization` header.
    DuplicateHeader = (BAD_REQUEST, "duplicate_header"),
    /// The multipart upload is malformed.
    InvalidMultipart = (BAD_REQUEST, "invalid_multipart"),
    /// A multipart form field appears more than once.
    DuplicateField = (BAD_REQUEST, "duplicate_field"),
    /// The multipart form has no `file` field.
    MissingFile = (BAD_REQUEST, "missing_file"),
    /// The upload broke off before its body was complete.
    UploadInterrupted = (BAD_REQUEST, "upload_interrupted"),
    /// The uploaded file is empty.
    EmptyFile = (BAD_REQUEST, "empty_file"),
    /// Lines of the dataset are invalid; `error.lines` lists each with its problem.
    InvalidJsonl = (BAD_REQUEST, "invalid_jsonl"),
    /// An unfinished fine-tuning job trains on the file, so it cannot be deleted.
    FileInUse = (BAD_REQUEST, "file_in_use"),
    /// The file named in a create request was never uploaded (or was deleted).
    FileNotFound = (BAD_REQUEST, "file_not_found"),
    /// No registered base model has this name.
    ModelNotFound = (BAD_REQUEST, "model_not_found"),
    /// Only the supervised fine-tuning method is offered.
    UnsupportedMethod = (BAD_REQUEST, "unsupported_method"),
    /// A job continues from the fine-tuned model, so it cannot be deleted yet.
    ModelInUse = (BAD_REQUEST, "model_in_use"),
    /// The files' records do not fit the method: preference pairs train with DPO,
    /// conversations and texts with the supervised method.
    MethodMismatch = (BAD_REQUEST, "method_mismatch"),
    /// The base model is of an architecture (or has a config field) tuneq does not train.
    UnsupportedModelArchitecture = (BAD_REQUEST, "unsupported_model_architecture"),
    /// Integrations (such as Weights & Biases) are not offered.
    UnsupportedIntegration = (BAD_REQUEST, "unsupported_integration"),
    /// The webhook URL is not one the server may deliver to (see the webhooks tag).
    InvalidWebhookUrl = (BAD_REQUEST, "invalid_webhook_url"),
    /// The Idempotency-Key was used before for a different request.
    IdempotencyKeyReused = (BAD_REQUEST, "idempotency_key_reused"),
    /// The conversation, with the tokens asked for (`max_tokens`), does not fit the
    /// model's context; `param` says which to shorten.
    ContextLengthExceeded = (BAD_REQUEST, "context_length_exceeded"),
    /// `max_seq_len` is longer than the model's context.
    ExceedsModelContext = (BAD_REQUEST, "exceeds_model_context"),
    /// The LoRA rank is wider than a projection it adapts.
    ExceedsProjectionWidth = (BAD_REQUEST, "exceeds_projection_width"),
    /// No example of the training file has a token to learn from.
    NoTrainableTokens = (BAD_REQUEST, "no_trainable_tokens"),
    /// No node pool offers the requested hardware.
    NoPoolFits = (BAD_REQUEST, "no_pool_fits"),
    /// The job would not fit the memory of any pool that offers its hardware.
    DoesNotFit = (BAD_REQUEST, "does_not_fit"),
    /// Every pool that could run the job would cost more than `max_cost`.
    OverBudget = (BAD_REQUEST, "over_budget"),
    /// The job has already finished, so there is nothing to cancel, pause or resume.
    JobAlreadyFinished = (BAD_REQUEST, "job_already_finished"),
    /// The job is being cancelled, so it cannot be paused or resumed.
    JobBeingCancelled = (BAD_REQUEST, "job_being_cancelled"),
    /// Only a paused job can be resumed (one still pausing included: resume it once
    /// its status is `paused`).
    JobNotPaused = (BAD_REQUEST, "job_not_paused"),
    /// The job has not succeeded, so it has no adapter yet.
    AdapterNotReady = (BAD_REQUEST, "adapter_not_ready"),
    /// This server's object store cannot presign URLs; use the tar download.
    PresignUnsupported = (BAD_REQUEST, "presign_unsupported"),
    /// API keys must be at least 16 characters.
    KeyTooShort = (BAD_REQUEST, "key_too_short"),
    /// The API key already belongs to another tenant.
    KeyInUse = (BAD_REQUEST, "key_in_use"),
    /// A tenant with this id exists, with other settings than asked.
    TenantExists = (CONFLICT, "tenant_exists"),
    /// A base model with this id is registered at another location.
    ModelExists = (CONFLICT, "model_exists"),
    /// A key chosen by a person that is too easy to guess.
    KeyTooWeak = (BAD_REQUEST, "key_too_weak"),
    /// The API key was revoked; a revoked key is never registered again.
    KeyRevoked = (BAD_REQUEST, "key_revoked"),
    /// No API key, or not one the server knows (or not the admin key on admin routes).
    InvalidApiKey = (UNAUTHORIZED, "invalid_api_key"),
    /// A known key that may not do this (the admin routes are disabled).
    Forbidden = (FORBIDDEN, "forbidden"),
    /// No such object for this tenant; another tenant's ids answer the same.
    NotFound = (NOT_FOUND, "not_found"),
    /// No route has this path.
    UnknownRoute = (NOT_FOUND, "unknown_route"),
    /// The route does not serve this method; the `Allow` header lists those it does.
    MethodNotAllowed = (METHOD_NOT_ALLOWED, "method_not_allowed"),
    /// The request body arrived too slowly.
    BodyTimeout = (REQUEST_TIMEOUT, "body_timeout"),
    /// The stored content of the object is gone from the object store.
    ObjectGone = (GONE, "object_gone"),
    /// Trainers only: the job no longer exists.
    JobGone = (GONE, "job_gone"),
    /// Trainers only: this attempt is no longer the job's live attempt; stop.
    AttemptSuperseded = (GONE, "attempt_superseded"),
    /// Trainers only: the job was cancelled or has ended; stop this attempt.
    AttemptStopped = (GONE, "attempt_stopped"),
    /// The upload is larger than the server's limit.
    FileTooLarge = (PAYLOAD_TOO_LARGE, "file_too_large"),
    /// The JSON body is larger than the server's limit.
    BodyTooLarge = (PAYLOAD_TOO_LARGE, "body_too_large"),
    /// The body is content-encoded (compressed), which the server does not accept.
    EncodedBodyUnsupported = (UNSUPPORTED_MEDIA_TYPE, "encoded_body_unsupported"),
    /// The tenant has as many jobs waiting as its limit allows; retry after `retry-after`.
    TooManyQueuedJobs = (TOO_MANY_REQUESTS, "too_many_queued_jobs"),
    /// Too many uploads at once (for the tenant or the server); retry after `retry-after`.
    TooManyUploads = (TOO_MANY_REQUESTS, "too_many_uploads"),
    /// Too many event streams open at once (for the tenant or the server); retry after
    /// `retry-after`, or close one.
    TooManyStreams = (TOO_MANY_REQUESTS, "too_many_streams"),
    /// Too many downloads in progress at once (for the tenant or the server); retry
    /// after `retry-after`.
    TooManyDownloads = (TOO_MANY_REQUESTS, "too_many_downloads"),
    /// The upload is larger than the tenant's limit.
    TenantUploadLimit = (TOO_MANY_REQUESTS, "tenant_upload_limit"),
    /// The upload would take the tenant past its file count or stored bytes.
    TenantStorageQuota = (TOO_MANY_REQUESTS, "tenant_storage_quota"),
    /// Every generation slot of the server is busy, or the tenant holds its share of them;
    /// retry after `retry-after`.
    TooManyGenerations = (TOO_MANY_REQUESTS, "too_many_generations"),
    /// Too many failed authentications from this address; wait before trying again.
    TooManyFailedAuthentications = (TOO_MANY_REQUESTS, "too_many_failed_authentications"),
    /// Our fault; the message says no more than is safe to show.
    InternalError = (INTERNAL_SERVER_ERROR, "internal_error"),
    /// The HTTP method is not one the server implements.
    MethodNotSupported = (NOT_IMPLEMENTED, "method_not_supported"),
    /// A backend (the job store, the object store) is unreachable; retry later.
    Unavailable = (SERVICE_UNAVAILABLE, "unavailable"),
    /// This server does not serve models (it runs without inference); chat requests
    /// go to the deployment that does.
    InferenceUnavailable = (SERVICE_UNAVAILABLE, "inference_unavailable"),
    /// The experiment tracking server the job asks for did not answer; try again later.
    IntegrationUnavailable = (SERVICE_UNAVAILABLE, "integration_unavailable"),
    /// The server's disk is full; nothing was stored (retry later).
    InsufficientStorage = (INSUFFICIENT_STORAGE, "insufficient_storage"),
}

impl Code {
    /// OpenAI's error `type` for the code's status.
    pub fn kind(self) -> &'static str {
        match self.status() {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::FORBIDDEN => "permission_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::INTERNAL_SERVER_ERROR
            | StatusCode::SERVICE_UNAVAILABLE
            | StatusCode::INSUFFICIENT_STORAGE => "server_error",
            // 501 included: an unknown method is the request's fault.
            _ => "invalid_request_error",
        }
    }
}

impl std::fmt::Display for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error answer.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// The body's `error` object (boxed: errors travel in every handler's `Result`).
    pub detail: Box<ErrorDetail>,
    /// Seconds to wait before trying again (sent as `retry-after`), for 429s.
    pub retry_after: Option<u64>,
    /// What went wrong, as the code `detail.code` spells.
    code: Code,
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.detail.message)
    }
}

impl ApiError {
    /// An error with `code` (which decides the status and `type`).
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            status: code.status(),
            detail: Box::new(ErrorDetail {
                message: message.into(),
                kind: code.kind().to_string(),
                param: None,
                code: Some(code.as_str().to_string()),
                lines: Vec::new(),
            }),
            retry_after: None,
            code,
        }
    }

    /// A limit of the tenant's is reached (429); try again after `retry_after` seconds.
    pub fn too_many(code: Code, message: impl Into<String>, retry_after: u64) -> Self {
        let mut e = Self::new(code, message);
        e.retry_after = Some(retry_after);
        e
    }

    /// The request is wrong (400); `param` names the field.
    pub fn invalid(param: &str, code: Code, message: impl Into<String>) -> Self {
        let mut e = Self::new(code, message);
        e.detail.param = Some(param.to_string());
        e
    }

    /// Its machine-readable code.
    pub fn code(&self) -> Code {
        self.code
    }

    /// Its message.
    pub fn message(&self) -> &str {
        &self.detail.message
    }

    /// The field the error is about, when it names one.
    pub fn param(&self) -> Option<&str> {
        self.detail.param.as_deref()
    }

    /// 400 for a dataset with bad lines, listing them.
    pub fn bad_lines(message: impl Into<String>, lines: Vec<LineProblem>) -> Self {
        let mut e = Self::invalid("file", Code::InvalidJsonl, message);
        e.detail.lines = lines;
        e
    }

    /// 401: no key, or not a key we know.
    pub fn unauthenticated(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidApiKey, message)
    }

    /// 403: a known key that may not do this.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(Code::Forbidden, message)
    }

    /// 404: no such object for this tenant (another tenant's ids answer the same).
    pub fn not_found(what: &str, id: &str) -> Self {
        let mut e = Self::new(
            Code::NotFound,
            format!("No such {what}: {}", crate::quote::shown(id)),
        );
        e.detail.param = Some("id".into());
        e
    }

    /// 413: the body is larger than allowed.
    pub fn too_large(limit: u64) -> Self {
        Self::new(
            Code::FileTooLarge,
            format!("The upload is larger than the limit of {limit} bytes."),
        )
    }

    /// 500: our fault; the message is safe to show (no secrets, no internals).
    ///
    /// `message` is for the operator: it goes to the log, with the request's span (and so
    /// its request id), and the client gets a fixed sentence. Internal messages can hold
    /// what a tenant must not see (server paths, record contents).
    pub fn internal(message: impl Into<String>) -> Self {
        let message = message.into();
        tracing::error!(detail = %message, "internal error");
        Self::new(
            Code::InternalError,
            "The server could not complete this request; the failure is logged under this request's id.",
        )
    }

    /// 507: the server has no room to keep what the request sends (a full disk); a
    /// retry later may find some.
    pub fn storage_full(what: &str) -> Self {
        tracing::error!(what, "no space left to store a request's data");
        Self::too_many(
            Code::InsufficientStorage,
            format!("The server has no room to store {what} right now; try again later."),
            60,
        )
    }

    /// 503: a backend is unreachable; retrying later may help.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(Code::Unavailable, message)
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse {
        let mut response = HttpResponse::build(self.status);
        if let Some(seconds) = self.retry_after {
            response.insert_header((actix_web::http::header::RETRY_AFTER, seconds.to_string()));
        }
        response.json(ErrorBody {
            error: (*self.detail).clone(),
        })
    }
}

impl From<QueueError> for ApiError {
    fn from(e: QueueError) -> Self {
        match e {
            QueueError::Invalid { field, message } => {
                Self::invalid(field, Code::InvalidValue, message)
            }
            QueueError::Unavailable(cause) => {
                tracing::warn!(
                    error = &cause as &dyn std::error::Error,
                    "queue unavailable"
                );
                Self::unavailable("The job store is unavailable; try again shortly.")
            }
            other => {
                tracing::error!(error = &other as &dyn std::error::Error, "queue error");
                Self::internal("The job store answered unexpectedly.")
            }
        }
    }
}

impl From<tuneq_storage::Error> for ApiError {
    fn from(e: tuneq_storage::Error) -> Self {
        if e.is_not_found() {
            // The record names an object the store no longer has (deleted behind our
            // back, or a crash between the two): gone, not a server fault. The key is
            // the operator's business, not the client's.
            tracing::warn!(error = %e, "a recorded object is missing from the store");
            return Self::new(
                Code::ObjectGone,
                "The stored content of this object is gone.",
            );
        }
        tracing::error!(error = %e, "object store error");
        if e.is_retryable() {
            Self::unavailable("The object store is unavailable; try again shortly.")
        } else {
            Self::internal("The object store refused the operation.")
        }
    }
}

/// Result alias for handlers.
pub type ApiResult<T> = Result<T, ApiError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_is_declared_once_and_described() {
        let mut seen = std::collections::HashSet::new();
        for code in Code::ALL {
            assert!(seen.insert(code.as_str()), "{code} is declared twice");
            assert!(
                code.as_str()
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c == '_'),
                "{code} is not snake_case"
            );
            assert!(!code.description().trim().is_empty(), "{code} has no doc");
        }
    }

    #[test]
    fn a_codes_status_and_type_are_what_its_body_carries() {
        let e = ApiError::invalid("limit", Code::InvalidValue, "no");
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.detail.kind, "invalid_request_error");
        assert_eq!(e.detail.code.as_deref(), Some("invalid_value"));
        assert_eq!(e.detail.param.as_deref(), Some("limit"));
        let limited = ApiError::too_many(Code::TooManyQueuedJobs, "wait", 30);
        assert_eq!(limited.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(limited.detail.kind, "rate_limit_error");
        assert_eq!(limited.retry_after, Some(30));
        assert_eq!(
            ApiError::unauthenticated("x").detail.kind,
            "authentication_error"
        );
        assert_eq!(ApiError::forbidden("x").detail.kind, "permission_error");
        assert_eq!(ApiError::unavailable("x").detail.kind, "server_error");
        // 501 stays a request error, as it was before codes were declared.
        assert_eq!(Code::MethodNotSupported.kind(), "invalid_request_error");
    }
}
