//! The pools a service serves: from the pools file or the `--pool` shorthand.

use super::pair::pair;
use crate::cli::BadInput;
use anyhow::Result;
use std::path::Path;

/// The pools the service uses: the pools file when one is named, else the `--pool
/// NAME=HARDWARE` shorthand (local pools with `memory` bytes per attempt, when known).
pub fn load_pools(
    file: Option<&Path>,
    shorthand: &[String],
    memory: Option<u64>,
) -> Result<tuneq_pools::PoolsFile> {
    if let Some(path) = file {
        return tuneq_pools::PoolsFile::load(path).map_err(|e| BadInput(e.to_string()).into());
    }
    let pairs = shorthand
        .iter()
        .map(|p| pair(p, "--pool"))
        .collect::<Result<Vec<_>>>()?;
    tuneq_pools::PoolsFile::from_shorthand(&pairs, memory)
        .map_err(|e| BadInput(e.to_string()).into())
}

/// Refuses a pools file with a Kubernetes pool (of those `serves`) that the dispatcher
/// cannot build a Job for, such as a volume on the runtime's own paths, naming the file
/// (`shown`) and the field as the file's own errors do: found when the file is checked
/// or the dispatcher starts, not when a job first runs there.
pub fn check_kubernetes_pools(
    file: &tuneq_pools::PoolsFile,
    shown: &str,
    serves: impl Fn(&tuneq_pools::Pool) -> bool,
) -> Result<()> {
    for (i, pool) in file.pools.iter().enumerate().filter(|(_, p)| serves(p)) {
        if let Err(e) = tuneq_dispatcher::kubernetes::check_pool(pool) {
            return Err(BadInput(format!("{shown}: pool[{i}].{}: {e}", e.field())).into());
        }
    }
    Ok(())
}

/// The local pools of `pools` (the ones this process runs attempts for), or a clear
/// refusal naming those it cannot run.
pub fn local_pools(pools: &tuneq_pools::PoolsFile) -> Result<Vec<tuneq_pools::Pool>> {
    let (local, remote): (Vec<_>, Vec<_>) = pools
        .pools
        .iter()
        .cloned()
        .partition(|p| p.runtime == tuneq_pools::RuntimeKind::Local);
    if let Some(pool) = remote.first() {
        return Err(BadInput(format!(
            "pool `{}` has runtime = \"kubernetes\", which this build's dispatcher does not run yet; only local pools can be served",
            pool.name
        ))
        .into());
    }
    Ok(local)
}
