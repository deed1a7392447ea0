//! The refusals many routes answer alike, for their OpenAPI entries: a route lists one
//! of these in its `responses(...)` instead of writing each status out again, so a
//! 401 or a 404 is described the same on every route that can answer it. (The refusals
//! of a route that takes an object the tenant owns come with its extractor,
//! [`crate::owned::Own`].)

use std::collections::BTreeMap;
use utoipa::IntoResponses;
use utoipa::openapi::{ContentBuilder, Ref, RefOr, ResponseBuilder, response::Response};

/// 401 on a tenant's route.
pub(crate) const NO_TENANT_KEY: (&str, &str) = ("401", "No or unknown API key");
/// 401 and 403 on an admin route.
const NOT_ADMIN: [(&str, &str); 2] = [
    ("401", "No key, or not the admin key"),
    ("403", "Admin routes disabled"),
];

/// Each `(status, description)` as an error response whose body is an `ErrorBody`.
pub(crate) fn error_responses(answers: &[(&str, &str)]) -> BTreeMap<String, RefOr<Response>> {
    answers
        .iter()
        .map(|(status, description)| {
            let content = ContentBuilder::new()
                .schema(Some(Ref::from_schema_name("ErrorBody")))
                .build();
            let response = ResponseBuilder::new()
                .description(*description)
                .content("application/json", content)
                .build();
            (status.to_string(), RefOr::T(response))
        })
        .collect()
}

/// Declares each refusal type with the answers it stands for.
macro_rules! refusals {
    ($($(#[$doc:meta])* $name:ident => [$($answer:expr),+ $(,)?];)+) => {$(
        $(#[$doc])*
        pub(crate) struct $name;

        impl IntoResponses for $name {
            fn responses() -> BTreeMap<String, RefOr<Response>> {
                error_responses(&[$(&$answer[..]),+].concat())
            }
        }
    )+};
}

refusals! {
    /// 401: a tenant's route without a known key.
    Unauthenticated => [[NO_TENANT_KEY]];
    /// 401, or 404 for a model the tenant cannot see.
    UnknownModel => [[NO_TENANT_KEY, ("404", "No such model for this tenant")]];
    /// [`UnknownModel`], or 403 for a base model or an alias: the operator's, which
    /// tenants do not delete.
    OperatorsModel => [[
        NO_TENANT_KEY,
        ("403", "A base model or an alias: the operator's"),
        ("404", "No such fine-tuned model for this tenant"),
    ]];
    /// 401 or 403: an admin route without the admin key, or with admin routes disabled.
    NotAdmin => [NOT_ADMIN];
    /// [`NotAdmin`], or 404 for a tenant that does not exist.
    UnknownTenant => [NOT_ADMIN, [("404", "No such tenant")]];
    /// [`NotAdmin`], or 404 for a key the tenant does not have.
    UnknownKey => [NOT_ADMIN, [("404", "No such key for this tenant")]];
    /// What a request for an answer (`/v1/chat/completions`, `/v1/responses`) may be
    /// refused with.
    GenerationRefused => [[
        ("400", "A field is invalid (`param` names it), or the prompt and the tokens asked for do not fit the model's context (`context_length_exceeded`)"),
        NO_TENANT_KEY,
        ("404", "No such model for this tenant"),
        ("429", "Every generation slot is busy, or the tenant holds its share (`too_many_generations`); retry after `retry-after`"),
        ("503", "This server does not serve models (`inference_unavailable`)"),
    ]];
}
