//! The attempt Job and Secret built for each example pool in `examples/pools/`: the rules
//! the API server would not check for us (research note §C.3), and the manifests written
//! as JSON for `scripts/validate-k8s-manifests` (`kubernetes-validate --strict`).

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Container, PodSpec, Secret};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use tuneq_dispatcher::kubernetes::job::{
    ATTEMPT_DIR, CACHE_DIR, CREDENTIAL_KEY, GPU_RESOURCE, SPEC_KEY, TTL_AFTER_FINISHED_SECS,
    is_label_value,
};
use tuneq_dispatcher::kubernetes::{
    AttemptLaunch, BuildError, CONTAINER, RULE_BAD_INPUT, RULE_DISRUPTION, build_job, build_secret,
    job_name, secret_name,
};
use tuneq_openapi::launch;
use tuneq_pools::{Hardware, KubernetesPool, Pool, PoolsFile};

const CREDENTIAL: &str = "tqatt-5f0e8c1d2b3a4968-credential-under-test";

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Every Kubernetes pool of the example pools files.
fn example_pools() -> Vec<(String, Pool, KubernetesPool)> {
    let mut pools = Vec::new();
    for file in ["gke-spot-l4.toml", "xeon.toml"] {
        let path = workspace().join("examples/pools").join(file);
        let parsed = PoolsFile::load(&path).unwrap();
        for pool in parsed.pools {
            if let Some(k) = pool.kubernetes.clone() {
                pools.push((file.trim_end_matches(".toml").to_string(), pool, k));
            }
        }
    }
    assert_eq!(pools.len(), 3, "l4-spot, l4-on-demand, xeon");
    pools
}

fn launch(pool: &Pool) -> AttemptLaunch {
    let spec_json =
        json!({"model": "tiny-llama", "training_file": "file-1", "epochs": 1}).to_string();
    AttemptLaunch {
        job_id: "ftjob-0a1b2c3d4e5f60718293a4b5".into(),
        attempt: 2,
        tenant: "acme".into(),
        pool: pool.name.clone(),
        spec_hash: AttemptLaunch::hash_spec(&spec_json),
        spec_json,
        report_url: "http://tuneq-api.tuneq.svc:8080/internal/attempts/ftjob-0a1b2c3d4e5f60718293a4b5/report".into(),
        credential: CREDENTIAL.into(),
    }
}

fn pod_spec(job: &Job) -> &PodSpec {
    job.spec.as_ref().unwrap().template.spec.as_ref().unwrap()
}

fn trainer(job: &Job) -> &Container {
    let containers = &pod_spec(job).containers;
    assert_eq!(containers.len(), 1);
    &containers[0]
}

#[test]
fn each_example_pool_gets_a_job_by_the_rules() {
    for (_, pool, k) in example_pools() {
        let at = &pool.name;
        let l = launch(&pool);
        let job = build_job(&l, &pool, &k).unwrap();
        let spec = job.spec.as_ref().unwrap();
        let pod = pod_spec(&job);

        // Name and place.
        let name = job.metadata.name.as_deref().unwrap();
        assert_eq!(name, job_name(&l.job_id, l.attempt));
        assert!(tuneq_pools::file::is_dns_label(name, 63), "{at}: {name}");
        assert_eq!(
            job.metadata.namespace.as_deref(),
            Some(k.namespace.as_str())
        );

        // Retries belong to the dispatcher.
        assert_eq!(pod.restart_policy.as_deref(), Some("Never"), "{at}");
        assert_eq!(spec.backoff_limit, Some(0), "{at}");
        assert_eq!(
            spec.pod_replacement_policy.as_deref(),
            Some("Failed"),
            "{at}"
        );
        let rules = &spec.pod_failure_policy.as_ref().unwrap().rules;
        assert_eq!(rules.len(), 2);
        assert!(rules.iter().all(|r| r.action == "FailJob"));
        let disruption = rules[RULE_DISRUPTION].on_pod_conditions.as_ref().unwrap();
        assert_eq!(disruption.len(), 1);
        assert_eq!(disruption[0].type_, "DisruptionTarget");
        assert_eq!(disruption[0].status, "True");
        assert!(rules[RULE_DISRUPTION].on_exit_codes.is_none());
        let bad_input = rules[RULE_BAD_INPUT].on_exit_codes.as_ref().unwrap();
        assert_eq!(bad_input.container_name.as_deref(), Some(CONTAINER));
        assert_eq!(bad_input.operator, "In");
        assert_eq!(
            bad_input.values,
            [launch::EXIT_BAD_INPUT, launch::EXIT_DIVERGED]
        );

        // Clocks and grace from the pool.
        assert_eq!(
            spec.active_deadline_seconds,
            Some(k.attempt_deadline.as_secs() as i64),
            "{at}"
        );
        assert_eq!(
            spec.ttl_seconds_after_finished,
            Some(TTL_AFTER_FINISHED_SECS)
        );
        assert_eq!(
            pod.termination_grace_period_seconds,
            Some(k.termination_grace.as_secs() as i64),
            "{at}"
        );

        // The same labels on the Job and its pods, all valid label values.
        let labels = job.metadata.labels.as_ref().unwrap();
        let template_labels = spec
            .template
            .metadata
            .as_ref()
            .unwrap()
            .labels
            .as_ref()
            .unwrap();
        assert_eq!(labels, template_labels, "{at}");
        for key in [
            "app.kubernetes.io/managed-by",
            "app.kubernetes.io/name",
            "tuneq.io/job-id",
            "tuneq.io/attempt",
            "tuneq.io/pool",
        ] {
            let value = labels
                .get(key)
                .unwrap_or_else(|| panic!("{at}: no label {key}"));
            assert!(is_label_value(value), "{at}: {key}={value}");
        }
        assert_eq!(labels["app.kubernetes.io/managed-by"], "tuneq");
        assert_eq!(labels["tuneq.io/attempt"], "2");
        assert_eq!(labels["tuneq.io/pool"], pool.name);
        let annotations = job.metadata.annotations.as_ref().unwrap();
        assert_eq!(annotations["tuneq.io/attempt-uid"], "2");
        assert_eq!(annotations["tuneq.io/spec-hash"], l.spec_hash);

        // Guaranteed QoS: requests are the limits, from the pool.
        let c = trainer(&job);
        let resources = c.resources.as_ref().unwrap();
        assert_eq!(resources.requests, resources.limits, "{at}");
        let limits = resources.limits.as_ref().unwrap();
        assert_eq!(limits["cpu"].0, pool.cpu.0.as_str());
        assert_eq!(limits["memory"].0, pool.memory.as_ref().unwrap().0.as_str());
        match pool.hardware {
            Hardware::Gpu => assert_eq!(limits[GPU_RESOURCE].0, pool.accelerators.to_string()),
            Hardware::Cpu => assert!(!limits.contains_key(GPU_RESOURCE), "{at}"),
        }

        // The trainer: the contract's arguments, non-root, read-only.
        assert_eq!(c.name, CONTAINER);
        assert_eq!(c.image.as_deref(), Some(k.image.as_str()));
        assert_eq!(
            c.args.as_ref().unwrap(),
            &launch::trainer_args(&format!("{ATTEMPT_DIR}/{SPEC_KEY}"))
        );
        let sc = c.security_context.as_ref().unwrap();
        assert_eq!(sc.run_as_non_root, Some(true));
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert_eq!(sc.read_only_root_filesystem, Some(true));
        assert_eq!(
            sc.capabilities.as_ref().unwrap().drop.as_deref(),
            Some(&["ALL".to_string()][..])
        );
        assert_eq!(pod.automount_service_account_token, Some(false));
        assert_eq!(pod.service_account_name, k.service_account);

        // The credential comes from the attempt's Secret, never inline.
        let env = c.env.as_ref().unwrap();
        let var = |name: &str| {
            env.iter()
                .find(|e| e.name == name)
                .unwrap_or_else(|| panic!("{at}: no {name}"))
        };
        let cred = var(launch::ENV_REPORT_CREDENTIAL);
        assert!(cred.value.is_none());
        let key_ref = cred
            .value_from
            .as_ref()
            .unwrap()
            .secret_key_ref
            .as_ref()
            .unwrap();
        assert_eq!(key_ref.name, secret_name(&l.job_id, l.attempt));
        assert_eq!(key_ref.key, CREDENTIAL_KEY);
        assert_eq!(
            var(launch::ENV_REPORT_URL).value.as_deref(),
            Some(l.report_url.as_str())
        );
        assert_eq!(var(launch::ENV_CACHE_DIR).value.as_deref(), Some(CACHE_DIR));
        let limit = var(launch::ENV_MEMORY_LIMIT_BYTES)
            .value_from
            .as_ref()
            .and_then(|v| v.resource_field_ref.as_ref())
            .unwrap();
        assert_eq!(
            (limit.container_name.as_deref(), limit.resource.as_str()),
            (Some(CONTAINER), "limits.memory"),
            "{at}"
        );
        // One GPU's memory, for `activation_checkpointing: auto` on the graph.
        let accelerator = env
            .iter()
            .find(|e| e.name == launch::ENV_ACCELERATOR_MEMORY_BYTES)
            .and_then(|e| e.value.clone());
        match pool.hardware {
            Hardware::Gpu => assert_eq!(
                accelerator,
                pool.accelerator_memory
                    .as_ref()
                    .map(|m| m.bytes().to_string()),
                "{at}"
            ),
            Hardware::Cpu => assert_eq!(accelerator, None, "{at}"),
        }
        for (name, value) in &k.env {
            assert_eq!(var(name).value.as_ref(), Some(value), "{at}");
        }
        let serialized = serde_json::to_string(&job).unwrap();
        assert!(
            !serialized.contains(CREDENTIAL),
            "{at}: the credential is in the Job"
        );
        assert!(
            !serialized.contains("dHFhdHQt"),
            "{at}: the credential, base64, is in the Job"
        );

        // Every mount has its volume; the spec comes from the Secret, read-only.
        let volumes = pod.volumes.as_ref().unwrap();
        let mounts = c.volume_mounts.as_ref().unwrap();
        for m in mounts {
            assert!(
                volumes.iter().any(|v| v.name == m.name),
                "{at}: mount {} has no volume",
                m.name
            );
        }
        let mounted_at = |path: &str| {
            let m = mounts
                .iter()
                .find(|m| m.mount_path == path)
                .unwrap_or_else(|| panic!("{at}: nothing at {path}"));
            (m, volumes.iter().find(|v| v.name == m.name).unwrap())
        };
        let (m, v) = mounted_at(ATTEMPT_DIR);
        assert_eq!(m.read_only, Some(true));
        let secret_volume = v.secret.as_ref().unwrap();
        assert_eq!(
            secret_volume.secret_name.as_deref(),
            Some(key_ref.name.as_str())
        );
        let items = secret_volume.items.as_ref().unwrap();
        assert_eq!(items.len(), 1, "{at}: only the spec is mounted");
        assert_eq!(items[0].key, SPEC_KEY);
        let (_, shm) = mounted_at("/dev/shm");
        let shm = shm.empty_dir.as_ref().unwrap();
        assert_eq!(shm.medium.as_deref(), Some("Memory"));
        assert_eq!(
            shm.size_limit.as_ref().unwrap().0,
            k.shm_size.as_ref().map_or("1Gi", |s| s.0.as_str())
        );
        assert!(mounted_at("/tmp").1.empty_dir.is_some());
        for pv in &k.volumes {
            let (m, _) = mounted_at(&pv.mount_path);
            assert_eq!(m.name, pv.name);
        }
        let (_, cache) = mounted_at(CACHE_DIR);
        if !k.volumes.iter().any(|v| v.mount_path == CACHE_DIR) {
            assert!(cache.empty_dir.is_some());
        }

        // Placement from the pool.
        assert_eq!(
            pod.node_selector.clone().unwrap_or_default(),
            k.node_selector
        );
        assert_eq!(
            pod.tolerations.as_ref().map_or(0, Vec::len),
            k.tolerations.len()
        );
        let required = pod
            .affinity
            .as_ref()
            .and_then(|a| a.node_affinity.as_ref())
            .and_then(|n| {
                n.required_during_scheduling_ignored_during_execution
                    .as_ref()
            })
            .map_or(0, |r| {
                r.node_selector_terms[0]
                    .match_expressions
                    .as_ref()
                    .unwrap()
                    .len()
            });
        assert_eq!(required, k.affinity.len(), "{at}");

        // It reads back as it was written.
        let back: Job = serde_json::from_str(&serialized).unwrap();
        assert_eq!(back, job);
    }
}

#[test]
fn the_secret_holds_spec_and_credential_and_follows_its_job() {
    let (_, pool, k) = example_pools().remove(0);
    let l = launch(&pool);
    let owned = build_secret(
        &l,
        &k.namespace,
        Some("0b1f0f0e-6e8a-4c5e-9d3b-6a1f9c2b7d10"),
    );
    assert_eq!(
        owned.metadata.name.as_deref(),
        Some(secret_name(&l.job_id, l.attempt).as_str())
    );
    assert_eq!(
        owned.metadata.namespace.as_deref(),
        Some(k.namespace.as_str())
    );
    let data = owned.data.as_ref().unwrap();
    assert_eq!(data[CREDENTIAL_KEY].0, CREDENTIAL.as_bytes());
    assert_eq!(data[SPEC_KEY].0, l.spec_json.as_bytes());
    assert_eq!(owned.immutable, Some(true));
    let job = build_job(&l, &pool, &k).unwrap();
    assert_eq!(owned.metadata.labels, job.metadata.labels);
    let owners = owned.metadata.owner_references.as_ref().unwrap();
    assert_eq!(owners.len(), 1);
    assert_eq!(owners[0].api_version, "batch/v1");
    assert_eq!(owners[0].kind, "Job");
    assert_eq!(Some(owners[0].name.as_str()), job.metadata.name.as_deref());
    assert_eq!(owners[0].uid, "0b1f0f0e-6e8a-4c5e-9d3b-6a1f9c2b7d10");
    assert_eq!(owners[0].controller, Some(false));
    assert_eq!(owners[0].block_owner_deletion, Some(false));

    let orphan = build_secret(&l, &k.namespace, None);
    assert!(orphan.metadata.owner_references.is_none());
    // Written as the API takes it: base64 under `data`.
    let written = serde_json::to_value(&orphan).unwrap();
    assert!(written["data"][CREDENTIAL_KEY].is_string());
    assert!(!written.to_string().contains(CREDENTIAL));
}

#[test]
fn pools_the_runtime_cannot_serve_are_refused() {
    let base = r#"
[[pool]]
name = "p"
runtime = "kubernetes"
hardware = "cpu"
cpu = "4"
memory = "8Gi"
[pool.kubernetes]
namespace = "tuneq"
image = "registry.example.com/tuneq/tuneq:0.1.0"
"#;
    let with_volume = |name: &str, path: &str| {
        format!(
            "{base}[[pool.kubernetes.volumes]]\nname = \"{name}\"\nmount_path = \"{path}\"\nsource = {{ empty_dir = {{}} }}\n"
        )
    };
    for (text, what) in [
        (with_volume("tuneq-tmp", "/scratch"), "volume tuneq-tmp"),
        (with_volume("scratch", "/tmp"), "mount path /tmp"),
        (
            with_volume("spec", ATTEMPT_DIR),
            "mount path /var/run/tuneq/attempt",
        ),
    ] {
        let file = PoolsFile::parse(&text, "pools.toml").unwrap();
        let pool = &file.pools[0];
        let err = build_job(&launch(pool), pool, pool.kubernetes.as_ref().unwrap()).unwrap_err();
        assert!(
            matches!(&err, BuildError::VolumeClash { what: w, .. } if w == what),
            "{err}"
        );
        assert!(!err.is_retryable());
    }
    let ok = PoolsFile::parse(&with_volume("scratch", "/scratch"), "pools.toml").unwrap();
    let mut pool = ok.pools[0].clone();
    let k = pool.kubernetes.clone().unwrap();
    assert!(build_job(&launch(&pool), &pool, &k).is_ok());
    pool.memory = None;
    assert!(matches!(
        build_job(&launch(&pool), &pool, &k),
        Err(BuildError::NoMemory { .. })
    ));
}

/// Where the manifests go: `TUNEQ_K8S_MANIFESTS_DIR`, else `k8s-manifests` in the cargo
/// target folder (`CARGO_TARGET_DIR`, else the workspace's `target`), as
/// `scripts/validate-k8s-manifests` looks for them.
fn manifests_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("TUNEQ_K8S_MANIFESTS_DIR") {
        return PathBuf::from(dir);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target"));
    target.join("k8s-manifests")
}

#[test]
fn manifests_are_written_for_the_validator() {
    let dir = manifests_dir();
    let negative = dir.join("negative");
    std::fs::create_dir_all(&negative).unwrap();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "json") {
            std::fs::remove_file(path).unwrap();
        }
    }
    let write = |path: PathBuf, value: &Value| {
        std::fs::write(&path, serde_json::to_string_pretty(value).unwrap()).unwrap();
    };
    let mut written = 0;
    for (file, pool, k) in example_pools() {
        let l = launch(&pool);
        let job = build_job(&l, &pool, &k).unwrap();
        let secret: Secret = build_secret(
            &l,
            &k.namespace,
            Some("0b1f0f0e-6e8a-4c5e-9d3b-6a1f9c2b7d10"),
        );
        let job = with_kind(serde_json::to_value(&job).unwrap(), "batch/v1", "Job");
        let secret = with_kind(serde_json::to_value(&secret).unwrap(), "v1", "Secret");
        write(dir.join(format!("{file}-{}-job.json", pool.name)), &job);
        write(
            dir.join(format!("{file}-{}-secret.json", pool.name)),
            &secret,
        );
        written += 2;
        if pool.name == "xeon" {
            // A typo the validator must catch: the script checks that this one fails.
            let mut typo = job.clone();
            let pod = &mut typo["spec"]["template"]["spec"];
            let grace = pod["terminationGracePeriodSeconds"].take();
            pod.as_object_mut()
                .unwrap()
                .remove("terminationGracePeriodSeconds");
            pod["terminationGracePeriodSecond"] = grace;
            write(negative.join("job-typo.json"), &typo);
        }
    }
    assert_eq!(written, 6);
}

/// `value`, checked to carry `apiVersion` and `kind` (k8s-openapi writes them from its
/// `Resource` impls; the validator picks its schema by them).
fn with_kind(value: Value, api_version: &str, kind: &str) -> Value {
    assert_eq!(value["apiVersion"], api_version, "{value}");
    assert_eq!(value["kind"], kind);
    value
}
