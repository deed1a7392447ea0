//! The service process itself: private files, the open-file limit, the upload spool
//! left by a crash, and the async runtime.

use anyhow::{Context, Result};
use std::path::Path;

/// Files and folders this process (and the trainers it starts) creates are readable by
/// its user only: the queue file, datasets, checkpoints, adapters and keys. Also raises
/// the open-file limit (see [`raise_file_limit`]).
pub fn private_files() {
    rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o077));
    raise_file_limit();
}

/// Raises this process's open-file limit to the most it may have: each connection,
/// spool file and trainer log holds one, and the usual soft limit (1 024) is reached
/// long before the machine's. Logged when it cannot.
pub fn raise_file_limit() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current == limit.maximum {
        return;
    }
    limit.current = limit.maximum;
    if let Err(e) = setrlimit(Resource::Nofile, limit) {
        tracing::warn!(error = %e, "cannot raise the open-file limit");
    }
}

/// Makes `dir` (a data dir made before [`private_files`]) its owner's only.
pub fn make_private(dir: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("cannot make {} private", dir.display()))
}

/// Removes upload spool files that a crashed process left in `dir` (logged).
pub fn clean_spool(dir: &Path) {
    match tuneq_api::files::clean_spool(dir) {
        Ok(0) => {}
        Ok(bytes) => {
            tracing::info!(bytes, dir = %dir.display(), "removed the spool files of an earlier run")
        }
        Err(e) => tracing::warn!(error = %e, dir = %dir.display(), "cannot clean the upload spool"),
    }
}

/// A multi-threaded runtime for a service command.
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}
