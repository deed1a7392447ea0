//! The HTTP API running inside this process, and its orderly stop.

use anyhow::Result;
use std::sync::Arc;

/// The API server, started on its own task.
pub struct RunningApi {
    handle: actix_web::dev::ServerHandle,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
    holds: Arc<tuneq_api::holds::Holds>,
}

impl RunningApi {
    /// Serves `state` on `listener`.
    pub fn start(listener: std::net::TcpListener, state: &tuneq_api::AppState) -> Result<Self> {
        let server = tuneq_api::serve(listener, state.clone(), None)?;
        Ok(Self {
            handle: server.handle(),
            task: tokio::spawn(server),
            holds: state.holds.clone(),
        })
    }

    /// Stops taking requests and waits for those in flight. Open event streams end now
    /// (their clients reconnect elsewhere with Last-Event-ID) instead of holding the
    /// graceful stop to its timeout.
    pub async fn stop(self) {
        self.holds.close();
        self.handle.stop(true).await;
        let _ = self.task.await;
    }
}
