//! The local-directory backend: objects are files under a root folder.
//!
//! Writes go to a temporary sibling and are renamed into place, so a reader (or a
//! trainer resuming after a kill) never sees a half-written object.

use crate::{Error, ObjectKey, ObjectMeta, ObjectStore, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

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
        key.as_str()
            .split('/')
            .filter(|s| !s.is_empty())
            .fold(self.root.clone(), |p, s| p.join(s))
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Writes `data` to `path` atomically: temp file in the same folder, fsync, rename.
pub fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("object");
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let mut f = std::fs::File::create(&tmp).map_err(io_err(&tmp))?;
    f.write_all(data).map_err(io_err(&tmp))?;
    f.sync_all().map_err(io_err(&tmp))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(io_err(path))?;
    Ok(())
}

impl ObjectStore for LocalStore {
    fn put(&self, key: &ObjectKey, data: &[u8]) -> Result<()> {
        write_atomic(&self.path_of(key), data)
    }

    fn get(&self, key: &ObjectKey) -> Result<Vec<u8>> {
        let path = self.path_of(key);
        std::fs::read(&path).map_err(|source| match source.kind() {
            std::io::ErrorKind::NotFound => Error::NotFound(key.to_string()),
            _ => Error::Io {
                path: path.display().to_string(),
                source,
            },
        })
    }

    fn head(&self, key: &ObjectKey) -> Result<ObjectMeta> {
        let path = self.path_of(key);
        match std::fs::metadata(&path) {
            Ok(m) if m.is_file() => Ok(ObjectMeta {
                key: key.to_string(),
                size: m.len(),
            }),
            Ok(_) => Err(Error::NotFound(key.to_string())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(Error::NotFound(key.to_string()))
            }
            Err(source) => Err(Error::Io {
                path: path.display().to_string(),
                source,
            }),
        }
    }

    fn list(&self, prefix: &ObjectKey) -> Result<Vec<ObjectMeta>> {
        let mut out = Vec::new();
        let start = self.path_of(prefix);
        let mut stack = vec![start];
        while let Some(dir) = stack.pop() {
            let entries = match std::fs::read_dir(&dir) {
                Ok(e) => e,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(source) => {
                    return Err(Error::Io {
                        path: dir.display().to_string(),
                        source,
                    });
                }
            };
            for entry in entries {
                let entry = entry.map_err(io_err(&dir))?;
                let path = entry.path();
                let meta = entry.metadata().map_err(io_err(&path))?;
                if meta.is_dir() {
                    stack.push(path);
                } else if let Ok(rel) = path.strip_prefix(&self.root) {
                    let key = rel.to_string_lossy().replace('\\', "/");
                    let hidden = rel
                        .file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with('.'));
                    if !hidden {
                        out.push(ObjectMeta {
                            key,
                            size: meta.len(),
                        });
                    }
                }
            }
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    fn delete(&self, key: &ObjectKey) -> Result<()> {
        let path = self.path_of(key);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(Error::Io {
                path: path.display().to_string(),
                source,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_list_delete_and_commit() -> Result<()> {
        let dir = tempfile::tempdir().map_err(io_err(Path::new("tmp")))?;
        let store = LocalStore::new(dir.path());
        let a = ObjectKey::parse("jobs/j1/checkpoints/step-1/a.bin")?;
        store.put(&a, b"hello")?;
        assert_eq!(store.get(&a)?, b"hello");
        assert_eq!(store.head(&a)?.size, 5);
        let prefix = ObjectKey::parse("jobs/j1/checkpoints/step-1")?;
        assert!(!store.is_committed(&prefix)?);
        store.commit_manifest(&prefix, b"{}")?;
        assert!(store.is_committed(&prefix)?);
        let keys: Vec<_> = store
            .list(&ObjectKey::parse("jobs/j1")?)?
            .into_iter()
            .map(|m| m.key)
            .collect();
        assert_eq!(
            keys,
            [
                "jobs/j1/checkpoints/step-1/a.bin",
                "jobs/j1/checkpoints/step-1/manifest.json"
            ]
        );
        store.delete(&a)?;
        assert!(matches!(store.get(&a), Err(Error::NotFound(_))));
        store.delete(&a)?;
        Ok(())
    }
}
