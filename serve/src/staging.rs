//! Base models and adapters made local folders: a model at `s3://` or `gs://` is
//! downloaded into a cache once (unchanged objects are not fetched again); a local one
//! is used where it is. Adapters bring only their two files, not the checkpoints or
//! optimiser state stored beside them. The trainer's staging is reused, so a model is
//! read the same way for training and for serving.

use crate::error::{Result, ServeError};
use std::path::PathBuf;
use tuneq_trainer::remote::Storage;

/// Stages models into local folders (blocking: call it off the async threads).
#[derive(Debug)]
pub struct Staging {
    /// Always set; taken only by `drop`.
    storage: Option<Storage>,
}

impl Drop for Staging {
    /// The store's runtime may not be dropped on an async thread (where a server drops
    /// its state at shutdown): it goes on a thread of its own.
    fn drop(&mut self) {
        if let Some(storage) = self.storage.take() {
            let _ = std::thread::Builder::new()
                .name("tuneq-staging-drop".into())
                .spawn(move || drop(storage));
        }
    }
}

impl Staging {
    /// Staging with the object stores' settings, into `cache`.
    pub fn new(config: tuneq_storage::StorageConfig, cache: PathBuf) -> Result<Self> {
        Ok(Self {
            storage: Some(
                Storage::new(config, cache).map_err(|e| ServeError::Load(e.to_string()))?,
            ),
        })
    }

    fn storage(&self) -> Result<&Storage> {
        self.storage
            .as_ref()
            .ok_or_else(|| ServeError::Load("staging has shut down".into()))
    }

    /// A local folder holding the base model at `location` (a folder or URI).
    pub fn base(&self, location: &str) -> Result<PathBuf> {
        self.storage()?
            .input_dir("model", location)
            .map_err(|e| ServeError::Load(e.to_string()))
    }

    /// A local folder holding the PEFT adapter at `uri`.
    pub fn adapter(&self, uri: &str) -> Result<PathBuf> {
        self.storage()?
            .input_adapter("model", uri)
            .map_err(|e| ServeError::Load(e.to_string()))
    }
}
