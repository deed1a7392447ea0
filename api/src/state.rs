//! What every handler shares: the queue (jobs and the catalog), the object store, and
//! the server's settings.

use std::path::PathBuf;
use std::sync::Arc;
use tuneq_queue::Queue;
use tuneq_storage::ObjectStore;

/// The server's settings.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// Largest accepted upload, in bytes.
    pub max_upload_bytes: u64,
    /// Largest accepted JSON request body, in bytes.
    pub max_json_bytes: usize,
    /// SHA-256 (hex) of the admin key; None disables the admin routes.
    pub admin_key_hash: Option<String>,
    /// Where uploads are spooled while they are validated.
    pub spool_dir: PathBuf,
}

impl Default for ApiConfig {
    fn default() -> Self {
        Self {
            max_upload_bytes: 512 << 20,
            max_json_bytes: 1 << 20,
            admin_key_hash: None,
            spool_dir: std::env::temp_dir(),
        }
    }
}

/// Shared by every request.
#[derive(Debug, Clone)]
pub struct AppState {
    /// Jobs and the catalog.
    pub queue: Queue,
    /// Datasets, checkpoints and adapters.
    pub store: Arc<dyn ObjectStore>,
    /// Settings.
    pub config: ApiConfig,
}
