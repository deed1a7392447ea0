//! What a client may hold open (issue 30, H1 and L4 of the 2026-12-04 probe): event
//! streams and downloads are bounded per tenant and for the process, so another tenant
//! and the health probes always get a connection; a stream ends when its key is revoked
//! and when its lifetime is over, and resumes with `Last-Event-ID`; slots come back when
//! their client goes away.
//!
//! Streams are opened over raw TCP (one connection each, as the probe did). Every wait is
//! bounded by a deadline that only turns a hang into a failure; nothing asserts a time.

#![allow(clippy::unwrap_used, missing_docs)]

use crate::support::{self, ADMIN_KEY, Server, create, examples, start, upload};
use reqwest::StatusCode;
use serde_json::{Value, json};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long any one read may wait before the test gives up on it.
const PATIENCE: Duration = Duration::from_secs(20);

/// A queued job of `acme` (no dispatcher runs, so it stays queued and its stream open).
async fn queued_job(s: &Server) -> String {
    let file = upload(s, &s.acme, &examples(8)).await;
    let (status, job) = create(s, &file, json!({})).await;
    assert_eq!(status, StatusCode::OK, "{job}");
    job["id"].as_str().unwrap().to_string()
}

/// Sends `GET path` with `key` on a new connection and reads the answer's head (and
/// whatever came with it).
async fn open(s: &Server, key: &str, path: &str, extra: &str) -> (TcpStream, String) {
    let mut conn = TcpStream::connect(s.addr).await.unwrap();
    conn.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n{extra}\r\n")
            .as_bytes(),
    )
    .await
    .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(PATIENCE, conn.read(&mut buf))
            .await
            .expect("no answer")
            .unwrap();
        assert!(
            n > 0,
            "closed before answering: {:?}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    (conn, String::from_utf8_lossy(&got).into_owned())
}

/// Opens the event stream of `job` with `key`.
async fn stream(s: &Server, key: &str, job: &str) -> (TcpStream, String) {
    open(
        s,
        key,
        &format!("/v1/fine_tuning/jobs/{job}/events?stream=true"),
        "",
    )
    .await
}

/// Reads `conn` until the server closes it; what came.
async fn read_to_close(conn: &mut TcpStream) -> String {
    let mut rest = Vec::new();
    tokio::time::timeout(PATIENCE, conn.read_to_end(&mut rest))
        .await
        .expect("the server kept the connection open")
        .unwrap();
    String::from_utf8_lossy(&rest).into_owned()
}

/// Reads a stream (chunked) until its last chunk; what came, after what was `read`
/// already (the head, and what came with it).
async fn read_to_end_of_stream(conn: &mut TcpStream, read: &str) -> String {
    let mut got = read.as_bytes().to_vec();
    let mut buf = [0u8; 4096];
    // One deadline for the whole stream: its keep-alive comments must not extend it.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !got.ends_with(b"\r\n0\r\n\r\n") {
        let n = tokio::time::timeout_at(deadline, conn.read(&mut buf))
            .await
            .expect("the stream did not end")
            .unwrap();
        assert!(
            n > 0,
            "closed mid-stream: {:?}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// Checks that `head` (and the rest of its answer) is a 429 with `code` and
/// `retry-after`, on a connection the server then closes.
async fn assert_refused(conn: &mut TcpStream, head: &str, code: &str) {
    assert!(head.starts_with("HTTP/1.1 429"), "{head}");
    assert!(head.to_ascii_lowercase().contains("retry-after:"), "{head}");
    let whole = format!("{head}{}", read_to_close(conn).await);
    assert!(whole.contains(&format!("\"code\":\"{code}\"")), "{whole}");
}

/// A new key of `acme`, and its public id.
async fn new_acme_key(s: &Server) -> (String, String) {
    let client = reqwest::Client::new();
    let created: Value = support::json_of(
        client
            .post(format!("{}/admin/tenants/acme/keys", s.url))
            .bearer_auth(ADMIN_KEY),
    )
    .await;
    let key = created["api_key"].as_str().unwrap().to_string();
    let listed: Value = support::json_of(
        client
            .get(format!("{}/admin/tenants/acme/keys", s.url))
            .bearer_auth(ADMIN_KEY),
    )
    .await;
    let id = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| key.starts_with(k["prefix"].as_str().unwrap().trim_end_matches('…')))
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    (key, id)
}

/// Tries to open a stream until one is answered 200 (a slot given back is seen by the
/// server once it notices the client has gone); gives up after `tries`.
async fn stream_once_free(s: &Server, key: &str, job: &str, tries: usize) -> TcpStream {
    for _ in 0..tries {
        let (conn, head) = stream(s, key, job).await;
        if head.starts_with("HTTP/1.1 200") {
            return conn;
        }
        assert!(head.starts_with("HTTP/1.1 429"), "{head}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no stream slot came back");
}

#[tokio::test]
async fn a_tenant_past_its_stream_bound_is_refused_and_its_slots_come_back() {
    let s = start(|c| c.holds.streams_per_tenant = 3).await;
    let job = queued_job(&s).await;
    let mut held = Vec::new();
    for _ in 0..3 {
        let (conn, head) = stream(&s, &s.acme, &job).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(head.contains("text/event-stream"), "{head}");
        held.push(conn);
    }
    // One more is refused, and its connection is not kept either.
    let (mut conn, head) = stream(&s, &s.acme, &job).await;
    assert_refused(&mut conn, &head, "too_many_streams").await;
    // The bound is the tenant's: another of its keys gets no more.
    let (key, _) = new_acme_key(&s).await;
    let (mut conn, head) = stream(&s, &key, &job).await;
    assert_refused(&mut conn, &head, "too_many_streams").await;
    // Pages of events (no stream) are not bounded by it.
    let page = support::get_json(&s, &format!("/v1/fine_tuning/jobs/{job}/events")).await;
    assert_eq!(page["object"], "list", "{page}");
    // A client that goes away gives its slot back.
    drop(held.pop());
    held.push(stream_once_free(&s, &key, &job, 100).await);
    let (mut conn, head) = stream(&s, &s.acme, &job).await;
    assert_refused(&mut conn, &head, "too_many_streams").await;
    assert_eq!(s.state.holds.held(), 3);
}

#[tokio::test]
async fn with_the_most_streams_open_other_tenants_and_health_probes_are_answered() {
    // 8 connections (4 per worker): at most 4 held open by streams.
    let s = start(|c| {
        c.max_connections = 8;
        c.holds.streams_per_tenant = 100;
    })
    .await;
    assert_eq!(s.state.holds.per_process(), 4);
    let job = queued_job(&s).await;
    // As many streams as the server has connections, as the probe opened.
    let (mut open_streams, mut refused) = (Vec::new(), 0);
    for _ in 0..8 {
        let (mut conn, head) = stream(&s, &s.acme, &job).await;
        if head.starts_with("HTTP/1.1 200") {
            open_streams.push(conn);
        } else {
            assert_refused(&mut conn, &head, "too_many_streams").await;
            refused += 1;
        }
    }
    assert_eq!((open_streams.len(), refused), (4, 4));
    let client = reqwest::Client::builder()
        .timeout(PATIENCE)
        .build()
        .unwrap();
    for _ in 0..3 {
        let health = client
            .get(format!("{}/healthz", s.url))
            .send()
            .await
            .unwrap();
        assert_eq!(health.status(), StatusCode::OK);
        let ready = client
            .get(format!("{}/readyz", s.url))
            .send()
            .await
            .unwrap();
        assert_eq!(ready.status(), StatusCode::OK);
        let files = client
            .get(format!("{}/v1/files", s.url))
            .bearer_auth(&s.other)
            .send()
            .await
            .unwrap();
        assert_eq!(files.status(), StatusCode::OK);
    }
    // The streams themselves are still held open.
    assert_eq!(s.state.holds.held(), 4);
    drop(open_streams);
}

#[tokio::test]
async fn a_stream_ends_when_its_key_is_revoked() {
    let s = start(|c| c.holds.key_check = Duration::from_millis(100)).await;
    let job = queued_job(&s).await;
    let (key, key_id) = new_acme_key(&s).await;
    let (mut conn, head) = stream(&s, &key, &job).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    // A stream of the tenant's other key stays.
    let (mut kept, kept_head) = stream(&s, &s.acme, &job).await;
    assert!(kept_head.starts_with("HTTP/1.1 200"), "{kept_head}");
    let revoked = s
        .delete_as(ADMIN_KEY, &format!("/admin/tenants/acme/keys/{key_id}"))
        .await;
    assert_eq!(revoked.status(), StatusCode::OK);
    let rest = read_to_end_of_stream(&mut conn, &head).await;
    assert!(rest.contains("event: error"), "{rest}");
    assert!(rest.contains("invalid_api_key"), "{rest}");
    assert!(!rest.contains("event: done"), "{rest}");
    // Its slot came back; the other key's stream is still open.
    assert_eq!(s.state.holds.held(), 1);
    let mut buf = [0u8; 64];
    let still = tokio::time::timeout(Duration::from_millis(300), kept.read(&mut buf)).await;
    assert!(
        still.map_or(true, |n| n.unwrap() > 0),
        "the other key's stream ended"
    );
    // And the revoked key opens no new one.
    let (_conn, head) = stream(&s, &key, &job).await;
    assert!(head.starts_with("HTTP/1.1 401"), "{head}");
}

#[tokio::test]
async fn a_stream_ends_after_its_lifetime_and_resumes_with_last_event_id() {
    let s = start(|c| c.holds.stream_lifetime = Duration::from_secs(1)).await;
    let job = queued_job(&s).await;
    let (mut conn, head) = stream(&s, &s.acme, &job).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let first = read_to_end_of_stream(&mut conn, &head).await;
    assert!(!first.contains("event: done"), "{first}");
    assert!(first.contains("reconnect with Last-Event-ID"), "{first}");
    let ids: Vec<&str> = first
        .lines()
        .filter_map(|l| l.strip_prefix("id: "))
        .collect();
    assert!(!ids.is_empty(), "{first}");
    assert_eq!(s.state.holds.held(), 0);
    // New events, then a reconnect that says where it got to: only the new ones come,
    // even with an older `after` left in the URL (a reconnecting client keeps its URL).
    let cancelled = s
        .post_as(&s.acme, &format!("/v1/fine_tuning/jobs/{job}/cancel"))
        .await;
    assert_eq!(cancelled.status(), StatusCode::OK);
    let (mut conn, head) = open(
        &s,
        &s.acme,
        &format!(
            "/v1/fine_tuning/jobs/{job}/events?stream=true&after=ftevent-{}-0",
            job.trim_start_matches("ftjob-")
        ),
        &format!("Last-Event-ID: {}\r\n", ids[ids.len() - 1]),
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let second = read_to_end_of_stream(&mut conn, &head).await;
    for id in &ids {
        assert!(
            !second.contains(&format!("id: {id}\n")),
            "{id} again: {second}"
        );
    }
    assert!(second.contains("event: done"), "{second}");
}

#[tokio::test]
async fn downloads_held_open_are_bounded_per_tenant() {
    let s = start(|c| {
        c.holds.downloads_per_tenant = 1;
    })
    .await;
    // Larger than what the kernel buffers between a client that does not read and the
    // server, so the first download stays in progress.
    let line = format!("{{\"text\":\"{}\"}}", "a".repeat(1 << 20));
    let big = vec![line; 24].join("\n");
    let file = upload(&s, &s.acme, &big).await;
    let path = format!("/v1/files/{file}/content");
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut slow = socket.connect(s.addr).await.unwrap();
    slow.write_all(
        format!(
            "GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n\r\n",
            s.acme
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut buf = [0u8; 16];
    tokio::time::timeout(PATIENCE, slow.read_exact(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert!(buf.starts_with(b"HTTP/1.1 200"));
    let (mut conn, head) = open(&s, &s.acme, &path, "").await;
    assert_refused(&mut conn, &head, "too_many_downloads").await;
    // Another tenant is not held up by it.
    let other = upload(&s, &s.other, &examples(2)).await;
    let answer = s
        .get_as(&s.other, &format!("/v1/files/{other}/content"))
        .await;
    assert_eq!(answer.status(), StatusCode::OK);
    // Once the slow client is gone, its slot comes back.
    drop(slow);
    for _ in 0..100 {
        if s.state.holds.held() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let answer = s.get_as(&s.acme, &path).await;
    assert_eq!(answer.status(), StatusCode::OK);
    assert_eq!(answer.bytes().await.unwrap().len(), big.len());
}
