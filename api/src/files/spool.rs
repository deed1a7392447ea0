//! An upload on its way in: spooled to a private file named for this process (so a
//! crash's leftovers are recognised and removed at the next start), within the size
//! limit, and only while the tenant and the process have an upload slot free.

use crate::error::{ApiError, ApiResult, Code};
use crate::state::AppState;
use futures::StreamExt;
use std::io::Write;

use super::UploadLimit;

/// The answer to a body that broke off: too slow (408), or cut by the client (400).
pub(super) fn broke_off(e: &actix_web::error::PayloadError) -> ApiError {
    if crate::guard::is_body_timeout(e) {
        return crate::guard::body_timeout();
    }
    ApiError::invalid(
        "file",
        Code::UploadInterrupted,
        format!("The upload broke off: {e}"),
    )
}

/// [`broke_off`] for a form's field.
pub(super) fn field_broke_off(e: actix_multipart::MultipartError) -> ApiError {
    match e {
        actix_multipart::MultipartError::Payload(p) => broke_off(&p),
        other => ApiError::invalid("file", Code::InvalidMultipart, other.to_string()),
    }
}

/// Writes `chunks` to a new spool file, refusing more than `limit` bytes.
pub(super) async fn spool<S>(
    state: &AppState,
    limit: UploadLimit,
    mut chunks: S,
) -> ApiResult<(tempfile::NamedTempFile, u64)>
where
    S: futures::Stream<Item = Result<bytes::Bytes, ApiError>> + Unpin,
{
    let mut file = spool_file(&state.config.spool_dir)
        .map_err(|e| ApiError::internal(format!("cannot spool the upload: {e}")))?;
    let mut bytes = 0u64;
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk?;
        bytes += chunk.len() as u64;
        if bytes > limit.bytes {
            return Err(limit.exceeded());
        }
        file.write_all(&chunk)
            .map_err(|e| ApiError::internal(format!("cannot spool the upload: {e}")))?;
    }
    Ok((file, bytes))
}

/// What spool files of this process are named with: a file whose process is gone was
/// left by a crash, and [`clean_spool`] removes it.
fn spool_prefix(pid: u32) -> String {
    format!("tuneq-upload-{pid}-")
}

/// A new spool file in `dir`, readable by this user only.
pub(super) fn spool_file(dir: &std::path::Path) -> std::io::Result<tempfile::NamedTempFile> {
    use std::os::unix::fs::PermissionsExt;
    tempfile::Builder::new()
        .prefix(&spool_prefix(std::process::id()))
        .suffix(".jsonl")
        .permissions(std::fs::Permissions::from_mode(0o600))
        .tempfile_in(dir)
}

/// Removes the spool files in `dir` that processes no longer running left behind (a
/// crash or a kill in the middle of an upload), and returns how many bytes that freed.
/// Files of live processes (another API process may share the folder) are kept.
pub fn clean_spool(dir: &std::path::Path) -> std::io::Result<u64> {
    let mut freed = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("tuneq-upload-"))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        let alive =
            pid == std::process::id() || std::path::Path::new(&format!("/proc/{pid}")).exists();
        if alive {
            continue;
        }
        let bytes = entry.metadata().map(|m| m.len()).unwrap_or(0);
        match std::fs::remove_file(entry.path()) {
            Ok(()) => freed += bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(freed)
}

/// Uploads in progress, in the whole process and per tenant: each holds a connection, a
/// spool file and, while it is validated, a core. Beyond the bounds an upload is
/// answered 429 before its body is read.
pub(super) mod upload_slots {
    use crate::error::{ApiError, Code};
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};

    /// Uploads at once in one process.
    pub const PER_PROCESS: usize = 32;
    /// Uploads at once of one tenant.
    pub const PER_TENANT: usize = 4;
    /// `retry-after` when no slot is free.
    const RETRY_AFTER_S: u64 = 5;

    #[derive(Default)]
    struct Slots {
        total: usize,
        by_tenant: HashMap<String, usize>,
    }

    fn slots() -> &'static Mutex<Slots> {
        static SLOTS: OnceLock<Mutex<Slots>> = OnceLock::new();
        SLOTS.get_or_init(Default::default)
    }

    /// A slot held for one upload, given back when dropped.
    pub struct Slot(String);

    impl Drop for Slot {
        fn drop(&mut self) {
            if let Ok(mut s) = slots().lock() {
                s.total = s.total.saturating_sub(1);
                if let Some(n) = s.by_tenant.get_mut(&self.0) {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        s.by_tenant.remove(&self.0);
                    }
                }
            }
        }
    }

    /// How many uploads `tenant` has in progress (each holding a slot).
    pub fn held(tenant: &str) -> usize {
        slots()
            .lock()
            .map_or(0, |s| s.by_tenant.get(tenant).copied().unwrap_or(0))
    }

    /// A slot for `tenant`, or 429 when the tenant or the process has none free.
    pub fn take(tenant: &str) -> Result<Slot, ApiError> {
        let mut s = slots()
            .lock()
            .map_err(|_| ApiError::internal("upload slots are poisoned"))?;
        if s.total >= PER_PROCESS {
            return Err(ApiError::too_many(
                Code::TooManyUploads,
                format!(
                    "The server is receiving {PER_PROCESS} uploads already; try again shortly."
                ),
                RETRY_AFTER_S,
            ));
        }
        let mine = s.by_tenant.get(tenant).copied().unwrap_or(0);
        if mine >= PER_TENANT {
            return Err(ApiError::too_many(
                Code::TooManyUploads,
                format!(
                    "This tenant has {PER_TENANT} uploads in progress; wait for one to finish."
                ),
                RETRY_AFTER_S,
            ));
        }
        s.total += 1;
        s.by_tenant.insert(tenant.to_string(), mine + 1);
        Ok(Slot(tenant.to_string()))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn spool_files_of_dead_processes_are_removed_and_live_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        // A pid far above any pid_max is never a live process.
        let dead = dir.path().join("tuneq-upload-2147483646-abc.jsonl");
        std::fs::write(&dead, vec![0u8; 1000]).unwrap();
        let mine = spool_file(dir.path()).unwrap();
        let unrelated = dir.path().join("notes.txt");
        std::fs::write(&unrelated, "keep").unwrap();
        assert_eq!(clean_spool(dir.path()).unwrap(), 1000);
        assert!(!dead.exists());
        assert!(mine.path().exists());
        assert!(unrelated.exists());
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(mine.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}
