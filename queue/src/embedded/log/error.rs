//! Why the queue file could not be opened, written or repaired.

use std::path::PathBuf;

/// Why the file could not be opened, written or repaired.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// Reading, writing or syncing failed.
    #[error("queue file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Another process has the file open.
    #[error("queue file {0} is in use by another process (is another `tuneq up` running?)")]
    InUse(PathBuf),
    /// The file is not a tuneq queue file.
    #[error("{0} is not a tuneq queue file (unknown header)")]
    NotAQueueFile(PathBuf),
    /// Acknowledged records are damaged (a flipped bit, a bad block): not the torn last
    /// write of a crash, which opening handles by itself. The file was left untouched.
    #[error(
        "queue file {path} is damaged at byte {offset}: {intact_before} intact records \
         precede the damage and {}. The file was left untouched. Stop here and either run \
         `tuneq queue repair --file {path}` (it copies the file aside, then keeps every \
         intact record, before and after the damage) or restore the file from a backup",
        after_damage(*valid_after)
    )]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Where the first damaged record starts.
        offset: u64,
        /// Whole records before it.
        intact_before: usize,
        /// Whole records after it (0: the damaged record is the last one, but it is
        /// not a torn write).
        valid_after: usize,
    },
}

/// The part of [`LogError::Corrupt`]'s message about what follows the damage.
pub(super) fn after_damage(valid_after: usize) -> String {
    match valid_after {
        0 => "the damaged record is the last one but is not a torn write (it has its full \
              length, or more bytes follow it), so it had been acknowledged"
            .to_string(),
        n => format!("{n} valid records follow it, so it is not a torn last write"),
    }
}
