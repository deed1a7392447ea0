//! Base models and adapters made local folders: a model at `s3://` or `gs://` is
//! downloaded into a cache once (unchanged objects are not fetched again); a local one
//! is used where it is. Adapters bring only their two files, not the checkpoints or
//! optimiser state stored beside them. The trainer's staging is reused, so a model is
//! read the same way for training and for serving.
//!
//! An adapter's objects never change once its job or checkpoint is done, so a staged
//! adapter is used again without asking the store; the cache keeps the
//! `max_adapters` used most recently and deletes the others' folders, so a server that
//! answers for many fine-tuned models does not fill its disk.

use crate::error::{Result, ServeError};
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use tuneq_trainer::remote::Storage;

/// Stages models into local folders (blocking: call it off the async threads).
#[derive(Debug)]
pub struct Staging {
    /// Always set; taken only by `drop`.
    storage: Option<Storage>,
    /// Where remote inputs are downloaded (nothing outside it is ever deleted).
    downloads: PathBuf,
    /// Remote adapters on disk, the most recently used last.
    adapters: Mutex<VecDeque<(String, PathBuf)>>,
    /// Remote adapters kept on disk at most.
    max_adapters: usize,
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
    /// Staging with the object stores' settings, into `cache`, keeping at most
    /// `max_adapters` remote adapters on disk.
    pub fn new(
        config: tuneq_storage::StorageConfig,
        cache: PathBuf,
        max_adapters: usize,
    ) -> Result<Self> {
        Ok(Self {
            downloads: cache.join(Storage::INPUTS),
            storage: Some(
                Storage::new(config, cache).map_err(|e| ServeError::Load(e.to_string()))?,
            ),
            adapters: Mutex::new(VecDeque::new()),
            max_adapters: max_adapters.max(1),
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

    /// A local folder holding the PEFT adapter at `uri`: staged before (and still on
    /// disk), or downloaded now.
    pub fn adapter(&self, uri: &str) -> Result<PathBuf> {
        if let Some(dir) = self.staged_adapter(uri) {
            return Ok(dir);
        }
        let dir = self
            .storage()?
            .input_adapter("model", uri)
            .map_err(|e| ServeError::Load(e.to_string()))?;
        if dir.starts_with(&self.downloads) {
            self.keep_adapter(uri, &dir);
        }
        Ok(dir)
    }

    /// The folder `uri` was staged into, if it is still whole; marks it used.
    fn staged_adapter(&self, uri: &str) -> Option<PathBuf> {
        let mut staged = self.adapters.lock().unwrap_or_else(PoisonError::into_inner);
        let at = staged.iter().position(|(u, _)| u == uri)?;
        let entry = staged.remove(at)?;
        if !adapter_files_present(&entry.1) {
            return None;
        }
        let dir = entry.1.clone();
        staged.push_back(entry);
        Some(dir)
    }

    /// Records `uri` as staged in `dir`, deleting the folders of the least recently
    /// used adapters past `max_adapters`.
    fn keep_adapter(&self, uri: &str, dir: &Path) {
        let evicted: Vec<PathBuf> = {
            let mut staged = self.adapters.lock().unwrap_or_else(PoisonError::into_inner);
            staged.retain(|(u, _)| u != uri);
            staged.push_back((uri.to_string(), dir.to_path_buf()));
            let past = staged.len().saturating_sub(self.max_adapters);
            staged.drain(..past).map(|(_, dir)| dir).collect()
        };
        for old in evicted {
            tracing::debug!(dir = %old.display(), "an adapter leaves the staging cache");
            if let Err(e) = std::fs::remove_dir_all(&old) {
                tracing::warn!(dir = %old.display(), error = %e, "cannot delete a staged adapter");
            }
        }
    }
}

/// Whether `dir` holds every file of an adapter.
fn adapter_files_present(dir: &Path) -> bool {
    tuneq_storage::layout::ADAPTER_FILES
        .iter()
        .all(|name| dir.join(name).is_file())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tuneq_storage::testing::{TEST_BUCKET, moto, s3_config, unique_prefix};
    use tuneq_storage::{Location, ObjectKey, PutMode, StorageConfig};

    fn config() -> StorageConfig {
        StorageConfig {
            s3: s3_config(moto()),
            ..StorageConfig::default()
        }
    }

    /// Runs `work` against the store at `uri` on a runtime of its own.
    fn with_store<T>(uri: &str, work: impl AsyncFnOnce(&dyn tuneq_storage::ObjectStore) -> T) -> T {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let location = Location::parse(uri).expect("uri");
            let store = tuneq_storage::open(&location, &config())
                .await
                .expect("store");
            work(store.as_ref()).await
        })
    }

    /// An adapter's two files at a fresh prefix of the test bucket; its URI.
    fn upload_adapter(name: &str) -> String {
        let uri = format!("s3://{TEST_BUCKET}/{}", unique_prefix(name));
        with_store(&uri, async |store| {
            for file in tuneq_storage::layout::ADAPTER_FILES {
                let key = ObjectKey::root().join(file).expect("key");
                let body = bytes::Bytes::from(format!("{name}/{file}"));
                store
                    .put(&key, body, PutMode::Overwrite)
                    .await
                    .expect("put");
            }
        });
        uri
    }

    fn delete_adapter(uri: &str) {
        with_store(uri, async |store| {
            for file in tuneq_storage::layout::ADAPTER_FILES {
                let key = ObjectKey::root().join(file).expect("key");
                store.delete(&key).await.expect("delete");
            }
        });
    }

    #[test]
    fn staged_adapters_are_reused_and_the_least_recent_past_the_bound_deleted() {
        let cache = tempfile::tempdir().expect("cache");
        let staging = Staging::new(config(), cache.path().to_path_buf(), 2).expect("staging");
        let [a, b, c] = ["a", "b", "c"].map(upload_adapter);
        let dir_a = staging.adapter(&a).expect("a");
        let content = std::fs::read_to_string(dir_a.join("adapter_config.json")).expect("file");
        assert_eq!(content, "a/adapter_config.json");
        let dir_b = staging.adapter(&b).expect("b");

        // Staged once, an adapter is used again without asking the store.
        delete_adapter(&a);
        assert_eq!(staging.adapter(&a).expect("a from the cache"), dir_a);

        // A third adapter past the bound of two: b, used least recently, is deleted.
        let dir_c = staging.adapter(&c).expect("c");
        assert!(dir_a.is_dir() && dir_c.is_dir());
        assert!(
            !dir_b.exists(),
            "the least recently used adapter stays on disk"
        );
        // And staged again from the store when asked for.
        assert_eq!(staging.adapter(&b).expect("b again"), dir_b);
        assert!(dir_b.join("adapter_model.safetensors").is_file());
        assert!(!dir_a.exists(), "a is now the least recently used");
    }

    #[test]
    fn a_local_adapter_is_used_where_it_is_and_never_deleted() {
        let cache = tempfile::tempdir().expect("cache");
        let staging = Staging::new(config(), cache.path().to_path_buf(), 1).expect("staging");
        let local = tempfile::tempdir().expect("local adapter");
        let path = local.path().to_str().expect("utf-8").to_string();
        assert_eq!(staging.adapter(&path).expect("local"), local.path());
        staging.adapter(&upload_adapter("remote")).expect("remote");
        staging
            .adapter(&upload_adapter("another"))
            .expect("another");
        assert!(local.path().is_dir());
    }
}
