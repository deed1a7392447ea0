//! What every request passes before it reaches a handler, so that nothing a client
//! sends can grow the server's memory, files or connections without a bound:
//!
//! - a method outside HTTP's standard set is never written into a metric label or a log
//!   field (they read `other`); one longer than [`MAX_METHOD_LEN`] is refused (501)
//!   before routing, a short one reaches its route and gets its 405 with `Allow`;
//! - encoded request bodies (`Content-Encoding: gzip`, …) are refused (415): a small
//!   compressed body can inflate a thousandfold before any limit sees it;
//! - a request with two `Authorization` headers is refused (400) rather than read as
//!   whichever one comes first;
//! - a body must keep arriving: [`Paced`] ends one that stalls or trickles (see
//!   [`BodyPace`]), so a stalled client cannot hold a connection, a spool file and a
//!   worker's attention for ever;
//! - a client's `X-Request-Id` is kept only when it is short and plain ([`request_id`]),
//!   else replaced by one of ours: it goes into every log line of the request.

use crate::error::{ApiError, Code};
use actix_web::dev::{Payload, ServiceRequest};
use actix_web::error::PayloadError;
use actix_web::http::{Method, header};
use bytes::Bytes;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

/// The pace a request body must keep (see [`Paced`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BodyPace {
    /// The longest a body may go without a byte arriving.
    pub idle: Duration,
    /// How long a body may take before `min_rate` applies.
    pub grace: Duration,
    /// Bytes per second a body must average once `grace` is over.
    pub min_rate: u64,
}

impl Default for BodyPace {
    /// 20 s without a byte, or under 8 KiB/s after 10 s: a client on a poor mobile link
    /// passes; one that holds a connection open by trickling does not.
    fn default() -> Self {
        Self {
            idle: Duration::from_secs(20),
            grace: Duration::from_secs(10),
            min_rate: 8 << 10,
        }
    }
}

/// The header a request id travels in, both ways.
pub const REQUEST_ID: &str = "x-request-id";

/// Longest client request id kept.
const MAX_REQUEST_ID_LEN: usize = 64;

/// The request's id: the client's `X-Request-Id` when it is at most 64 characters of
/// letters, digits, `-`, `_`, `.` and `:` (so it can go into logs as it is), else a new
/// `req_` followed by 24 hex digits.
pub fn request_id(req: &ServiceRequest) -> String {
    let given = req
        .headers()
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| {
            !v.is_empty()
                && v.len() <= MAX_REQUEST_ID_LEN
                && v.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
        });
    match given {
        Some(id) => id.to_string(),
        None => format!("req_{}", hex::encode(rand::random::<[u8; 12]>())),
    }
}

/// The label of a standard method; None for any other (an extension method).
pub fn method_label(method: &Method) -> Option<&'static str> {
    Some(match *method {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::OPTIONS => "OPTIONS",
        Method::TRACE => "TRACE",
        Method::CONNECT => "CONNECT",
        _ => return None,
    })
}

/// The longest extension method (`QUERY`, `PROPFIND`) that is routed, to be answered
/// 405 by its route; a longer one is no method anyone uses.
pub const MAX_METHOD_LEN: usize = 16;

/// Why `req` is refused before routing, if it is.
pub fn refusal(req: &ServiceRequest) -> Option<ApiError> {
    if method_label(req.method()).is_none() && req.method().as_str().len() > MAX_METHOD_LEN {
        return Some(ApiError::new(
            Code::MethodNotSupported,
            "This method is not supported.",
        ));
    }
    let headers = req.headers();
    let encoded = headers
        .get_all(header::CONTENT_ENCODING)
        .any(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"));
    if encoded {
        return Some(ApiError::new(
            Code::EncodedBodyUnsupported,
            "Request bodies must not be compressed: send them without Content-Encoding.",
        ));
    }
    if headers.get_all(header::AUTHORIZATION).nth(1).is_some() {
        let mut error = ApiError::new(
            Code::DuplicateHeader,
            "The request has more than one Authorization header; send one.",
        );
        error.detail.param = Some("Authorization".into());
        return Some(error);
    }
    None
}

/// A request body stream, as actix keeps one.
type BoxedBody = Pin<Box<dyn futures::Stream<Item = Result<Bytes, PayloadError>>>>;

/// Puts `req`'s body under [`Paced`], when it has one (a request without
/// `Content-Length` or `Transfer-Encoding` has none, and costs no timer).
pub fn pace_body(req: &mut ServiceRequest, pace: BodyPace) {
    use actix_web::HttpMessage as _;
    let headers = req.headers();
    let has_body = headers.contains_key(header::TRANSFER_ENCODING)
        || headers
            .get(header::CONTENT_LENGTH)
            .is_some_and(|v| v.as_bytes() != b"0");
    if !has_body {
        return;
    }
    let inner = req.take_payload();
    let paced: BoxedBody = Box::pin(Paced::new(inner, pace));
    req.set_payload(Payload::from(paced));
}

/// Whether `error` is the end of a body [`Paced`] cut off.
pub fn is_body_timeout(error: &PayloadError) -> bool {
    matches!(error, PayloadError::Io(e) if e.kind() == std::io::ErrorKind::TimedOut)
}

/// The answer to a body that [`Paced`] cut off.
pub fn body_timeout() -> ApiError {
    ApiError::new(
        Code::BodyTimeout,
        "The request body arrived too slowly (it stalled, or kept under the minimum rate).",
    )
}

/// A request body that must keep a minimum pace: it ends in a `TimedOut` error when no
/// byte arrives for `pace.idle`, or when after `pace.grace` it has averaged less than
/// `pace.min_rate`. One timer, moved forward with every chunk, watches both.
pub struct Paced {
    inner: Payload,
    pace: BodyPace,
    started: tokio::time::Instant,
    received: u64,
    timer: Pin<Box<tokio::time::Sleep>>,
    done: bool,
}

impl Paced {
    /// Paces `inner` from now.
    pub fn new(inner: Payload, pace: BodyPace) -> Self {
        let started = tokio::time::Instant::now();
        let mut paced = Self {
            inner,
            pace,
            started,
            received: 0,
            timer: Box::pin(tokio::time::sleep_until(started + pace.idle)),
            done: false,
        };
        paced.rearm();
        paced
    }

    /// The timer at the sooner of: the idle limit from now, and the moment the bytes
    /// received so far stop meeting the minimum rate.
    fn rearm(&mut self) {
        let idle = tokio::time::Instant::now() + self.pace.idle;
        let earned =
            Duration::from_secs_f64(self.received as f64 / self.pace.min_rate.max(1) as f64);
        let rate = self.started + self.pace.grace + earned;
        self.timer.as_mut().reset(idle.min(rate));
    }
}

fn too_slow() -> PayloadError {
    PayloadError::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "the request body arrived too slowly",
    ))
}

impl futures::Stream for Paced {
    type Item = Result<Bytes, PayloadError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut self.inner).poll_next(cx) {
            Poll::Ready(Some(Ok(chunk))) => {
                self.received += chunk.len() as u64;
                // A client that always has a byte ready when asked still owes the rate.
                let elapsed = self.started.elapsed();
                let owed = elapsed.saturating_sub(self.pace.grace).as_secs_f64()
                    * self.pace.min_rate as f64;
                if (self.received as f64) < owed {
                    self.done = true;
                    return Poll::Ready(Some(Err(too_slow())));
                }
                self.rearm();
                Poll::Ready(Some(Ok(chunk)))
            }
            Poll::Ready(end) => {
                self.done = true;
                Poll::Ready(end)
            }
            Poll::Pending => match self.timer.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    self.done = true;
                    Poll::Ready(Some(Err(too_slow())))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn only_standard_methods_have_labels() {
        assert_eq!(method_label(&Method::GET), Some("GET"));
        let long = Method::from_bytes("X".repeat(30_000).as_bytes()).unwrap();
        assert_eq!(method_label(&long), None);
        assert_eq!(
            method_label(&Method::from_bytes(b"PROPFIND").unwrap()),
            None
        );
    }

    /// A body fed by hand: what is sent on the channel arrives, then it stalls.
    fn body() -> (
        futures::channel::mpsc::UnboundedSender<Result<Bytes, PayloadError>>,
        Payload,
    ) {
        let (sender, receiver) = futures::channel::mpsc::unbounded();
        let stream: BoxedBody = Box::pin(receiver);
        (sender, Payload::from(stream))
    }

    #[actix_web::test]
    async fn a_stalled_body_ends_in_a_timeout() {
        use futures::StreamExt;
        tokio::time::pause();
        let (sender, payload) = body();
        sender
            .unbounded_send(Ok(Bytes::from_static(b"{\"a\":")))
            .unwrap();
        let mut paced = Paced::new(payload, BodyPace::default());
        assert_eq!(paced.next().await.unwrap().unwrap(), "{\"a\":");
        // Nothing more arrives: the timer ends the body (the clock is paused, so the
        // runtime advances it instead of waiting).
        let end = paced.next().await.unwrap().unwrap_err();
        assert!(is_body_timeout(&end), "{end}");
        assert!(paced.next().await.is_none());
    }

    #[actix_web::test]
    async fn a_trickle_below_the_minimum_rate_is_cut_off() {
        use futures::StreamExt;
        tokio::time::pause();
        let (sender, payload) = body();
        let mut paced = Paced::new(payload, BodyPace::default());
        // One byte every 5 s never trips the idle limit, but falls below the rate.
        let mut cut_at = None;
        for i in 0..20 {
            sender.unbounded_send(Ok(Bytes::from_static(b"x"))).unwrap();
            match paced.next().await.unwrap() {
                Ok(_) => tokio::time::advance(Duration::from_secs(5)).await,
                Err(e) => {
                    assert!(is_body_timeout(&e));
                    cut_at = Some(i);
                    break;
                }
            }
        }
        let cut_at = cut_at.expect("a 0.2 B/s body must be cut off");
        assert!(
            cut_at <= 3,
            "cut off once the grace is over, not at byte {cut_at}"
        );
    }

    #[actix_web::test]
    async fn a_body_at_a_fair_pace_passes_whole() {
        use futures::StreamExt;
        tokio::time::pause();
        let (sender, payload) = body();
        let mut paced = Paced::new(payload, BodyPace::default());
        for _ in 0..30 {
            sender
                .unbounded_send(Ok(Bytes::from(vec![0u8; 16 << 10])))
                .unwrap();
            assert!(paced.next().await.unwrap().is_ok());
            tokio::time::advance(Duration::from_secs(1)).await;
        }
        drop(sender);
        assert!(paced.next().await.is_none());
    }
}
