//! The embedded store's one file: a header, then records. A record is one atomic batch
//! of changes (everything one queue operation changed), synced to disk before the
//! operation is acknowledged.
//!
//! # Format
//!
//! The header is `TUNEQQ02` and 8 random bytes (the file's *salt*). A record is
//! `length (u32) | sequence (u64) | CRC-32 of the body (u32) | CRC-32 of the salt,
//! length, sequence and body CRC (u32) | body`, little-endian. Sequence numbers count
//! from 1 in each file, one per record. The frame has a checksum of its own, so a
//! damaged length can never pass for a record cut short; the sequence tells a record
//! that follows damage from an old one; and the salt means a job payload that happens
//! to hold bytes shaped like a record (or was crafted to) never checks out as one.
//!
//! Files of the first format (`TUNEQQ01`, frames of `length | CRC-32 of the body`) are
//! still read: opening one rewrites its records in the current format (atomically, as
//! compaction does) before anything is appended.
//!
//! # Damage and torn writes
//!
//! Only the last record can have been torn by a crash, and it was never acknowledged,
//! so it may go. Anything else that fails its checks is damage to acknowledged records,
//! and opening refuses the file ([`LogError::Corrupt`]) without touching it; an operator
//! then runs [`repair`] (`tuneq queue repair`), which keeps every intact record, or
//! restores a backup. After the last intact record the rest of the file is a torn write
//! only when *nothing valid follows it anywhere* and it looks like one:
//!
//! - it is shorter than a frame, or all zeros;
//! - its frame checks out and the file ends before the length it declares (a write
//!   cut short, as a killed process leaves it);
//! - it ends in at least [`ZERO_TAIL`] zero bytes: the file grew but the last blocks'
//!   data never reached the disk, as a power cut can leave it. No encoded record ends
//!   so: a body ends with its last argument's bytes, which are text.
//!
//! A full-length last record whose checksum fails and that does not end in zeros is
//! *damage*, not a torn write: a torn append leaves a prefix of the record, or blocks
//! the disk never wrote (zeros), never other bytes of the right length. So is a last
//! record that checks out in its frame but fails in its body while more bytes follow
//! it: a later write began, so it had been synced and acknowledged. Refusing may cost
//! a manual repair after a rare crash on a file system that exposes stale blocks;
//! accepting would silently drop acknowledged work. The bytes of a torn tail are
//! copied aside (`<file>.torn-<unix time>`) before the file is cut.
//!
//! Compaction writes the live keys as records into a new file, syncs it and renames it
//! over the old one, so a crash leaves either file whole. Every file this module
//! creates (the queue file, staged files, copies set aside) is private to its owner
//! (mode 0600), and an existing queue file readable by others is made private on open:
//! it holds job payloads and API keys.
//!
//! The file is locked while open, so a second process cannot write it at the same time.
//!
//! Layout: `record` (the bytes: frames, records, walking them, torn writes), `file`
//! (locking, privacy, staged writes and renames), `error` ([`LogError`]); this module
//! holds [`Log`] (open, append, compact) and [`repair`].

mod error;
mod file;
mod record;
#[cfg(test)]
mod tests;

pub use error::LogError;
use file::*;
use record::*;

use super::db::Command;
use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// Commands per record when writing a snapshot.
const SNAPSHOT_RECORD: usize = 1024;

/// The log is compacted once it is this big and four times its last compacted size.
pub const COMPACT_AT_BYTES: u64 = 64 << 20;

/// The open file, positioned at its end.
#[derive(Debug)]
pub struct Log {
    file: File,
    path: PathBuf,
    salt: [u8; 8],
    next_seq: u64,
    len: u64,
    compacted_len: u64,
    /// Where the next compaction stops as a crash would (a test hook).
    #[cfg(feature = "testing")]
    pub(super) crash: Option<CompactionCrash>,
    /// Appends that fail as on a full disk, after writing half their record (a test
    /// hook).
    #[cfg(feature = "testing")]
    pub(super) failing_appends: u32,
}

/// The points [`Log::compact`] passes a test hook at.
#[cfg(feature = "testing")]
use CompactionCrash as CompactionCrashPoint;

/// The points [`Log::compact`] passes (a test hook stops at them with `testing`).
#[cfg(not(feature = "testing"))]
#[derive(Debug, Clone, Copy)]
enum CompactionCrashPoint {
    BeforeRename,
    AfterRename,
}

/// A point of a compaction where a test makes it stop as if the process had crashed
/// there, leaving the files on disk as that crash would (`testing` feature only).
#[cfg(feature = "testing")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompactionCrash {
    /// The new file is written and synced under its staged name (`<file>.compacting`),
    /// not yet renamed over the old one. (A crash while it was being written leaves a
    /// shorter staged file; tests cut this one to get that.)
    BeforeRename,
    /// The new file has taken the real name; the directory is not yet synced.
    AfterRename,
}

/// What opening found.
#[derive(Debug)]
pub struct Opened {
    /// The file, ready for appends.
    pub log: Log,
    /// Every whole record's changes, in order.
    pub batches: Vec<Vec<Command>>,
    /// Bytes of a torn last record that were cut off.
    pub truncated_bytes: u64,
    /// Where the cut bytes were copied, when there were any.
    pub torn_copy: Option<PathBuf>,
    /// The file was in the first format and has been rewritten in the current one.
    pub migrated: bool,
}

/// What [`repair`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepairReport {
    /// The file repaired.
    pub path: PathBuf,
    /// Where the original was copied before it was replaced; None when there was
    /// nothing to repair (the file was left as it was).
    pub original_copy: Option<PathBuf>,
    /// Intact records kept, in their order.
    pub kept_records: usize,
    /// The byte ranges dropped, in order.
    pub dropped: Vec<DroppedRange>,
}

/// A stretch of the file that held no intact record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DroppedRange {
    /// First byte.
    pub start: u64,
    /// One past the last byte.
    pub end: u64,
    /// Records lost in it, when the sequence numbers around it tell (files in the
    /// current format, damage followed by an intact record).
    pub records: Option<u64>,
}

impl RepairReport {
    /// Bytes dropped in all.
    pub fn dropped_bytes(&self) -> u64 {
        self.dropped.iter().map(|d| d.end - d.start).sum()
    }
}

impl Log {
    /// Opens (or creates) the file at `path`, locks it and reads its records. A torn
    /// last record is cut off (its bytes copied aside first); damage anywhere else is
    /// refused with [`LogError::Corrupt`], the file untouched. A file in the first
    /// format is rewritten in the current one.
    pub fn open(path: &Path) -> Result<Opened, LogError> {
        let io = |source| LogError::Io {
            path: path.to_path_buf(),
            source,
        };
        let (mut file, bytes) = open_locked(path, true)?;
        let Some(format) = format_of(&bytes, path)? else {
            // New, or cut inside its header while being created: start it afresh.
            return Self::start_afresh(file, path);
        };
        let walk = walk(&bytes, format);
        let whole = intact_len(&walk, &bytes, format, path)?;
        let truncated_bytes = (bytes.len() - whole) as u64;
        let mut torn_copy = None;
        if truncated_bytes > 0 {
            torn_copy = Some(cut_torn_tail(&file, path, &bytes, whole).map_err(io)?);
        }
        let batches: Vec<Vec<Command>> = walk.records.into_iter().map(|(_, b)| b).collect();
        let log = match format {
            Format::V2 { salt } => {
                file.seek(SeekFrom::Start(whole as u64)).map_err(io)?;
                let next_seq = batches.len() as u64 + 1;
                Log::at(file, path, salt, next_seq, whole as u64)
            }
            Format::V1 => Self::migrate(path, &batches)?,
        };
        Ok(Opened {
            log,
            batches,
            truncated_bytes,
            torn_copy,
            migrated: matches!(format, Format::V1),
        })
    }

    /// The log of `file` at `path`, `len` bytes long and compacted up to there, whose
    /// next record is `next_seq`.
    fn at(file: File, path: &Path, salt: [u8; 8], next_seq: u64, len: u64) -> Log {
        Log {
            file,
            path: path.to_path_buf(),
            salt,
            next_seq,
            len,
            compacted_len: len,
            #[cfg(feature = "testing")]
            crash: None,
            #[cfg(feature = "testing")]
            failing_appends: 0,
        }
    }

    /// Writes a fresh header (a new salt) into `file`, a new file or one cut inside its
    /// header, and opens it empty.
    fn start_afresh(mut file: File, path: &Path) -> Result<Opened, LogError> {
        let io = |source| LogError::Io {
            path: path.to_path_buf(),
            source,
        };
        let salt: [u8; 8] = rand::random();
        file.set_len(0).map_err(io)?;
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        file.write_all(MAGIC).map_err(io)?;
        file.write_all(&salt).map_err(io)?;
        file.sync_all().map_err(io)?;
        sync_dir(path).map_err(io)?;
        Ok(Opened {
            log: Log::at(file, path, salt, 1, HEADER as u64),
            batches: Vec::new(),
            truncated_bytes: 0,
            torn_copy: None,
            migrated: false,
        })
    }

    /// Rewrites the file at `path`, in the first format, in the current one with the
    /// same `batches`, and opens the new file.
    fn migrate(path: &Path, batches: &[Vec<Command>]) -> Result<Log, LogError> {
        let staged = with_suffix(path, ".migrating");
        let written = write_new(&staged, batches.iter().map(Vec::as_slice))?;
        install(&staged, path).map_err(|source| LogError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        tracing::info!(
            path = %path.display(),
            records = batches.len(),
            "queue file rewritten in the current format (TUNEQQ02)"
        );
        Ok(Log::at(
            written.file,
            path,
            written.salt,
            written.next_seq,
            written.len,
        ))
    }

    fn io(&self, source: std::io::Error) -> LogError {
        LogError::Io {
            path: self.path.clone(),
            source,
        }
    }

    /// Appends one batch and syncs it to disk.
    pub fn append(&mut self, batch: &[Command]) -> Result<(), LogError> {
        let record = encode(batch, &self.salt, self.next_seq);
        #[cfg(feature = "testing")]
        if self.failing_appends > 0 {
            self.failing_appends -= 1;
            self.file
                .write_all(&record[..record.len() / 2])
                .map_err(|e| self.io(e))?;
            return Err(self.io(std::io::Error::from_raw_os_error(28)));
        }
        self.file.write_all(&record).map_err(|e| self.io(e))?;
        self.file.sync_data().map_err(|e| self.io(e))?;
        self.len += record.len() as u64;
        self.next_seq += 1;
        Ok(())
    }

    /// Goes back to the last record that was written whole: cuts off whatever a failed
    /// [`Log::append`] left after it (a partial record, on a full disk) and reads the
    /// file's records again, through the handle this log holds (and the lock on it), for
    /// the caller to rebuild its memory from. Needs no free space: a file only shrinks.
    pub fn rewind(&mut self) -> Result<Vec<Vec<Command>>, LogError> {
        use std::io::Read;
        self.file.set_len(self.len).map_err(|e| self.io(e))?;
        self.file.sync_all().map_err(|e| self.io(e))?;
        self.file.seek(SeekFrom::Start(0)).map_err(|e| self.io(e))?;
        let mut bytes = Vec::with_capacity(usize::try_from(self.len).unwrap_or(0));
        (&self.file)
            .read_to_end(&mut bytes)
            .map_err(|e| self.io(e))?;
        self.file
            .seek(SeekFrom::Start(self.len))
            .map_err(|e| self.io(e))?;
        let format = Format::V2 { salt: self.salt };
        let walk = walk(&bytes, format);
        if let Some((first, before)) = walk.damage.first() {
            return Err(LogError::Corrupt {
                path: self.path.clone(),
                offset: first.start as u64,
                intact_before: *before,
                valid_after: walk.records.len() - before,
            });
        }
        Ok(walk.records.into_iter().map(|(_, batch)| batch).collect())
    }

    /// Whether the file has grown enough to be worth compacting.
    pub fn wants_compaction(&self) -> bool {
        self.len > COMPACT_AT_BYTES && self.len > self.compacted_len.saturating_mul(4)
    }

    /// Replaces the file's content with `snapshot` (the commands that recreate every
    /// live key), atomically. `Ok(false)` when the new file could not be written: the
    /// old one is untouched and stays in use. An error after the rename leaves the file
    /// in an unknown state, and the caller must stop writing.
    pub fn compact(&mut self, snapshot: &[Command]) -> Result<bool, LogError> {
        let staged = with_suffix(&self.path, ".compacting");
        let written = match write_new(&staged, snapshot.chunks(SNAPSHOT_RECORD)) {
            Ok(written) => written,
            Err(e) => {
                tracing::warn!(error = %e, "queue file compaction skipped");
                let _ = std::fs::remove_file(&staged);
                return Ok(false);
            }
        };
        self.crash_point(CompactionCrashPoint::BeforeRename)?;
        std::fs::rename(&staged, &self.path).map_err(|e| self.io(e))?;
        self.crash_point(CompactionCrashPoint::AfterRename)?;
        self.file = written.file;
        self.salt = written.salt;
        self.next_seq = written.next_seq;
        self.len = written.len;
        self.compacted_len = written.len;
        sync_dir(&self.path).map_err(|e| self.io(e))?;
        Ok(true)
    }

    /// Stops here as a crash would, when a test asked for it (see [`CompactionCrash`]).
    #[cfg(feature = "testing")]
    fn crash_point(&mut self, here: CompactionCrash) -> Result<(), LogError> {
        if self.crash != Some(here) {
            return Ok(());
        }
        self.crash = None;
        Err(self.io(std::io::Error::other(format!(
            "compaction stopped {here:?} (a test's simulated crash)"
        ))))
    }

    /// Without the `testing` feature there is nothing to stop for.
    #[cfg(not(feature = "testing"))]
    fn crash_point(&mut self, _here: CompactionCrashPoint) -> Result<(), LogError> {
        Ok(())
    }

    /// The file's size in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Repairs a damaged queue file, when explicitly asked (`tuneq queue repair`): copies
/// the original aside (`<file>.corrupt-<unix time>`), keeps every intact record,
/// before and after the damage, in order, and writes them as a new file in the current
/// format that replaces the old one atomically. A file with nothing to repair is left
/// as it is. The file must not be in use.
///
/// Records lost to the damage are gone: what the kept ones replay to may be missing
/// changes (a job's record without the job it updated). Check the queue afterwards.
pub fn repair(path: &Path) -> Result<RepairReport, LogError> {
    let io = |source| LogError::Io {
        path: path.to_path_buf(),
        source,
    };
    let (file, bytes) = open_locked(path, false)?;
    let nothing = |kept| RepairReport {
        path: path.to_path_buf(),
        original_copy: None,
        kept_records: kept,
        dropped: Vec::new(),
    };
    let Some(format) = format_of(&bytes, path)? else {
        return Ok(nothing(0));
    };
    let walk = walk(&bytes, format);
    if walk.damage.is_empty() {
        return Ok(nothing(walk.records.len()));
    }
    let dropped = walk
        .damage
        .iter()
        .map(|(range, before)| {
            let seq_before = before
                .checked_sub(1)
                .map_or(Some(0), |i| walk.records.get(i).map(|r| r.0));
            let seq_after = walk.records.get(*before).map(|r| r.0);
            let records = match (format, seq_before, seq_after) {
                (Format::V2 { .. }, Some(b), Some(a)) => Some(a.saturating_sub(b + 1)),
                _ => None,
            };
            DroppedRange {
                start: range.start as u64,
                end: range.end as u64,
                records,
            }
        })
        .collect();
    let original_copy = set_aside(path, "corrupt", &bytes).map_err(io)?;
    let staged = with_suffix(path, ".repairing");
    // Held (locked) until the new file has the real name.
    let _written = match write_new(&staged, walk.records.iter().map(|(_, b)| b.as_slice())) {
        Ok(written) => written,
        Err(e) => {
            let _ = std::fs::remove_file(&staged);
            return Err(e);
        }
    };
    install(&staged, path).map_err(io)?;
    drop(file);
    Ok(RepairReport {
        path: path.to_path_buf(),
        original_copy: Some(original_copy),
        kept_records: walk.records.len(),
        dropped,
    })
}

/// How many of `bytes` (the file at `path`, walked as `walk`) are whole records: all
/// of them, or up to a torn last record. Damage anywhere else is refused with
/// [`LogError::Corrupt`].
fn intact_len(walk: &Walk, bytes: &[u8], format: Format, path: &Path) -> Result<usize, LogError> {
    let Some((first, before)) = walk.damage.first() else {
        return Ok(bytes.len());
    };
    let last_seq = before
        .checked_sub(1)
        .and_then(|i| walk.records.get(i))
        .map_or(0, |r| r.0);
    let final_tail = walk.damage.len() == 1 && first.end == bytes.len();
    if !final_tail || !is_torn(bytes, first.start, format, last_seq + 1) {
        return Err(LogError::Corrupt {
            path: path.to_path_buf(),
            offset: first.start as u64,
            intact_before: *before,
            valid_after: walk.records.len() - before,
        });
    }
    Ok(first.start)
}

/// Copies the torn tail of `bytes` (from `whole` on) aside, then cuts `file` back to
/// its whole records. Returns where the copy went.
fn cut_torn_tail(file: &File, path: &Path, bytes: &[u8], whole: usize) -> std::io::Result<PathBuf> {
    let copy = set_aside(path, "torn", &bytes[whole..])?;
    tracing::warn!(
        path = %path.display(),
        offset = whole,
        bytes = bytes.len() - whole,
        copy = %copy.display(),
        "cut off the torn last record of the queue file (a crash mid-write; it was \
         never acknowledged); its bytes were copied aside"
    );
    file.set_len(whole as u64)?;
    file.sync_all()?;
    Ok(copy)
}
