//! A test server: the real `tuneq_api::serve` on a free loopback port, with the embedded
//! queue and a local object store in a temp dir, two tenants with a key each, an admin
//! key, and a base model whose folder holds a real `config.json` (no weights: creating
//! a job reads only the shape).

#![allow(clippy::unwrap_used, dead_code)]

use std::sync::Arc;
use tuneq_api::records::model::{self, BaseModel};
use tuneq_api::records::tenant;
use tuneq_api::{ApiConfig, AppState};
use tuneq_queue::{AttemptSigner, JobQueue, Queue, QueueConfig};
use tuneq_storage::{LocalStore, ObjectStore};

/// The admin key every test server takes.
pub const ADMIN_KEY: &str = "admin-key-for-tests-0123456789-abcdef";

/// The secret the test servers sign attempt credentials with, so a test can act as a
/// dispatcher (see [`Server::signer`]).
pub const ATTEMPT_SECRET: &[u8] = b"test secret for attempt credentials";

/// A running test server.
pub struct Server {
    pub url: String,
    pub addr: std::net::SocketAddr,
    pub state: AppState,
    /// The server's queue (the same as `state.queue`), to act as a dispatcher would.
    pub queue: Queue,
    /// Signs attempt credentials the server accepts.
    pub signer: AttemptSigner,
    pub acme: String,
    pub other: String,
    pub dir: tempfile::TempDir,
    pub handle: actix_web::dev::ServerHandle,
}

/// A server with the default settings changed by `configure`.
pub async fn start(configure: impl FnOnce(&mut ApiConfig)) -> Server {
    start_with_store(None, configure).await
}

/// A server whose objects live in `store` (default: a folder of its temp dir), with the
/// default settings changed by `configure`.
pub async fn start_with_store(
    store: Option<Arc<dyn ObjectStore>>,
    configure: impl FnOnce(&mut ApiConfig),
) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let queue = Queue::open_embedded(
        &dir.path().join("queue.db"),
        "tuneq",
        QueueConfig::default(),
    )
    .await
    .unwrap();
    queue.set_pool("local", 1).await.unwrap();
    let spool = dir.path().join("spool");
    std::fs::create_dir_all(&spool).unwrap();
    let signer = AttemptSigner::new(ATTEMPT_SECRET.to_vec());
    let mut config = ApiConfig {
        spool_dir: spool,
        admin_key_hash: Some(tenant::key_hash(ADMIN_KEY)),
        pools: Arc::new(tuneq_pools::PoolsFile::local(None)),
        attempt_signer: signer.clone(),
        ..ApiConfig::default()
    };
    configure(&mut config);
    let store = store.unwrap_or_else(|| Arc::new(LocalStore::new(dir.path().join("objects"))));
    let state = AppState::new(queue.clone(), store, config);
    tenant::create_tenant(&state.queue, "acme", "Acme")
        .await
        .unwrap();
    tenant::create_tenant(&state.queue, "other", "Other")
        .await
        .unwrap();
    let acme = tenant::add_key(&state.queue, "acme", None).await.unwrap();
    let other = tenant::add_key(&state.queue, "other", None).await.unwrap();
    register_model(&state, dir.path(), "base", 1e-3, small_shape(256)).await;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tuneq_api::serve(listener, state.clone(), Some(2)).unwrap();
    let handle = server.handle();
    tokio::spawn(server);
    Server {
        url: format!("http://{addr}"),
        addr,
        state,
        queue,
        signer,
        acme,
        other,
        dir,
        handle,
    }
}

impl Server {
    /// A request for `path` on this server, as the holder of `key`.
    pub fn request(
        &self,
        method: reqwest::Method,
        key: &str,
        path: &str,
    ) -> reqwest::RequestBuilder {
        reqwest::Client::new()
            .request(method, format!("{}{path}", self.url))
            .bearer_auth(key)
    }

    /// `GET path` as the holder of `key`.
    pub async fn get_as(&self, key: &str, path: &str) -> reqwest::Response {
        send(self.request(reqwest::Method::GET, key, path)).await
    }

    /// `GET path` without a key.
    pub async fn get_without_key(&self, path: &str) -> reqwest::Response {
        send(reqwest::Client::new().get(format!("{}{path}", self.url))).await
    }

    /// `GET path` as the holder of `key`, answered as JSON.
    pub async fn json_as(&self, key: &str, path: &str) -> serde_json::Value {
        self.get_as(key, path).await.json().await.unwrap()
    }

    /// `POST path` without a body, as the holder of `key`.
    pub async fn post_as(&self, key: &str, path: &str) -> reqwest::Response {
        send(self.request(reqwest::Method::POST, key, path)).await
    }

    /// `DELETE path` as the holder of `key`.
    pub async fn delete_as(&self, key: &str, path: &str) -> reqwest::Response {
        send(self.request(reqwest::Method::DELETE, key, path)).await
    }

    /// `POST path` with the JSON `body`, as the holder of `key`.
    pub async fn post_json(
        &self,
        key: &str,
        path: &str,
        body: &serde_json::Value,
    ) -> reqwest::Response {
        send(self.request(reqwest::Method::POST, key, path).json(body)).await
    }

    /// `PUT path` with the JSON `body`, as the holder of `key`.
    pub async fn put_json(
        &self,
        key: &str,
        path: &str,
        body: &serde_json::Value,
    ) -> reqwest::Response {
        send(self.request(reqwest::Method::PUT, key, path).json(body)).await
    }

    /// `POST path` with the multipart `form`, as the holder of `key`.
    pub async fn post_form(
        &self,
        key: &str,
        path: &str,
        form: reqwest::multipart::Form,
    ) -> reqwest::Response {
        send(
            self.request(reqwest::Method::POST, key, path)
                .multipart(form),
        )
        .await
    }

    /// `POST path` with `body` as it is, as the holder of `key`.
    pub async fn post_body(
        &self,
        key: &str,
        path: &str,
        body: impl Into<reqwest::Body>,
    ) -> reqwest::Response {
        send(self.request(reqwest::Method::POST, key, path).body(body)).await
    }
}

/// Sends `request`; its answer, whatever the status.
pub async fn send(request: reqwest::RequestBuilder) -> reqwest::Response {
    request.send().await.unwrap()
}

/// Sends `request` and reads its answer as JSON.
pub async fn json_of(request: reqwest::RequestBuilder) -> serde_json::Value {
    send(request).await.json().await.unwrap()
}

/// The shape of a small Llama (two layers of width 64) with `vocab_size` tokens, as
/// [`register_model`] takes it.
pub fn small_shape(vocab_size: u64) -> serde_json::Value {
    serde_json::json!({
        "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": vocab_size,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-5
    })
}

/// Registers base model `id`: a Llama `config.json` with `shape`'s fields under
/// `dir/models/{id}` (nothing here reads weights).
pub async fn register_model(
    state: &AppState,
    dir: &std::path::Path,
    id: &str,
    base_learning_rate: f64,
    shape: serde_json::Value,
) {
    let model = dir.join("models").join(id);
    std::fs::create_dir_all(&model).unwrap();
    let mut config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama"
    });
    config
        .as_object_mut()
        .unwrap()
        .extend(shape.as_object().unwrap().clone());
    std::fs::write(model.join("config.json"), config.to_string()).unwrap();
    model::register(
        &state.queue,
        &BaseModel::new(id, &model.display().to_string(), base_learning_rate),
    )
    .await
    .unwrap();
}

/// Uploads `body` as a raw-body dataset for the tenant of `key`; the file's id.
pub async fn upload(s: &Server, key: &str, body: &str) -> String {
    let response = s
        .post_body(key, "/v1/files?filename=d.jsonl", body.to_string())
        .await;
    assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
    let file: serde_json::Value = response.json().await.unwrap();
    file["id"].as_str().unwrap().to_string()
}

/// Creates a fine-tune of `base` on `file` for the tenant `acme`, with `extra` fields
/// merged into the request; the status and the answer.
pub async fn create(
    s: &Server,
    file: &str,
    extra: serde_json::Value,
) -> (reqwest::StatusCode, serde_json::Value) {
    let mut request = serde_json::json!({"model": "base", "training_file": file});
    for (k, v) in extra.as_object().unwrap() {
        request[k] = v.clone();
    }
    let response = s.post_json(&s.acme, "/v1/fine_tuning/jobs", &request).await;
    (response.status(), response.json().await.unwrap())
}

/// `GET url` with `key`, from `http` (which may call from an address of its own).
pub async fn get(
    http: &reqwest::Client,
    url: String,
    key: impl std::fmt::Display,
) -> reqwest::Response {
    http.get(url).bearer_auth(key).send().await.unwrap()
}

/// `GET path` as the tenant `acme`, answered as JSON.
pub async fn get_json(s: &Server, path: &str) -> serde_json::Value {
    s.json_as(&s.acme, path).await
}

/// Claims the next job of pool `local` as a dispatcher would: the lease, and the
/// credential its attempt is started with.
pub async fn claim(s: &Server) -> (tuneq_queue::Lease, String) {
    let lease = s
        .queue
        .claim_started("local", "test", "")
        .await
        .unwrap()
        .unwrap();
    let credential = s.signer.sign(&lease.id, lease.token);
    (lease, credential)
}

/// Preempts `lease`'s attempt as a spot node taken away would.
pub async fn reclaim(s: &Server, lease: &tuneq_queue::Lease) {
    stop_attempt(
        s,
        lease,
        tuneq_openapi::StopCause::Preemption,
        "spot reclaimed",
    )
    .await;
}

/// Reports `lease`'s attempt stopped before its end, by `cause`, as its dispatcher does.
pub async fn stop_attempt(
    s: &Server,
    lease: &tuneq_queue::Lease,
    cause: tuneq_openapi::StopCause,
    reason: &str,
) {
    s.queue
        .preempt(&lease.id, lease.token, cause, reason)
        .await
        .unwrap();
}

/// `n` prompt/completion examples.
pub fn examples(n: usize) -> String {
    (0..n)
        .map(|i| format!(r#"{{"prompt":"p{i}","completion":"c{i}"}}"#))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Reads one HTTP request off `stream`: its head (request line and headers, as text)
/// and its `content-length` body; None when the connection closes before a whole head
/// or the head is not text (a TLS hello, say).
pub async fn read_request(stream: &mut tokio::net::TcpStream) -> Option<(String, Vec<u8>)> {
    use tokio::io::AsyncReadExt;
    let mut data = Vec::new();
    let mut buf = [0u8; 8192];
    let head_end = loop {
        let n = stream.read(&mut buf).await.ok()?;
        if n == 0 {
            return None;
        }
        data.extend_from_slice(&buf[..n]);
        if let Some(i) = data.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8(data[..head_end].to_vec()).ok()?;
    let length = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(name, _)| name.trim().eq_ignore_ascii_case("content-length"))
        .map_or(0, |(_, v)| v.trim().parse::<usize>().unwrap_or(0));
    while data.len() < head_end + length {
        let n = stream.read(&mut buf).await.ok()?;
        if n == 0 {
            break;
        }
        data.extend_from_slice(&buf[..n]);
    }
    let body = data.split_off(head_end);
    Some((head, body))
}

/// Sends `head` (request line and headers, CRLF-terminated, with the blank line) and
/// then `body` over a raw TCP connection, and returns what the server answers within
/// `wait` (empty when it answered nothing).
pub async fn raw(s: &Server, head: &str, body: &[u8], wait: std::time::Duration) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(body).await.unwrap();
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Err(_) => break,
            Ok(Ok(n)) => {
                answer.extend_from_slice(&buf[..n]);
                // One answer is enough.
                if answer.windows(4).any(|w| w == b"\r\n\r\n") {
                    let text = String::from_utf8_lossy(&answer);
                    let length = text.lines().find_map(|l| {
                        l.to_ascii_lowercase()
                            .strip_prefix("content-length:")
                            .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                    });
                    let head_end = text.find("\r\n\r\n").unwrap() + 4;
                    if length.is_some_and(|n| answer.len() >= head_end + n) {
                        break;
                    }
                }
            }
            Ok(Err(_)) => break,
        }
    }
    String::from_utf8_lossy(&answer).into_owned()
}
