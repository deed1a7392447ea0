//! The embedded store's promises, on its real file: a reopened queue holds everything
//! that was acknowledged (jobs, leases with their fencing tokens, capacity held); a
//! writer process SIGKILLed at random moments, mid-write included, leaves a file that
//! opens, with every acknowledged job in it and the invariants intact; and a second
//! process cannot open a file that is in use.
//!
//! The writer is this test binary itself, re-run with `--exact` on the ignored
//! `child_writer` test.

#![allow(clippy::unwrap_used, missing_docs)]

use rand::{Rng, SeedableRng};
use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;
use tuneq_queue::*;
use tuneq_queue::{JobQueue, Queue};

const DOMAIN: &str = "durable";

fn job(i: usize, payload_bytes: usize) -> NewJob {
    NewJob {
        tenant: format!("t{}", i % 3),
        priority: (i % 10) as u8,
        pools: vec![],
        gpus: 1,
        estimated_seconds: 0,
        max_attempts: 3,
        payload: "x".repeat(payload_bytes),
        idempotency_key: Some(format!("req-{i}")),
        notify: false,
    }
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
    assert!(refused.to_string().contains("in use"), "{refused}");
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
        // A kill inside write(2) is rare (the kernel finishes most writes first), so
        // every other round also plants what a power cut mid-write leaves: the start
        // of a record whose body never reached the disk.
        let whole = std::fs::metadata(&file).unwrap().len();
        if round % 2 == 1 {
            let mut torn = (1u32 << 20).to_le_bytes().to_vec();
            torn.extend((0..rng.random_range(0..4_000)).map(|_| rng.random::<u8>()));
            let mut f = std::fs::OpenOptions::new()
                .append(true)
                .open(&file)
                .unwrap();
            std::io::Write::write_all(&mut f, &torn).unwrap();
        }

        let q = open(&file).await;
        let kept = std::fs::metadata(&file).unwrap().len();
        // The kill itself may have torn the last record (then less than `whole` stays);
        // what was planted never does.
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
