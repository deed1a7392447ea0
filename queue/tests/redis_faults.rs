//! Faults around a real redis-server: claimers in separate OS processes racing never
//! lease one job twice; a claimer SIGKILLed between claim and start leaves a job that
//! comes back exactly once (lease expiry → suspect → requeue); and redis-server itself
//! SIGKILLed under `appendfsync always` loses no acknowledged job.
//!
//! The child processes are this test binary itself, re-run with `--exact` on the
//! ignored `child_claimer` test and told what to do through environment variables.

#![allow(clippy::unwrap_used, missing_docs)]

mod support;

use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use tuneq_queue::*;
use tuneq_queue::{JobQueue, Queue};

fn job(i: usize) -> NewJob {
    support::new_job(format!("t{}", i % 3), (i % 10) as u8, "{}")
}

fn spawn_child(url: &str, domain: &str, mode: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_claimer",
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("TUNEQ_CHILD_REDIS", url)
        .env("TUNEQ_CHILD_DOMAIN", domain)
        .env("TUNEQ_CHILD_MODE", mode)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Run only as a child: claims jobs and reports each as `CLAIMED <id> <token>` (libtest
/// may print its `test child_claimer ... ` header in front of the first one).
/// Mode `drain` completes every job until none is left; mode `claim-and-hang` claims
/// one job and then waits to be killed.
#[tokio::test]
#[ignore = "run by the other tests as a child process"]
async fn child_claimer() {
    let (Ok(url), Ok(domain), Ok(mode)) = (
        std::env::var("TUNEQ_CHILD_REDIS"),
        std::env::var("TUNEQ_CHILD_DOMAIN"),
        std::env::var("TUNEQ_CHILD_MODE"),
    ) else {
        return;
    };
    let q = Queue::connect(&url, &domain, QueueConfig::default())
        .await
        .unwrap();
    let me = format!("pid-{}", std::process::id());
    loop {
        match q.claim("gpu", &me, "").await.unwrap() {
            Some(lease) => {
                println!("CLAIMED {} {}", lease.id, lease.token);
                if mode == "claim-and-hang" {
                    loop {
                        tokio::time::sleep(std::time::Duration::from_secs(60)).await;
                    }
                }
                q.start(&lease.id, lease.token).await.unwrap();
                q.complete(&lease.id, lease.token, "{}").await.unwrap();
            }
            None => {
                let usage = q.pool_usage("gpu").await.unwrap();
                let left = q.position_any().await;
                if usage.used == 0 && !left {
                    return;
                }
                tokio::task::yield_now().await;
            }
        }
    }
}

/// Whether any job still waits (the children stop when none does).
trait AnyWaiting {
    async fn position_any(&self) -> bool;
}

impl AnyWaiting for Queue {
    async fn position_any(&self) -> bool {
        let mut conn = self.redis_connection().unwrap();
        let n: u64 = ::redis::cmd("ZCARD")
            .arg(format!("{}tenants", self.prefix()))
            .query_async(&mut conn)
            .await
            .unwrap();
        n > 0
    }
}

fn claimed_lines(child: &mut Child) -> Vec<(String, u64)> {
    let stdout = child.stdout.take().unwrap();
    BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| {
            // libtest may print "test child_claimer ... " in front of the first line.
            let rest = &l[l.find("CLAIMED ")? + "CLAIMED ".len()..];
            let (id, token) = rest.split_once(' ')?;
            Some((id.to_string(), token.parse().ok()?))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claimers_in_separate_processes_never_double_lease() {
    let url = testing::shared();
    let domain = testing::unique_domain("procs");
    let q = Queue::connect(url, &domain, QueueConfig::default())
        .await
        .unwrap();
    q.set_pool("gpu", 3).await.unwrap();
    for i in 0..300 {
        q.enqueue(&job(i)).await.unwrap();
    }
    let mut children: Vec<Child> = (0..4).map(|_| spawn_child(url, &domain, "drain")).collect();
    let mut seen = HashSet::new();
    for child in &mut children {
        for (id, _) in claimed_lines(child) {
            assert!(seen.insert(id.clone()), "{id} was leased by two processes");
        }
        assert!(child.wait().unwrap().success());
    }
    assert_eq!(seen.len(), 300);
    assert_eq!(q.pool_usage("gpu").await.unwrap().used, 0);
    q.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimer_killed_between_claim_and_start_gives_the_job_back_exactly_once() {
    let url = testing::shared();
    let domain = testing::unique_domain("killed");
    let q = Queue::connect(url, &domain, QueueConfig::default())
        .await
        .unwrap();
    q.set_pool("gpu", 1).await.unwrap();
    let id = q.enqueue(&job(0)).await.unwrap().id;

    let mut child = spawn_child(url, &domain, "claim-and-hang");
    let stdout = child.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    let claimed = loop {
        let line = lines.next().expect("child output").unwrap();
        if let Some(at) = line.find("CLAIMED ") {
            break line[at + "CLAIMED ".len()..].to_string();
        }
    };
    let (claimed_id, token) = claimed.split_once(' ').unwrap();
    assert_eq!(claimed_id, id);
    let token: u64 = token.parse().unwrap();
    child.kill().unwrap(); // SIGKILL: no goodbye, the lease just stops being renewed
    child.wait().unwrap();

    assert_eq!(q.get(&id).await.unwrap().unwrap().state, JobState::Leased);
    assert!(
        q.claim("gpu", "d2", "").await.unwrap().is_none(),
        "not while the lease lives"
    );
    // The child's lease is the default 60 s; move the queue clock past it.
    q.advance_clock(61_000).await.unwrap();
    assert_eq!(q.expire_leases(10).await.unwrap(), vec![id.clone()]);
    // The dispatcher finds no attempt for that token and requeues it.
    q.resolve_suspect(&id, token, SuspectVerdict::Requeue)
        .await
        .unwrap();
    let again = q.claim("gpu", "d2", "").await.unwrap().unwrap();
    assert_eq!(again.id, id);
    assert!(again.token > token);
    q.start(&id, again.token).await.unwrap();
    q.complete(&id, again.token, "{}").await.unwrap();
    assert!(
        q.claim("gpu", "d2", "").await.unwrap().is_none(),
        "exactly once"
    );
    assert!(matches!(
        q.start(&id, token).await,
        Err(QueueError::StaleToken(_))
    ));
    let record = q.get(&id).await.unwrap().unwrap();
    assert_eq!(
        (record.state, record.stalls, record.attempts),
        (JobState::Succeeded, 1, 0)
    );
    q.destroy().await.unwrap();
}

use tuneq_queue::testing;

#[tokio::test]
async fn a_sigkilled_redis_with_aof_always_loses_no_acknowledged_job() {
    let dir = testing::scratch_dir();
    let mut server = testing::RedisServer::start(&dir, true);
    let q = Queue::connect(&server.url, "aof", QueueConfig::default())
        .await
        .unwrap();
    let mut acknowledged = vec![];
    for i in 0..300 {
        acknowledged.push(q.enqueue(&job(i)).await.unwrap().id);
    }
    q.set_pool("gpu", 1).await.unwrap();
    let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
    server.kill();
    server.restart();
    let q = Queue::connect(&server.url, "aof", QueueConfig::default())
        .await
        .unwrap();
    for id in &acknowledged {
        assert!(
            q.get(id).await.unwrap().is_some(),
            "acknowledged job {id} lost"
        );
    }
    let record = q.get(&lease.id).await.unwrap().unwrap();
    assert_eq!(record.state, JobState::Leased);
    assert_eq!(record.epoch, lease.token, "the fence survived the restart");
    let next = q.claim("gpu", "d", "").await.unwrap();
    assert!(next.is_none(), "capacity accounting survived the restart");
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A server that lost the scripts' library (here restarted without persistence; a
/// FUNCTION FLUSH or a new Cluster node is the same) gets it loaded again by the first
/// call that misses it.
#[tokio::test]
async fn a_redis_restarted_without_persistence_gets_the_scripts_again() {
    let dir = testing::scratch_dir();
    let mut server = testing::RedisServer::start(&dir, false);
    let q = Queue::connect(&server.url, "reload", QueueConfig::default())
        .await
        .unwrap();
    q.enqueue(&job(0)).await.unwrap();
    server.restart();
    // The first call after the restart may find its connection gone: an enqueue with an
    // idempotency key is retried inside the queue.
    let keyed = NewJob {
        idempotency_key: Some("after-restart".into()),
        ..job(1)
    };
    let id = q.enqueue(&keyed).await.unwrap().id;
    q.set_pool("gpu", 1).await.unwrap();
    let lease = q.claim("gpu", "d", "").await.unwrap().unwrap();
    assert_eq!(
        lease.id, id,
        "only the job enqueued after the restart is there"
    );
    q.complete(&id, lease.token, "{}").await.unwrap();

    // Reads that use no script work the same without the library.
    let waiting = q.enqueue(&job(2)).await.unwrap().id;
    redis::cmd("FUNCTION")
        .arg("FLUSH")
        .query_async::<()>(
            &mut redis::Client::open(server.url.as_str())
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap(),
        )
        .await
        .unwrap();
    let (record, standing) = q.status(&waiting, "t2").await.unwrap().unwrap();
    assert_eq!(record.state, JobState::Queued);
    assert_eq!(standing.map(|p| p.ahead_in_tenant), Some(0));
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}
