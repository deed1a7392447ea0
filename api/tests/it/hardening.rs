//! What an attacker or a careless client found when the service was probed (issue 11),
//! each kept fixed by a test over real HTTP: nothing a client sends can grow the
//! server's memory, files or connections without a bound, keys can be revoked, failed
//! authentications are slowed, and a job that can never train is refused at create.

#![allow(clippy::unwrap_used, missing_docs)]

use crate::support;

use reqwest::StatusCode;
use serde_json::{Value, json};
use std::time::{Duration, Instant};
use support::{ADMIN_KEY, create, examples, get, raw, start, upload};

#[tokio::test]
async fn extension_methods_are_refused_and_never_become_metric_labels() {
    let s = start(|_| {}).await;
    let long = "X".repeat(30_000);
    // A method nobody uses is refused before routing; a short extension method reaches
    // its route and is told what the route serves.
    for (method, status) in [
        (long.as_str(), "501"),
        ("PROPFIND", "405"),
        ("BREW", "405"),
        ("QUERY", "405"),
    ] {
        for _ in 0..50 {
            let answer = raw(
                &s,
                &format!("{method} /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"),
                b"",
                Duration::from_secs(5),
            )
            .await;
            assert!(
                answer.starts_with(&format!("HTTP/1.1 {status}")),
                "{method:.20}: {answer:.200}"
            );
        }
    }
    let metrics = reqwest::get(format!("{}/metrics", s.url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!metrics.contains("PROPFIND") && !metrics.contains("BREW"));
    assert!(!metrics.contains("XXXXXXXX"), "a method became a label");
    assert!(
        metrics.len() < 64 << 10,
        "metrics grew to {} bytes",
        metrics.len()
    );
}

#[tokio::test]
async fn compressed_bodies_are_refused_before_they_are_inflated() {
    let s = start(|_| {}).await;
    // Any encoding, with or without a key, on a JSON route and on the trainers' route.
    for (path, key) in [
        ("/v1/fine_tuning/jobs", Some(s.acme.clone())),
        ("/internal/attempts/job-1/report", None),
    ] {
        let mut request = reqwest::Client::new()
            .post(format!("{}{path}", s.url))
            .header("content-encoding", "gzip")
            .header("content-type", "application/json")
            .body(vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3]);
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        let response = request.send().await.unwrap();
        assert_eq!(
            response.status(),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "{path}"
        );
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["error"]["code"], "encoded_body_unsupported");
    }
}

#[tokio::test]
async fn the_trainers_route_checks_the_credential_before_it_reads_a_byte() {
    let s = start(|_| {}).await;
    // A body is announced but never sent: the answer must not wait for it.
    let started = Instant::now();
    let answer = raw(
        &s,
        "POST /internal/attempts/job-1/report HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n",
        b"{",
        Duration::from_secs(5),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer:.200}");
    assert!(started.elapsed() < Duration::from_secs(3));
}

#[tokio::test]
async fn a_stalled_body_is_answered_408_and_its_connection_closed() {
    let s = start(|c| {
        c.body_pace = tuneq_api::guard::BodyPace {
            idle: Duration::from_millis(500),
            grace: Duration::from_secs(1),
            min_rate: 1024,
        };
    })
    .await;
    for path in ["/v1/fine_tuning/jobs", "/v1/files?filename=a.jsonl"] {
        let started = Instant::now();
        let answer = raw(
            &s,
            &format!(
                "POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n",
                s.acme
            ),
            b"{\"model\":",
            Duration::from_secs(10),
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 408"), "{path}: {answer:.300}");
        assert!(answer.contains("body_timeout"), "{answer:.300}");
        assert!(started.elapsed() < Duration::from_secs(5), "{path}");
    }
}

#[tokio::test]
async fn uploads_at_once_are_bounded_per_tenant() {
    use tokio::io::AsyncWriteExt;
    let s = start(|_| {}).await;
    // Four uploads that send their headers and a first line, then wait.
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut stream = tokio::net::TcpStream::connect(s.addr).await.unwrap();
        stream
            .write_all(
                format!(
                    "POST /v1/files?filename=a.jsonl HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Length: 100000\r\n\r\n{{\"text\":\"a\"}}\n",
                    s.acme
                )
                .as_bytes(),
            )
            .await
            .unwrap();
        held.push(stream);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let response = s
        .post_body(&s.acme, "/v1/files?filename=b.jsonl", examples(2))
        .await;
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(response.headers().contains_key("retry-after"));
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "too_many_uploads");
    // Another tenant is not held up by them.
    upload(&s, &s.other, &examples(2)).await;
    drop(held);
    // Their slots come back once they are gone.
    tokio::time::sleep(Duration::from_millis(300)).await;
    upload(&s, &s.acme, &examples(2)).await;
}

#[tokio::test]
async fn a_line_longer_than_the_limit_is_named_not_buffered() {
    let s = start(|c| c.max_upload_bytes = 32 << 20).await;
    let long = format!("{{\"text\":\"{}\"}}", "a".repeat(9 << 20));
    let body = format!("{}\n{long}\n{}\n", examples(1), examples(1));
    let response = s
        .post_body(&s.acme, "/v1/files?filename=long.jsonl", body)
        .await;
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["lines"][0]["line"], 2, "{body}");
    assert!(
        body["error"]["lines"][0]["message"]
            .as_str()
            .unwrap()
            .contains("longer than"),
        "{body}"
    );
}

#[tokio::test]
async fn repeated_form_fields_and_authorization_headers_are_refused() {
    let s = start(|_| {}).await;
    let data = examples(2);
    let form = reqwest::multipart::Form::new()
        .part(
            "file",
            reqwest::multipart::Part::text(data.clone()).file_name("a.jsonl"),
        )
        .part(
            "file",
            reqwest::multipart::Part::text(data).file_name("b.jsonl"),
        );
    let response = s.post_form(&s.acme, "/v1/files", form).await;
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "duplicate_field");
    assert_eq!(body["error"]["param"], "file");

    let answer = raw(
        &s,
        &format!(
            "GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nAuthorization: Bearer {}\r\n\r\n",
            s.acme, s.other
        ),
        b"",
        Duration::from_secs(5),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer:.200}");
    assert!(answer.contains("duplicate_header"));
}

#[tokio::test]
async fn keys_are_listed_by_id_and_a_revoked_key_stops_at_once() {
    let s = start(|_| {}).await;
    let http = reqwest::Client::new();
    let admin = |r: reqwest::RequestBuilder| r.bearer_auth(ADMIN_KEY);
    // The key works (and is now in the process's cache).
    let ok = s.get_as(&s.acme, "/v1/models").await;
    assert_eq!(ok.status(), StatusCode::OK);
    let listed: Value = support::json_of(admin(
        http.get(format!("{}/admin/tenants/acme/keys", s.url)),
    ))
    .await;
    let keys = listed["data"].as_array().unwrap();
    assert_eq!(keys.len(), 1, "{listed}");
    let prefix = keys[0]["prefix"].as_str().unwrap().trim_end_matches('…');
    assert!(s.acme.starts_with(prefix) && prefix.len() < s.acme.len() / 2);
    assert!(
        !listed.to_string().contains(&s.acme),
        "the key itself is never listed"
    );
    let id = keys[0]["id"].as_str().unwrap();
    // Another tenant's id is not found under this one.
    let wrong = admin(http.delete(format!("{}/admin/tenants/other/keys/{id}", s.url)))
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), StatusCode::NOT_FOUND);
    let revoked = admin(http.delete(format!("{}/admin/tenants/acme/keys/{id}", s.url)))
        .send()
        .await
        .unwrap();
    assert_eq!(revoked.status(), StatusCode::OK);
    let after = s.get_as(&s.acme, "/v1/models").await;
    assert_eq!(after.status(), StatusCode::UNAUTHORIZED);
    // Revoked for good: registering the same key again (as a restart that passes it
    // once more would) is refused, and it still does not work.
    let again = tuneq_api::records::tenant::add_key(&s.state.queue, "acme", Some(&s.acme))
        .await
        .unwrap_err();
    assert_eq!(again.code(), tuneq_api::Code::KeyRevoked, "{again}");
    assert!(
        tuneq_api::records::tenant::revocation(&s.state.queue, &s.acme)
            .await
            .unwrap()
            .is_some()
    );
    let after = s.get_as(&s.acme, "/v1/models").await;
    assert_eq!(after.status(), StatusCode::UNAUTHORIZED);
    // The other tenant's key is untouched.
    let other = s.get_as(&s.other, "/v1/models").await;
    assert_eq!(other.status(), StatusCode::OK);
}

#[tokio::test]
async fn webhook_secrets_are_not_readable_from_the_queue_file() {
    let s = start(|_| {}).await;
    let secret: Value = s.json_as(&s.acme, "/webhooks/secret").await;
    let secret = secret["secret"].as_str().unwrap().to_string();
    assert!(secret.starts_with("whsec_"));
    let file = std::fs::read(s.dir.path().join("queue.db")).unwrap();
    let encoded = secret.trim_start_matches("whsec_");
    assert!(
        !file.windows(encoded.len()).any(|w| w == encoded.as_bytes()),
        "the queue file holds the webhook secret in plain text"
    );
}

#[tokio::test]
async fn tenant_names_and_metadata_refuse_controls_and_bidi_overrides() {
    let s = start(|_| {}).await;
    for name in ["evil\u{202e}gnp.exe", "nul\0here", &"n".repeat(200)] {
        let response = s
            .post_json(
                ADMIN_KEY,
                "/admin/tenants",
                &json!({"id": "named", "name": name}),
            )
            .await;
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{name:.20}");
    }
    let file = upload(&s, &s.acme, &examples(4)).await;
    for metadata in [json!({"k\u{2066}": "v"}), json!({"k": "a\0b"})] {
        let response = s
            .post_json(
                &s.acme,
                "/v1/fine_tuning/jobs",
                &json!({"model": "base", "training_file": file, "metadata": metadata}),
            )
            .await;
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{metadata}");
    }
}

/// `GET url` with `key`.
/// Creates a job with `extra` merged into a valid request; the answer's status and body.

#[tokio::test]
async fn settings_that_can_never_train_are_refused_at_create_naming_the_field() {
    let s = start(|_| {}).await;
    let file = upload(&s, &s.acme, &examples(8)).await;
    let hp =
        |h: Value| json!({"method": {"type": "supervised", "supervised": {"hyperparameters": h}}});
    for (extra, param) in [
        (json!({"lora": {"r": 100000}}), "lora.r"),
        (json!({"lora": {"r": 64}}), "lora.r"), // wider than k_proj (32)
        (json!({"lora": {"alpha": 1e308}}), "lora.alpha"),
        (
            json!({"lora": {"target_modules": ["q_proj", "q_proj"]}}),
            "lora.target_modules",
        ),
        (
            hp(json!({"learning_rate": 1e308})),
            "hyperparameters.learning_rate",
        ),
        (
            hp(json!({"learning_rate_multiplier": 1e-300})),
            "hyperparameters.learning_rate_multiplier",
        ),
        (
            hp(json!({"warmup_steps": u64::MAX})),
            "hyperparameters.warmup_steps",
        ),
        (
            hp(json!({"max_seq_len": 4096})),
            "hyperparameters.max_seq_len",
        ),
    ] {
        let (status, body) = create(&s, &file, extra.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{extra}: {body}");
        assert_eq!(body["error"]["param"], param, "{extra}: {body}");
    }
    // Values of the wrong type, and fields that do not exist, are named the same way,
    // by their path in the body.
    for (extra, param) in [
        (json!({"lora": {"r": "eight"}}), "lora.r"),
        (json!({"lora": {"rank": 8}}), "lora.rank"),
        (
            hp(json!({"n_epochs": -1})),
            "method.supervised.hyperparameters.n_epochs",
        ),
        (json!({"suffix": 7}), "suffix"),
        (json!({"epochs": 3}), "epochs"),
    ] {
        let (status, body) = create(&s, &file, extra.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{extra}: {body}");
        assert_eq!(body["error"]["code"], "invalid_json", "{extra}: {body}");
        assert_eq!(body["error"]["param"], param, "{extra}: {body}");
    }
    // Nothing was created.
    let jobs: Value = s.json_as(&s.acme, "/v1/fine_tuning/jobs").await;
    assert_eq!(jobs["data"].as_array().unwrap().len(), 0);
    // The same request within bounds is accepted.
    let (status, body) = create(&s, &file, json!({"lora": {"r": 16}})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
}

#[tokio::test]
async fn a_job_that_needs_more_memory_than_an_attempt_has_is_refused_with_the_numbers() {
    let s = start(|c| c.pools = std::sync::Arc::new(tuneq_pools::PoolsFile::local(Some(8 << 20))))
        .await;
    let file = upload(&s, &s.acme, &examples(8)).await;
    let (status, body) = create(
        &s,
        &file,
        json!({"method": {"type": "supervised", "supervised": {"hyperparameters": {"batch_size": 64, "max_seq_len": 1024}}}}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["error"]["code"], "does_not_fit");
    assert!(body["error"]["message"].as_str().unwrap().contains("MiB"));
}

/// Registers `llama-7b`, a base model of Llama 2 7B's shape (its config only: nothing
/// here reads its weights).
async fn register_7b(s: &support::Server) {
    support::register_model(
        &s.state,
        s.dir.path(),
        "llama-7b",
        1e-4,
        json!({
            "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5
        }),
    )
    .await;
}

#[tokio::test]
async fn a_job_that_fits_only_in_bf16_is_refused_naming_dtype_and_fits_when_asked() {
    let on_pool = |bytes: u64| {
        start(move |c| c.pools = std::sync::Arc::new(tuneq_pools::PoolsFile::local(Some(bytes))))
    };
    // What a 7B job needs with f32 weights (the CPU's `auto`) and with bf16 weights, from
    // the refusals on a pool too small for either.
    let s = on_pool(1 << 30).await;
    register_7b(&s).await;
    let file = upload(&s, &s.acme, &examples(8)).await;
    let mut mib = Vec::new();
    for body in [
        json!({"model": "llama-7b"}),
        json!({"model": "llama-7b", "dtype": "bf16"}),
    ] {
        let (status, refused) = create(&s, &file, body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{refused}");
        assert_eq!(refused["error"]["code"], "does_not_fit", "{refused}");
        let message = refused["error"]["message"].as_str().unwrap();
        mib.push(
            message
                .split("needs about ")
                .nth(1)
                .and_then(|rest| rest.split(' ').next())
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("no figure in {message}")),
        );
    }
    let (f32_mib, bf16_mib) = (mib[0], mib[1]);
    assert!(
        bf16_mib + 1024 < f32_mib,
        "bf16 {bf16_mib} MiB, f32 {f32_mib} MiB"
    );

    // A pool between the two: the default is refused, naming dtype and saying what fits.
    let s = on_pool(((bf16_mib + f32_mib) / 2) << 20).await;
    register_7b(&s).await;
    let file = upload(&s, &s.acme, &examples(8)).await;
    let (status, body) = create(&s, &file, json!({"model": "llama-7b"})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["error"]["code"], "does_not_fit", "{body}");
    assert_eq!(body["error"]["param"], "dtype", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains(r#"With "dtype": "bf16" it fits."#),
        "{message}"
    );
    // Following the advice works.
    let (status, body) = create(&s, &file, json!({"model": "llama-7b", "dtype": "bf16"})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
}

#[tokio::test]
async fn a_deleted_file_goes_from_the_catalog_first_and_missing_content_is_410() {
    let s = start(|_| {}).await;
    let file = upload(&s, &s.acme, &examples(3)).await;
    // The content vanishes behind the service's back (a crash, an operator).
    let content = s
        .dir
        .path()
        .join(format!("objects/tenants/acme/files/{file}/content.jsonl"));
    std::fs::remove_file(&content).unwrap();
    let response = s
        .get_as(&s.acme, &format!("/v1/files/{file}/content"))
        .await;
    assert_eq!(response.status(), StatusCode::GONE);
    let body = response.text().await.unwrap();
    assert!(!body.contains("objects/"), "a server path leaked: {body}");
    // Deleting it still works, and then it is 404.
    let deleted = s.delete_as(&s.acme, &format!("/v1/files/{file}")).await;
    assert_eq!(deleted.status(), StatusCode::OK);
    let gone = s.get_as(&s.acme, &format!("/v1/files/{file}")).await;
    assert_eq!(gone.status(), StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn a_file_an_unfinished_job_trains_on_cannot_be_deleted() {
    let s = start(|_| {}).await;
    let file = upload(&s, &s.acme, &examples(4)).await;
    let (status, job) = create(&s, &file, json!({})).await;
    assert_eq!(status, StatusCode::OK, "{job}");
    let response = s.delete_as(&s.acme, &format!("/v1/files/{file}")).await;
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "file_in_use");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains(job["id"].as_str().unwrap())
    );
    // Still there, content and all.
    let content = s
        .get_as(&s.acme, &format!("/v1/files/{file}/content"))
        .await;
    assert_eq!(content.status(), StatusCode::OK);
}

#[tokio::test]
async fn a_tenants_storage_quota_is_answered_429_and_stores_nothing() {
    let s = start(|_| {}).await;
    let http = reqwest::Client::new();
    let set = |limits: Value| {
        http.put(format!("{}/admin/tenants/acme/limits", s.url))
            .bearer_auth(ADMIN_KEY)
            .json(&limits)
            .send()
    };
    assert_eq!(
        set(json!({"max_files": 2})).await.unwrap().status(),
        StatusCode::OK
    );
    upload(&s, &s.acme, &examples(2)).await;
    upload(&s, &s.acme, &examples(2)).await;
    let third = s
        .post_body(&s.acme, "/v1/files?filename=c.jsonl", examples(2))
        .await;
    assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
    let body: Value = third.json().await.unwrap();
    assert_eq!(body["error"]["code"], "tenant_storage_quota");
    // Bytes: what is kept plus the upload must stay within the quota.
    let kept = 2 * examples(2).len() as u64;
    assert_eq!(
        set(json!({"max_stored_bytes": kept + 10}))
            .await
            .unwrap()
            .status(),
        StatusCode::OK
    );
    let over = s
        .post_body(&s.acme, "/v1/files?filename=d.jsonl", examples(2))
        .await;
    assert_eq!(over.status(), StatusCode::TOO_MANY_REQUESTS);
    let files: Value = get(&http, format!("{}/v1/files", s.url), &s.acme)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(files["data"].as_array().unwrap().len(), 2);
    // Another tenant has no such quota.
    upload(&s, &s.other, &examples(2)).await;
}

#[tokio::test]
async fn a_key_made_before_key_ids_gets_one_when_used_and_can_then_be_revoked() {
    use tuneq_queue::Catalog;
    let s = start(|_| {}).await;
    let http = reqwest::Client::new();
    // A key as the catalog held it before keys had ids: only its tenant.
    let old_key = "tq_an_old_key_from_before_key_ids_0001";
    s.state
        .queue
        .create_entry(
            "apikey",
            "keys",
            &tuneq_api::auth::key_hash(old_key),
            r#"{"tenant":"acme"}"#,
        )
        .await
        .unwrap();
    let used = s.get_as(old_key, "/v1/models").await;
    assert_eq!(used.status(), StatusCode::OK);
    let listed: Value = get(
        &http,
        format!("{}/admin/tenants/acme/keys", s.url),
        ADMIN_KEY,
    )
    .await
    .json()
    .await
    .unwrap();
    let keys = listed["data"].as_array().unwrap();
    assert_eq!(keys.len(), 2, "{listed}");
    let old = keys
        .iter()
        .find(|k| old_key.starts_with(k["prefix"].as_str().unwrap().trim_end_matches('…')))
        .unwrap();
    let revoked = s
        .delete_as(
            ADMIN_KEY,
            &format!("/admin/tenants/acme/keys/{}", old["id"].as_str().unwrap()),
        )
        .await;
    assert_eq!(revoked.status(), StatusCode::OK);
    let after = s.get_as(old_key, "/v1/models").await;
    assert_eq!(after.status(), StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn a_plain_request_id_is_kept_and_anything_else_replaced_by_ours() {
    let s = start(|_| {}).await;
    let http = reqwest::Client::new();
    let id_of = |response: &reqwest::Response| {
        response
            .headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
            .expect("every answer names its request")
    };
    // A client's plain id comes back as it is, on answers and refusals alike.
    for path in ["/v1/models", "/v1/no-such-route"] {
        let response = http
            .get(format!("{}{path}", s.url))
            .bearer_auth(&s.acme)
            .header("x-request-id", "trace-42.a:b_c")
            .send()
            .await
            .unwrap();
        assert_eq!(id_of(&response), "trace-42.a:b_c", "{path}");
    }
    // None, too long, or with characters a log line should not carry: ours instead.
    let mut ours = std::collections::HashSet::new();
    for given in [
        None,
        Some("x".repeat(65)),
        Some("a b\tc".to_string()),
        Some("ünï".to_string()),
    ] {
        let mut request = http
            .get(format!("{}/v1/models", s.url))
            .bearer_auth(&s.acme);
        if let Some(given) = &given {
            request = request.header("x-request-id", given.as_str());
        }
        let id = id_of(&request.send().await.unwrap());
        assert!(
            id.starts_with("req_")
                && id.len() == 28
                && id[4..].bytes().all(|b| b.is_ascii_hexdigit()),
            "{given:?} gave {id}"
        );
        ours.insert(id);
    }
    assert_eq!(ours.len(), 4, "each request gets its own id");
}
