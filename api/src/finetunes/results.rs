//! A succeeded job's result file: the step metrics its trainer wrote beside the adapter
//! (`step_metrics.csv`, OpenAI's columns), kept as one of the tenant's files of purpose
//! `fine-tune-results`, which `files.content` reads.

use crate::error::{ApiError, ApiResult};
use crate::records;
use crate::state::AppState;
use sha2::{Digest, Sha256};
use tuneq_openapi::{FileObject, FilePurpose, FileValidation};
use tuneq_storage::layout::{self, Id, RESULTS_CSV};

/// The id of the result file of the fine-tune `finetune`: derived from it, so that
/// keeping it again (a report sent twice) writes the same file.
pub(crate) fn file_id(finetune: &str) -> String {
    let digest = Sha256::digest(format!("results:{finetune}").as_bytes());
    format!("file-{}", &hex::encode(digest)[..24])
}

/// Keeps the run's `step_metrics.csv` (from the job's output in the store) as the
/// tenant's result file of `finetune`, of `steps` rows; its id, or None when the run
/// left no such file (a trainer from before it wrote one).
pub(crate) async fn keep(
    state: &AppState,
    tenant: &str,
    finetune: &str,
    steps: u64,
) -> ApiResult<Option<String>> {
    let ids = Id::parse(tenant).and_then(|t| Id::parse(finetune).map(|f| (t, f)));
    let (tenant_id, job) = ids.map_err(|_| ApiError::internal("job ids are not storage ids"))?;
    let from = layout::job_output(&tenant_id, &job)
        .join(RESULTS_CSV)
        .map_err(|e| ApiError::internal(e.to_string()))?;
    let id = file_id(finetune);
    let to = records::file::content_key(tenant, &id)?;
    let meta = match state.store.copy(&from, &to).await {
        Ok(meta) => meta,
        Err(e) if e.is_not_found() => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    if records::file::get(&state.queue, tenant, &id)
        .await?
        .is_none()
    {
        let file = FileObject {
            id: id.clone(),
            object: "file".into(),
            bytes: meta.size,
            created_at: records::now_seconds(),
            filename: RESULTS_CSV.into(),
            purpose: FilePurpose::FineTuneResults.as_str().into(),
            status: "processed".into(),
            validation: FileValidation {
                format: "csv".into(),
                examples: steps,
                characters: meta.size,
                tokens: None,
            },
        };
        records::file::create(&state.queue, tenant, &file).await?;
    }
    Ok(Some(id))
}
