//! Random operation sequences (a proptest state machine) with every invariant checked
//! after each step.

use super::*;

/// One step of a random run (see [`random_sequences_keep_every_invariant`]).
#[derive(Debug, Clone)]
enum Op {
    /// A job for tenant x/y/z, pinned to no pool, pool a or pool b, maybe with one of
    /// a few idempotency keys (so repeats happen).
    Enqueue {
        tenant: usize,
        priority: u8,
        pools: usize,
        key: Option<u8>,
    },
    Claim {
        pool_a: bool,
    },
    /// Ends a live attempt: complete, fail (retryable), preempt, or complete and
    /// claim the next job in one step.
    Finish {
        pick: usize,
        how: u8,
    },
    Heartbeat {
        pick: usize,
    },
    Cancel {
        pick: usize,
    },
    /// Pauses a job (or resumes it, with `resume`); the dispatcher's stop of a pausing
    /// attempt is a `Finish` that preempts.
    Pause {
        pick: usize,
        resume: bool,
    },
    /// Moves the clock; expired leases are settled, adopted or requeued.
    Expire {
        advance_ms: u64,
        adopt: bool,
    },
    /// Replays a token that has been superseded.
    Stale {
        pick: usize,
    },
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        3 => (0..3usize, 0..10u8, 0..3usize, proptest::option::of(0..4u8)).prop_map(
            |(tenant, priority, pools, key)| Op::Enqueue { tenant, priority, pools, key }
        ),
        3 => any::<bool>().prop_map(|pool_a| Op::Claim { pool_a }),
        2 => (any::<usize>(), 0..4u8).prop_map(|(pick, how)| Op::Finish { pick, how }),
        1 => any::<usize>().prop_map(|pick| Op::Heartbeat { pick }),
        1 => any::<usize>().prop_map(|pick| Op::Cancel { pick }),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(pick, resume)| Op::Pause { pick, resume }),
        1 => (0..2_500u64, any::<bool>()).prop_map(|(advance_ms, adopt)| Op::Expire { advance_ms, adopt }),
        1 => any::<usize>().prop_map(|pick| Op::Stale { pick }),
    ]
}

/// What the test knows the queue must hold.
#[derive(Default)]
struct Model {
    /// Every accepted job, in acceptance order.
    ids: Vec<String>,
    /// job -> its live token.
    live: HashMap<String, u64>,
    /// Superseded (job, token) pairs.
    stale: Vec<(String, u64)>,
    cancelled: HashSet<String>,
    /// (tenant, idempotency key) -> job.
    keyed: HashMap<(usize, u8), String>,
}

fn pick<T: Clone>(items: &[T], n: usize) -> Option<T> {
    (!items.is_empty()).then(|| items[n % items.len()].clone())
}

/// Runs `ops` on a fresh domain, checking after every step: the storage invariants
/// ([`check_invariants`]), no acknowledged job lost, at most one live token per job,
/// stale tokens refused and changing nothing, cancelled jobs never dispatched,
/// idempotency keys answering with their job, and FIFO among equals: a claim never
/// passes over an older never-dispatched job of the same tenant, priority and pools.
async fn run_ops(backend: Backend, ops: Vec<Op>) {
    let q = queue_with(backend, "random", |c| c.lease_ms = 1_000).await;
    q.set_pool("a", 2).await.unwrap();
    q.set_pool("b", 1).await.unwrap();
    let mut m = Model::default();
    for (step, op) in ops.iter().enumerate() {
        let ctx = format!("step {step} {op:?}");
        match op.clone() {
            Op::Enqueue {
                tenant,
                priority,
                pools,
                key,
            } => {
                let mut j = job(["x", "y", "z"][tenant], priority);
                j.pools = match pools {
                    0 => vec![],
                    1 => vec!["a".into()],
                    _ => vec!["b".into()],
                };
                j.idempotency_key = key.map(|k| format!("key-{k}"));
                let accepted = q.enqueue(&j).await.unwrap();
                match key.and_then(|k| m.keyed.get(&(tenant, k))) {
                    Some(first) => {
                        assert!(accepted.duplicate, "{ctx}: a repeated key made a new job");
                        assert_eq!(
                            &accepted.id, first,
                            "{ctx}: a repeated key answered another job"
                        );
                    }
                    None => {
                        assert!(!accepted.duplicate, "{ctx}");
                        if let Some(k) = key {
                            m.keyed.insert((tenant, k), accepted.id.clone());
                        }
                        m.ids.push(accepted.id);
                    }
                }
            }
            Op::Claim { pool_a } => {
                let pool = if pool_a { "a" } else { "b" };
                let before = q.inspect().await.unwrap();
                if let Some(lease) = q.claim(pool, "d", "").await.unwrap() {
                    assert!(
                        !m.cancelled.contains(&lease.id),
                        "{ctx}: cancelled job dispatched"
                    );
                    assert!(!m.live.contains_key(&lease.id), "{ctx}: second live lease");
                    let fresh =
                        |r: &JobRecord| r.attempts == 0 && r.preemptions == 0 && r.stalls == 0;
                    let (claimed, _) = before.jobs.iter().find(|(r, _)| r.id == lease.id).unwrap();
                    // In line, or waiting for a retry whose time has come (a claim
                    // promotes those first); never paused, cancelled or running.
                    assert!(
                        matches!(claimed.state, JobState::Queued | JobState::Delayed),
                        "{ctx}: claimed a job that is {:?}",
                        claimed.state
                    );
                    if fresh(claimed) {
                        for (other, _) in &before.jobs {
                            let equal = other.tenant == claimed.tenant
                                && other.priority == claimed.priority
                                && other.pools == claimed.pools;
                            assert!(
                                !(equal
                                    && other.state == JobState::Queued
                                    && fresh(other)
                                    && other.id < claimed.id),
                                "{ctx}: {} claimed before the older equal {}",
                                claimed.id,
                                other.id
                            );
                        }
                    }
                    m.live.insert(lease.id, lease.token);
                }
            }
            Op::Finish { pick: n, how } => {
                let live: Vec<(String, u64)> = sorted(&m.live);
                if let Some((id, token)) = pick(&live, n) {
                    m.live.remove(&id);
                    m.stale.push((id.clone(), token));
                    match how {
                        0 => q.complete(&id, token, "{}").await.unwrap(),
                        1 => {
                            training_failed(&q, &id, token, "x", true).await.unwrap();
                        }
                        2 => q
                            .preempt(&id, token, tuneq_openapi::StopCause::Preemption, "spot")
                            .await
                            .unwrap(),
                        _ => {
                            let pool = if n % 2 == 0 { "a" } else { "b" };
                            let next = q.complete_and_claim(&id, token, "{}", pool, "d");
                            if let Some(lease) = next.await.unwrap() {
                                assert!(
                                    !m.cancelled.contains(&lease.id),
                                    "{ctx}: cancelled job dispatched"
                                );
                                assert!(
                                    !m.live.contains_key(&lease.id),
                                    "{ctx}: second live lease"
                                );
                                m.live.insert(lease.id, lease.token);
                            }
                        }
                    }
                }
            }
            Op::Heartbeat { pick: n } => {
                if let Some((id, token)) = pick(&sorted(&m.live), n) {
                    q.heartbeat(&id, token, Some("{}")).await.unwrap();
                }
            }
            Op::Cancel { pick: n } => {
                if let Some(id) = pick(&m.ids, n) {
                    let state = q.cancel(&id).await.unwrap();
                    if let Some(t) = m.live.remove(&id) {
                        m.stale.push((id.clone(), t));
                    }
                    if state == JobState::CancelRequested {
                        q.confirm_cancelled(&id).await.unwrap();
                    }
                    if q.get(&id).await.unwrap().unwrap().state == JobState::Cancelled {
                        m.cancelled.insert(id);
                    }
                }
            }
            Op::Pause { pick: n, resume } => {
                if let Some(id) = pick(&m.ids, n) {
                    let before = q.get(&id).await.unwrap().unwrap();
                    let outcome = if resume {
                        q.resume(&id).await
                    } else {
                        q.pause(&id).await
                    };
                    let after = q.get(&id).await.unwrap().unwrap();
                    match outcome {
                        Ok(state) => assert_eq!(state, after.state, "{ctx}"),
                        Err(QueueError::WrongState { .. }) => {
                            assert_eq!(before, after, "{ctx}: a refused call changed the job")
                        }
                        Err(e) => panic!("{ctx}: {e}"),
                    }
                    assert!(
                        !(after.state == JobState::Paused && after.pause_requested),
                        "{ctx}: a paused job still waits for a pause"
                    );
                }
            }
            Op::Expire { advance_ms, adopt } => {
                q.advance_clock(advance_ms).await.unwrap();
                q.expire_leases(50).await.unwrap();
                for id in q.suspects(50).await.unwrap() {
                    let token = m.live.remove(&id).unwrap();
                    let verdict = if adopt {
                        SuspectVerdict::Adopt
                    } else {
                        SuspectVerdict::Requeue
                    };
                    if q.resolve_suspect(&id, token, verdict).await.unwrap() == JobState::Running {
                        m.live.insert(id, token);
                    } else {
                        m.stale.push((id, token));
                    }
                }
            }
            Op::Stale { pick: n } => {
                if let Some((id, token)) = pick(&m.stale, n) {
                    let before = q.get(&id).await.unwrap();
                    let outcome = q.complete(&id, token, "{}").await;
                    // The one success: repeating the completion this very attempt made
                    // (idempotent, so a lost reply is safe); it changes nothing either.
                    let own_repeat = before
                        .as_ref()
                        .is_some_and(|r| r.state == JobState::Succeeded && r.epoch == token);
                    assert!(
                        matches!(
                            outcome,
                            Err(QueueError::StaleToken(_)) | Err(QueueError::WrongState { .. })
                        ) || (own_repeat && outcome.is_ok()),
                        "{ctx}: stale token accepted: {outcome:?}"
                    );
                    assert_eq!(
                        before,
                        q.get(&id).await.unwrap(),
                        "{ctx}: stale call changed the job"
                    );
                }
            }
        }
        check_invariants(&q, &["a", "b"]).await;
        let seen = q.inspect().await.unwrap();
        let present: HashSet<&str> = seen.jobs.iter().map(|(r, _)| r.id.as_str()).collect();
        for id in &m.ids {
            assert!(present.contains(id.as_str()), "{ctx}: job {id} lost");
        }
        for (record, _) in &seen.jobs {
            let live = matches!(record.state, JobState::Leased | JobState::Running);
            assert_eq!(
                live,
                m.live.contains_key(&record.id),
                "{ctx}: live leases of {}",
                record.id
            );
            if let Some(token) = m.live.get(&record.id) {
                assert_eq!(record.epoch, *token, "{ctx}: one live token per job");
            }
        }
    }
    q.destroy().await.unwrap();
}

fn sorted(live: &HashMap<String, u64>) -> Vec<(String, u64)> {
    let mut v: Vec<(String, u64)> = live.iter().map(|(i, t)| (i.clone(), *t)).collect();
    v.sort();
    v
}

/// A proptest state machine over [`Op`]: random operation sequences from several
/// dispatchers, shrunk to the shortest failing one when an invariant breaks.
pub(crate) async fn random_sequences_keep_every_invariant(backend: Backend) {
    use proptest::test_runner::{Config, TestRunner};
    let handle = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || {
        let mut runner = TestRunner::new(Config {
            cases: 24,
            failure_persistence: None,
            ..Config::default()
        });
        let outcome = runner.run(&proptest::collection::vec(op(), 1..90), |ops| {
            handle.block_on(run_ops(backend, ops));
            Ok(())
        });
        if let Err(e) = outcome {
            panic!("{e}");
        }
    })
    .await
    .unwrap();
}
