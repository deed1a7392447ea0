//! One conformance suite, run against every backend: a local folder, S3 (moto's
//! server) and GCS (fake-gcs-server), the servers started by the harness on free ports.

#![allow(clippy::unwrap_used, missing_docs)]

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use sha2::{Digest, Sha256};
use std::sync::Arc;
use std::time::Duration;
use tuneq_storage::testing::{self, TEST_BUCKET};
use tuneq_storage::{
    ByteStream, Error, GetRange, ObjectKey, ObjectStore, PresignMethod, PutMode, Result,
};

/// A store under a fresh prefix, plus whatever must live as long as it.
struct Fixture {
    store: Arc<dyn ObjectStore>,
    _dir: Option<tempfile::TempDir>,
}

async fn local(_name: &str) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    Fixture {
        store: Arc::new(tuneq_storage::LocalStore::new(dir.path())),
        _dir: Some(dir),
    }
}

async fn s3(name: &str) -> Fixture {
    s3_on(testing::moto(), name).await
}

/// SeaweedFS checks SigV4, so presigned URLs and every signed request are verified for real.
async fn seaweedfs(name: &str) -> Fixture {
    s3_on(testing::seaweedfs(), name).await
}

/// An S3 store on `server`, under a fresh prefix named after `name`.
async fn s3_on(server: &testing::TestServer, name: &str) -> Fixture {
    let store = tuneq_storage::s3::S3Store::connect(
        &testing::s3_config(server),
        TEST_BUCKET,
        &testing::unique_prefix(name),
    )
    .await
    .unwrap();
    Fixture {
        store: Arc::new(store),
        _dir: None,
    }
}

async fn gcs(name: &str) -> Fixture {
    let server = testing::fake_gcs();
    let dir = tempfile::tempdir().unwrap();
    let mut config = testing::gcs_config(server);
    config.credentials_file = Some(service_account_key(dir.path()));
    let store =
        tuneq_storage::gcs::GcsStore::connect(&config, TEST_BUCKET, &testing::unique_prefix(name))
            .await
            .unwrap();
    Fixture {
        store: Arc::new(store),
        _dir: Some(dir),
    }
}

/// A throwaway service-account key (RSA, PKCS#8) so GCS URLs can be signed in tests.
fn service_account_key(dir: &std::path::Path) -> std::path::PathBuf {
    let pem = dir.join("key.pem");
    let status = std::process::Command::new("openssl")
        .args([
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
            "-out",
        ])
        .arg(&pem)
        .stderr(std::process::Stdio::null())
        .status()
        .expect("openssl is needed to make a test service-account key (apt-get install openssl)");
    assert!(status.success());
    let key = serde_json::json!({
        "type": "service_account",
        "project_id": "tuneq-test",
        "private_key_id": "test-key",
        "private_key": std::fs::read_to_string(&pem).unwrap(),
        "client_email": "tuneq-test@tuneq-test.iam.gserviceaccount.com",
        "client_id": "1",
        "token_uri": "http://127.0.0.1:9/token",
    });
    let path = dir.join("service-account.json");
    std::fs::write(&path, key.to_string()).unwrap();
    path
}

fn key(k: &str) -> ObjectKey {
    ObjectKey::parse(k).unwrap()
}

/// Deterministic pseudo-random bytes, produced chunk by chunk, with their SHA-256.
fn pattern_stream(total: usize, chunk: usize) -> (ByteStream, String) {
    let mut hasher = Sha256::new();
    let mut chunks = Vec::new();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut left = total;
    while left > 0 {
        let n = left.min(chunk);
        let mut c = vec![0u8; n];
        for b in c.iter_mut() {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            *b = state as u8;
        }
        hasher.update(&c);
        chunks.push(Ok(Bytes::from(c)));
        left -= n;
    }
    (
        futures::stream::iter(chunks).boxed(),
        hex::encode(hasher.finalize()),
    )
}

async fn sha256_of(stream: ByteStream) -> (String, u64) {
    let mut hasher = Sha256::new();
    let mut n = 0u64;
    let mut stream = stream;
    while let Some(chunk) = stream.try_next().await.unwrap() {
        n += chunk.len() as u64;
        hasher.update(&chunk);
    }
    (hex::encode(hasher.finalize()), n)
}

async fn small_round_trip(store: Arc<dyn ObjectStore>) {
    let k = key("files/a.jsonl");
    let meta = store
        .put(&k, Bytes::from_static(b"hello"), PutMode::Overwrite)
        .await
        .unwrap();
    assert_eq!(meta.size, 5);
    assert_eq!(meta.key, k);
    assert!(meta.etag.is_some());
    assert_eq!(&store.get_bytes(&k).await.unwrap()[..], b"hello");
    let head = store.head(&k).await.unwrap();
    assert_eq!(head.size, 5);
    assert!(head.modified.is_some());
    // An empty object is an object too.
    let empty = key("files/empty");
    store
        .put(&empty, Bytes::new(), PutMode::Overwrite)
        .await
        .unwrap();
    assert_eq!(store.head(&empty).await.unwrap().size, 0);
    assert!(store.get_bytes(&empty).await.unwrap().is_empty());
}

async fn multi_part_round_trip(store: Arc<dyn ObjectStore>) {
    // 20 MiB in odd-sized chunks: more than two S3 parts / GCS resumable chunks.
    let k = key("big/object.bin");
    let (stream, digest) = pattern_stream(20 * 1024 * 1024 + 12_345, 1_000_003);
    let meta = store
        .put_stream(&k, stream, PutMode::Overwrite)
        .await
        .unwrap();
    assert_eq!(meta.size, 20 * 1024 * 1024 + 12_345);
    let got = store.get(&k, None).await.unwrap();
    assert_eq!(got.meta.size, meta.size);
    assert_eq!(sha256_of(got.body).await, (digest, meta.size));
}

async fn create_only_writes(store: Arc<dyn ObjectStore>) {
    let k = key("once/manifest.json");
    store
        .put(&k, Bytes::from_static(b"first"), PutMode::Create)
        .await
        .unwrap();
    let again = store
        .put(&k, Bytes::from_static(b"second"), PutMode::Create)
        .await;
    assert!(
        matches!(again, Err(Error::PreconditionFailed { .. })),
        "{again:?}"
    );
    assert_eq!(&store.get_bytes(&k).await.unwrap()[..], b"first");
}

async fn ranged_reads(store: Arc<dyn ObjectStore>) {
    let k = key("ranges/r.bin");
    let data: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
    store
        .put(&k, Bytes::from(data.clone()), PutMode::Overwrite)
        .await
        .unwrap();
    for (range, want) in [
        (GetRange::Bounded { start: 0, end: 10 }, &data[0..10]),
        (
            GetRange::Bounded {
                start: 990,
                end: 1000,
            },
            &data[990..],
        ),
        (
            GetRange::Bounded {
                start: 995,
                end: 5000,
            },
            &data[995..],
        ),
        (GetRange::From(500), &data[500..]),
        (GetRange::Bounded { start: 7, end: 7 }, &data[7..7]),
    ] {
        let got = store.get(&k, Some(range)).await.unwrap();
        assert_eq!(got.meta.size, 1000, "{range:?}: size is the whole object's");
        let bytes = tuneq_storage::collect(got.body).await.unwrap();
        assert_eq!(&bytes[..], want, "{range:?}");
    }
    let past = store.get(&k, Some(GetRange::From(1000))).await;
    assert!(
        matches!(past, Err(Error::InvalidRange { size: 1000, .. })),
        "{past:?}"
    );
}

async fn overwrite_replaces(store: Arc<dyn ObjectStore>) {
    let k = key("o/v");
    let first = store
        .put(&k, Bytes::from_static(b"one"), PutMode::Overwrite)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    let second = store
        .put(
            &k,
            Bytes::from_static(b"second version"),
            PutMode::Overwrite,
        )
        .await
        .unwrap();
    assert_eq!(&store.get_bytes(&k).await.unwrap()[..], b"second version");
    assert_eq!(second.size, 14);
    assert_ne!(first.etag, second.etag);
}

async fn delete_and_not_found(store: Arc<dyn ObjectStore>) {
    let k = key("d/x");
    store
        .put(&k, Bytes::from_static(b"x"), PutMode::Overwrite)
        .await
        .unwrap();
    store.delete(&k).await.unwrap();
    assert!(matches!(store.head(&k).await, Err(Error::NotFound { .. })));
    assert!(matches!(
        store.get(&k, None).await,
        Err(Error::NotFound { .. })
    ));
    // Deleting what is gone is not an error.
    store.delete(&k).await.unwrap();
    let missing = store.copy(&key("d/none"), &key("d/y")).await;
    assert!(
        matches!(missing, Err(Error::NotFound { .. })),
        "{missing:?}"
    );
}

async fn copy_inside_the_store(store: Arc<dyn ObjectStore>) {
    let (from, to) = (key("c/src.bin"), key("c/sub/dst.bin"));
    store
        .put(&from, Bytes::from_static(b"copy me"), PutMode::Overwrite)
        .await
        .unwrap();
    let meta = store.copy(&from, &to).await.unwrap();
    assert_eq!(meta.size, 7);
    assert_eq!(&store.get_bytes(&to).await.unwrap()[..], b"copy me");
    assert_eq!(&store.get_bytes(&from).await.unwrap()[..], b"copy me");
}

async fn listing_paginates_in_key_order(store: Arc<dyn ObjectStore>) {
    const N: usize = 1100;
    futures::stream::iter(0..N)
        .map(|i| {
            let store = store.clone();
            async move {
                store
                    .put(
                        &key(&format!("many/{i:05}")),
                        Bytes::from(i.to_string()),
                        PutMode::Overwrite,
                    )
                    .await
            }
        })
        .buffer_unordered(16)
        .try_collect::<Vec<_>>()
        .await
        .unwrap();
    // A sibling that shares the name's first characters is not "under" it.
    store
        .put(
            &key("many-not/x"),
            Bytes::from_static(b"x"),
            PutMode::Overwrite,
        )
        .await
        .unwrap();
    let listed: Vec<_> = store.list(&key("many")).try_collect().await.unwrap();
    assert_eq!(listed.len(), N);
    let names: Vec<String> = listed.iter().map(|m| m.key.to_string()).collect();
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(names, sorted);
    assert_eq!(names[0], "many/00000");
    assert_eq!(listed[N - 1].size, (N - 1).to_string().len() as u64);
    // The whole store lists everything, the sibling included.
    let all = store
        .list(&ObjectKey::root())
        .try_collect::<Vec<_>>()
        .await
        .unwrap();
    assert_eq!(all.len(), N + 1);
    assert!(store.list(&key("nothing-here")).next().await.is_none());
}

async fn failed_upload_leaves_nothing(store: Arc<dyn ObjectStore>) {
    // The producer fails after 10 MiB: the object must not appear, not even partly.
    let k = key("broken/upload.bin");
    let (good, _) = pattern_stream(10 * 1024 * 1024, 1024 * 1024);
    let failing = good
        .chain(futures::stream::once(async {
            Err(Error::Io {
                path: "producer".into(),
                source: std::io::Error::other("producer died"),
            })
        }))
        .boxed();
    assert!(
        store
            .put_stream(&k, failing, PutMode::Overwrite)
            .await
            .is_err()
    );
    assert!(matches!(store.head(&k).await, Err(Error::NotFound { .. })));
}

async fn manifest_commit_visibility(store: Arc<dyn ObjectStore>) {
    let prefix = key("jobs/j1/checkpoints/step-00000010");
    store
        .put(
            &prefix.join("adapter.safetensors").unwrap(),
            Bytes::from_static(b"w"),
            PutMode::Overwrite,
        )
        .await
        .unwrap();
    assert!(!store.is_committed(&prefix).await.unwrap());
    store
        .commit_manifest(&prefix, Bytes::from_static(br#"{"step":10}"#))
        .await
        .unwrap();
    assert!(store.is_committed(&prefix).await.unwrap());
    let keys: Vec<String> = store
        .list(&prefix)
        .map_ok(|m| m.key.file_name().to_string())
        .try_collect()
        .await
        .unwrap();
    assert_eq!(keys, ["adapter.safetensors", "manifest.json"]);
    assert!(
        !store
            .is_committed(&key("jobs/j1/checkpoints/step-00000020"))
            .await
            .unwrap()
    );
}

async fn presigned_put_then_get(store: Arc<dyn ObjectStore>) {
    let k = key("presigned/data.bin");
    let put = match store
        .presign(&k, PresignMethod::Put, Duration::from_secs(300))
        .await
    {
        Err(Error::Unsupported { .. }) if store.backend() == "local" => return,
        other => other.unwrap(),
    };
    let http = reqwest::Client::new();
    let mut req = http.put(&put.url).body("uploaded without credentials");
    for (name, value) in &put.headers {
        req = req.header(name, value);
    }
    let answer = req.send().await.unwrap();
    assert!(
        answer.status().is_success(),
        "{}: {}",
        answer.status(),
        answer.text().await.unwrap()
    );
    assert_eq!(
        &store.get_bytes(&k).await.unwrap()[..],
        b"uploaded without credentials"
    );
    let get = store
        .presign(&k, PresignMethod::Get, Duration::from_secs(300))
        .await
        .unwrap();
    let body = http.get(&get.url).send().await.unwrap();
    assert!(body.status().is_success());
    assert_eq!(
        &body.bytes().await.unwrap()[..],
        b"uploaded without credentials"
    );
}

async fn unsafe_keys_never_reach_a_backend(store: Arc<dyn ObjectStore>) {
    // Keys are built from checked segments only: traversal, separators smuggled inside a
    // segment and control characters are refused before any backend is called.
    for bad in [
        "../escape",
        "a/../../b",
        "a/./b",
        "a\\..\\b",
        "nul\0byte",
        "line\nbreak",
    ] {
        assert!(ObjectKey::parse(bad).is_err(), "{bad:?} must be refused");
    }
    for segment in ["", ".", "..", "a/b", "a\\b"] {
        assert!(ObjectKey::root().join(segment).is_err(), "{segment:?}");
    }
    // What a hostile-looking name becomes once checked stays under its own prefix:
    // leading and doubled slashes are dropped, never read as the store's root.
    let written = key("/tenant-a//files/y");
    assert_eq!(written.as_str(), "tenant-a/files/y");
    store
        .put(
            &key("tenant-a/files/x"),
            Bytes::from_static(b"x"),
            PutMode::Overwrite,
        )
        .await
        .unwrap();
    store
        .put(&written, Bytes::from_static(b"y"), PutMode::Overwrite)
        .await
        .unwrap();
    let mut all: Vec<String> = store
        .list(&ObjectKey::root())
        .map_ok(|m| m.key.to_string())
        .try_collect()
        .await
        .unwrap();
    all.sort();
    assert_eq!(all, ["tenant-a/files/x", "tenant-a/files/y"]);
    assert_eq!(&store.get_bytes(&written).await.unwrap()[..], b"y");
}

macro_rules! conformance {
    ($backend:ident) => {
        mod $backend {
            conformance!(@cases $backend:
                small_round_trip, multi_part_round_trip, create_only_writes, ranged_reads,
                overwrite_replaces, delete_and_not_found, copy_inside_the_store,
                listing_paginates_in_key_order, failed_upload_leaves_nothing,
                manifest_commit_visibility, presigned_put_then_get,
                unsafe_keys_never_reach_a_backend);
        }
    };
    (@cases $backend:ident: $($case:ident),*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let fixture = super::$backend(stringify!($case)).await;
                super::$case(fixture.store.clone()).await;
            }
        )*
    };
}

conformance!(local);
conformance!(s3);
conformance!(seaweedfs);
conformance!(gcs);

#[tokio::test]
async fn s3_errors_are_typed() -> Result<()> {
    let server = testing::moto();
    let store =
        tuneq_storage::s3::S3Store::connect(&testing::s3_config(server), "no-such-bucket-xyz", "")
            .await?;
    let err = store.head(&key("x")).await.unwrap_err();
    assert!(err.is_not_found(), "{err:?}");
    assert!(!err.is_retryable());
    Ok(())
}

/// Our V4 signer against Google's own: `google-cloud-storage` (Python) must produce the
/// same URL, signature included, for the same key, object, method and instant.
#[tokio::test]
async fn gcs_signed_urls_match_googles_python_client() {
    let server = testing::fake_gcs();
    let dir = tempfile::tempdir().unwrap();
    let key_file = service_account_key(dir.path());
    let mut config = testing::gcs_config(server);
    config.credentials_file = Some(key_file.clone());
    let prefix = testing::unique_prefix("signing");
    let store = tuneq_storage::gcs::GcsStore::connect(&config, TEST_BUCKET, &prefix)
        .await
        .unwrap();
    let object = key("data sets/train v1.jsonl");
    let now = std::time::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    for (method, verb) in [(PresignMethod::Get, "GET"), (PresignMethod::Put, "PUT")] {
        let ours = store
            .presign_at(&object, method, Duration::from_secs(900), now)
            .await
            .unwrap();
        let script = r#"
import datetime, sys, urllib.parse
from google.oauth2 import service_account
from google.cloud.storage._signing import generate_signed_url_v4
key, resource, endpoint, method = sys.argv[1:5]
creds = service_account.Credentials.from_service_account_file(key)
# Quoted the way google.cloud.storage.Blob.generate_signed_url quotes object names.
resource = urllib.parse.quote(resource, safe="/~")
print(generate_signed_url_v4(creds, resource=resource, expiration=datetime.timedelta(seconds=900),
      api_access_endpoint=endpoint, method=method, _request_timestamp="20231114T221320Z"))
"#;
        let python = testing::venv().join("bin/python");
        let out = std::process::Command::new(&python)
            .arg("-c")
            .arg(script)
            .arg(&key_file)
            .arg(format!("/{TEST_BUCKET}/{prefix}/{}", object.as_str()))
            .arg(&server.endpoint)
            .arg(verb)
            .output()
            .expect("the venv's python (scripts/setup-test-deps installs google-cloud-storage)");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let theirs = String::from_utf8_lossy(&out.stdout).trim().to_string();
        assert_eq!(ours.url, theirs, "{verb}");
    }
}

/// A store on SeaweedFS (which verifies SigV4) under a fresh prefix, signing with
/// `secret`; the test credentials' secret is `testing`.
async fn seaweedfs_signing_with(secret: &str, prefix: &str) -> tuneq_storage::s3::S3Store {
    let mut config = testing::s3_config(testing::seaweedfs());
    config.secret_access_key = Some(tuneq_storage::config::Secret::new(secret));
    tuneq_storage::s3::S3Store::connect(&config, TEST_BUCKET, prefix)
        .await
        .unwrap()
}

/// README: on SeaweedFS "a tampered presigned URL must get 403". A presigned URL works
/// as issued; changed in its object, its lifetime or its signature it is refused, and a
/// tampered PUT writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seaweedfs_refuses_tampered_presigned_urls() {
    let store = seaweedfs_signing_with("testing", &testing::unique_prefix("tamper")).await;
    for (name, body) in [("a.bin", "object a"), ("b.bin", "object b")] {
        store
            .put(&key(name), Bytes::from(body), PutMode::Overwrite)
            .await
            .unwrap();
    }
    let http = reqwest::Client::new();
    let get = store
        .presign(&key("a.bin"), PresignMethod::Get, Duration::from_secs(300))
        .await
        .unwrap();
    let answer = http.get(&get.url).send().await.unwrap();
    assert_eq!(answer.status(), 200, "the URL as issued works");
    assert_eq!(answer.text().await.unwrap(), "object a");

    // The signature is the last hex digits of `X-Amz-Signature`; flip its last one.
    let (signed, last) = get.url.split_at(get.url.len() - 1);
    let flipped = if last == "0" { "1" } else { "0" };
    let expires = get
        .url
        .split(['?', '&'])
        .find(|p| p.starts_with("X-Amz-Expires="))
        .unwrap()
        .to_string();
    for (what, url) in [
        ("another object", get.url.replacen("/a.bin?", "/b.bin?", 1)),
        (
            "a longer lifetime",
            get.url.replacen(&expires, "X-Amz-Expires=600", 1),
        ),
        ("another signature", format!("{signed}{flipped}")),
    ] {
        assert_ne!(url, get.url, "{what}: nothing was changed");
        let answer = http.get(&url).send().await.unwrap();
        let status = answer.status();
        let text = answer.text().await.unwrap();
        assert_eq!(status, 403, "{what}: {text}");
        assert!(!text.contains("object"), "{what}: the object was served");
    }

    let put = store
        .presign(&key("c.bin"), PresignMethod::Put, Duration::from_secs(300))
        .await
        .unwrap();
    let tampered = put.url.replacen("/c.bin?", "/d.bin?", 1);
    assert_ne!(tampered, put.url);
    let mut request = http.put(&tampered).body("smuggled");
    for (name, value) in &put.headers {
        request = request.header(name, value);
    }
    let answer = request.send().await.unwrap();
    assert_eq!(answer.status(), 403, "{}", answer.text().await.unwrap());
    for name in ["c.bin", "d.bin"] {
        let err = store.head(&key(name)).await.unwrap_err();
        assert!(err.is_not_found(), "{name} was written: {err:?}");
    }
}

/// README: on SeaweedFS "a wrong secret `PermissionDenied`": every operation signed with
/// the wrong secret is refused as such (never retried, never "not found"), and writes
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seaweedfs_refuses_a_wrong_secret_with_permission_denied() {
    let prefix = testing::unique_prefix("wrong-secret");
    let good = seaweedfs_signing_with("testing", &prefix).await;
    good.put(&key("there"), Bytes::from("x"), PutMode::Overwrite)
        .await
        .unwrap();
    let wrong = seaweedfs_signing_with("not-the-secret", &prefix).await;
    let refusals = [
        ("head", wrong.head(&key("there")).await.map(|_| ())),
        ("get", wrong.get_bytes(&key("there")).await.map(|_| ())),
        (
            "put",
            wrong
                .put(&key("new"), Bytes::from("y"), PutMode::Overwrite)
                .await
                .map(|_| ()),
        ),
        ("delete", wrong.delete(&key("there")).await.map(|_| ())),
        (
            "list",
            wrong
                .list(&ObjectKey::root())
                .try_collect::<Vec<_>>()
                .await
                .map(|_| ()),
        ),
    ];
    for (operation, result) in refusals {
        match result {
            Err(err @ Error::PermissionDenied { .. }) => {
                assert!(!err.is_retryable(), "{operation}: {err:?}")
            }
            other => panic!("{operation} with a wrong secret: {other:?}"),
        }
    }
    assert_eq!(&good.get_bytes(&key("there")).await.unwrap()[..], b"x");
    assert!(good.head(&key("new")).await.unwrap_err().is_not_found());
}
