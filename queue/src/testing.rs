//! A real `redis-server` for tests, on a free loopback port, and a real three-node Redis
//! Cluster. A missing binary is a loud failure with the install hint, never a skip.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::ffi::OsString;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

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

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

fn binary() -> &'static str {
    let found = Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found,
        "redis-server is not installed: the queue tests need a real one. \
         Run scripts/setup-test-deps (it runs `apt-get install redis-server`)."
    );
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
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if ping(self.port) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "redis-server on port {} did not answer PING; log: {}",
            self.port,
            std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default()
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

/// The watchdog around a shared server: `sh -c WATCHDOG sh PARENT_PID redis-server ARGS...`
/// runs the server and stops it when the parent process (or the server) is gone, since a
/// shared server lives in a static and is never dropped.
const WATCHDOG: &str = r#"parent=$1; shift; "$@" & c=$!
trap 'kill $c 2>/dev/null; exit 0' TERM INT
while kill -0 "$parent" 2>/dev/null && kill -0 "$c" 2>/dev/null; do sleep 0.5; done
kill $c 2>/dev/null; wait $c"#;

/// Starts redis-server on `port` with its data and log in `dir`, plus `extra` arguments,
/// under [`WATCHDOG`].
fn spawn_watched(port: u16, dir: &Path, extra: &[OsString]) -> Child {
    Command::new("sh")
        .arg("-c")
        .arg(WATCHDOG)
        .arg("sh")
        .arg(std::process::id().to_string())
        .arg(binary())
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .arg("--dir")
        .arg(dir)
        .arg("--logfile")
        .arg(dir.join(format!("redis-{port}.log")))
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start redis-server")
}

/// Waits until the server on `port` answers PING.
fn wait_for_ping(port: u16, dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ping(port) {
        assert!(
            Instant::now() < deadline,
            "redis-server on port {port} did not start; see {}",
            dir.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A server shared by the tests of one process (each test uses its own domain). It
/// runs under a watchdog shell that stops it when this process exits.
pub fn shared() -> &'static str {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| {
        let dir = scratch_dir();
        let port = free_port();
        let mut watchdog = spawn_watched(port, &dir, &[]);
        std::thread::spawn(move || watchdog.wait());
        wait_for_ping(port, &dir);
        format!("redis://127.0.0.1:{port}/")
    })
}

fn cli() -> &'static str {
    static FOUND: OnceLock<bool> = OnceLock::new();
    let found = *FOUND.get_or_init(|| {
        Command::new("redis-cli")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    assert!(
        found,
        "redis-cli is not installed: the Redis Cluster tests create their cluster with it. \
         Run scripts/setup-test-deps (it runs `apt-get install redis-server`, which brings \
         redis-cli)."
    );
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
    /// `redis://127.0.0.1:PORT/` of every node, as [`crate::Queue::connect_cluster`]
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
            cluster.watchdogs.push(spawn_watched(port, dir, &extra));
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
        let deadline = Instant::now() + Duration::from_secs(30);
        for &port in &self.ports {
            while !redis_cli(port, &["CLUSTER", "INFO"])
                .is_some_and(|info| info.contains("cluster_state:ok"))
            {
                assert!(
                    Instant::now() < deadline,
                    "Redis Cluster node {port} never reached cluster_state:ok; logs in {}",
                    self.dir.display()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
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
    CLUSTER.get_or_init(|| RedisCluster::start(&scratch_dir()))
}

/// A scratch folder for a server under `target/test-servers`.
pub fn scratch_dir() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../target/test-servers")
        .join(format!(
            "redis-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
    std::fs::create_dir_all(&path).unwrap();
    path
}

/// A fresh domain name per test, so tests sharing a server never meet.
pub fn unique_domain(name: &str) -> String {
    format!("{name}-{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff)
}
