//! The queue file's format, damage handling, repair and compaction, on real files.

#![allow(clippy::unwrap_used)]
use super::*;
use std::fs::OpenOptions;
use std::ops::Range;

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

/// A temporary directory, removed when it drops; derefs to its path.
fn tempdir() -> Scratch {
    Scratch(
        tempfile::Builder::new()
            .prefix("tuneq-log-")
            .tempdir()
            .unwrap(),
    )
}

struct Scratch(tempfile::TempDir);

impl std::ops::Deref for Scratch {
    type Target = Path;

    fn deref(&self) -> &Path {
        self.0.path()
    }
}
