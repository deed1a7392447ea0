//! The file itself: locked against a second process, private to its owner, written
//! whole at a staged name and renamed into place, with copies set aside.

use super::error::LogError;
use super::record::{HEADER, MAGIC, encode};
use crate::embedded::db::Command;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// Permissions of every file this module creates: the owner's alone.
#[cfg(unix)]
pub(super) const PRIVATE: u32 = 0o600;

pub(super) fn sync_dir(path: &Path) -> std::io::Result<()> {
    match path.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(dir) => File::open(dir)?.sync_all(),
        None => File::open(".")?.sync_all(),
    }
}

pub(super) fn lock(file: &File, path: &Path) -> Result<(), LogError> {
    file.try_lock().map_err(|e| match e {
        std::fs::TryLockError::WouldBlock => LogError::InUse(path.to_path_buf()),
        std::fs::TryLockError::Error(source) => LogError::Io {
            path: path.to_path_buf(),
            source,
        },
    })
}

/// Makes `file` readable and writable by its owner only, if it is not already.
pub(super) fn make_private(file: &File, path: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = file.metadata()?.permissions().mode();
        if mode & 0o077 != 0 {
            tracing::warn!(
                path = %path.display(),
                mode = format!("{:o}", mode & 0o777),
                "the queue file was readable by others; it is now private (0600)"
            );
            file.set_permissions(std::fs::Permissions::from_mode(PRIVATE))?;
        }
    }
    #[cfg(not(unix))]
    let _ = (file, path);
    Ok(())
}

/// Options that create a file private to its owner.
pub(super) fn private_options() -> OpenOptions {
    let mut options = OpenOptions::new();
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, PRIVATE);
    options
}

/// Opens the file at `path` for reading and writing (creating it, 0600, when `create`),
/// locks it, makes it private and reads it whole: how both opening and repairing start.
pub(super) fn open_locked(path: &Path, create: bool) -> Result<(File, Vec<u8>), LogError> {
    let io = |source| LogError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = private_options()
        .read(true)
        .write(true)
        .create(create)
        .truncate(false)
        .open(path)
        .map_err(io)?;
    lock(&file, path)?;
    make_private(&file, path).map_err(io)?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).map_err(io)?;
    Ok((file, bytes))
}

pub(super) fn unix_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Writes `bytes` to a new private file `<path>.<kind>-<unix time>` (a number added if
/// that name is taken), synced, and returns its name. Never overwrites anything.
pub(super) fn set_aside(path: &Path, kind: &str, bytes: &[u8]) -> std::io::Result<PathBuf> {
    let stem = format!("{}.{kind}-{}", path.display(), unix_time());
    for n in 0.. {
        let name = match n {
            0 => PathBuf::from(&stem),
            n => PathBuf::from(format!("{stem}-{n}")),
        };
        let mut file = match private_options().write(true).create_new(true).open(&name) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 1000 => continue,
            Err(e) => return Err(e),
        };
        file.write_all(bytes)?;
        file.sync_all()?;
        sync_dir(&name)?;
        return Ok(name);
    }
    Err(std::io::Error::other("no free name to set a copy aside"))
}

/// `<path><suffix>`.
pub(super) fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// A file written whole at a staged name: its handle, salt, next sequence and length.
pub(super) struct Written {
    pub(super) file: File,
    pub(super) salt: [u8; 8],
    pub(super) next_seq: u64,
    pub(super) len: u64,
}

/// Writes a whole new file at `staged` in the current format, with a new salt: the
/// header and one record per batch, synced, and locked before it takes the real name
/// so no other process can open it unlocked.
pub(super) fn write_new<'a>(
    staged: &Path,
    batches: impl IntoIterator<Item = &'a [Command]>,
) -> Result<Written, LogError> {
    let io = |source| LogError::Io {
        path: staged.to_path_buf(),
        source,
    };
    let mut file = private_options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(staged)
        .map_err(io)?;
    lock(&file, staged)?;
    // A stale staged file of a crashed run keeps its old mode when opened.
    make_private(&file, staged).map_err(io)?;
    let salt: [u8; 8] = rand::random();
    let mut out = std::io::BufWriter::new(&mut file);
    out.write_all(MAGIC).map_err(io)?;
    out.write_all(&salt).map_err(io)?;
    let mut len = HEADER as u64;
    let mut seq = 1;
    for batch in batches {
        let record = encode(batch, &salt, seq);
        out.write_all(&record).map_err(io)?;
        len += record.len() as u64;
        seq += 1;
    }
    out.flush().map_err(io)?;
    drop(out);
    file.sync_all().map_err(io)?;
    Ok(Written {
        file,
        salt,
        next_seq: seq,
        len,
    })
}

/// Moves a staged file over `path` and makes the rename durable.
pub(super) fn install(staged: &Path, path: &Path) -> std::io::Result<()> {
    std::fs::rename(staged, path)?;
    sync_dir(path)
}
