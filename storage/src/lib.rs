//! Object storage behind one interface.
//!
//! Datasets, base models, checkpoints and adapters all live in object storage. Every
//! other crate names places with a [`Location`] and reads and writes through an
//! [`ObjectStore`], so none of them cares which backend is behind it.
//!
//! Layout:
//! - [`location`]: parsing `file://`, `s3://`, `gs://` URIs and plain paths into a typed [`Location`];
//!   object keys are built only from checked segments ([`ObjectKey`]).
//! - [`local`]: the local-directory backend used by `tuneq up` and the trainer today.
//!
//! S3 and GCS backends arrive with issue 3; until then a remote location is a clear
//! [`Error::Unsupported`].

pub mod local;
pub mod location;

pub use local::LocalStore;
pub use location::{Location, ObjectKey};

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
    /// The object does not exist.
    #[error("object not found: {0}")]
    NotFound(String),
    /// The backend is not available in this build.
    #[error("{scheme}:// storage is not supported yet (only local folders and file:// URIs)")]
    Unsupported {
        /// The URI scheme.
        scheme: String,
    },
    /// An I/O failure on the local backend.
    #[error("i/o error on {path}")]
    Io {
        /// The path involved.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// Whether retrying the same operation can succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Io { source, .. } => matches!(
                source.kind(),
                std::io::ErrorKind::Interrupted
                    | std::io::ErrorKind::TimedOut
                    | std::io::ErrorKind::WouldBlock
            ),
            _ => false,
        }
    }
}

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Metadata of one stored object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectMeta {
    /// Key relative to the store root.
    pub key: String,
    /// Size in bytes.
    pub size: u64,
}

/// The operations every backend provides. Keys are `/`-separated and relative to the
/// store's root; they come from [`ObjectKey`], never from unchecked strings.
pub trait ObjectStore: Send + Sync {
    /// Writes `data` at `key`, replacing what was there; readers never see a partial object.
    fn put(&self, key: &ObjectKey, data: &[u8]) -> Result<()>;
    /// Reads the whole object.
    fn get(&self, key: &ObjectKey) -> Result<Vec<u8>>;
    /// Size of the object, or [`Error::NotFound`].
    fn head(&self, key: &ObjectKey) -> Result<ObjectMeta>;
    /// Every object whose key starts with `prefix`, sorted by key.
    fn list(&self, prefix: &ObjectKey) -> Result<Vec<ObjectMeta>>;
    /// Deletes the object; deleting a missing object succeeds.
    fn delete(&self, key: &ObjectKey) -> Result<()>;
    /// Writes `manifest` as `<prefix>/manifest.json`, last, making the prefix complete.
    fn commit_manifest(&self, prefix: &ObjectKey, manifest: &[u8]) -> Result<()> {
        self.put(&prefix.join("manifest.json")?, manifest)
    }
    /// Whether `<prefix>/manifest.json` exists, i.e. the prefix was committed.
    fn is_committed(&self, prefix: &ObjectKey) -> Result<bool> {
        match self.head(&prefix.join("manifest.json")?) {
            Ok(_) => Ok(true),
            Err(Error::NotFound(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }
}
