//! Which endpoint, region and credentials each backend uses.
//!
//! Settings left empty here fall back to what users of the official SDKs expect:
//! the standard AWS environment and profile files (`AWS_ENDPOINT_URL`, `AWS_REGION`,
//! `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`, `AWS_PROFILE`, web identity tokens,
//! SSO, instance and container roles) for S3, and `STORAGE_EMULATOR_HOST` plus
//! application-default credentials (`GOOGLE_APPLICATION_CREDENTIALS`, gcloud user
//! credentials, the metadata server / Workload Identity) for GCS. The same struct is
//! the `[storage]` table of tuneq's config file.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Settings for every backend.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StorageConfig {
    /// Folder that relative `file://` data lives under (`tuneq up` keeps its objects here).
    pub local_root: Option<PathBuf>,
    /// S3 and S3-compatible stores.
    pub s3: S3Config,
    /// Google Cloud Storage.
    pub gcs: GcsConfig,
}

/// S3 settings; every field is optional.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct S3Config {
    /// Endpoint override for S3-compatible stores (MinIO, SeaweedFS, Ceph, R2…).
    /// Default: `AWS_ENDPOINT_URL_S3`, then `AWS_ENDPOINT_URL`, then AWS itself.
    pub endpoint: Option<String>,
    /// Region. Default: `AWS_REGION` / the profile's region, then `us-east-1`.
    pub region: Option<String>,
    /// Address buckets as `endpoint/bucket/key` instead of `bucket.endpoint/key`.
    /// Default: on when an endpoint override is set (what S3-compatible stores need),
    /// off for AWS.
    pub force_path_style: Option<bool>,
    /// Named profile from `~/.aws/config`. Default: `AWS_PROFILE`, then `default`.
    pub profile: Option<String>,
    /// Static access key for S3-compatible stores that have no credential chain.
    /// Default: the standard chain (environment, profile, web identity, SSO, instance
    /// or container role), which is what AWS deployments should use.
    pub access_key_id: Option<String>,
    /// The secret for `access_key_id`. Never logged.
    pub secret_access_key: Option<Secret>,
    /// Objects at least this large are uploaded in parts of this size (bytes, ≥ 5 MiB).
    pub multipart_part_size: Option<usize>,
}

/// A secret string: serialises as itself, prints as `***` in logs and debug output.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret itself, for the one place that needs it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

/// GCS settings; every field is optional.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GcsConfig {
    /// Endpoint override, e.g. an emulator at `http://127.0.0.1:4443`. Default:
    /// `STORAGE_EMULATOR_HOST`, then `https://storage.googleapis.com`.
    pub endpoint: Option<String>,
    /// Send no credentials (emulators, public buckets). Default: on when an endpoint
    /// override or `STORAGE_EMULATOR_HOST` is set, otherwise application-default
    /// credentials are used.
    pub anonymous: Option<bool>,
    /// Service-account key file to use instead of application-default credentials;
    /// also what signs presigned URLs.
    pub credentials_file: Option<PathBuf>,
    /// Objects at least this large are uploaded with a resumable upload in chunks of
    /// this size (bytes, a multiple of 256 KiB).
    pub chunk_size: Option<usize>,
}

/// Reads an environment variable, treating empty as unset.
pub(crate) fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

impl S3Config {
    /// The endpoint override in force: the config's, else the standard AWS variables.
    pub fn effective_endpoint(&self) -> Option<String> {
        self.endpoint
            .clone()
            .or_else(|| env_var("AWS_ENDPOINT_URL_S3"))
            .or_else(|| env_var("AWS_ENDPOINT_URL"))
    }
}

impl GcsConfig {
    /// The endpoint in force and whether it is an override (emulator or private endpoint).
    pub fn effective_endpoint(&self) -> (String, bool) {
        if let Some(e) = &self.endpoint {
            return (e.trim_end_matches('/').to_string(), true);
        }
        if let Some(host) = env_var("STORAGE_EMULATOR_HOST") {
            let host = host.trim_end_matches('/');
            let url = if host.contains("://") {
                host.to_string()
            } else {
                format!("http://{host}")
            };
            return (url, true);
        }
        ("https://storage.googleapis.com".to_string(), false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_settings_are_refused() {
        let err = serde_json::from_str::<StorageConfig>(r#"{"s3":{"endpiont":"x"}}"#);
        assert!(err.is_err());
        let ok: StorageConfig =
            serde_json::from_str(r#"{"s3":{"endpoint":"http://127.0.0.1:9000"}}"#)
                .expect("valid config");
        assert_eq!(ok.s3.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
    }

    #[test]
    fn secrets_never_print() {
        let cfg = S3Config {
            secret_access_key: Some(Secret::new("hunter2")),
            ..S3Config::default()
        };
        assert!(!format!("{cfg:?}").contains("hunter2"));
    }

    #[test]
    fn explicit_gcs_endpoint_wins() {
        let cfg = GcsConfig {
            endpoint: Some("http://127.0.0.1:4443/".into()),
            ..GcsConfig::default()
        };
        assert_eq!(
            cfg.effective_endpoint(),
            ("http://127.0.0.1:4443".to_string(), true)
        );
    }
}
