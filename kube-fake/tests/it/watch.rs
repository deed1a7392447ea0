//! Watches: raw events, bookmarks, `Expired`, and kube-runtime's `watcher` on top.

use crate::job;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::batch::v1::Job;
use kube::api::{Api, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kube::runtime::watcher;
use serde_json::json;
use std::time::Duration;
use tuneq_kube_fake::FakeCluster;

const WAIT: Duration = Duration::from_secs(10);

#[tokio::test]
async fn a_watch_replays_after_its_version_filters_bookmarks_and_ends_at_its_timeout() {
    let cluster = FakeCluster::new();
    cluster.set_bookmark_interval(Duration::from_millis(50));
    let jobs: Api<Job> = Api::default_namespaced(cluster.client());
    jobs.create(&PostParams::default(), &job("a", json!({"app": "tuneq"})))
        .await
        .unwrap();
    jobs.create(&PostParams::default(), &job("b", json!({"app": "other"})))
        .await
        .unwrap();
    let wp = WatchParams::default().labels("app=tuneq").timeout(1);
    let mut stream = jobs.watch(&wp, "1").await.unwrap().boxed();
    jobs.patch_status(
        "a",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"active": 1}})),
    )
    .await
    .unwrap();
    let mut seen = Vec::new();
    let mut bookmark = None;
    let ended = tokio::time::timeout(WAIT, async {
        while let Some(e) = stream.try_next().await.unwrap() {
            match e {
                WatchEvent::Added(j) | WatchEvent::Modified(j) | WatchEvent::Deleted(j) => {
                    seen.push((
                        j.metadata.name.unwrap(),
                        j.metadata.resource_version.unwrap(),
                    ));
                }
                WatchEvent::Bookmark(b) => bookmark = Some(b.metadata.resource_version),
                WatchEvent::Error(e) => panic!("{e:?}"),
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the stream ends at timeoutSeconds");
    assert_eq!(
        seen,
        vec![("a".to_string(), "3".to_string())],
        "only after rv 1, only app=tuneq"
    );
    assert_eq!(bookmark.as_deref(), Some("3"));

    // An injected expiry: one ERROR event with reason Expired, code 410.
    cluster.expire_next_watches(1);
    let mut stream = jobs.watch(&wp, "3").await.unwrap().boxed();
    match stream.try_next().await.unwrap() {
        Some(WatchEvent::Error(e)) => assert_eq!((e.code, e.reason.as_str()), (410, "Expired")),
        other => panic!("{other:?}"),
    }
    // A compaction: old versions are expired, new ones are not.
    cluster.compact();
    let mut stream = jobs.watch(&wp, "2").await.unwrap().boxed();
    assert!(
        matches!(stream.try_next().await.unwrap(), Some(WatchEvent::Error(e)) if e.code == 410)
    );
}

#[tokio::test]
async fn the_watcher_sees_a_job_and_its_status_and_recovers_after_an_expiry() {
    let cluster = FakeCluster::new();
    let jobs: Api<Job> = Api::default_namespaced(cluster.client());
    let config = watcher::Config::default().labels("app.kubernetes.io/managed-by=tuneq");
    let mut events = watcher(jobs.clone(), config).boxed();
    let managed = json!({"app.kubernetes.io/managed-by": "tuneq"});

    // The first list: empty.
    assert!(matches!(next(&mut events).await, watcher::Event::Init));
    assert!(matches!(next(&mut events).await, watcher::Event::InitDone));

    jobs.create(&PostParams::default(), &job("a", managed.clone()))
        .await
        .unwrap();
    jobs.create(&PostParams::default(), &job("ignored", json!({})))
        .await
        .unwrap();
    match next(&mut events).await {
        watcher::Event::Apply(j) => assert_eq!(j.metadata.name.as_deref(), Some("a")),
        other => panic!("{other:?}"),
    }
    cluster.sync_jobs();
    match next(&mut events).await {
        watcher::Event::Apply(j) => {
            let status = j.status.unwrap();
            assert!(status.start_time.is_some());
            assert_eq!(status.active, Some(1));
        }
        other => panic!("{other:?}"),
    }

    // Expire the next watch and cut the open one: the watcher relists and goes on.
    cluster.expire_next_watches(1);
    cluster.close_watches();
    let mut relisted = false;
    let mut saw_b = false;
    let mut saw_expired = false;
    jobs.create(&PostParams::default(), &job("b", managed))
        .await
        .unwrap();
    for _ in 0..10 {
        let event = tokio::time::timeout(WAIT, events.try_next())
            .await
            .expect("an event in time");
        match event {
            Err(watcher::Error::WatchError(e)) => {
                assert_eq!((e.code, e.reason.as_str()), (410, "Expired"));
                saw_expired = true;
            }
            Err(other) => panic!("{other:?}"),
            Ok(None) => panic!("the watcher ended"),
            Ok(Some(watcher::Event::Init)) => relisted = true,
            Ok(Some(watcher::Event::InitApply(j) | watcher::Event::Apply(j)))
                if j.metadata.name.as_deref() == Some("b") =>
            {
                saw_b = true;
                if relisted {
                    break;
                }
            }
            _ => {}
        }
    }
    assert!(
        saw_expired && relisted && saw_b,
        "expired: {saw_expired}, relisted: {relisted}, saw b: {saw_b}"
    );
    let lists = cluster
        .requests()
        .into_iter()
        .filter(|r| r.method == "GET" && !r.is_watch())
        .count();
    assert!(lists >= 2, "the watcher listed again");
    assert!(
        cluster
            .requests()
            .iter()
            .filter(|r| r.method == "GET")
            .all(|r| {
                r.query_param("labelSelector") == Some("app.kubernetes.io/managed-by=tuneq")
            })
    );
}

type Events = futures::stream::BoxStream<'static, Result<watcher::Event<Job>, watcher::Error>>;

async fn next(events: &mut Events) -> watcher::Event<Job> {
    tokio::time::timeout(WAIT, events.try_next())
        .await
        .expect("an event in time")
        .unwrap()
        .unwrap()
}
