//! Placement rules as tables: which pools a job may use, in which order, what it would
//! cost, and when its next attempt moves on.
#![allow(clippy::unwrap_used, missing_docs)]

use std::time::Duration;
use tuneq_pools::memory::SCRATCH_PER_THREAD_BYTES;
use tuneq_pools::placement::{Needs, Refusal, Setback, choose, plan, usable};
use tuneq_pools::{PoolsFile, file::PlacementSettings};

/// Four pools: spot L4, on-demand L4, a big Xeon pool, a small CPU pool.
fn cluster() -> PoolsFile {
    PoolsFile::parse(
        r#"
[[pool]]
name = "cpu-small"
runtime = "local"
hardware = "cpu"
cpu = 2
memory = "4Gi"
price_per_hour = 0.1
tokens_per_second = 500

[[pool]]
name = "l4-on-demand"
runtime = "local"
hardware = "gpu"
accelerator_memory = "24Gi"
cpu = 8
memory = "32Gi"
price_per_hour = 0.85
tokens_per_second = 9000

[[pool]]
name = "xeon"
runtime = "local"
hardware = "cpu"
cpu = 32
memory = "128Gi"
price_per_hour = 1.6
tokens_per_second = 1500

[[pool]]
name = "l4-spot"
runtime = "local"
hardware = "gpu"
spot = true
accelerator_memory = "24Gi"
cpu = 8
memory = "32Gi"
price_per_hour = 0.32
tokens_per_second = 9000
"#,
        "cluster.toml",
    )
    .unwrap()
}

fn names(file: &PoolsFile, needs: &Needs<'_>) -> Result<Vec<String>, Refusal> {
    plan(file, needs, &|_| None).map(|c| c.iter().map(|c| c.pool.name.clone()).collect())
}

const GIB: u64 = 1 << 30;

#[test]
fn pools_are_chosen_by_class_and_memory_and_ordered_spot_gpu_price() {
    let file = cluster();
    let table: &[(&str, Option<u64>, &[&str])] = &[
        (
            "any",
            None,
            &["l4-spot", "l4-on-demand", "cpu-small", "xeon"],
        ),
        ("gpu", None, &["l4-spot", "l4-on-demand"]),
        ("spot-gpu", None, &["l4-spot"]),
        ("cpu", None, &["cpu-small", "xeon"]),
        // 10 GiB: too big for the small CPU pool.
        ("any", Some(10 * GIB), &["l4-spot", "l4-on-demand", "xeon"]),
        ("cpu", Some(10 * GIB), &["xeon"]),
        // 64 GiB: only the Xeon pool holds it.
        ("any", Some(64 * GIB), &["xeon"]),
        // The Xeon's 32 compute threads add 30 threads' scratch (180 MiB) to what the
        // estimate counts at 2 threads: 128 GiB less that still fits its 128 GiB.
        (
            "cpu",
            Some(128 * GIB - 30 * SCRATCH_PER_THREAD_BYTES),
            &["xeon"],
        ),
    ];
    for (class, memory, expected) in table {
        let needs = Needs {
            class,
            memory_bytes: *memory,
            ..Needs::default()
        };
        assert_eq!(
            names(&file, &needs).unwrap(),
            *expected,
            "{class} {memory:?}"
        );
    }
    // …and a MiB more does not.
    let needs = Needs {
        class: "cpu",
        memory_bytes: Some(128 * GIB - 30 * SCRATCH_PER_THREAD_BYTES + (1 << 20)),
        ..Needs::default()
    };
    assert!(
        matches!(names(&file, &needs), Err(Refusal::DoesNotFit { .. })),
        "{:?}",
        names(&file, &needs)
    );
}

#[test]
fn cpu_and_gpu_pools_are_held_to_their_own_estimates() {
    let file = cluster();
    // 20 GiB on the CPU (fused step), 30 GiB on a GPU (candle's graph): only Xeon.
    let needs = Needs {
        class: "any",
        memory_bytes: Some(20 * GIB),
        accelerator_memory_bytes: Some(30 * GIB),
        ..Needs::default()
    };
    assert_eq!(names(&file, &needs).unwrap(), ["xeon"]);
    // 2 GiB on the CPU, 20 GiB on a GPU: every pool.
    let needs = Needs {
        memory_bytes: Some(2 * GIB),
        accelerator_memory_bytes: Some(20 * GIB),
        ..needs
    };
    assert_eq!(names(&file, &needs).unwrap().len(), 4);
    // A GPU job too big for the L4s is refused with the GPU figure.
    let e = names(
        &file,
        &Needs {
            class: "gpu",
            memory_bytes: Some(GIB),
            accelerator_memory_bytes: Some(30 * GIB),
            ..Needs::default()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("30720 MiB"), "{e}");
}

#[test]
fn a_pool_of_two_gpus_per_attempt_holds_what_one_gpu_holds() {
    // The trainer trains on one device: two L4s per attempt do not make 48 GB.
    let file = PoolsFile::parse(
        r#"
[[pool]]
name = "two-l4"
runtime = "local"
hardware = "gpu"
accelerators = 2
accelerator_memory = "24Gi"
cpu = 16
memory = "64Gi"
"#,
        "two.toml",
    )
    .unwrap();
    let needs = |gib| Needs {
        class: "gpu",
        accelerator_memory_bytes: Some(gib * GIB),
        ..Needs::default()
    };
    assert_eq!(names(&file, &needs(20)).unwrap(), ["two-l4"]);
    assert!(matches!(
        names(&file, &needs(30)),
        Err(Refusal::DoesNotFit { .. })
    ));
}

#[test]
fn a_job_no_pool_can_hold_is_refused_with_the_numbers() {
    let file = cluster();
    let e = names(
        &file,
        &Needs {
            class: "gpu",
            memory_bytes: Some(30 * GIB),
            ..Needs::default()
        },
    )
    .unwrap_err();
    assert!(matches!(e, Refusal::DoesNotFit { .. }), "{e:?}");
    let message = e.to_string();
    assert!(
        message.contains("30720 MiB") && message.contains("24576 MiB"),
        "{message}"
    );
    let e = names(
        &file,
        &Needs {
            class: "tpu",
            ..Needs::default()
        },
    )
    .unwrap_err();
    assert_eq!(e.field(), "hardware");
    assert!(
        e.to_string()
            .ends_with("this service has: cpu, gpu, spot-gpu."),
        "{e}"
    );
}

#[test]
fn estimates_come_from_price_and_speed_and_max_cost_refuses_or_narrows() {
    let file = cluster();
    // 90 M tokens: 10 000 s on an L4 (2.78 h), 60 000 s on the Xeon pool.
    let needs = Needs {
        class: "any",
        memory_bytes: Some(10 * GIB),
        accelerator_memory_bytes: None,
        tokens: Some(90_000_000),
        max_cost: None,
    };
    let plan_ = plan(&file, &needs, &|_| None).unwrap();
    let spot = plan_[0].estimate.unwrap();
    assert!((spot.seconds - 10_000.0).abs() < 1e-6);
    assert!((spot.cost - 10_000.0 / 3600.0 * 0.32).abs() < 1e-9);
    // A measured speed replaces the file's figure.
    let measured = plan(&file, &needs, &|p| (p == "l4-spot").then_some(4500.0)).unwrap();
    assert!((measured[0].estimate.unwrap().seconds - 20_000.0).abs() < 1e-6);
    // max_cost 1.0 keeps the spot pool only (0.89); on-demand costs 2.36, Xeon 26.7.
    let within = names(
        &file,
        &Needs {
            max_cost: Some(1.0),
            ..needs.clone()
        },
    )
    .unwrap();
    assert_eq!(within, ["l4-spot"]);
    let e = names(
        &file,
        &Needs {
            max_cost: Some(0.5),
            ..needs
        },
    )
    .unwrap_err();
    assert!(matches!(e, Refusal::OverBudget { .. }), "{e:?}");
    assert_eq!(e.field(), "max_cost");
    assert!(e.to_string().contains("0.89 on l4-spot"), "{e}");
}

#[test]
fn repeated_preemptions_or_no_capacity_move_the_next_attempt_on() {
    let settings = PlacementSettings {
        preemptions_before_fallback: 2,
        preemption_window: Duration::from_secs(3600),
    };
    let list: Vec<String> = ["l4-spot", "l4-on-demand", "xeon"]
        .map(String::from)
        .to_vec();
    let hour = 3_600_000;
    let now = 10 * hour;
    let preempted = |pool: &str, ago: u64| Setback::Preempted {
        pool: pool.into(),
        at_ms: now - ago,
    };
    let table: Vec<(Vec<Setback>, &[&str])> = vec![
        (vec![], &["l4-spot", "l4-on-demand", "xeon"]),
        (
            vec![preempted("l4-spot", 60_000)],
            &["l4-spot", "l4-on-demand", "xeon"],
        ),
        (
            vec![preempted("l4-spot", 60_000), preempted("l4-spot", 120_000)],
            &["l4-on-demand", "xeon"],
        ),
        // The older one is outside the window.
        (
            vec![
                preempted("l4-spot", 2 * hour),
                preempted("l4-spot", 120_000),
            ],
            &["l4-spot", "l4-on-demand", "xeon"],
        ),
        (
            vec![Setback::NoCapacity {
                pool: "l4-spot".into(),
            }],
            &["l4-on-demand", "xeon"],
        ),
        // Everything avoided: the last pool stays, so the job can still wait somewhere.
        (
            vec![
                Setback::NoCapacity {
                    pool: "l4-spot".into(),
                },
                Setback::NoCapacity {
                    pool: "l4-on-demand".into(),
                },
                Setback::NoCapacity {
                    pool: "xeon".into(),
                },
            ],
            &["xeon"],
        ),
    ];
    for (setbacks, expected) in table {
        assert_eq!(
            usable(&list, &setbacks, &settings, now),
            expected,
            "{setbacks:?}"
        );
    }
    let free = |p: &str| u32::from(p != "l4-spot");
    assert_eq!(choose(&list, &free), Some("l4-on-demand"));
    assert_eq!(choose(&list, &|_| 0), None);
}
