//! The process kubelet: runs the first container of each scheduled pod as a local
//! process, so a black-box test can drive a real trainer binary through the fake cluster.
//!
//! [`FakeCluster::run_pods_as_processes`] starts a background task that, every ~100 ms:
//! - starts a process for each pod that is scheduled (`spec.nodeName` set, the Node
//!   present), `Pending` and not being deleted, then marks the pod `Running` as
//!   [`FakeCluster::run`] does. The program is the `exe` given (it stands for the image's
//!   entrypoint; the container's `command` is not used), with the container's `args`. Each
//!   volume is a folder `root/<pod>/<volume>` (a Secret volume holds the Secret's keys,
//!   `items` honoured; anything else is an empty folder), and every mount path prefix in
//!   the args and env values is rewritten to its folder. The environment is the test's
//!   own, plus the container's `env` (values, and `secretKeyRef`s read from the stored
//!   Secret; a missing Secret leaves the pod `Pending` with `CreateContainerConfigError`,
//!   as a real kubelet does, and is retried). The working directory is `root/<pod>`;
//!   stdout and stderr go to `root/<pod>/log`;
//! - writes the end of each process that exited as [`FakeCluster::exit`] does: its exit
//!   code (a death by signal `n` as `128 + n`), reason `Completed` or `Error`, and for
//!   `terminationMessagePolicy: FallbackToLogsOnError` the log's tail as the message;
//! - sends SIGTERM to the process of a pod being deleted (`deletionTimestamp`), then
//!   SIGKILL once its grace period is over; kills at once the process of a pod that is
//!   gone from the API.
//!
//! A pod is started at most once (pods have `restartPolicy: Never` here). The Job
//! controller still runs only when the test calls [`FakeCluster::sync_jobs`], or in the
//! background after [`ProcessKubelet::auto_sync`].
//!
//! Concurrency: the processes are in one `std::sync::Mutex`, never held across an await
//! nor while the cluster's lock is taken.

use crate::store::{Kind, meta_str, pod_terminal};
use crate::{Error, FakeCluster, Result};
use base64::Engine as _;
use serde_json::Value;
use std::collections::{HashMap, HashSet};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

/// How often the process kubelet looks at the pods and its processes.
const TICK: Duration = Duration::from_millis(100);
/// The grace period of a pod that names none (the API's default).
const DEFAULT_GRACE: u64 = 30;
/// The kubelet's cap on a `FallbackToLogsOnError` message: 80 lines, 2048 bytes.
const MESSAGE_LINES: usize = 80;
const MESSAGE_BYTES: usize = 2048;

/// How a process's end is written to its pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EndAs {
    /// As [`FakeCluster::exit`].
    Exit,
    /// As the end of a graceful node shutdown (phase `Failed`, reason `Terminated`).
    NodeShutdown,
    /// Not at all: the node is gone, nobody reports for it.
    Unreported,
}

/// One started process.
struct Proc {
    uid: String,
    node: String,
    child: tokio::process::Child,
    log: PathBuf,
    fallback_to_logs: bool,
    termed: bool,
    kill_at: Option<Instant>,
    end: EndAs,
}

impl Proc {
    fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    fn signal(&mut self, signal: &str) {
        if signal == "KILL" {
            let _ = self.child.start_kill();
        } else if let Some(pid) = self.pid() {
            send_signal(pid, signal);
        }
    }

    /// SIGTERM now, SIGKILL after `grace`.
    fn terminate(&mut self, grace: Duration) {
        if !self.termed {
            self.termed = true;
            self.signal("TERM");
        }
        let at = Instant::now() + grace;
        if self.kill_at.is_none_or(|k| at < k) {
            self.kill_at = Some(at);
        }
    }
}

/// What the process kubelet shares with the cluster and its handle.
pub(crate) struct Shared {
    exe: PathBuf,
    root: PathBuf,
    /// The running processes, by pod (`namespace`, `name`).
    procs: Mutex<HashMap<(String, String), Proc>>,
    /// The uids of every pod ever started, so none is started twice.
    started: Mutex<HashSet<String>>,
}

impl Shared {
    fn procs(&self) -> MutexGuard<'_, HashMap<(String, String), Proc>> {
        // A panic under the lock leaves the map usable: keep going.
        self.procs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn started(&self) -> MutexGuard<'_, HashSet<String>> {
        self.started
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn kill_all(&self) {
        for p in self.procs().values_mut() {
            p.end = EndAs::Unreported;
            p.signal("KILL");
        }
    }
}

/// The handle of a process kubelet: dropping it, or [`ProcessKubelet::stop`], kills every
/// process it started and ends its task.
pub struct ProcessKubelet {
    cluster: FakeCluster,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
    sync: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for ProcessKubelet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessKubelet")
            .field("exe", &self.shared.exe)
            .field("root", &self.shared.root)
            .field("processes", &self.shared.procs().len())
            .finish()
    }
}

impl ProcessKubelet {
    /// Also runs the Job controller ([`FakeCluster::sync_jobs`]) every `interval`, so the
    /// test need not.
    pub fn auto_sync(&mut self, interval: Duration) {
        let cluster = self.cluster.clone();
        if let Some(old) = self.sync.take() {
            old.abort();
        }
        self.sync = Some(tokio::spawn(async move {
            loop {
                cluster.sync_jobs();
                tokio::time::sleep(interval).await;
            }
        }));
    }

    /// The pods whose processes are running now (`namespace/name`).
    pub fn running(&self) -> Vec<String> {
        let mut pods: Vec<String> = self
            .shared
            .procs()
            .keys()
            .map(|(ns, n)| format!("{ns}/{n}"))
            .collect();
        pods.sort();
        pods
    }

    /// The pid of the process of `pod` (`name` or `namespace/name`), while it runs.
    pub fn pid(&self, pod: &str) -> Option<u32> {
        let procs = self.shared.procs();
        procs
            .iter()
            .find(|(k, _)| matches_pod(k, pod))
            .and_then(|(_, p)| p.pid())
    }

    /// Kills every process and stops the task.
    pub fn stop(self) {
        drop(self);
    }
}

impl Drop for ProcessKubelet {
    fn drop(&mut self) {
        self.task.abort();
        if let Some(sync) = &self.sync {
            sync.abort();
        }
        self.shared.kill_all();
        // `kill_on_drop` reaps what is left when the map goes.
        self.shared.procs().clear();
    }
}

fn matches_pod((ns, name): &(String, String), pod: &str) -> bool {
    match pod.split_once('/') {
        Some((n, p)) => ns == n && name == p,
        None => name == pod,
    }
}

/// Sends `signal` (`TERM`, `KILL`, …) to `pid` with `kill(1)`: no unsafe code for it.
fn send_signal(pid: u32, signal: &str) {
    let _ = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

impl FakeCluster {
    /// Starts a process kubelet (see the module doc) that runs pods as processes of `exe`,
    /// in folders under `root`. Must be called inside a tokio runtime.
    pub fn run_pods_as_processes(&self, exe: PathBuf, root: PathBuf) -> ProcessKubelet {
        let shared = Arc::new(Shared {
            exe,
            root,
            procs: Mutex::new(HashMap::new()),
            started: Mutex::new(HashSet::new()),
        });
        *self.processes() = Some(Arc::downgrade(&shared));
        let cluster = self.clone();
        let weak = Arc::downgrade(&shared);
        let task = tokio::spawn(async move {
            loop {
                let Some(shared) = weak.upgrade() else {
                    return;
                };
                tick(&cluster, &shared);
                drop(shared);
                tokio::time::sleep(TICK).await;
            }
        });
        ProcessKubelet {
            cluster: self.clone(),
            shared,
            task,
            sync: None,
        }
    }

    fn process_kubelet(&self) -> Option<Arc<Shared>> {
        self.processes().as_ref().and_then(Weak::upgrade)
    }

    /// A crash: SIGKILL to the process of `pod`, nothing written to the API (the process
    /// kubelet then reports the exit, 137).
    pub fn kill_process(&self, pod: &str) -> Result<()> {
        let shared = self.process_kubelet().ok_or_else(no_kubelet)?;
        let mut procs = shared.procs();
        let (_, p) = procs
            .iter_mut()
            .find(|(k, _)| matches_pod(k, pod))
            .ok_or_else(|| Error::NotFound {
                kind: Kind::Pod,
                name: pod.to_string(),
            })?;
        p.signal("KILL");
        Ok(())
    }

    /// A vanished VM: SIGKILL to every process on `node`, whose ends are never reported,
    /// and the Node object deleted; its pods stay as they were (`Running`) in the API
    /// until something (PodGC, [`FakeCluster::podgc`]) deletes them.
    pub fn lose_node(&self, node: &str) -> Result<()> {
        if let Some(shared) = self.process_kubelet() {
            for p in shared.procs().values_mut().filter(|p| p.node == node) {
                p.end = EndAs::Unreported;
                p.signal("KILL");
            }
        }
        self.delete_node(node)
    }

    /// For a node shutdown of `pod`: when a process kubelet runs it, SIGTERM to its
    /// process (SIGKILL after the pod's grace) and `true`; the end is written on exit.
    pub(crate) fn signal_node_shutdown(&self, pod: &str) -> Result<bool> {
        let Some(shared) = self.process_kubelet() else {
            return Ok(false);
        };
        let grace = self
            .get(Kind::Pod, pod)
            .and_then(|p| {
                p.pointer("/spec/terminationGracePeriodSeconds")
                    .and_then(Value::as_u64)
            })
            .unwrap_or(DEFAULT_GRACE);
        let mut procs = shared.procs();
        let Some((_, p)) = procs.iter_mut().find(|(k, _)| matches_pod(k, pod)) else {
            return Ok(false);
        };
        p.end = EndAs::NodeShutdown;
        p.terminate(Duration::from_secs(grace));
        Ok(true)
    }
}

fn no_kubelet() -> Error {
    Error::InvalidState("no process kubelet runs on this cluster".to_string())
}

/// One look at the pods and the processes (see the module doc).
fn tick(cluster: &FakeCluster, shared: &Shared) {
    reap(cluster, shared);
    let pods = cluster.list(Kind::Pod);
    let nodes: HashSet<String> = cluster
        .list(Kind::Node)
        .iter()
        .filter_map(|n| meta_str(n, "name").map(str::to_string))
        .collect();
    let mut alive: HashSet<(String, String)> = HashSet::new();
    for pod in &pods {
        let ns = meta_str(pod, "namespace").unwrap_or_default().to_string();
        let name = meta_str(pod, "name").unwrap_or_default().to_string();
        let uid = meta_str(pod, "uid").unwrap_or_default().to_string();
        let key = (ns, name);
        let deleting = pod.pointer("/metadata/deletionTimestamp").is_some();
        {
            let mut procs = shared.procs();
            if let Some(p) = procs.get_mut(&key)
                && p.uid == uid
            {
                alive.insert(key.clone());
                if deleting {
                    let grace = pod
                        .pointer("/metadata/deletionGracePeriodSeconds")
                        .and_then(Value::as_u64)
                        .unwrap_or(0);
                    p.terminate(Duration::from_secs(grace));
                }
                continue;
            }
        }
        let node = pod
            .pointer("/spec/nodeName")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let pending = pod.pointer("/status/phase").and_then(Value::as_str) == Some("Pending")
            || pod.pointer("/status/phase").is_none();
        if node.is_empty()
            || !nodes.contains(node)
            || deleting
            || !pending
            || pod_terminal(pod)
            || shared.started().contains(&uid)
        {
            continue;
        }
        let pod_name = format!("{}/{}", key.0, key.1);
        match start(cluster, shared, pod, &key.1) {
            Ok(Some(mut proc)) => {
                proc.uid = uid.clone();
                proc.node = node.to_string();
                shared.started().insert(uid);
                shared.procs().insert(key.clone(), proc);
                alive.insert(key);
                let _ = cluster.run(&pod_name);
            }
            Ok(None) => {
                let waits = pod
                    .pointer("/status/containerStatuses/0/state/waiting/reason")
                    .and_then(Value::as_str)
                    == Some("CreateContainerConfigError");
                if !waits {
                    let _ = cluster.config_error(&pod_name);
                }
            }
            Err(e) => {
                let _ = cluster.with_state(|s| {
                    let p = s.objects.get(&(Kind::Pod, key.0.clone(), key.1.clone()))?;
                    let p = p.clone();
                    s.record_event(&p, "Warning", "Failed", &e, "kubelet");
                    Some(())
                });
                shared.started().insert(uid);
            }
        }
    }
    // Processes of pods gone from the API (force-deleted) die at once; overdue ones too.
    let now = Instant::now();
    for (key, p) in shared.procs().iter_mut() {
        if !alive.contains(key) {
            p.end = EndAs::Unreported;
            p.signal("KILL");
        } else if p.kill_at.is_some_and(|k| now >= k) {
            p.signal("KILL");
        }
    }
}

/// Writes the end of every process that exited, and forgets it.
fn reap(cluster: &FakeCluster, shared: &Shared) {
    let mut ended: Vec<((String, String), Proc, i32)> = Vec::new();
    {
        let mut procs = shared.procs();
        let keys: Vec<(String, String)> = procs.keys().cloned().collect();
        for key in keys {
            let Some(p) = procs.get_mut(&key) else {
                continue;
            };
            let Ok(Some(status)) = p.child.try_wait() else {
                continue;
            };
            let code = status
                .code()
                .or_else(|| status.signal().map(|s| 128 + s))
                .unwrap_or(255);
            if let Some(p) = procs.remove(&key) {
                ended.push((key, p, code));
            }
        }
    }
    for ((ns, name), p, code) in ended {
        let pod = format!("{ns}/{name}");
        let same = cluster
            .get(Kind::Pod, &pod)
            .is_some_and(|o| meta_str(&o, "uid") == Some(p.uid.as_str()) && !pod_terminal(&o));
        if !same {
            continue;
        }
        let _ = match p.end {
            EndAs::Unreported => Ok(()),
            EndAs::NodeShutdown => cluster.node_shutdown_end(&pod, code),
            EndAs::Exit => {
                let reason = if code == 0 { "Completed" } else { "Error" };
                let message = (code != 0 && p.fallback_to_logs)
                    .then(|| log_tail(&p.log))
                    .flatten();
                cluster.exit(&pod, code, reason, message.as_deref())
            }
        };
    }
}

/// The last lines of a log as the kubelet keeps them for a termination message.
fn log_tail(path: &Path) -> Option<String> {
    let text = std::fs::read(path).ok()?;
    let text = String::from_utf8_lossy(&text);
    let lines: Vec<&str> = text.lines().collect();
    let tail = lines[lines.len().saturating_sub(MESSAGE_LINES)..].join("\n");
    let mut start = tail.len().saturating_sub(MESSAGE_BYTES);
    while !tail.is_char_boundary(start) {
        start += 1;
    }
    let tail = tail[start..].trim().to_string();
    (!tail.is_empty()).then_some(tail)
}

/// A Secret's keys and their bytes (`data` base64, `stringData` as is).
fn secret_data(secret: &Value) -> HashMap<String, Vec<u8>> {
    let mut out = HashMap::new();
    if let Some(data) = secret.get("data").and_then(Value::as_object) {
        for (k, v) in data {
            if let Some(bytes) = v
                .as_str()
                .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
            {
                out.insert(k.clone(), bytes);
            }
        }
    }
    if let Some(data) = secret.get("stringData").and_then(Value::as_object) {
        for (k, v) in data {
            if let Some(s) = v.as_str() {
                out.insert(k.clone(), s.as_bytes().to_vec());
            }
        }
    }
    out
}

/// Rewrites every mount path prefix of `value` (whole, or after a `=`) to its folder.
fn rewrite(value: &str, mounts: &[(String, PathBuf)]) -> String {
    let swap = |v: &str| -> Option<String> {
        mounts.iter().find_map(|(mount, dir)| {
            let rest = v.strip_prefix(mount.as_str())?;
            (rest.is_empty() || rest.starts_with('/')).then(|| format!("{}{rest}", dir.display()))
        })
    };
    if let Some(v) = swap(value) {
        return v;
    }
    if let Some((flag, v)) = value.split_once('=')
        && let Some(v) = swap(v)
    {
        return format!("{flag}={v}");
    }
    value.to_string()
}

/// Starts the first container of `pod`: `Ok(None)` when a Secret it needs is missing,
/// `Err` with the reason when it cannot start otherwise.
fn start(
    cluster: &FakeCluster,
    shared: &Shared,
    pod: &Value,
    name: &str,
) -> Result<Option<Proc>, String> {
    let ns = meta_str(pod, "namespace").unwrap_or_default();
    let dir = shared.root.join(name);
    std::fs::create_dir_all(&dir).map_err(io_error(&dir))?;
    let container = pod
        .pointer("/spec/containers/0")
        .ok_or("the pod has no container")?;
    let Some(folders) = volume_folders(cluster, ns, pod, &dir)? else {
        return Ok(None);
    };
    let mounts = mount_table(container, &folders);
    let args: Vec<String> = container["args"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(|a| rewrite(a, &mounts))
        .collect();
    let Some(env) = container_env(cluster, ns, container, &mounts) else {
        return Ok(None);
    };
    spawn(shared, &dir, container, &args, env).map(Some)
}

/// How an I/O error under the pod's folder `dir` is reported.
fn io_error(dir: &Path) -> impl Fn(std::io::Error) -> String + '_ {
    move |e| format!("{}: {e}", dir.display())
}

/// A Secret of namespace `ns`, by name.
fn namespaced_secret(cluster: &FakeCluster, ns: &str, name: &str) -> Option<Value> {
    cluster.get(Kind::Secret, &format!("{ns}/{name}"))
}

/// One folder under `dir` per volume of `pod`, by volume name, with each Secret volume's
/// files written into its folder; `Ok(None)` when a Secret or one of its keys is missing.
fn volume_folders(
    cluster: &FakeCluster,
    ns: &str,
    pod: &Value,
    dir: &Path,
) -> Result<Option<HashMap<String, PathBuf>>, String> {
    let mut folders: HashMap<String, PathBuf> = HashMap::new();
    for v in pod
        .pointer("/spec/volumes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let vname = v["name"].as_str().unwrap_or_default();
        let folder = dir.join(vname);
        std::fs::create_dir_all(&folder).map_err(io_error(dir))?;
        if let Some(sname) = v.pointer("/secret/secretName").and_then(Value::as_str) {
            let Some(s) = namespaced_secret(cluster, ns, sname) else {
                return Ok(None);
            };
            if !write_secret_files(&s, v, &folder, dir)? {
                return Ok(None);
            }
        }
        folders.insert(vname.to_string(), folder);
    }
    Ok(Some(folders))
}

/// Writes the keys of Secret `s` that volume `v` projects (its `items`, or every key)
/// into `folder`; `Ok(false)` when a key it names is missing.
fn write_secret_files(s: &Value, v: &Value, folder: &Path, dir: &Path) -> Result<bool, String> {
    let data = secret_data(s);
    let files: Vec<(String, String)> = match v.pointer("/secret/items") {
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(|i| Some((i["key"].as_str()?.into(), i["path"].as_str()?.into())))
            .collect(),
        _ => data.keys().map(|k| (k.clone(), k.clone())).collect(),
    };
    for (key, path) in files {
        let Some(bytes) = data.get(&key) else {
            return Ok(false);
        };
        let file = folder.join(path);
        if let Some(parent) = file.parent() {
            std::fs::create_dir_all(parent).map_err(io_error(dir))?;
        }
        std::fs::write(&file, bytes).map_err(io_error(dir))?;
    }
    Ok(true)
}

/// The container's mount paths and the folders they stand for (a `subPath` inside its
/// volume's folder), longest path first so `/a/b` wins over `/a`.
fn mount_table(container: &Value, folders: &HashMap<String, PathBuf>) -> Vec<(String, PathBuf)> {
    let mut mounts: Vec<(String, PathBuf)> = container["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| {
            let folder = folders.get(m["name"].as_str()?)?;
            let folder = match m["subPath"].as_str().filter(|s| !s.is_empty()) {
                Some(sub) => folder.join(sub),
                None => folder.clone(),
            };
            Some((
                m["mountPath"].as_str()?.trim_end_matches('/').to_string(),
                folder,
            ))
        })
        .collect();
    mounts.sort_by_key(|(m, _)| std::cmp::Reverse(m.len()));
    mounts
}

/// The container's environment: plain values with mount paths rewritten, Secret keys
/// read from the Secret; `None` when a Secret key that is not optional is missing.
fn container_env(
    cluster: &FakeCluster,
    ns: &str,
    container: &Value,
    mounts: &[(String, PathBuf)],
) -> Option<Vec<(String, String)>> {
    let mut env: Vec<(String, String)> = Vec::new();
    for e in container["env"].as_array().into_iter().flatten() {
        let Some(key) = e["name"].as_str() else {
            continue;
        };
        if let Some(v) = e["value"].as_str() {
            env.push((key.to_string(), rewrite(v, mounts)));
        } else if let Some(r) = e.pointer("/valueFrom/secretKeyRef") {
            let optional = r["optional"].as_bool() == Some(true);
            let value = r["name"]
                .as_str()
                .and_then(|n| namespaced_secret(cluster, ns, n))
                .and_then(|s| secret_data(&s).remove(r["key"].as_str().unwrap_or_default()));
            match value {
                Some(v) => env.push((key.to_string(), String::from_utf8_lossy(&v).into_owned())),
                None if optional => {}
                None => return None,
            }
        }
    }
    Some(env)
}

/// Runs the fake's executable in the pod's folder `dir` with `args` and `env`, its output
/// in `dir/log`.
fn spawn(
    shared: &Shared,
    dir: &Path,
    container: &Value,
    args: &[String],
    env: Vec<(String, String)>,
) -> Result<Proc, String> {
    let log = dir.join("log");
    let out = std::fs::File::create(&log).map_err(io_error(dir))?;
    let err = out.try_clone().map_err(io_error(dir))?;
    let child = tokio::process::Command::new(&shared.exe)
        .args(args)
        .envs(env)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", shared.exe.display()))?;
    Ok(Proc {
        uid: String::new(),
        node: String::new(),
        child,
        log,
        fallback_to_logs: container["terminationMessagePolicy"] == "FallbackToLogsOnError",
        termed: false,
        kill_at: None,
        end: EndAs::Exit,
    })
}
