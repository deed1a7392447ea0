//! The HTTP surface: routes a request to the store, answers with the bodies and status
//! codes the real API server uses, and logs every request.

use crate::log::RequestRecord;
use crate::selector::{FieldSelector, LabelSelector};
use crate::store::{
    ApiError, DeleteOptions, Key, Kind, Propagation, State, meta_mut, meta_str, random_suffix,
};
use crate::watch::{self, WatchRequest};
use crate::{FakeCluster, ResponseBody, kubelet};
use bytes::Bytes;
use http::{HeaderValue, Method, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};
use std::time::Duration;

/// What a handler answers.
enum Reply {
    Json {
        status: u16,
        body: Value,
        warning: Option<&'static str>,
    },
    Stream(ResponseBody),
}

fn ok(status: u16, body: Value) -> Result<Reply, ApiError> {
    Ok(Reply::Json {
        status,
        body,
        warning: None,
    })
}

/// Where a request points.
struct Target {
    kind: Kind,
    /// `None`: all namespaces (or a cluster-scoped kind).
    namespace: Option<String>,
    name: Option<String>,
    subresource: Option<String>,
}

fn route(path: &str) -> Option<Target> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (gv, rest) = match segs.as_slice() {
        ["api", "v1", rest @ ..] => ("v1", rest),
        ["apis", "batch", "v1", rest @ ..] => ("batch/v1", rest),
        _ => return None,
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some(ns.to_string()), rest),
        _ => (None, rest),
    };
    let (plural, tail) = rest.split_first()?;
    let kind = Kind::from_path(gv, plural)?;
    if namespace.is_some() && !kind.namespaced() {
        return None;
    }
    let (name, subresource) = match tail {
        [] => (None, None),
        [name] => (Some(name.to_string()), None),
        [name, sub] => (Some(name.to_string()), Some(sub.to_string())),
        _ => return None,
    };
    Some(Target {
        kind,
        namespace,
        name,
        subresource,
    })
}

/// Decodes a query string (`+` is a space, as form encoding writes it).
pub(crate) fn parse_query(query: &str) -> Vec<(String, String)> {
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(&s.replace('+', " "))
            .decode_utf8_lossy()
            .into_owned()
    };
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (decode(k), decode(v)),
            None => (decode(p), String::new()),
        })
        .collect()
}

/// Serves one request.
pub(crate) async fn handle(
    cluster: &FakeCluster,
    parts: http::request::Parts,
    body: Bytes,
) -> Response<ResponseBody> {
    let method = parts.method.clone();
    let path = parts.uri.path().to_string();
    let query = parse_query(parts.uri.query().unwrap_or_default());
    let content_type = parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let json_body: Option<Value> = serde_json::from_slice(&body).ok();
    let mut record = RequestRecord {
        method: method.to_string(),
        path: path.clone(),
        query,
        content_type,
        body: json_body,
        status: 0,
    };
    let reply = dispatch(cluster, &method, &record, &body);
    let response = match reply {
        Ok(Reply::Json {
            status,
            body,
            warning,
        }) => {
            record.status = status;
            json_response(status, &body, warning)
        }
        Ok(Reply::Stream(body)) => {
            record.status = 200;
            let mut r = Response::new(body);
            r.headers_mut().insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            r
        }
        Err(e) => {
            record.status = e.code;
            json_response(e.code, &e.status(), None)
        }
    };
    cluster.with_state(|s| s.log.push(record));
    response
}

fn json_response(status: u16, body: &Value, warning: Option<&str>) -> Response<ResponseBody> {
    let bytes = Bytes::from(serde_json::to_vec(body).unwrap_or_default());
    let mut r = Response::new(Full::new(bytes).boxed_unsync());
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(w) = warning
        .map(|w| format!("299 - \"{w}\""))
        .and_then(|w| HeaderValue::from_str(&w).ok())
    {
        r.headers_mut().insert(http::header::WARNING, w);
    }
    r
}

/// Answers one request: the version, or the object route's method on its target.
fn dispatch(
    cluster: &FakeCluster,
    method: &Method,
    req: &RequestRecord,
    raw: &Bytes,
) -> Result<Reply, ApiError> {
    if req.path == "/version" {
        return ok(
            200,
            json!({"major": "1", "minor": "33", "gitVersion": "v1.33.0-tuneq-kube-fake",
                   "platform": "linux/amd64"}),
        );
    }
    let target = route(&req.path).ok_or_else(|| ApiError {
        code: 404,
        reason: "NotFound",
        message: "the server could not find the requested resource".into(),
        details: None,
    })?;
    let dry_run = req.query_param("dryRun") == Some("All");
    match (method, &target.name, target.subresource.as_deref()) {
        (&Method::GET, None, None) => {
            if req.is_watch() {
                start_watch(cluster, &target, req)
            } else {
                cluster.with_state(|s| list(s, &target, req))
            }
        }
        (&Method::GET, Some(name), None | Some("status")) => {
            cluster.with_state(|s| get_one(s, &target, name))
        }
        (&Method::POST, None, None) => {
            let body = req
                .body
                .clone()
                .ok_or_else(|| ApiError::bad_request("the body is not a JSON object"))?;
            cluster.with_state(|s| create(s, &target, body, dry_run).and_then(|o| ok(201, o)))
        }
        (&Method::POST, Some(name), Some("eviction")) if target.kind == Kind::Pod => {
            cluster.with_state(|s| evict(s, &target, name))
        }
        (&Method::PATCH, Some(name), sub @ (None | Some("status"))) => {
            let status = sub.is_some();
            cluster.with_state(|s| patch(s, &target, name, req, raw, status, dry_run))
        }
        (&Method::PUT, Some(name), _) => Err(ApiError {
            code: 405,
            reason: "MethodNotAllowed",
            message: format!(
                "tuneq-kube-fake does not serve PUT (replace) of {} \"{name}\": tuneq never replaces objects",
                target.kind.qualified()
            ),
            details: Some((name.clone(), target.kind)),
        }),
        (&Method::DELETE, Some(name), None) => {
            let opts = delete_options(req)?;
            cluster.with_state(|s| delete_one(s, &target, name, req, &opts))
        }
        (&Method::DELETE, None, None) => {
            let opts = delete_options(req)?;
            cluster.with_state(|s| delete_collection(s, &target, req, &opts))
        }
        _ => Err(ApiError {
            code: 405,
            reason: "MethodNotAllowed",
            message: format!("{method} is not supported on {}", req.path),
            details: None,
        }),
    }
}

/// `GET` of one object (or its `status`, the whole object as the real server answers).
fn get_one(s: &mut State, target: &Target, name: &str) -> Result<Reply, ApiError> {
    let key = key(target, name);
    s.objects
        .get(&key)
        .cloned()
        .ok_or_else(|| ApiError::not_found(target.kind, name))
        .and_then(|o| ok(200, o))
}

/// `POST …/pods/NAME/eviction`: the pod gets `DisruptionTarget` and a graceful delete.
fn evict(s: &mut State, target: &Target, name: &str) -> Result<Reply, ApiError> {
    let key = key(target, name);
    kubelet::evict_in(s, &key)?;
    ok(
        201,
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
               "status": "Success", "code": 201}),
    )
}

/// `DELETE` of one object, refused with 409 when the body's preconditions (`uid`,
/// `resourceVersion`) do not hold.
fn delete_one(
    s: &mut State,
    target: &Target,
    name: &str,
    req: &RequestRecord,
    opts: &DeleteOptions,
) -> Result<Reply, ApiError> {
    let key = key(target, name);
    if let Some(pre) = req.body.as_ref().and_then(|b| b.get("preconditions")) {
        let current = s
            .objects
            .get(&key)
            .ok_or_else(|| ApiError::not_found(target.kind, name))?;
        for field in ["uid", "resourceVersion"] {
            if let Some(want) = pre.get(field).and_then(Value::as_str)
                && meta_str(current, field) != Some(want)
            {
                return Err(ApiError::conflict(target.kind, name));
            }
        }
    }
    let d = s.delete(&key, opts)?;
    // As the real server: 200 even when the object stays (grace, finalizers),
    // 202 only then and only for `orphanDependents: false`.
    let accepted = !d.gone && req.param("orphanDependents").as_deref() == Some("false");
    Ok(Reply::Json {
        status: if accepted { 202 } else { 200 },
        body: deleted_body(target.kind, d.gone, d.object),
        warning: d.warning,
    })
}

/// `DELETE` of a collection: every object the request's selectors match, answered with
/// the list of them.
fn delete_collection(
    s: &mut State,
    target: &Target,
    req: &RequestRecord,
    opts: &DeleteOptions,
) -> Result<Reply, ApiError> {
    let keys = matching(s, target, req)?;
    let mut items = Vec::new();
    let mut warning = None;
    for k in keys {
        let d = s.delete(&k, opts)?;
        warning = warning.or(d.warning);
        items.push(d.object);
    }
    Ok(Reply::Json {
        status: 200,
        body: list_body(target.kind, s.rv, items),
        warning,
    })
}

/// The body of a delete's answer. The real server returns the object when it stays
/// (deleting) and for pods; an object of another kind that is gone at once is answered
/// with a `Success` Status naming it (the generic registry's `finalizeDelete`).
fn deleted_body(kind: Kind, gone: bool, object: Value) -> Value {
    if !gone || kind == Kind::Pod {
        return object;
    }
    let mut details = json!({
        "name": meta_str(&object, "name"),
        "kind": kind.plural(),
        "uid": meta_str(&object, "uid"),
    });
    if !kind.group().is_empty() {
        details["group"] = json!(kind.group());
    }
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
           "details": details})
}

fn key(target: &Target, name: &str) -> Key {
    (
        target.kind,
        target.namespace.clone().unwrap_or_default(),
        name.to_string(),
    )
}

fn selectors(req: &RequestRecord) -> Result<(LabelSelector, FieldSelector), ApiError> {
    let labels = LabelSelector::parse(req.query_param("labelSelector").unwrap_or_default())
        .map_err(ApiError::bad_request)?;
    let fields = FieldSelector::parse(req.query_param("fieldSelector").unwrap_or_default())
        .map_err(ApiError::bad_request)?;
    Ok((labels, fields))
}

/// The keys of the objects a collection request selects.
fn matching(s: &State, target: &Target, req: &RequestRecord) -> Result<Vec<Key>, ApiError> {
    let (labels, fields) = selectors(req)?;
    Ok(s.objects
        .iter()
        .filter(|((k, ns, _), o)| {
            *k == target.kind
                && target.namespace.as_ref().is_none_or(|want| want == ns)
                && labels.matches(o)
                && fields.matches(o)
        })
        .map(|(k, _)| k.clone())
        .collect())
}

fn list_body(kind: Kind, rv: u64, items: Vec<Value>) -> Value {
    json!({
        "apiVersion": kind.api_version(),
        "kind": format!("{}List", kind.name()),
        "metadata": {"resourceVersion": rv.to_string()},
        "items": items,
    })
}

fn list(s: &mut State, target: &Target, req: &RequestRecord) -> Result<Reply, ApiError> {
    let items = matching(s, target, req)?
        .into_iter()
        .filter_map(|k| s.objects.get(&k).cloned())
        .collect();
    ok(200, list_body(target.kind, s.rv, items))
}

fn create(
    s: &mut State,
    target: &Target,
    mut body: Value,
    dry_run: bool,
) -> Result<Value, ApiError> {
    if let Some(refusal) = s.refused_creates.get(&target.kind) {
        return Err(refusal.clone());
    }
    let namespace = target.namespace.clone().unwrap_or_default();
    if target.kind.namespaced() && namespace.is_empty() {
        return Err(ApiError::bad_request(
            "a namespaced object must be created under /namespaces/<namespace>/",
        ));
    }
    if let Some(ns) = meta_str(&body, "namespace")
        && target.kind.namespaced()
        && ns != namespace
    {
        return Err(ApiError::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        ));
    }
    let name = match (meta_str(&body, "name"), meta_str(&body, "generateName")) {
        (Some(n), _) if !n.is_empty() => n.to_string(),
        (_, Some(g)) => format!("{g}{}", random_suffix()),
        _ => {
            return Err(ApiError {
                code: 422,
                reason: "Invalid",
                message: "name or generateName is required".into(),
                details: None,
            });
        }
    };
    match target.kind {
        Kind::Job => {
            if let Some(o) = body.as_object_mut() {
                o.remove("status");
            }
        }
        Kind::Pod => body["status"] = json!({"phase": "Pending"}),
        Kind::Secret => string_data(&mut body),
        _ => {}
    }
    s.create(&(target.kind, namespace, name), body, dry_run)
}

/// A Secret's `stringData` is merged into `data` (base64) on write, as the API does.
fn string_data(secret: &mut Value) {
    let Some(Value::Object(plain)) = secret.as_object_mut().and_then(|o| o.remove("stringData"))
    else {
        return;
    };
    if !secret.get("data").is_some_and(Value::is_object) {
        secret["data"] = json!({});
    }
    for (k, v) in plain {
        let bytes = v.as_str().unwrap_or_default().as_bytes().to_vec();
        secret["data"][k] =
            serde_json::to_value(k8s_openapi::ByteString(bytes)).unwrap_or(Value::Null);
    }
}

fn patch(
    s: &mut State,
    target: &Target,
    name: &str,
    req: &RequestRecord,
    raw: &Bytes,
    status_sub: bool,
    dry_run: bool,
) -> Result<Reply, ApiError> {
    let key = key(target, name);
    let content_type = req.content_type.as_deref().unwrap_or_default();
    let media = content_type.split(';').next().unwrap_or_default().trim();
    let body = req.body.clone().ok_or_else(|| {
        ApiError::bad_request(format!(
            "the patch body is not JSON (tuneq-kube-fake reads JSON bodies only; {} bytes)",
            raw.len()
        ))
    })?;
    let Some(current) = s.objects.get(&key).cloned() else {
        if media == "application/apply-patch+yaml" && !status_sub {
            let o = create(s, target, with_name(body, name), dry_run)?;
            return ok(201, o);
        }
        return Err(ApiError::not_found(target.kind, name));
    };
    let mut patched = current.clone();
    match media {
        "application/json-patch+json" => {
            let ops: json_patch::Patch = serde_json::from_value(body.clone())
                .map_err(|e| ApiError::bad_request(format!("invalid JSON patch: {e}")))?;
            json_patch::patch(&mut patched, &ops).map_err(|e| ApiError {
                code: 422,
                reason: "Invalid",
                message: format!("the JSON patch does not apply: {e}"),
                details: Some((name.to_string(), target.kind)),
            })?;
        }
        "application/merge-patch+json"
        | "application/strategic-merge-patch+json"
        | "application/apply-patch+yaml" => {
            if let Some(want) = body
                .pointer("/metadata/resourceVersion")
                .and_then(Value::as_str)
                && meta_str(&current, "resourceVersion") != Some(want)
            {
                return Err(ApiError::conflict(target.kind, name));
            }
            json_patch::merge(&mut patched, &body);
        }
        other => {
            return Err(ApiError {
                code: 415,
                reason: "UnsupportedMediaType",
                message: format!(
                    "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml (got {other:?})"
                ),
                details: None,
            });
        }
    }
    let mut result = if status_sub {
        let mut r = current.clone();
        set_or_remove(&mut r, "status", patched.get("status").cloned());
        r
    } else {
        if target.kind.has_status() {
            set_or_remove(&mut patched, "status", current.get("status").cloned());
        }
        patched
    };
    // What the server owns comes back from the stored object.
    result["apiVersion"] = json!(target.kind.api_version());
    result["kind"] = json!(target.kind.name());
    for field in [
        "name",
        "namespace",
        "uid",
        "creationTimestamp",
        "generation",
        "resourceVersion",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
    ] {
        let old = current.get("metadata").and_then(|m| m.get(field)).cloned();
        let meta = meta_mut(&mut result);
        match old {
            Some(v) => meta.insert(field.to_string(), v),
            None => meta.remove(field),
        };
    }
    if target.kind == Kind::Secret {
        string_data(&mut result);
    }
    if dry_run {
        return ok(200, result);
    }
    let written = s.write(&key, result);
    ok(200, written)
}

fn with_name(mut body: Value, name: &str) -> Value {
    meta_mut(&mut body).insert("name".into(), json!(name));
    body
}

fn set_or_remove(obj: &mut Value, field: &str, value: Option<Value>) {
    match (obj.as_object_mut(), value) {
        (Some(o), Some(v)) if !v.is_null() => {
            o.insert(field.to_string(), v);
        }
        (Some(o), _) => {
            o.remove(field);
        }
        _ => {}
    }
}

fn delete_options(req: &RequestRecord) -> Result<DeleteOptions, ApiError> {
    let policy = match req.param("propagationPolicy") {
        Some(p) => Some(
            Propagation::parse(&p)
                .ok_or_else(|| ApiError::bad_request(format!("unknown propagationPolicy {p:?}")))?,
        ),
        None => match req.param("orphanDependents").as_deref() {
            Some("true") => Some(Propagation::Orphan),
            Some("false") => Some(Propagation::Background),
            _ => None,
        },
    };
    let grace = match req.param("gracePeriodSeconds") {
        Some(g) => Some(
            g.parse::<i64>()
                .map_err(|_| ApiError::bad_request(format!("invalid gracePeriodSeconds {g:?}")))?,
        ),
        None => None,
    };
    let dry_run = req.query_param("dryRun") == Some("All")
        || req
            .body
            .as_ref()
            .and_then(|b| b.get("dryRun"))
            .and_then(Value::as_array)
            .is_some_and(|a| a.iter().any(|v| v == "All"));
    Ok(DeleteOptions {
        propagation: policy,
        grace,
        dry_run,
    })
}

fn start_watch(
    cluster: &FakeCluster,
    target: &Target,
    req: &RequestRecord,
) -> Result<Reply, ApiError> {
    let (labels, fields) = selectors(req)?;
    let from = match req.query_param("resourceVersion") {
        None | Some("") => None,
        Some(rv) => Some(
            rv.parse::<u64>()
                .map_err(|_| ApiError::bad_request(format!("invalid resourceVersion {rv:?}")))?,
        ),
    };
    let timeout = req
        .query_param("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .map(Duration::from_secs);
    let request = WatchRequest {
        kind: target.kind,
        namespace: target.namespace.clone(),
        labels,
        fields,
        from,
        timeout,
        bookmarks: req.query_param("allowWatchBookmarks") == Some("true"),
    };
    Ok(Reply::Stream(watch::start(cluster.clone(), request)))
}
