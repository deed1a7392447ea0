//! Real storage servers for tests, from the workspace's test kit (`tuneq-testkit`):
//! moto's S3 server, SeaweedFS (which checks SigV4) and fake-gcs-server, each started
//! once per test process on free loopback ports and stopped when that process exits. A
//! missing server is a loud failure naming `scripts/setup-test-deps`, never a skip.
//! Tests share a server but use their own key prefix, so they never see each other's
//! objects. What is this crate's own: the settings that reach those servers.

pub use tuneq_testkit::{TEST_BUCKET, TestServer, fake_gcs, moto, seaweedfs, venv};

use crate::config::{GcsConfig, S3Config, Secret};

/// Settings that reach the moto server with static test credentials (moto accepts any).
pub fn s3_config(server: &TestServer) -> S3Config {
    S3Config {
        endpoint: Some(server.endpoint.clone()),
        region: Some("us-east-1".into()),
        force_path_style: Some(true),
        access_key_id: Some("testing".into()),
        secret_access_key: Some(Secret::new("testing")),
        ..S3Config::default()
    }
}

/// Settings that reach fake-gcs-server without credentials.
pub fn gcs_config(server: &TestServer) -> GcsConfig {
    GcsConfig {
        endpoint: Some(server.endpoint.clone()),
        anonymous: Some(true),
        ..GcsConfig::default()
    }
}

/// A fresh random prefix so tests sharing a bucket never see each other's objects.
pub fn unique_prefix(name: &str) -> String {
    format!("{name}-{:016x}", rand::random::<u64>())
}
