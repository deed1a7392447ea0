//! The OpenAPI document, generated from the handlers' annotations and the contract
//! types (`tuneq-openapi`). `openapi/openapi.json` is this document committed; a test
//! fails when they drift. Served at `GET /openapi.json`, and read by people at `/docs`
//! (a self-contained page: no CDN, works offline).

use crate::error::Code;
use actix_web::HttpResponse;
use utoipa::OpenApi;
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};

/// The API's description.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "tuneq",
        description = "Self-hostable LoRA fine-tuning with an OpenAI-compatible API. Every route \
under /v1/files and /v1/fine_tuning/jobs is also served under /files and /finetunes.",
        // OpenAPI 3.1 wants an SPDX `identifier` (or a `url`) beside the name; openapi-generator
        // refuses the document without one.
        license(name = "Apache-2.0", identifier = "Apache-2.0")
    ),
    components(schemas(tuneq_openapi::ErrorDetail, tuneq_openapi::LineProblem, tuneq_openapi::WebhookEvent)),
    modifiers(&Security, &ErrorCodes),
    security(("api_key" = [])),
    tags(
        (name = "files", description = "Datasets: upload (validated at once), list, download, delete"),
        (name = "fine-tuning", description = "Fine-tuning jobs, their events, checkpoints and adapter"),
        (name = "models", description = "Base models and fine-tuned adapters"),
        (name = "webhooks", description = "Signed events when a job finishes (Standard Webhooks)"),
        (name = "admin", description = "Tenants, API keys and base models (admin key)"),
        (name = "health", description = "Liveness and readiness"),
    )
)]
struct ApiDoc;

/// Declares the bearer schemes: tenants' API keys and the admin key.
struct Security;

impl utoipa::Modify for Security {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        for name in ["api_key", "admin_key"] {
            components.add_security_scheme(
                name,
                SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)),
            );
        }
    }
}

/// Documents every error code (see [`Code`]) as the `ErrorCode` schema: the codes,
/// each with its status and meaning, taken from the one declaration of the codes.
struct ErrorCodes;

impl utoipa::Modify for ErrorCodes {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::schema::{ObjectBuilder, Schema, Type};
        let mut description =
            String::from("The `code` of an error body, with the HTTP status it answers:\n");
        for code in Code::ALL {
            description.push_str(&format!(
                "\n- `{}` ({}): {}",
                code.as_str(),
                code.status().as_u16(),
                code.description().trim()
            ));
        }
        let schema = ObjectBuilder::new()
            .schema_type(Type::String)
            .enum_values(Some(Code::ALL.iter().map(|c| c.as_str())))
            .description(Some(description))
            .build();
        openapi
            .components
            .get_or_insert_with(Default::default)
            .schemas
            .insert("ErrorCode".into(), Schema::Object(schema).into());
    }
}

/// The whole document, native aliases included.
pub fn document() -> utoipa::openapi::OpenApi {
    let mut doc = ApiDoc::openapi();
    doc.merge(crate::routes::Documented::openapi());
    doc.info.version = env!("CARGO_PKG_VERSION").to_string();
    // Health routes need no key.
    for path in ["/healthz", "/readyz"] {
        if let Some(op) = doc
            .paths
            .paths
            .get_mut(path)
            .and_then(|item| item.get.as_mut())
        {
            op.security = Some(vec![
                utoipa::openapi::security::SecurityRequirement::default(),
            ]);
        }
    }
    let mut native = Vec::new();
    for (path, item) in &doc.paths.paths {
        for (openai, alias) in crate::routes::ALIASES {
            if let Some(rest) = path.strip_prefix(openai) {
                let mut item = item.clone();
                for op in [item.get.as_mut(), item.post.as_mut(), item.delete.as_mut()]
                    .into_iter()
                    .flatten()
                {
                    op.operation_id = op.operation_id.as_ref().map(|id| format!("{id}_native"));
                }
                native.push((format!("{alias}{rest}"), item));
            }
        }
    }
    doc.paths.paths.extend(native);
    doc
}

/// The document as the committed `openapi/openapi.json` holds it.
pub fn document_json() -> String {
    let mut text = document()
        .to_pretty_json()
        .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
    text.push('\n');
    text
}

/// The document's own routes (left out of it).
pub(crate) fn routes() -> Vec<crate::routes::Route> {
    use crate::routes::Route;
    use actix_web::{http::Method, web};
    vec![
        Route::hidden("/openapi.json", Method::GET, |r, m| {
            r.route(web::method(m).to(openapi_json))
        }),
        Route::hidden("/docs", Method::GET, |r, m| {
            r.route(web::method(m).to(docs_page))
        }),
    ]
}

/// `GET /openapi.json`: the document.
async fn openapi_json() -> HttpResponse {
    HttpResponse::Ok()
        .content_type("application/json")
        .body(served_json())
}

/// `GET /docs`: the document's human-readable page.
async fn docs_page() -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/html; charset=utf-8")
        .body(DOCS_PAGE)
}

/// The document as served, generated once per process (not once per server worker).
fn served_json() -> &'static str {
    static JSON: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    JSON.get_or_init(document_json)
}

/// `/docs`: renders `/openapi.json` in the browser with nothing fetched from elsewhere.
const DOCS_PAGE: &str = include_str!("docs.html");

#[cfg(test)]
mod tests {
    use tuneq_openapi::FailureClass;

    #[test]
    fn the_document_lists_exactly_the_failure_codes_a_job_can_show() {
        let document: serde_json::Value =
            serde_json::from_str(&super::document_json()).unwrap_or_default();
        let listed: Vec<&str> = document["components"]["schemas"]["FailureClass"]["enum"]
            .as_array()
            .map(|codes| codes.iter().filter_map(|c| c.as_str()).collect())
            .unwrap_or_default();
        let produced: Vec<&str> = FailureClass::ALL.iter().map(|c| c.code()).collect();
        assert_eq!(listed, produced);
        let error_code = &document["components"]["schemas"]["JobError"]["properties"]["code"];
        assert_eq!(
            error_code["$ref"], "#/components/schemas/FailureClass",
            "a failed job's error.code is a FailureClass: {error_code}"
        );
    }
}
