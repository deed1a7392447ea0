//! The embedded store's promises, on its real file: a reopened queue holds everything
//! that was acknowledged (jobs, leases with their fencing tokens, capacity held); a
//! writer process SIGKILLed at random moments, mid-write included, leaves a file that
//! opens, with every acknowledged job in it and the invariants intact; a torn last
//! write is cut off (and kept aside) while damage anywhere else is refused, never cut
//! (one flipped bit used to cost every record after it); `repair` keeps what is
//! intact; an idle queue writes nothing; and a second process cannot open a file that
//! is in use.
//!
//! The writer is this test binary itself, re-run with `--exact` on the ignored
//! `child_writer` test.

#![allow(clippy::unwrap_used, missing_docs)]

mod support;

use rand::{Rng, SeedableRng};
use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;
use tuneq_queue::embedded::CompactionCrash;
use tuneq_queue::*;
use tuneq_queue::{JobQueue, Queue};

const DOMAIN: &str = "durable";

fn job(i: usize, payload_bytes: usize) -> NewJob {
    NewJob {
        idempotency_key: Some(format!("req-{i}")),
        ..support::new_job(
            format!("t{}", i % 3),
            (i % 10) as u8,
            "x".repeat(payload_bytes),
        )
    }
}

/// An error with its causes, as the CLI prints them.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    std::iter::successors(Some(e), |e| e.source())
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(": ")
}

async fn open(file: &Path) -> Queue {
    Queue::open_embedded(file, DOMAIN, QueueConfig::default())
        .await
        .unwrap()
}

#[tokio::test]
async fn a_reopened_queue_has_every_job_lease_and_reservation() {
    let file = testing::scratch_dir().join("queue.db");
    let q = open(&file).await;
    q.set_pool("gpu", 1).await.unwrap();
    let mut ids = vec![];
    for i in 0..50 {
        ids.push(q.enqueue(&job(i, 100)).await.unwrap().id);
    }
    let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
    q.start(&lease.id, lease.token).await.unwrap();
    drop(q);

    let q = open(&file).await;
    for id in &ids {
        assert!(q.get(id).await.unwrap().is_some(), "job {id} lost");
    }
    let record = q.get(&lease.id).await.unwrap().unwrap();
    assert_eq!(record.state, JobState::Running);
    assert_eq!(record.epoch, lease.token, "the fence survived the restart");
    assert!(
        q.claim("gpu", "d", "").await.unwrap().is_none(),
        "the reservation survived the restart"
    );
    let again = q.enqueue(&job(7, 100)).await.unwrap();
    assert!(again.duplicate, "idempotency keys survived the restart");
    assert_eq!(again.id, ids[7]);
    q.complete(&lease.id, lease.token, "{}").await.unwrap();
    assert!(q.claim("gpu", "d", "").await.unwrap().is_some());
}

#[tokio::test]
async fn a_second_process_cannot_open_a_file_in_use() {
    let file = testing::scratch_dir().join("queue.db");
    let _held = open(&file).await;
    let refused = Queue::open_embedded(&file, DOMAIN, QueueConfig::default())
        .await
        .unwrap_err();
    let refused = chain(&refused);
    assert!(refused.contains("in use"), "{refused}");
}

#[tokio::test]
async fn a_writer_killed_mid_write_loses_nothing_acknowledged() {
    let file = testing::scratch_dir().join("queue.db");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let mut acknowledged: HashSet<String> = HashSet::new();
    for round in 0..6 {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_writer", "--ignored", "--nocapture"])
            .args(["--test-threads", "1"])
            .env("TUNEQ_CHILD_QUEUE_FILE", &file)
            .env("TUNEQ_CHILD_ROUND", round.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        // Kill after a random number of acknowledgements, at a random moment after it,
        // while the writer is busy appending large records.
        let kill_after = rng.random_range(5..60);
        let mut lines = stdout.lines().map_while(Result::ok);
        let mut seen = 0;
        for line in lines.by_ref() {
            if let Some(id) = line.split("ACKED ").nth(1) {
                acknowledged.insert(id.to_string());
                seen += 1;
                if seen == kill_after {
                    break;
                }
            }
        }
        std::thread::sleep(Duration::from_micros(rng.random_range(0..3_000)));
        child.kill().unwrap();
        // Acknowledgements printed before the kill landed count too.
        for line in lines {
            if let Some(id) = line.split("ACKED ").nth(1) {
                acknowledged.insert(id.to_string());
            }
        }
        child.wait().unwrap();
        let whole = std::fs::metadata(&file).unwrap().len();
        let q = open(&file).await;
        let kept = std::fs::metadata(&file).unwrap().len();
        // Every other round also plants what a power cut can leave after the file grew:
        // blocks whose data never reached the disk, read back as zeros.
        let q = if round % 2 == 1 {
            drop(q);
            let zeros = vec![0u8; rng.random_range(1..40_000)];
            let mut f = std::fs::OpenOptions::new()
                .append(true)
                .open(&file)
                .unwrap();
            std::io::Write::write_all(&mut f, &zeros).unwrap();
            drop(f);
            let q = open(&file).await;
            assert_eq!(std::fs::metadata(&file).unwrap().len(), kept);
            q
        } else {
            q
        };
        // The kill itself may have torn the last record (then less than `whole` stays).
        assert!(
            kept <= whole,
            "round {round}: a torn tail of {} bytes was kept",
            kept - whole
        );
        if kept < whole {
            eprintln!(
                "round {round}: the kill tore a record; {} bytes cut",
                whole - kept
            );
        }
        for id in &acknowledged {
            assert!(
                q.get(id).await.unwrap().is_some(),
                "round {round}: acknowledged job {id} lost"
            );
        }
        let seen = q.inspect().await.unwrap();
        for (record, member_of) in &seen.jobs {
            assert_eq!(member_of.as_slice(), ["ready"], "job {}", record.id);
        }
        assert_eq!(seen.active_tenants, seen.tenants_with_waiting);
    }
    assert!(acknowledged.len() >= 30);
}

/// Run only as a child: enqueues jobs with 256 KiB payloads (so a kill often lands
/// inside a write) and prints `ACKED <id>` after each one is acknowledged.
#[tokio::test]
#[ignore = "run by the other tests as a child process"]
async fn child_writer() {
    let (Ok(file), Ok(round)) = (
        std::env::var("TUNEQ_CHILD_QUEUE_FILE"),
        std::env::var("TUNEQ_CHILD_ROUND"),
    ) else {
        return;
    };
    let round: usize = round.parse().unwrap();
    let q = open(Path::new(&file)).await;
    for i in 0.. {
        let id = q
            .enqueue(&job(round * 1_000_000 + i, 256 << 10))
            .await
            .unwrap()
            .id;
        println!("ACKED {id}");
    }
}

/// Everything a reopened queue must still hold: every job with its indexes, the pools,
/// and the catalog entries.
async fn everything(q: &Queue) -> (Inspection, Vec<Entry>) {
    let mut entries = vec![];
    for owner in ["t0", "t1"] {
        entries.extend(
            q.list_entries("file", owner, None, 1000)
                .await
                .unwrap()
                .entries,
        );
    }
    (q.inspect().await.unwrap(), entries)
}

/// A queue file written through the real API, several hundred records: jobs enqueued,
/// claimed, started, completed and failed, files in the catalog. Returns what it holds
/// and the file's length before the last operation (an enqueue, the last record).
async fn busy_file(file: &Path) -> ((Inspection, Vec<Entry>), u64) {
    let q = open(file).await;
    q.set_pool("gpu", 4).await.unwrap();
    for i in 0..300 {
        q.enqueue(&job(i, 40)).await.unwrap();
        if i % 3 == 0 {
            q.create_entry("file", &format!("t{}", i % 2), &format!("file-{i}"), "{}")
                .await
                .unwrap();
        }
        if i % 5 == 4 {
            let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
            q.start(&lease.id, lease.token).await.unwrap();
            if i % 10 == 4 {
                q.complete(&lease.id, lease.token, "{\"ok\":1}")
                    .await
                    .unwrap();
            } else {
                support::training_failed(&q, &lease.id, lease.token, "boom", false)
                    .await
                    .unwrap();
            }
        }
    }
    let before_last = std::fs::metadata(file).unwrap().len();
    q.enqueue(&job(1_000, 3_000)).await.unwrap();
    let held = everything(&q).await;
    drop(q);
    (held, before_last)
}

fn copy_to_scratch(file: &Path) -> std::path::PathBuf {
    let copy = testing::scratch_dir().join("queue.db");
    std::fs::copy(file, &copy).unwrap();
    copy
}

fn set_aside(file: &Path, kind: &str) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(file.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().contains(&format!("queue.db.{kind}-")))
        .collect()
}

#[tokio::test]
async fn one_flipped_bit_anywhere_never_costs_an_acknowledged_record() {
    let file = testing::scratch_dir().join("queue.db");
    let (held, _) = busy_file(&file).await;
    let bytes = std::fs::read(&file).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(52);
    let (mut refused, mut opened) = (0, 0);
    for _ in 0..200 {
        let copy = copy_to_scratch(&file);
        let mut damaged = bytes.clone();
        let at = rng.random_range(0..damaged.len());
        damaged[at] ^= 1 << rng.random_range(0..8);
        std::fs::write(&copy, &damaged).unwrap();
        match Queue::open_embedded(&copy, DOMAIN, QueueConfig::default()).await {
            Ok(q) => {
                opened += 1;
                let (jobs, entries) = everything(&q).await;
                // Not assert_eq: the whole queue in a failure message helps nobody.
                assert!(
                    (&jobs, &entries) == (&held.0, &held.1),
                    "flip at byte {at}: opened with {} of {} jobs and {} of {} files",
                    jobs.jobs.len(),
                    held.0.jobs.len(),
                    entries.len(),
                    held.1.len()
                );
            }
            Err(e) => {
                refused += 1;
                let message = chain(&e);
                assert!(
                    message.contains("is damaged at byte")
                        || message.contains("not a tuneq queue file"),
                    "flip at byte {at}: {message}"
                );
                assert_eq!(
                    std::fs::read(&copy).unwrap(),
                    damaged,
                    "flip at byte {at}: a refused file was changed"
                );
                assert!(set_aside(&copy, "torn").is_empty());
            }
        }
    }
    eprintln!(
        "{} bytes, 200 flips: {refused} refused, {opened} opened whole",
        bytes.len()
    );
}

#[tokio::test]
async fn a_torn_last_record_is_cut_off_and_set_aside_keeping_every_earlier_one() {
    let file = testing::scratch_dir().join("queue.db");
    let (held, before_last) = busy_file(&file).await;
    // What the file held before its last record.
    let earlier = copy_to_scratch(&file);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&earlier)
        .unwrap();
    f.set_len(before_last).unwrap();
    drop(f);
    let earlier = everything(&open(&earlier).await).await;
    assert_ne!(earlier, held);
    let bytes = std::fs::read(&file).unwrap();
    let end = bytes.len();
    let start = usize::try_from(before_last).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    for i in 0..30 {
        let copy = copy_to_scratch(&file);
        let torn = match i % 3 {
            // Cut short, as a killed writer leaves it.
            0 => bytes[..rng.random_range(start + 1..end)].to_vec(),
            // The file grew, but the record's last blocks never reached the disk.
            1 => {
                let mut b = bytes.clone();
                let from = rng.random_range(start..end - 16);
                b[from..].fill(0);
                b
            }
            // Cut short, and the part that exists partly zeros.
            _ => {
                let mut b = bytes[..rng.random_range(start + 40..end)].to_vec();
                let len = b.len();
                b[rng.random_range(start..len - 16)..].fill(0);
                b
            }
        };
        std::fs::write(&copy, &torn).unwrap();
        let q = open(&copy).await;
        assert_eq!(everything(&q).await, earlier, "case {i}");
        drop(q);
        assert_eq!(std::fs::metadata(&copy).unwrap().len(), before_last);
        let aside = set_aside(&copy, "torn");
        assert_eq!(aside.len(), 1, "case {i}");
        assert_eq!(std::fs::read(&aside[0]).unwrap(), torn[start..]);
    }
    // Zeros past a whole last record: nothing acknowledged is lost either.
    let copy = copy_to_scratch(&file);
    let mut grown = bytes.clone();
    grown.extend(vec![0; 10_000]);
    std::fs::write(&copy, &grown).unwrap();
    assert_eq!(everything(&open(&copy).await).await, held);
}

#[tokio::test]
async fn repair_keeps_the_records_before_and_after_the_damage() {
    let file = testing::scratch_dir().join("queue.db");
    let q = open(&file).await;
    for i in 0..100 {
        q.enqueue(&job(i, 40)).await.unwrap();
    }
    let start = std::fs::metadata(&file).unwrap().len();
    q.create_entry("file", "t0", "lost", "{\"name\":\"x.jsonl\"}")
        .await
        .unwrap();
    let end = std::fs::metadata(&file).unwrap().len();
    for i in 100..200 {
        q.enqueue(&job(i, 40)).await.unwrap();
        q.create_entry("file", "t1", &format!("kept-{i}"), "{}")
            .await
            .unwrap();
    }
    let (jobs, mut entries) = everything(&q).await;
    drop(q);
    entries.retain(|e| e.id != "lost");
    let mut bytes = std::fs::read(&file).unwrap();
    let at = usize::try_from((start + end) / 2).unwrap();
    bytes[at] ^= 0x08;
    std::fs::write(&file, &bytes).unwrap();
    let refused = chain(
        &Queue::open_embedded(&file, DOMAIN, QueueConfig::default())
            .await
            .unwrap_err(),
    );
    assert!(
        refused.contains(&format!("damaged at byte {start}")),
        "{refused}"
    );
    // The queue's settings, then one record per operation.
    assert!(refused.contains("101 intact records"), "{refused}");
    assert!(refused.contains("200 valid records follow"), "{refused}");

    let report = tuneq_queue::embedded::repair(&file).unwrap();
    assert_eq!(report.dropped.len(), 1);
    assert_eq!(
        (report.dropped[0].start, report.dropped[0].end),
        (start, end)
    );
    assert_eq!(report.dropped[0].records, Some(1));
    assert_eq!(report.kept_records, 1 + 100 + 200);
    let copy = report.original_copy.unwrap();
    assert_eq!(std::fs::read(&copy).unwrap(), bytes);
    let q = open(&file).await;
    assert_eq!(everything(&q).await, (jobs, entries));
    // The counters did not go back: a new job gets a new id.
    let new = q.enqueue(&job(5_000, 10)).await.unwrap();
    assert!(!new.duplicate);
    assert_eq!(q.inspect().await.unwrap().jobs.len(), 201);
}

#[tokio::test]
async fn an_idle_queue_writes_nothing() {
    let file = testing::scratch_dir().join("queue.db");
    let q = open(&file).await;
    q.set_pool("gpu", 1).await.unwrap();
    q.enqueue(&job(1, 10)).await.unwrap();
    q.enqueue(&job(2, 10)).await.unwrap();
    let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
    q.start(&lease.id, lease.token).await.unwrap();
    let len = std::fs::metadata(&file).unwrap().len();
    // What a dispatcher tick, the webhook sender and the retention sweep do while
    // nothing happens: the pool is full, no lease is due, nothing to deliver or trim.
    for _ in 0..50 {
        q.expire_leases(100).await.unwrap();
        assert!(q.suspects(100).await.unwrap().is_empty());
        assert!(q.claim("gpu", "d", "").await.unwrap().is_none());
        assert!(q.due_deliveries(10).await.unwrap().is_empty());
        q.trim(100).await.unwrap();
        q.pool_usage("gpu").await.unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        std::fs::metadata(&file).unwrap().len(),
        len,
        "idle operations appended (and synced) records"
    );
    // A real change still writes, and the clock read meanwhile goes with it.
    q.heartbeat(&lease.id, lease.token, None).await.unwrap();
    assert!(std::fs::metadata(&file).unwrap().len() > len);
    drop(q);
    let q = open(&file).await;
    assert_eq!(
        q.get(&lease.id).await.unwrap().unwrap().state,
        JobState::Running
    );
}

#[cfg(unix)]
#[tokio::test]
async fn the_queue_file_is_private() {
    use std::os::unix::fs::PermissionsExt;
    let file = testing::scratch_dir().join("queue.db");
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    drop(open(&file).await);
    assert_eq!(mode(&file), 0o600);
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    drop(open(&file).await);
    assert_eq!(mode(&file), 0o600);
}

/// The file's length.
fn length(file: &Path) -> u64 {
    std::fs::metadata(file).unwrap().len()
}

#[tokio::test]
async fn compaction_starts_by_itself_once_the_file_passes_its_threshold() {
    let file = testing::scratch_dir().join("queue.db");
    let config = QueueConfig {
        // Finished jobs go at once, so what the file holds beyond the live keys is
        // history that compaction drops.
        retention_count: 0,
        ..QueueConfig::default()
    };
    let q = Queue::open_embedded(&file, DOMAIN, config.clone())
        .await
        .unwrap();
    q.set_pool("gpu", 1).await.unwrap();
    // Jobs for another pool wait through it all.
    let mut waiting = vec![];
    for i in 0..20 {
        let keep = NewJob {
            pools: vec!["elsewhere".into()],
            ..job(i, 100)
        };
        waiting.push(q.enqueue(&keep).await.unwrap().id);
    }
    let threshold = tuneq_queue::embedded::COMPACT_AT_BYTES;
    let payload = 1 << 20;
    let mut largest = length(&file);
    let mut compacted_from = None;
    for i in 0..(2 * threshold / payload) as usize {
        let churn = NewJob {
            tenant: "churn".into(),
            idempotency_key: None,
            ..job(1_000 + i, payload as usize)
        };
        q.enqueue(&churn).await.unwrap();
        let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
        q.complete(&lease.id, lease.token, "{}").await.unwrap();
        let now = length(&file);
        if now < largest {
            compacted_from = Some(largest);
            break;
        }
        largest = now;
    }
    // The write that crossed the threshold compacted the file in the same step, so
    // the largest size seen from outside is the one just before it.
    let from = compacted_from.expect("the file grew past its threshold and was never compacted");
    assert!(
        from <= threshold && from + 2 * payload > threshold,
        "compacted after growing to {from} bytes: not by the write that passed {threshold}"
    );
    let after = length(&file);
    assert!(
        after < from / 16,
        "the compacted file ({after} bytes) holds only the live keys"
    );
    drop(q);
    let q = Queue::open_embedded(&file, DOMAIN, config).await.unwrap();
    for id in &waiting {
        assert_eq!(
            q.get(id).await.unwrap().map(|r| r.state),
            Some(JobState::Queued),
            "job {id} after compaction"
        );
    }
}

/// Where a crash in the middle of a compaction leaves the files.
#[derive(Debug, Clone, Copy)]
enum CrashedCompaction {
    /// The staged file was being written: cut at `keep` of its length (0.0 to 1.0).
    Writing { keep: f64 },
    /// The staged file was written and synced, not yet renamed.
    Written,
    /// The staged file had taken the real name.
    Renamed,
}

#[tokio::test]
async fn a_crash_at_any_point_of_compaction_loses_no_accepted_job() {
    for crash in [
        CrashedCompaction::Writing { keep: 0.0 },
        CrashedCompaction::Writing { keep: 0.01 },
        CrashedCompaction::Writing { keep: 0.5 },
        CrashedCompaction::Writing { keep: 0.99 },
        CrashedCompaction::Written,
        CrashedCompaction::Renamed,
    ] {
        let file = testing::scratch_dir().join("queue.db");
        let (held, _) = busy_file(&file).await;
        let q = open(&file).await;
        let store = q.embedded_store().unwrap();
        let point = match crash {
            CrashedCompaction::Renamed => CompactionCrash::AfterRename,
            _ => CompactionCrash::BeforeRename,
        };
        store.crash_next_compaction(point).unwrap();
        assert!(
            store.compact_now().is_err(),
            "{crash:?}: the hook stops the compaction"
        );
        drop(store);
        drop(q);
        let staged = file.with_extension("db.compacting");
        match crash {
            CrashedCompaction::Writing { keep } => {
                let len = length(&staged);
                let cut = (len as f64 * keep) as u64;
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&staged)
                    .unwrap()
                    .set_len(cut)
                    .unwrap();
            }
            CrashedCompaction::Written => assert!(staged.exists()),
            CrashedCompaction::Renamed => assert!(!staged.exists()),
        }
        let q = open(&file).await;
        assert!(
            everything(&q).await == held,
            "{crash:?}: the reopened queue lost or changed acknowledged work"
        );
        // It goes on: the next compaction runs over the leftover staged file, and what
        // it writes opens with the same content.
        q.embedded_store().unwrap().compact_now().unwrap();
        assert!(!staged.exists(), "{crash:?}: a staged file was left behind");
        q.enqueue(&job(5_000, 10)).await.unwrap();
        let held = everything(&q).await;
        drop(q);
        let q = open(&file).await;
        assert!(
            everything(&q).await == held,
            "{crash:?}: lost work after the next compaction"
        );
    }
}

/// A full disk mid-write (the probe's M2): the append fails after writing part of its
/// record. The store refuses calls for a moment, then goes back to what its file holds by
/// itself — no restart — and works again once the disk has room: nothing acknowledged is
/// lost, nothing refused is kept, and the file reopens to the same state with no torn tail.
#[tokio::test]
async fn a_full_disk_mid_write_heals_by_itself_once_space_returns() {
    let file = testing::scratch_dir().join("queue.db");
    let q = open(&file).await;
    q.set_pool("gpu", 1).await.unwrap();
    let mut acknowledged = vec![];
    for i in 0..20 {
        acknowledged.push(q.enqueue(&job(i, 100)).await.unwrap().id);
    }
    let store = q.embedded_store().unwrap();
    // The disk is full: every write fails after writing part of its record (the
    // client's own retries included), and nothing of it is kept.
    store.fail_next_appends(u32::MAX);
    assert!(
        q.enqueue(&job(100, 100)).await.is_err(),
        "the full disk refuses the write"
    );
    assert!(store.failure().is_some_and(|(_, recoverable)| recoverable));
    tokio::time::sleep(tuneq_queue::embedded::RECOVERY_EVERY + Duration::from_millis(100)).await;
    assert!(q.enqueue(&job(101, 100)).await.is_err(), "still full");
    // Space is back: within the recovery pause the store works again, with no restart.
    store.fail_next_appends(0);
    tokio::time::sleep(tuneq_queue::embedded::RECOVERY_EVERY + Duration::from_millis(100)).await;
    let after = q.enqueue(&job(103, 100)).await.unwrap().id;
    assert!(store.failure().is_none());
    acknowledged.push(after);
    let held = everything(&q).await;
    let ids: HashSet<String> = held.0.jobs.iter().map(|(j, _)| j.id.to_string()).collect();
    for id in &acknowledged {
        assert!(ids.contains(&id.to_string()), "acknowledged job {id} kept");
    }
    assert_eq!(
        ids.len(),
        acknowledged.len(),
        "no refused enqueue was kept: {ids:?}"
    );
    drop(store);
    drop(q);
    let reopened = open(&file).await;
    assert!(
        everything(&reopened).await == held,
        "the file holds what memory held"
    );
    let torn: Vec<_> = std::fs::read_dir(file.parent().unwrap())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("torn"))
        .collect();
    assert!(
        torn.is_empty(),
        "the partial records were cut at once: {torn:?}"
    );
}
