//! The file's bytes: the header, records in their frames (see the format in the
//! parent module's docs), and reading them back: walking the records, telling a torn
//! last write from damage.

use super::error::LogError;
use crate::embedded::db::Command;
use std::ops::Range;
use std::path::Path;

/// The current format's magic.
pub(super) const MAGIC: &[u8; 8] = b"TUNEQQ02";

/// The first format's magic (read, and rewritten in the current format on open).
pub(super) const MAGIC_V1: &[u8; 8] = b"TUNEQQ01";

/// The current header: magic and salt.
pub(super) const HEADER: usize = 16;

/// The current frame: length, sequence, body CRC, frame CRC.
pub(super) const FRAME: usize = 20;

/// The first format's frame: length, body CRC.
pub(super) const FRAME_V1: usize = 8;

/// A tail ending in this many zero bytes is a write whose last blocks never reached the
/// disk (see the module docs).
pub(super) const ZERO_TAIL: usize = 16;

/// How a file's records are framed.
#[derive(Debug, Clone, Copy)]
pub(super) enum Format {
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

pub(super) fn put_u32(out: &mut Vec<u8>, n: usize) {
    out.extend_from_slice(&u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes());
}

pub(super) fn encode_body(batch: &[Command]) -> Vec<u8> {
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
pub(super) fn frame_crc(salt: &[u8; 8], len: u32, seq: u64, body_crc: u32) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(salt);
    h.update(&len.to_le_bytes());
    h.update(&seq.to_le_bytes());
    h.update(&body_crc.to_le_bytes());
    h.finalize()
}

/// One record in the current format.
pub(super) fn encode(batch: &[Command], salt: &[u8; 8], seq: u64) -> Vec<u8> {
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
pub(super) fn take_u32(bytes: &[u8], at: &mut usize) -> Option<usize> {
    let raw = bytes.get(*at..at.checked_add(4)?)?;
    *at += 4;
    usize::try_from(u32::from_le_bytes(raw.try_into().ok()?)).ok()
}

pub(super) fn read_u64(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(
        bytes.get(at..at.checked_add(8)?)?.try_into().ok()?,
    ))
}

pub(super) fn decode(body: &[u8]) -> Option<Vec<Command>> {
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
pub(super) fn checked_frame(bytes: &[u8], at: usize, salt: &[u8; 8]) -> Option<(u64, usize)> {
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
pub(super) fn record_at(
    bytes: &[u8],
    at: usize,
    format: Format,
) -> Option<(Vec<Command>, u64, usize)> {
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
pub(super) struct Walk {
    /// Each record's sequence (0 in the first format) and changes, in order.
    pub(super) records: Vec<(u64, Vec<Command>)>,
    /// Stretches with no valid record, with how many records precede each.
    pub(super) damage: Vec<(Range<usize>, usize)>,
}

/// Reads the records after the header. Records follow each other, their sequences
/// counting up by one; where that stops, the bytes after are scanned for the next
/// valid record with a higher sequence (any valid record, in the first format), and
/// reading goes on from there.
pub(super) fn walk(bytes: &[u8], format: Format) -> Walk {
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
pub(super) fn is_torn(bytes: &[u8], at: usize, format: Format, expected_seq: u64) -> bool {
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

/// Reads the header: the format, or None for a file cut inside its header while it
/// was being created (it holds nothing).
pub(super) fn format_of(bytes: &[u8], path: &Path) -> Result<Option<Format>, LogError> {
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
