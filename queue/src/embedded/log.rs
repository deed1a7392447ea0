//! The embedded store's one file: a magic header, then records. A record is one atomic
//! batch of changes (everything one queue operation changed), framed as
//! `length (u32 LE) | CRC-32 of the body (u32 LE) | body`, and synced to disk before the
//! operation is acknowledged.
//!
//! Opening replays every whole record. A record cut short or damaged (the process died
//! while writing it) can only be the last one, which was never acknowledged: the file is
//! truncated just before it. Compaction writes the live keys as records into a new file,
//! syncs it and renames it over the old one, so a crash leaves either file whole.
//!
//! The file is locked while open, so a second process cannot write it at the same time.

use super::db::Command;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"TUNEQQ01";
const FRAME: usize = 8;
/// Commands per record when writing a snapshot.
const SNAPSHOT_RECORD: usize = 1024;
/// The log is compacted once it is this big and four times its last compacted size.
const COMPACT_AT_BYTES: u64 = 64 << 20;

/// Why the file could not be opened or written.
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
}

/// The open file, positioned at its end.
#[derive(Debug)]
pub struct Log {
    file: File,
    path: PathBuf,
    len: u64,
    compacted_len: u64,
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
}

fn encode(batch: &[Command]) -> Vec<u8> {
    let mut body = Vec::new();
    let put = |out: &mut Vec<u8>, n: usize| {
        out.extend_from_slice(&u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes());
    };
    put(&mut body, batch.len());
    for command in batch {
        put(&mut body, command.len());
        for arg in command {
            put(&mut body, arg.len());
            body.extend_from_slice(arg);
        }
    }
    let mut record = Vec::with_capacity(FRAME + body.len());
    put(&mut record, body.len());
    record.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
    record.extend_from_slice(&body);
    record
}

/// Reads a little-endian u32 at `*at`, advancing it; None past the end.
fn take_u32(bytes: &[u8], at: &mut usize) -> Option<usize> {
    let raw = bytes.get(*at..at.checked_add(4)?)?;
    *at += 4;
    usize::try_from(u32::from_le_bytes(raw.try_into().ok()?)).ok()
}

fn decode(body: &[u8]) -> Option<Vec<Command>> {
    let mut at = 0;
    let commands = take_u32(body, &mut at)?;
    let mut batch = Vec::with_capacity(commands.min(body.len()));
    for _ in 0..commands {
        let args = take_u32(body, &mut at)?;
        let mut command = Vec::with_capacity(args.min(body.len()));
        for _ in 0..args {
            let len = take_u32(body, &mut at)?;
            command.push(body.get(at..at.checked_add(len)?)?.to_vec());
            at += len;
        }
        batch.push(command);
    }
    (at == body.len()).then_some(batch)
}

/// Splits the records after the header; returns them and where the whole ones end.
fn parse(bytes: &[u8]) -> (Vec<Vec<Command>>, usize) {
    let mut at = MAGIC.len();
    let mut batches = Vec::new();
    loop {
        let start = at;
        let (Some(len), Some(crc)) = (take_u32(bytes, &mut at), take_u32(bytes, &mut at)) else {
            return (batches, start);
        };
        let Some(body) = at.checked_add(len).and_then(|end| bytes.get(at..end)) else {
            return (batches, start);
        };
        if crc32fast::hash(body) as usize != crc {
            return (batches, start);
        }
        let Some(batch) = decode(body) else {
            return (batches, start);
        };
        at += len;
        batches.push(batch);
    }
}

fn sync_dir(path: &Path) -> std::io::Result<()> {
    match path.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(dir) => File::open(dir)?.sync_all(),
        None => File::open(".")?.sync_all(),
    }
}

fn lock(file: &File, path: &Path) -> Result<(), LogError> {
    file.try_lock().map_err(|e| match e {
        std::fs::TryLockError::WouldBlock => LogError::InUse(path.to_path_buf()),
        std::fs::TryLockError::Error(source) => LogError::Io {
            path: path.to_path_buf(),
            source,
        },
    })
}

/// Writes a whole new file at `staged`: header and snapshot records, synced, locked
/// before it takes the real name so no other process can open it unlocked.
fn write_snapshot(staged: &Path, snapshot: &[Command]) -> Result<(File, u64), LogError> {
    let io = |source| LogError::Io {
        path: staged.to_path_buf(),
        source,
    };
    let mut file = File::create(staged).map_err(io)?;
    lock(&file, staged)?;
    let mut len = MAGIC.len() as u64;
    file.write_all(MAGIC).map_err(io)?;
    for chunk in snapshot.chunks(SNAPSHOT_RECORD) {
        let record = encode(chunk);
        file.write_all(&record).map_err(io)?;
        len += record.len() as u64;
    }
    file.sync_all().map_err(io)?;
    Ok((file, len))
}

impl Log {
    /// Opens (or creates) the file at `path`, locks it and reads its records.
    pub fn open(path: &Path) -> Result<Opened, LogError> {
        let io = |source| LogError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(io)?;
        lock(&file, path)?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).map_err(io)?;
        if bytes.is_empty() {
            file.write_all(MAGIC).map_err(io)?;
            file.sync_all().map_err(io)?;
            sync_dir(path).map_err(io)?;
            bytes.extend_from_slice(MAGIC);
        } else if !bytes.starts_with(MAGIC) {
            // A file cut inside its own header was being created and holds nothing.
            if bytes.len() < MAGIC.len() && MAGIC.starts_with(&bytes) {
                file.set_len(0).map_err(io)?;
                file.seek(SeekFrom::Start(0)).map_err(io)?;
                file.write_all(MAGIC).map_err(io)?;
                file.sync_all().map_err(io)?;
                bytes = MAGIC.to_vec();
            } else {
                return Err(LogError::NotAQueueFile(path.to_path_buf()));
            }
        }
        let (batches, whole) = parse(&bytes);
        let truncated_bytes = (bytes.len() - whole) as u64;
        if truncated_bytes > 0 {
            file.set_len(whole as u64).map_err(io)?;
            file.sync_all().map_err(io)?;
        }
        file.seek(SeekFrom::Start(whole as u64)).map_err(io)?;
        let len = whole as u64;
        Ok(Opened {
            log: Log {
                file,
                path: path.to_path_buf(),
                len,
                compacted_len: len,
            },
            batches,
            truncated_bytes,
        })
    }

    fn io(&self, source: std::io::Error) -> LogError {
        LogError::Io {
            path: self.path.clone(),
            source,
        }
    }

    /// Appends one batch and syncs it to disk.
    pub fn append(&mut self, batch: &[Command]) -> Result<(), LogError> {
        let record = encode(batch);
        self.file.write_all(&record).map_err(|e| self.io(e))?;
        self.file.sync_data().map_err(|e| self.io(e))?;
        self.len += record.len() as u64;
        Ok(())
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
        let mut name = self.path.as_os_str().to_owned();
        name.push(".compacting");
        let staged = PathBuf::from(name);
        let (file, len) = match write_snapshot(&staged, snapshot) {
            Ok(written) => written,
            Err(e) => {
                tracing::warn!(error = %e, "queue file compaction skipped");
                let _ = std::fs::remove_file(&staged);
                return Ok(false);
            }
        };
        std::fs::rename(&staged, &self.path).map_err(|e| self.io(e))?;
        self.file = file;
        self.len = len;
        self.compacted_len = len;
        sync_dir(&self.path).map_err(|e| self.io(e))?;
        Ok(true)
    }

    /// The file's size in bytes.
    #[cfg(test)]
    pub fn len(&self) -> u64 {
        self.len
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn cmd(line: &str) -> Command {
        line.split(' ').map(|s| s.as_bytes().to_vec()).collect()
    }

    #[test]
    fn records_round_trip_and_a_torn_tail_is_cut_off() {
        let dir = tempdir();
        let path = dir.join("q.db");
        let mut opened = Log::open(&path).unwrap();
        opened
            .log
            .append(&[cmd("SET a 1"), cmd("SET b 2")])
            .unwrap();
        opened.log.append(&[cmd("HSET h f v")]).unwrap();
        let whole = opened.log.len();
        opened.log.append(&[cmd("SET c 3")]).unwrap();
        drop(opened);
        // Tear the last record: keep only part of it.
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(whole + 5).unwrap();
        drop(f);
        let again = Log::open(&path).unwrap();
        assert_eq!(
            again.batches,
            vec![
                vec![cmd("SET a 1"), cmd("SET b 2")],
                vec![cmd("HSET h f v")]
            ]
        );
        assert_eq!(again.truncated_bytes, 5);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), whole);
    }

    #[test]
    fn a_damaged_record_ends_the_log() {
        let dir = tempdir();
        let path = dir.join("q.db");
        let mut opened = Log::open(&path).unwrap();
        opened.log.append(&[cmd("SET a 1")]).unwrap();
        let first = opened.log.len();
        opened.log.append(&[cmd("SET b 2")]).unwrap();
        drop(opened);
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
        std::fs::write(&path, &bytes).unwrap();
        let again = Log::open(&path).unwrap();
        assert_eq!(again.batches, vec![vec![cmd("SET a 1")]]);
        assert_eq!(again.log.len(), first);
    }

    #[test]
    fn a_second_opener_is_refused_and_foreign_files_are_not_touched() {
        let dir = tempdir();
        let path = dir.join("q.db");
        let _held = Log::open(&path).unwrap();
        assert!(matches!(Log::open(&path), Err(LogError::InUse(_))));
        let other = dir.join("notes.txt");
        std::fs::write(&other, "hello, this is not a queue").unwrap();
        assert!(matches!(Log::open(&other), Err(LogError::NotAQueueFile(_))));
        assert_eq!(
            std::fs::read_to_string(&other).unwrap(),
            "hello, this is not a queue"
        );
    }

    #[test]
    fn compaction_replaces_the_content_and_keeps_the_lock() {
        let dir = tempdir();
        let path = dir.join("q.db");
        let mut opened = Log::open(&path).unwrap();
        for i in 0..100 {
            opened.log.append(&[cmd(&format!("SET k{i} {i}"))]).unwrap();
        }
        assert!(opened.log.compact(&[cmd("SET k99 99")]).unwrap());
        opened.log.append(&[cmd("SET z 1")]).unwrap();
        assert!(matches!(Log::open(&path), Err(LogError::InUse(_))));
        drop(opened);
        let again = Log::open(&path).unwrap();
        assert_eq!(
            again.batches,
            vec![vec![cmd("SET k99 99")], vec![cmd("SET z 1")]]
        );
    }

    fn tempdir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "tuneq-log-{}-{}",
            std::process::id(),
            super::super::db::wall_clock_us()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
