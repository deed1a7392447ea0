//! Settings of the services: flags over the environment over a config file over the
//! defaults, `tuneq config show` masking secrets, and a config file's mistakes refused
//! with the key and the file named.

mod common;

use common::BIN;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};

const SECRET: &str = "attempt-secret-0123456789-abcdefghijkl";
const PASSWORD: &str = "redis-pass/with@odd:chars";

/// A config file at mode `mode`.
fn config_file(dir: &Path, text: &str, mode: u32) -> std::path::PathBuf {
    let path = dir.join("tuneq.toml");
    std::fs::write(&path, text).expect("write config");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    path
}

/// `tuneq` with only the environment given (no TUNEQ_* from the caller's), which must
/// exit within a minute (a service that started instead of refusing is killed).
fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(BIN);
    command.args(args);
    for (key, _) in std::env::vars() {
        if key.starts_with("TUNEQ_") {
            command.env_remove(key);
        }
    }
    let child = command
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run tuneq");
    let pid = child.id();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let out = child.wait_with_output().expect("wait for tuneq");
        let _ = done_tx.send(());
        out
    });
    if done_rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .is_err()
    {
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
        let out = waiter.join().expect("waiter");
        panic!(
            "tuneq {args:?} did not exit: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    waiter.join().expect("waiter")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The line of `show`'s output for `key`.
fn line<'a>(shown: &'a str, key: &str) -> &'a str {
    shown
        .lines()
        .find(|l| l.starts_with(&format!("{key} = ")))
        .unwrap_or_else(|| panic!("no `{key}` in:\n{shown}"))
}

#[test]
fn flags_win_over_the_environment_which_wins_over_the_file_which_wins_over_defaults() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = config_file(
        dir.path(),
        &format!(
            "[api]\nport = 9000\nhost = \"10.0.0.1\"\nstore = \"s3://bucket/prefix\"\n\
             pool = [\"a=cpu\", \"b=spot-gpu\"]\njob-retention = \"14d\"\n\
             attempt-secret = \"{SECRET}\"\nredis = \"redis://redis:6379\"\n\
             redis-password = \"{PASSWORD}\"\n[dispatcher]\nslots = 3\n"
        ),
        0o600,
    );
    let file = file.to_str().expect("utf8");
    let show = |args: &[&str], env: &[(&str, &str)]| {
        let mut all = vec!["--config", file, "config", "show", "api"];
        all.extend_from_slice(args);
        let out = run(&all, env);
        assert!(out.status.success(), "config show failed: {}", stderr(&out));
        stdout(&out)
    };

    let shown = show(&["--port", "9200"], &[("TUNEQ_PORT", "9100")]);
    assert_eq!(line(&shown, "port"), "port = 9200  # flag");
    let shown = show(&[], &[("TUNEQ_PORT", "9100")]);
    assert_eq!(line(&shown, "port"), "port = 9100  # env TUNEQ_PORT");
    let shown = show(&[], &[]);
    for (key, want) in [
        ("port", "port = 9000  # config file"),
        ("host", "host = \"10.0.0.1\"  # config file"),
        ("pool", "pool = [\"a=cpu\", \"b=spot-gpu\"]  # config file"),
        ("job-retention", "job-retention = \"14d\"  # config file"),
        ("max-upload-mib", "max-upload-mib = 512  # default"),
        // Secrets are masked wherever they came from; a URL keeps its host.
        (
            "attempt-secret",
            "attempt-secret = \"********\"  # config file",
        ),
        (
            "redis-password",
            "redis-password = \"********\"  # config file",
        ),
    ] {
        assert_eq!(line(&shown, key), want, "{key}");
    }
    let with_url_password = show(&["--redis", "redis://:hunter2@cache:6379/0"], &[]);
    assert_eq!(
        line(&with_url_password, "redis"),
        "redis = \"redis://:********@cache:6379/0\"  # flag"
    );
    for text in [&shown, &with_url_password] {
        assert!(
            !text.contains(SECRET) && !text.contains("hunter2") && !text.contains("odd:chars"),
            "a secret was printed:\n{text}"
        );
    }
    // Another service's table is not this one's.
    assert!(!shown.contains("slots"), "{shown}");
    // What `show` prints is a config file the service reads back.
    let again = config_file(dir.path(), &shown, 0o600);
    let out = run(
        &[
            "--config",
            again.to_str().expect("utf8"),
            "config",
            "show",
            "api",
        ],
        &[("TUNEQ_ATTEMPT_SECRET", SECRET)],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(line(&stdout(&out), "port"), "port = 9000  # config file");
}

#[test]
fn mistakes_in_a_config_file_are_refused_naming_the_key_and_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cases: [(&str, u32, &[&str]); 5] = [
        ("[up]\nprot = 8080\n", 0o644, &["no setting `prot`", "[up]"]),
        ("[uo]\nport = 8080\n", 0o644, &["unknown table [uo]"]),
        ("[up]\nport = \"eighty\"\n", 0o644, &["eighty", "--port"]),
        (
            "[up]\njob-retention = \"soon\"\n",
            0o644,
            &["soon", "--job-retention"],
        ),
        // A secret in a file others may read.
        (
            "[up]\napi-key = \"tq-0123456789abcdef\"\n",
            0o644,
            &["chmod 600", "others may read it"],
        ),
    ];
    for (text, mode, expected) in cases {
        let file = config_file(dir.path(), text, mode);
        let out = run(&["up", "--config", file.to_str().expect("utf8")], &[]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{text}: {err}");
        for want in expected {
            assert!(err.contains(want), "{text}: `{want}` not in: {err}");
        }
        assert!(!err.contains("tq-0123456789abcdef"), "{err}");
        if !text.contains("eighty") && !text.contains("soon") {
            assert!(err.contains(file.to_str().expect("utf8")), "{text}: {err}");
        }
    }
    // The same secret in a private file is fine, and not shown.
    let file = config_file(
        dir.path(),
        "[up]\napi-key = \"tq-0123456789abcdef\"\n",
        0o600,
    );
    let out = run(
        &[
            "config",
            "show",
            "up",
            "--config",
            file.to_str().expect("utf8"),
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stdout(&out).contains("tq-0123456789abcdef"));
    // A trainer started with a service's environment does not read its config file.
    let broken = config_file(dir.path(), "[up]\nprot = 1\n", 0o600);
    let out = run(
        &["model", "init", "--help"],
        &[("TUNEQ_CONFIG", broken.to_str().expect("utf8"))],
    );
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn tuneq_up_runs_with_the_settings_of_its_config_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data-from-file");
    let file = config_file(
        dir.path(),
        &format!(
            "[up]\nport = 0\ndata-dir = \"{}\"\njob-retention = \"1d\"\n",
            data.display()
        ),
        0o600,
    );
    let mut child = Command::new(BIN)
        .args(["up", "--config", file.to_str().expect("utf8")])
        .env_remove("TUNEQ_PORT")
        .env_remove("TUNEQ_DATA_DIR")
        .current_dir(dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start tuneq up");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let first = lines.next().and_then(Result::ok).unwrap_or_default();
    stop(&mut child);
    assert!(first.starts_with("tuneq is up at http://"), "{first}");
    assert!(
        !first.ends_with(":8080"),
        "the file's port 0 was not used: {first}"
    );
    assert!(
        data.join("api-key").is_file(),
        "the file's data dir was not used"
    );
}

/// Stops `tuneq up` as Ctrl-C would, and waits for it.
fn stop(child: &mut std::process::Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
}

/// A Kubernetes pools file whose one pool has `extra` added to its `[pool.kubernetes]`.
fn kubernetes_pools(dir: &Path, extra: &str) -> std::path::PathBuf {
    let path = dir.join("pools.toml");
    let text = format!(
        "[[pool]]\nname = \"xeon\"\nruntime = \"kubernetes\"\nhardware = \"cpu\"\ncpu = 8\nmemory = \"32Gi\"\n\
         [pool.kubernetes]\nnamespace = \"tuneq\"\nimage = \"example.com/tuneq:0.1.0\"\n{extra}\n"
    );
    std::fs::write(&path, text).expect("write pools file");
    path
}

#[test]
fn check_config_refuses_pools_whose_job_kubernetes_or_the_runtime_would_refuse() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ok = kubernetes_pools(dir.path(), "");
    let out = run(
        &["dispatcher", "--check-config", ok.to_str().expect("utf8")],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let cases = [
        // Volumes on the runtime's own mount paths, or with its volume names: found
        // by building the pool's Job, as the dispatcher does for each attempt.
        (
            r#"volumes = [{ name = "scratch", mount_path = "/tmp", source = { empty_dir = {} } }]"#,
            &["pool[0].kubernetes.volumes[0]", "mount path /tmp"][..],
        ),
        (
            r#"volumes = [{ name = "spec", mount_path = "/var/run/tuneq/attempt", source = { empty_dir = {} } }]"#,
            &["pool[0].kubernetes.volumes[0]", "/var/run/tuneq/attempt"][..],
        ),
        (
            r#"volumes = [{ name = "x", mount_path = "/data", source = { empty_dir = {} } }, { name = "tuneq-tmp", mount_path = "/scratch", source = { empty_dir = {} } }]"#,
            &["pool[0].kubernetes.volumes[1]", "volume tuneq-tmp"][..],
        ),
        // The probe's example: a nodeSelector Kubernetes answers with 422.
        (
            r#"node_selector = { "a/b/c" = "has space" }"#,
            &[r#"pool[0].kubernetes.node_selector."a/b/c""#][..],
        ),
    ];
    for (extra, wanted) in cases {
        let path = kubernetes_pools(dir.path(), extra);
        let out = run(
            &["dispatcher", "--check-config", path.to_str().expect("utf8")],
            &[],
        );
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{extra}: {err}");
        assert!(err.contains(path.to_str().expect("utf8")), "{extra}: {err}");
        for want in wanted {
            assert!(err.contains(want), "{extra}: `{want}` not in: {err}");
        }
    }
}
