//! Every route, declared once. A handler's `#[utoipa::path]` attribute is its one
//! declaration: its path, method and OpenAPI entry. [`declare!`] below lists the
//! handlers; from that list come both the OpenAPI paths ([`Documented`]) and the
//! router ([`configure`]). The trainers' report route, which the document leaves out, is
//! declared beside them, in [`hidden`]; the document's own routes are declared with it
//! (`spec::routes`), which sits above this module and hands them to [`configure`].
//!
//! Routes under an OpenAI-compatible prefix are also served under the native one
//! ([`ALIASES`]: `/v1/files` and `/files`, …); each prefix is a scope, so the router
//! compares one static prefix before it tries the patterns with an `{id}` in them. A
//! method a route does not serve answers 405 with an `Allow` header and the error body.

use crate::error::{ApiError, Code};
use crate::{admin, chat, files, finetunes, health, internal, metrics, models, registry, webhooks};
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
pub(crate) type AddHandler = fn(Resource, Method) -> Resource;

/// One route: where, which method, and its handler.
pub(crate) struct Route {
    path: String,
    method: Method,
    add: AddHandler,
}

impl Route {
    /// A route the OpenAPI document leaves out.
    pub(crate) fn hidden(path: &str, method: Method, add: AddHandler) -> Self {
        Route {
            path: path.into(),
            method,
            add,
        }
    }

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
    finetunes::pause, finetunes::resume,
    finetunes::events, finetunes::checkpoints, finetunes::adapter, finetunes::adapter_urls,
    models::list, models::retrieve, models::delete, chat::completions, chat::create_response,
    webhooks::secret, webhooks::rotate_secret,
    admin::create_tenant, admin::create_key, admin::list_keys, admin::revoke_key,
    registry::register, registry::delete,
    admin::set_limits,
    health::healthz, health::readyz, metrics::metrics,
}

/// Where trainers report: not a client's business, so not in the document.
fn hidden() -> Vec<Route> {
    vec![Route::hidden(
        "/internal/attempts/{job}/report",
        Method::POST,
        |r, m| r.route(web::method(m).to(internal::report)),
    )]
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

/// Every route (and `more`), grouped by path in declaration order.
fn by_path(more: Vec<Route>) -> Vec<PathRoutes> {
    let mut paths: Vec<PathRoutes> = Vec::new();
    for route in documented().into_iter().chain(hidden()).chain(more) {
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

/// Registers every route, and `more` (both prefixes of the aliased ones).
pub(crate) fn configure(cfg: &mut web::ServiceConfig, more: Vec<Route>) {
    let paths = by_path(more);
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
