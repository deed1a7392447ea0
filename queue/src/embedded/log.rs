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

use super::db::Command;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// The current format's magic.
const MAGIC: &[u8; 8] = b"TUNEQQ02";
/// The first format's magic (read, and rewritten in the current format on open).
const MAGIC_V1: &[u8; 8] = b"TUNEQQ01";
/// The current header: magic and salt.
const HEADER: usize = 16;
/// The current frame: length, sequence, body CRC, frame CRC.
const FRAME: usize = 20;
/// The first format's frame: length, body CRC.
const FRAME_V1: usize = 8;
/// A tail ending in this many zero bytes is a write whose last blocks never reached the
/// disk (see the module docs).
const ZERO_TAIL: usize = 16;
/// Commands per record when writing a snapshot.
const SNAPSHOT_RECORD: usize = 1024;
/// The log is compacted once it is this big and four times its last compacted size.
pub const COMPACT_AT_BYTES: u64 = 64 << 20;
/// Permissions of every file this module creates: the owner's alone.
#[cfg(unix)]
const PRIVATE: u32 = 0o600;

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
fn after_damage(valid_after: usize) -> String {
    match valid_after {
        0 => "the damaged record is the last one but is not a torn write (it has its full \
              length, or more bytes follow it), so it had been acknowledged"
            .to_string(),
        n => format!("{n} valid records follow it, so it is not a torn last write"),
    }
}

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

/// How a file's records are framed.
#[derive(Debug, Clone, Copy)]
enum Format {
    V1,
    V2 { salt: [u8; 8] },
}

impl Format {
    fn header(self) -> usize {
        match self {
            Format::V1 => MAGIC_V1.len(),
            Format::V2 { .. } => HEADER,
        }
    }

    fn frame(self) -> usize {
        match self {
            Format::V1 => FRAME_V1,
            Format::V2 { .. } => FRAME,
        }
    }
}

fn put_u32(out: &mut Vec<u8>, n: usize) {
    out.extend_from_slice(&u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes());
}

fn encode_body(batch: &[Command]) -> Vec<u8> {
    let mut body = Vec::new();
    put_u32(&mut body, batch.len());
    for command in batch {
        put_u32(&mut body, command.len());
        for arg in command {
            put_u32(&mut body, arg.len());
            body.extend_from_slice(arg);
        }
    }
    body
}

/// The checksum of a frame: the file's salt, the length, the sequence and the body's
/// checksum.
fn frame_crc(salt: &[u8; 8], len: u32, seq: u64, body_crc: u32) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(salt);
    h.update(&len.to_le_bytes());
    h.update(&seq.to_le_bytes());
    h.update(&body_crc.to_le_bytes());
    h.finalize()
}

/// One record in the current format.
fn encode(batch: &[Command], salt: &[u8; 8], seq: u64) -> Vec<u8> {
    let body = encode_body(batch);
    let len = u32::try_from(body.len()).unwrap_or(u32::MAX);
    let body_crc = crc32fast::hash(&body);
    let mut record = Vec::with_capacity(FRAME + body.len());
    record.extend_from_slice(&len.to_le_bytes());
    record.extend_from_slice(&seq.to_le_bytes());
    record.extend_from_slice(&body_crc.to_le_bytes());
    record.extend_from_slice(&frame_crc(salt, len, seq, body_crc).to_le_bytes());
    record.extend_from_slice(&body);
    record
}

/// Reads a little-endian u32 at `*at`, advancing it; None past the end.
fn take_u32(bytes: &[u8], at: &mut usize) -> Option<usize> {
    let raw = bytes.get(*at..at.checked_add(4)?)?;
    *at += 4;
    usize::try_from(u32::from_le_bytes(raw.try_into().ok()?)).ok()
}

fn read_u64(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(
        bytes.get(at..at.checked_add(8)?)?.try_into().ok()?,
    ))
}

fn decode(body: &[u8]) -> Option<Vec<Command>> {
    let mut at = 0;
    let commands = take_u32(body, &mut at)?;
    // Every record holds at least one command (an operation that changed nothing
    // writes none); this also rejects most of the offsets a scan tries at once.
    if commands == 0 || commands > body.len() / 4 {
        return None;
    }
    let mut batch = Vec::with_capacity(commands);
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

/// A current-format frame at `at` whose own checksum holds: its sequence and where
/// its record ends (which may be past the end of the file).
fn checked_frame(bytes: &[u8], at: usize, salt: &[u8; 8]) -> Option<(u64, usize)> {
    let mut pos = at;
    let len = take_u32(bytes, &mut pos)?;
    let seq = read_u64(bytes, pos)?;
    pos += 8;
    let body_crc = take_u32(bytes, &mut pos)?;
    let crc = take_u32(bytes, &mut pos)?;
    let len32 = u32::try_from(len).ok()?;
    let body_crc32 = u32::try_from(body_crc).ok()?;
    (frame_crc(salt, len32, seq, body_crc32) as usize == crc).then_some((seq, pos + len))
}

/// The whole, valid record at `at`: its changes, its sequence (0 in the first format,
/// which has none) and where it ends.
fn record_at(bytes: &[u8], at: usize, format: Format) -> Option<(Vec<Command>, u64, usize)> {
    match format {
        Format::V1 => {
            let mut pos = at;
            let len = take_u32(bytes, &mut pos)?;
            let crc = take_u32(bytes, &mut pos)?;
            // Cheap checks first: a scan tries every offset.
            let body = bytes.get(pos..pos.checked_add(len)?)?;
            if len < 4 || take_u32(body, &mut 0)? > len / 4 {
                return None;
            }
            if crc32fast::hash(body) as usize != crc {
                return None;
            }
            Some((decode(body)?, 0, pos + len))
        }
        Format::V2 { salt } => {
            let (seq, end) = checked_frame(bytes, at, &salt)?;
            let body = bytes.get(at + FRAME..end)?;
            let mut crc_at = at + 12;
            if crc32fast::hash(body) as usize != take_u32(bytes, &mut crc_at)? {
                return None;
            }
            Some((decode(body)?, seq, end))
        }
    }
}

/// Every valid record in the file, and the stretches between them that hold none.
#[derive(Debug, Default)]
struct Walk {
    /// Each record's sequence (0 in the first format) and changes, in order.
    records: Vec<(u64, Vec<Command>)>,
    /// Stretches with no valid record, with how many records precede each.
    damage: Vec<(Range<usize>, usize)>,
}

/// Reads the records after the header. Records follow each other, their sequences
/// counting up by one; where that stops, the bytes after are scanned for the next
/// valid record with a higher sequence (any valid record, in the first format), and
/// reading goes on from there.
fn walk(bytes: &[u8], format: Format) -> Walk {
    let mut out = Walk::default();
    let mut at = format.header();
    let mut last_seq = 0u64;
    while at < bytes.len() {
        if let Some((batch, seq, end)) = record_at(bytes, at, format) {
            let in_order = matches!(format, Format::V1) || seq == last_seq + 1;
            if in_order || seq > last_seq {
                if !in_order {
                    // Whole records are missing, though no byte is out of place.
                    out.damage.push((at..at, out.records.len()));
                }
                out.records.push((seq, batch));
                last_seq = seq;
                at = end;
                continue;
            }
        }
        // A frame that checks out tells exactly where the next record starts: nothing
        // inside its body is looked at.
        let resume = match format {
            Format::V2 { salt } => match checked_frame(bytes, at, &salt) {
                Some((seq, end)) if seq == last_seq + 1 && end <= bytes.len() => end,
                _ => at + 1,
            },
            Format::V1 => at + 1,
        };
        let next = (resume..bytes.len()).find_map(|from| {
            let (batch, seq, end) = record_at(bytes, from, format)?;
            (matches!(format, Format::V1) || seq > last_seq).then_some((from, batch, seq, end))
        });
        let Some((from, batch, seq, end)) = next else {
            out.damage.push((at..bytes.len(), out.records.len()));
            break;
        };
        out.damage.push((at..from, out.records.len()));
        out.records.push((seq, batch));
        last_seq = seq;
        at = end;
    }
    out
}

/// Whether the bytes from `at` to the end, after the last intact record and with no
/// valid record anywhere in them, are a torn write (see the module docs).
fn is_torn(bytes: &[u8], at: usize, format: Format, expected_seq: u64) -> bool {
    let tail = bytes.get(at..).unwrap_or_default();
    let zeros = tail.iter().rev().take_while(|b| **b == 0).count();
    if tail.len() < format.frame() || zeros == tail.len() {
        return true;
    }
    match format {
        Format::V2 { salt } => match checked_frame(bytes, at, &salt) {
            // The frame is intact, so its length is the one that was written.
            Some((seq, end)) if seq == expected_seq => {
                end > bytes.len() || (end == bytes.len() && zeros >= ZERO_TAIL)
            }
            _ => zeros >= ZERO_TAIL,
        },
        Format::V1 => {
            if zeros >= ZERO_TAIL {
                return true;
            }
            let mut pos = at;
            let (Some(len), Some(crc)) = (take_u32(bytes, &mut pos), take_u32(bytes, &mut pos))
            else {
                return true;
            };
            // The first format does not check its lengths: a record cut short is one
            // whose bytes are not a whole record under a damaged length.
            pos.saturating_add(len) > bytes.len()
                && crc32fast::hash(&tail[FRAME_V1..]) as usize != crc
        }
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

/// Makes `file` readable and writable by its owner only, if it is not already.
fn make_private(file: &File, path: &Path) -> std::io::Result<()> {
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
fn private_options() -> OpenOptions {
    let mut options = OpenOptions::new();
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, PRIVATE);
    options
}

/// Opens the file at `path` for reading and writing (creating it, 0600, when `create`),
/// locks it, makes it private and reads it whole: how both opening and repairing start.
fn open_locked(path: &Path, create: bool) -> Result<(File, Vec<u8>), LogError> {
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

fn unix_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Writes `bytes` to a new private file `<path>.<kind>-<unix time>` (a number added if
/// that name is taken), synced, and returns its name. Never overwrites anything.
fn set_aside(path: &Path, kind: &str, bytes: &[u8]) -> std::io::Result<PathBuf> {
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
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// A file written whole at a staged name: its handle, salt, next sequence and length.
struct Written {
    file: File,
    salt: [u8; 8],
    next_seq: u64,
    len: u64,
}

/// Writes a whole new file at `staged` in the current format, with a new salt: the
/// header and one record per batch, synced, and locked before it takes the real name
/// so no other process can open it unlocked.
fn write_new<'a>(
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
fn install(staged: &Path, path: &Path) -> std::io::Result<()> {
    std::fs::rename(staged, path)?;
    sync_dir(path)
}

/// Reads the header: the format, or None for a file cut inside its header while it
/// was being created (it holds nothing).
fn format_of(bytes: &[u8], path: &Path) -> Result<Option<Format>, LogError> {
    if bytes.starts_with(MAGIC) {
        return Ok(match bytes.get(MAGIC.len()..HEADER) {
            Some(salt) => salt.try_into().ok().map(|salt| Format::V2 { salt }),
            None => None,
        });
    }
    if bytes.starts_with(MAGIC_V1) {
        return Ok(Some(Format::V1));
    }
    if bytes.len() < MAGIC.len() && (MAGIC.starts_with(bytes) || MAGIC_V1.starts_with(bytes)) {
        return Ok(None);
    }
    Err(LogError::NotAQueueFile(path.to_path_buf()))
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
            let salt: [u8; 8] = rand::random();
            file.set_len(0).map_err(io)?;
            file.seek(SeekFrom::Start(0)).map_err(io)?;
            file.write_all(MAGIC).map_err(io)?;
            file.write_all(&salt).map_err(io)?;
            file.sync_all().map_err(io)?;
            sync_dir(path).map_err(io)?;
            return Ok(Opened {
                log: Log {
                    file,
                    path: path.to_path_buf(),
                    salt,
                    next_seq: 1,
                    len: HEADER as u64,
                    compacted_len: HEADER as u64,
                    #[cfg(feature = "testing")]
                    crash: None,
                },
                batches: Vec::new(),
                truncated_bytes: 0,
                torn_copy: None,
                migrated: false,
            });
        };
        let walk = walk(&bytes, format);
        let mut whole = bytes.len();
        if let Some((first, before)) = walk.damage.first() {
            let last_seq = before
                .checked_sub(1)
                .and_then(|i| walk.records.get(i))
                .map_or(0, |r| r.0);
            let final_tail = walk.damage.len() == 1 && first.end == bytes.len();
            if !final_tail || !is_torn(&bytes, first.start, format, last_seq + 1) {
                return Err(LogError::Corrupt {
                    path: path.to_path_buf(),
                    offset: first.start as u64,
                    intact_before: *before,
                    valid_after: walk.records.len() - before,
                });
            }
            whole = first.start;
        }
        let truncated_bytes = (bytes.len() - whole) as u64;
        let mut torn_copy = None;
        if truncated_bytes > 0 {
            let copy = set_aside(path, "torn", &bytes[whole..]).map_err(io)?;
            tracing::warn!(
                path = %path.display(),
                offset = whole,
                bytes = truncated_bytes,
                copy = %copy.display(),
                "cut off the torn last record of the queue file (a crash mid-write; it was \
                 never acknowledged); its bytes were copied aside"
            );
            file.set_len(whole as u64).map_err(io)?;
            file.sync_all().map_err(io)?;
            torn_copy = Some(copy);
        }
        let batches: Vec<Vec<Command>> = walk.records.into_iter().map(|(_, b)| b).collect();
        let log = match format {
            Format::V2 { salt } => {
                file.seek(SeekFrom::Start(whole as u64)).map_err(io)?;
                let next_seq = batches.len() as u64 + 1;
                Log {
                    file,
                    path: path.to_path_buf(),
                    salt,
                    next_seq,
                    len: whole as u64,
                    compacted_len: whole as u64,
                    #[cfg(feature = "testing")]
                    crash: None,
                }
            }
            Format::V1 => {
                let staged = with_suffix(path, ".migrating");
                let written = write_new(&staged, batches.iter().map(Vec::as_slice))?;
                install(&staged, path).map_err(io)?;
                tracing::info!(
                    path = %path.display(),
                    records = batches.len(),
                    "queue file rewritten in the current format (TUNEQQ02)"
                );
                Log {
                    file: written.file,
                    path: path.to_path_buf(),
                    salt: written.salt,
                    next_seq: written.next_seq,
                    len: written.len,
                    compacted_len: written.len,
                    #[cfg(feature = "testing")]
                    crash: None,
                }
            }
        };
        Ok(Opened {
            log,
            batches,
            truncated_bytes,
            torn_copy,
            migrated: matches!(format, Format::V1),
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
        let record = encode(batch, &self.salt, self.next_seq);
        self.file.write_all(&record).map_err(|e| self.io(e))?;
        self.file.sync_data().map_err(|e| self.io(e))?;
        self.len += record.len() as u64;
        self.next_seq += 1;
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn cmd(line: &str) -> Command {
        line.split(' ').map(|s| s.as_bytes().to_vec()).collect()
    }

    /// A file of `n` one-command records; returns where each record starts and the
    /// file's length.
    fn file_of(path: &Path, n: usize) -> (Vec<u64>, u64) {
        let mut opened = Log::open(path).unwrap();
        let mut starts = vec![];
        for i in 0..n {
            starts.push(opened.log.len());
            opened
                .log
                .append(&[cmd(&format!("SET key{i} value-{i}"))])
                .unwrap();
        }
        (starts, opened.log.len())
    }

    fn batches(n: Range<usize>) -> Vec<Vec<Command>> {
        n.map(|i| vec![cmd(&format!("SET key{i} value-{i}"))])
            .collect()
    }

    /// One record in the first format.
    fn encode_v1(batch: &[Command]) -> Vec<u8> {
        let body = encode_body(batch);
        let mut record = Vec::new();
        put_u32(&mut record, body.len());
        record.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
        record.extend_from_slice(&body);
        record
    }

    fn write_v1(path: &Path, records: &[Vec<Command>]) -> Vec<usize> {
        let mut bytes = MAGIC_V1.to_vec();
        let mut starts = vec![];
        for r in records {
            starts.push(bytes.len());
            bytes.extend(encode_v1(r));
        }
        std::fs::write(path, &bytes).unwrap();
        starts
    }

    fn flip(path: &Path, at: u64, mask: u8) -> Vec<u8> {
        let mut bytes = std::fs::read(path).unwrap();
        bytes[at as usize] ^= mask;
        std::fs::write(path, &bytes).unwrap();
        bytes
    }

    fn asides(dir: &Path, kind: &str) -> Vec<PathBuf> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.to_string_lossy().contains(&format!(".{kind}-")))
            .collect()
    }

    #[test]
    fn records_round_trip_and_a_torn_tail_is_cut_off_and_kept_aside() {
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
        let bytes = std::fs::read(&path).unwrap();
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
        let copy = again.torn_copy.clone().unwrap();
        assert_eq!(std::fs::read(&copy).unwrap(), bytes[whole as usize..][..5]);
        assert_eq!(asides(&dir, "torn"), vec![copy]);
        // Appends go on from there, in sequence.
        let mut log = again.log;
        log.append(&[cmd("SET d 4")]).unwrap();
        drop(log);
        assert_eq!(Log::open(&path).unwrap().batches.len(), 3);
    }

    #[test]
    fn a_full_length_last_record_that_fails_its_checksum_is_refused_not_dropped() {
        // The old rule dropped it as "torn": an acknowledged record, silently gone.
        let dir = tempdir();
        let path = dir.join("q.db");
        let (starts, _) = file_of(&path, 2);
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x01;
        std::fs::write(&path, &bytes).unwrap();
        match Log::open(&path) {
            Err(LogError::Corrupt {
                offset,
                intact_before: 1,
                valid_after: 0,
                ..
            }) => assert_eq!(offset, starts[1]),
            other => panic!("{other:?}"),
        }
        assert_eq!(std::fs::read(&path).unwrap(), bytes, "left untouched");
        assert!(asides(&dir, "torn").is_empty());
    }

    #[test]
    fn a_last_record_whose_end_never_reached_the_disk_is_torn() {
        // A power cut after the file grew: the last blocks read back as zeros.
        let dir = tempdir();
        let path = dir.join("q.db");
        let (starts, len) = file_of(&path, 3);
        let mut bytes = std::fs::read(&path).unwrap();
        for b in &mut bytes[(len as usize - ZERO_TAIL)..] {
            *b = 0;
        }
        std::fs::write(&path, &bytes).unwrap();
        let again = Log::open(&path).unwrap();
        assert_eq!(again.batches, batches(0..2));
        assert_eq!(again.log.len(), starts[2]);

        // The whole record zero, and zeros past it.
        drop(again);
        let (_, len) = file_of(&dir.join("z.db"), 3);
        let mut bytes = std::fs::read(dir.join("z.db")).unwrap();
        bytes.extend([0; 5000]);
        std::fs::write(dir.join("z.db"), &bytes).unwrap();
        let again = Log::open(&dir.join("z.db")).unwrap();
        assert_eq!(again.batches, batches(0..3));
        assert_eq!(again.log.len(), len);
    }

    #[test]
    fn damage_followed_by_valid_records_is_refused_and_the_file_left_untouched() {
        let dir = tempdir();
        let path = dir.join("q.db");
        let (starts, _) = file_of(&path, 20);
        // The length's top bit: the record now seems to run past the end of the file,
        // which the old code took for a torn write and cut 19 records.
        let bytes = flip(&path, starts[1] + 3, 0x80);
        match Log::open(&path) {
            Err(e @ LogError::Corrupt { .. }) => {
                let LogError::Corrupt {
                    offset,
                    intact_before,
                    valid_after,
                    ..
                } = &e
                else {
                    unreachable!()
                };
                assert_eq!((*offset, *intact_before, *valid_after), (starts[1], 1, 18));
                let message = e.to_string();
                assert!(message.contains("tuneq queue repair"), "{message}");
                assert!(message.contains(&path.display().to_string()), "{message}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
    }

    #[test]
    fn repair_keeps_every_intact_record_and_sets_the_original_aside() {
        let dir = tempdir();
        let path = dir.join("q.db");
        let (starts, _) = file_of(&path, 20);
        let damaged = flip(&path, starts[7] + FRAME as u64 + 6, 0x10);
        let report = repair(&path).unwrap();
        assert_eq!(report.kept_records, 19);
        assert_eq!(
            report.dropped,
            vec![DroppedRange {
                start: starts[7],
                end: starts[8],
                records: Some(1)
            }]
        );
        assert_eq!(report.dropped_bytes(), starts[8] - starts[7]);
        let copy = report.original_copy.unwrap();
        assert_eq!(std::fs::read(&copy).unwrap(), damaged);
        let again = Log::open(&path).unwrap();
        let mut expected = batches(0..7);
        expected.extend(batches(8..20));
        assert_eq!(again.batches, expected);
        drop(again);
        // Nothing left to repair: the file stays as it is.
        let before = std::fs::read(&path).unwrap();
        let report = repair(&path).unwrap();
        assert_eq!((report.original_copy, report.kept_records), (None, 19));
        assert_eq!(std::fs::read(&path).unwrap(), before);
    }

    #[test]
    fn repair_is_refused_while_the_file_is_open() {
        let dir = tempdir();
        let path = dir.join("q.db");
        let _held = Log::open(&path).unwrap();
        assert!(matches!(repair(&path), Err(LogError::InUse(_))));
    }

    #[test]
    fn files_of_the_first_format_are_read_and_rewritten_in_the_current_one() {
        let dir = tempdir();
        let path = dir.join("q.db");
        write_v1(&path, &batches(0..10));
        let opened = Log::open(&path).unwrap();
        assert!(opened.migrated);
        assert_eq!(opened.batches, batches(0..10));
        let mut log = opened.log;
        log.append(&[cmd("SET key10 value-10")]).unwrap();
        drop(log);
        assert!(std::fs::read(&path).unwrap().starts_with(MAGIC));
        let again = Log::open(&path).unwrap();
        assert!(!again.migrated);
        assert_eq!(again.batches, batches(0..11));
    }

    #[test]
    fn first_format_files_keep_the_torn_write_rule_and_refuse_damage() {
        let dir = tempdir();
        // Torn: the last record cut short.
        let path = dir.join("torn.db");
        let starts = write_v1(&path, &batches(0..5));
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(starts[4] as u64 + 11).unwrap();
        drop(f);
        let opened = Log::open(&path).unwrap();
        assert_eq!(
            (opened.batches.clone(), opened.truncated_bytes),
            (batches(0..4), 11)
        );
        // Damaged: a length made larger in the middle (the reported case) or in the last
        // record (whose bytes are still a whole record), a flipped body bit at the end.
        for (record, at, mask) in [(1, 2, 0x01), (4, 3, 0x40), (4, FRAME_V1 + 5, 0x04)] {
            let path = dir.join(format!("damaged-{record}-{at}.db"));
            let starts = write_v1(&path, &batches(0..5));
            let bytes = flip(&path, (starts[record] + at) as u64, mask);
            match Log::open(&path) {
                Err(LogError::Corrupt { intact_before, .. }) => assert_eq!(intact_before, record),
                other => panic!("record {record} byte {at}: {other:?}"),
            }
            assert_eq!(std::fs::read(&path).unwrap(), bytes);
            let report = repair(&path).unwrap();
            assert_eq!(report.kept_records, 4);
            let opened = Log::open(&path).unwrap();
            let mut expected = batches(0..record);
            expected.extend(batches(record + 1..5));
            assert_eq!(opened.batches, expected);
        }
    }

    #[test]
    fn bytes_shaped_like_a_record_inside_a_torn_record_do_not_count() {
        // A payload may hold what looks like a record (a copy of another queue file);
        // without this file's salt its frame does not check out.
        let dir = tempdir();
        let other = dir.join("other.db");
        file_of(&other, 3);
        let foreign = std::fs::read(&other).unwrap();
        let path = dir.join("q.db");
        let mut opened = Log::open(&path).unwrap();
        opened.log.append(&[cmd("SET a 1")]).unwrap();
        let whole = opened.log.len();
        opened
            .log
            .append(&[vec![
                b"SET".to_vec(),
                b"x".to_vec(),
                foreign[HEADER..].to_vec(),
            ]])
            .unwrap();
        let end = opened.log.len();
        drop(opened);
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(end - 3).unwrap();
        drop(f);
        let again = Log::open(&path).unwrap();
        assert_eq!(again.batches, vec![vec![cmd("SET a 1")]]);
        assert_eq!(again.log.len(), whole);
    }

    #[cfg(unix)]
    #[test]
    fn the_file_and_its_copies_are_private() {
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        let dir = tempdir();
        let path = dir.join("q.db");
        let (starts, _) = file_of(&path, 3);
        assert_eq!(mode(&path), 0o600);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(starts[2] + 4).unwrap();
        drop(f);
        let mut opened = Log::open(&path).unwrap();
        assert_eq!(mode(&path), 0o600, "tightened on open");
        assert_eq!(mode(opened.torn_copy.as_ref().unwrap()), 0o600);
        assert!(opened.log.compact(&[cmd("SET a 1")]).unwrap());
        assert_eq!(mode(&path), 0o600, "a compacted file too");
        drop(opened);
        let bytes = std::fs::read(&path).unwrap();
        let mut damaged = bytes.clone();
        damaged[HEADER + 2] ^= 1;
        damaged.extend(&bytes[HEADER..]);
        std::fs::write(&path, &damaged).unwrap();
        let report = repair(&path).unwrap();
        assert_eq!(mode(report.original_copy.as_ref().unwrap()), 0o600);
        assert_eq!(mode(&path), 0o600);
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
        assert!(matches!(repair(&other), Err(LogError::NotAQueueFile(_))));
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
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tuneq-log-{}-{}-{}",
            std::process::id(),
            super::super::db::wall_clock_us(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
