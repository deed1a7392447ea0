//! A Hugging Face–layout model folder's weights, as registration and the trainer both
//! read them: which safetensors files hold the weights (in load order), what a file's
//! header lists, and the folder's identity — the SHA-256 that fingerprints every run
//! trained on it, and a cheap stamp that says whether that hash still holds.
//!
//! The hash reads every byte of the weights (about 14 GB for a 7B model in bf16), so
//! registration computes it once and hands it to the trainer with the stamp; the
//! trainer hashes again only where the stamp of the folder it sees differs.

use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};
use tuneq_openapi::ModelIdentity;

/// The index of a sharded checkpoint.
pub const INDEX: &str = "model.safetensors.index.json";

/// The weights of an unsharded checkpoint.
pub const SINGLE: &str = "model.safetensors";

/// The largest index read (real ones are tens of KiB).
const INDEX_LIMIT: u64 = 16 << 20;

/// Why a folder's weights cannot be listed, read or hashed.
#[derive(Debug, thiserror::Error)]
pub enum FolderError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The index is too large, not JSON, or has no `weight_map`.
    #[error("{INDEX}: {0}")]
    Index(String),
    /// The index names a shard the folder lacks (or a path, never taken).
    #[error("{INDEX} names the shard {0}, which the folder lacks")]
    MissingShard(String),
    /// The folder has neither an index nor a single weights file.
    #[error("neither {SINGLE} nor {INDEX} is in the folder")]
    NoWeights,
}

impl FolderError {
    fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Self + '_ {
        move |source| Self::Io {
            path: path.display().to_string(),
            source,
        }
    }
}

/// The safetensors files of the folder `dir`, in load order: the shards its index
/// names (sorted, each a plain file name in the folder, never a path out of it), or its
/// single `model.safetensors`. Every missing shard is an error; the first is named.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, FolderError> {
    let shards = shard_names(dir)?;
    if shards.is_empty() {
        let single = dir.join(SINGLE);
        return match single.is_file() {
            true => Ok(vec![single]),
            false => Err(FolderError::NoWeights),
        };
    }
    if let Some(missing) = missing_shards(dir, &shards).into_iter().next() {
        return Err(FolderError::MissingShard(missing));
    }
    Ok(shards.iter().map(|shard| dir.join(shard)).collect())
}

/// The shards the folder's index names, sorted and without repeats; none without an
/// index.
pub fn shard_names(dir: &Path) -> Result<Vec<String>, FolderError> {
    let path = dir.join(INDEX);
    let Ok(meta) = std::fs::metadata(&path) else {
        return Ok(Vec::new());
    };
    if meta.len() > INDEX_LIMIT {
        return Err(FolderError::Index("larger than 16 MiB".into()));
    }
    let bytes = std::fs::read(&path).map_err(FolderError::io(&path))?;
    let index: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| FolderError::Index(format!("not JSON ({e})")))?;
    let map = index["weight_map"]
        .as_object()
        .ok_or_else(|| FolderError::Index("no \"weight_map\" object".into()))?;
    let mut shards: Vec<String> = map
        .values()
        .filter_map(|f| f.as_str().map(str::to_string))
        .collect();
    shards.sort();
    shards.dedup();
    Ok(shards)
}

/// The shards among `shards` the folder lacks, a name that is a path counted as
/// lacking.
pub fn missing_shards(dir: &Path, shards: &[String]) -> Vec<String> {
    shards
        .iter()
        .filter(|shard| {
            let plain = !shard.contains('/') && !shard.contains('\\') && *shard != "..";
            !plain || !dir.join(shard).is_file()
        })
        .cloned()
        .collect()
}

/// Why a safetensors header cannot be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    /// The file ends before its header does.
    #[error("is too short to be a safetensors file")]
    TooShort,
    /// The header is longer than the limit the reader set.
    #[error("has a header longer than the {0} bytes read")]
    TooLong(u64),
    /// Reading failed.
    #[error("cannot be read")]
    Unreadable,
    /// The header is not a JSON object.
    #[error("has a header that is not a JSON object")]
    NotJson,
}

/// A safetensors file's header: each tensor's entry (`dtype`, `shape`, `data_offsets`)
/// by name, `__metadata__` left out, and where the tensor data starts.
pub struct Header {
    /// Each tensor's entry by name.
    pub tensors: serde_json::Map<String, serde_json::Value>,
    /// The offset of the first byte of tensor data in the file.
    pub data_start: u64,
}

/// Reads the header at the start of `file`, at most `limit` bytes of it.
pub fn read_header(file: &mut impl Read, limit: u64) -> Result<Header, HeaderError> {
    let mut len = [0u8; 8];
    file.read_exact(&mut len)
        .map_err(|_| HeaderError::TooShort)?;
    let len = u64::from_le_bytes(len);
    if len > limit {
        return Err(HeaderError::TooLong(limit));
    }
    let mut header = Vec::with_capacity(len as usize);
    file.take(len)
        .read_to_end(&mut header)
        .map_err(|_| HeaderError::Unreadable)?;
    if header.len() as u64 != len {
        return Err(HeaderError::TooShort);
    }
    let mut tensors: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|_| HeaderError::NotJson)?;
    tensors.remove("__metadata__");
    Ok(Header {
        tensors,
        data_start: 8 + len,
    })
}

/// The files the identity covers: `config.json`, then the weight files in load order.
fn identity_files(dir: &Path) -> Result<Vec<PathBuf>, FolderError> {
    let mut files = vec![dir.join("config.json")];
    files.extend(weight_files(dir)?);
    Ok(files)
}

/// A hash of each covered file's name, length and modification time (whole seconds:
/// the API's machine and a trainer's may see the folder through mounts that keep times
/// more or less finely): equal while no file was replaced or rewritten, read from the
/// file system's metadata alone.
pub fn stamp(dir: &Path) -> Result<String, FolderError> {
    let mut h = Sha256::new();
    for file in identity_files(dir)? {
        let meta = std::fs::metadata(&file).map_err(FolderError::io(&file))?;
        let modified = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_secs());
        let name = file.file_name().map(|n| n.to_string_lossy().into_owned());
        h.update(format!("{}\0{}\0{modified}\n", name.unwrap_or_default(), meta.len()).as_bytes());
    }
    Ok(hex::encode(h.finalize()))
}

/// The folder's identity: every covered file read and hashed.
pub fn identity(dir: &Path) -> Result<ModelIdentity, FolderError> {
    let stamp = stamp(dir)?;
    let mut h = Sha256::new();
    for file in identity_files(dir)? {
        h.update(sha256_file(&file)?.as_bytes());
    }
    Ok(ModelIdentity {
        sha256: hex::encode(h.finalize()),
        stamp,
    })
}

/// The SHA-256 of one file, read in 1 MiB pieces.
pub fn sha256_file(path: &Path) -> Result<String, FolderError> {
    let mut file = std::fs::File::open(path).map_err(FolderError::io(path))?;
    let mut h = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buffer).map_err(FolderError::io(path))?;
        if n == 0 {
            return Ok(hex::encode(h.finalize()));
        }
        h.update(&buffer[..n]);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn safetensors(header: &str) -> Vec<u8> {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes
    }

    #[test]
    fn a_header_lists_its_tensors_without_the_metadata() {
        let bytes = safetensors(
            r#"{"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
        );
        let header = read_header(&mut bytes.as_slice(), 1 << 20).unwrap();
        assert_eq!(header.tensors.keys().collect::<Vec<_>>(), ["w"]);
        assert_eq!(header.data_start, bytes.len() as u64);
    }

    #[test]
    fn a_bad_header_says_what_is_wrong() {
        let long = safetensors(&format!("{{\"w\":\"{}\"}}", "x".repeat(64)));
        assert_eq!(
            read_header(&mut long.as_slice(), 16).err(),
            Some(HeaderError::TooLong(16))
        );
        assert_eq!(
            read_header(&mut &b"abc"[..], 16).err(),
            Some(HeaderError::TooShort)
        );
        let cut = &safetensors("{}")[..9];
        assert_eq!(
            read_header(&mut &cut[..], 16).err(),
            Some(HeaderError::TooShort)
        );
        let text = safetensors("[1]");
        assert_eq!(
            read_header(&mut text.as_slice(), 16).err(),
            Some(HeaderError::NotJson)
        );
    }

    #[test]
    fn shards_come_from_the_index_sorted_and_a_path_is_never_one() {
        let dir = tempfile::tempdir().unwrap();
        let index =
            r#"{"weight_map":{"a":"m-2.safetensors","b":"m-1.safetensors","c":"m-2.safetensors"}}"#;
        std::fs::write(dir.path().join(INDEX), index).unwrap();
        std::fs::write(dir.path().join("m-1.safetensors"), b"").unwrap();
        assert!(
            matches!(weight_files(dir.path()), Err(FolderError::MissingShard(s)) if s == "m-2.safetensors")
        );
        std::fs::write(dir.path().join("m-2.safetensors"), b"").unwrap();
        let names: Vec<_> = weight_files(dir.path())
            .unwrap()
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["m-1.safetensors", "m-2.safetensors"]);
        let escaping = r#"{"weight_map":{"a":"../m-1.safetensors"}}"#;
        std::fs::write(dir.path().join(INDEX), escaping).unwrap();
        assert!(matches!(
            weight_files(dir.path()),
            Err(FolderError::MissingShard(_))
        ));
    }

    #[test]
    fn the_identity_follows_the_bytes_and_the_stamp_follows_a_rewrite() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(identity(dir.path()), Err(FolderError::NoWeights)));
        std::fs::write(dir.path().join(SINGLE), b"one").unwrap();
        assert!(matches!(identity(dir.path()), Err(FolderError::Io { .. })));
        std::fs::write(dir.path().join("config.json"), b"{}").unwrap();
        let first = identity(dir.path()).unwrap();
        assert_eq!(first, identity(dir.path()).unwrap());
        std::fs::write(dir.path().join(SINGLE), b"two").unwrap();
        let second = identity(dir.path()).unwrap();
        assert_ne!(first.sha256, second.sha256);
        // Same length, another modification time: the stamp moves with it.
        let file = std::fs::File::options()
            .write(true)
            .open(dir.path().join(SINGLE))
            .unwrap();
        file.set_modified(std::time::UNIX_EPOCH + std::time::Duration::from_secs(1000))
            .unwrap();
        let touched = stamp(dir.path()).unwrap();
        assert_ne!(touched, second.stamp);
        file.set_modified(std::time::UNIX_EPOCH + std::time::Duration::from_secs(2000))
            .unwrap();
        assert_ne!(stamp(dir.path()).unwrap(), touched);
    }
}
