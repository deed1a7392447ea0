//! A real `redis-server` for tests, on a free loopback port. A missing binary is a loud
//! failure with the install hint, never a skip.

#![allow(clippy::unwrap_used, clippy::expect_used)]

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

/// A server shared by the tests of one process (each test uses its own domain). It
/// runs under a watchdog shell that stops it when this process exits.
pub fn shared() -> &'static str {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| {
        let dir = scratch_dir();
        let port = free_port();
        let script = r#"parent=$1; shift; "$@" & c=$!
trap 'kill $c 2>/dev/null; exit 0' TERM INT
while kill -0 "$parent" 2>/dev/null && kill -0 "$c" 2>/dev/null; do sleep 0.5; done
kill $c 2>/dev/null; wait $c"#;
        let mut watchdog = Command::new("sh")
            .arg("-c")
            .arg(script)
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
            .arg(&dir)
            .arg("--logfile")
            .arg(dir.join("redis.log"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server");
        std::thread::spawn(move || watchdog.wait());
        let deadline = Instant::now() + Duration::from_secs(20);
        while !ping(port) {
            assert!(
                Instant::now() < deadline,
                "shared redis-server did not start; see {}",
                dir.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        format!("redis://127.0.0.1:{port}/")
    })
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
