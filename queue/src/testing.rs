//! Redis for tests, from the workspace's test kit (`tuneq-testkit`): a real
//! `redis-server` on a free loopback port (shared per test process, or owned so a test
//! can kill and restart it) and a real three-node Redis Cluster. A missing binary is a
//! loud failure naming `scripts/setup-test-deps`, never a skip.

pub use tuneq_testkit::redis::{RedisCluster, RedisServer, shared, shared_cluster};

/// A scratch folder for a server under `target/test-servers`.
pub fn scratch_dir() -> std::path::PathBuf {
    tuneq_testkit::scratch_dir("redis")
}

/// A fresh domain name per test, so tests sharing a server never meet.
pub fn unique_domain(name: &str) -> String {
    format!("{name}-{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff)
}
