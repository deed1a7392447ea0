//! Hashing a registered local folder's weights after its registration has answered.
//!
//! Reading every weight takes about a minute for 14 GB and ten for a 70B model: longer
//! than a proxy in front of the API waits for an answer (an ingress gives up after 60 s),
//! and a registration that answered only then would be dropped with the request. So
//! `POST /admin/models` registers a checked folder at once, and its weights are hashed
//! here, one folder at a time, the hash recorded only while the model is still
//! registered at that folder. Until then its jobs' trainers hash the folder themselves
//! (as for a folder in a store), so nothing waits on it.

use crate::records;
use std::path::PathBuf;
use tokio::sync::Semaphore;
use tuneq_queue::Queue;

/// Folders hashed at once: one, so that registrations of many models read the disk in
/// turn rather than all together.
static HASHING: Semaphore = Semaphore::const_new(1);

/// Hashes the folder `location` of base model `id` in the background and records the
/// hash while `id` is still registered there.
pub(super) fn hash_in_background(queue: Queue, id: String, location: String) {
    tokio::spawn(async move {
        let Ok(_turn) = HASHING.acquire().await else {
            return;
        };
        // Registered again elsewhere, or removed, while it waited: nothing to hash.
        match records::model::get(&queue, &id).await {
            Ok(Some(model)) if model.location == location && model.identity.is_none() => {}
            _ => return,
        }
        let path = PathBuf::from(&location);
        let hash = move || super::inspect::identity(&path, None);
        let identity = match crate::blocking::run("the model weights' hash", hash).await {
            Ok(Ok(identity)) => identity,
            Ok(Err(e)) | Err(e) => {
                tracing::warn!(model = %id, folder = %location, why = %e.detail.message, "the model's weights could not be hashed; its trainers hash them");
                return;
            }
        };
        match records::model::record_identity(&queue, &id, &location, &identity).await {
            Ok(true) => tracing::info!(model = %id, "model weights' hash recorded"),
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(model = %id, error = %e.detail.message, "the model weights' hash could not be recorded; its trainers hash them");
            }
        }
    });
}
