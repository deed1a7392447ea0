//! The crate diagram in `docs/architecture.md` is generated from `cargo metadata`: this
//! fails when the workspace's dependencies and the document drift. Regenerate with
//! `UPDATE_DOCS=1 cargo test --test crate_diagram` and commit the result.
//!
//! The diagram draws each workspace crate's normal dependencies on the other workspace
//! crates (optional ones dotted, labelled with the feature that turns them on);
//! dev-dependencies are not drawn but listed in one line under it.

use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The line before the generated part of the document.
const BEGIN: &str = "<!-- crate diagram: generated from `cargo metadata` by tests/crate_diagram.rs; \
                     regenerate with UPDATE_DOCS=1 cargo test --test crate_diagram -->";
/// The line after it.
const END: &str = "<!-- end of the generated crate diagram -->";

/// One workspace crate as the diagram shows it.
struct Crate {
    /// Its package name (`tuneq-queue`).
    package: String,
    /// Its mermaid node id (`queue`, `kube_fake`; `tuneq` for the root package).
    id: String,
    /// The label drawn: its folder (`queue/`), or `src/ (tuneq)` for the root package.
    label: String,
}

/// The workspace's metadata, without its registry dependencies.
fn metadata(root: &Path) -> Value {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| env!("CARGO").into());
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--manifest-path",
        ])
        .arg(root.join("Cargo.toml"))
        .output()
        .expect("run cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("cargo metadata prints JSON")
}

/// The workspace's crates, by package name.
fn crates(meta: &Value, root: &Path) -> Vec<Crate> {
    let mut crates: Vec<Crate> = meta["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .map(|p| {
            let package = p["name"].as_str().expect("name").to_string();
            let manifest = PathBuf::from(p["manifest_path"].as_str().expect("manifest_path"));
            let dir = manifest
                .parent()
                .and_then(|d| d.strip_prefix(root).ok())
                .map(|d| d.to_string_lossy().into_owned())
                .unwrap_or_default();
            if dir.is_empty() {
                Crate {
                    id: "tuneq".into(),
                    label: format!("src/ ({package})"),
                    package,
                }
            } else {
                Crate {
                    id: dir.replace(['-', '/'], "_"),
                    label: format!("{dir}/"),
                    package,
                }
            }
        })
        .collect();
    crates.sort_by(|a, b| a.label.cmp(&b.label));
    crates
}

/// The features of package `p` that turn on its optional dependency `dep`.
fn enabling_features(p: &Value, dep: &str) -> Vec<String> {
    let mut names: Vec<String> = p["features"]
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(_, enables)| {
            enables.as_array().into_iter().flatten().any(|e| {
                let e = e.as_str().unwrap_or_default();
                e == dep || e == format!("dep:{dep}") || e.starts_with(&format!("{dep}/"))
            })
        })
        .map(|(name, _)| name.clone())
        .collect();
    names.sort();
    names
}

/// The generated part of the document, markers included.
fn diagram(meta: &Value, root: &Path) -> String {
    let crates = crates(meta, root);
    let by_package = |name: &str| crates.iter().find(|c| c.package == name);
    let mut edges = BTreeSet::new();
    let mut dev_edges = BTreeSet::new();
    for p in meta["packages"].as_array().expect("packages") {
        let from = by_package(p["name"].as_str().expect("name")).expect("a workspace crate");
        for d in p["dependencies"].as_array().into_iter().flatten() {
            let Some(to) = by_package(d["name"].as_str().unwrap_or_default()) else {
                continue;
            };
            if to.package == from.package {
                continue;
            }
            let arrow = if d["optional"] == true {
                let features = enabling_features(p, &to.package).join(", ");
                format!("{} -.->|optional: {features}| {}", from.id, to.id)
            } else {
                format!("{} --> {}", from.id, to.id)
            };
            match d["kind"].as_str() {
                None | Some("normal") => {
                    edges.insert(arrow);
                }
                Some("dev") => {
                    dev_edges.insert((from.label.clone(), to.label.clone()));
                }
                _ => {}
            }
        }
    }
    // A dev-dependency on a crate it already depends on normally adds nothing to say.
    let normal: BTreeSet<(String, String)> = edges
        .iter()
        .filter_map(|e| {
            let (from, rest) = e.split_once(' ')?;
            let to = rest.rsplit(' ').next()?;
            let label = |id: &str| crates.iter().find(|c| c.id == id).map(|c| c.label.clone());
            Some((label(from)?, label(to)?))
        })
        .collect();
    let dev: Vec<String> = dev_edges
        .iter()
        .filter(|edge| !normal.contains(*edge))
        .map(|(from, to)| format!("`{from}` → `{to}`"))
        .collect();

    let mut out = format!("{BEGIN}\n\n```mermaid\ngraph TD\n");
    for c in &crates {
        out.push_str(&format!("    {}[\"{}\"]\n", c.id, c.label));
    }
    for e in &edges {
        out.push_str(&format!("    {e}\n"));
    }
    out.push_str("```\n\n");
    out.push_str(&format!(
        "Dev-dependencies (tests only) are not drawn: {}.\n\n{END}",
        dev.join(", ")
    ));
    out
}

#[test]
fn the_crate_diagram_matches_cargo_metadata() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let meta = metadata(&root);
    // cargo prints the root as the manifest's folder, which may differ from ours by links.
    let root = meta["workspace_root"]
        .as_str()
        .map(PathBuf::from)
        .unwrap_or(root);
    let generated = diagram(&meta, &root);
    let path = root.join("docs/architecture.md");
    let text = std::fs::read_to_string(&path).expect("read docs/architecture.md");
    let (Some(start), Some(end)) = (text.find(BEGIN), text.find(END)) else {
        panic!("docs/architecture.md has no crate diagram markers:\n{BEGIN}\n…\n{END}");
    };
    let current = &text[start..end + END.len()];
    if std::env::var_os("UPDATE_DOCS").is_some() {
        let updated = format!("{}{generated}{}", &text[..start], &text[end + END.len()..]);
        std::fs::write(&path, updated).expect("write docs/architecture.md");
        return;
    }
    assert!(
        current == generated,
        "docs/architecture.md's crate diagram is out of date with cargo metadata; regenerate it \
         with\n  UPDATE_DOCS=1 cargo test --test crate_diagram\nand commit the result\n\n\
         expected:\n{generated}"
    );
}
