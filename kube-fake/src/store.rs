//! The object store: every object as a `serde_json::Value` under its kind, namespace and
//! name, the global resourceVersion counter, the history that watches replay, and the
//! server-side rules of writes (stamping, the status subresource, deletion with its
//! propagation policies, finalizers and pod grace periods).
//!
//! Everything here is synchronous and runs under the cluster's one lock.

use crate::log::RequestRecord;
use k8s_openapi::jiff::Timestamp;
use rand::Rng;
use serde_json::{Map, Value, json};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, SystemTime};

/// The finalizer the job controller puts on the pods it creates, removed once it has
/// counted the pod's end (so a deleted pod's failure is never lost).
pub const JOB_TRACKING_FINALIZER: &str = "batch.kubernetes.io/job-tracking";
/// The finalizer a foreground deletion puts on the owner until its dependants are gone.
pub const FOREGROUND_FINALIZER: &str = "foregroundDeletion";
/// The warning the API server sends when a `batch/v1` Job is deleted without a policy.
pub const ORPHAN_WARNING: &str = "child pods are preserved by default when jobs are deleted; set propagationPolicy=Background to remove them or set propagationPolicy=Orphan to suppress this warning";

/// The kinds of object the fake serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// `batch/v1` Job.
    Job,
    /// `v1` Pod.
    Pod,
    /// `v1` Secret.
    Secret,
    /// `v1` Event.
    Event,
    /// `v1` Node (cluster-scoped).
    Node,
}

impl Kind {
    /// Every kind.
    pub const ALL: [Kind; 5] = [Kind::Job, Kind::Pod, Kind::Secret, Kind::Event, Kind::Node];

    /// The `apiVersion` of its objects.
    pub fn api_version(self) -> &'static str {
        match self {
            Kind::Job => "batch/v1",
            _ => "v1",
        }
    }

    /// The API group (`""` for the core group).
    pub fn group(self) -> &'static str {
        match self {
            Kind::Job => "batch",
            _ => "",
        }
    }

    /// The `kind` of its objects.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Job => "Job",
            Kind::Pod => "Pod",
            Kind::Secret => "Secret",
            Kind::Event => "Event",
            Kind::Node => "Node",
        }
    }

    /// The resource's plural name, as in URLs.
    pub fn plural(self) -> &'static str {
        match self {
            Kind::Job => "jobs",
            Kind::Pod => "pods",
            Kind::Secret => "secrets",
            Kind::Event => "events",
            Kind::Node => "nodes",
        }
    }

    /// Whether its objects live in a namespace.
    pub fn namespaced(self) -> bool {
        self != Kind::Node
    }

    /// Whether writes to the main resource ignore `status` (it has a `/status`
    /// subresource).
    pub fn has_status(self) -> bool {
        matches!(self, Kind::Job | Kind::Pod | Kind::Node)
    }

    /// `jobs.batch`, `pods`: how the API server names the resource in messages.
    pub fn qualified(self) -> String {
        match self.group() {
            "" => self.plural().to_string(),
            g => format!("{}.{g}", self.plural()),
        }
    }

    /// The kind served at `group_version` (`v1`, `batch/v1`) under `plural`.
    pub fn from_path(group_version: &str, plural: &str) -> Option<Kind> {
        Kind::ALL
            .into_iter()
            .find(|k| k.api_version() == group_version && k.plural() == plural)
    }
}

/// Where an object is stored: its kind, namespace (`""` for cluster-scoped) and name.
pub type Key = (Kind, String, String);

/// A watch event type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    /// The object was created.
    Added,
    /// The object changed.
    Modified,
    /// The object was removed.
    Deleted,
}

impl EventType {
    /// As written on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One change, as watches replay it.
#[derive(Debug, Clone)]
pub struct Change {
    /// The resourceVersion the change made.
    pub rv: u64,
    /// The object's kind.
    pub kind: Kind,
    /// Its namespace (`""` when cluster-scoped).
    pub namespace: String,
    /// What happened.
    pub type_: EventType,
    /// The object after the change (before it, for a deletion, with the new rv).
    pub object: Value,
    /// The object before the change, for a modification.
    pub previous: Option<Value>,
}

/// An API error, written as a `Status` body with the exact `reason` kube-rs compares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status code.
    pub code: u16,
    /// `NotFound`, `AlreadyExists`, `Conflict`, `Expired`, `BadRequest`, …
    pub reason: &'static str,
    /// The human message.
    pub message: String,
    /// `details` of the Status: name, group, kind.
    pub details: Option<(String, Kind)>,
}

impl ApiError {
    /// `404 NotFound` for `name` of `kind`.
    pub fn not_found(kind: Kind, name: &str) -> Self {
        Self {
            code: 404,
            reason: "NotFound",
            message: format!("{} \"{name}\" not found", kind.qualified()),
            details: Some((name.to_string(), kind)),
        }
    }

    /// `409 AlreadyExists`.
    pub fn already_exists(kind: Kind, name: &str) -> Self {
        Self {
            code: 409,
            reason: "AlreadyExists",
            message: format!("{} \"{name}\" already exists", kind.qualified()),
            details: Some((name.to_string(), kind)),
        }
    }

    /// `409 Conflict` on a resourceVersion mismatch.
    pub fn conflict(kind: Kind, name: &str) -> Self {
        Self {
            code: 409,
            reason: "Conflict",
            message: format!(
                "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
                kind.qualified()
            ),
            details: Some((name.to_string(), kind)),
        }
    }

    /// `400 BadRequest`.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            code: 400,
            reason: "BadRequest",
            message: message.into(),
            details: None,
        }
    }

    /// `410 Expired`: the watch's resourceVersion is too old.
    pub fn expired(asked: u64, oldest: u64) -> Self {
        Self {
            code: 410,
            reason: "Expired",
            message: format!("too old resource version: {asked} ({oldest})"),
            details: None,
        }
    }

    /// The `Status` body.
    pub fn status(&self) -> Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let Some((name, kind)) = &self.details {
            // The core group is left out, as the real server writes it.
            status["details"] = json!({"name": name, "kind": kind.plural()});
            if !kind.group().is_empty() {
                status["details"]["group"] = json!(kind.group());
            }
        }
        status
    }
}

/// How a delete treats the object's dependants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Propagation {
    /// Dependants are deleted after the owner is gone.
    Background,
    /// The owner stays (with `deletionTimestamp`) until its dependants are gone.
    Foreground,
    /// Dependants stay, their owner reference removed.
    Orphan,
}

impl Propagation {
    /// Parses `Background`, `Foreground`, `Orphan`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "Background" => Some(Self::Background),
            "Foreground" => Some(Self::Foreground),
            "Orphan" => Some(Self::Orphan),
            _ => None,
        }
    }
}

/// The options of one delete.
#[derive(Debug, Clone, Default)]
pub struct DeleteOptions {
    /// `propagationPolicy`, when given.
    pub propagation: Option<Propagation>,
    /// `gracePeriodSeconds`, when given.
    pub grace: Option<i64>,
    /// `dryRun=All`.
    pub dry_run: bool,
}

/// What a delete did.
#[derive(Debug, Clone)]
pub struct Deleted {
    /// The object as it is now (kept with `deletionTimestamp`) or was (gone).
    pub object: Value,
    /// Whether it is gone already (200) or kept until finalizers or a grace period end (202).
    pub gone: bool,
    /// A `Warning` header to send.
    pub warning: Option<&'static str>,
}

/// The knobs tests turn on watches.
#[derive(Debug)]
pub struct WatchKnobs {
    /// How many of the next watch requests answer an ERROR event with reason `Expired`.
    pub expire_next: usize,
    /// Watches from a resourceVersion below this answer `Expired` (a compaction).
    pub compacted_below: u64,
    /// How often an idle watch that allows bookmarks gets one.
    pub bookmark_interval: Duration,
}

impl Default for WatchKnobs {
    fn default() -> Self {
        Self {
            expire_next: 0,
            compacted_below: 0,
            bookmark_interval: Duration::from_secs(1),
        }
    }
}

/// The whole state of the fake cluster.
#[derive(Debug, Default)]
pub struct State {
    /// The objects.
    pub objects: BTreeMap<Key, Value>,
    /// The last resourceVersion handed out.
    pub rv: u64,
    /// Every change, oldest first.
    pub history: Vec<Change>,
    /// Every request served.
    pub log: Vec<RequestRecord>,
    /// Watch knobs.
    pub watch: WatchKnobs,
    /// How far the cluster's clock is ahead of the machine's.
    pub clock_offset: Duration,
    /// The job controller's memory: pod uid → job uid of every pod it counted.
    pub counted_pods: HashMap<String, String>,
    /// The job controller's memory: pod uid → (job uid, namespace, name, resourceVersion at
    /// creation) of every pod it made.
    pub created_pods: HashMap<String, (String, String, String, u64)>,
    /// Creates of these kinds are answered with this error instead (what a real API
    /// server's validation or admission would answer; the fake validates nothing).
    pub refused_creates: HashMap<Kind, ApiError>,
}

/// The object's `metadata` as a map (created when missing).
pub fn meta_mut(obj: &mut Value) -> &mut Map<String, Value> {
    if !obj.get("metadata").is_some_and(Value::is_object) {
        obj["metadata"] = json!({});
    }
    match obj.get_mut("metadata") {
        Some(Value::Object(m)) => m,
        // Just made an object above.
        _ => unreachable!("metadata was just made an object"),
    }
}

/// `metadata.<field>` as a string.
pub fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    obj.get("metadata")?.get(field)?.as_str()
}

/// A random lowercase hex string of `n` characters.
pub fn random_hex(n: usize) -> String {
    let mut rng = rand::rng();
    (0..n)
        .map(|_| char::from_digit(rng.random_range(0..16), 16).unwrap_or('0'))
        .collect()
}

/// A random uid in the UUID v4 text shape.
pub fn random_uid() -> String {
    format!(
        "{}-{}-4{}-a{}-{}",
        random_hex(8),
        random_hex(4),
        random_hex(3),
        random_hex(3),
        random_hex(12)
    )
}

/// The suffix the API server appends to a `generateName` (and the job controller to pod
/// names): 5 characters from its alphabet without vowels.
pub fn random_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut rng = rand::rng();
    (0..5)
        .map(|_| char::from(ALPHABET[rng.random_range(0..ALPHABET.len())]))
        .collect()
}

/// The uids of `obj`'s owners.
fn owner_uids(obj: &Value) -> Vec<String> {
    obj.get("metadata")
        .and_then(|m| m.get("ownerReferences"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|r| r.get("uid")?.as_str().map(str::to_string))
        .collect()
}

fn finalizers(obj: &Value) -> Vec<String> {
    obj.get("metadata")
        .and_then(|m| m.get("finalizers"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|f| f.as_str().map(str::to_string))
        .collect()
}

/// Whether a pod's phase is `Succeeded` or `Failed`.
pub fn pod_terminal(pod: &Value) -> bool {
    matches!(
        pod.pointer("/status/phase").and_then(Value::as_str),
        Some("Succeeded" | "Failed")
    )
}

impl State {
    /// The cluster's clock.
    pub fn now(&self) -> Timestamp {
        let t = SystemTime::now() + self.clock_offset;
        Timestamp::try_from(t).unwrap_or(Timestamp::UNIX_EPOCH)
    }

    /// The cluster's clock as the API writes times (whole seconds, `Z`).
    pub fn now_string(&self) -> String {
        self.time_string(0)
    }

    /// The cluster's clock plus `secs`, as the API writes times.
    pub fn time_string(&self, secs: i64) -> String {
        let s = self.now().as_second().saturating_add(secs);
        Timestamp::from_second(s)
            .unwrap_or(Timestamp::UNIX_EPOCH)
            .to_string()
    }

    fn next_rv(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    fn record(&mut self, type_: EventType, key: &Key, object: Value, previous: Option<Value>) {
        self.history.push(Change {
            rv: self.rv,
            kind: key.0,
            namespace: key.1.clone(),
            type_,
            object,
            previous,
        });
    }

    /// Stores a new object at `key`, stamping uid, resourceVersion, generation and
    /// creationTimestamp. `obj` must carry its name; `dry_run` stores nothing.
    pub fn create(&mut self, key: &Key, mut obj: Value, dry_run: bool) -> Result<Value, ApiError> {
        if self.objects.contains_key(key) {
            return Err(ApiError::already_exists(key.0, &key.2));
        }
        obj["apiVersion"] = json!(key.0.api_version());
        obj["kind"] = json!(key.0.name());
        let now = self.now_string();
        let meta = meta_mut(&mut obj);
        meta.insert("name".into(), json!(key.2));
        if key.0.namespaced() {
            meta.insert("namespace".into(), json!(key.1));
        } else {
            meta.remove("namespace");
        }
        meta.remove("generateName");
        meta.insert("uid".into(), json!(random_uid()));
        meta.insert("generation".into(), json!(1));
        meta.insert("creationTimestamp".into(), json!(now));
        meta.remove("deletionTimestamp");
        meta.remove("deletionGracePeriodSeconds");
        meta.remove("resourceVersion");
        if dry_run {
            return Ok(obj);
        }
        let rv = self.next_rv();
        meta_mut(&mut obj).insert("resourceVersion".into(), json!(rv.to_string()));
        self.objects.insert(key.clone(), obj.clone());
        self.record(EventType::Added, key, obj.clone(), None);
        Ok(obj)
    }

    /// Replaces the object at `key` with `obj` as it is (the caller decides what may
    /// change), with a new resourceVersion; bumps `generation` when `spec` changed. Then
    /// settles deletions (a write may have removed the last finalizer).
    pub fn write(&mut self, key: &Key, mut obj: Value) -> Value {
        let previous = self.objects.get(key).cloned();
        if let Some(prev) = &previous {
            if prev.get("spec") != obj.get("spec") {
                let generation = prev
                    .pointer("/metadata/generation")
                    .and_then(Value::as_i64)
                    .unwrap_or(1);
                meta_mut(&mut obj).insert("generation".into(), json!(generation + 1));
            }
            if prev == &obj {
                return obj;
            }
        }
        let rv = self.next_rv();
        meta_mut(&mut obj).insert("resourceVersion".into(), json!(rv.to_string()));
        self.objects.insert(key.clone(), obj.clone());
        self.record(EventType::Modified, key, obj.clone(), previous);
        self.settle();
        obj
    }

    /// Changes the object at `key` with `f` (any field: this is the controllers' and the
    /// kubelet's door, not the API's).
    pub fn update(
        &mut self,
        key: &Key,
        f: impl FnOnce(&mut Value, &State),
    ) -> Result<Value, ApiError> {
        let mut obj = self
            .objects
            .get(key)
            .cloned()
            .ok_or_else(|| ApiError::not_found(key.0, &key.2))?;
        f(&mut obj, self);
        Ok(self.write(key, obj))
    }

    /// Removes the object at `key` now, then lets the garbage collector at its dependants
    /// (`Background`) unless `orphan`.
    fn remove_now(&mut self, key: &Key, orphan: bool) -> Option<Value> {
        let mut obj = self.objects.remove(key)?;
        let rv = self.next_rv();
        meta_mut(&mut obj).insert("resourceVersion".into(), json!(rv.to_string()));
        self.record(EventType::Deleted, key, obj.clone(), None);
        if let Some(uid) = meta_str(&obj, "uid").map(str::to_string) {
            if orphan {
                self.orphan_dependants(&uid);
            } else {
                self.collect_dependants(&uid);
            }
        }
        Some(obj)
    }

    /// The keys of the objects that name `uid` among their owners.
    pub fn dependants(&self, uid: &str) -> Vec<Key> {
        self.objects
            .iter()
            .filter(|(_, o)| owner_uids(o).iter().any(|u| u == uid))
            .map(|(k, _)| k.clone())
            .collect()
    }

    fn orphan_dependants(&mut self, uid: &str) {
        for key in self.dependants(uid) {
            let _ = self.update(&key, |o, _| {
                let meta = meta_mut(o);
                if let Some(Value::Array(refs)) = meta.get_mut("ownerReferences") {
                    refs.retain(|r| r.get("uid").and_then(Value::as_str) != Some(uid));
                    if refs.is_empty() {
                        meta.remove("ownerReferences");
                    }
                }
            });
        }
    }

    /// The garbage collector: deletes (background) every dependant of `uid` whose owners
    /// are all gone.
    fn collect_dependants(&mut self, uid: &str) {
        let alive: HashSet<String> = self
            .objects
            .values()
            .filter_map(|o| meta_str(o, "uid").map(str::to_string))
            .collect();
        for key in self.dependants(uid) {
            let Some(obj) = self.objects.get(&key) else {
                continue;
            };
            if obj.pointer("/metadata/deletionTimestamp").is_some() {
                continue;
            }
            if owner_uids(obj).iter().all(|u| !alive.contains(u)) {
                let _ = self.delete(
                    &key,
                    &DeleteOptions {
                        propagation: Some(Propagation::Background),
                        ..Default::default()
                    },
                );
            }
        }
    }

    /// Deletes the object at `key` as the API server does.
    pub fn delete(&mut self, key: &Key, opts: &DeleteOptions) -> Result<Deleted, ApiError> {
        let obj = self
            .objects
            .get(key)
            .cloned()
            .ok_or_else(|| ApiError::not_found(key.0, &key.2))?;
        let (propagation, warning) = match opts.propagation {
            Some(p) => (p, None),
            None if key.0 == Kind::Job => (Propagation::Orphan, Some(ORPHAN_WARNING)),
            None => (Propagation::Background, None),
        };
        let mut grace = 0;
        if key.0 == Kind::Pod {
            grace = opts
                .grace
                .or_else(|| {
                    obj.pointer("/spec/terminationGracePeriodSeconds")
                        .and_then(Value::as_i64)
                })
                .unwrap_or(30)
                .max(0);
            let scheduled = obj
                .pointer("/spec/nodeName")
                .and_then(Value::as_str)
                .is_some_and(|n| !n.is_empty());
            if !scheduled || pod_terminal(&obj) {
                grace = 0;
            }
        }
        let already = obj.pointer("/metadata/deletionTimestamp").is_some();
        let mut kept = obj.clone();
        {
            let now = self.time_string(grace);
            let meta = meta_mut(&mut kept);
            let shortens = meta
                .get("deletionGracePeriodSeconds")
                .and_then(Value::as_i64)
                .is_none_or(|g| grace < g);
            if !already || shortens {
                meta.insert("deletionTimestamp".into(), json!(now));
                meta.insert("deletionGracePeriodSeconds".into(), json!(grace));
            }
            if propagation == Propagation::Foreground && !already {
                let mut f = finalizers(&Value::Object(meta.clone()));
                if !f.iter().any(|x| x == FOREGROUND_FINALIZER) {
                    f.push(FOREGROUND_FINALIZER.to_string());
                }
                meta.insert("finalizers".into(), json!(f));
            }
        }
        let waits = !finalizers(&kept).is_empty() || grace > 0;
        if opts.dry_run {
            return Ok(Deleted {
                object: if waits { kept } else { obj },
                gone: !waits,
                warning,
            });
        }
        if !waits {
            let gone = self
                .remove_now(key, propagation == Propagation::Orphan)
                .unwrap_or(obj);
            return Ok(Deleted {
                object: gone,
                gone: true,
                warning,
            });
        }
        if propagation == Propagation::Orphan
            && let Some(uid) = meta_str(&obj, "uid")
        {
            let uid = uid.to_string();
            self.orphan_dependants(&uid);
        }
        let object = self.write(key, kept);
        if propagation == Propagation::Foreground
            && let Some(uid) = meta_str(&object, "uid").map(str::to_string)
        {
            for dep in self.dependants(&uid) {
                let _ = self.delete(
                    &dep,
                    &DeleteOptions {
                        propagation: Some(Propagation::Background),
                        ..Default::default()
                    },
                );
            }
        }
        self.settle();
        let object = self.objects.get(key).cloned().unwrap_or(object);
        let gone = !self.objects.contains_key(key);
        Ok(Deleted {
            object,
            gone,
            warning,
        })
    }

    /// Finishes what deletions can finish: drops `foregroundDeletion` from owners whose
    /// dependants are gone, removes objects being deleted that have no finalizers left
    /// (a pod only once it is terminal or its grace is 0: the kubelet finishes it).
    pub fn settle(&mut self) {
        loop {
            let mut changed = false;
            let deleting: Vec<(Key, Value)> = self
                .objects
                .iter()
                .filter(|(_, o)| o.pointer("/metadata/deletionTimestamp").is_some())
                .map(|(k, o)| (k.clone(), o.clone()))
                .collect();
            for (key, obj) in deleting {
                let fins = finalizers(&obj);
                if fins.iter().any(|f| f == FOREGROUND_FINALIZER) {
                    let uid = meta_str(&obj, "uid").unwrap_or_default();
                    if self.dependants(uid).is_empty() {
                        let mut o = obj.clone();
                        let rest: Vec<&String> =
                            fins.iter().filter(|f| *f != FOREGROUND_FINALIZER).collect();
                        meta_mut(&mut o).insert("finalizers".into(), json!(rest));
                        let rv = self.next_rv();
                        meta_mut(&mut o).insert("resourceVersion".into(), json!(rv.to_string()));
                        self.objects.insert(key.clone(), o.clone());
                        self.record(EventType::Modified, &key, o, Some(obj.clone()));
                        changed = true;
                    }
                    continue;
                }
                if !fins.is_empty() {
                    continue;
                }
                let grace = obj
                    .pointer("/metadata/deletionGracePeriodSeconds")
                    .and_then(Value::as_i64)
                    .unwrap_or(0);
                if key.0 == Kind::Pod && grace > 0 && !pod_terminal(&obj) {
                    continue;
                }
                self.remove_now(&key, false);
                changed = true;
            }
            if !changed {
                break;
            }
        }
    }

    /// The pod called `pod` (`name`, or `namespace/name`), in any namespace.
    pub fn find(&self, kind: Kind, name: &str) -> Option<Key> {
        if let Some((ns, n)) = name.split_once('/') {
            let key = (kind, ns.to_string(), n.to_string());
            return self.objects.contains_key(&key).then_some(key);
        }
        self.objects
            .keys()
            .find(|(k, _, n)| *k == kind && n == name)
            .cloned()
    }
}

impl State {
    /// Records a `v1` Event about `involved` (a stored object), as a controller or the
    /// kubelet would: `type_` is `Normal` or `Warning`.
    pub fn record_event(
        &mut self,
        involved: &Value,
        type_: &str,
        reason: &str,
        message: &str,
        component: &str,
    ) {
        let kind = involved
            .get("kind")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let name = meta_str(involved, "name").unwrap_or_default().to_string();
        let namespace = meta_str(involved, "namespace")
            .unwrap_or("default")
            .to_string();
        let now = self.now_string();
        let event = json!({
            "metadata": {"name": format!("{name}.{}", random_hex(16)), "namespace": namespace},
            "involvedObject": {
                "kind": kind,
                "apiVersion": involved.get("apiVersion"),
                "namespace": meta_str(involved, "namespace"),
                "name": name,
                "uid": meta_str(involved, "uid"),
                "resourceVersion": meta_str(involved, "resourceVersion"),
            },
            "reason": reason,
            "message": message,
            "type": type_,
            "source": {"component": component},
            "reportingComponent": component,
            "reportingInstance": "",
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        });
        let key = (
            Kind::Event,
            namespace,
            event["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        );
        let _ = self.create(&key, event, false);
    }
}
