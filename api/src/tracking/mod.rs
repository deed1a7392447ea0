//! Experiment tracking in an MLflow server the operator named
//! (`--mlflow-tracking-uri`): the [`Tracker`] opens a job's run, and a background worker
//! sends it each report's figures and, at the job's end, the adapter (as artifacts
//! under `adapter/`, through the server's artifact proxy) and the run's end.
//!
//! The worker keeps requests from ever waiting on the tracking server: a trainer's
//! report is answered whether or not its figures have reached MLflow. Its queue is
//! bounded, and what does not fit is dropped with a warning rather than held. What a
//! request may ask for, and the refusals, are the handlers' (`finetunes::integrations`).

pub(crate) mod mlflow;
mod worker;

pub use mlflow::MlflowServer;

use mlflow::{Metric, MlflowClient, MlflowError, RunEnd};
use std::collections::BTreeMap;
use tuneq_openapi::{JobStatus, MlflowRun, TrainEvent};

/// Now, in Unix milliseconds.
fn now_millis() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or_default()
}

/// Tracks jobs in one MLflow server: opens runs at create, hands metrics and ends to
/// a background worker.
#[derive(Debug, Clone)]
pub struct Tracker {
    client: MlflowClient,
    tasks: worker::Tasks,
}

impl Tracker {
    /// A tracker for `server` that reads adapters from `store`; its worker runs on the
    /// current Tokio runtime (without one, nothing is sent, which is logged).
    pub fn start(
        server: MlflowServer,
        store: std::sync::Arc<dyn tuneq_storage::ObjectStore>,
    ) -> Self {
        let client = MlflowClient::new(server);
        let tasks = worker::Tasks::start(client.clone(), store);
        Self { client, tasks }
    }

    /// Opens a run named `run_name` in the experiment `experiment_name` (created when
    /// the server has none by that name), with `tags` and the job's `params`.
    pub(crate) async fn open_run(
        &self,
        experiment_name: String,
        run_name: String,
        tags: BTreeMap<String, String>,
        extra_tags: &[(String, String)],
        params: &[(String, String)],
    ) -> Result<MlflowRun, MlflowError> {
        let experiment_id = self.client.experiment(&experiment_name).await?;
        let mut all_tags: Vec<(String, String)> = tags.clone().into_iter().collect();
        all_tags.extend_from_slice(extra_tags);
        let created = self
            .client
            .create_run(&experiment_id, &run_name, now_millis(), &all_tags)
            .await?;
        self.client.log(&created.run_id, params, &[]).await?;
        tracing::info!(run = %created.run_id, experiment = %experiment_name, "MLflow run opened");
        Ok(MlflowRun {
            experiment_name,
            experiment_id,
            run_id: created.run_id,
            run_name,
            tags,
        })
    }

    /// Sends the figures of a trainer's report to the job's runs.
    pub(crate) fn log(&self, runs: &[MlflowRun], events: &[TrainEvent]) {
        let metrics = metrics_of(events, now_millis());
        if metrics.is_empty() {
            return;
        }
        for run in runs {
            self.tasks.send(worker::Task::Log {
                run_id: run.run_id.clone(),
                metrics: metrics.clone(),
            });
        }
    }

    /// Ends the runs of job `job` of `tenant` as its `status` says; a succeeded job's
    /// adapter is uploaded first.
    pub(crate) fn end(&self, runs: &[MlflowRun], status: JobStatus, tenant: &str, job: &str) {
        let (end, adapter) = match status {
            JobStatus::Succeeded => (RunEnd::Finished, adapter_files(tenant, job)),
            JobStatus::Cancelled => (RunEnd::Killed, Vec::new()),
            _ => (RunEnd::Failed, Vec::new()),
        };
        for run in runs {
            self.tasks.send(worker::Task::End {
                run_id: run.run_id.clone(),
                end,
                adapter: adapter.clone(),
            });
        }
    }
}

/// The store keys of job `job`'s adapter files, with their names (none when the ids do
/// not read, which a stored job's never fail to).
fn adapter_files(tenant: &str, job: &str) -> Vec<(String, tuneq_storage::ObjectKey)> {
    use tuneq_storage::layout::{ADAPTER_FILES, Id, job_output};
    let (Ok(tenant), Ok(job)) = (Id::parse(tenant), Id::parse(job)) else {
        return Vec::new();
    };
    let output = job_output(&tenant, &job);
    ADAPTER_FILES
        .iter()
        .filter_map(|name| Some((name.to_string(), output.join(name).ok()?)))
        .collect()
}

/// The MLflow metrics of a report's events: each step's loss, accuracy, learning rate,
/// gradient norm and speed (and a DPO step's rewards), each validation's loss and
/// accuracy, named as OpenAI's result file and TRL name them.
fn metrics_of(events: &[TrainEvent], now_ms: u64) -> Vec<Metric> {
    let mut metrics = Vec::new();
    let mut put = |key: &'static str, value: f64, step: u64| {
        if value.is_finite() {
            metrics.push(Metric {
                key,
                value,
                step,
                timestamp_ms: now_ms,
            });
        }
    };
    for event in events {
        match event {
            TrainEvent::Step(m) => {
                put("train_loss", m.loss, m.step);
                put("learning_rate", m.lr, m.step);
                put("grad_norm", m.grad_norm, m.step);
                put("tokens_per_second", m.tokens_per_s, m.step);
                if let Some(accuracy) = m.token_accuracy {
                    put("train_mean_token_accuracy", accuracy, m.step);
                }
                if let Some(p) = &m.preference {
                    put("rewards/chosen", p.rewards_chosen, m.step);
                    put("rewards/rejected", p.rewards_rejected, m.step);
                    put("rewards/accuracies", p.rewards_accuracy, m.step);
                    put("rewards/margins", p.rewards_margin, m.step);
                }
            }
            TrainEvent::Eval {
                step,
                validation_loss,
                token_accuracy,
                ..
            } => {
                put("valid_loss", *validation_loss, *step);
                if let Some(accuracy) = token_accuracy {
                    put("valid_mean_token_accuracy", *accuracy, *step);
                }
            }
            _ => {}
        }
    }
    metrics
}

#[cfg(test)]
mod tests {
    use super::*;
    use tuneq_openapi::{PreferenceMetrics, StepMetrics};

    fn step(step: u64, loss: f64) -> TrainEvent {
        TrainEvent::Step(StepMetrics {
            step,
            total_steps: 10,
            epoch: 0,
            loss,
            lr: 1e-3,
            grad_norm: 0.5,
            tokens_per_s: 100.0,
            elapsed_s: 1.0,
            eta_s: 9.0,
            tokens_seen: 64,
            token_accuracy: Some(0.25),
            preference: None,
        })
    }

    #[test]
    fn a_reports_steps_and_validations_become_metrics_at_their_steps_and_nan_is_left_out() {
        let mut dpo = step(2, f64::NAN);
        if let TrainEvent::Step(m) = &mut dpo {
            m.token_accuracy = None;
            m.preference = Some(PreferenceMetrics {
                rewards_chosen: 0.1,
                rewards_rejected: -0.1,
                rewards_accuracy: 1.0,
                rewards_margin: 0.2,
                logps_chosen: -3.0,
                logps_rejected: -4.0,
            });
        }
        let events = [
            step(1, 2.0),
            dpo,
            TrainEvent::Eval {
                step: 2,
                validation_loss: 1.5,
                token_accuracy: Some(0.5),
            },
            TrainEvent::Warning {
                message: "ignored".into(),
            },
        ];
        let metrics = metrics_of(&events, 7);
        let at = |key: &str| -> Vec<(u64, f64)> {
            metrics
                .iter()
                .filter(|m| m.key == key)
                .map(|m| (m.step, m.value))
                .collect()
        };
        assert_eq!(at("train_loss"), [(1, 2.0)], "a NaN loss is not sent");
        assert_eq!(at("train_mean_token_accuracy"), [(1, 0.25)]);
        assert_eq!(at("learning_rate"), [(1, 1e-3), (2, 1e-3)]);
        assert_eq!(at("rewards/margins"), [(2, 0.2)]);
        assert_eq!(at("valid_loss"), [(2, 1.5)]);
        assert_eq!(at("valid_mean_token_accuracy"), [(2, 0.5)]);
        assert!(metrics.iter().all(|m| m.timestamp_ms == 7));
    }
}
