//! Two ways to reach the fake: a `tower::Service` that `kube::Client::new` takes (no
//! sockets), and a plain-HTTP server on `127.0.0.1:0` with a kubeconfig pointing at it,
//! for a child process (`KUBECONFIG=…`).

use crate::{Error, FakeCluster, ResponseBody, Result, api};
use bytes::Bytes;
use futures::future::BoxFuture;
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::task::{Context, Poll};
use tokio::task::JoinHandle;

/// The fake as a `tower::Service` over any request body.
#[derive(Clone, Debug)]
pub struct FakeService {
    cluster: FakeCluster,
}

impl<B> tower::Service<Request<B>> for FakeService
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
{
    type Response = Response<ResponseBody>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let cluster = self.cluster.clone();
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            // A body that fails to arrive reads as empty: the handler answers 400 for it.
            let body = body
                .collect()
                .await
                .map(|c| c.to_bytes())
                .unwrap_or_default();
            Ok(api::handle(&cluster, parts, body).await)
        })
    }
}

impl FakeCluster {
    /// The fake as a `tower::Service`.
    pub fn service(&self) -> FakeService {
        FakeService {
            cluster: self.clone(),
        }
    }

    /// A `kube::Client` talking to this cluster in process, default namespace `default`.
    /// Must be called inside a tokio runtime (the client spawns its buffer task).
    pub fn client(&self) -> kube::Client {
        kube::Client::new(self.service(), "default")
    }

    /// Serves the API over plain HTTP/1.1 on `127.0.0.1` at a free port, until the task is
    /// aborted. Returns the address and the accept loop's task.
    pub async fn serve(&self) -> Result<(SocketAddr, JoinHandle<()>)> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(Error::Serve)?;
        let addr = listener.local_addr().map_err(Error::Serve)?;
        let service = self.service();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let svc = hyper_util::service::TowerToHyperService::new(service.clone());
                tokio::spawn(async move {
                    // A client hanging up mid-stream ends its connection only.
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Ok((addr, task))
    }
}

/// A kubeconfig (YAML) whose current context points at `http://<addr>`, namespace
/// `default`, with a dummy token: for a child process run with `KUBECONFIG`.
pub fn kubeconfig(addr: SocketAddr) -> String {
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: tuneq-kube-fake
  cluster:
    server: http://{addr}
contexts:
- name: tuneq-kube-fake
  context:
    cluster: tuneq-kube-fake
    user: tuneq-kube-fake
    namespace: default
current-context: tuneq-kube-fake
users:
- name: tuneq-kube-fake
  user:
    token: tuneq-kube-fake-token
"
    )
}
