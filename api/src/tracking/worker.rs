//! The tracker's background worker: sends metrics and run ends to the tracking server
//! one at a time, in the order they came, so requests never wait on it. Its queue is
//! bounded ([`QUEUED_TASKS`]); a task that does not fit is dropped with a warning, and
//! a task the server refuses or does not take is logged and not retried (a run misses
//! some points rather than the service holding them without bound).

use super::mlflow::{Metric, MlflowClient, RunEnd};
use tokio::sync::mpsc;
use tuneq_storage::ObjectKey;

/// Tasks waiting for the worker, at most.
const QUEUED_TASKS: usize = 1024;

/// What the worker does.
#[derive(Debug)]
pub(super) enum Task {
    /// Log metrics to a run.
    Log {
        run_id: String,
        metrics: Vec<Metric>,
    },
    /// Upload the adapter's files (name, store key) as artifacts, then end the run.
    End {
        run_id: String,
        end: RunEnd,
        adapter: Vec<(String, ObjectKey)>,
    },
}

/// The worker's queue.
#[derive(Debug, Clone)]
pub(super) struct Tasks(Option<mpsc::Sender<Task>>);

impl Tasks {
    /// Starts the worker on the current runtime (none: every task is dropped).
    pub(super) fn start(client: MlflowClient, store: StoreHandle) -> Self {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!("no async runtime: MLflow tracking is off");
            return Self(None);
        };
        let (sender, receiver) = mpsc::channel(QUEUED_TASKS);
        runtime.spawn(work(client, store, receiver));
        Self(Some(sender))
    }

    pub(super) fn send(&self, task: Task) {
        let Some(sender) = &self.0 else { return };
        if let Err(e) = sender.try_send(task) {
            tracing::warn!(error = %e, "the MLflow tracker is behind; a task is dropped");
        }
    }
}

/// Where the worker reads adapters from.
pub(super) type StoreHandle = std::sync::Arc<dyn tuneq_storage::ObjectStore>;

async fn work(client: MlflowClient, store: StoreHandle, mut tasks: mpsc::Receiver<Task>) {
    while let Some(task) = tasks.recv().await {
        match task {
            Task::Log { run_id, metrics } => {
                if let Err(e) = client.log(&run_id, &[], &metrics).await {
                    tracing::warn!(run = %run_id, error = %e, "cannot log metrics to MLflow");
                }
            }
            Task::End {
                run_id,
                end,
                adapter,
            } => {
                upload_adapter(&client, store.as_ref(), &run_id, &adapter).await;
                let ended = client.end_run(&run_id, end, super::now_millis()).await;
                match ended {
                    Ok(()) => tracing::info!(run = %run_id, ?end, "MLflow run ended"),
                    Err(e) => {
                        tracing::warn!(run = %run_id, error = %e, "cannot end an MLflow run")
                    }
                }
            }
        }
    }
}

/// Uploads the adapter's files as the run's artifacts under `adapter/`.
async fn upload_adapter(
    client: &MlflowClient,
    store: &dyn tuneq_storage::ObjectStore,
    run_id: &str,
    files: &[(String, ObjectKey)],
) {
    if files.is_empty() {
        return;
    }
    let root = match client.artifact_uri(run_id).await {
        Ok(root) => root,
        Err(e) => {
            tracing::warn!(run = %run_id, error = %e, "cannot find an MLflow run's artifacts");
            return;
        }
    };
    for (name, key) in files {
        let bytes = match store.get_bytes(key).await {
            Ok(bytes) => bytes.to_vec(),
            Err(e) => {
                tracing::warn!(run = %run_id, error = %e, "cannot read the adapter for MLflow");
                return;
            }
        };
        match client
            .upload_artifact(&root, &format!("adapter/{name}"), bytes)
            .await
        {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!(run = %run_id, root, "the MLflow server does not proxy this run's artifacts (start it with --serve-artifacts); the adapter is not uploaded");
                return;
            }
            Err(e) => {
                tracing::warn!(run = %run_id, error = %e, "cannot upload the adapter to MLflow");
                return;
            }
        }
    }
}
