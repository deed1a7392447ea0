//! Typed storage locations and safe object keys.

use crate::{Error, Result};
use std::path::{Path, PathBuf};

/// Where a model, dataset or output lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A local folder or file (absolute after parsing).
    Local(PathBuf),
    /// `s3://bucket/prefix`
    S3 {
        /// Bucket name.
        bucket: String,
        /// Key prefix (no leading slash).
        prefix: String,
    },
    /// `gs://bucket/prefix`
    Gcs {
        /// Bucket name.
        bucket: String,
        /// Key prefix (no leading slash).
        prefix: String,
    },
}

impl Location {
    /// Parses a URI (`file:///abs`, `s3://b/p`, `gs://b/p`) or a plain path (relative
    /// paths are resolved against the current directory).
    pub fn parse(input: &str) -> Result<Self> {
        let invalid = |reason: &str| Error::InvalidLocation {
            input: input.to_string(),
            reason: reason.to_string(),
        };
        if input.trim().is_empty() {
            return Err(invalid("empty"));
        }
        if input.chars().any(char::is_control) {
            return Err(invalid("contains control characters"));
        }
        if let Some((scheme, rest)) = input.split_once("://") {
            return match scheme {
                "file" => {
                    if !rest.starts_with('/') {
                        return Err(invalid(
                            "file:// URIs need an absolute path (file:///abs/dir)",
                        ));
                    }
                    Ok(Location::Local(PathBuf::from(rest)))
                }
                "s3" | "gs" => {
                    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
                    if bucket.is_empty()
                        || !bucket.chars().all(|c| {
                            c.is_ascii_lowercase()
                                || c.is_ascii_digit()
                                || c == '-'
                                || c == '.'
                                || c == '_'
                        })
                    {
                        return Err(invalid(
                            "bucket names use lowercase letters, digits, '-', '_' and '.'",
                        ));
                    }
                    let prefix = prefix.trim_end_matches('/').to_string();
                    for seg in prefix.split('/').filter(|s| !s.is_empty()) {
                        ObjectKey::check_segment(seg)
                            .map_err(|_| invalid("prefix has an unsafe segment"))?;
                    }
                    let bucket = bucket.to_string();
                    Ok(if scheme == "s3" {
                        Location::S3 { bucket, prefix }
                    } else {
                        Location::Gcs { bucket, prefix }
                    })
                }
                other => Err(invalid(&format!(
                    "unknown scheme {other:?}; use file://, s3:// or gs://"
                ))),
            };
        }
        let path = Path::new(input);
        let abs = if path.is_absolute() {
            path.to_path_buf()
        } else {
            std::env::current_dir()
                .map_err(|source| Error::Io {
                    path: input.to_string(),
                    source,
                })?
                .join(path)
        };
        Ok(Location::Local(abs))
    }

    /// The local path, for `file://` URIs and plain paths.
    pub fn as_local(&self) -> Option<&Path> {
        match self {
            Location::Local(p) => Some(p),
            Location::S3 { .. } | Location::Gcs { .. } => None,
        }
    }

    /// Whether this names a local folder or file.
    pub fn is_local(&self) -> bool {
        self.as_local().is_some()
    }

    /// The location `key` names below this one.
    pub fn child(&self, key: &ObjectKey) -> Location {
        match self {
            Location::Local(p) => Location::Local(key.segments().fold(p.clone(), |p, s| p.join(s))),
            Location::S3 { bucket, prefix } => Location::S3 {
                bucket: bucket.clone(),
                prefix: crate::full_key(prefix, key),
            },
            Location::Gcs { bucket, prefix } => Location::Gcs {
                bucket: bucket.clone(),
                prefix: crate::full_key(prefix, key),
            },
        }
    }
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Location::Local(p) => write!(f, "file://{}", p.display()),
            Location::S3 { bucket, prefix } => write!(f, "s3://{bucket}/{prefix}"),
            Location::Gcs { bucket, prefix } => write!(f, "gs://{bucket}/{prefix}"),
        }
    }
}

/// A `/`-separated object key made only of checked segments.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct ObjectKey(String);

impl ObjectKey {
    /// The empty key (the store root).
    pub fn root() -> Self {
        Self(String::new())
    }

    /// Builds a key from segments, each checked.
    pub fn from_segments<'a>(segments: impl IntoIterator<Item = &'a str>) -> Result<Self> {
        let mut key = Self::root();
        for s in segments {
            key = key.join(s)?;
        }
        Ok(key)
    }

    /// Parses a `/`-separated key, checking every segment.
    pub fn parse(key: &str) -> Result<Self> {
        Self::from_segments(key.split('/').filter(|s| !s.is_empty()))
    }

    /// Appends one checked segment.
    pub fn join(&self, segment: &str) -> Result<Self> {
        Self::check_segment(segment)?;
        Ok(if self.0.is_empty() {
            Self(segment.to_string())
        } else {
            Self(format!("{}/{segment}", self.0))
        })
    }

    /// The key as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether this is the root (empty) key.
    pub fn is_root(&self) -> bool {
        self.0.is_empty()
    }

    /// The checked segments, in order.
    pub fn segments(&self) -> impl Iterator<Item = &str> {
        self.0.split('/').filter(|s| !s.is_empty())
    }

    /// The last segment (empty for the root).
    pub fn file_name(&self) -> &str {
        self.0.rsplit('/').next().unwrap_or("")
    }

    /// Appends every segment of `other`.
    pub fn join_key(&self, other: &ObjectKey) -> ObjectKey {
        match (self.is_root(), other.is_root()) {
            (true, _) => other.clone(),
            (false, true) => self.clone(),
            (false, false) => Self(format!("{}/{}", self.0, other.0)),
        }
    }

    /// The rest of this key below `prefix`, if it lies below it.
    pub fn strip_prefix(&self, prefix: &ObjectKey) -> Option<ObjectKey> {
        if prefix.is_root() {
            return Some(self.clone());
        }
        self.0
            .strip_prefix(prefix.as_str())
            .and_then(|rest| rest.strip_prefix('/'))
            .map(|rest| Self(rest.to_string()))
    }

    pub(crate) fn check_segment(segment: &str) -> Result<()> {
        let bad = |reason| {
            Err(Error::InvalidKey {
                segment: segment.to_string(),
                reason,
            })
        };
        if segment.is_empty() {
            return bad("empty");
        }
        if segment == "." || segment == ".." {
            return bad("relative segment");
        }
        if segment.contains('/') || segment.contains('\\') {
            return bad("contains a path separator");
        }
        if segment.chars().any(char::is_control) {
            return bad("contains control characters");
        }
        if segment.len() > 255 {
            return bad("longer than 255 bytes");
        }
        Ok(())
    }
}

impl std::fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_scheme() {
        assert_eq!(
            Location::parse("file:///data/x").ok(),
            Some(Location::Local("/data/x".into()))
        );
        assert_eq!(
            Location::parse("s3://bucket/a/b/").ok(),
            Some(Location::S3 {
                bucket: "bucket".into(),
                prefix: "a/b".into()
            })
        );
        assert_eq!(
            Location::parse("gs://b").ok(),
            Some(Location::Gcs {
                bucket: "b".into(),
                prefix: "".into()
            })
        );
        assert!(
            Location::parse("relative/dir")
                .expect("path")
                .as_local()
                .expect("local")
                .is_absolute()
        );
    }

    #[test]
    fn refuses_bad_locations() {
        for bad in [
            "",
            "ftp://x/y",
            "file://rel",
            "s3://",
            "s3://Bad_Bucket!/x",
            "s3://b/../etc",
            "a\u{0}b",
        ] {
            assert!(Location::parse(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn keys_never_escape_their_prefix() {
        let base = ObjectKey::parse("tenants/t1").expect("valid");
        for bad in ["..", ".", "", "a/b", "a\\b", "x\ny"] {
            assert!(base.join(bad).is_err(), "{bad:?} should be refused");
        }
        assert_eq!(base.join("files").expect("ok").as_str(), "tenants/t1/files");
    }
}
