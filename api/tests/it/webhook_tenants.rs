//! Webhooks across tenants and requests: a receiver that accepts and never answers
//! delays only its own tenant's webhooks, a sender stopped while tries hang ends within
//! its grace (the hanging deliveries stay queued for the next start), and rotations of a
//! tenant's signing secret made at the same moment hand every caller a secret that
//! signs.
//!
//! Nothing here measures time: a try's timeout is set far beyond the test's length, so
//! "no try of the hanging tenant ended" is a fact about states, not about speed.

#![allow(clippy::unwrap_used, missing_docs)]

use crate::support;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, KeyInit, Mac};
use serde_json::{Value, json};
use sha2::Sha256;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::{Server, examples, start, upload};
use tokio::io::AsyncWriteExt;
use tokio::sync::watch;
use tuneq_api::webhooks::{SendLimits, file_outcomes, sender, settle};
use tuneq_queue::JobQueue;

/// A receiver that accepts every connection and never answers, holding it open.
struct Hanging {
    port: u16,
    accepted: Arc<Mutex<usize>>,
}

impl Hanging {
    async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(Mutex::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                *count.lock().unwrap() += 1;
                held.push(stream);
            }
        });
        Self { port, accepted }
    }

    fn accepted(&self) -> usize {
        *self.accepted.lock().unwrap()
    }
}

/// One request a [`Recording`] receiver answered: its path, headers and body.
#[derive(Clone, Debug)]
struct Seen {
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Seen {
    fn header(&self, name: &str) -> &str {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
            .unwrap()
    }
}

/// A receiver that answers 200 to everything and keeps what it was sent.
struct Recording {
    port: u16,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Recording {
    async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let kept = seen.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let kept = kept.clone();
                tokio::spawn(async move {
                    if let Some(request) = read(&mut stream).await {
                        kept.lock().unwrap().push(request);
                    }
                    let _ = stream
                        .write_all(
                            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                        )
                        .await;
                    let _ = stream.shutdown().await;
                });
            }
        });
        Self { port, seen }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

/// Reads one HTTP request (head and `content-length` body).
async fn read(stream: &mut tokio::net::TcpStream) -> Option<Seen> {
    let (head, body) = support::read_request(stream).await?;
    let mut lines = head.lines();
    let path = lines.next()?.split(' ').nth(1)?.to_string();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Some(Seen {
        path,
        headers,
        body,
    })
}

/// A server whose webhook targets may be on loopback over plain HTTP.
async fn open_server() -> Server {
    start(|c| c.webhooks.allow_private = true).await
}

/// Fine-tunes of the tenant of `key` on `file`, one per webhook URL, each cancelled at
/// once so that it has finished and its event is due; their ids.
async fn finished_jobs(s: &Server, key: &str, file: &str, urls: &[String]) -> Vec<String> {
    let mut ids = Vec::new();
    for url in urls {
        let response = s
            .post_json(
                key,
                "/v1/fine_tuning/jobs",
                &json!({"model": "base", "training_file": file, "webhook_url": url}),
            )
            .await;
        assert_eq!(response.status(), 200);
        let job: Value = response.json().await.unwrap();
        let id = job["id"].as_str().unwrap().to_string();
        let cancelled = s
            .post_as(key, &format!("/v1/fine_tuning/jobs/{id}/cancel"))
            .await;
        assert_eq!(cancelled.status(), 200);
        ids.push(id);
    }
    ids
}

/// The job's `webhook` as the tenant of `key` sees it.
async fn webhook_of(s: &Server, key: &str, id: &str) -> Value {
    let job: Value = s.json_as(key, &format!("/v1/fine_tuning/jobs/{id}")).await;
    job["webhook"].clone()
}

/// How many tries of the jobs `ids` have ended (succeeded or failed).
async fn tries_ended(s: &Server, key: &str, ids: &[String]) -> u64 {
    let mut ended = 0;
    for id in ids {
        ended += webhook_of(s, key, id).await["attempts"]
            .as_u64()
            .unwrap_or(0);
    }
    ended
}

/// Waits (a generous bound: a failure, not a measurement) until `done` holds.
async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..1200 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("never happened: {what}");
}

/// Limits with tries that outlast the test: a hanging try never ends by itself here.
fn patient() -> SendLimits {
    SendLimits {
        try_timeout: Duration::from_secs(3600),
        ..SendLimits::default()
    }
}

/// More hanging deliveries than the previous sender's 16 tries at once, so that under
/// it the other tenant's event waited for a hanging try to time out.
const HANGING: usize = 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_receiver_that_never_answers_delays_only_its_own_tenants_webhooks() {
    let s = open_server().await;
    let hanging = Hanging::start().await;
    let fine = Recording::start().await;
    let acme_file = upload(&s, &s.acme, &examples(8)).await;
    let other_file = upload(&s, &s.other, &examples(8)).await;
    let urls: Vec<String> = (0..HANGING)
        .map(|i| format!("http://127.0.0.1:{}/hang/{i}", hanging.port))
        .collect();
    let slow = finished_jobs(&s, &s.acme, &acme_file, &urls).await;
    let victim = format!("http://127.0.0.1:{}/victim", fine.port);
    let victim = finished_jobs(&s, &s.other, &other_file, &[victim]).await;
    // Every outcome is filed first; the hanging tenant's are the oldest to send.
    file_outcomes(&s.state, 100).await.unwrap();

    let (stop, stopped) = watch::channel(false);
    let running = tokio::spawn(sender::run(s.state.clone(), patient(), async move {
        let mut stopped = stopped;
        let _ = stopped.wait_for(|s| *s).await;
    }));
    eventually("the other tenant's event arrives", || {
        fine.seen().iter().any(|r| r.path == "/victim")
    })
    .await;
    assert_eq!(
        tries_ended(&s, &s.acme, &slow).await,
        0,
        "the other tenant's event waited for a hanging try to end"
    );
    assert!(
        hanging.accepted() <= SendLimits::default().per_endpoint,
        "{} tries at once to one endpoint",
        hanging.accepted()
    );
    let mut status = Value::Null;
    for _ in 0..1200 {
        status = webhook_of(&s, &s.other, &victim[0]).await["status"].clone();
        if status == "delivered" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(status, "delivered");

    stop.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(60), running)
        .await
        .expect("the sender did not stop while tries hung")
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopped_sender_drops_hanging_tries_and_keeps_their_deliveries() {
    let s = open_server().await;
    let hanging = Hanging::start().await;
    let file = upload(&s, &s.acme, &examples(8)).await;
    let urls: Vec<String> = (0..HANGING)
        .map(|i| format!("http://127.0.0.1:{}/hang/{i}", hanging.port))
        .collect();
    let ids = finished_jobs(&s, &s.acme, &file, &urls).await;
    file_outcomes(&s.state, 100).await.unwrap();

    let (stop, stopped) = watch::channel(false);
    let running = tokio::spawn(sender::run(s.state.clone(), patient(), async move {
        let mut stopped = stopped;
        let _ = stopped.wait_for(|s| *s).await;
    }));
    eventually("a try reaches the hanging receiver", || {
        hanging.accepted() > 0
    })
    .await;
    stop.send(true).unwrap();
    // Resolves within the grace, though every try in flight still hangs.
    tokio::time::timeout(Duration::from_secs(60), running)
        .await
        .expect("the sender waited on hanging tries")
        .unwrap();
    assert_eq!(
        tries_ended(&s, &s.acme, &ids).await,
        0,
        "the sender waited for a hanging try to end"
    );
    // None is lost: every delivery still waits in the send queue, due now.
    let queued = s.state.queue.due_sends(10, 100).await.unwrap();
    assert_eq!(queued.len(), HANGING);
}

/// Whether `signatures` (a `webhook-signature` header) hold one by `secret` of `seen`.
fn signed_by(secret: &str, seen: &Seen) -> bool {
    let key = BASE64
        .decode(secret.strip_prefix("whsec_").unwrap())
        .unwrap();
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).unwrap();
    let signed = format!(
        "{}.{}.",
        seen.header("webhook-id"),
        seen.header("webhook-timestamp")
    );
    mac.update(signed.as_bytes());
    mac.update(&seen.body);
    let expected = format!("v1,{}", BASE64.encode(mac.finalize().into_bytes()));
    seen.header("webhook-signature")
        .split(' ')
        .any(|s| s == expected)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rotations_at_the_same_moment_hand_out_only_secrets_that_sign() {
    let s = open_server().await;
    let receiver = Recording::start().await;
    let file = upload(&s, &s.acme, &examples(8)).await;
    let rotate = || async {
        let response = s.post_as(&s.acme, "/webhooks/secret/rotate").await;
        assert_eq!(response.status(), 200);
        let body: Value = response.json().await.unwrap();
        body["secret"].as_str().unwrap().to_string()
    };
    for round in 0..10 {
        let (a, b) = tokio::join!(rotate(), rotate());
        // An event sent now is signed by every secret that signs: each caller's must.
        let url = format!("http://127.0.0.1:{}/round/{round}", receiver.port);
        finished_jobs(&s, &s.acme, &file, &[url]).await;
        settle(&s.state, 100).await.unwrap();
        let path = format!("/round/{round}");
        let seen = receiver.seen();
        let event = seen.iter().find(|r| r.path == path).unwrap();
        for secret in [&a, &b] {
            assert!(
                signed_by(secret, event),
                "round {round}: a caller was handed a secret that does not sign"
            );
        }
    }
}
