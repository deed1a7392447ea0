//! The trainer's error type.

use crate::data::DataError;

/// Errors from loading, training, exporting and generating.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tensor operation failed (shape mismatch, device error, …).
    #[error("tensor operation failed")]
    Candle(#[from] candle_core::Error),
    /// A file could not be read or written.
    #[error("i/o error on {path}")]
    Io {
        /// The file or folder.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A JSON file could not be parsed or did not have the expected shape.
    #[error("invalid JSON in {path}")]
    Json {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// A safetensors file could not be read or written.
    #[error("invalid safetensors file {path}: {message}")]
    Safetensors {
        /// The file.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// The base model folder is incomplete or inconsistent.
    #[error("model {path}: {message}")]
    Model {
        /// The model folder.
        path: String,
        /// What is missing or wrong.
        message: String,
    },
    /// A dataset or template problem (bad lines are listed inside).
    #[error(transparent)]
    Data(#[from] DataError),
    /// Several dataset files have problems; each lists its bad lines.
    #[error("{} dataset files are invalid: {}", .0.len(), .0.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))]
    Datasets(Vec<DataError>),
    /// The spec cannot be run (each problem names its field).
    #[error("invalid spec: {}", .0.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))]
    Spec(Vec<tuneq_openapi::SpecError>),
    /// Storage could not be reached or refused the operation.
    #[error(transparent)]
    Storage(#[from] tuneq_storage::Error),
    /// A checkpoint exists but does not match this run.
    #[error("checkpoint {path} cannot be resumed: {message}")]
    Checkpoint {
        /// The checkpoint folder.
        path: String,
        /// Why it does not fit.
        message: String,
    },
    /// The requested device is not available in this build or on this machine.
    #[error("device unavailable: {0}")]
    Device(String),
    /// Training produced a non-finite loss.
    #[error("loss became {loss} at step {step}; lower the learning rate")]
    Diverged {
        /// The optimiser step.
        step: u64,
        /// The loss value.
        loss: f64,
    },
}

impl Error {
    /// Whether the error is the user's input (spec, dataset, model files, a device this build
    /// or machine lacks): retrying unchanged cannot help; `tuneq train` exits 42 (the launch contract), other commands 2.
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            Error::Data(_)
                | Error::Datasets(_)
                | Error::Spec(_)
                | Error::Model { .. }
                | Error::Json { .. }
                // A weights file that does not read is as permanent as a config.json
                // that does not: retrying the same file cannot help.
                | Error::Safetensors { .. }
                | Error::Checkpoint { .. }
                | Error::Device(_)
                // The same data, settings and seed diverge again: retrying cannot help.
                | Error::Diverged { .. }
        ) || matches!(self, Error::Storage(e) if !e.is_retryable())
    }

    /// The class of job failure this error is: what `tuneq train` exits with and
    /// reports (the launch contract), so the dispatcher and the tenant never read it
    /// from the message.
    pub fn failure_class(&self) -> tuneq_openapi::FailureClass {
        use tuneq_openapi::FailureClass;
        match self {
            Error::Diverged { .. } => FailureClass::TrainingDiverged,
            _ if self.is_bad_input() => FailureClass::InvalidTrainingInput,
            _ => FailureClass::TrainingFailed,
        }
    }

    pub(crate) fn io(path: impl AsRef<std::path::Path>) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.as_ref().display().to_string();
        move |source| Error::Io { path, source }
    }
}

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Reads and parses a JSON file into `T`, naming the file in errors.
pub(crate) fn read_json<T: serde::de::DeserializeOwned>(path: &std::path::Path) -> Result<T> {
    let bytes = std::fs::read(path).map_err(Error::io(path))?;
    serde_json::from_slice(&bytes).map_err(|source| Error::Json {
        path: path.display().to_string(),
        source,
    })
}
