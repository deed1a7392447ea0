//! Where the operator lets `POST /admin/models` take models from (`--model-root`): local
//! folders and store prefixes. A location is taken only under one of them — a local one
//! checked before any of its files is read, once as written (no `..`) and again with its
//! symbolic links resolved, so that neither a path nor a link leads out; a store one by
//! whole path segments (`s3://models/llama` is not under `s3://models/ll`). With no
//! root set, any location is taken (the admin key is the only gate).

use std::path::{Component, Path, PathBuf};
use tuneq_storage::Location;

/// One place models may come from.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Root {
    /// A local folder, its links resolved where it exists here.
    Local(PathBuf),
    /// A bucket and the key segments under it.
    Store {
        scheme: &'static str,
        bucket: String,
        segments: Vec<String>,
    },
}

/// The places models may be registered from; empty: anywhere.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelRoots(Vec<Root>);

/// Why a `--model-root` cannot be one.
#[derive(Debug, thiserror::Error)]
#[error("--model-root {root}: {reason}")]
pub struct BadRoot {
    root: String,
    reason: String,
}

impl ModelRoots {
    /// Reads the roots: each an absolute path, a `file://`, `s3://` or `gs://` URI
    /// (a bucket at least), with no `..` in it.
    pub fn parse(texts: &[String]) -> Result<Self, BadRoot> {
        let mut roots = Vec::with_capacity(texts.len());
        for text in texts {
            let bad = |reason: &str| BadRoot {
                root: text.clone(),
                reason: reason.into(),
            };
            if !text.contains("://") && !Path::new(text).is_absolute() {
                return Err(bad("a local root is an absolute path"));
            }
            let location = Location::parse(text).map_err(|e| bad(&e.to_string()))?;
            roots.push(match location {
                Location::Local(path) => {
                    if !plain(&path) {
                        return Err(bad("a root has no '.' or '..' in it"));
                    }
                    Root::Local(std::fs::canonicalize(&path).unwrap_or(path))
                }
                store => store_root(&store).ok_or_else(|| bad("a root has no '..' in it"))?,
            });
        }
        Ok(Self(roots))
    }

    /// Whether any location is taken.
    pub fn is_open(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether the local folder `path` is under a root: as written (absolute, without
    /// `.` or `..`), and once resolved (its links followed; None where it does not
    /// resolve, which the caller refuses on its own).
    pub fn allows_folder(&self, path: &Path, resolved: Option<&Path>) -> bool {
        if self.is_open() {
            return true;
        }
        let under = |p: &Path| {
            self.0
                .iter()
                .any(|root| matches!(root, Root::Local(r) if p.starts_with(r)))
        };
        plain(path) && under(path) && resolved.is_none_or(under)
    }

    /// Whether the store location is under a root, segment by segment.
    pub fn allows_store(&self, location: &Location) -> bool {
        if self.is_open() {
            return true;
        }
        let Some(Root::Store {
            scheme,
            bucket,
            segments,
        }) = store_root(location)
        else {
            return false;
        };
        self.0.iter().any(|root| match root {
            Root::Store {
                scheme: s,
                bucket: b,
                segments: under,
            } => *s == scheme && *b == bucket && segments.starts_with(under),
            Root::Local(_) => false,
        })
    }

    /// The roots as an operator wrote them, for refusals.
    pub fn describe(&self) -> String {
        self.0
            .iter()
            .map(|root| match root {
                Root::Local(path) => path.display().to_string(),
                Root::Store {
                    scheme,
                    bucket,
                    segments,
                } => format!("{scheme}://{bucket}/{}", segments.join("/")),
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Whether `path` is absolute and names no `.` or `..`.
fn plain(path: &Path) -> bool {
    path.is_absolute()
        && path
            .components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
}

/// A store location as a root: its scheme, bucket and key segments; None for a local
/// one or a prefix with a `.` or `..` segment.
fn store_root(location: &Location) -> Option<Root> {
    let (scheme, bucket, prefix) = match location {
        Location::S3 { bucket, prefix } => ("s3", bucket, prefix),
        Location::Gcs { bucket, prefix } => ("gs", bucket, prefix),
        Location::Local(_) => return None,
    };
    let segments: Vec<String> = prefix
        .split('/')
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    if segments.iter().any(|s| s == "." || s == "..") {
        return None;
    }
    Some(Root::Store {
        scheme,
        bucket: bucket.clone(),
        segments,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn roots(texts: &[&str]) -> ModelRoots {
        ModelRoots::parse(&texts.iter().map(|t| t.to_string()).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn a_store_location_is_taken_only_under_a_root_by_whole_segments() {
        let r = roots(&["s3://models/llama", "gs://weights"]);
        let allows = |text: &str| r.allows_store(&Location::parse(text).unwrap());
        assert!(allows("s3://models/llama"));
        assert!(allows("s3://models/llama/3.2-1b"));
        assert!(allows("gs://weights/any/thing"));
        assert!(!allows("s3://models/llamas"));
        assert!(!allows("s3://models"));
        assert!(!allows("gs://models/llama"));
        assert!(!allows("s3://other/llama"));
        assert!(roots(&[]).allows_store(&Location::parse("s3://x/y").unwrap()));
    }

    #[test]
    fn a_folder_is_taken_only_under_a_root_as_written_and_resolved() {
        let dir = tempfile::tempdir().unwrap();
        let base = std::fs::canonicalize(dir.path()).unwrap();
        let root = base.join("models");
        std::fs::create_dir_all(root.join("llama")).unwrap();
        std::fs::create_dir_all(base.join("secret")).unwrap();
        let r = roots(&[root.to_str().unwrap()]);
        let inside = root.join("llama");
        let resolved = std::fs::canonicalize(&inside).unwrap();
        assert!(r.allows_folder(&inside, Some(&resolved)));
        // `..` out of the root, as written.
        let dotted = root.join("llama/../../secret");
        assert!(!r.allows_folder(&dotted, None));
        // A link inside the root to a folder outside it.
        let link = root.join("link");
        std::os::unix::fs::symlink(base.join("secret"), &link).unwrap();
        let target = std::fs::canonicalize(&link).unwrap();
        assert!(!r.allows_folder(&link, Some(&target)));
        // A sibling whose name starts like the root.
        assert!(!r.allows_folder(&base.join("models-2"), None));
        assert!(roots(&[]).allows_folder(&dotted, None));
    }

    #[test]
    fn a_root_is_absolute_and_plain() {
        for bad in [
            "models",
            "/models/../etc",
            "s3://",
            "s3://b/../x",
            "ftp://x",
        ] {
            assert!(ModelRoots::parse(&[bad.to_string()]).is_err(), "{bad}");
        }
    }
}
