//! What the test modules share.

use std::path::Path;
use tuneq_queue::{Queue, QueueConfig};

/// The embedded queue of domain `tuneq` in `dir`.
pub async fn embedded_queue(dir: &Path, config: QueueConfig) -> Queue {
    Queue::open_embedded(&dir.join("queue.db"), "tuneq", config)
        .await
        .unwrap()
}
