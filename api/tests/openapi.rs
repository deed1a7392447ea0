//! `openapi/openapi.json` is the document the handlers generate: this fails when they
//! drift. Regenerate with `UPDATE_OPENAPI=1 cargo test -p tuneq-api --test openapi`.

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
         UPDATE_OPENAPI=1 cargo test -p tuneq-api --test openapi\nand commit the result"
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
