//! The local-directory backend: objects are files under a root folder.
//!
//! Writes stream into a file in the root's staging folder (`.tuneq-staging/`, never
//! listed), are fsynced, and renamed into place, so a reader (or a trainer resuming
//! after a kill) never sees a half-written object. Create-only writes use a hard link,
//! which fails atomically when the target exists.

use crate::{
    ByteStream, Error, GetObject, GetRange, ObjectKey, ObjectMeta, ObjectStore, PresignMethod,
    PresignedRequest, PutMode, Result,
};
use async_trait::async_trait;
use bytes::BytesMut;
use futures::stream::{BoxStream, StreamExt};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};

/// Folder under the root where writes are staged before the rename.
pub const STAGING_DIR: &str = ".tuneq-staging";

/// Bytes per chunk when streaming a file out.
const READ_CHUNK: usize = 256 * 1024;

/// Objects stored as files under `root`.
#[derive(Debug, Clone)]
pub struct LocalStore {
    root: PathBuf,
}

impl LocalStore {
    /// A store rooted at `root` (created on first write).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// The root folder.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The file path of `key`.
    pub fn path_of(&self, key: &ObjectKey) -> PathBuf {
        key.segments().fold(self.root.clone(), |p, s| p.join(s))
    }

    fn checked_path(&self, key: &ObjectKey) -> Result<PathBuf> {
        if key.segments().next() == Some(STAGING_DIR) {
            return Err(Error::InvalidKey {
                segment: STAGING_DIR.to_string(),
                reason: "reserved for in-flight writes",
            });
        }
        if key.is_root() {
            return Err(Error::InvalidKey {
                segment: String::new(),
                reason: "an object needs a non-empty key",
            });
        }
        Ok(self.path_of(key))
    }

    fn staging_file(&self) -> PathBuf {
        let nonce: u64 = rand::random();
        self.root
            .join(STAGING_DIR)
            .join(format!("{}-{nonce:016x}", std::process::id()))
    }

    fn not_found(&self, key: &ObjectKey) -> Error {
        Error::NotFound { uri: self.uri(key) }
    }
}

/// Writes `data` to `path` atomically: temp file in the same folder, fsync, rename.
/// For callers that write local files directly (the trainer's output folder).
pub fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    std::fs::create_dir_all(dir).map_err(Error::io(dir.display()))?;
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("object");
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let mut f = std::fs::File::create(&tmp).map_err(Error::io(tmp.display()))?;
    f.write_all(data).map_err(Error::io(tmp.display()))?;
    f.sync_all().map_err(Error::io(tmp.display()))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(Error::io(path.display()))?;
    Ok(())
}

fn meta_of(key: &ObjectKey, m: &std::fs::Metadata) -> ObjectMeta {
    let modified = m.modified().ok();
    let nanos = modified
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    ObjectMeta {
        key: key.clone(),
        size: m.len(),
        etag: Some(format!("{nanos:x}-{:x}", m.len())),
        modified,
    }
}

/// Moves a fully written staging file to `path` according to `mode`.
fn publish(staged: &Path, path: &Path, mode: PutMode, uri: &str) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(Error::io(dir.display()))?;
    }
    match mode {
        PutMode::Overwrite => std::fs::rename(staged, path).map_err(Error::io(path.display())),
        PutMode::Create => {
            let linked = std::fs::hard_link(staged, path);
            let _ = std::fs::remove_file(staged);
            match linked {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    Err(Error::PreconditionFailed {
                        uri: uri.to_string(),
                        message: "the object already exists".into(),
                    })
                }
                Err(e) => Err(Error::io(path.display())(e)),
            }
        }
    }
}

#[async_trait]
impl ObjectStore for LocalStore {
    fn backend(&self) -> &'static str {
        "local"
    }

    fn uri(&self, key: &ObjectKey) -> String {
        format!("file://{}", self.path_of(key).display())
    }

    async fn put_stream(
        &self,
        key: &ObjectKey,
        mut body: ByteStream,
        mode: PutMode,
    ) -> Result<ObjectMeta> {
        let path = self.checked_path(key)?;
        let staged = self.staging_file();
        if let Some(dir) = staged.parent() {
            tokio::fs::create_dir_all(dir)
                .await
                .map_err(Error::io(dir.display()))?;
        }
        let result = async {
            let mut file = tokio::fs::File::create(&staged)
                .await
                .map_err(Error::io(staged.display()))?;
            while let Some(chunk) = body.next().await {
                file.write_all(&chunk?)
                    .await
                    .map_err(Error::io(staged.display()))?;
            }
            file.sync_all().await.map_err(Error::io(staged.display()))?;
            drop(file);
            let (staged, path, uri) = (staged.clone(), path.clone(), self.uri(key));
            tokio::task::spawn_blocking(move || publish(&staged, &path, mode, &uri))
                .await
                .map_err(|e| Error::Io {
                    path: "publish".into(),
                    source: std::io::Error::other(e),
                })?
        }
        .await;
        if result.is_err() {
            let _ = tokio::fs::remove_file(&staged).await;
        }
        result?;
        self.head(key).await
    }

    async fn get(&self, key: &ObjectKey, range: Option<GetRange>) -> Result<GetObject> {
        let path = self.checked_path(key)?;
        let mut file = match tokio::fs::File::open(&path).await {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(self.not_found(key));
            }
            Err(e) => return Err(Error::io(path.display())(e)),
        };
        let m = file.metadata().await.map_err(Error::io(path.display()))?;
        if !m.is_file() {
            return Err(self.not_found(key));
        }
        let meta = meta_of(key, &m);
        let (start, end) = GetRange::resolve(range, meta.size, &self.uri(key))?;
        file.seek(std::io::SeekFrom::Start(start))
            .await
            .map_err(Error::io(path.display()))?;
        let display = path.display().to_string();
        let body = futures::stream::try_unfold(
            (file, end - start, display),
            |(mut file, left, display)| async move {
                if left == 0 {
                    return Ok(None);
                }
                let want = usize::try_from(left).unwrap_or(READ_CHUNK).min(READ_CHUNK);
                let mut buf = BytesMut::zeroed(want);
                let n = file
                    .read(&mut buf)
                    .await
                    .map_err(Error::io(display.clone()))?;
                if n == 0 {
                    return Err(Error::Io {
                        path: display,
                        source: std::io::ErrorKind::UnexpectedEof.into(),
                    });
                }
                buf.truncate(n);
                Ok(Some((buf.freeze(), (file, left - n as u64, display))))
            },
        )
        .boxed();
        Ok(GetObject { meta, body })
    }

    async fn head(&self, key: &ObjectKey) -> Result<ObjectMeta> {
        let path = self.checked_path(key)?;
        match tokio::fs::metadata(&path).await {
            Ok(m) if m.is_file() => Ok(meta_of(key, &m)),
            Ok(_) => Err(self.not_found(key)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(self.not_found(key)),
            Err(e) => Err(Error::io(path.display())(e)),
        }
    }

    fn list(&self, prefix: &ObjectKey) -> BoxStream<'_, Result<ObjectMeta>> {
        let root = self.root.clone();
        let start = self.path_of(prefix);
        let fut = tokio::task::spawn_blocking(move || walk(&root, &start));
        futures::stream::once(fut)
            .flat_map(|joined| {
                let items = match joined {
                    Ok(Ok(items)) => items.into_iter().map(Ok).collect(),
                    Ok(Err(e)) => vec![Err(e)],
                    Err(e) => vec![Err(Error::Io {
                        path: "list".into(),
                        source: std::io::Error::other(e),
                    })],
                };
                futures::stream::iter(items)
            })
            .boxed()
    }

    async fn delete(&self, key: &ObjectKey) -> Result<()> {
        let path = self.checked_path(key)?;
        match tokio::fs::remove_file(&path).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io(path.display())(e)),
        }
    }

    async fn copy(&self, from: &ObjectKey, to: &ObjectKey) -> Result<ObjectMeta> {
        let src = self.checked_path(from)?;
        let dst = self.checked_path(to)?;
        let staged = self.staging_file();
        let uri = self.uri(to);
        let not_found = self.not_found(from);
        let copied = tokio::task::spawn_blocking(move || -> Result<()> {
            if let Some(dir) = staged.parent() {
                std::fs::create_dir_all(dir).map_err(Error::io(dir.display()))?;
            }
            match std::fs::copy(&src, &staged) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(not_found),
                Err(e) => return Err(Error::io(src.display())(e)),
            }
            let synced = std::fs::File::open(&staged).and_then(|f| f.sync_all());
            synced.map_err(Error::io(staged.display()))?;
            publish(&staged, &dst, PutMode::Overwrite, &uri)
        })
        .await
        .map_err(|e| Error::Io {
            path: "copy".into(),
            source: std::io::Error::other(e),
        })?;
        copied?;
        self.head(to).await
    }

    async fn presign(
        &self,
        _key: &ObjectKey,
        _method: PresignMethod,
        _expires_in: Duration,
    ) -> Result<PresignedRequest> {
        Err(Error::Unsupported {
            operation: "presigned URLs",
            backend: "local storage",
            reason: "a local folder has no URL of its own; download through the API instead".into(),
        })
    }
}

/// Every file below `start`, as keys relative to `root`, sorted (staging files excluded).
fn walk(root: &Path, start: &Path) -> Result<Vec<ObjectMeta>> {
    let mut out = Vec::new();
    let mut stack = vec![start.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
                ) =>
            {
                continue;
            }
            Err(e) => return Err(Error::io(dir.display())(e)),
        };
        for entry in entries {
            let entry = entry.map_err(Error::io(dir.display()))?;
            let path = entry.path();
            let meta = entry.metadata().map_err(Error::io(path.display()))?;
            let Ok(rel) = path.strip_prefix(root) else {
                continue;
            };
            let rel = rel.to_string_lossy().replace('\\', "/");
            if rel == STAGING_DIR || rel.starts_with(&format!("{STAGING_DIR}/")) {
                continue;
            }
            if meta.is_dir() {
                stack.push(path);
            } else if let Ok(key) = ObjectKey::parse(&rel) {
                out.push(meta_of(&key, &meta));
            }
        }
    }
    out.sort_by(|a, b| a.key.cmp(&b.key));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use futures::TryStreamExt;

    #[tokio::test]
    async fn staging_folder_is_reserved_and_hidden() -> Result<()> {
        let dir = tempfile::tempdir().map_err(Error::io("tempdir"))?;
        let store = LocalStore::new(dir.path());
        let bad = ObjectKey::parse(".tuneq-staging/x")?;
        assert!(
            store
                .put(&bad, Bytes::from_static(b"x"), PutMode::Overwrite)
                .await
                .is_err()
        );
        store
            .put(
                &ObjectKey::parse("a/b")?,
                Bytes::from_static(b"hi"),
                PutMode::Overwrite,
            )
            .await?;
        std::fs::create_dir_all(dir.path().join(STAGING_DIR)).map_err(Error::io("mk"))?;
        std::fs::write(dir.path().join(STAGING_DIR).join("junk"), b"x").map_err(Error::io("w"))?;
        let keys: Vec<_> = store
            .list(&ObjectKey::root())
            .map_ok(|m| m.key.to_string())
            .try_collect()
            .await?;
        assert_eq!(keys, ["a/b"]);
        Ok(())
    }
}
