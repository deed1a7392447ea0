//! JSON request bodies: [`JsonBody`], the extractor the handlers take, and
//! [`read_json`], for handlers that must check something (a credential) before they
//! read a byte of the body. Both refuse a body that does not fit its type naming the
//! field (`lora.r`, `dtype`, `method.supervised.hyperparameters.n_epochs`) in the
//! error's `param`, as OpenAI's API does, not just "body".

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
    let value: serde_json::Value = serde_json::from_slice(&body).map_err(|e| {
        ApiError::invalid(
            "body",
            Code::InvalidJson,
            format!("The JSON body is invalid: {e}"),
        )
    })?;
    parse(value)
}

/// A JSON body of type `T`: read within the app's [`web::JsonConfig`] (limit, content
/// type, pacing, and its error bodies), then converted to `T` by [`parse`], so that a
/// value of the wrong type names its field.
#[derive(Debug)]
pub struct JsonBody<T>(pub T);

impl<T> std::ops::Deref for JsonBody<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T: DeserializeOwned + 'static> actix_web::FromRequest for JsonBody<T> {
    type Error = actix_web::Error;
    type Future = futures::future::LocalBoxFuture<'static, Result<Self, Self::Error>>;

    fn from_request(
        req: &actix_web::HttpRequest,
        payload: &mut actix_web::dev::Payload,
    ) -> Self::Future {
        let value = web::Json::<serde_json::Value>::from_request(req, payload);
        Box::pin(async move {
            let web::Json(value) = value.await?;
            Ok(JsonBody(parse(value)?))
        })
    }
}

/// `value` as a `T`, or a 400 `invalid_json` whose `param` is the path of the field that
/// did not fit (`lora.r`, `hyperparameters.n_epochs`, `training_files[1]`): the field
/// itself for an unknown or a missing one, and "body" only when the body as a whole is
/// of the wrong kind (a string where an object is expected).
pub(crate) fn parse<T: DeserializeOwned>(value: serde_json::Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let message = e.inner().to_string();
        let param = field_path(&e.path().to_string(), &message);
        ApiError::invalid(
            &param,
            Code::InvalidJson,
            format!("The JSON body is invalid: {message}"),
        )
    })
}

/// The field an error is about: serde names an unknown or a missing field only in its
/// message (`` unknown field `rank`, expected one of … ``), where the path stops at the
/// object that holds it.
fn field_path(path: &str, message: &str) -> String {
    let named = ["unknown field `", "missing field `"]
        .iter()
        .find_map(|prefix| message.strip_prefix(prefix))
        .and_then(|rest| rest.split('`').next())
        .filter(|name| !name.is_empty());
    let path = if path == "." { "" } else { path };
    match (path, named) {
        ("", None) => "body".into(),
        ("", Some(name)) => name.into(),
        (path, Some(name)) if !path.ends_with(name) => format!("{path}.{name}"),
        (path, _) => path.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Lora {
        r: u32,
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Create {
        model: String,
        #[serde(default)]
        lora: Option<Lora>,
        #[serde(default)]
        files: Vec<String>,
    }

    fn param(value: serde_json::Value) -> String {
        let e = parse::<Create>(value).expect_err("refused");
        e.param().expect("param").to_string()
    }

    #[test]
    fn a_body_that_does_not_fit_its_type_names_the_field() {
        use serde_json::json;
        assert_eq!(param(json!({"model": 7})), "model");
        assert_eq!(param(json!({})), "model");
        assert_eq!(
            param(json!({"model": "m", "lora": {"r": "eight"}})),
            "lora.r"
        );
        assert_eq!(
            param(json!({"model": "m", "lora": {"rank": 8}})),
            "lora.rank"
        );
        assert_eq!(param(json!({"model": "m", "lora": {}})), "lora.r");
        assert_eq!(param(json!({"model": "m", "files": ["a", 2]})), "files[1]");
        assert_eq!(param(json!({"model": "m", "epochs": 3})), "epochs");
        assert_eq!(param(json!("model")), "body");
        let ok = parse::<Create>(json!({"model": "m", "lora": {"r": 8}})).expect("parsed");
        assert_eq!(ok.model, "m");
    }
}
