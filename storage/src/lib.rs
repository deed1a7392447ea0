//! Object storage behind one async interface.
//!
//! Datasets, base models, checkpoints and adapters all live in object storage. Every
//! other crate names places with a [`Location`], opens an [`ObjectStore`] rooted there
//! with [`open`], and reads and writes through it, so none of them cares which
//! backend is behind it.
//!
//! Layout:
//! - [`location`]: parsing `file://`, `s3://`, `gs://` URIs and plain paths into a typed
//!   [`Location`]; object keys are built only from checked segments ([`ObjectKey`]).
//! - [`layout`]: where a tenant's files and a job's checkpoints and adapter live.
//! - [`config`]: which endpoint, region and credentials each backend uses.
//! - [`local`], [`s3`], [`gcs`]: the three backends.
//! - [`transfer`]: whole-file and whole-folder copies between local disk and a store.
//!
//! Every backend streams: a put consumes an async byte stream part by part and a get
//! yields one, so a 200 MiB object never sits in memory.

pub mod config;
pub mod gcs;
pub mod layout;
pub mod local;
pub mod location;
mod retry;
pub mod s3;
#[cfg(feature = "testing")]
pub mod testing;
pub mod transfer;

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::{BoxStream, StreamExt, TryStreamExt};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

pub use config::StorageConfig;
pub use local::LocalStore;
pub use location::{Location, ObjectKey};

/// Name of the object that marks a prefix as complete (see [`ObjectStore::commit_manifest`]).
pub const MANIFEST: &str = "manifest.json";

/// Errors from object storage.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The URI or path could not be parsed.
    #[error("invalid location {input:?}: {reason}")]
    InvalidLocation {
        /// What the user gave.
        input: String,
        /// Why it was refused.
        reason: String,
    },
    /// A key segment was unsafe (empty, `..`, absolute, control characters).
    #[error("invalid object key segment {segment:?}: {reason}")]
    InvalidKey {
        /// The refused segment.
        segment: String,
        /// Why it was refused.
        reason: &'static str,
    },
    /// The object (or bucket) does not exist.
    #[error("not found: {uri}")]
    NotFound {
        /// The object's URI.
        uri: String,
    },
    /// The credentials in use may not do this.
    #[error("permission denied on {uri}: {message}")]
    PermissionDenied {
        /// The object's URI.
        uri: String,
        /// What the backend said.
        message: String,
    },
    /// A conditional write found the object in another state (e.g. it already exists).
    #[error("precondition failed on {uri}: {message}")]
    PreconditionFailed {
        /// The object's URI.
        uri: String,
        /// What the backend said.
        message: String,
    },
    /// The backend asked us to slow down; retrying later can succeed.
    #[error("throttled by the backend on {uri}: {message}")]
    Throttled {
        /// The object's URI.
        uri: String,
        /// What the backend said.
        message: String,
    },
    /// A ranged read asked for bytes past the end of the object.
    #[error("range {start}.. is outside {uri} ({size} bytes)")]
    InvalidRange {
        /// The object's URI.
        uri: String,
        /// First byte asked for.
        start: u64,
        /// The object's size.
        size: u64,
    },
    /// The backend cannot do this operation (e.g. presigned URLs on a local folder).
    #[error("{operation} is not supported by {backend}: {reason}")]
    Unsupported {
        /// What was asked.
        operation: &'static str,
        /// Which backend.
        backend: &'static str,
        /// Why, and what to do instead.
        reason: String,
    },
    /// The storage configuration is unusable (bad endpoint, unreadable credentials…).
    #[error("storage configuration: {0}")]
    Config(String),
    /// An I/O failure on local disk.
    #[error("i/o error on {path}: {source}")]
    Io {
        /// The path involved.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Any other backend failure; `retryable` says whether trying again can help
    /// (connection resets, timeouts, 5xx answers).
    #[error("storage backend error on {uri}: {message}")]
    Backend {
        /// The object's URI.
        uri: String,
        /// What went wrong.
        message: String,
        /// Whether retrying the same operation can succeed.
        retryable: bool,
    },
}

impl Error {
    /// Whether retrying the same operation can succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Throttled { .. } => true,
            Error::Backend { retryable, .. } => *retryable,
            Error::Io { source, .. } => matches!(
                source.kind(),
                std::io::ErrorKind::Interrupted
                    | std::io::ErrorKind::TimedOut
                    | std::io::ErrorKind::WouldBlock
            ),
            _ => false,
        }
    }

    /// Whether this is [`Error::NotFound`].
    pub fn is_not_found(&self) -> bool {
        matches!(self, Error::NotFound { .. })
    }

    pub(crate) fn io(path: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.to_string();
        move |source| Error::Io { path, source }
    }
}

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A stream of object bytes. Puts consume one, gets yield one.
pub type ByteStream = BoxStream<'static, Result<Bytes>>;

/// Turns in-memory bytes into a [`ByteStream`].
pub fn bytes_stream(data: impl Into<Bytes>) -> ByteStream {
    futures::stream::once(futures::future::ready(Ok(data.into()))).boxed()
}

/// Reads a whole [`ByteStream`] into memory (for small objects: manifests, configs).
pub async fn collect(stream: ByteStream) -> Result<Bytes> {
    let parts: Vec<Bytes> = stream.try_collect().await?;
    Ok(match parts.len() {
        0 => Bytes::new(),
        1 => parts.into_iter().next().unwrap_or_default(),
        _ => Bytes::from(parts.concat()),
    })
}

/// Reads from `body` into `buf` until it holds more than `limit` bytes; true when the
/// stream ended first. Uploaders call it with their part size: an ended stream fits in
/// one request, otherwise whole parts can go out while the rest follows.
pub(crate) async fn fill_past(
    body: &mut ByteStream,
    buf: &mut bytes::BytesMut,
    limit: usize,
) -> Result<bool> {
    while buf.len() <= limit {
        match body.next().await {
            Some(chunk) => buf.extend_from_slice(&chunk?),
            None => return Ok(true),
        }
    }
    Ok(false)
}

/// A store that takes an object of at most one part in one request and a larger one in
/// parts (S3's multipart upload, GCS's resumable session).
#[async_trait]
pub(crate) trait PartedUpload: ObjectStore {
    /// Bytes per part: an object of at most this many goes in one request.
    fn part_size(&self) -> usize;

    /// Stores `data` in one request.
    async fn put_single(&self, key: &ObjectKey, data: Bytes, mode: PutMode) -> Result<()>;

    /// Stores `buf` (what was read so far, more than a part) and the rest of `body`.
    async fn put_parts(
        &self,
        key: &ObjectKey,
        body: &mut ByteStream,
        buf: &mut bytes::BytesMut,
        mode: PutMode,
    ) -> Result<()>;

    /// [`ObjectStore::put_stream`] for such a store: one request when the stream ends
    /// within a part, parts otherwise.
    async fn put_in_parts(
        &self,
        key: &ObjectKey,
        mut body: ByteStream,
        mode: PutMode,
    ) -> Result<ObjectMeta> {
        let mut buf = bytes::BytesMut::new();
        if fill_past(&mut body, &mut buf, self.part_size()).await? {
            self.put_single(key, buf.freeze(), mode).await?;
        } else {
            self.put_parts(key, &mut body, &mut buf, mode).await?;
        }
        self.head(key).await
    }
}

/// Metadata of one stored object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectMeta {
    /// Key relative to the store's root.
    pub key: ObjectKey,
    /// Size in bytes.
    pub size: u64,
    /// Opaque version tag; changes whenever the content is replaced.
    pub etag: Option<String>,
    /// When the object was last written.
    pub modified: Option<SystemTime>,
}

/// How a put treats an object that already exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PutMode {
    /// Replace it.
    #[default]
    Overwrite,
    /// Fail with [`Error::PreconditionFailed`] if it exists (atomic create-only).
    Create,
}

/// Which bytes of an object a get returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GetRange {
    /// `start..end` (end exclusive; clamped to the object's size).
    Bounded {
        /// First byte.
        start: u64,
        /// One past the last byte.
        end: u64,
    },
    /// Everything from `start` on.
    From(u64),
}

impl GetRange {
    /// The HTTP `Range` header value for this range.
    pub fn to_http_header(self) -> String {
        match self {
            GetRange::Bounded { start, end } => format!("bytes={start}-{}", end.max(start + 1) - 1),
            GetRange::From(start) => format!("bytes={start}-"),
        }
    }

    /// First byte asked for.
    pub fn start(self) -> u64 {
        match self {
            GetRange::Bounded { start, .. } | GetRange::From(start) => start,
        }
    }

    /// The byte span `start..end` this range selects from an object of `size` bytes
    /// (HTTP semantics: the end is clamped; a start past the last byte is an error).
    pub fn resolve(range: Option<Self>, size: u64, uri: &str) -> Result<(u64, u64)> {
        let Some(r) = range else {
            return Ok((0, size));
        };
        let start = r.start();
        if start > size || (start == size && size > 0) {
            return Err(Error::InvalidRange {
                uri: uri.to_string(),
                start,
                size,
            });
        }
        let end = match r {
            GetRange::Bounded { end, .. } => end.min(size),
            GetRange::From(_) => size,
        };
        Ok((start, end.max(start)))
    }
}

/// The answer to a get: the object's metadata and a stream of the requested bytes.
pub struct GetObject {
    /// Metadata of the whole object (`size` is the full size, not the range's).
    pub meta: ObjectMeta,
    /// The requested bytes.
    pub body: ByteStream,
}

impl std::fmt::Debug for GetObject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GetObject")
            .field("meta", &self.meta)
            .finish()
    }
}

/// Which request a presigned URL authorises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PresignMethod {
    /// Download.
    Get,
    /// Upload (replaces the object).
    Put,
}

/// A URL anyone holding it may use, until it expires, for one method on one object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PresignedRequest {
    /// `GET` or `PUT`.
    pub method: PresignMethod,
    /// The URL.
    pub url: String,
    /// Headers the client must send with it (beyond `Host`).
    pub headers: Vec<(String, String)>,
    /// When it stops working.
    pub expires_at: SystemTime,
}

/// The operations every backend provides.
///
/// Keys are `/`-separated and relative to the store's root (the [`Location`] it was
/// opened at); they come from [`ObjectKey`], never from unchecked strings. Transient
/// failures are retried with backoff inside the backend before an error comes back.
#[async_trait]
pub trait ObjectStore: Send + Sync + std::fmt::Debug {
    /// Short backend name for messages and metrics (`local`, `s3`, `gcs`).
    fn backend(&self) -> &'static str;

    /// The full URI of `key`, for messages and lineage records.
    fn uri(&self, key: &ObjectKey) -> String;

    /// Writes the bytes of `body` at `key`. Large objects go up in parts (S3 multipart,
    /// GCS resumable upload), so memory stays bounded by one part. Readers see either
    /// the old object or the whole new one, never a partial one.
    async fn put_stream(
        &self,
        key: &ObjectKey,
        body: ByteStream,
        mode: PutMode,
    ) -> Result<ObjectMeta>;

    /// Writes in-memory bytes at `key`.
    async fn put(&self, key: &ObjectKey, data: Bytes, mode: PutMode) -> Result<ObjectMeta> {
        self.put_stream(key, bytes_stream(data), mode).await
    }

    /// Streams the object, or the given range of it.
    async fn get(&self, key: &ObjectKey, range: Option<GetRange>) -> Result<GetObject>;

    /// Reads the whole object into memory (for small objects).
    async fn get_bytes(&self, key: &ObjectKey) -> Result<Bytes> {
        collect(self.get(key, None).await?.body).await
    }

    /// Size, etag and modification time, or [`Error::NotFound`].
    async fn head(&self, key: &ObjectKey) -> Result<ObjectMeta>;

    /// Every object under `prefix/` (or every object, for the root key), in key order,
    /// fetched page by page as the stream is read.
    fn list(&self, prefix: &ObjectKey) -> BoxStream<'_, Result<ObjectMeta>>;

    /// Deletes the object; deleting a missing object succeeds.
    async fn delete(&self, key: &ObjectKey) -> Result<()>;

    /// Copies `from` to `to` inside the store without passing the bytes through us.
    async fn copy(&self, from: &ObjectKey, to: &ObjectKey) -> Result<ObjectMeta>;

    /// A URL that lets a plain HTTP client do `method` on `key` until `expires_in` has
    /// passed, or [`Error::Unsupported`] where the backend or its credentials cannot.
    async fn presign(
        &self,
        key: &ObjectKey,
        method: PresignMethod,
        expires_in: Duration,
    ) -> Result<PresignedRequest>;

    /// Marks `prefix` complete by writing `<prefix>/manifest.json`. Call it after every
    /// other object under the prefix is written: readers trust only committed prefixes,
    /// so a writer killed half-way leaves nothing anyone would use.
    async fn commit_manifest(&self, prefix: &ObjectKey, manifest: Bytes) -> Result<ObjectMeta> {
        self.put(&prefix.join(MANIFEST)?, manifest, PutMode::Overwrite)
            .await
    }

    /// Whether `<prefix>/manifest.json` exists, i.e. the prefix was committed.
    async fn is_committed(&self, prefix: &ObjectKey) -> Result<bool> {
        match self.head(&prefix.join(MANIFEST)?).await {
            Ok(_) => Ok(true),
            Err(e) if e.is_not_found() => Ok(false),
            Err(e) => Err(e),
        }
    }
}

/// Opens the store rooted at `location` with the backend its scheme names.
pub async fn open(location: &Location, config: &StorageConfig) -> Result<Arc<dyn ObjectStore>> {
    Ok(match location {
        Location::Local(path) => Arc::new(LocalStore::new(path)),
        Location::S3 { bucket, prefix } => {
            Arc::new(s3::S3Store::connect(&config.s3, bucket, prefix).await?)
        }
        Location::Gcs { bucket, prefix } => {
            Arc::new(gcs::GcsStore::connect(&config.gcs, bucket, prefix).await?)
        }
    })
}

/// Joins a store's prefix and a relative key into a full backend key.
pub(crate) fn full_key(prefix: &str, key: &ObjectKey) -> String {
    match (prefix.is_empty(), key.as_str().is_empty()) {
        (true, _) => key.as_str().to_string(),
        (false, true) => prefix.to_string(),
        (false, false) => format!("{prefix}/{}", key.as_str()),
    }
}

/// The listing prefix for `prefix` under a store prefix: everything below it, never a
/// sibling that merely starts with the same characters (`jobs/j1` must not match `jobs/j10`).
pub(crate) fn list_prefix(store_prefix: &str, prefix: &ObjectKey) -> String {
    let full = full_key(store_prefix, prefix);
    if full.is_empty() {
        full
    } else {
        format!("{full}/")
    }
}

/// Turns a full backend key back into a key relative to the store prefix.
pub(crate) fn relative_key(store_prefix: &str, full: &str) -> Result<ObjectKey> {
    let rel = if store_prefix.is_empty() {
        full
    } else {
        full.strip_prefix(store_prefix)
            .and_then(|r| r.strip_prefix('/'))
            .unwrap_or(full)
    };
    ObjectKey::parse(rel)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_join_and_split_around_store_prefixes() -> Result<()> {
        let k = ObjectKey::parse("a/b")?;
        assert_eq!(full_key("", &k), "a/b");
        assert_eq!(full_key("p/q", &k), "p/q/a/b");
        assert_eq!(list_prefix("p", &ObjectKey::root()), "p/");
        assert_eq!(list_prefix("", &ObjectKey::root()), "");
        assert_eq!(list_prefix("p", &k), "p/a/b/");
        assert_eq!(relative_key("p/q", "p/q/a/b")?, k);
        assert_eq!(relative_key("", "a/b")?, k);
        Ok(())
    }

    #[test]
    fn ranges_render_as_http_headers() {
        assert_eq!(
            GetRange::Bounded { start: 0, end: 10 }.to_http_header(),
            "bytes=0-9"
        );
        assert_eq!(GetRange::From(5).to_http_header(), "bytes=5-");
    }

    #[test]
    fn only_transient_errors_are_retryable() {
        let uri = "s3://b/k".to_string();
        assert!(
            Error::Throttled {
                uri: uri.clone(),
                message: String::new()
            }
            .is_retryable()
        );
        assert!(!Error::NotFound { uri: uri.clone() }.is_retryable());
        assert!(
            !Error::PreconditionFailed {
                uri,
                message: String::new()
            }
            .is_retryable()
        );
    }
}
