//! The Google Cloud Storage backend, on GCS's JSON API with `google-cloud-auth` credentials.
//!
//! Why not the `google-cloud-storage` crate: its object listing, metadata, delete and
//! copy go through the gRPC `google.storage.v2` API, which no emulator speaks, and its
//! uploads cannot be exercised against one (single-shot uploads append a checksum part
//! that fake-gcs-server stores as data; resumable uploads stall after the session
//! starts). A backend we cannot test end to end is a backend we cannot ship, so this
//! one speaks the JSON API (the one `gsutil` and the Python client use) over `reqwest`,
//! and every code path runs against fake-gcs-server in the test suite. Credentials
//! (application-default, service-account keys, Workload Identity via the metadata
//! server) and URL signing come from the official `google-cloud-auth` crate.
//!
//! Objects smaller than one chunk go up in one media upload; larger ones use a
//! resumable upload, one chunk in memory at a time, resuming from the offset the
//! server confirms after a transient failure. Reads pin the generation they started
//! with, so a concurrent overwrite never mixes two versions in one stream.

use crate::config::GcsConfig;
use crate::retry::{RetryPolicy, error_for_status};
use crate::{
    ByteStream, Error, GetObject, GetRange, ObjectKey, ObjectMeta, ObjectStore, PartedUpload,
    PresignMethod, PresignedRequest, PutMode, Result, fill_past, full_key, list_prefix,
    relative_key,
};
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use futures::stream::{BoxStream, StreamExt, TryStreamExt};
use google_cloud_auth::credentials::{CacheableResource, Credentials};
use google_cloud_auth::signer::Signer;
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::time::{Duration, SystemTime};
use tokio::sync::OnceCell;

/// Default resumable-upload chunk (a multiple of 256 KiB, as GCS requires).
pub const DEFAULT_CHUNK_SIZE: usize = 8 * 1024 * 1024;
const CHUNK_GRANULE: usize = 256 * 1024;
const SCOPE: &str = "https://www.googleapis.com/auth/devstorage.read_write";
/// The longest a V4 signed URL may live.
const MAX_SIGNED_URL_LIFETIME: Duration = Duration::from_secs(7 * 24 * 3600);

/// Characters kept verbatim in URL path segments and query values (RFC 3986 unreserved).
const UNRESERVED: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

/// How requests are authorised.
#[derive(Clone)]
enum Auth {
    /// No credentials (emulators, public buckets).
    Anonymous,
    /// OAuth credentials from `google-cloud-auth`.
    Credentials(Credentials),
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Auth::Anonymous => "Anonymous",
            Auth::Credentials(_) => "Credentials(..)",
        })
    }
}

/// A bucket, optionally below a key prefix, on GCS or a GCS emulator.
#[derive(Debug)]
pub struct GcsStore {
    http: reqwest::Client,
    endpoint: String,
    bucket: String,
    prefix: String,
    auth: Auth,
    chunk_size: usize,
    retry: RetryPolicy,
    signing: SigningSource,
    signer: OnceCell<Signer>,
}

/// Where a URL signer comes from, built on first use.
#[derive(Debug, Clone)]
enum SigningSource {
    /// A service-account key file.
    KeyFile(std::path::PathBuf),
    /// Application-default credentials (service-account key, or the metadata server
    /// with IAM `signBlob`).
    ApplicationDefault,
    /// No credentials to sign with.
    None,
}

/// The parts of a GCS object resource tuneq reads.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct GcsObject {
    name: String,
    #[serde(default, deserialize_with = "u64_from_string")]
    size: u64,
    etag: Option<String>,
    updated: Option<String>,
    #[serde(default)]
    generation: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ObjectList {
    #[serde(default)]
    items: Vec<GcsObject>,
    next_page_token: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RewriteResponse {
    done: bool,
    rewrite_token: Option<String>,
}

/// GCS sends 64-bit integers as JSON strings.
fn u64_from_string<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<u64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Num {
        S(String),
        N(u64),
    }
    match Num::deserialize(d)? {
        Num::S(s) => s.parse().map_err(serde::de::Error::custom),
        Num::N(n) => Ok(n),
    }
}

fn transport_err(uri: &str, e: &reqwest::Error) -> Error {
    Error::Backend {
        uri: uri.to_string(),
        message: format!("request failed: {e}"),
        retryable: e.is_timeout() || e.is_connect() || e.is_request() || e.is_body(),
    }
}

/// Turns a non-success answer into a typed error, keeping GCS's message.
async fn status_err(uri: &str, response: reqwest::Response) -> Error {
    let status = response.status().as_u16();
    let body = response.text().await.unwrap_or_default();
    let message = serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| body.chars().take(300).collect());
    error_for_status(status, uri, message)
}

fn encode(s: &str) -> String {
    utf8_percent_encode(s, UNRESERVED).to_string()
}

fn modified(updated: Option<&str>) -> Option<SystemTime> {
    updated.and_then(|u| humantime::parse_rfc3339_weak(u).ok())
}

impl GcsStore {
    /// Connects with `config`, falling back to `STORAGE_EMULATOR_HOST` and
    /// application-default credentials for anything left unset.
    pub async fn connect(config: &GcsConfig, bucket: &str, prefix: &str) -> Result<Self> {
        let (endpoint, overridden) = config.effective_endpoint();
        url::Url::parse(&endpoint)
            .map_err(|e| Error::Config(format!("GCS endpoint {endpoint:?} is not a URL: {e}")))?;
        let anonymous = config.anonymous.unwrap_or(overridden);
        let auth = if anonymous {
            Auth::Anonymous
        } else if let Some(path) = &config.credentials_file {
            let key = read_key_file(path)?;
            let creds = google_cloud_auth::credentials::service_account::Builder::new(key)
                .with_access_specifier(
                    google_cloud_auth::credentials::service_account::AccessSpecifier::from_scopes(
                        [SCOPE],
                    ),
                )
                .build()
                .map_err(|e| Error::Config(format!("GCS credentials {}: {e}", path.display())))?;
            Auth::Credentials(creds)
        } else {
            let creds = google_cloud_auth::credentials::Builder::default()
                .with_scopes([SCOPE])
                .build()
                .map_err(|e| {
                    Error::Config(format!(
                        "GCS application-default credentials: {e} (set GOOGLE_APPLICATION_CREDENTIALS, \
                         run `gcloud auth application-default login`, or run on GCP with a service account)"
                    ))
                })?;
            Auth::Credentials(creds)
        };
        let signing = match (&config.credentials_file, anonymous) {
            (Some(path), _) => SigningSource::KeyFile(path.clone()),
            (None, false) => SigningSource::ApplicationDefault,
            (None, true) => SigningSource::None,
        };
        let chunk_size = config.chunk_size.unwrap_or(DEFAULT_CHUNK_SIZE);
        if chunk_size == 0 || !chunk_size.is_multiple_of(CHUNK_GRANULE) {
            return Err(Error::Config(format!(
                "gcs.chunk_size must be a positive multiple of {CHUNK_GRANULE} bytes"
            )));
        }
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| Error::Config(format!("HTTP client: {e}")))?;
        Ok(Self {
            http,
            endpoint,
            bucket: bucket.to_string(),
            prefix: prefix.trim_matches('/').to_string(),
            auth,
            chunk_size,
            retry: RetryPolicy::default(),
            signing,
            signer: OnceCell::new(),
        })
    }

    fn full(&self, key: &ObjectKey) -> String {
        full_key(&self.prefix, key)
    }

    fn object_url(&self, full: &str) -> String {
        format!(
            "{}/storage/v1/b/{}/o/{}",
            self.endpoint,
            encode(&self.bucket),
            encode(full)
        )
    }

    fn upload_url(&self) -> String {
        format!(
            "{}/upload/storage/v1/b/{}/o",
            self.endpoint,
            encode(&self.bucket)
        )
    }

    /// Adds the authorisation headers (none when anonymous).
    async fn authorise(&self, req: reqwest::RequestBuilder) -> Result<reqwest::RequestBuilder> {
        match &self.auth {
            Auth::Anonymous => Ok(req),
            Auth::Credentials(creds) => match creds.headers(http::Extensions::new()).await {
                Ok(CacheableResource::New { data, .. }) => Ok(req.headers(data)),
                Ok(CacheableResource::NotModified) => Ok(req),
                Err(e) => Err(Error::Backend {
                    uri: format!("gs://{}", self.bucket),
                    message: format!("fetching GCS credentials: {e}"),
                    retryable: e.is_transient(),
                }),
            },
        }
    }

    /// Sends a request built by `build` (rebuilt on each try), retrying transient failures.
    async fn send(
        &self,
        what: &str,
        uri: &str,
        build: impl Fn() -> reqwest::RequestBuilder,
    ) -> Result<reqwest::Response> {
        self.retry
            .run(what, || async {
                let response = self
                    .authorise(build())
                    .await?
                    .send()
                    .await
                    .map_err(|e| transport_err(uri, &e))?;
                if response.status().is_success() {
                    Ok(response)
                } else {
                    Err(status_err(uri, response).await)
                }
            })
            .await
    }

    async fn json<T: serde::de::DeserializeOwned>(
        uri: &str,
        response: reqwest::Response,
    ) -> Result<T> {
        let body = response.bytes().await.map_err(|e| transport_err(uri, &e))?;
        serde_json::from_slice(&body).map_err(|e| Error::Backend {
            uri: uri.to_string(),
            message: format!("unexpected GCS answer: {e}"),
            retryable: false,
        })
    }

    fn to_meta(&self, o: GcsObject) -> Result<ObjectMeta> {
        Ok(ObjectMeta {
            key: relative_key(&self.prefix, &o.name)?,
            size: o.size,
            etag: o.etag,
            modified: modified(o.updated.as_deref()),
        })
    }

    async fn object(&self, key: &ObjectKey) -> Result<GcsObject> {
        let uri = self.uri(key);
        let url = self.object_url(&self.full(key));
        let response = self
            .send("gcs.get_metadata", &uri, || self.http.get(&url))
            .await?;
        Self::json(&uri, response).await
    }

    /// Uploads one chunk at `offset`; returns the new offset. After a transient failure
    /// it asks the session how much arrived and sends only the rest.
    async fn put_chunk(
        &self,
        session: &str,
        uri: &str,
        offset: u64,
        chunk: Bytes,
        total: Option<u64>,
    ) -> Result<u64> {
        let end = offset + chunk.len() as u64;
        let mut sent_from = offset;
        let mut attempt = 0u32;
        loop {
            let data = chunk.slice(usize::try_from(sent_from - offset).unwrap_or(0)..);
            let total_str = total.map_or_else(|| "*".to_string(), |t| t.to_string());
            let range = if data.is_empty() {
                format!("bytes */{total_str}")
            } else {
                format!("bytes {sent_from}-{}/{total_str}", end - 1)
            };
            let req = self
                .authorise(
                    self.http
                        .put(session)
                        .header(reqwest::header::CONTENT_RANGE, range)
                        .body(data),
                )
                .await?;
            let outcome = match req.send().await {
                Ok(r) if r.status().is_success() => return Ok(end),
                Ok(r) if r.status().as_u16() == 308 => {
                    let confirmed = confirmed_end(&r);
                    if confirmed >= end {
                        return Ok(end);
                    }
                    // The server kept less than we sent: continue from what it has.
                    sent_from = confirmed.max(offset);
                    Ok(())
                }
                Ok(r) => Err(status_err(uri, r).await),
                Err(e) => Err(transport_err(uri, &e)),
            };
            if let Err(e) = outcome {
                if !e.is_retryable() || attempt + 1 >= self.retry.attempts {
                    return Err(e);
                }
                attempt += 1;
                tokio::time::sleep(self.retry.base * attempt).await;
                sent_from = self
                    .query_offset(session, uri, total)
                    .await?
                    .clamp(offset, end);
            }
        }
    }

    /// Asks a resumable session how many bytes it has persisted.
    async fn query_offset(&self, session: &str, uri: &str, total: Option<u64>) -> Result<u64> {
        let total_str = total.map_or_else(|| "*".to_string(), |t| t.to_string());
        let req = self
            .authorise(self.http.put(session).header(
                reqwest::header::CONTENT_RANGE,
                format!("bytes */{total_str}"),
            ))
            .await?;
        let response = req.send().await.map_err(|e| transport_err(uri, &e))?;
        match response.status().as_u16() {
            308 => Ok(confirmed_end(&response)),
            200 | 201 => Ok(total.unwrap_or(u64::MAX)),
            _ => Err(status_err(uri, response).await),
        }
    }

    /// A V4 signed URL as of `now` (what [`ObjectStore::presign`] does with the current
    /// time); a fixed instant makes signatures reproducible, e.g. to compare them with
    /// Google's own client libraries.
    pub async fn presign_at(
        &self,
        key: &ObjectKey,
        method: PresignMethod,
        expires_in: Duration,
        now: SystemTime,
    ) -> Result<PresignedRequest> {
        if expires_in.is_zero() || expires_in > MAX_SIGNED_URL_LIFETIME {
            return Err(Error::Config(format!(
                "GCS signed URLs live between 1 second and 7 days, not {expires_in:?}"
            )));
        }
        let signer = self.signer().await?;
        let sign_err = |e: &dyn std::fmt::Display| Error::Backend {
            uri: self.uri(key),
            message: format!("signing the URL: {e}"),
            retryable: false,
        };
        let email = signer.client_email().await.map_err(|e| sign_err(&e))?;
        let endpoint = url::Url::parse(&self.endpoint)
            .map_err(|e| Error::Config(format!("GCS endpoint: {e}")))?;
        let host = match (endpoint.host_str(), endpoint.port()) {
            (Some(h), Some(p)) => format!("{h}:{p}"),
            (Some(h), None) => h.to_string(),
            (None, _) => return Err(Error::Config("GCS endpoint has no host".into())),
        };
        let path = format!(
            "/{}/{}",
            encode(&self.bucket),
            self.full(key)
                .split('/')
                .map(encode)
                .collect::<Vec<_>>()
                .join("/")
        );
        let (date, datetime) = signing_dates(now);
        let credential = format!("{email}/{date}/auto/storage/goog4_request");
        let verb = match method {
            PresignMethod::Get => "GET",
            PresignMethod::Put => "PUT",
        };
        let (request, query) = canonical_request(
            verb,
            &host,
            &path,
            &credential,
            &datetime,
            expires_in.as_secs().max(1),
        );
        let string_to_sign = format!(
            "GOOG4-RSA-SHA256\n{datetime}\n{date}/auto/storage/goog4_request\n{}",
            hex::encode(Sha256::digest(request.as_bytes()))
        );
        let signature = signer
            .sign(string_to_sign.as_bytes())
            .await
            .map_err(|e| sign_err(&e))?;
        Ok(PresignedRequest {
            method,
            url: format!(
                "{}://{host}{path}?{query}&X-Goog-Signature={}",
                endpoint.scheme(),
                hex::encode(signature)
            ),
            headers: Vec::new(),
            expires_at: now + expires_in,
        })
    }

    async fn signer(&self) -> Result<&Signer> {
        self.signer
            .get_or_try_init(|| async {
                let unsupported = |reason: String| Error::Unsupported {
                    operation: "presigned URLs",
                    backend: "GCS",
                    reason,
                };
                match &self.signing {
                    SigningSource::None => Err(unsupported(
                        "no credentials to sign with; set gcs.credentials_file to a service-account key".into(),
                    )),
                    SigningSource::KeyFile(path) => {
                        let key = read_key_file(path)?;
                        google_cloud_auth::credentials::service_account::Builder::new(key)
                            .build_signer()
                            .map_err(|e| unsupported(format!("{}: {e}", path.display())))
                    }
                    SigningSource::ApplicationDefault => {
                        google_cloud_auth::credentials::Builder::default()
                            .build_signer()
                            .map_err(|e| {
                                unsupported(format!(
                                    "the application-default credentials cannot sign ({e}); use a service account"
                                ))
                            })
                    }
                }
            })
            .await
    }
}

/// The end (exclusive) of what a `308` says the session holds, from `Range: bytes=0-N`.
fn confirmed_end(response: &reqwest::Response) -> u64 {
    response
        .headers()
        .get(reqwest::header::RANGE)
        .and_then(|v| v.to_str().ok())
        .and_then(|r| r.rsplit('-').next())
        .and_then(|n| n.trim().parse::<u64>().ok())
        .map_or(0, |last| last + 1)
}

fn read_key_file(path: &std::path::Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(Error::io(path.display()))?;
    serde_json::from_str(&text)
        .map_err(|e| Error::Config(format!("{} is not a JSON key file: {e}", path.display())))
}

/// `YYYYMMDD` and `YYYYMMDDTHHMMSSZ` for a UTC instant.
fn signing_dates(now: SystemTime) -> (String, String) {
    let stamp: String = humantime::format_rfc3339_seconds(now)
        .to_string()
        .chars()
        .filter(|c| *c != '-' && *c != ':')
        .collect();
    (stamp[..8].to_string(), stamp)
}

/// The V4 canonical request and its query string, per GCS's signing spec.
fn canonical_request(
    method: &str,
    host: &str,
    path: &str,
    credential: &str,
    datetime: &str,
    expires: u64,
) -> (String, String) {
    let mut query = [
        ("X-Goog-Algorithm", "GOOG4-RSA-SHA256".to_string()),
        ("X-Goog-Credential", credential.to_string()),
        ("X-Goog-Date", datetime.to_string()),
        ("X-Goog-Expires", expires.to_string()),
        ("X-Goog-SignedHeaders", "host".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| format!("{}={}", encode(k), encode(&v)))
    .collect::<Vec<_>>();
    query.sort();
    let query = query.join("&");
    let request = format!("{method}\n{path}\n{query}\nhost:{host}\n\nhost\nUNSIGNED-PAYLOAD");
    (request, query)
}

#[async_trait]
impl PartedUpload for GcsStore {
    fn part_size(&self) -> usize {
        self.chunk_size
    }

    /// Uploads a small object in one multipart (metadata + media) request, the upload
    /// type on which GCS and its emulators both honour `ifGenerationMatch`.
    async fn put_single(&self, key: &ObjectKey, data: Bytes, mode: PutMode) -> Result<()> {
        let uri = self.uri(key);
        let url = self.upload_url();
        let name = self.full(key);
        let boundary = format!("tuneq-{:032x}", rand::random::<u128>());
        let metadata = serde_json::json!({ "name": name }).to_string();
        let mut body = Vec::with_capacity(data.len() + metadata.len() + 256);
        body.extend_from_slice(
            format!(
                "--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n{metadata}\r\n\
                 --{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n"
            )
            .as_bytes(),
        );
        body.extend_from_slice(&data);
        body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
        let body = Bytes::from(body);
        self.send("gcs.upload", &uri, || {
            let mut query = vec![("uploadType", "multipart")];
            if mode == PutMode::Create {
                query.push(("ifGenerationMatch", "0"));
            }
            self.http
                .post(&url)
                .query(&query)
                .header(
                    reqwest::header::CONTENT_TYPE,
                    format!("multipart/related; boundary={boundary}"),
                )
                .body(body.clone())
        })
        .await?;
        Ok(())
    }

    /// Streams `buf` and the rest of `body` through a resumable upload session.
    async fn put_parts(
        &self,
        key: &ObjectKey,
        body: &mut ByteStream,
        buf: &mut BytesMut,
        mode: PutMode,
    ) -> Result<()> {
        let uri = self.uri(key);
        let url = self.upload_url();
        let name = self.full(key);
        let started = self
            .send("gcs.start_resumable", &uri, || {
                let mut query = vec![("uploadType", "resumable"), ("name", name.as_str())];
                if mode == PutMode::Create {
                    query.push(("ifGenerationMatch", "0"));
                }
                self.http
                    .post(&url)
                    .query(&query)
                    .header("x-upload-content-type", "application/octet-stream")
                    .json(&serde_json::json!({ "name": name }))
            })
            .await?;
        let session = started
            .headers()
            .get(reqwest::header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
            .ok_or_else(|| Error::Backend {
                uri: uri.clone(),
                message: "resumable upload started without a session URL".into(),
                retryable: false,
            })?;
        let uploaded = async {
            let mut offset: u64 = 0;
            let mut ended = false;
            loop {
                if !ended {
                    ended = fill_past(body, buf, self.chunk_size).await?;
                }
                // Send whole chunks while more data follows; the last piece carries the total.
                let last = ended && buf.len() <= self.chunk_size;
                let take = if last { buf.len() } else { self.chunk_size };
                let chunk = buf.split_to(take).freeze();
                let total = last.then_some(offset + chunk.len() as u64);
                offset = self.put_chunk(&session, &uri, offset, chunk, total).await?;
                if last {
                    return Ok(());
                }
            }
        }
        .await;
        if uploaded.is_err() {
            // Nothing was committed; cancel the session rather than leave it for GCS's
            // one-week expiry. Best effort: the upload's own error is what matters.
            if let Ok(req) = self.authorise(self.http.delete(&session)).await {
                let _ = req.send().await;
            }
        }
        uploaded
    }
}

#[async_trait]
impl ObjectStore for GcsStore {
    fn backend(&self) -> &'static str {
        "gcs"
    }

    fn uri(&self, key: &ObjectKey) -> String {
        format!("gs://{}/{}", self.bucket, self.full(key))
    }

    async fn put_stream(
        &self,
        key: &ObjectKey,
        body: ByteStream,
        mode: PutMode,
    ) -> Result<ObjectMeta> {
        self.put_in_parts(key, body, mode).await
    }

    async fn get(&self, key: &ObjectKey, range: Option<GetRange>) -> Result<GetObject> {
        let uri = self.uri(key);
        let object = self.object(key).await?;
        let generation = object.generation.clone();
        let meta = self.to_meta(object)?;
        let (start, end) = GetRange::resolve(range, meta.size, &uri)?;
        if start == end {
            return Ok(GetObject {
                meta,
                body: futures::stream::empty().boxed(),
            });
        }
        let url = self.object_url(&self.full(key));
        let response = self
            .send("gcs.download", &uri, || {
                let mut query = vec![("alt", "media".to_string())];
                if let Some(g) = &generation {
                    query.push(("generation", g.clone()));
                }
                let mut req = self.http.get(&url).query(&query);
                if range.is_some() {
                    req = req.header(
                        reqwest::header::RANGE,
                        GetRange::Bounded { start, end }.to_http_header(),
                    );
                }
                req
            })
            .await?;
        let body = response
            .bytes_stream()
            .map_err(move |e| transport_err(&uri, &e))
            .boxed();
        Ok(GetObject { meta, body })
    }

    async fn head(&self, key: &ObjectKey) -> Result<ObjectMeta> {
        let object = self.object(key).await?;
        self.to_meta(object)
    }

    fn list(&self, prefix: &ObjectKey) -> BoxStream<'_, Result<ObjectMeta>> {
        let list_from = list_prefix(&self.prefix, prefix);
        let uri = format!("gs://{}/{list_from}", self.bucket);
        let url = format!("{}/storage/v1/b/{}/o", self.endpoint, encode(&self.bucket));
        // State: Some(page token) while pages remain; the first page has an empty token.
        futures::stream::try_unfold(Some(String::new()), move |token| {
            let (uri, url, list_from) = (uri.clone(), url.clone(), list_from.clone());
            async move {
                let Some(token) = token else {
                    return Ok(None);
                };
                let response = self
                    .send("gcs.list", &uri, || {
                        let mut query =
                            vec![("prefix", list_from.as_str()), ("maxResults", "1000")];
                        if !token.is_empty() {
                            query.push(("pageToken", token.as_str()));
                        }
                        self.http.get(&url).query(&query)
                    })
                    .await?;
                let page: ObjectList = Self::json(&uri, response).await?;
                let items: Vec<Result<ObjectMeta>> = page
                    .items
                    .into_iter()
                    .filter_map(|o| {
                        let name = o.name.clone();
                        match self.to_meta(o) {
                            Ok(m) => Some(Ok(m)),
                            Err(_) => {
                                tracing::warn!(
                                    key = name,
                                    "skipping an object whose key tuneq cannot address"
                                );
                                None
                            }
                        }
                    })
                    .collect();
                let next = page.next_page_token.filter(|t| !t.is_empty());
                Ok(Some((futures::stream::iter(items), next)))
            }
        })
        .try_flatten()
        .boxed()
    }

    async fn delete(&self, key: &ObjectKey) -> Result<()> {
        let uri = self.uri(key);
        let url = self.object_url(&self.full(key));
        match self
            .send("gcs.delete", &uri, || self.http.delete(&url))
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.is_not_found() => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn copy(&self, from: &ObjectKey, to: &ObjectKey) -> Result<ObjectMeta> {
        let uri = self.uri(from);
        let url = format!(
            "{}/rewriteTo/b/{}/o/{}",
            self.object_url(&self.full(from)),
            encode(&self.bucket),
            encode(&self.full(to))
        );
        let mut token: Option<String> = None;
        loop {
            let response = self
                .send("gcs.rewrite", &uri, || {
                    let mut req = self.http.post(&url).json(&serde_json::json!({}));
                    if let Some(t) = &token {
                        req = req.query(&[("rewriteToken", t)]);
                    }
                    req
                })
                .await?;
            let step: RewriteResponse = Self::json(&uri, response).await?;
            if step.done {
                return self.head(to).await;
            }
            token = step.rewrite_token;
            if token.is_none() {
                return Err(Error::Backend {
                    uri,
                    message: "rewrite not done but no continuation token".into(),
                    retryable: false,
                });
            }
        }
    }

    async fn presign(
        &self,
        key: &ObjectKey,
        method: PresignMethod,
        expires_in: Duration,
    ) -> Result<PresignedRequest> {
        self.presign_at(key, method, expires_in, SystemTime::now())
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signing_dates_are_compact_utc() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(
            signing_dates(t),
            ("20231114".to_string(), "20231114T221320Z".to_string())
        );
    }

    #[test]
    fn canonical_request_follows_the_v4_layout() {
        let (request, query) = canonical_request(
            "GET",
            "storage.googleapis.com",
            "/b/a%20b",
            "sa@p.iam.gserviceaccount.com/20231114/auto/storage/goog4_request",
            "20231114T221320Z",
            900,
        );
        assert!(query.starts_with("X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Credential=sa%40p."));
        assert!(query.contains("%2F20231114%2Fauto%2Fstorage%2Fgoog4_request"));
        let lines: Vec<&str> = request.split('\n').collect();
        assert_eq!(lines[0], "GET");
        assert_eq!(lines[1], "/b/a%20b");
        assert_eq!(lines[3], "host:storage.googleapis.com");
        assert_eq!(lines[4], "");
        assert_eq!(lines[5], "host");
        assert_eq!(lines[6], "UNSIGNED-PAYLOAD");
    }
}
