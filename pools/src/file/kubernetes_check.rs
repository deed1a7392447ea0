//! The checks of a `[pool.kubernetes]` table: every string the attempt's Job hands to
//! the API server is checked by Kubernetes' own rules ([`crate::kube_syntax`]), so a
//! pool the cluster would refuse is refused when the file is read, with the field named.

use super::{
    KubernetesPool, MAX_TERMINATION_GRACE, NodeOperator, TolerationOperator, VolumeSource,
};
use crate::kube_syntax as k8s;
use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

/// The field of `key` in the map `map`, quoted as a TOML dotted key (`node_selector."a/b"`).
fn entry(map: &str, key: &str) -> String {
    format!("{map}.{key:?}")
}

/// Checks every key of `map` with `check_key` and every value with `check_value`.
fn check_map(
    name: &str,
    map: &BTreeMap<String, String>,
    check_key: fn(&str) -> k8s::Check,
    check_value: fn(&str) -> k8s::Check,
) -> Result<(), (String, String)> {
    for (key, value) in map {
        check_key(key).map_err(|e| (entry(name, key), format!("the key {e}")))?;
        check_value(value).map_err(|e| (entry(name, key), e))?;
    }
    Ok(())
}

fn any_value(_: &str) -> k8s::Check {
    Ok(())
}

impl KubernetesPool {
    /// Returns the field (below `kubernetes.`) and the problem of the first thing wrong.
    pub(super) fn check(&self) -> Result<(), (String, String)> {
        k8s::dns_label(&self.namespace).map_err(|e| ("namespace".to_string(), e))?;
        self.check_image()?;
        self.check_pod_fields()?;
        self.check_tolerations()?;
        self.check_affinity()?;
        self.check_env()?;
        self.check_volumes()?;
        self.check_durations()
    }

    /// The image: a valid reference with a pinned tag or digest.
    fn check_image(&self) -> Result<(), (String, String)> {
        if self.image.is_empty() || self.image.contains(char::is_whitespace) {
            return Err(("image".into(), "must be an image reference".into()));
        }
        k8s::image_reference(&self.image).map_err(|e| ("image".to_string(), e))?;
        if !k8s::image_pinned(&self.image) {
            return Err((
                "image".into(),
                format!(
                    "`{}` has no pinned tag; name a version or a digest (never `latest`), so every attempt of a job runs the same trainer",
                    self.image
                ),
            ));
        }
        Ok(())
    }

    /// The pod's service account, node selector and annotations, by Kubernetes' rules.
    fn check_pod_fields(&self) -> Result<(), (String, String)> {
        if let Some(sa) = &self.service_account {
            k8s::dns_subdomain(sa).map_err(|e| {
                (
                    "service_account".to_string(),
                    format!("not a ServiceAccount name: {e}"),
                )
            })?;
        }
        check_map(
            "node_selector",
            &self.node_selector,
            k8s::qualified_name,
            k8s::label_value,
        )?;
        check_map(
            "pod_annotations",
            &self.pod_annotations,
            k8s::annotation_key,
            any_value,
        )?;
        k8s::annotations_size(&self.pod_annotations).map_err(|e| ("pod_annotations".to_string(), e))
    }

    /// Each toleration: a valid key, and a value exactly when its operator takes one.
    fn check_tolerations(&self) -> Result<(), (String, String)> {
        for (i, t) in self.tolerations.iter().enumerate() {
            let at = |f: &str| format!("tolerations[{i}].{f}");
            if !t.key.is_empty() {
                k8s::qualified_name(&t.key).map_err(|e| (at("key"), e))?;
            }
            match t.operator {
                TolerationOperator::Exists if t.value.is_some() => {
                    return Err((
                        at("value"),
                        "a toleration with operator Exists takes no value".into(),
                    ));
                }
                TolerationOperator::Equal if t.key.is_empty() => {
                    return Err((
                        at("key"),
                        "a toleration with operator Equal needs a key".into(),
                    ));
                }
                TolerationOperator::Equal => {
                    k8s::label_value(t.value.as_deref().unwrap_or_default())
                        .map_err(|e| (at("value"), e))?;
                }
                TolerationOperator::Exists => {}
            }
        }
        Ok(())
    }

    /// Each node affinity rule: a valid key, as many values as its operator takes, and
    /// values a label (or, for `Gt`/`Lt`, an integer) can have.
    fn check_affinity(&self) -> Result<(), (String, String)> {
        for (i, r) in self.affinity.iter().enumerate() {
            let at = |f: &str| format!("affinity[{i}].{f}");
            k8s::qualified_name(&r.key).map_err(|e| (at("key"), e))?;
            let problem = match (r.operator, r.values.len()) {
                (NodeOperator::In | NodeOperator::NotIn, 0) => Some("needs values"),
                (NodeOperator::Exists | NodeOperator::DoesNotExist, n) if n > 0 => {
                    Some("takes no values")
                }
                (NodeOperator::Gt | NodeOperator::Lt, n) if n != 1 => {
                    Some("needs exactly one value")
                }
                _ => None,
            };
            if let Some(problem) = problem {
                return Err((at("values"), format!("operator {:?} {problem}", r.operator)));
            }
            for (j, value) in r.values.iter().enumerate() {
                let check = match r.operator {
                    NodeOperator::Gt | NodeOperator::Lt => k8s::integer,
                    // A value no label can have would never match a node.
                    _ => k8s::label_value,
                };
                check(value).map_err(|e| (format!("affinity[{i}].values[{j}]"), e))?;
            }
        }
        Ok(())
    }

    /// The extra environment: valid variable names, none of the launch contract's.
    fn check_env(&self) -> Result<(), (String, String)> {
        for name in self.env.keys() {
            let valid = !name.is_empty()
                && !name.starts_with(|c: char| c.is_ascii_digit())
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !valid {
                return Err((
                    format!("env.{name}"),
                    "not an environment variable name".into(),
                ));
            }
            if name.starts_with("TUNEQ_") {
                return Err((
                    format!("env.{name}"),
                    "names starting with TUNEQ_ belong to the launch contract".into(),
                ));
            }
        }
        Ok(())
    }

    /// The grace period within what spot nodes give, and timeouts that can end.
    fn check_durations(&self) -> Result<(), (String, String)> {
        if self.termination_grace > MAX_TERMINATION_GRACE {
            return Err((
                "termination_grace".into(),
                format!(
                    "at most {}s (GKE spot gives pods 15–25 s, at most 120 s)",
                    MAX_TERMINATION_GRACE.as_secs()
                ),
            ));
        }
        if self.platform_timeout.is_zero() {
            return Err((
                "platform_timeout".into(),
                "must be above zero (an image that cannot be pulled would hold the attempt until its deadline)".into(),
            ));
        }
        if self.placement_timeout.is_zero() || self.attempt_deadline < Duration::from_secs(60) {
            return Err((
                "attempt_deadline".into(),
                "placement_timeout must be above zero and attempt_deadline at least a minute"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Names unique DNS labels, mount paths absolute and unique, sources named as
    /// Kubernetes names them. Clashes with the runtime's own volumes are the dispatcher's
    /// to find (it builds the Job when it checks the file).
    fn check_volumes(&self) -> Result<(), (String, String)> {
        let mut names = HashSet::new();
        let mut paths = HashSet::new();
        for (i, v) in self.volumes.iter().enumerate() {
            let at = |f: &str| format!("volumes[{i}].{f}");
            k8s::dns_label(&v.name).map_err(|e| (at("name"), e))?;
            if v.name == "dshm" || !names.insert(&v.name) {
                return Err((
                    at("name"),
                    format!("`{}` must be unique (and not `dshm`)", v.name),
                ));
            }
            k8s::mount_path(&v.mount_path).map_err(|e| (at("mount_path"), e))?;
            if v.mount_path == "/dev/shm" {
                return Err((
                    at("mount_path"),
                    "must be an absolute path other than /dev/shm".into(),
                ));
            }
            if !paths.insert(v.mount_path.trim_end_matches('/')) {
                return Err((
                    at("mount_path"),
                    format!("another volume is mounted at `{}` already", v.mount_path),
                ));
            }
            let source = |f: &str| format!("volumes[{i}].source.{f}");
            match &v.source {
                VolumeSource::PersistentVolumeClaim { claim_name } => {
                    k8s::dns_subdomain(claim_name)
                        .map_err(|e| (source("persistent_volume_claim.claim_name"), e))
                }
                VolumeSource::ConfigMap { name } => {
                    k8s::dns_subdomain(name).map_err(|e| (source("config_map.name"), e))
                }
                VolumeSource::Secret { secret_name } => {
                    k8s::dns_subdomain(secret_name).map_err(|e| (source("secret.secret_name"), e))
                }
                VolumeSource::EmptyDir { .. } => Ok(()),
                VolumeSource::Csi { driver, .. } => {
                    k8s::csi_driver(driver).map_err(|e| (source("csi.driver"), e))
                }
            }?;
        }
        Ok(())
    }
}
