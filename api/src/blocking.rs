//! Work that blocks (reading model files, generating tokens) on tokio's blocking pool,
//! so that it never holds up the threads that serve requests.

use crate::error::{ApiError, ApiResult};

/// Runs `work` on the blocking pool; a panic there is a 500 whose log names `what`.
pub(crate) async fn run<T: Send + 'static>(
    what: &'static str,
    work: impl FnOnce() -> T + Send + 'static,
) -> ApiResult<T> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ApiError::internal(format!("{what}: {e}")))
}
