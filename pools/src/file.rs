//! The pools file: the node pools a deployment places attempts on, read by `tuneq api`
//! (what a job may ask for, what it would cost), `tuneq dispatcher` (what it runs and
//! how) and `tuneq up`.
//!
//! A TOML file with one `[[pool]]` table per pool and an optional `[placement]` table.
//! Unknown fields are refused (a typo must not silently drop a toleration), and every
//! error names the file and the field. `docs/pools.md` documents each field; the
//! examples in `examples/pools/` are parsed by the tests.

mod kubernetes_check;

use crate::quantity::{Cpu, Memory};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

/// A parsed and checked pools file.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PoolsFile {
    /// When an attempt moves to the next pool of a job's list.
    #[serde(default)]
    pub placement: PlacementSettings,
    /// The pools, in the order placement prefers them when all else is equal.
    #[serde(rename = "pool", default)]
    pub pools: Vec<Pool>,
}

/// When a job's next attempt goes to the next pool of its list.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PlacementSettings {
    /// Preemptions on one pool within `preemption_window` after which the job's next
    /// attempt goes elsewhere (SkyPilot's lesson: repeated preemptions mean the
    /// capacity is scarce there).
    #[serde(default = "default_preemptions_before_fallback")]
    pub preemptions_before_fallback: u32,
    /// The window those preemptions are counted in.
    #[serde(default = "default_preemption_window", with = "duration_text")]
    pub preemption_window: Duration,
}

impl Default for PlacementSettings {
    fn default() -> Self {
        Self {
            preemptions_before_fallback: default_preemptions_before_fallback(),
            preemption_window: default_preemption_window(),
        }
    }
}

fn default_preemptions_before_fallback() -> u32 {
    3
}

fn default_preemption_window() -> Duration {
    Duration::from_secs(3600)
}

/// Where an attempt runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RuntimeKind {
    /// A `tuneq train` child process of the dispatcher, on its machine.
    Local,
    /// A `batch/v1` Job per attempt on a Kubernetes cluster.
    Kubernetes,
}

/// What a pool's nodes compute with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Hardware {
    /// CPUs only.
    Cpu,
    /// One or more GPUs per attempt.
    Gpu,
}

/// One node pool.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Pool {
    /// Its name: lowercase letters, digits and `-`, at most 40 characters (it appears
    /// in queue keys, Job labels and metrics).
    pub name: String,
    /// Where its attempts run.
    pub runtime: RuntimeKind,
    /// CPU or GPU.
    pub hardware: Hardware,
    /// Whether its nodes can be taken away at any moment (spot / preemptible VMs).
    #[serde(default)]
    pub spot: bool,
    /// The accelerator's name (e.g. `nvidia-l4`); GPU pools only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accelerator: Option<String>,
    /// Memory of one accelerator (e.g. `24Gi`); required for GPU pools, where it is
    /// the memory an attempt's weights and activations must fit in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accelerator_memory: Option<Memory>,
    /// Accelerators per attempt (GPU pools; default 1).
    #[serde(default = "one")]
    pub accelerators: u32,
    /// CPUs per attempt (`8`, `500m`).
    pub cpu: Cpu,
    /// Memory per attempt (`32Gi`): the limit an attempt runs under, and on CPU pools
    /// the memory its training must fit in. Required in a file; unknown for pools from
    /// the `--pool` shorthand without a memory figure (then nothing is checked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<Memory>,
    /// Attempts it runs at once.
    #[serde(default = "one")]
    pub slots: u32,
    /// What one attempt's node time costs per hour (any currency; used for estimates
    /// and `max_cost`).
    #[serde(default)]
    pub price_per_hour: f64,
    /// Training speed assumed for estimates until the dispatcher has measured the pool
    /// (tokens per second of one attempt).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_second: Option<f64>,
    /// Kubernetes settings; required exactly when `runtime = "kubernetes"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubernetes: Option<KubernetesPool>,
}

fn one() -> u32 {
    1
}

/// How a Kubernetes pool's attempts are placed and run.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesPool {
    /// Namespace the attempt Jobs are created in.
    pub namespace: String,
    /// The `tuneq` image the trainer runs from (pin a tag or digest; never `latest`).
    pub image: String,
    /// ServiceAccount of the trainer pods (Workload Identity / IRSA give it the object
    /// store; no storage keys go in the manifest).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account: Option<String>,
    /// Node labels the pods require (`nodeSelector`).
    #[serde(default)]
    pub node_selector: BTreeMap<String, String>,
    /// Taints the pods tolerate.
    #[serde(default)]
    pub tolerations: Vec<Toleration>,
    /// Node-affinity requirements, all of which must hold
    /// (`requiredDuringSchedulingIgnoredDuringExecution`), e.g. `gke-spot DoesNotExist`
    /// for an on-demand pool.
    #[serde(default)]
    pub affinity: Vec<NodeRequirement>,
    /// Extra environment of the trainer container (names starting with `TUNEQ_` are
    /// the launch contract's and refused).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Annotations of the pods (e.g. `gke-gcsfuse/volumes = "true"`).
    #[serde(default)]
    pub pod_annotations: BTreeMap<String, String>,
    /// Extra volumes mounted into the trainer container.
    #[serde(default)]
    pub volumes: Vec<Volume>,
    /// Size of the in-memory `/dev/shm` (default 1Gi).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shm_size: Option<Memory>,
    /// Time a stopping pod gets to checkpoint before it is killed
    /// (`terminationGracePeriodSeconds`; at most 25 s on GKE spot by default).
    #[serde(default = "default_termination_grace", with = "duration_text")]
    pub termination_grace: Duration,
    /// How long an attempt may wait for a node (pod unschedulable) before the job's
    /// next attempt goes to the next pool of its list; not counted as a failure.
    #[serde(default = "default_placement_timeout", with = "duration_text")]
    pub placement_timeout: Duration,
    /// How long a pod may wait on its image (pull errors) or its configuration (a
    /// missing Secret or ConfigMap) before the attempt ends with a platform error.
    #[serde(default = "default_platform_timeout", with = "duration_text")]
    pub platform_timeout: Duration,
    /// Wall-clock budget of one attempt (`activeDeadlineSeconds`).
    #[serde(default = "default_attempt_deadline", with = "duration_text")]
    pub attempt_deadline: Duration,
}

fn default_termination_grace() -> Duration {
    Duration::from_secs(25)
}

fn default_placement_timeout() -> Duration {
    Duration::from_secs(15 * 60)
}

fn default_platform_timeout() -> Duration {
    Duration::from_secs(5 * 60)
}

fn default_attempt_deadline() -> Duration {
    Duration::from_secs(24 * 3600)
}

/// A taint the pods tolerate.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Toleration {
    /// The taint's key (empty with `Exists`: every taint).
    #[serde(default)]
    pub key: String,
    /// `Equal` (default) or `Exists`.
    #[serde(default = "default_toleration_operator")]
    pub operator: TolerationOperator,
    /// The taint's value (with `Equal`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// `NoSchedule`, `PreferNoSchedule` or `NoExecute` (none: all effects).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effect: Option<TaintEffect>,
}

fn default_toleration_operator() -> TolerationOperator {
    TolerationOperator::Equal
}

/// How a toleration matches a taint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
pub enum TolerationOperator {
    /// Key and value equal.
    Equal,
    /// The key exists.
    Exists,
}

/// A taint's effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
pub enum TaintEffect {
    /// Not scheduled there.
    NoSchedule,
    /// Avoided when possible.
    PreferNoSchedule,
    /// Not scheduled, and evicted.
    NoExecute,
}

/// One node-affinity requirement.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NodeRequirement {
    /// The node label.
    pub key: String,
    /// How it is compared.
    pub operator: NodeOperator,
    /// The values (for `In`, `NotIn`, `Gt`, `Lt`).
    #[serde(default)]
    pub values: Vec<String>,
}

/// A node-affinity operator, as Kubernetes spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
pub enum NodeOperator {
    /// The label's value is one of the values.
    In,
    /// It is none of them.
    NotIn,
    /// The label exists.
    Exists,
    /// It does not.
    DoesNotExist,
    /// Its value is a number above the one value.
    Gt,
    /// Below it.
    Lt,
}

/// A volume mounted into the trainer container.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Volume {
    /// Its name in the pod.
    pub name: String,
    /// Where it is mounted (absolute).
    pub mount_path: String,
    /// Mounted read-only.
    #[serde(default)]
    pub read_only: bool,
    /// What it is.
    pub source: VolumeSource,
}

/// Where a volume's contents come from.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum VolumeSource {
    /// A PersistentVolumeClaim (e.g. a model cache on a shared disk).
    PersistentVolumeClaim {
        /// The claim's name.
        claim_name: String,
    },
    /// A ConfigMap.
    ConfigMap {
        /// Its name.
        name: String,
    },
    /// A Secret.
    Secret {
        /// Its name.
        secret_name: String,
    },
    /// Scratch space on the node.
    EmptyDir {
        /// Its size limit.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        size_limit: Option<Memory>,
    },
    /// A CSI driver (e.g. `gcsfuse.csi.storage.gke.io`).
    Csi {
        /// The driver.
        driver: String,
        /// Its attributes (`bucketName`, `mountOptions`, …).
        #[serde(default)]
        attributes: BTreeMap<String, String>,
    },
}

/// Why a pools file was refused: the file, the field and what is wrong.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {field}: {message}")]
pub struct PoolsError {
    /// The file (or `--pool` for the shorthand flags).
    pub file: String,
    /// The field, as a path (`pool[2].kubernetes.tolerations[0].effect`), or the parse
    /// position.
    pub field: String,
    /// What is wrong with it.
    pub message: String,
}

/// Longest pool name (it becomes part of Job labels, metric labels and queue keys).
pub const MAX_POOL_NAME: usize = 40;

/// The most attempts one pool runs at once.
pub const MAX_SLOTS: u32 = 10_000;

/// The longest grace a pod gets to checkpoint (GKE spot allows 120 s at most, AWS 2 min).
pub const MAX_TERMINATION_GRACE: Duration = Duration::from_secs(600);

impl PoolsFile {
    /// Reads and checks the pools file at `path`.
    pub fn load(path: &Path) -> Result<Self, PoolsError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| PoolsError {
            file: file.clone(),
            field: "-".into(),
            message: format!("cannot read it: {e}"),
        })?;
        Self::parse(&text, &file)
    }

    /// Parses and checks a pools file's text; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<Self, PoolsError> {
        let parsed: Self = toml::from_str(text).map_err(|e| PoolsError {
            file: file.to_string(),
            field: e
                .span()
                .map(|s| {
                    let line = text[..s.start.min(text.len())].matches('\n').count() + 1;
                    format!("line {line}")
                })
                .unwrap_or_else(|| "-".into()),
            message: e.message().to_string(),
        })?;
        parsed.check(true).map_err(|(field, message)| PoolsError {
            file: file.to_string(),
            field,
            message,
        })?;
        Ok(parsed)
    }

    /// The pool named `name`.
    pub fn pool(&self, name: &str) -> Option<&Pool> {
        self.pools.iter().find(|p| p.name == name)
    }

    /// One local CPU pool named `local` with one slot (what `tuneq up` runs by default),
    /// `memory` bytes per attempt when known.
    pub fn local(memory: Option<u64>) -> Self {
        Self {
            placement: PlacementSettings::default(),
            pools: vec![Pool {
                name: "local".into(),
                runtime: RuntimeKind::Local,
                hardware: Hardware::Cpu,
                spot: false,
                accelerator: None,
                accelerator_memory: None,
                accelerators: 1,
                cpu: Cpu(crate::quantity::Quantity::millicores(1000)),
                memory: memory
                    .filter(|m| *m > 0)
                    .map(|m| Memory(crate::quantity::Quantity::bytes(m))),
                slots: 1,
                price_per_hour: 0.0,
                tokens_per_second: None,
                kubernetes: None,
            }],
        }
    }

    /// Pools from the `--pool NAME=HARDWARE` shorthand: local pools, `HARDWARE` being
    /// `cpu`, `gpu`, `spot-cpu` or `spot-gpu`, each with `memory` per attempt when it is
    /// known (a GPU's own memory is not, so jobs on them are not checked for fit).
    pub fn from_shorthand(
        pairs: &[(String, String)],
        memory: Option<u64>,
    ) -> Result<Self, PoolsError> {
        let mut pools = Vec::new();
        for (i, (name, class)) in pairs.iter().enumerate() {
            let (hardware, spot) = match class.as_str() {
                "cpu" => (Hardware::Cpu, false),
                "spot-cpu" => (Hardware::Cpu, true),
                "gpu" => (Hardware::Gpu, false),
                "spot-gpu" => (Hardware::Gpu, true),
                other => {
                    return Err(PoolsError {
                        file: "--pool".into(),
                        field: format!("pool[{i}].hardware"),
                        message: format!(
                            "`{other}` is not a hardware class; use cpu, gpu, spot-cpu or spot-gpu"
                        ),
                    });
                }
            };
            let memory = memory
                .map(|m| crate::quantity::Quantity::memory(&m.to_string()).map(Memory))
                .transpose()
                .map_err(|e| PoolsError {
                    file: "--pool".into(),
                    field: format!("pool[{i}].memory"),
                    message: e.to_string(),
                })?;
            pools.push(Pool {
                name: name.clone(),
                runtime: RuntimeKind::Local,
                hardware,
                spot,
                accelerator: None,
                accelerator_memory: None,
                accelerators: 1,
                cpu: Cpu(crate::quantity::Quantity::cpu("1").map_err(|e| PoolsError {
                    file: "--pool".into(),
                    field: format!("pool[{i}].cpu"),
                    message: e.to_string(),
                })?),
                memory,
                slots: 1,
                price_per_hour: 0.0,
                tokens_per_second: None,
                kubernetes: None,
            });
        }
        let file = Self {
            placement: PlacementSettings::default(),
            pools,
        };
        file.check(false).map_err(|(field, message)| PoolsError {
            file: "--pool".into(),
            field,
            message,
        })?;
        Ok(file)
    }

    /// Rules serde cannot express; `file` adds those only a file can meet (memory
    /// figures). Returns the field path and the problem.
    fn check(&self, file: bool) -> Result<(), (String, String)> {
        if self.pools.is_empty() {
            return Err(("pool".into(), "the file defines no pool".into()));
        }
        if self.placement.preemptions_before_fallback == 0 {
            return Err((
                "placement.preemptions_before_fallback".into(),
                "must be at least 1".into(),
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for (i, pool) in self.pools.iter().enumerate() {
            let at = |field: &str| format!("pool[{i}].{field}");
            if !is_dns_label(&pool.name, MAX_POOL_NAME) {
                return Err((
                    at("name"),
                    format!(
                        "`{}` must be lowercase letters, digits and `-`, start and end with a letter or digit, at most {MAX_POOL_NAME} characters",
                        pool.name
                    ),
                ));
            }
            if !seen.insert(pool.name.as_str()) {
                return Err((at("name"), format!("`{}` is defined twice", pool.name)));
            }
            pool.check(file)
                .map_err(|(field, message)| (at(&field), message))?;
        }
        Ok(())
    }
}

impl Pool {
    /// The memory an attempt's training must fit in: one accelerator's on GPU pools (the
    /// trainer runs on one device, whatever the pool requests), the attempt's own on CPU
    /// pools (None: not known, not checked).
    pub fn training_memory_bytes(&self) -> Option<u64> {
        match self.hardware {
            Hardware::Gpu => self.accelerator_memory.as_ref().map(Memory::bytes),
            Hardware::Cpu => self.memory.as_ref().map(Memory::bytes),
        }
    }

    /// Its hardware class as jobs ask for it: `cpu`, `gpu`, `spot-cpu` or `spot-gpu`.
    pub fn class(&self) -> &'static str {
        match (self.hardware, self.spot) {
            (Hardware::Cpu, false) => "cpu",
            (Hardware::Cpu, true) => "spot-cpu",
            (Hardware::Gpu, false) => "gpu",
            (Hardware::Gpu, true) => "spot-gpu",
        }
    }

    fn check(&self, file: bool) -> Result<(), (String, String)> {
        let err = |field: &str, message: String| Err((field.to_string(), message));
        if file && self.memory.is_none() {
            return err(
                "memory",
                "every pool says the memory of one attempt (e.g. `32Gi`)".into(),
            );
        }
        if self.slots == 0 || self.slots > MAX_SLOTS {
            return err("slots", format!("must be between 1 and {MAX_SLOTS}"));
        }
        if !self.price_per_hour.is_finite() || self.price_per_hour < 0.0 {
            return err("price_per_hour", "must be a number ≥ 0".into());
        }
        if let Some(t) = self.tokens_per_second
            && !(t.is_finite() && t > 0.0)
        {
            return err("tokens_per_second", "must be a number above 0".into());
        }
        match self.hardware {
            Hardware::Gpu => {
                if file && self.accelerator_memory.is_none() {
                    return err(
                        "accelerator_memory",
                        "a GPU pool must say its accelerator's memory (e.g. `24Gi` for an L4)"
                            .into(),
                    );
                }
                if self.accelerators == 0 || self.accelerators > 16 {
                    return err("accelerators", "must be between 1 and 16".into());
                }
            }
            Hardware::Cpu => {
                if self.accelerator.is_some() || self.accelerator_memory.is_some() {
                    return err(
                        "accelerator",
                        "a CPU pool has no accelerator; set hardware = \"gpu\"".into(),
                    );
                }
            }
        }
        match (self.runtime, &self.kubernetes) {
            (RuntimeKind::Kubernetes, None) => err(
                "kubernetes",
                "a pool with runtime = \"kubernetes\" needs a [pool.kubernetes] table".into(),
            ),
            (RuntimeKind::Local, Some(_)) => err(
                "kubernetes",
                "only pools with runtime = \"kubernetes\" take a [pool.kubernetes] table".into(),
            ),
            (RuntimeKind::Kubernetes, Some(k)) => k
                .check()
                .map_err(|(field, message)| (format!("kubernetes.{field}"), message)),
            (RuntimeKind::Local, None) => Ok(()),
        }
    }
}

/// An RFC 1123 label: lowercase alphanumerics and `-`, alphanumeric at both ends.
pub fn is_dns_label(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// A duration written as `25s`, `15m`, `24h` or `1h 30m`.
/// A duration in the file as humantime writes it (`25s`, `15m`, `24h`).
mod duration_text {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(d)?;
        humantime::parse_duration(&text).map_err(|e| {
            serde::de::Error::custom(format!(
                "`{text}` is not a duration ({e}); write e.g. `25s`, `15m`, `24h`"
            ))
        })
    }

    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*d).to_string())
    }
}
