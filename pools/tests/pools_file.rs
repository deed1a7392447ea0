//! The pools file as users write it: the shipped examples parse, and every mistake is
//! refused with the file and the field named.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;
use std::time::Duration;
use tuneq_pools::{Hardware, PoolsFile, RuntimeKind};

fn example(name: &str) -> PoolsFile {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/pools")
        .join(name);
    PoolsFile::load(&path).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn the_shipped_examples_parse() {
    let gke = example("gke-spot-l4.toml");
    assert_eq!(gke.pools.len(), 2);
    let spot = gke.pool("l4-spot").unwrap();
    assert!(spot.spot);
    assert_eq!(spot.hardware, Hardware::Gpu);
    assert_eq!(spot.training_memory_bytes(), Some(24 << 30));
    let k = spot.kubernetes.as_ref().unwrap();
    assert_eq!(k.termination_grace, Duration::from_secs(25));
    assert_eq!(k.tolerations.len(), 2);
    assert_eq!(gke.placement.preemptions_before_fallback, 3);

    let xeon = example("xeon.toml");
    let pool = xeon.pool("xeon").unwrap();
    assert_eq!(pool.training_memory_bytes(), Some(128 << 30));
    assert_eq!(pool.cpu.millis(), 32_000);
    assert_eq!(pool.kubernetes.as_ref().unwrap().volumes.len(), 1);

    let local = example("local.toml");
    assert_eq!(local.pools[0].runtime, RuntimeKind::Local);
}

const GOOD: &str = r#"
[[pool]]
name = "l4"
runtime = "kubernetes"
hardware = "gpu"
accelerator_memory = "24Gi"
cpu = 8
memory = "32Gi"
[pool.kubernetes]
namespace = "tuneq"
image = "example.com/tuneq:0.1.0"
"#;

fn refused(text: &str) -> String {
    PoolsFile::parse(text, "pools.toml")
        .unwrap_err()
        .to_string()
}

#[test]
fn mistakes_are_refused_with_the_file_and_the_field() {
    assert!(PoolsFile::parse(GOOD, "pools.toml").is_ok());
    let cases: &[(&str, &str, &str)] = &[
        // (text replaced, replacement, expected in the message)
        ("cpu = 8", "cpu = 8\ncpus = 4", "unknown field `cpus`"),
        (
            "image = ",
            "imagee = \"x:1\"\nimage = ",
            "unknown field `imagee`",
        ),
        (
            "[pool.kubernetes]",
            "[pool.kubernetes]\ntolerations = [{ key = \"a\", effect = \"NoSchedul\" }]",
            "NoSchedul",
        ),
        (
            "memory = \"32Gi\"",
            "memory = \"32GB\"",
            "`32GB` is not a quantity",
        ),
        ("name = \"l4\"", "name = \"L4_pool\"", "pool[0].name"),
        (
            "accelerator_memory = \"24Gi\"\n",
            "",
            "pool[0].accelerator_memory",
        ),
        ("memory = \"32Gi\"\n", "", "pool[0].memory"),
        (
            "image = \"example.com/tuneq:0.1.0\"",
            "image = \"example.com/tuneq:latest\"",
            "pool[0].kubernetes.image",
        ),
        (
            "image = \"example.com/tuneq:0.1.0\"",
            "image = \"example.com/tuneq\"",
            "pinned tag",
        ),
        (
            "[pool.kubernetes]",
            "[pool.kubernetes]\nenv = { TUNEQ_REPORT_URL = \"x\" }",
            "pool[0].kubernetes.env.TUNEQ_REPORT_URL",
        ),
        (
            "[pool.kubernetes]",
            "[pool.kubernetes]\ntermination_grace = \"1h\"",
            "pool[0].kubernetes.termination_grace",
        ),
        (
            "[pool.kubernetes]",
            "[pool.kubernetes]\nplacement_timeout = \"soon\"",
            "`soon` is not a duration",
        ),
        (
            "[pool.kubernetes]",
            "[pool.kubernetes]\nplatform_timeout = \"0s\"",
            "pool[0].kubernetes.platform_timeout",
        ),
        (
            "runtime = \"kubernetes\"",
            "runtime = \"local\"",
            "pool[0].kubernetes",
        ),
        ("runtime = \"kubernetes\"", "runtime = \"slurm\"", "slurm"),
        (
            "[pool.kubernetes]",
            "[pool.kubernetes]\naffinity = [{ key = \"a\", operator = \"In\" }]",
            "pool[0].kubernetes.affinity[0].values",
        ),
    ];
    for (from, to, expected) in cases {
        assert!(GOOD.contains(from), "{from}");
        let message = refused(&GOOD.replacen(from, to, 1));
        assert!(message.starts_with("pools.toml: "), "{message}");
        assert!(message.contains(expected), "{expected}: {message}");
    }
    let twice = format!("{GOOD}{GOOD}");
    assert!(refused(&twice).contains("defined twice"));
    assert!(refused("").contains("defines no pool"));
    let missing = PoolsFile::load(Path::new("/nonexistent/pools.toml")).unwrap_err();
    assert!(
        missing.to_string().starts_with("/nonexistent/pools.toml: "),
        "{missing}"
    );
}

#[test]
fn the_pool_flag_shorthand_makes_local_pools() {
    let pairs = vec![
        ("cpu-pool".to_string(), "cpu".to_string()),
        ("l4-spot".to_string(), "spot-gpu".to_string()),
    ];
    let file = PoolsFile::from_shorthand(&pairs, Some(8 << 30)).unwrap();
    assert_eq!(file.pools[0].class(), "cpu");
    assert_eq!(file.pools[0].training_memory_bytes(), Some(8 << 30));
    // A GPU's own memory is not something the shorthand can say: not checked.
    assert_eq!(file.pools[1].class(), "spot-gpu");
    assert_eq!(file.pools[1].training_memory_bytes(), None);
    let unknown = PoolsFile::from_shorthand(&pairs, None).unwrap();
    assert_eq!(unknown.pools[0].training_memory_bytes(), None);
    let bad = PoolsFile::from_shorthand(&[("x".into(), "tpu".into())], None).unwrap_err();
    assert!(
        bad.to_string().contains("`tpu` is not a hardware class"),
        "{bad}"
    );
}

/// `GOOD` with `table` added to its `[pool.kubernetes]` table.
fn with_kubernetes(table: &str) -> String {
    GOOD.replacen(
        "[pool.kubernetes]",
        &format!("[pool.kubernetes]\n{table}"),
        1,
    )
}

#[test]
fn what_kubernetes_would_refuse_is_refused_with_the_field_named() {
    let digest_bad = "example.com/tuneq@sha256:xyz";
    let big = "x".repeat(300_000);
    let cases: Vec<(String, &str)> = vec![
        // (added to [pool.kubernetes], the field the message must name)
        // The probe's node_selector keys and values.
        (r#"node_selector = { "a/b/c" = "x" }"#.into(), r#"node_selector."a/b/c""#),
        (r#"node_selector = { "-bad" = "x" }"#.into(), r#"node_selector."-bad""#),
        (r#"node_selector = { "a:b" = "x" }"#.into(), r#"node_selector."a:b""#),
        (r#"node_selector = { a = "has space" }"#.into(), r#"node_selector."a""#),
        (r#"node_selector = { a = "ü" }"#.into(), r#"node_selector."a""#),
        // Toleration and affinity keys; a Gt that is no number.
        (r#"tolerations = [{ key = "a b", operator = "Exists" }]"#.into(), "tolerations[0].key"),
        (r#"tolerations = [{ key = "a", value = "has space" }]"#.into(), "tolerations[0].value"),
        (r#"affinity = [{ key = "a b", operator = "Exists" }]"#.into(), "affinity[0].key"),
        (r#"affinity = [{ key = "a", operator = "Gt", values = ["abc"] }]"#.into(), "affinity[0].values[0]"),
        (r#"affinity = [{ key = "a", operator = "Lt", values = ["1", "2"] }]"#.into(), "affinity[0].values"),
        // Volume sources named as Kubernetes never names them.
        (
            r#"volumes = [{ name = "v", mount_path = "/v", source = { config_map = { name = "A B" } } }]"#.into(),
            "volumes[0].source.config_map.name",
        ),
        (
            r#"volumes = [{ name = "v", mount_path = "/v", source = { persistent_volume_claim = { claim_name = "../x" } } }]"#.into(),
            "volumes[0].source.persistent_volume_claim.claim_name",
        ),
        (
            r#"volumes = [{ name = "v", mount_path = "/v", source = { secret = { secret_name = "UPPER" } } }]"#.into(),
            "volumes[0].source.secret.secret_name",
        ),
        (
            r#"volumes = [{ name = "v", mount_path = "/v", source = { csi = { driver = "a b" } } }]"#.into(),
            "volumes[0].source.csi.driver",
        ),
        (
            r#"volumes = [{ name = "V", mount_path = "/v", source = { empty_dir = {} } }]"#.into(),
            "volumes[0].name",
        ),
        // Mount paths: a `:`, and two volumes on one path.
        (
            r#"volumes = [{ name = "v", mount_path = "/a:b", source = { empty_dir = {} } }]"#.into(),
            "volumes[0].mount_path",
        ),
        (
            r#"volumes = [{ name = "v", mount_path = "/data", source = { empty_dir = {} } }, { name = "w", mount_path = "/data", source = { empty_dir = {} } }]"#.into(),
            "volumes[1].mount_path",
        ),
        // Annotations: too large in all, and a key that is no qualified name.
        (format!(r#"pod_annotations = {{ a = "{big}" }}"#), "pool[0].kubernetes.pod_annotations"),
        (r#"pod_annotations = { "UPPER_/x" = "1" }"#.into(), r#"pod_annotations."UPPER_/x""#),
        // A ServiceAccount with upper case.
        (r#"service_account = "Trainer""#.into(), "service_account"),
    ];
    for (table, field) in &cases {
        let message = refused(&with_kubernetes(table));
        assert!(
            message.starts_with("pools.toml: pool[0].kubernetes."),
            "{message}"
        );
        assert!(message.contains(field), "{field}: {message}");
    }
    // The probe's image with a digest that is none.
    let message = refused(&GOOD.replace("example.com/tuneq:0.1.0", digest_bad));
    assert!(message.contains("pool[0].kubernetes.image"), "{message}");
    assert!(message.contains("sha256"), "{message}");
    // A registry port is no tag.
    let message = refused(&GOOD.replace("example.com/tuneq:0.1.0", "example.com:5000/tuneq"));
    assert!(message.contains("pinned tag"), "{message}");
    // An annotation key is never reported as a node_selector one.
    let message = refused(&with_kubernetes(r#"pod_annotations = { "a b" = "1" }"#));
    assert!(!message.contains("node_selector"), "{message}");
}

#[test]
fn what_kubernetes_accepts_is_accepted() {
    let digest = format!("example.com/tuneq@sha256:{}", "ab".repeat(32));
    for table in [
        r#"node_selector = { "cloud.google.com/gke-spot" = "true", "tier" = "" }"#.to_string(),
        r#"pod_annotations = { "gke-gcsfuse/volumes" = "true", "Example.com/Note" = "any text at all" }"#.into(),
        r#"tolerations = [{ operator = "Exists" }, { key = "nvidia.com/gpu", value = "present", effect = "NoSchedule" }]"#.into(),
        r#"affinity = [{ key = "cloud.google.com/gke-spot", operator = "DoesNotExist" }, { key = "gpu-count", operator = "Gt", values = ["3"] }]"#.into(),
        r#"volumes = [{ name = "models", mount_path = "/var/cache/tuneq", read_only = true, source = { csi = { driver = "gcsfuse.csi.storage.gke.io", attributes = { bucketName = "b" } } } }]"#.into(),
        r#"service_account = "tuneq-trainer""#.into(),
    ] {
        let text = with_kubernetes(&table);
        if let Err(e) = PoolsFile::parse(&text, "pools.toml") {
            panic!("{table}: {e}");
        }
    }
    let text = GOOD.replace("example.com/tuneq:0.1.0", &digest);
    PoolsFile::parse(&text, "pools.toml").unwrap();
}
