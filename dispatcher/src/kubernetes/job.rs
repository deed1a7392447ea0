//! An attempt's `batch/v1` Job and its Secret, built from the attempt and its pool.
//!
//! The shape, and why, is in `docs/kubernetes.md`: deterministic names, the
//! same labels on the Job and its pod template, `restartPolicy: Never`, `backoffLimit: 0`,
//! the two `podFailurePolicy` rules the classifier reads back by index, requests equal to
//! limits, a non-root read-only container, and the credential only in the Secret.

mod volumes;

use super::{
    ANNOTATION_ATTEMPT_UID, ANNOTATION_JOB_ID, ANNOTATION_SPEC_HASH, CONTAINER, LABEL_ATTEMPT,
    LABEL_JOB_ID, LABEL_MANAGED_BY, LABEL_NAME, LABEL_POOL, LABEL_TENANT, MANAGED_BY,
    RULE_BAD_INPUT, RULE_DISRUPTION, TRAINER_APP,
};
use k8s_openapi::ByteString;
use k8s_openapi::api::batch::v1::{
    Job, JobSpec, PodFailurePolicy, PodFailurePolicyOnExitCodesRequirement,
    PodFailurePolicyOnPodConditionsPattern, PodFailurePolicyRule,
};
use k8s_openapi::api::core::v1::{
    Affinity, Capabilities, Container, EnvVar, EnvVarSource, NodeAffinity, NodeSelector,
    NodeSelectorRequirement, NodeSelectorTerm, PodSecurityContext, PodSpec, PodTemplateSpec,
    ResourceFieldSelector, ResourceRequirements, SeccompProfile, Secret, SecretKeySelector,
    SecurityContext, Toleration, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fmt;
use tuneq_openapi::launch;
use tuneq_pools::file::{NodeOperator, TaintEffect, TolerationOperator};
use tuneq_pools::quantity::Memory;
use tuneq_pools::{Hardware, KubernetesPool, Pool};
use volumes::volumes;

/// Longest object name that is also a valid label value and pod hostname prefix.
pub const MAX_NAME: usize = 63;
/// Longest label value.
pub const MAX_LABEL_VALUE: usize = 63;
/// Hex digits of sha256 appended to a name or label value that had to be changed.
const HASH_HEX: usize = 10;

/// Where the attempt's Secret is mounted in the trainer container.
pub const ATTEMPT_DIR: &str = "/var/run/tuneq/attempt";
/// The spec's key in the Secret, and its file name under [`ATTEMPT_DIR`].
pub const SPEC_KEY: &str = "spec.json";
/// The report credential's key in the Secret.
pub const CREDENTIAL_KEY: &str = "credential";
/// The trainer's cache of remote models and datasets (an emptyDir, unless the pool mounts
/// a volume of its own there, such as a shared model cache).
pub const CACHE_DIR: &str = "/var/cache/tuneq";
/// The user and group the trainer runs as (any non-root id works; the image needs no
/// user of that id).
pub const TRAINER_UID: i64 = 10001;
/// The resource name of NVIDIA GPUs (the device plugin's).
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// How long a finished Job stays before Kubernetes deletes it, if the dispatcher has not
/// already: a backstop, since the dispatcher records the outcome first and then deletes.
pub const TTL_AFTER_FINISHED_SECS: i32 = 7 * 24 * 3600;
/// `/dev/shm`'s size when the pool does not say.
pub const DEFAULT_SHM: &str = "1Gi";

/// Why an attempt's Job could not be built from its pool.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BuildError {
    /// The pool says no memory per attempt (only pools from the `--pool` shorthand lack it,
    /// and those are local).
    #[error("pool {pool} says no memory per attempt; a Kubernetes pool needs one")]
    NoMemory {
        /// The pool.
        pool: String,
    },
    /// A pool volume takes a name or mount path the runtime uses itself.
    #[error("pool {pool}: volume {volume} clashes with the runtime's own {what}")]
    VolumeClash {
        /// The pool.
        pool: String,
        /// The volume's index in the pool's `volumes`.
        index: usize,
        /// The pool's volume.
        volume: String,
        /// What it clashes with (a volume name or a mount path).
        what: String,
    },
}

impl BuildError {
    /// Whether trying again can help: never, the pools file must change.
    pub fn is_retryable(&self) -> bool {
        false
    }

    /// The pool's field at fault, as the pools file's errors name fields
    /// (`kubernetes.volumes[2]`).
    pub fn field(&self) -> String {
        match self {
            Self::NoMemory { .. } => "memory".into(),
            Self::VolumeClash { index, .. } => format!("kubernetes.volumes[{index}]"),
        }
    }
}

/// Builds a Job for a sample attempt on `pool`, so what only the runtime knows (its own
/// volumes and mount paths) is checked when the pools file is read, not when a job
/// first runs there. A pool without a `kubernetes` table has no Job and passes.
pub fn check_pool(pool: &Pool) -> Result<(), BuildError> {
    let Some(k) = &pool.kubernetes else {
        return Ok(());
    };
    let sample = AttemptLaunch {
        job_id: "check".into(),
        attempt: 1,
        tenant: "check".into(),
        pool: pool.name.clone(),
        spec_json: "{}".into(),
        report_url: "http://tuneq-api/internal/attempts/check/report".into(),
        credential: String::new(),
        spec_hash: AttemptLaunch::hash_spec("{}"),
    };
    build_job(&sample, pool, k).map(|_| ())
}

/// What the dispatcher knows about an attempt when it starts it on a Kubernetes pool.
#[derive(Clone, PartialEq, Eq)]
pub struct AttemptLaunch {
    /// The training job's id.
    pub job_id: String,
    /// The attempt number, the queue lease's fencing token: a later attempt has a larger
    /// one, and a Job carrying another token is never adopted.
    pub attempt: u64,
    /// The tenant the job belongs to.
    pub tenant: String,
    /// The pool the attempt runs on.
    pub pool: String,
    /// The attempt's `TrainSpec`, as JSON (mounted as `spec.json`).
    pub spec_json: String,
    /// Where the trainer posts its progress reports.
    pub report_url: String,
    /// The attempt's report credential: kept in the Secret only, never printed.
    pub credential: String,
    /// sha256 of `spec_json`, hex ([`AttemptLaunch::hash_spec`]).
    pub spec_hash: String,
}

impl AttemptLaunch {
    /// The `spec_hash` of a spec: sha256 of its JSON, hex.
    pub fn hash_spec(spec_json: &str) -> String {
        hex::encode(Sha256::digest(spec_json.as_bytes()))
    }
}

impl fmt::Debug for AttemptLaunch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AttemptLaunch")
            .field("job_id", &self.job_id)
            .field("attempt", &self.attempt)
            .field("tenant", &self.tenant)
            .field("pool", &self.pool)
            .field("spec_hash", &self.spec_hash)
            .field("report_url", &self.report_url)
            .field("credential", &"[redacted]")
            .finish_non_exhaustive()
    }
}

/// The Job of attempt `attempt` of job `job_id`: `tq-<job-id>-a<attempt>`, a lowercase RFC
/// 1123 label of at most 63 characters.
///
/// `attempt` is the queue lease's fencing token, not a count of the job's attempts: the
/// queue draws every token from one counter shared by all jobs of its scheduling domain,
/// so one job's Jobs carry growing but not consecutive numbers (`-a7`, then `-a93`), and
/// no two attempts of a job ever share a name. A job id that would make it longer, or that has
/// characters other than `a-z`, `0-9` and `-`, is lowercased, cleaned, cut, and followed by
/// a hash of the original id, so the name stays the same for the same attempt and
/// differs between jobs.
pub fn job_name(job_id: &str, attempt: u64) -> String {
    dns_name(job_id, &format!("-a{attempt}"))
}

/// The Secret of attempt `attempt` of job `job_id`: `tq-<job-id>-a<attempt>-cred`, by the
/// same rules as [`job_name`].
pub fn secret_name(job_id: &str, attempt: u64) -> String {
    dns_name(job_id, &format!("-a{attempt}-cred"))
}

/// `tq-<id><suffix>`, shortened with a hash of `id` when needed to be a 63-character
/// RFC 1123 label.
fn dns_name(id: &str, suffix: &str) -> String {
    const PREFIX: &str = "tq-";
    let clean = !id.is_empty()
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if clean && PREFIX.len() + id.len() + suffix.len() <= MAX_NAME {
        return format!("{PREFIX}{id}{suffix}");
    }
    let hash = short_hash(id);
    let room = MAX_NAME - PREFIX.len() - suffix.len() - HASH_HEX - 1;
    let mut kept: String = id
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .map(|c| {
            if c.is_ascii_lowercase() || c.is_ascii_digit() {
                c
            } else {
                '-'
            }
        })
        .take(room)
        .collect();
    // `tq-` already starts with a letter; only a run of `-` before the hash would look odd.
    while kept.ends_with('-') {
        kept.pop();
    }
    if kept.is_empty() {
        format!("{PREFIX}{hash}{suffix}")
    } else {
        format!("{PREFIX}{kept}-{hash}{suffix}")
    }
}

/// The first hex digits of sha256 of `text`.
fn short_hash(text: &str) -> String {
    let mut hex = hex::encode(Sha256::digest(text.as_bytes()));
    hex.truncate(HASH_HEX);
    hex
}

/// Whether `value` is a valid label value: at most 63 characters of `A-Za-z0-9-_.`,
/// alphanumeric at both ends, or empty.
pub fn is_label_value(value: &str) -> bool {
    let alnum = |c: char| c.is_ascii_alphanumeric();
    value.len() <= MAX_LABEL_VALUE
        && value
            .chars()
            .all(|c| alnum(c) || matches!(c, '-' | '_' | '.'))
        && value.chars().next().is_none_or(alnum)
        && value.chars().last().is_none_or(alnum)
}

/// `value` as a label value: itself when valid, else cleaned, cut and followed by a hash
/// of the original (the full value goes in an annotation where it matters).
pub fn label_value(value: &str) -> String {
    if is_label_value(value) {
        return value.to_string();
    }
    let hash = short_hash(value);
    let room = MAX_LABEL_VALUE - HASH_HEX - 1;
    let kept: String = value
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '-'
            }
        })
        .take(room)
        .collect();
    let kept = kept.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    if kept.is_empty() {
        hash
    } else {
        format!("{kept}-{hash}")
    }
}

/// The labels of an attempt's Job, its pods and its Secret.
pub fn labels(launch: &AttemptLaunch) -> BTreeMap<String, String> {
    [
        (LABEL_MANAGED_BY, MANAGED_BY.to_string()),
        (LABEL_NAME, TRAINER_APP.to_string()),
        (LABEL_JOB_ID, label_value(&launch.job_id)),
        (LABEL_ATTEMPT, launch.attempt.to_string()),
        (LABEL_POOL, label_value(&launch.pool)),
        (LABEL_TENANT, label_value(&launch.tenant)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// The annotations of an attempt's Job and Secret: the fencing token, the spec's hash and
/// the job id unshortened.
pub fn annotations(launch: &AttemptLaunch) -> BTreeMap<String, String> {
    [
        (ANNOTATION_ATTEMPT_UID, launch.attempt.to_string()),
        (ANNOTATION_SPEC_HASH, launch.spec_hash.clone()),
        (ANNOTATION_JOB_ID, launch.job_id.clone()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// Seconds of a duration as Kubernetes takes them (saturating; pools bound them anyway).
fn seconds(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_secs()).unwrap_or(i64::MAX)
}

/// The attempt's Job on `pool` (whose Kubernetes settings are `k`), in `k.namespace`.
///
/// The trainer runs `tuneq` (the image's entrypoint) with
/// [`launch::trainer_args`] on the spec mounted from the attempt's Secret, reports to
/// `launch.report_url` with the credential from that Secret, and gets the pool's CPU,
/// memory and GPUs as both requests and limits (Guaranteed QoS).
pub fn build_job(
    launch: &AttemptLaunch,
    pool: &Pool,
    k: &KubernetesPool,
) -> Result<Job, BuildError> {
    let memory = pool.memory.as_ref().ok_or_else(|| BuildError::NoMemory {
        pool: pool.name.clone(),
    })?;
    let secret = secret_name(&launch.job_id, launch.attempt);
    let labels = labels(launch);
    let (volumes, mounts) = volumes(pool, k, &secret)?;
    let container = trainer_container(
        k,
        resources(pool, memory),
        trainer_env(launch, pool, k, &secret),
        mounts,
    );
    let pod = pod_spec(k, container, volumes);

    Ok(Job {
        metadata: ObjectMeta {
            name: Some(job_name(&launch.job_id, launch.attempt)),
            namespace: Some(k.namespace.clone()),
            labels: Some(labels.clone()),
            annotations: Some(annotations(launch)),
            ..Default::default()
        },
        spec: Some(JobSpec {
            backoff_limit: Some(0),
            completions: Some(1),
            parallelism: Some(1),
            active_deadline_seconds: Some(seconds(k.attempt_deadline)),
            ttl_seconds_after_finished: Some(TTL_AFTER_FINISHED_SECS),
            // No replacement pod while the old one terminates (the only value allowed with
            // a podFailurePolicy; written out so nobody removes the policy unaware).
            pod_replacement_policy: Some("Failed".to_string()),
            pod_failure_policy: Some(pod_failure_policy()),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels),
                    annotations: (!k.pod_annotations.is_empty()).then(|| k.pod_annotations.clone()),
                    ..Default::default()
                }),
                spec: Some(pod),
            },
            ..Default::default()
        }),
        status: None,
    })
}

/// The trainer's CPU, memory and (on a GPU pool) GPUs, used as both its requests and its
/// limits.
fn resources(pool: &Pool, memory: &Memory) -> BTreeMap<String, Quantity> {
    let mut resources = BTreeMap::from([
        ("cpu".to_string(), Quantity(pool.cpu.0.as_str().to_string())),
        (
            "memory".to_string(),
            Quantity(memory.0.as_str().to_string()),
        ),
    ]);
    if pool.hardware == Hardware::Gpu {
        resources.insert(
            GPU_RESOURCE.to_string(),
            Quantity(pool.accelerators.to_string()),
        );
    }
    resources
}

/// The trainer's environment: the launch contract's variables (report URL, the credential
/// from the attempt's Secret, cache dir, memory limits), then the pool's own `env`.
fn trainer_env(
    launch: &AttemptLaunch,
    pool: &Pool,
    k: &KubernetesPool,
    secret: &str,
) -> Vec<EnvVar> {
    let mut env = vec![
        EnvVar {
            name: launch::ENV_REPORT_URL.to_string(),
            value: Some(launch.report_url.clone()),
            ..Default::default()
        },
        EnvVar {
            name: launch::ENV_REPORT_CREDENTIAL.to_string(),
            value_from: Some(EnvVarSource {
                secret_key_ref: Some(SecretKeySelector {
                    name: secret.to_string(),
                    key: CREDENTIAL_KEY.to_string(),
                    optional: Some(false),
                }),
                ..Default::default()
            }),
            ..Default::default()
        },
        EnvVar {
            name: launch::ENV_CACHE_DIR.to_string(),
            value: Some(CACHE_DIR.to_string()),
            ..Default::default()
        },
        // The container's own memory limit, in bytes, from the kubelet: the trainer
        // turns activation checkpointing on when a step would not fit under it
        // (`activation_checkpointing: auto`) and stops with the figures before the
        // kernel's OOM killer would.
        EnvVar {
            name: launch::ENV_MEMORY_LIMIT_BYTES.to_string(),
            value_from: Some(EnvVarSource {
                resource_field_ref: Some(ResourceFieldSelector {
                    container_name: Some(CONTAINER.to_string()),
                    resource: "limits.memory".to_string(),
                    divisor: None,
                }),
                ..Default::default()
            }),
            ..Default::default()
        },
    ];
    // One accelerator's memory (the trainer uses one device): with `auto`, the graph
    // recomputes layers when keeping them would not fit.
    if pool.hardware == Hardware::Gpu
        && let Some(memory) = &pool.accelerator_memory
    {
        env.push(EnvVar {
            name: launch::ENV_ACCELERATOR_MEMORY_BYTES.to_string(),
            value: Some(memory.bytes().to_string()),
            ..Default::default()
        });
    }
    env.extend(k.env.iter().map(|(name, value)| EnvVar {
        name: name.clone(),
        value: Some(value.clone()),
        ..Default::default()
    }));
    env
}

/// The trainer container: the pool's image running the launch contract's arguments, with
/// `resources` as requests and limits, as a non-root user on a read-only root filesystem
/// with every capability dropped.
fn trainer_container(
    k: &KubernetesPool,
    resources: BTreeMap<String, Quantity>,
    env: Vec<EnvVar>,
    mounts: Vec<VolumeMount>,
) -> Container {
    let spec_path = format!("{ATTEMPT_DIR}/{SPEC_KEY}");
    Container {
        name: CONTAINER.to_string(),
        image: Some(k.image.clone()),
        image_pull_policy: Some("IfNotPresent".to_string()),
        args: Some(launch::trainer_args(&spec_path)),
        env: Some(env),
        resources: Some(ResourceRequirements {
            requests: Some(resources.clone()),
            limits: Some(resources),
            ..Default::default()
        }),
        volume_mounts: Some(mounts),
        security_context: Some(SecurityContext {
            run_as_non_root: Some(true),
            run_as_user: Some(TRAINER_UID),
            run_as_group: Some(TRAINER_UID),
            allow_privilege_escalation: Some(false),
            privileged: Some(false),
            read_only_root_filesystem: Some(true),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".to_string()]),
                ..Default::default()
            }),
            ..Default::default()
        }),
        // The trainer's last words (a bad-input reason) become the container's
        // termination message, which the classifier reports.
        termination_message_policy: Some("FallbackToLogsOnError".to_string()),
        ..Default::default()
    }
}

/// The pool's `affinity` as a required node affinity, or none when the pool has no rules.
fn node_affinity(k: &KubernetesPool) -> Option<Affinity> {
    (!k.affinity.is_empty()).then(|| Affinity {
        node_affinity: Some(NodeAffinity {
            required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                // One term: its expressions must all hold.
                node_selector_terms: vec![NodeSelectorTerm {
                    match_expressions: Some(
                        k.affinity
                            .iter()
                            .map(|r| NodeSelectorRequirement {
                                key: r.key.clone(),
                                operator: node_operator(r.operator).to_string(),
                                values: (!r.values.is_empty()).then(|| r.values.clone()),
                            })
                            .collect(),
                    ),
                    ..Default::default()
                }],
            }),
            ..Default::default()
        }),
        ..Default::default()
    })
}

/// The pod: never restarted, no API token, the pool's scheduling fields, grace and
/// service account, a non-root pod security context with the runtime's seccomp profile.
fn pod_spec(k: &KubernetesPool, container: Container, volumes: Vec<Volume>) -> PodSpec {
    PodSpec {
        restart_policy: Some("Never".to_string()),
        service_account_name: k.service_account.clone(),
        // Trainers never call the Kubernetes API; Workload Identity and IRSA do not need
        // the token mounted either (they project their own).
        automount_service_account_token: Some(false),
        enable_service_links: Some(false),
        termination_grace_period_seconds: Some(seconds(k.termination_grace)),
        node_selector: (!k.node_selector.is_empty()).then(|| k.node_selector.clone()),
        tolerations: (!k.tolerations.is_empty())
            .then(|| k.tolerations.iter().map(toleration).collect()),
        affinity: node_affinity(k),
        security_context: Some(PodSecurityContext {
            run_as_non_root: Some(true),
            run_as_user: Some(TRAINER_UID),
            run_as_group: Some(TRAINER_UID),
            fs_group: Some(TRAINER_UID),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".to_string(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        containers: vec![container],
        volumes: Some(volumes),
        ..Default::default()
    }
}

/// The Job's failure rules, at the indices [`RULE_DISRUPTION`] and [`RULE_BAD_INPUT`] that
/// the classifier reads back from the Job's failure message.
pub fn pod_failure_policy() -> PodFailurePolicy {
    let mut rules = [
        (
            RULE_DISRUPTION,
            PodFailurePolicyRule {
                action: "FailJob".to_string(),
                on_pod_conditions: Some(vec![PodFailurePolicyOnPodConditionsPattern {
                    type_: "DisruptionTarget".to_string(),
                    status: "True".to_string(),
                }]),
                ..Default::default()
            },
        ),
        (
            RULE_BAD_INPUT,
            PodFailurePolicyRule {
                action: "FailJob".to_string(),
                on_exit_codes: Some(PodFailurePolicyOnExitCodesRequirement {
                    container_name: Some(CONTAINER.to_string()),
                    operator: "In".to_string(),
                    values: vec![launch::EXIT_BAD_INPUT, launch::EXIT_DIVERGED],
                }),
                ..Default::default()
            },
        ),
    ];
    rules.sort_by_key(|(index, _)| *index);
    PodFailurePolicy {
        rules: rules.into_iter().map(|(_, rule)| rule).collect(),
    }
}

fn toleration(t: &tuneq_pools::file::Toleration) -> Toleration {
    Toleration {
        key: (!t.key.is_empty()).then(|| t.key.clone()),
        operator: Some(
            match t.operator {
                TolerationOperator::Equal => "Equal",
                TolerationOperator::Exists => "Exists",
            }
            .to_string(),
        ),
        value: t.value.clone(),
        effect: t.effect.map(|e| {
            match e {
                TaintEffect::NoSchedule => "NoSchedule",
                TaintEffect::PreferNoSchedule => "PreferNoSchedule",
                TaintEffect::NoExecute => "NoExecute",
            }
            .to_string()
        }),
        toleration_seconds: None,
    }
}

fn node_operator(op: NodeOperator) -> &'static str {
    match op {
        NodeOperator::In => "In",
        NodeOperator::NotIn => "NotIn",
        NodeOperator::Exists => "Exists",
        NodeOperator::DoesNotExist => "DoesNotExist",
        NodeOperator::Gt => "Gt",
        NodeOperator::Lt => "Lt",
    }
}

/// The attempt's Secret: the spec (`spec.json`, mounted into the pod) and the report
/// credential (`credential`, the trainer's environment), with the Job's labels.
///
/// It is created after the Job, so it can name the Job as its owner when `owner_job_uid`
/// is known: then Kubernetes deletes it with the Job. Without the uid (the Job's create
/// answer was lost) it has no owner, and the dispatcher deletes it itself.
pub fn build_secret(
    launch: &AttemptLaunch,
    namespace: &str,
    owner_job_uid: Option<&str>,
) -> Secret {
    let owner = owner_job_uid.map(|uid| OwnerReference {
        api_version: "batch/v1".to_string(),
        kind: "Job".to_string(),
        name: job_name(&launch.job_id, launch.attempt),
        uid: uid.to_string(),
        controller: Some(false),
        // `true` would need `update` on `jobs/finalizers` where the API server runs
        // OwnerReferencesPermissionEnforcement (OpenShift does), and the dispatcher's Role
        // has no such grant: the create would be refused with 403.
        block_owner_deletion: Some(false),
    });
    Secret {
        metadata: ObjectMeta {
            name: Some(secret_name(&launch.job_id, launch.attempt)),
            namespace: Some(namespace.to_string()),
            labels: Some(labels(launch)),
            annotations: Some(annotations(launch)),
            owner_references: owner.map(|o| vec![o]),
            ..Default::default()
        },
        type_: Some("Opaque".to_string()),
        immutable: Some(true),
        data: Some(BTreeMap::from([
            (
                CREDENTIAL_KEY.to_string(),
                ByteString(launch.credential.as_bytes().to_vec()),
            ),
            (
                SPEC_KEY.to_string(),
                ByteString(launch.spec_json.as_bytes().to_vec()),
            ),
        ])),
        string_data: None,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn is_rfc1123_label(s: &str) -> bool {
        tuneq_pools::file::is_dns_label(s, MAX_NAME)
    }

    #[test]
    fn names_of_plain_job_ids_read_as_written() {
        assert_eq!(job_name("ftjob-0a1b2c", 2), "tq-ftjob-0a1b2c-a2");
        assert_eq!(secret_name("ftjob-0a1b2c", 2), "tq-ftjob-0a1b2c-a2-cred");
        let id = format!("ftjob-{}", "0123456789abcdef01234567");
        assert_eq!(job_name(&id, 1), format!("tq-{id}-a1"));
    }

    #[test]
    fn names_are_rfc1123_labels_of_at_most_63_characters() {
        let long = "x".repeat(200);
        let ids = [
            "ftjob-0a1b2c",
            "FTJOB-ABC",
            "job_with_underscores.and.dots",
            "-leading-and-trailing-",
            "ünïcödé",
            "!!!",
            "",
            long.as_str(),
            &"a".repeat(52),
            &"a".repeat(53),
        ];
        for id in ids {
            for attempt in [0, 1, 42, u64::MAX] {
                for name in [job_name(id, attempt), secret_name(id, attempt)] {
                    assert!(name.len() <= MAX_NAME, "{name} ({} chars)", name.len());
                    assert!(is_rfc1123_label(&name), "{name:?} from {id:?}");
                    assert!(name.starts_with("tq-"), "{name}");
                }
                assert!(job_name(id, attempt).ends_with(&format!("-a{attempt}")));
                assert!(secret_name(id, attempt).ends_with(&format!("-a{attempt}-cred")));
            }
        }
    }

    #[test]
    fn names_are_deterministic_and_tell_jobs_apart() {
        let long_a = format!("{}a", "x".repeat(100));
        let long_b = format!("{}b", "x".repeat(100));
        assert_eq!(job_name(&long_a, 3), job_name(&long_a, 3));
        assert_ne!(job_name(&long_a, 3), job_name(&long_b, 3));
        assert_ne!(job_name(&long_a, 3), job_name(&long_a, 4));
        // Ids that clean to the same text keep apart by the hash of the original.
        assert_ne!(job_name("ABC", 1), job_name("abc", 1));
        assert_ne!(job_name("a_b", 1), job_name("a.b", 1));
        assert_ne!(job_name("a_b", 1), job_name("a-b", 1));
        // A changed id keeps its readable part before the hash.
        let name = job_name("FTJOB-ABC", 1);
        assert!(name.starts_with("tq-ftjob-abc-"), "{name}");
        assert_eq!(name.len(), "tq-ftjob-abc-".len() + HASH_HEX + "-a1".len());
    }

    #[test]
    fn label_values_stay_valid_and_distinct() {
        assert_eq!(label_value("l4-spot"), "l4-spot");
        assert_eq!(label_value("Tenant_1.eu"), "Tenant_1.eu");
        assert_eq!(label_value(""), "");
        let long = "t".repeat(64);
        for v in [long.as_str(), "acme corp", "-x-", "ü", "a/b", "_x_"] {
            let label = label_value(v);
            assert!(is_label_value(&label), "{label:?} from {v:?}");
            assert!(!label.is_empty());
            assert_eq!(label, label_value(v));
        }
        assert_ne!(label_value(&"t".repeat(64)), label_value(&"t".repeat(65)));
        assert!(is_label_value(&"t".repeat(63)));
        assert!(!is_label_value(&"t".repeat(64)));
    }

    #[test]
    fn the_credential_never_shows_in_debug_output() {
        let launch = AttemptLaunch {
            job_id: "ftjob-1".into(),
            attempt: 1,
            tenant: "t".into(),
            pool: "p".into(),
            spec_json: "{}".into(),
            report_url: "http://api/internal/attempts/ftjob-1/report".into(),
            credential: "s3cr3t-token".into(),
            spec_hash: AttemptLaunch::hash_spec("{}"),
        };
        let shown = format!("{launch:?}");
        assert!(!shown.contains("s3cr3t"), "{shown}");
        assert!(shown.contains("[redacted]"));
    }
}
