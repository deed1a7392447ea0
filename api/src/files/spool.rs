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
    let mut file = spool_file(&state.config.spool_dir).map_err(spool_failed)?;
    let mut bytes = 0u64;
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk?;
        bytes += chunk.len() as u64;
        if bytes > limit.bytes {
            return Err(limit.exceeded());
        }
        file.write_all(&chunk).map_err(spool_failed)?;
    }
    Ok((file, bytes))
}

/// The answer to a spool file that cannot be made or written: 507 with `retry-after`
/// on a full disk, else an opaque 500; the cause, with the spool path, is only logged
/// (tenants never see server paths).
fn spool_failed(e: std::io::Error) -> ApiError {
    tracing::error!(error = %e, "cannot spool an upload");
    if e.kind() == std::io::ErrorKind::StorageFull {
        ApiError::storage_full("this upload")
    } else {
        ApiError::internal("cannot spool an upload")
    }
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_full_disk_is_507_with_retry_after_and_no_error_shows_the_spool_path() {
        let full = spool_failed(std::io::Error::from_raw_os_error(28));
        assert_eq!(full.status.as_u16(), 507);
        assert!(full.retry_after.is_some());
        assert_eq!(full.code(), Code::InsufficientStorage);
        let other = spool_failed(std::io::Error::other("open /var/lib/tuneq/spool/x: EIO"));
        assert_eq!(other.status.as_u16(), 500);
        for e in [full, other] {
            assert!(!e.detail.message.contains('/'), "{}", e.detail.message);
        }
    }

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
