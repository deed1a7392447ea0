//! A 200 MiB object streamed into and out of every backend, with the test process's
//! peak resident memory held under 100 MiB: puts and gets must stream, one part at a time.
//!
//! Alone in its own test binary so no other test's allocations count against the peak.

#![allow(clippy::unwrap_used, missing_docs)]

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use sha2::{Digest, Sha256};
use std::sync::Arc;
use tuneq_storage::testing::{self, TEST_BUCKET};
use tuneq_storage::{ByteStream, ObjectKey, ObjectStore, PutMode};

const SIZE: u64 = 200 * 1024 * 1024;
const CHUNK: usize = 1024 * 1024 + 17;
const PEAK_LIMIT_KIB: u64 = 100 * 1024;

/// Deterministic bytes generated lazily, chunk by chunk (never all in memory).
fn generated() -> ByteStream {
    futures::stream::unfold(
        (0u64, 0x2545_f491_4f6c_dd1du64),
        |(sent, mut state)| async move {
            if sent >= SIZE {
                return None;
            }
            let n = usize::try_from((SIZE - sent).min(CHUNK as u64)).unwrap();
            let mut chunk = vec![0u8; n];
            for b in chunk.iter_mut() {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                *b = state as u8;
            }
            Some((Ok(Bytes::from(chunk)), (sent + n as u64, state)))
        },
    )
    .boxed()
}

async fn digest(mut stream: ByteStream) -> (String, u64) {
    let mut h = Sha256::new();
    let mut n = 0;
    while let Some(c) = stream.try_next().await.unwrap() {
        n += c.len() as u64;
        h.update(&c);
    }
    (hex::encode(h.finalize()), n)
}

fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_mib_stream_through_every_backend_in_bounded_memory() {
    let want = digest(generated()).await;
    let dir = tempfile::tempdir().unwrap();
    let moto = testing::moto();
    let gcs = testing::fake_gcs();
    let stores: Vec<Arc<dyn ObjectStore>> = vec![
        Arc::new(tuneq_storage::LocalStore::new(dir.path())),
        Arc::new(
            tuneq_storage::s3::S3Store::connect(
                &testing::s3_config(moto),
                TEST_BUCKET,
                &testing::unique_prefix("large"),
            )
            .await
            .unwrap(),
        ),
        Arc::new(
            tuneq_storage::gcs::GcsStore::connect(
                &testing::gcs_config(gcs),
                TEST_BUCKET,
                &testing::unique_prefix("large"),
            )
            .await
            .unwrap(),
        ),
    ];
    let key = ObjectKey::parse("big/200mib.bin").unwrap();
    for store in stores {
        let started = std::time::Instant::now();
        let meta = store
            .put_stream(&key, generated(), PutMode::Overwrite)
            .await
            .unwrap();
        assert_eq!(meta.size, SIZE, "{}", store.backend());
        let got = store.get(&key, None).await.unwrap();
        assert_eq!(got.meta.size, SIZE);
        assert_eq!(digest(got.body).await, want, "{}", store.backend());
        store.delete(&key).await.unwrap();
        let peak = peak_rss_kib();
        eprintln!(
            "{}: 200 MiB up and down in {:.1}s, peak RSS so far {} MiB",
            store.backend(),
            started.elapsed().as_secs_f64(),
            peak / 1024
        );
        assert!(
            peak < PEAK_LIMIT_KIB,
            "{}: peak RSS {peak} KiB exceeds {PEAK_LIMIT_KIB} KiB",
            store.backend()
        );
    }
}
