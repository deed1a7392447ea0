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
