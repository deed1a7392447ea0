//! Inputs and outputs in object storage.
//!
//! The trainer computes on local files (candle memory-maps weights, checkpoints are
//! written and verified on disk). For `s3://` and `gs://` locations this module stages
//! the base model and datasets into a local cache, and mirrors the output folder back:
//! every checkpoint is uploaded file by file with its `manifest.json` last, and the run's
//! own `manifest.json` goes up after the adapter. A trainer killed mid-upload therefore
//! leaves at most an uncommitted prefix, which resume ignores. On a fresh machine (a
//! replacement spot node), [`Output::restore`] brings back the newest committed
//! checkpoint before training starts.

use crate::error::{Error, Result};
use futures::TryStreamExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tuneq_storage::{Location, ObjectKey, ObjectMeta, ObjectStore, PutMode, StorageConfig};

/// Name of the file that commits a folder (a checkpoint, or the whole run).
const MANIFEST: &str = tuneq_storage::MANIFEST;

/// Opens stores and stages remote inputs into a local cache.
#[derive(Clone)]
pub struct Storage {
    runtime: Arc<tokio::runtime::Runtime>,
    config: StorageConfig,
    cache: PathBuf,
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Storage")
            .field("cache", &self.cache)
            .finish_non_exhaustive()
    }
}

fn spec_error(field: &str, message: impl std::fmt::Display) -> Error {
    Error::Spec(vec![tuneq_openapi::SpecError {
        field: field.into(),
        message: message.to_string(),
    }])
}

/// A short stable name for a URI, used for cache folders.
fn cache_name(uri: &str) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(&Sha256::digest(uri.as_bytes())[..8])
}

/// Splits a remote location into its bucket-root location and the object key it names.
fn bucket_and_key(location: &Location) -> Result<(Location, ObjectKey)> {
    let (root, prefix) = match location {
        Location::S3 { bucket, prefix } => (
            Location::S3 {
                bucket: bucket.clone(),
                prefix: String::new(),
            },
            prefix,
        ),
        Location::Gcs { bucket, prefix } => (
            Location::Gcs {
                bucket: bucket.clone(),
                prefix: String::new(),
            },
            prefix,
        ),
        Location::Local(p) => {
            return Err(Error::Io {
                path: p.display().to_string(),
                source: std::io::Error::other("not a remote location"),
            });
        }
    };
    Ok((root, ObjectKey::parse(prefix)?))
}

impl Storage {
    /// The folder of `cache` that remote inputs are downloaded into.
    pub const INPUTS: &'static str = "inputs";

    /// Storage with `config`; remote inputs and outputs are staged under `cache`.
    pub fn new(config: StorageConfig, cache: PathBuf) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(Error::io("tokio runtime"))?;
        Ok(Self {
            runtime: Arc::new(runtime),
            config,
            cache,
        })
    }

    /// The default cache folder: `$TUNEQ_CACHE_DIR`, else `tuneq-cache` in the temp folder.
    pub fn default_cache_dir() -> PathBuf {
        std::env::var_os(tuneq_openapi::launch::ENV_CACHE_DIR)
            .map(PathBuf::from)
            .unwrap_or_else(|| std::env::temp_dir().join("tuneq-cache"))
    }

    fn parse(field: &str, value: &str) -> Result<Location> {
        Location::parse(value).map_err(|e| spec_error(field, e))
    }

    fn open(&self, location: &Location) -> Result<Arc<dyn ObjectStore>> {
        Ok(self
            .runtime
            .block_on(tuneq_storage::open(location, &self.config))?)
    }

    /// A local folder holding the model at `value` (downloaded if remote; unchanged
    /// objects are not fetched again).
    pub fn input_dir(&self, field: &str, value: &str) -> Result<PathBuf> {
        let location = Self::parse(field, value)?;
        if let Some(p) = location.as_local() {
            return Ok(p.to_path_buf());
        }
        let store = self.open(&location)?;
        let dir = self.cache.join(Self::INPUTS).join(cache_name(value));
        let listed = self
            .runtime
            .block_on(tuneq_storage::transfer::download_dir(
                store.as_ref(),
                &ObjectKey::root(),
                &dir,
            ))?;
        if listed == 0 {
            return Err(spec_error(field, format!("no objects under {value}")));
        }
        Ok(dir)
    }

    /// A local folder holding the PEFT adapter at `value` (its
    /// [`tuneq_storage::layout::ADAPTER_FILES`], downloaded if remote): only those, not
    /// whatever else the folder holds (a job's output keeps its checkpoints beside them,
    /// a checkpoint its optimiser state).
    pub fn input_adapter(&self, field: &str, value: &str) -> Result<PathBuf> {
        let location = Self::parse(field, value)?;
        if let Some(p) = location.as_local() {
            return Ok(p.to_path_buf());
        }
        let store = self.open(&location)?;
        let dir = self.cache.join(Self::INPUTS).join(cache_name(value));
        self.runtime.block_on(async {
            for name in tuneq_storage::layout::ADAPTER_FILES {
                let key = ObjectKey::root().join(name)?;
                tuneq_storage::transfer::download_file(store.as_ref(), &key, &dir.join(name))
                    .await
                    .map_err(|e| match e {
                        tuneq_storage::Error::NotFound { uri } => spec_error(
                            field,
                            format!("no adapter at {value}: {uri} does not exist"),
                        ),
                        other => Error::Storage(other),
                    })?;
            }
            Ok::<_, Error>(())
        })?;
        Ok(dir)
    }

    /// A local file holding the object at `value` (downloaded if remote and changed).
    pub fn input_file(&self, field: &str, value: &str) -> Result<PathBuf> {
        let location = Self::parse(field, value)?;
        if let Some(p) = location.as_local() {
            return Ok(p.to_path_buf());
        }
        let (root, key) = bucket_and_key(&location)?;
        if key.is_root() {
            return Err(spec_error(field, "names a bucket, not a file"));
        }
        let store = self.open(&root)?;
        let dir = self.cache.join(Self::INPUTS).join(cache_name(value));
        let path = dir.join(key.file_name());
        self.runtime.block_on(async {
            let meta = store.head(&key).await.map_err(|e| match e {
                tuneq_storage::Error::NotFound { uri } => {
                    spec_error(field, format!("{uri} does not exist"))
                }
                other => Error::Storage(other),
            })?;
            let tag_file = dir.join(".etag");
            let tag = tuneq_storage::transfer::cache_tag(&meta);
            let cached = std::fs::read_to_string(&tag_file).ok();
            if cached.as_deref() != Some(tag.as_str()) || !path.is_file() {
                tuneq_storage::transfer::download_file(store.as_ref(), &key, &path).await?;
                tuneq_storage::local::write_atomic(&tag_file, tag.as_bytes())?;
            }
            Ok::<_, Error>(())
        })?;
        Ok(path)
    }

    /// The output at `value`: a local folder, or a local work folder mirrored to storage.
    pub fn output(&self, field: &str, value: &str) -> Result<Output> {
        let location = Self::parse(field, value)?;
        if let Some(p) = location.as_local() {
            return Ok(Output {
                local: p.to_path_buf(),
                remote: None,
            });
        }
        let store = self.open(&location)?;
        Ok(Output {
            local: self.cache.join("outputs").join(cache_name(value)),
            remote: Some(Mirror {
                runtime: self.runtime.clone(),
                store,
                uri: value.trim_end_matches('/').to_string(),
            }),
        })
    }
}

/// Where a run writes: always a local folder, plus a remote mirror for s3:// and gs://.
#[derive(Debug)]
pub struct Output {
    /// The folder the trainer writes to.
    pub local: PathBuf,
    remote: Option<Mirror>,
}

struct Mirror {
    runtime: Arc<tokio::runtime::Runtime>,
    store: Arc<dyn ObjectStore>,
    uri: String,
}

impl std::fmt::Debug for Mirror {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mirror").field("uri", &self.uri).finish()
    }
}

fn key(s: &str) -> Result<ObjectKey> {
    Ok(ObjectKey::parse(s)?)
}

/// Committed checkpoint steps under `checkpoints/` of a store, newest first.
async fn committed_steps(store: &dyn ObjectStore) -> Result<Vec<(u64, ObjectKey)>> {
    let root = key(crate::checkpoint::CHECKPOINTS_DIR)?;
    let objects: Vec<ObjectMeta> = store.list(&root).try_collect().await?;
    let mut steps: Vec<(u64, ObjectKey)> = objects
        .iter()
        .filter(|m| m.key.file_name() == MANIFEST)
        .filter_map(|m| {
            let dir = m.key.strip_prefix(&root)?;
            let name = dir.segments().next()?;
            let step = name.strip_prefix("step-")?.parse().ok()?;
            Some((step, root.join(name).ok()?))
        })
        .collect();
    steps.sort_by_key(|s| std::cmp::Reverse(s.0));
    steps.dedup_by_key(|s| s.0);
    Ok(steps)
}

impl Output {
    /// Whether the output lives in object storage.
    pub fn is_remote(&self) -> bool {
        self.remote.is_some()
    }

    /// The location to report for a path inside the output (its URI when remote).
    pub fn display(&self, rel: &str) -> String {
        match &self.remote {
            Some(m) if rel.is_empty() => m.uri.clone(),
            Some(m) => format!("{}/{rel}", m.uri),
            None if rel.is_empty() => self.local.display().to_string(),
            None => self.local.join(rel).display().to_string(),
        }
    }

    /// Brings back what a previous attempt committed remotely: the finished run, or the
    /// newest committed checkpoint and the metrics so far. Local state that is already
    /// as new is kept. Returns a note for each thing restored.
    pub fn restore(&self) -> Result<Vec<String>> {
        let Some(m) = &self.remote else {
            return Ok(Vec::new());
        };
        m.runtime.block_on(async {
            let store = m.store.as_ref();
            let mut notes = Vec::new();
            std::fs::create_dir_all(&self.local).map_err(Error::io(&self.local))?;
            if store.is_committed(&ObjectKey::root()).await? {
                for f in [
                    crate::peft::ADAPTER_CONFIG,
                    crate::peft::ADAPTER_WEIGHTS,
                    "metrics.jsonl",
                    "samples.jsonl",
                    MANIFEST,
                ] {
                    tuneq_storage::transfer::download_file_if_present(
                        store,
                        &key(f)?,
                        &self.local.join(f),
                    )
                    .await?;
                }
                notes.push(format!("restored the finished run from {}", m.uri));
                return Ok(notes);
            }
            let local_steps: Vec<u64> = crate::checkpoint::complete_checkpoints(&self.local)?
                .into_iter()
                .map(|c| c.0)
                .collect();
            let Some((step, prefix)) = committed_steps(store).await?.into_iter().next() else {
                return Ok(notes);
            };
            if local_steps.first().is_some_and(|&s| s >= step) {
                return Ok(notes);
            }
            let dir = self
                .local
                .join(crate::checkpoint::CHECKPOINTS_DIR)
                .join(prefix.file_name());
            let tmp = self
                .local
                .join(crate::checkpoint::CHECKPOINTS_DIR)
                .join(format!(".tmp-restore-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&tmp);
            let objects: Vec<ObjectMeta> = store.list(&prefix).try_collect().await?;
            // The manifest goes last here too: a local checkpoint counts only when complete.
            let (manifests, files): (Vec<_>, Vec<_>) =
                objects.iter().partition(|o| o.key.file_name() == MANIFEST);
            for o in files.iter().chain(manifests.iter()) {
                let Some(rel) = o.key.strip_prefix(&prefix) else {
                    continue;
                };
                let path = rel.segments().fold(tmp.clone(), |p, s| p.join(s));
                tuneq_storage::transfer::download_file(store, &o.key, &path).await?;
            }
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::rename(&tmp, &dir).map_err(Error::io(&dir))?;
            tuneq_storage::transfer::download_file_if_present(
                store,
                &key("metrics.jsonl")?,
                &self.local.join("metrics.jsonl"),
            )
            .await?;
            notes.push(format!(
                "restored checkpoint step {step} from {}/{}",
                m.uri,
                prefix.as_str()
            ));
            Ok(notes)
        })
    }

    /// Uploads a committed local checkpoint (its manifest last), the metrics so far, and
    /// drops remote checkpoints beyond the newest `keep` but the step `protect` (early
    /// stopping's best).
    pub fn push_checkpoint(&self, dir: &Path, keep: usize, protect: Option<u64>) -> Result<()> {
        let Some(m) = &self.remote else {
            return Ok(());
        };
        let name = dir.file_name().and_then(|n| n.to_str()).ok_or_else(|| {
            Error::io(dir)(std::io::Error::other("checkpoint folder has no name"))
        })?;
        let prefix = key(crate::checkpoint::CHECKPOINTS_DIR)?.join(name)?;
        m.runtime.block_on(async {
            let store = m.store.as_ref();
            upload_committed(store, dir, &prefix).await?;
            let metrics = self.local.join("metrics.jsonl");
            if metrics.is_file() {
                tuneq_storage::transfer::upload_file(
                    store,
                    &metrics,
                    &key("metrics.jsonl")?,
                    PutMode::Overwrite,
                )
                .await?;
            }
            let committed = committed_steps(store).await?.into_iter().skip(keep);
            for (_, old) in committed.filter(|(step, _)| Some(*step) != protect) {
                // Manifest first: a half-deleted checkpoint is never taken for a whole one.
                store.delete(&old.join(MANIFEST)?).await?;
                let rest: Vec<ObjectMeta> = store.list(&old).try_collect().await?;
                for o in rest {
                    store.delete(&o.key).await?;
                }
            }
            Ok(())
        })
    }

    /// Uploads the finished run: adapter, samples, metrics, then the run manifest last.
    pub fn push_final(&self) -> Result<()> {
        let Some(m) = &self.remote else {
            return Ok(());
        };
        m.runtime.block_on(async {
            let store = m.store.as_ref();
            for f in [
                crate::peft::ADAPTER_CONFIG,
                crate::peft::ADAPTER_WEIGHTS,
                "samples.jsonl",
                "metrics.jsonl",
                tuneq_storage::layout::RESULTS_CSV,
            ] {
                let path = self.local.join(f);
                if path.is_file() {
                    tuneq_storage::transfer::upload_file(
                        store,
                        &path,
                        &key(f)?,
                        PutMode::Overwrite,
                    )
                    .await?;
                }
            }
            commit_from_file(store, &ObjectKey::root(), &self.local.join(MANIFEST)).await
        })
    }
}

/// Uploads every file of a local folder under `prefix`, then commits the prefix with the
/// folder's `manifest.json` ([`ObjectStore::commit_manifest`]).
async fn upload_committed(store: &dyn ObjectStore, dir: &Path, prefix: &ObjectKey) -> Result<()> {
    for rel in tuneq_storage::transfer::local_files(dir)? {
        if rel == MANIFEST {
            continue;
        }
        let target = prefix.join_key(&ObjectKey::parse(&rel)?);
        tuneq_storage::transfer::upload_file(store, &dir.join(&rel), &target, PutMode::Overwrite)
            .await?;
    }
    commit_from_file(store, prefix, &dir.join(MANIFEST)).await
}

/// Commits `prefix` with the manifest stored in a local file.
async fn commit_from_file(
    store: &dyn ObjectStore,
    prefix: &ObjectKey,
    manifest: &Path,
) -> Result<()> {
    let bytes = tokio::fs::read(manifest)
        .await
        .map_err(Error::io(manifest))?;
    store.commit_manifest(prefix, bytes.into()).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_locations_split_into_bucket_and_key() -> Result<()> {
        let loc = Location::parse("s3://b/tenants/t/files/f/data.jsonl")?;
        let (root, k) = bucket_and_key(&loc)?;
        assert_eq!(root.to_string(), "s3://b/");
        assert_eq!(k.as_str(), "tenants/t/files/f/data.jsonl");
        assert_eq!(k.file_name(), "data.jsonl");
        Ok(())
    }
}
