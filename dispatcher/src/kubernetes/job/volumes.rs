//! The pod's volumes and the trainer's mounts: what the runtime adds (the attempt's
//! Secret, `/dev/shm`, `/tmp`, the cache) and the pool's own, checked for clashes.

use super::{ATTEMPT_DIR, BuildError, CACHE_DIR, DEFAULT_SHM, SPEC_KEY};
use k8s_openapi::api::core::v1::{
    CSIVolumeSource, ConfigMapVolumeSource, EmptyDirVolumeSource, KeyToPath,
    PersistentVolumeClaimVolumeSource, SecretVolumeSource, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use tuneq_pools::file::{Volume as PoolVolume, VolumeSource};
use tuneq_pools::{KubernetesPool, Pool};

/// The volumes the runtime adds itself; a pool's volumes may not take these names.
const VOLUME_ATTEMPT: &str = "tuneq-attempt";
const VOLUME_SHM: &str = "dshm";
const VOLUME_TMP: &str = "tuneq-tmp";
const VOLUME_CACHE: &str = "tuneq-cache";

/// The pod's volumes and the trainer's mounts: the attempt's Secret (spec only), `/dev/shm`
/// in memory, writable `/tmp` and cache, then the pool's own.
pub(super) fn volumes(
    pool: &Pool,
    k: &KubernetesPool,
    secret: &str,
) -> Result<(Vec<Volume>, Vec<VolumeMount>), BuildError> {
    let (mut volumes, mut mounts) = runtime_volumes(k, secret);
    for (index, v) in k.volumes.iter().enumerate() {
        check_pool_volume(pool, index, v, &volumes, &mounts)?;
        volumes.push(pool_volume(v));
        mounts.push(mount(&v.name, &v.mount_path, v.read_only));
    }
    Ok((volumes, mounts))
}

/// The volumes the runtime adds itself, with their mounts: the attempt's Secret (spec
/// only, read-only), `/dev/shm` in memory, a writable `/tmp`, and the cache unless the pool
/// mounts a volume of its own there.
fn runtime_volumes(k: &KubernetesPool, secret: &str) -> (Vec<Volume>, Vec<VolumeMount>) {
    let shm = k
        .shm_size
        .as_ref()
        .map_or(DEFAULT_SHM.to_string(), |m| m.0.as_str().to_string());
    let mut volumes = vec![
        Volume {
            name: VOLUME_ATTEMPT.to_string(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(secret.to_string()),
                // Only the spec: the credential reaches the trainer through its
                // environment, not as a file.
                items: Some(vec![KeyToPath {
                    key: SPEC_KEY.to_string(),
                    path: SPEC_KEY.to_string(),
                    mode: None,
                }]),
                default_mode: Some(0o440),
                optional: Some(false),
            }),
            ..Default::default()
        },
        Volume {
            name: VOLUME_SHM.to_string(),
            empty_dir: Some(empty_dir(Some("Memory"), Some(shm))),
            ..Default::default()
        },
        Volume {
            name: VOLUME_TMP.to_string(),
            empty_dir: Some(empty_dir(None, None)),
            ..Default::default()
        },
    ];
    let mut mounts = vec![
        mount(VOLUME_ATTEMPT, ATTEMPT_DIR, true),
        mount(VOLUME_SHM, "/dev/shm", false),
        mount(VOLUME_TMP, "/tmp", false),
    ];
    // A pool volume at the cache path (a shared model cache) replaces the emptyDir.
    if !k.volumes.iter().any(|v| v.mount_path == CACHE_DIR) {
        volumes.push(Volume {
            name: VOLUME_CACHE.to_string(),
            empty_dir: Some(empty_dir(None, None)),
            ..Default::default()
        });
        mounts.push(mount(VOLUME_CACHE, CACHE_DIR, false));
    }
    (volumes, mounts)
}

/// Refuses pool volume `index` when it takes a name or mount path already in `volumes`
/// and `mounts`, or mounts inside the read-only Secret volume.
fn check_pool_volume(
    pool: &Pool,
    index: usize,
    v: &PoolVolume,
    volumes: &[Volume],
    mounts: &[VolumeMount],
) -> Result<(), BuildError> {
    let clash = |what: &str| BuildError::VolumeClash {
        pool: pool.name.clone(),
        index,
        volume: v.name.clone(),
        what: what.to_string(),
    };
    if let Some(ours) = volumes.iter().find(|o| o.name == v.name) {
        return Err(clash(&format!("volume {}", ours.name)));
    }
    if let Some(ours) = mounts.iter().find(|m| m.mount_path == v.mount_path) {
        return Err(clash(&format!("mount path {}", ours.mount_path)));
    }
    // Nothing can be mounted inside the read-only Secret volume.
    if v.mount_path.starts_with(&format!("{ATTEMPT_DIR}/")) {
        return Err(clash(&format!("read-only mount path {ATTEMPT_DIR}")));
    }
    Ok(())
}

/// A pool's volume as the pod declares it, from its source.
fn pool_volume(v: &PoolVolume) -> Volume {
    let mut volume = Volume {
        name: v.name.clone(),
        ..Default::default()
    };
    match &v.source {
        VolumeSource::PersistentVolumeClaim { claim_name } => {
            volume.persistent_volume_claim = Some(PersistentVolumeClaimVolumeSource {
                claim_name: claim_name.clone(),
                read_only: v.read_only.then_some(true),
            });
        }
        VolumeSource::ConfigMap { name } => {
            volume.config_map = Some(ConfigMapVolumeSource {
                name: name.clone(),
                ..Default::default()
            });
        }
        VolumeSource::Secret { secret_name } => {
            volume.secret = Some(SecretVolumeSource {
                secret_name: Some(secret_name.clone()),
                ..Default::default()
            });
        }
        VolumeSource::EmptyDir { size_limit } => {
            volume.empty_dir = Some(empty_dir(
                None,
                size_limit.as_ref().map(|m| m.0.as_str().to_string()),
            ));
        }
        VolumeSource::Csi { driver, attributes } => {
            volume.csi = Some(CSIVolumeSource {
                driver: driver.clone(),
                read_only: v.read_only.then_some(true),
                volume_attributes: (!attributes.is_empty()).then(|| attributes.clone()),
                ..Default::default()
            });
        }
    }
    volume
}

/// An emptyDir on `medium` (the node's disk when none), capped at `size` when given.
fn empty_dir(medium: Option<&str>, size: Option<String>) -> EmptyDirVolumeSource {
    EmptyDirVolumeSource {
        medium: medium.map(str::to_string),
        size_limit: size.map(Quantity),
    }
}

/// The trainer's mount of volume `name` at `path` (`readOnly` written only when true).
fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: name.to_string(),
        mount_path: path.to_string(),
        read_only: read_only.then_some(true),
        ..Default::default()
    }
}
