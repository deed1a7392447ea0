//! The Kubernetes runtime: each attempt is a `batch/v1` Job (and its per-attempt Secret)
//! in the pool's namespace, created and read back through the API server with `kube`.
//!
//! Jobs and pods are watched (see `super::observe`), so following many attempts costs no
//! request per tick; an end seen in the watch caches is confirmed by reading the API
//! server itself before the attempt counts as over.
//!
//! Attempts outlive the dispatcher: a restarted one lists the Jobs of its pool
//! ([`Runtime::leftovers`]) and adopts those the queue still backs. Every delete is
//! `Background` (the API's default for Jobs orphans their pods) and nothing is ever
//! replaced (no PUT). An attempt counts as ended only once no pod of it is still alive,
//! so the next attempt of a job never runs beside a straggler of the last (the
//! double-run guard): a pod stuck on a node that is gone is force-deleted once the Node
//! object is confirmed deleted, and until then the attempt is still running.

use super::classify::{AttemptEnd, Limits, classify, non_terminal_pods};
use super::job::{
    AttemptLaunch, build_job, build_secret, check_pool, job_name, label_value, secret_name,
};
use super::observe::Observer;
use super::{ANNOTATION_ATTEMPT_UID, ANNOTATION_JOB_ID, LABEL_ATTEMPT, LABEL_JOB_ID, LABEL_POOL};
use crate::DispatchError;
use crate::runtime::{End, Launch, Runtime, State};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Node, Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tuneq_openapi::DeviceKind;
use tuneq_pools::{Hardware, KubernetesPool, Pool};

/// How attempts of one Kubernetes pool are started.
#[derive(Debug, Clone)]
pub struct KubernetesSettings {
    /// The pool (its `kubernetes` table is required).
    pub pool: Pool,
    /// Where trainers report (the API's base URL as pods reach it).
    pub report_base_url: String,
    /// How often the nodes under one attempt's live pods are checked for having vanished
    /// (a pod on a deleted VM stays `Running` in the API, so only the Node tells).
    pub node_check_every: Duration,
}

impl KubernetesSettings {
    /// Settings for `pool` reporting to `report_base_url`: the nodes under each attempt
    /// checked every ten seconds.
    pub fn new(pool: Pool, report_base_url: String) -> Self {
        Self {
            pool,
            report_base_url,
            node_check_every: Duration::from_secs(10),
        }
    }
}

/// The Kubernetes runtime of one pool.
pub struct KubernetesRuntime {
    settings: KubernetesSettings,
    k: KubernetesPool,
    jobs: Api<Job>,
    pods: Api<Pod>,
    secrets: Api<Secret>,
    nodes: Api<Node>,
    /// The pool's Jobs and pods as the watches report them.
    observer: Observer,
    /// When the nodes under each attempt's pods were last checked.
    nodes_checked: HashMap<(String, u64), Instant>,
    /// Attempts whose node vanished under them, and the node: they end as preempted.
    lost: HashMap<(String, u64), String>,
}

impl KubernetesRuntime {
    /// A runtime for `settings.pool` talking to the cluster through `client`; starts the
    /// pool's watches, so it must be made inside a tokio runtime. A pool whose Job cannot
    /// be built is refused here, before any job is claimed for it.
    pub fn new(client: kube::Client, settings: KubernetesSettings) -> Result<Self, DispatchError> {
        let k =
            settings
                .pool
                .kubernetes
                .clone()
                .ok_or_else(|| DispatchError::NotAKubernetesPool {
                    pool: settings.pool.name.clone(),
                })?;
        check_pool(&settings.pool)?;
        Ok(Self {
            observer: Observer::start(client.clone(), &k.namespace, &settings.pool.name),
            jobs: Api::namespaced(client.clone(), &k.namespace),
            pods: Api::namespaced(client.clone(), &k.namespace),
            secrets: Api::namespaced(client.clone(), &k.namespace),
            nodes: Api::all(client),
            k,
            settings,
            nodes_checked: HashMap::new(),
            lost: HashMap::new(),
        })
    }

    /// The label selector of one attempt's pods.
    fn attempt_selector(job: &str, token: u64) -> String {
        format!(
            "{LABEL_JOB_ID}={},{LABEL_ATTEMPT}={token}",
            label_value(job)
        )
    }

    /// The attempt's pods, as the API server has them now.
    async fn attempt_pods(&self, job: &str, token: u64) -> Result<Vec<Pod>, DispatchError> {
        Ok(self
            .pods
            .list(&ListParams::default().labels(&Self::attempt_selector(job, token)))
            .await
            .map_err(api("list the attempt's pods"))?
            .items)
    }

    /// The attempt's Job and pods: from the watch caches when they are current and
    /// `direct` is false, else from the API server. A Job the caches lack (created a
    /// moment ago, or gone) is always looked up.
    async fn observe(
        &self,
        job: &str,
        token: u64,
        direct: bool,
    ) -> Result<(Option<Job>, Vec<Pod>), DispatchError> {
        let name = job_name(job, token);
        if !direct && self.observer.is_current() {
            let pods = self.observer.pods(job, token);
            if let Some(found) = self.observer.job(&name) {
                return Ok((Some(found), pods));
            }
        }
        let found = self
            .jobs
            .get_opt(&name)
            .await
            .map_err(api("read the attempt's Job"))?;
        Ok((found, self.attempt_pods(job, token).await?))
    }

    /// Says how the attempt stands from its Job and pods as observed; checks the nodes
    /// under its live pods when `check_nodes`.
    async fn judge(
        &mut self,
        job: &str,
        token: u64,
        found: Option<Job>,
        pods: Vec<Pod>,
        check_nodes: bool,
    ) -> Result<State, DispatchError> {
        let key = (job.to_string(), token);
        let name = job_name(job, token);
        if check_nodes && let Some(node) = self.release_lost_pods(&pods).await? {
            tracing::warn!(job, token, %node, "the attempt's node is gone");
            self.lost.insert(key.clone(), node);
        }
        let alive = non_terminal_pods(&pods).len();
        if let Some(node) = self.lost.get(&key) {
            // Its node vanished: over once no pod of it can run anywhere else, whatever
            // the Job says. Pods on the vanished node cannot (they were force-deleted;
            // their objects may linger until the Job controller lets them go).
            let elsewhere = non_terminal_pods(&pods)
                .into_iter()
                .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()) != Some(node))
                .count();
            return Ok(if elsewhere > 0 {
                State::Running
            } else {
                State::Ended(End::Interrupted(format!("node {node} is gone")))
            });
        }
        let Some(found) = found else {
            // Deleted (by us after a cancel, by someone else, or by its TTL): over once
            // its pods are gone.
            return Ok(if alive > 0 {
                State::Running
            } else {
                State::Ended(End::Interrupted(format!(
                    "the attempt's Job {name} is gone"
                )))
            });
        };
        let limits = Limits::for_pool(&self.settings.pool, &self.k);
        let end = classify(&found, &pods, k8s_openapi::jiff::Timestamp::now(), &limits);
        if let AttemptEnd::Pending { .. } = end {
            return Ok(State::Pending);
        }
        if !end.is_over() {
            return Ok(State::Running);
        }
        // No node, or a container that could not be created: the pods never ran a
        // trainer, so once removed they cannot overlap the next attempt.
        let early = match &end {
            AttemptEnd::NoCapacity { message } => Some(End::NoCapacity(message.clone())),
            AttemptEnd::PlatformError { reason, message } => {
                Some(End::Platform(format!("{reason}: {message}")))
            }
            _ => None,
        };
        if let Some(early) = early {
            let live = non_terminal_pods(&pods);
            if live.iter().any(|p| !never_started(p)) {
                return Ok(State::Running);
            }
            if !live.is_empty() {
                self.delete_pods(job, token, 0).await?;
            }
            return Ok(State::Ended(early));
        }
        // The Job says it is over; the double-run guard waits for its pods.
        if alive > 0 {
            return Ok(State::Running);
        }
        Ok(State::Ended(match end {
            AttemptEnd::Succeeded => End::Finished,
            AttemptEnd::Preempted { reason, node } => End::Interrupted(match node {
                Some(node) => format!("preempted on node {node} ({reason})"),
                None => format!("preempted ({reason})"),
            }),
            AttemptEnd::BadInput { message } => End::BadInput(message),
            AttemptEnd::Diverged { message } => End::Diverged(message),
            AttemptEnd::OutOfMemory { message } => End::BadInput(message),
            AttemptEnd::Superseded => End::Superseded,
            AttemptEnd::Crashed { message, .. } => End::Crashed(message),
            AttemptEnd::DeadlineExceeded => End::Crashed(format!(
                "the attempt ran past its deadline of {}",
                humantime::format_duration(self.k.attempt_deadline)
            )),
            AttemptEnd::PlatformError { reason, message } => {
                End::Platform(format!("{reason}: {message}"))
            }
            AttemptEnd::NoCapacity { message } => End::NoCapacity(message),
            AttemptEnd::Running
            | AttemptEnd::Pending { .. }
            | AttemptEnd::NodeLost { .. }
            | AttemptEnd::Suspended => return Ok(State::Running),
        }))
    }

    /// Force-deletes live pods whose Node object is confirmed gone (a vanished VM
    /// leaves them `Running` in the API): they can no longer run, and the next attempt
    /// must not wait for them. Returns the node, when one was gone.
    async fn release_lost_pods(&self, pods: &[Pod]) -> Result<Option<String>, DispatchError> {
        let mut gone = None;
        for pod in non_terminal_pods(pods) {
            let (Some(name), Some(node)) = (
                &pod.metadata.name,
                pod.spec.as_ref().and_then(|s| s.node_name.as_ref()),
            ) else {
                continue;
            };
            match self.nodes.get_opt(node).await {
                Ok(Some(_)) => continue,
                Ok(None) => {}
                // Reading Nodes takes a cluster-wide grant (docs: "Running on
                // Kubernetes"); without it, a vanished node is noticed when Kubernetes'
                // own pod garbage collector marks its pods.
                Err(kube::Error::Api(status)) if status.code == 403 => {
                    tracing::debug!(node, "may not read Nodes; leaving lost pods to the pod GC");
                    continue;
                }
                Err(e) => return Err(api("read a Node")(e)),
            }
            tracing::warn!(pod = %name, node, "force-deleting a pod whose node is gone");
            ignore_missing(
                self.pods
                    .delete(name, &DeleteParams::background().grace_period(0))
                    .await,
            )?;
            gone = Some(node.clone());
        }
        Ok(gone)
    }

    /// Deletes the attempt's Job (its pods with it) after `grace` seconds for them.
    async fn delete_job(&self, job: &str, token: u64, grace: u32) -> Result<(), DispatchError> {
        let name = job_name(job, token);
        ignore_missing(
            self.jobs
                .delete(&name, &DeleteParams::background().grace_period(grace))
                .await,
        )
    }

    /// Deletes the attempt's pods with `grace` seconds to stop. A pod on a node gets at
    /// least a second: a grace of zero is a force delete, which removes the pod object at
    /// once without its kubelet confirming the trainer stopped (on an unreachable node it
    /// may still run), and the double-run guard would see nothing left to wait for. A pod
    /// that never got a node has nothing to stop and goes at once.
    async fn delete_pods(&self, job: &str, token: u64, grace: u32) -> Result<(), DispatchError> {
        let pods = self.attempt_pods(job, token).await?;
        for pod in non_terminal_pods(&pods) {
            let Some(name) = &pod.metadata.name else {
                continue;
            };
            let on_node = pod.spec.as_ref().is_some_and(|s| s.node_name.is_some());
            let grace = if on_node { grace.max(1) } else { 0 };
            ignore_missing(
                self.pods
                    .delete(name, &DeleteParams::background().grace_period(grace))
                    .await,
            )?;
        }
        Ok(())
    }
}

/// The Kubernetes client the runtime talks through.
pub type KubeClient = kube::Client;

/// A client for the cluster this process runs in, or the one `KUBECONFIG` (else
/// `~/.kube/config`) names.
pub async fn connect() -> Result<kube::Client, DispatchError> {
    kube::Client::try_default()
        .await
        .map_err(api("reach the Kubernetes API"))
}

/// Whether `pod` never ran its container: unscheduled, or its container still waiting
/// to be created (an image not pulled, a Secret missing).
fn never_started(pod: &Pod) -> bool {
    let Some(status) = &pod.status else {
        return true;
    };
    if status.phase.as_deref() != Some("Pending") {
        return false;
    }
    status.container_statuses.as_ref().is_none_or(|statuses| {
        statuses
            .iter()
            .all(|c| c.state.as_ref().is_none_or(|s| s.waiting.is_some()))
    })
}

/// A `kube` error on `what` as the dispatcher's.
fn api(what: &'static str) -> impl FnOnce(kube::Error) -> DispatchError {
    move |source| DispatchError::Kubernetes { what, source }
}

/// A delete's result, a missing object counting as deleted.
fn ignore_missing<T>(result: Result<T, kube::Error>) -> Result<(), DispatchError> {
    match result {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.is_not_found() => Ok(()),
        Err(e) => Err(api("delete")(e)),
    }
}

#[async_trait::async_trait]
impl Runtime for KubernetesRuntime {
    fn kind(&self) -> &'static str {
        "kubernetes"
    }

    fn attempts_outlive_dispatcher(&self) -> bool {
        true
    }

    async fn start(&mut self, launch: &Launch<'_>) -> Result<(), DispatchError> {
        let mut spec = launch.spec.clone();
        spec.device = match self.settings.pool.hardware {
            Hardware::Gpu => DeviceKind::Cuda,
            Hardware::Cpu => DeviceKind::Cpu,
        };
        let spec_json = serde_json::to_string(&spec)?;
        let attempt = AttemptLaunch {
            job_id: launch.job.to_string(),
            attempt: launch.token,
            tenant: launch.tenant.to_string(),
            pool: self.settings.pool.name.clone(),
            spec_hash: AttemptLaunch::hash_spec(&spec_json),
            spec_json,
            report_url: format!(
                "{}/internal/attempts/{}/report",
                self.settings.report_base_url.trim_end_matches('/'),
                launch.job
            ),
            credential: launch.credential.to_string(),
        };
        let manifest = build_job(&attempt, &self.settings.pool, &self.k)?;
        let name = job_name(launch.job, launch.token);
        let created = match self.jobs.create(&PostParams::default(), &manifest).await {
            Ok(created) => created,
            // Created by an earlier try whose answer was lost: adopt it only if it is
            // this very attempt (the fencing token in its annotation).
            Err(kube::Error::Api(status)) if status.is_already_exists() => {
                let existing = self
                    .jobs
                    .get(&name)
                    .await
                    .map_err(api("read the existing Job"))?;
                let token = existing
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(ANNOTATION_ATTEMPT_UID));
                if token.map(String::as_str) != Some(launch.token.to_string().as_str()) {
                    return Err(DispatchError::NameTaken { name });
                }
                tracing::info!(job = launch.job, %name, "adopting the attempt's existing Job");
                existing
            }
            Err(e) => return Err(api("create the attempt's Job")(e)),
        };
        let secret = build_secret(&attempt, &self.k.namespace, created.metadata.uid.as_deref());
        match self.secrets.create(&PostParams::default(), &secret).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.is_already_exists() => {}
            Err(e) => return Err(api("create the attempt's Secret")(e)),
        }
        tracing::info!(job = launch.job, %name, pool = %self.settings.pool.name, "attempt Job created");
        Ok(())
    }

    async fn poll(&mut self, job: &str, token: u64) -> Result<State, DispatchError> {
        let key = (job.to_string(), token);
        let check_nodes = self
            .nodes_checked
            .get(&key)
            .is_none_or(|at| at.elapsed() >= self.settings.node_check_every);
        if check_nodes {
            self.nodes_checked.insert(key, Instant::now());
        }
        let (found, pods) = self.observe(job, token, false).await?;
        let state = self.judge(job, token, found, pods, check_nodes).await?;
        if !matches!(state, State::Ended(_)) {
            return Ok(state);
        }
        // An attempt is over for good: confirm it from the API server itself, so a cache
        // a moment behind can never let the next attempt start beside a live pod.
        let (found, pods) = self.observe(job, token, true).await?;
        self.judge(job, token, found, pods, true).await
    }

    async fn stop(&mut self, job: &str, token: u64) -> Result<(), DispatchError> {
        let grace = u32::try_from(self.k.termination_grace.as_secs()).unwrap_or(u32::MAX);
        self.delete_pods(job, token, grace).await
    }

    async fn kill(&mut self, job: &str, token: u64) -> Result<(), DispatchError> {
        self.delete_pods(job, token, 0).await?;
        self.delete_job(job, token, 0).await
    }

    async fn release(&mut self, job: &str, token: u64) -> Result<(), DispatchError> {
        self.nodes_checked.remove(&(job.to_string(), token));
        self.lost.remove(&(job.to_string(), token));
        self.delete_job(job, token, 0).await?;
        // Owned by the Job, so collected with it; deleted here too in case the owner
        // reference could not be set.
        ignore_missing(
            self.secrets
                .delete(&secret_name(job, token), &DeleteParams::background())
                .await,
        )
    }

    async fn leftovers(&mut self) -> Result<Vec<(String, u64)>, DispatchError> {
        let selector = format!(
            "{},{LABEL_POOL}={}",
            super::MANAGED_SELECTOR,
            label_value(&self.settings.pool.name)
        );
        let jobs = self
            .jobs
            .list(&ListParams::default().labels(&selector))
            .await
            .map_err(api("list the pool's Jobs"))?;
        Ok(jobs
            .items
            .into_iter()
            .filter_map(|j| {
                let annotations = j.metadata.annotations?;
                let job = annotations.get(ANNOTATION_JOB_ID)?.clone();
                let token = annotations.get(ANNOTATION_ATTEMPT_UID)?.parse().ok()?;
                Some((job, token))
            })
            .collect())
    }
}
