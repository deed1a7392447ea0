//! Redis for tests: a redis-server of the test's own (killed and restarted at will), a
//! shared one per test process under the watchdog, and a three-node Redis Cluster.

use crate::{free_port, require_program, scratch_dir, spawn_watched, wait_until};
use std::ffi::OsString;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

/// A redis-server child process with its own data folder.
#[derive(Debug)]
pub struct RedisServer {
    /// `redis://127.0.0.1:PORT/`
    pub url: String,
    port: u16,
    dir: PathBuf,
    aof_always: bool,
    child: Option<Child>,
}

fn binary() -> &'static str {
    static FOUND: OnceLock<()> = OnceLock::new();
    FOUND.get_or_init(|| require_program("redis-server", "the queue tests need a real one"));
    "redis-server"
}

impl RedisServer {
    /// Starts a server in `dir`; with `aof_always` every write is fsynced to the
    /// append-only file before it is acknowledged (`appendfsync always`).
    pub fn start(dir: &Path, aof_always: bool) -> Self {
        let mut server = Self {
            url: String::new(),
            port: free_port(),
            dir: dir.to_path_buf(),
            aof_always,
            child: None,
        };
        server.url = format!("redis://127.0.0.1:{}/", server.port);
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        std::fs::create_dir_all(&self.dir).unwrap();
        let mut cmd = Command::new(binary());
        cmd.arg("--port")
            .arg(self.port.to_string())
            .arg("--bind")
            .arg("127.0.0.1")
            .arg("--dir")
            .arg(&self.dir)
            .arg("--save")
            .arg("")
            .arg("--logfile")
            .arg(self.dir.join("redis.log"));
        if self.aof_always {
            cmd.args(["--appendonly", "yes", "--appendfsync", "always"]);
        } else {
            cmd.args(["--appendonly", "no"]);
        }
        self.child = Some(
            cmd.stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start redis-server"),
        );
        self.wait_ready();
    }

    fn wait_ready(&self) {
        wait_until(
            &format!("redis-server on port {} did not answer PING", self.port),
            Duration::from_secs(20),
            Duration::from_millis(20),
            || ping(self.port),
            || {
                format!(
                    "log: {}",
                    std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default()
                )
            },
        );
    }

    /// SIGKILLs the server (no shutdown, no final fsync).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port and data folder (replaying the AOF).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One `PING` over a plain socket.
fn ping(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    if s.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 7];
    s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}

/// Starts redis-server on `port` with its data and log in `dir`, plus `extra` arguments,
/// under the watchdog (see [`spawn_watched`]).
fn spawn_shared(port: u16, dir: &Path, extra: &[OsString]) -> Child {
    let mut args: Vec<OsString> = [
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
    ]
    .iter()
    .map(OsString::from)
    .collect();
    args.push(dir.into());
    args.push("--logfile".into());
    args.push(dir.join(format!("redis-{port}.log")).into());
    args.extend(extra.iter().cloned());
    spawn_watched(binary(), &args, Stdio::null(), Stdio::null())
}

/// Waits until the server on `port` answers PING.
fn wait_for_ping(port: u16, dir: &Path) {
    wait_until(
        &format!("redis-server on port {port} did not start"),
        Duration::from_secs(20),
        Duration::from_millis(20),
        || ping(port),
        || format!("see {}", dir.display()),
    );
}

/// A server shared by the tests of one process (each test uses its own domain). It
/// runs under a watchdog shell that stops it when this process exits.
pub fn shared() -> &'static str {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| {
        let dir = scratch_dir("redis");
        let port = free_port();
        crate::reap(spawn_shared(port, &dir, &[]));
        wait_for_ping(port, &dir);
        format!("redis://127.0.0.1:{port}/")
    })
}

fn cli() -> &'static str {
    static FOUND: OnceLock<()> = OnceLock::new();
    FOUND.get_or_init(|| {
        require_program(
            "redis-cli",
            "the Redis Cluster tests create their cluster with it (apt's redis-server brings it)",
        )
    });
    "redis-cli"
}

/// `redis-cli -p PORT ARGS...`: its output, or None if it did not succeed.
fn redis_cli(port: u16, args: &[&str]) -> Option<String> {
    let out = Command::new(cli())
        .arg("-p")
        .arg(port.to_string())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A free port whose cluster bus port (port + 10000, fixed by Redis) is free as well.
fn free_cluster_port() -> u16 {
    loop {
        let port = free_port();
        let Some(bus) = port.checked_add(10_000) else {
            continue;
        };
        if TcpListener::bind(("127.0.0.1", port)).is_ok()
            && TcpListener::bind(("127.0.0.1", bus)).is_ok()
        {
            return port;
        }
    }
}

/// A Redis Cluster of three primaries (no replicas, all 16384 slots spread over them) on
/// free loopback ports. Every node runs under the watchdog, so none outlives this
/// process; dropping the cluster shuts them down at once.
#[derive(Debug)]
pub struct RedisCluster {
    /// `redis://127.0.0.1:PORT/` of every node, as `tuneq_queue::Queue::connect_cluster`
    /// takes them.
    pub urls: Vec<String>,
    ports: Vec<u16>,
    dir: PathBuf,
    watchdogs: Vec<Child>,
}

impl RedisCluster {
    /// Starts three cluster-enabled servers in `dir`, joins them with
    /// `redis-cli --cluster create`, and waits until every node reports
    /// `cluster_state:ok`.
    pub fn start(dir: &Path) -> Self {
        cli();
        std::fs::create_dir_all(dir).unwrap();
        let mut cluster = Self {
            urls: Vec::new(),
            ports: Vec::new(),
            dir: dir.to_path_buf(),
            watchdogs: Vec::new(),
        };
        for _ in 0..3 {
            let port = free_cluster_port();
            let nodes_conf = dir.join(format!("nodes-{port}.conf"));
            let extra = [
                OsString::from("--cluster-enabled"),
                OsString::from("yes"),
                OsString::from("--cluster-config-file"),
                nodes_conf.into_os_string(),
            ];
            cluster.watchdogs.push(spawn_shared(port, dir, &extra));
            // Up before the next port is picked, so no two nodes pick the same ports.
            wait_for_ping(port, dir);
            cluster.ports.push(port);
            cluster.urls.push(format!("redis://127.0.0.1:{port}/"));
        }
        let nodes: Vec<String> = cluster
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let create = Command::new(cli())
            .args(["--cluster", "create"])
            .args(&nodes)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            create.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&create.stdout),
            String::from_utf8_lossy(&create.stderr)
        );
        cluster.wait_ok();
        cluster
    }

    /// Waits until every node sees all slots covered (`cluster_state:ok`), so a client
    /// that asks any node for the slot map gets the whole one.
    fn wait_ok(&self) {
        for &port in &self.ports {
            wait_until(
                &format!("Redis Cluster node {port} never reached cluster_state:ok"),
                Duration::from_secs(30),
                Duration::from_millis(50),
                || {
                    redis_cli(port, &["CLUSTER", "INFO"])
                        .is_some_and(|info| info.contains("cluster_state:ok"))
                },
                || format!("logs in {}", self.dir.display()),
            );
        }
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for &port in &self.ports {
            let _ = redis_cli(port, &["SHUTDOWN", "NOSAVE"]);
        }
        for watchdog in &mut self.watchdogs {
            let _ = watchdog.wait();
        }
    }
}

/// A cluster shared by the tests of one process (each test uses its own domain, whose
/// name picks the slot and so the node). Its nodes stop when this process exits.
pub fn shared_cluster() -> &'static RedisCluster {
    static CLUSTER: OnceLock<RedisCluster> = OnceLock::new();
    CLUSTER.get_or_init(|| RedisCluster::start(&scratch_dir("redis")))
}
