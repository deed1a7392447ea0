//! The S3 backend (AWS S3 and S3-compatible stores), on the official `aws-sdk-s3`.
//!
//! Objects smaller than one part go up in a single `PutObject`; larger ones stream
//! through a multipart upload, one part in memory at a time, aborted if anything fails
//! so no half-object ever becomes visible. The SDK's standard retry mode (exponential
//! backoff with jitter, six tries) retries throttling and transient failures.

use crate::config::S3Config;
use crate::{
    ByteStream, Error, GetObject, GetRange, ObjectKey, ObjectMeta, ObjectStore, PartedUpload,
    PresignMethod, PresignedRequest, PutMode, Result, fill_past, full_key, list_prefix,
    relative_key,
};
use async_trait::async_trait;
use aws_sdk_s3::config::http::HttpResponse;
use aws_sdk_s3::config::retry::RetryConfig;
use aws_sdk_s3::config::timeout::TimeoutConfig;
use aws_sdk_s3::config::{BehaviorVersion, Region};
use aws_sdk_s3::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_s3::presigning::PresigningConfig;
use aws_sdk_s3::primitives::ByteStream as SdkBody;
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
use bytes::{Bytes, BytesMut};
use futures::stream::{BoxStream, StreamExt, TryStreamExt};
use std::time::{Duration, SystemTime};

/// Default multipart part size: large enough for few requests, small enough for memory.
pub const DEFAULT_PART_SIZE: usize = 8 * 1024 * 1024;
/// S3's smallest allowed part (all but the last).
const MIN_PART_SIZE: usize = 5 * 1024 * 1024;

/// A bucket, optionally below a key prefix, on S3 or an S3-compatible store.
#[derive(Debug, Clone)]
pub struct S3Store {
    client: aws_sdk_s3::Client,
    bucket: String,
    prefix: String,
    part_size: usize,
}

impl S3Store {
    /// Connects with the settings in `config`, falling back to the standard AWS
    /// environment, profile files and credential chain for anything left unset.
    pub async fn connect(config: &S3Config, bucket: &str, prefix: &str) -> Result<Self> {
        let endpoint = config.effective_endpoint();
        if let Some(e) = &endpoint {
            url::Url::parse(e)
                .map_err(|err| Error::Config(format!("S3 endpoint {e:?} is not a URL: {err}")))?;
        }
        let mut loader = aws_config::defaults(BehaviorVersion::latest());
        if let Some(profile) = &config.profile {
            loader = loader.profile_name(profile);
        }
        if let Some(region) = &config.region {
            loader = loader.region(Region::new(region.clone()));
        }
        if let Some(e) = &config.endpoint {
            loader = loader.endpoint_url(e);
        }
        match (&config.access_key_id, &config.secret_access_key) {
            (Some(id), Some(secret)) => {
                loader = loader.credentials_provider(aws_sdk_s3::config::Credentials::new(
                    id,
                    secret.expose(),
                    None,
                    None,
                    "tuneq-config",
                ));
            }
            (None, None) => {}
            _ => {
                return Err(Error::Config(
                    "s3.access_key_id and s3.secret_access_key go together".into(),
                ));
            }
        }
        let sdk = loader.load().await;
        let mut builder = aws_sdk_s3::config::Builder::from(&sdk)
            .force_path_style(config.force_path_style.unwrap_or(endpoint.is_some()))
            .retry_config(RetryConfig::standard().with_max_attempts(6))
            .timeout_config(
                TimeoutConfig::builder()
                    .connect_timeout(Duration::from_secs(10))
                    .build(),
            );
        if sdk.region().is_none() {
            builder = builder.region(Region::new("us-east-1"));
        }
        let part_size = config.multipart_part_size.unwrap_or(DEFAULT_PART_SIZE);
        if part_size < MIN_PART_SIZE {
            return Err(Error::Config(format!(
                "s3.multipart_part_size must be at least {MIN_PART_SIZE} bytes (S3's minimum part)"
            )));
        }
        Ok(Self {
            client: aws_sdk_s3::Client::from_conf(builder.build()),
            bucket: bucket.to_string(),
            prefix: prefix.trim_matches('/').to_string(),
            part_size,
        })
    }

    /// The SDK client, for operations outside the [`ObjectStore`] interface (tests create buckets).
    pub fn client(&self) -> &aws_sdk_s3::Client {
        &self.client
    }

    fn full(&self, key: &ObjectKey) -> String {
        full_key(&self.prefix, key)
    }

    async fn upload_parts(
        &self,
        key: &ObjectKey,
        upload_id: &str,
        body: &mut ByteStream,
        buf: &mut BytesMut,
        mode: PutMode,
    ) -> Result<()> {
        let uri = self.uri(key);
        let mut parts = Vec::new();
        let mut ended = false;
        loop {
            while buf.len() >= self.part_size || (ended && !buf.is_empty()) {
                let take = buf.len().min(self.part_size);
                let data = buf.split_to(take).freeze();
                let number = i32::try_from(parts.len() + 1).unwrap_or(i32::MAX);
                let out = self
                    .client
                    .upload_part()
                    .bucket(&self.bucket)
                    .key(self.full(key))
                    .upload_id(upload_id)
                    .part_number(number)
                    .body(SdkBody::from(data))
                    .send()
                    .await
                    .map_err(|e| map_err(e, &uri))?;
                parts.push(
                    CompletedPart::builder()
                        .part_number(number)
                        .set_e_tag(out.e_tag().map(str::to_string))
                        .set_checksum_crc32(out.checksum_crc32().map(str::to_string))
                        .build(),
                );
                if parts.len() > 10_000 {
                    return Err(Error::Config(format!(
                        "{uri}: more than 10000 parts; raise s3.multipart_part_size"
                    )));
                }
            }
            if ended {
                break;
            }
            ended = fill_past(body, buf, self.part_size).await?;
        }
        let mut complete = self
            .client
            .complete_multipart_upload()
            .bucket(&self.bucket)
            .key(self.full(key))
            .upload_id(upload_id)
            .multipart_upload(
                CompletedMultipartUpload::builder()
                    .set_parts(Some(parts))
                    .build(),
            );
        if mode == PutMode::Create {
            complete = complete.if_none_match("*");
        }
        complete.send().await.map_err(|e| map_err(e, &uri))?;
        Ok(())
    }
}

/// Maps an SDK failure to a typed error.
fn map_err<E>(err: SdkError<E, HttpResponse>, uri: &str) -> Error
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    let status = err.raw_response().map(|r| r.status().as_u16());
    let code = err.code().unwrap_or_default().to_string();
    let message = DisplayErrorContext(&err).to_string();
    let uri = uri.to_string();
    match (status, code.as_str()) {
        (_, "NoSuchKey" | "NoSuchBucket" | "NotFound") | (Some(404), _) => Error::NotFound { uri },
        (_, "AccessDenied" | "InvalidAccessKeyId" | "SignatureDoesNotMatch")
        | (Some(401 | 403), _) => Error::PermissionDenied { uri, message },
        (_, "PreconditionFailed" | "ConditionalRequestConflict") | (Some(409 | 412), _) => {
            Error::PreconditionFailed { uri, message }
        }
        (_, "SlowDown" | "Throttling" | "ThrottlingException" | "RequestLimitExceeded")
        | (Some(429 | 503), _) => Error::Throttled { uri, message },
        (Some(s), _) => Error::Backend {
            uri,
            message,
            retryable: crate::retry::status_is_transient(s),
        },
        // No HTTP response: a connection or timeout failure (retryable), or a request
        // that could not be built (not retryable).
        (None, _) => Error::Backend {
            uri,
            message,
            retryable: !matches!(err, SdkError::ConstructionFailure(_)),
        },
    }
}

fn system_time(t: Option<&aws_smithy_types::DateTime>) -> Option<SystemTime> {
    t.and_then(|d| SystemTime::try_from(*d).ok())
}

/// The total size from a `Content-Range: bytes a-b/total` header.
fn total_from_content_range(header: &str) -> Option<u64> {
    header.rsplit('/').next()?.trim().parse().ok()
}

/// `bucket/key` for `x-amz-copy-source`, the key percent-encoded except for `/`.
fn copy_source(bucket: &str, key: &str) -> String {
    use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
    const KEEP: &AsciiSet = &NON_ALPHANUMERIC
        .remove(b'/')
        .remove(b'-')
        .remove(b'_')
        .remove(b'.')
        .remove(b'~');
    format!("{bucket}/{}", utf8_percent_encode(key, KEEP))
}

#[async_trait]
impl PartedUpload for S3Store {
    fn part_size(&self) -> usize {
        self.part_size
    }

    async fn put_single(&self, key: &ObjectKey, data: Bytes, mode: PutMode) -> Result<()> {
        let mut req = self
            .client
            .put_object()
            .bucket(&self.bucket)
            .key(self.full(key))
            .body(SdkBody::from(data));
        if mode == PutMode::Create {
            req = req.if_none_match("*");
        }
        req.send().await.map_err(|e| map_err(e, &self.uri(key)))?;
        Ok(())
    }

    /// Streams the rest of `body` as a multipart upload, `buf` holding what was read so far.
    async fn put_parts(
        &self,
        key: &ObjectKey,
        body: &mut ByteStream,
        buf: &mut BytesMut,
        mode: PutMode,
    ) -> Result<()> {
        let uri = self.uri(key);
        let created = self
            .client
            .create_multipart_upload()
            .bucket(&self.bucket)
            .key(self.full(key))
            .send()
            .await
            .map_err(|e| map_err(e, &uri))?;
        let upload_id = created.upload_id().unwrap_or_default().to_string();
        let result = self.upload_parts(key, &upload_id, body, buf, mode).await;
        if result.is_err() {
            let aborted = self
                .client
                .abort_multipart_upload()
                .bucket(&self.bucket)
                .key(self.full(key))
                .upload_id(&upload_id)
                .send()
                .await;
            if let Err(e) = aborted {
                tracing::warn!(%uri, error = %DisplayErrorContext(&e), "could not abort multipart upload; a lifecycle rule will reap it");
            }
        }
        result
    }
}

#[async_trait]
impl ObjectStore for S3Store {
    fn backend(&self) -> &'static str {
        "s3"
    }

    fn uri(&self, key: &ObjectKey) -> String {
        format!("s3://{}/{}", self.bucket, self.full(key))
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
        let mut req = self
            .client
            .get_object()
            .bucket(&self.bucket)
            .key(self.full(key));
        if let Some(r) = range {
            if let GetRange::Bounded { start, end } = r
                && end <= start
            {
                // An empty range: HTTP cannot express it, so answer it here.
                let meta = self.head(key).await?;
                if start > meta.size {
                    return Err(Error::InvalidRange {
                        uri,
                        start,
                        size: meta.size,
                    });
                }
                return Ok(GetObject {
                    meta,
                    body: futures::stream::empty().boxed(),
                });
            }
            req = req.range(r.to_http_header());
        }
        let out = match req.send().await {
            Ok(out) => out,
            Err(e) if e.raw_response().map(|r| r.status().as_u16()) == Some(416) => {
                let size = self.head(key).await?.size;
                return Err(Error::InvalidRange {
                    uri,
                    start: range.map_or(0, GetRange::start),
                    size,
                });
            }
            Err(e) => return Err(map_err(e, &uri)),
        };
        let size = match (range, out.content_range()) {
            (Some(_), Some(cr)) => total_from_content_range(cr),
            _ => out.content_length().and_then(|n| u64::try_from(n).ok()),
        }
        .unwrap_or_default();
        let meta = ObjectMeta {
            key: key.clone(),
            size,
            etag: out.e_tag().map(str::to_string),
            modified: system_time(out.last_modified()),
        };
        let body = futures::stream::try_unfold((out.body, uri), |(mut body, uri)| async move {
            match body.try_next().await {
                Ok(Some(chunk)) => Ok(Some((chunk, (body, uri)))),
                Ok(None) => Ok(None),
                Err(e) => Err(Error::Backend {
                    uri,
                    message: format!("reading the object body: {}", DisplayErrorContext(&e)),
                    retryable: true,
                }),
            }
        })
        .boxed();
        Ok(GetObject { meta, body })
    }

    async fn head(&self, key: &ObjectKey) -> Result<ObjectMeta> {
        let out = self
            .client
            .head_object()
            .bucket(&self.bucket)
            .key(self.full(key))
            .send()
            .await
            .map_err(|e| map_err(e, &self.uri(key)))?;
        Ok(ObjectMeta {
            key: key.clone(),
            size: out
                .content_length()
                .and_then(|n| u64::try_from(n).ok())
                .unwrap_or_default(),
            etag: out.e_tag().map(str::to_string),
            modified: system_time(out.last_modified()),
        })
    }

    fn list(&self, prefix: &ObjectKey) -> BoxStream<'_, Result<ObjectMeta>> {
        let list_from = list_prefix(&self.prefix, prefix);
        let uri = format!("s3://{}/{list_from}", self.bucket);
        let pages = self
            .client
            .list_objects_v2()
            .bucket(&self.bucket)
            .prefix(list_from)
            .into_paginator()
            .send();
        futures::stream::try_unfold((pages, uri), move |(mut pages, uri)| async move {
            match pages.next().await {
                None => Ok(None),
                Some(Err(e)) => Err(map_err(e, &uri)),
                Some(Ok(page)) => {
                    let items: Vec<Result<ObjectMeta>> = page
                        .contents()
                        .iter()
                        .filter_map(|o| {
                            let full = o.key()?;
                            match relative_key(&self.prefix, full) {
                                Ok(key) => Some(Ok(ObjectMeta {
                                    key,
                                    size: o
                                        .size()
                                        .and_then(|n| u64::try_from(n).ok())
                                        .unwrap_or_default(),
                                    etag: o.e_tag().map(str::to_string),
                                    modified: system_time(o.last_modified()),
                                })),
                                Err(_) => {
                                    tracing::warn!(
                                        key = full,
                                        "skipping an object whose key tuneq cannot address"
                                    );
                                    None
                                }
                            }
                        })
                        .collect();
                    Ok(Some((futures::stream::iter(items), (pages, uri))))
                }
            }
        })
        .try_flatten()
        .boxed()
    }

    async fn delete(&self, key: &ObjectKey) -> Result<()> {
        self.client
            .delete_object()
            .bucket(&self.bucket)
            .key(self.full(key))
            .send()
            .await
            .map_err(|e| map_err(e, &self.uri(key)))?;
        Ok(())
    }

    async fn copy(&self, from: &ObjectKey, to: &ObjectKey) -> Result<ObjectMeta> {
        self.client
            .copy_object()
            .bucket(&self.bucket)
            .key(self.full(to))
            .copy_source(copy_source(&self.bucket, &self.full(from)))
            .send()
            .await
            .map_err(|e| map_err(e, &self.uri(from)))?;
        self.head(to).await
    }

    async fn presign(
        &self,
        key: &ObjectKey,
        method: PresignMethod,
        expires_in: Duration,
    ) -> Result<PresignedRequest> {
        let uri = self.uri(key);
        let config = PresigningConfig::expires_in(expires_in)
            .map_err(|e| Error::Config(format!("presign expiry {expires_in:?}: {e}")))?;
        let request = match method {
            PresignMethod::Get => self
                .client
                .get_object()
                .bucket(&self.bucket)
                .key(self.full(key))
                .presigned(config)
                .await
                .map_err(|e| map_err(e, &uri))?,
            PresignMethod::Put => self
                .client
                .put_object()
                .bucket(&self.bucket)
                .key(self.full(key))
                .presigned(config)
                .await
                .map_err(|e| map_err(e, &uri))?,
        };
        Ok(PresignedRequest {
            method,
            url: request.uri().to_string(),
            headers: request
                .headers()
                .filter(|(name, _)| !name.eq_ignore_ascii_case("host"))
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
            expires_at: SystemTime::now() + expires_in,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_sources_are_encoded() {
        assert_eq!(copy_source("b", "a b/c+d.txt"), "b/a%20b/c%2Bd.txt");
    }

    #[test]
    fn content_range_totals_parse() {
        assert_eq!(total_from_content_range("bytes 0-9/1000"), Some(1000));
        assert_eq!(total_from_content_range("bytes */1000"), Some(1000));
        assert_eq!(total_from_content_range("garbage"), None);
    }
}
