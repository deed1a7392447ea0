//! A TCP proxy between a client and redis-server that can lose or delay a reply, so
//! tests can produce the *unknown outcome* the queue must survive: the command ran on
//! the server, but the client never heard back.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What happens to the next reply that comes back from the server.
const PASS: u64 = 0;
const LOSE: u64 = u64::MAX;

/// A proxy on a free loopback port in front of one redis-server.
#[derive(Debug)]
pub struct FaultProxy {
    /// `redis://127.0.0.1:PORT/`, to give the client instead of the server's URL.
    pub url: String,
    /// PASS, LOSE, or a delay in ms before the reply is dropped with its connection.
    next_reply: Arc<AtomicU64>,
    /// Client connections accepted so far.
    connections: Arc<AtomicU64>,
    accept: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Starts forwarding to the server at `redis_url` (`redis://host:port/...`).
    pub async fn start(redis_url: &str) -> Self {
        let upstream = redis_url
            .trim_start_matches("redis://")
            .trim_end_matches('/')
            .to_string();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("redis://{}/", listener.local_addr().unwrap());
        let next_reply = Arc::new(AtomicU64::new(PASS));
        let fault = Arc::clone(&next_reply);
        let connections = Arc::new(AtomicU64::new(0));
        let accepted = Arc::clone(&connections);
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                accepted.fetch_add(1, Ordering::SeqCst);
                let Ok(server) = TcpStream::connect(&upstream).await else {
                    continue;
                };
                tokio::spawn(relay(client, server, Arc::clone(&fault)));
            }
        });
        Self {
            url,
            next_reply,
            connections,
            accept,
        }
    }

    /// The next reply is thrown away and its connection cut: the command ran, the
    /// client never learns how it went.
    pub fn lose_next_reply(&self) {
        self.next_reply.store(LOSE, Ordering::SeqCst);
    }

    /// The next reply is held for `delay` (longer than the client's timeout, to make a
    /// timeout), then thrown away with its connection.
    pub fn stall_next_reply(&self, delay: Duration) {
        let ms = u64::try_from(delay.as_millis()).unwrap_or(LOSE - 1).max(1);
        self.next_reply.store(ms, Ordering::SeqCst);
    }

    /// Client connections accepted so far: a client that retries after a lost or
    /// stalled reply (whose connection the proxy cuts) comes back on a new one.
    pub fn connections(&self) -> u64 {
        self.connections.load(Ordering::SeqCst)
    }

    /// Whether the planted fault has happened yet.
    pub fn fault_pending(&self) -> bool {
        self.next_reply.load(Ordering::SeqCst) != PASS
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Forwards requests as they are; forwards replies unless a fault is planted.
async fn relay(client: TcpStream, server: TcpStream, fault: Arc<AtomicU64>) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let requests = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
    });
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match server_read.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        // A missing script or function did not run (the client loads it and sends the
        // call again): that refusal passes, and the fault waits for a reply to
        // something that ran.
        if buf[..n].starts_with(b"-NOSCRIPT") || buf[..n].starts_with(b"-ERR Function not found") {
            if client_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
            continue;
        }
        match fault.swap(PASS, Ordering::SeqCst) {
            PASS => {
                if client_write.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
            LOSE => break,
            delay_ms => {
                tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                break;
            }
        }
    }
    requests.abort();
}
