//! What the runtime sees of its pool's Jobs and pods, kept current by watches instead of
//! reading every attempt from the API server on every tick.
//!
//! One watch of Jobs and one of pods per pool, each filtered by tuneq's labels and the
//! pool's, feed two caches (`kube-runtime` reflectors). A watch that breaks relists on its
//! own (410 `Expired` included) with a backoff. While a watch has not finished its first
//! list, or since it last failed and has not delivered a change again, its cache counts
//! as stale and the runtime reads the API server directly: a stale cache may slow an
//! attempt's end down, never hide a live pod.

use super::job::label_value;
use super::{LABEL_ATTEMPT, LABEL_JOB_ID, LABEL_POOL, MANAGED_SELECTOR};
use futures::StreamExt;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::task::JoinHandle;

/// One watched kind: its cache, whether the cache is current, and the task feeding it.
struct Watched<K: kube::Resource<DynamicType = ()> + Clone + 'static> {
    store: Store<K>,
    current: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl<K> Watched<K>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    /// Starts watching `api` for objects matching `selector` (needs a tokio runtime).
    fn start(api: Api<K>, selector: &str, what: &'static str, pool: &str) -> Self {
        let (store, writer) = reflector::store();
        let current = Arc::new(AtomicBool::new(false));
        let flag = current.clone();
        let pool = pool.to_string();
        let events = reflector::reflector(
            writer,
            watcher(api, watcher::Config::default().labels(selector)).default_backoff(),
        );
        let task = tokio::spawn(async move {
            let mut events = std::pin::pin!(events);
            while let Some(event) = events.next().await {
                match event {
                    // A list finished, or a change arrived on a working watch.
                    Ok(watcher::Event::InitDone | watcher::Event::Apply(_))
                    | Ok(watcher::Event::Delete(_)) => {
                        if !flag.swap(true, Ordering::AcqRel) {
                            tracing::debug!(pool, what, "watch is current");
                        }
                    }
                    Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => {}
                    Err(e) => {
                        if flag.swap(false, Ordering::AcqRel) {
                            tracing::warn!(
                                pool,
                                what,
                                error = &e as &dyn std::error::Error,
                                "watch failed; reading the API server directly until it recovers"
                            );
                        } else {
                            tracing::debug!(
                                pool,
                                what,
                                error = &e as &dyn std::error::Error,
                                "watch still failing"
                            );
                        }
                    }
                }
            }
        });
        Self {
            store,
            current,
            task,
        }
    }

    fn is_current(&self) -> bool {
        self.current.load(Ordering::Acquire)
    }
}

impl<K: kube::Resource<DynamicType = ()> + Clone + 'static> Drop for Watched<K> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The watched Jobs and pods of one pool.
pub(super) struct Observer {
    namespace: String,
    jobs: Watched<Job>,
    pods: Watched<Pod>,
}

impl Observer {
    /// Starts the pool's two watches in `namespace` (needs a tokio runtime).
    pub(super) fn start(client: kube::Client, namespace: &str, pool: &str) -> Self {
        let selector = format!("{MANAGED_SELECTOR},{LABEL_POOL}={}", label_value(pool));
        Self {
            namespace: namespace.to_string(),
            jobs: Watched::start(
                Api::namespaced(client.clone(), namespace),
                &selector,
                "jobs",
                pool,
            ),
            pods: Watched::start(Api::namespaced(client, namespace), &selector, "pods", pool),
        }
    }

    /// Whether both caches are current; if not, read the API server instead.
    pub(super) fn is_current(&self) -> bool {
        self.jobs.is_current() && self.pods.is_current()
    }

    /// The Job named `name`, as last seen (a Job just created may not be seen yet).
    pub(super) fn job(&self, name: &str) -> Option<Job> {
        self.jobs
            .store
            .get(&ObjectRef::new(name).within(&self.namespace))
            .map(|job| Job::clone(&job))
    }

    /// The pods of attempt `token` of `job`, as last seen.
    pub(super) fn pods(&self, job: &str, token: u64) -> Vec<Pod> {
        let job_label = label_value(job);
        let token = token.to_string();
        self.pods
            .store
            .state_filter(|pod| {
                pod.metadata.labels.as_ref().is_some_and(|labels| {
                    labels.get(LABEL_JOB_ID) == Some(&job_label)
                        && labels.get(LABEL_ATTEMPT) == Some(&token)
                })
            })
            .into_iter()
            .map(|pod| Pod::clone(&pod))
            .collect()
    }
}
