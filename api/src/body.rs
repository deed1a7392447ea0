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
    let UniqueKeys(value) = serde_json::from_slice(&body).map_err(|e| {
        ApiError::invalid(
            "body",
            Code::InvalidJson,
            format!("The JSON body is invalid: {e}"),
        )
    })?;
    parse(value)
}

/// A JSON value in which no object names a key twice. JSON leaves duplicates undefined,
/// and parsers disagree on them (the last wins in serde_json, the first in others): a
/// body whose meaning depends on the reader is refused instead, naming the key.
#[derive(Debug)]
pub(crate) struct UniqueKeys(pub serde_json::Value);

impl<'de> serde::Deserialize<'de> for UniqueKeys {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer
            .deserialize_any(UniqueKeysVisitor)
            .map(UniqueKeys)
    }
}

struct UniqueKeysVisitor;

impl<'de> serde::de::Visitor<'de> for UniqueKeysVisitor {
    type Value = serde_json::Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(serde_json::Value::Null, Into::into))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }

    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
        while let Some(UniqueKeys(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(serde_json::Value::Array(items))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut object = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.contains_key(&key) {
                let shown: String = key.chars().take(64).collect();
                return Err(serde::de::Error::custom(format_args!(
                    "the key `{shown}` appears twice in one object"
                )));
            }
            let UniqueKeys(value) = map.next_value()?;
            object.insert(key, value);
        }
        Ok(serde_json::Value::Object(object))
    }
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
        let value = web::Json::<UniqueKeys>::from_request(req, payload);
        Box::pin(async move {
            let web::Json(UniqueKeys(value)) = value.await?;
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
#[allow(clippy::unwrap_used)]
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
    fn a_key_named_twice_in_one_object_is_refused() {
        let twice: Result<UniqueKeys, _> =
            serde_json::from_str(r#"{"model": "a", "lora": {"r": 8}, "model": "b"}"#);
        let message = twice.unwrap_err().to_string();
        assert!(message.contains("`model` appears twice"), "{message}");
        let nested: Result<UniqueKeys, _> = serde_json::from_str(r#"{"lora": {"r": 8, "r": 16}}"#);
        assert!(
            nested
                .unwrap_err()
                .to_string()
                .contains("`r` appears twice")
        );
        // The same key in different objects is fine, and values come through unchanged.
        let text =
            r#"{"a": {"r": 1}, "b": [{"r": 2.5}, null, true, "x", -3, 18446744073709551615]}"#;
        let UniqueKeys(value) = serde_json::from_str(text).unwrap();
        assert_eq!(
            value,
            serde_json::from_str::<serde_json::Value>(text).unwrap()
        );
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
