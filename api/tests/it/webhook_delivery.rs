//! Webhook delivery as README promises it, over real HTTP to a receiver on loopback: a
//! 410 stops delivery at once, a redirect is never followed, the SSRF guard is applied
//! again at every try (a target accepted under one policy is refused by a process with
//! the strict one, and nothing reaches the receiver), and a receiver that keeps failing
//! is retried on the documented schedule and then given up (`failed`).
//!
//! The service's settle loop is stood in for by calling [`settle`] directly, and the
//! retry schedule is walked with the queue's movable clock (`Queue::advance_clock`),
//! so nothing waits for real time.

#![allow(clippy::unwrap_used, missing_docs)]

use crate::support;

use serde_json::{Value, json};
use std::sync::{Arc, Mutex};
use support::{Server, examples, start, upload};
use tokio::io::AsyncWriteExt;
use tuneq_api::AppState;
use tuneq_api::webhooks::settle;

/// README: "non-2xx is retried after 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 14 h, 20 h,
/// 24 h", then given up.
const SCHEDULE_S: [u64; 9] = [5, 300, 1800, 7200, 18000, 36000, 50400, 72000, 86400];

/// A plain-HTTP receiver on loopback that answers each request with what `answer`
/// makes of its path, and keeps every connection and request line it saw.
struct Receiver {
    port: u16,
    /// Connections accepted (a try that reaches the receiver at all makes one).
    connections: Arc<Mutex<usize>>,
    /// `METHOD /path` of every request read.
    requests: Arc<Mutex<Vec<String>>>,
}

impl Receiver {
    async fn start(answer: fn(&str) -> String) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let connections = Arc::new(Mutex::new(0));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let (c, r) = (connections.clone(), requests.clone());
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                *c.lock().unwrap() += 1;
                let r = r.clone();
                tokio::spawn(async move {
                    let Some(line) = read_request(&mut stream).await else {
                        return;
                    };
                    let path = line.split(' ').nth(1).unwrap_or("").to_string();
                    r.lock().unwrap().push(line);
                    let _ = stream.write_all(answer(&path).as_bytes()).await;
                    let _ = stream.shutdown().await;
                });
            }
        });
        Self {
            port,
            connections,
            requests,
        }
    }

    fn requests(&self) -> Vec<String> {
        self.requests.lock().unwrap().clone()
    }

    fn connections(&self) -> usize {
        *self.connections.lock().unwrap()
    }
}

/// Reads one request (head and `content-length` body); its request line without the
/// HTTP version, or None when the connection was not HTTP (a TLS hello, say).
async fn read_request(stream: &mut tokio::net::TcpStream) -> Option<String> {
    let (head, _) = support::read_request(stream).await?;
    let line = head.lines().next()?;
    Some(line.rsplit_once(' ').map_or(line, |(l, _)| l).to_string())
}

fn status(code: u16) -> String {
    format!("HTTP/1.1 {code} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
}

/// A server whose webhook targets may be on loopback over plain HTTP.
async fn open_server() -> Server {
    start(|c| c.webhooks.allow_private = true).await
}

/// A fine-tune of tenant `acme` with `webhook_url`, cancelled at once so that it has
/// finished and its event is due; the job's id.
async fn finished_job_with_webhook(s: &Server, webhook_url: &str) -> String {
    let file = upload(s, &s.acme, &examples(8)).await;
    let (code, job) = support::create(s, &file, json!({"webhook_url": webhook_url})).await;
    assert_eq!(code, 200, "{job}");
    let id = job["id"].as_str().unwrap().to_string();
    let response = s
        .post_as(&s.acme, &format!("/v1/fine_tuning/jobs/{id}/cancel"))
        .await;
    assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
    id
}

/// The job's `webhook` as the API at `s` shows it.
async fn webhook_of(s: &Server, id: &str) -> Value {
    webhook_at(&s.url, &s.acme, id).await
}

/// The job's `webhook` as the API at `url` shows it to the tenant of `key`.
async fn webhook_at(url: &str, key: &str, id: &str) -> Value {
    let job: Value = support::json_of(
        reqwest::Client::new()
            .get(format!("{url}/v1/fine_tuning/jobs/{id}"))
            .bearer_auth(key),
    )
    .await;
    job["webhook"].clone()
}

/// One round of the service's settle loop, by the API process `state`.
async fn settle_now(state: &AppState) {
    settle(state, 100).await.unwrap();
}

#[tokio::test]
async fn a_410_stops_delivery_at_once() {
    let s = open_server().await;
    let receiver = Receiver::start(|_| status(410)).await;
    let url = format!("http://127.0.0.1:{}/hook", receiver.port);
    let id = finished_job_with_webhook(&s, &url).await;

    settle_now(&s.state).await;
    assert_eq!(receiver.requests(), ["POST /hook"]);
    let webhook = webhook_of(&s, &id).await;
    assert_eq!(webhook["status"], "failed", "{webhook}");
    assert_eq!(webhook["attempts"], 1, "{webhook}");
    assert!(
        webhook["last_error"].as_str().unwrap().contains("410"),
        "{webhook}"
    );

    // Past every retry the schedule has: no second try.
    s.state
        .queue
        .advance_clock(SCHEDULE_S.iter().sum::<u64>() * 1000 + 1000)
        .await
        .unwrap();
    settle_now(&s.state).await;
    assert_eq!(receiver.requests().len(), 1, "tried again after a 410");
    assert_eq!(webhook_of(&s, &id).await["attempts"], 1);
}

#[tokio::test]
async fn redirects_are_never_followed() {
    let s = open_server().await;
    // `/hook` redirects to `/elsewhere`, which would accept the event.
    let receiver = Receiver::start(|path| match path {
        "/hook" => "HTTP/1.1 307 Temporary Redirect\r\nlocation: /elsewhere\r\n\
                    content-length: 0\r\nconnection: close\r\n\r\n"
            .to_string(),
        _ => status(200),
    })
    .await;
    let url = format!("http://127.0.0.1:{}/hook", receiver.port);
    let id = finished_job_with_webhook(&s, &url).await;

    settle_now(&s.state).await;
    assert_eq!(
        receiver.requests(),
        ["POST /hook"],
        "the redirect was followed"
    );
    let webhook = webhook_of(&s, &id).await;
    assert_eq!(
        webhook["status"], "retrying",
        "a redirect is a failed try: {webhook}"
    );
    assert!(
        webhook["last_error"].as_str().unwrap().contains("307"),
        "{webhook}"
    );

    // The retry is sent to the URL the job was given, and again not redirected.
    s.state.queue.advance_clock(5_000).await.unwrap();
    settle_now(&s.state).await;
    assert_eq!(receiver.requests(), ["POST /hook", "POST /hook"]);
    assert_eq!(webhook_of(&s, &id).await["attempts"], 2);
}

#[tokio::test]
async fn the_ssrf_guard_is_applied_again_at_every_try() {
    let s = open_server().await;
    let receiver = Receiver::start(|_| status(503)).await;
    // Accepted at create by a server that allows private targets; the first try, by
    // that server, reaches the receiver and fails.
    let url = format!("http://127.0.0.1:{}/hook", receiver.port);
    let id = finished_job_with_webhook(&s, &url).await;
    settle_now(&s.state).await;
    assert_eq!(receiver.requests(), ["POST /hook"]);
    assert_eq!(webhook_of(&s, &id).await["status"], "retrying");

    // Another API process over the same queue and store, with the default (strict)
    // policy, makes the next try: the target is refused before anything is sent.
    let mut config = s.state.config.clone();
    config.webhooks.allow_private = false;
    let strict = AppState::new(s.state.queue.clone(), s.state.store.clone(), config);
    // It serves HTTP too: each process keeps its own copy of the records it read, so
    // the job is read from the process that made the try.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let strict_url = format!("http://{}", listener.local_addr().unwrap());
    let strict_server = tuneq_api::serve(listener, strict.clone(), Some(1)).unwrap();
    let _strict_handle = strict_server.handle();
    tokio::spawn(strict_server);
    s.state.queue.advance_clock(5_000).await.unwrap();
    settle_now(&strict).await;
    assert_eq!(
        receiver.connections(),
        1,
        "the strict process connected to a loopback target"
    );
    let webhook = webhook_at(&strict_url, &s.acme, &id).await;
    assert_eq!(webhook["status"], "failed", "{webhook}");
    assert_eq!(webhook["attempts"], 2, "{webhook}");
    let why = webhook["last_error"].as_str().unwrap();
    assert!(why.contains("https"), "the refusal says why: {why}");

    // The same for an https target at a loopback address: refused for its address.
    let id =
        finished_job_with_webhook(&s, &format!("https://127.0.0.1:{}/hook", receiver.port)).await;
    settle_now(&strict).await;
    assert_eq!(
        receiver.connections(),
        1,
        "a loopback address was connected to"
    );
    let webhook = webhook_at(&strict_url, &s.acme, &id).await;
    assert_eq!(webhook["status"], "failed", "{webhook}");
    let why = webhook["last_error"].as_str().unwrap();
    assert!(
        why.contains("127.0.0.1") && why.contains("not a public address"),
        "the refusal says why: {why}"
    );
}

#[tokio::test]
async fn a_failing_receiver_is_retried_on_the_schedule_then_given_up() {
    let s = open_server().await;
    let receiver = Receiver::start(|_| status(500)).await;
    let url = format!("http://127.0.0.1:{}/hook", receiver.port);
    let id = finished_job_with_webhook(&s, &url).await;

    settle_now(&s.state).await;
    assert_eq!(receiver.requests().len(), 1, "the first try is at once");
    for (i, delay_s) in SCHEDULE_S.iter().enumerate() {
        let tries = i + 1;
        let webhook = webhook_of(&s, &id).await;
        assert_eq!(
            webhook["status"], "retrying",
            "after try {tries}: {webhook}"
        );
        assert_eq!(webhook["attempts"], tries, "{webhook}");
        assert!(
            webhook["last_error"].as_str().unwrap().contains("500"),
            "{webhook}"
        );
        // Not before it is due: half-way through the wait nothing is sent. (The 5 s
        // wait is left out: real time passes too, and half of it is no margin.)
        let early_ms = if *delay_s > 5 { delay_s * 1000 / 2 } else { 0 };
        if early_ms > 0 {
            s.state.queue.advance_clock(early_ms).await.unwrap();
            settle_now(&s.state).await;
            assert_eq!(
                receiver.requests().len(),
                tries,
                "try {} was sent {early_ms} ms early",
                tries + 1
            );
        }
        // Once due, it is sent.
        s.state
            .queue
            .advance_clock(delay_s * 1000 - early_ms)
            .await
            .unwrap();
        settle_now(&s.state).await;
        assert_eq!(
            receiver.requests().len(),
            tries + 1,
            "try {} was not sent {delay_s} s after try {tries}",
            tries + 1
        );
    }
    let webhook = webhook_of(&s, &id).await;
    assert_eq!(webhook["status"], "failed", "{webhook}");
    assert_eq!(webhook["attempts"], SCHEDULE_S.len() + 1, "{webhook}");
    assert!(webhook["delivered_at"].is_null(), "{webhook}");

    // Given up: a week later nothing more is sent.
    s.state
        .queue
        .advance_clock(7 * 24 * 3600 * 1000)
        .await
        .unwrap();
    settle_now(&s.state).await;
    assert_eq!(receiver.requests().len(), SCHEDULE_S.len() + 1);
}
