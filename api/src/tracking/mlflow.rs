//! A client of MLflow's tracking REST API (`/api/2.0/mlflow/…`), the calls tuneq makes
//! and nothing more: find or create an experiment, create a run, log a batch of params
//! and metrics, end a run, and upload an artifact through the server's artifact proxy
//! (`mlflow server` serves artifacts by default).

use serde::Deserialize;
use serde_json::{Value, json};
use std::time::Duration;

/// How long one call to the tracking server may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// The most metrics one `log-batch` call carries (MLflow's limit is 1000).
pub(crate) const METRICS_PER_BATCH: usize = 1000;
/// The most params one `log-batch` call carries (MLflow's limit is 100).
pub(crate) const PARAMS_PER_BATCH: usize = 100;

/// The tracking server an operator named, and the token it wants (if any).
#[derive(Clone)]
pub struct MlflowServer {
    /// Its base URL (`http://mlflow:5000`).
    pub url: url::Url,
    /// Sent as `Authorization: Bearer …`; never logged.
    pub token: Option<String>,
}

impl std::fmt::Debug for MlflowServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MlflowServer")
            .field("url", &self.url.as_str())
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// Why a call to the tracking server failed (the detail is for the operator's log).
#[derive(Debug, thiserror::Error)]
pub(crate) enum MlflowError {
    /// The server could not be reached or did not answer in time.
    #[error("the MLflow tracking server did not answer: {0}")]
    Unreachable(#[source] reqwest::Error),
    /// The server answered with an error.
    #[error("the MLflow tracking server answered {status}: {code} {message}")]
    Refused {
        status: u16,
        /// MLflow's `error_code` (`RESOURCE_DOES_NOT_EXIST`, …).
        code: String,
        message: String,
    },
    /// The answer does not read as the API documents it.
    #[error("the MLflow tracking server's answer does not read: {0}")]
    Unreadable(String),
}

impl MlflowError {
    fn is(&self, error_code: &str) -> bool {
        matches!(self, Self::Refused { code, .. } if code == error_code)
    }
}

/// A run as created.
#[derive(Debug, Clone)]
pub(crate) struct CreatedRun {
    pub(crate) run_id: String,
}

/// One metric value at a step.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Metric {
    pub(crate) key: &'static str,
    pub(crate) value: f64,
    pub(crate) step: u64,
    /// Unix milliseconds.
    pub(crate) timestamp_ms: u64,
}

/// How a run ended, as MLflow names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RunEnd {
    Finished,
    Failed,
    Killed,
}

impl RunEnd {
    fn as_str(self) -> &'static str {
        match self {
            Self::Finished => "FINISHED",
            Self::Failed => "FAILED",
            Self::Killed => "KILLED",
        }
    }
}

/// Calls one tracking server.
#[derive(Debug, Clone)]
pub(crate) struct MlflowClient {
    server: MlflowServer,
    http: reqwest::Client,
}

impl MlflowClient {
    pub(crate) fn new(server: MlflowServer) -> Self {
        let http = reqwest::Client::builder()
            .timeout(CALL_TIMEOUT)
            // The operator's URL is called as given: no redirect elsewhere.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap_or_default();
        Self { server, http }
    }

    fn endpoint(&self, path: &str) -> String {
        format!("{}/{path}", self.server.url.as_str().trim_end_matches('/'))
    }

    fn authorised(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.server.token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    }

    /// The answer's JSON body (null when empty, as an artifact upload's is), or the
    /// error it reports.
    async fn answer(response: reqwest::Response) -> Result<Value, MlflowError> {
        let status = response.status();
        let bytes = response.bytes().await.map_err(MlflowError::Unreachable)?;
        let body: Value = if bytes.is_empty() {
            Value::Null
        } else {
            match serde_json::from_slice(&bytes) {
                Ok(body) => body,
                Err(e) if status.is_success() => {
                    return Err(MlflowError::Unreadable(e.to_string()));
                }
                Err(_) => Value::Null,
            }
        };
        if status.is_success() {
            return Ok(body);
        }
        let text = |field: &str| body[field].as_str().unwrap_or_default().to_string();
        Err(MlflowError::Refused {
            status: status.as_u16(),
            code: text("error_code"),
            message: text("message"),
        })
    }

    /// Sends `request` with the server's token and reads the answer.
    async fn send(&self, request: reqwest::RequestBuilder) -> Result<Value, MlflowError> {
        let response = self
            .authorised(request)
            .send()
            .await
            .map_err(MlflowError::Unreachable)?;
        Self::answer(response).await
    }

    async fn post(&self, path: &str, body: &Value) -> Result<Value, MlflowError> {
        self.send(self.http.post(self.endpoint(path)).json(body))
            .await
    }

    async fn get(&self, path: &str, query: &[(&str, &str)]) -> Result<Value, MlflowError> {
        self.send(self.http.get(self.endpoint(path)).query(query))
            .await
    }

    /// The id of the experiment named `name`, created when there is none.
    pub(crate) async fn experiment(&self, name: &str) -> Result<String, MlflowError> {
        #[derive(Deserialize)]
        struct Found {
            experiment: Experiment,
        }
        #[derive(Deserialize)]
        struct Experiment {
            experiment_id: String,
        }
        let found = self
            .get(
                "api/2.0/mlflow/experiments/get-by-name",
                &[("experiment_name", name)],
            )
            .await;
        match found {
            Ok(v) => return read::<Found>(v).map(|f| f.experiment.experiment_id),
            Err(e) if e.is("RESOURCE_DOES_NOT_EXIST") => {}
            Err(e) => return Err(e),
        }
        match self
            .post("api/2.0/mlflow/experiments/create", &json!({"name": name}))
            .await
        {
            Ok(v) => read::<Experiment>(v).map(|e| e.experiment_id),
            // Created meanwhile by someone else: read it again.
            Err(e) if e.is("RESOURCE_ALREADY_EXISTS") => {
                let v = self
                    .get(
                        "api/2.0/mlflow/experiments/get-by-name",
                        &[("experiment_name", name)],
                    )
                    .await?;
                read::<Found>(v).map(|f| f.experiment.experiment_id)
            }
            Err(e) => Err(e),
        }
    }

    /// Creates a run named `name` in experiment `experiment_id`, with `tags`.
    pub(crate) async fn create_run(
        &self,
        experiment_id: &str,
        name: &str,
        start_ms: u64,
        tags: &[(String, String)],
    ) -> Result<CreatedRun, MlflowError> {
        #[derive(Deserialize)]
        struct Created {
            run: Run,
        }
        #[derive(Deserialize)]
        struct Run {
            info: Info,
        }
        #[derive(Deserialize)]
        struct Info {
            run_id: String,
        }
        let tags: Vec<Value> = tags
            .iter()
            .map(|(k, v)| json!({"key": k, "value": v}))
            .collect();
        let body = json!({"experiment_id": experiment_id, "run_name": name,
            "start_time": start_ms, "tags": tags});
        let created = self.post("api/2.0/mlflow/runs/create", &body).await?;
        read::<Created>(created).map(|c| CreatedRun {
            run_id: c.run.info.run_id,
        })
    }

    /// Logs `params` and `metrics` to the run, in as many batches as MLflow's limits
    /// take. Logging a param again with the same value is allowed.
    pub(crate) async fn log(
        &self,
        run_id: &str,
        params: &[(String, String)],
        metrics: &[Metric],
    ) -> Result<(), MlflowError> {
        for chunk in params.chunks(PARAMS_PER_BATCH) {
            let params: Vec<Value> = chunk
                .iter()
                .map(|(k, v)| json!({"key": k, "value": v}))
                .collect();
            self.post(
                "api/2.0/mlflow/runs/log-batch",
                &json!({"run_id": run_id, "params": params}),
            )
            .await?;
        }
        for chunk in metrics.chunks(METRICS_PER_BATCH) {
            let metrics: Vec<Value> = chunk
                .iter()
                .map(|m| json!({"key": m.key, "value": m.value, "step": m.step, "timestamp": m.timestamp_ms}))
                .collect();
            self.post(
                "api/2.0/mlflow/runs/log-batch",
                &json!({"run_id": run_id, "metrics": metrics}),
            )
            .await?;
        }
        Ok(())
    }

    /// Ends the run.
    pub(crate) async fn end_run(
        &self,
        run_id: &str,
        end: RunEnd,
        end_ms: u64,
    ) -> Result<(), MlflowError> {
        self.post(
            "api/2.0/mlflow/runs/update",
            &json!({"run_id": run_id, "status": end.as_str(), "end_time": end_ms}),
        )
        .await
        .map(|_| ())
    }

    /// The run's artifact root, as the server reports it (`mlflow-artifacts:/…` when
    /// the server proxies artifacts).
    pub(crate) async fn artifact_uri(&self, run_id: &str) -> Result<String, MlflowError> {
        let run = self
            .get("api/2.0/mlflow/runs/get", &[("run_id", run_id)])
            .await?;
        run["run"]["info"]["artifact_uri"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| MlflowError::Unreadable("a run without artifact_uri".into()))
    }

    /// Uploads `bytes` as the artifact at `path` under `artifact_uri` through the
    /// server's artifact proxy. False when the run's artifacts are not proxied by the
    /// server (another artifact store the API cannot write to).
    pub(crate) async fn upload_artifact(
        &self,
        artifact_uri: &str,
        path: &str,
        bytes: Vec<u8>,
    ) -> Result<bool, MlflowError> {
        let Some(root) = artifact_uri.strip_prefix("mlflow-artifacts:") else {
            return Ok(false);
        };
        let root = root.trim_start_matches('/');
        let url = self.endpoint(&format!("api/2.0/mlflow-artifacts/artifacts/{root}/{path}"));
        self.send(self.http.put(url).body(bytes))
            .await
            .map(|_| true)
    }
}

fn read<T: serde::de::DeserializeOwned>(value: Value) -> Result<T, MlflowError> {
    serde_json::from_value(value).map_err(|e| MlflowError::Unreadable(e.to_string()))
}
