//! Every route, declared once. A handler's `#[utoipa::path]` attribute is its one
//! declaration: its path, method and OpenAPI entry. [`declare!`] below lists the
//! handlers; from that list come both the OpenAPI paths ([`Documented`]) and the
//! router ([`configure`]). The few routes the document leaves out (the trainers' report
//! route, the document itself and its page) are declared beside them, in [`hidden`].
//!
//! Routes under an OpenAI-compatible prefix are also served under the native one
//! ([`ALIASES`]: `/v1/files` and `/files`, …); each prefix is a scope, so the router
//! compares one static prefix before it tries the patterns with an `{id}` in them. A
//! method a route does not serve answers 405 with an `Allow` header and the error body.

use crate::error::{ApiError, Code};
use crate::{admin, files, finetunes, health, internal, metrics, models, spec, webhooks};
use actix_web::http::Method;
use actix_web::{Resource, web};
use utoipa::openapi::path::HttpMethod;

/// The native prefixes each OpenAI-compatible prefix is also served under.
pub(crate) const ALIASES: [(&str, &str); 3] = [
    ("/v1/files", "/files"),
    ("/v1/fine_tuning/jobs", "/finetunes"),
    ("/v1/models", "/models"),
];

/// Adds a route's handler for `method` to a resource.
type AddHandler = fn(Resource, Method) -> Resource;

/// One route: where, which method, and its handler.
struct Route {
    path: String,
    method: Method,
    add: AddHandler,
}

impl Route {
    /// The route a `#[utoipa::path]` declares, served by `add`.
    fn documented<P: utoipa::Path>(add: AddHandler) -> Vec<Self> {
        P::methods()
            .into_iter()
            .map(|method| Route {
                path: P::path(),
                method: actix_method(&method),
                add,
            })
            .collect()
    }
}

fn actix_method(method: &HttpMethod) -> Method {
    match method {
        HttpMethod::Get => Method::GET,
        HttpMethod::Post => Method::POST,
        HttpMethod::Put => Method::PUT,
        HttpMethod::Delete => Method::DELETE,
        HttpMethod::Options => Method::OPTIONS,
        HttpMethod::Head => Method::HEAD,
        HttpMethod::Patch => Method::PATCH,
        HttpMethod::Trace => Method::TRACE,
    }
}

/// Declares the documented routes: `module::handler`, each handler carrying its
/// `#[utoipa::path]`. Makes [`Documented`] (their OpenAPI entries) and `documented()`
/// (the routes to serve) from the one list.
macro_rules! declare {
    ($($module:ident :: $handler:ident),* $(,)?) => {
        pastey::paste! {
            /// The OpenAPI entries of the documented routes (the rest of the document is
            /// in [`crate::spec`]).
            #[derive(utoipa::OpenApi)]
            #[openapi(paths($($module::$handler),*))]
            pub(crate) struct Documented;

            /// The documented routes, in the order declared.
            fn documented() -> Vec<Route> {
                let mut routes = Vec::new();
                $(
                    routes.extend(Route::documented::<$module::[<__path_ $handler>]>(
                        |resource, method| resource.route(web::method(method).to($module::$handler)),
                    ));
                )*
                routes
            }
        }
    };
}

declare! {
    files::upload, files::list, files::retrieve, files::content, files::delete,
    finetunes::create, finetunes::list, finetunes::retrieve, finetunes::cancel,
    finetunes::events, finetunes::checkpoints, finetunes::adapter, finetunes::adapter_urls,
    models::list, webhooks::secret, webhooks::rotate_secret,
    admin::create_tenant, admin::create_key, admin::list_keys, admin::revoke_key,
    admin::set_limits,
    health::healthz, health::readyz, metrics::metrics,
}

/// Routes the OpenAPI document leaves out: where trainers report (not a client's
/// business), and the document and its page.
fn hidden() -> Vec<Route> {
    vec![
        Route {
            path: "/internal/attempts/{job}/report".into(),
            method: Method::POST,
            add: |r, m| r.route(web::method(m).to(internal::report)),
        },
        Route {
            path: "/openapi.json".into(),
            method: Method::GET,
            add: |r, m| r.route(web::method(m).to(spec::openapi_json)),
        },
        Route {
            path: "/docs".into(),
            method: Method::GET,
            add: |r, m| r.route(web::method(m).to(spec::docs_page)),
        },
    ]
}

/// The route pattern a request was routed to (`/v1/fine_tuning/jobs/{id}`): what its
/// metrics are labelled with. Set as the resource's data, so reading it costs no second
/// walk through the routes (`HttpRequest::match_pattern` re-matches every pattern).
#[derive(Debug, Clone)]
pub(crate) struct RoutePattern(pub std::sync::Arc<str>);

/// A path's routes, grouped: the methods it serves, in declaration order.
struct PathRoutes {
    path: String,
    routes: Vec<(Method, AddHandler)>,
}

/// Every route, grouped by path in declaration order.
fn by_path() -> Vec<PathRoutes> {
    let mut paths: Vec<PathRoutes> = Vec::new();
    for route in documented().into_iter().chain(hidden()) {
        match paths.iter_mut().find(|p| p.path == route.path) {
            Some(p) => p.routes.push((route.method, route.add)),
            None => paths.push(PathRoutes {
                path: route.path,
                routes: vec![(route.method, route.add)],
            }),
        }
    }
    paths
}

/// Registers every route (both prefixes of the aliased ones).
pub(crate) fn configure(cfg: &mut web::ServiceConfig) {
    let paths = by_path();
    for (openai, native) in ALIASES {
        for prefix in [openai, native] {
            let mut scope = web::scope(prefix);
            for p in paths.iter().filter(|p| in_scope(&p.path, openai)) {
                let rest = &p.path[openai.len()..];
                scope = scope.service(resource(prefix, rest, &p.routes));
            }
            cfg.service(scope);
        }
    }
    for p in paths
        .iter()
        .filter(|p| !ALIASES.iter().any(|(openai, _)| in_scope(&p.path, openai)))
    {
        cfg.service(resource("", &p.path, &p.routes));
    }
}

/// Whether `path` is `prefix` or below it.
fn in_scope(path: &str, prefix: &str) -> bool {
    path.strip_prefix(prefix)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// The resource at `path` inside the scope at `prefix`, serving `routes`; any other
/// method answers 405 with an `Allow` header (GET first) and the error body.
fn resource(prefix: &str, path: &str, routes: &[(Method, AddHandler)]) -> Resource {
    let mut methods: Vec<&Method> = routes.iter().map(|(m, _)| m).collect();
    methods.sort_by_key(|m| {
        [Method::GET, Method::POST, Method::PUT, Method::DELETE]
            .iter()
            .position(|known| known == *m)
            .unwrap_or(usize::MAX)
    });
    let allow: String = methods
        .iter()
        .map(|m| m.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    let mut resource = web::resource(path)
        .app_data(RoutePattern(format!("{prefix}{path}").into()))
        .default_service(web::to(move || {
            let allow = allow.clone();
            async move {
                let error = ApiError::new(
                    Code::MethodNotAllowed,
                    format!("This route serves {allow} only."),
                );
                let mut response = actix_web::ResponseError::error_response(&error);
                if let Ok(value) = actix_web::http::header::HeaderValue::from_str(&allow) {
                    response
                        .headers_mut()
                        .insert(actix_web::http::header::ALLOW, value);
                }
                response
            }
        }));
    for (method, add) in routes {
        resource = add(resource, method.clone());
    }
    resource
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use actix_web::{App, test};

    /// Every operation of the document (both prefixes), and every hidden route, reaches
    /// a handler: none answers `unknown_route` or 405.
    #[actix_web::test]
    async fn the_router_serves_what_the_document_declares() {
        let app = test::init_service(App::new().configure(configure)).await;
        let doc = crate::spec::document();
        let mut operations = Vec::new();
        for (path, item) in &doc.paths.paths {
            for (method, op) in [
                (Method::GET, &item.get),
                (Method::POST, &item.post),
                (Method::PUT, &item.put),
                (Method::DELETE, &item.delete),
            ] {
                if op.is_some() {
                    operations.push((method, path.clone()));
                }
            }
        }
        assert_eq!(
            operations.len(),
            38,
            "24 operations, 14 of them under two prefixes: {}",
            operations.len()
        );
        for route in hidden() {
            operations.push((route.method, route.path));
        }
        for (method, path) in operations {
            let uri = path
                .replace("{id}", "x")
                .replace("{key_id}", "y")
                .replace("{job}", "z");
            let response = test::call_service(
                &app,
                test::TestRequest::default()
                    .method(method.clone())
                    .uri(&uri)
                    .to_request(),
            )
            .await;
            let status = response.status();
            let body: serde_json::Value =
                serde_json::from_slice(&test::read_body(response).await).unwrap_or_default();
            assert_ne!(status, 405, "{method} {uri} is not routed to its handler");
            assert_ne!(
                body["error"]["code"], "unknown_route",
                "{method} {uri} is not routed"
            );
        }
        // A method the route does not serve: 405 naming those it does, GET first.
        let response = test::call_service(
            &app,
            test::TestRequest::patch().uri("/files/x").to_request(),
        )
        .await;
        assert_eq!(response.status(), 405);
        assert_eq!(response.headers().get("allow").unwrap(), "GET, DELETE");
    }
}
