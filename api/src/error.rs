//! The API's errors: every one answers with a status and OpenAI's error body
//! (`{"error": {"message", "type", "param", "code"}}`), never a bare string, and never
//! a 409 (OpenAI's SDKs retry 409s).

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use tuneq_openapi::{ErrorBody, ErrorDetail, LineProblem};
use tuneq_queue::QueueError;

/// An error answer.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// The body's `error` object (boxed: errors travel in every handler's `Result`).
    pub detail: Box<ErrorDetail>,
    /// Seconds to wait before trying again (sent as `retry-after`), for 429s.
    pub retry_after: Option<u64>,
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.detail.message)
    }
}

impl ApiError {
    /// An error with the given status, `type` and `code`.
    pub fn new(status: StatusCode, kind: &str, code: &str, message: impl Into<String>) -> Self {
        Self {
            status,
            detail: Box::new(ErrorDetail {
                message: message.into(),
                kind: kind.to_string(),
                param: None,
                code: Some(code.to_string()),
                lines: Vec::new(),
            }),
            retry_after: None,
        }
    }

    /// 429: a limit of the tenant's is reached; try again after `retry_after` seconds.
    pub fn too_many(code: &str, message: impl Into<String>, retry_after: u64) -> Self {
        let mut e = Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            code,
            message,
        );
        e.retry_after = Some(retry_after);
        e
    }

    /// 400: the request is wrong; `param` names the field.
    pub fn invalid(param: &str, code: &str, message: impl Into<String>) -> Self {
        let mut e = Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            code,
            message,
        );
        e.detail.param = Some(param.to_string());
        e
    }

    /// 400 for a dataset with bad lines, listing them.
    pub fn bad_lines(message: impl Into<String>, lines: Vec<LineProblem>) -> Self {
        let mut e = Self::invalid("file", "invalid_jsonl", message);
        e.detail.lines = lines;
        e
    }

    /// 401: no key, or not a key we know.
    pub fn unauthenticated(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid_api_key",
            message,
        )
    }

    /// 403: a known key that may not do this.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::FORBIDDEN,
            "permission_error",
            "forbidden",
            message,
        )
    }

    /// 404: no such object for this tenant (another tenant's ids answer the same).
    pub fn not_found(what: &str, id: &str) -> Self {
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "not_found",
            format!("No such {what}: {id}"),
        );
        e.detail.param = Some("id".into());
        e
    }

    /// 413: the body is larger than allowed.
    pub fn too_large(limit: u64) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "file_too_large",
            format!("The upload is larger than the limit of {limit} bytes."),
        )
    }

    /// 500: our fault; the message is safe to show (no secrets, no internals).
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "internal_error",
            message,
        )
    }

    /// 503: a backend is unreachable; retrying later may help.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "unavailable",
            message,
        )
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
                Self::invalid(field, "invalid_value", message)
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
                StatusCode::GONE,
                "invalid_request_error",
                "object_gone",
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
