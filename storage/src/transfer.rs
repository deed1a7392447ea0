//! Whole files and folders between local disk and a store, streamed in chunks.
//!
//! The trainer works on local files (candle memory-maps weights); these helpers stage
//! a remote base model and dataset onto local disk, and push checkpoints and adapters
//! back, always with bounded memory.

use crate::{ByteStream, Error, ObjectKey, ObjectMeta, ObjectStore, PutMode, Result};
use bytes::BytesMut;
use futures::stream::{StreamExt, TryStreamExt};
use std::path::{Path, PathBuf};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const CHUNK: usize = 1024 * 1024;

/// Streams a local file's bytes.
pub async fn file_stream(path: &Path) -> Result<ByteStream> {
    let file = tokio::fs::File::open(path)
        .await
        .map_err(Error::io(path.display()))?;
    let display = path.display().to_string();
    Ok(
        futures::stream::try_unfold((file, display), |(mut file, display)| async move {
            let mut buf = BytesMut::zeroed(CHUNK);
            let n = file.read(&mut buf).await.map_err(Error::io(&display))?;
            if n == 0 {
                return Ok(None);
            }
            buf.truncate(n);
            Ok(Some((buf.freeze(), (file, display))))
        })
        .boxed(),
    )
}

/// Uploads one local file to `key`.
pub async fn upload_file(
    store: &dyn ObjectStore,
    path: &Path,
    key: &ObjectKey,
    mode: PutMode,
) -> Result<ObjectMeta> {
    store.put_stream(key, file_stream(path).await?, mode).await
}

/// Uploads every file below `dir` (hidden files and folders skipped) under `prefix`,
/// in name order; returns what was written.
pub async fn upload_dir(
    store: &dyn ObjectStore,
    dir: &Path,
    prefix: &ObjectKey,
) -> Result<Vec<ObjectMeta>> {
    let mut written = Vec::new();
    for rel in local_files(dir)? {
        let key = prefix.join_key(&ObjectKey::parse(&rel)?);
        written.push(upload_file(store, &dir.join(&rel), &key, PutMode::Overwrite).await?);
    }
    Ok(written)
}

/// Every non-hidden file below `dir`, as sorted `/`-separated relative paths.
pub fn local_files(dir: &Path) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).map_err(Error::io(d.display()))? {
            let entry = entry.map_err(Error::io(d.display()))?;
            let name = entry.file_name().to_string_lossy().to_string();
            if name.starts_with('.') {
                continue;
            }
            let path = entry.path();
            let kind = entry.file_type().map_err(Error::io(path.display()))?;
            if kind.is_dir() {
                stack.push(path);
            } else if kind.is_file()
                && let Ok(rel) = path.strip_prefix(dir)
            {
                out.push(rel.to_string_lossy().replace('\\', "/"));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Downloads `key` to `path`: streamed into a temporary sibling, fsynced, renamed.
pub async fn download_file(store: &dyn ObjectStore, key: &ObjectKey, path: &Path) -> Result<u64> {
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    tokio::fs::create_dir_all(dir)
        .await
        .map_err(Error::io(dir.display()))?;
    let tmp: PathBuf = dir.join(format!(
        ".{}.part-{}",
        path.file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("object"),
        std::process::id()
    ));
    let result = async {
        let mut body = store.get(key, None).await?.body;
        let mut file = tokio::fs::File::create(&tmp)
            .await
            .map_err(Error::io(tmp.display()))?;
        let mut written = 0u64;
        while let Some(chunk) = body.try_next().await? {
            file.write_all(&chunk)
                .await
                .map_err(Error::io(tmp.display()))?;
            written += chunk.len() as u64;
        }
        file.sync_all().await.map_err(Error::io(tmp.display()))?;
        tokio::fs::rename(&tmp, path)
            .await
            .map_err(Error::io(path.display()))?;
        Ok(written)
    }
    .await;
    if result.is_err() {
        let _ = tokio::fs::remove_file(&tmp).await;
    }
    result
}

/// [`download_file`] for an optional object: `Ok(None)` when it does not exist.
pub async fn download_file_if_present(
    store: &dyn ObjectStore,
    key: &ObjectKey,
    path: &Path,
) -> Result<Option<u64>> {
    match download_file(store, key, path).await {
        Ok(n) => Ok(Some(n)),
        Err(e) if e.is_not_found() => Ok(None),
        Err(e) => Err(e),
    }
}

/// What identifies an object's content for caching: size and etag.
pub fn cache_tag(meta: &ObjectMeta) -> String {
    format!("{}:{}", meta.size, meta.etag.as_deref().unwrap_or(""))
}

/// File in a mirrored folder that records the [`cache_tag`] of each object downloaded.
pub const CACHE_TAGS: &str = ".tuneq-etags.json";

/// Mirrors every object under `prefix` into `dir`, keeping relative paths. Objects
/// whose size and etag match the previous download (recorded in `dir/.tuneq-etags.json`)
/// and whose file is still there are not fetched again. Returns how many objects the
/// prefix holds.
pub async fn download_dir(
    store: &dyn ObjectStore,
    prefix: &ObjectKey,
    dir: &Path,
) -> Result<usize> {
    let tags_path = dir.join(CACHE_TAGS);
    let mut tags: std::collections::BTreeMap<String, String> = std::fs::read(&tags_path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    let objects: Vec<ObjectMeta> = store.list(prefix).try_collect().await?;
    for meta in &objects {
        let Some(rel) = meta.key.strip_prefix(prefix) else {
            continue;
        };
        let path = rel.segments().fold(dir.to_path_buf(), |p, s| p.join(s));
        let tag = cache_tag(meta);
        if tags.get(rel.as_str()) == Some(&tag) && path.is_file() {
            continue;
        }
        download_file(store, &meta.key, &path).await?;
        tags.insert(rel.as_str().to_string(), tag);
    }
    let json = serde_json::to_vec(&tags).map_err(|e| Error::Io {
        path: tags_path.display().to_string(),
        source: std::io::Error::other(e),
    })?;
    crate::local::write_atomic(&tags_path, &json)?;
    Ok(objects.len())
}
