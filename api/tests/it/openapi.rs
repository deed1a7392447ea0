//! `openapi/openapi.json` is the document the handlers generate: this fails when they
//! drift. Regenerate with `UPDATE_OPENAPI=1 cargo test -p tuneq-api --test it openapi`.

#![allow(clippy::unwrap_used, missing_docs)]

use std::path::PathBuf;

#[test]
fn the_committed_document_matches_the_handlers() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../openapi/openapi.json");
    let generated = tuneq_api::spec::document_json();
    if std::env::var_os("UPDATE_OPENAPI").is_some() {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "openapi/openapi.json is out of date with the handlers; regenerate it with\n  \
         UPDATE_OPENAPI=1 cargo test -p tuneq-api --test it openapi\nand commit the result"
    );
}

#[test]
fn every_route_documents_its_errors_and_both_prefixes() {
    // Routes that need a key document 401; the open ones (health, metrics) say so with
    // an empty security requirement.
    let doc: serde_json::Value = serde_json::from_str(&tuneq_api::spec::document_json()).unwrap();
    let paths = doc["paths"].as_object().unwrap();
    for path in [
        "/v1/files",
        "/files/{id}/content",
        "/v1/fine_tuning/jobs",
        "/finetunes/{id}/events",
        "/finetunes/{id}/adapter",
        "/v1/models",
    ] {
        assert!(paths.contains_key(path), "{path} missing");
    }
    let mut ids = std::collections::HashSet::new();
    for (path, item) in paths {
        for (method, op) in item.as_object().unwrap() {
            let id = op["operationId"].as_str().unwrap();
            assert!(ids.insert(id.to_string()), "duplicate operationId {id}");
            let open = op
                .get("security")
                .and_then(|s| s.as_array())
                .is_some_and(|s| {
                    s.iter()
                        .all(|r| r.as_object().is_some_and(serde_json::Map::is_empty))
                });
            if !open {
                assert!(
                    op["responses"].get("401").is_some(),
                    "{method} {path} must document 401"
                );
            }
        }
    }
}

/// Every operation of the document (both prefixes), and the routes it leaves out, reach
/// a handler: none answers `unknown_route` or 405.
#[actix_web::test]
async fn the_router_serves_what_the_document_declares() {
    use actix_web::http::Method;
    use actix_web::{App, test};
    let app = test::init_service(App::new().configure(tuneq_api::configure(1 << 20))).await;
    let doc = tuneq_api::spec::document();
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
        50,
        "32 operations, 18 of them under two prefixes"
    );
    for (method, path) in [
        (Method::POST, "/internal/attempts/{job}/report"),
        (Method::GET, "/openapi.json"),
        (Method::GET, "/docs"),
    ] {
        operations.push((method, path.to_string()));
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
