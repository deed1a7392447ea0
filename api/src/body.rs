//! Reading a JSON body by hand, for handlers that must check something (a credential)
//! before they read a byte of it: within a limit, then parsed.

use crate::error::{ApiError, Code};
use actix_web::http::header::{self, HeaderMap};
use actix_web::web;
use futures::StreamExt;
use serde::de::DeserializeOwned;

/// The answer to a JSON body past `limit` bytes: 413 `body_too_large`, on every route
/// (the extractor's own overflow errors are mapped to it as well).
pub(crate) fn too_large(limit: usize) -> ApiError {
    ApiError::new(
        Code::BodyTooLarge,
        format!("The JSON body is larger than the limit of {limit} bytes."),
    )
}

/// Reads at most `limit` bytes of `payload` and parses them as `T`. A declared
/// `Content-Length` over the limit is refused before reading; so is a body that grows
/// past it, as soon as it does.
pub async fn read_json<T: DeserializeOwned>(
    mut payload: web::Payload,
    headers: &HeaderMap,
    limit: usize,
) -> Result<T, ApiError> {
    let too_large = || too_large(limit);
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(too_large());
    }
    let mut body = web::BytesMut::with_capacity(declared.unwrap_or(0).min(limit));
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| {
            if crate::guard::is_body_timeout(&e) {
                crate::guard::body_timeout()
            } else {
                ApiError::invalid(
                    "body",
                    Code::InvalidJson,
                    format!("The body broke off: {e}"),
                )
            }
        })?;
        if body.len() + chunk.len() > limit {
            return Err(too_large());
        }
        body.extend_from_slice(&chunk);
    }
    serde_json::from_slice(&body).map_err(|e| {
        ApiError::invalid(
            "body",
            Code::InvalidJson,
            format!("The JSON body is invalid: {e}"),
        )
    })
}
