//! Watches: a stream of newline-delimited watch events replayed from the store's history
//! after the requested resourceVersion, then live, with BOOKMARK events, an end at
//! `timeoutSeconds`, and the test knobs that answer `410 Expired` or close open streams.

use crate::selector::{FieldSelector, LabelSelector};
use crate::store::{ApiError, EventType, Kind, State};
use crate::{FakeCluster, ResponseBody};
use bytes::Bytes;
use futures::SinkExt;
use futures::StreamExt;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use serde_json::{Value, json};
use std::convert::Infallible;
use std::time::Duration;

/// How long a watch stays open when the request names no `timeoutSeconds`.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// What one watch asks for.
pub(crate) struct WatchRequest {
    pub kind: Kind,
    pub namespace: Option<String>,
    pub labels: LabelSelector,
    pub fields: FieldSelector,
    /// `None` (or `0`): start with the current objects as ADDED, then changes.
    pub from: Option<u64>,
    pub timeout: Option<Duration>,
    pub bookmarks: bool,
}

impl WatchRequest {
    fn selects(&self, namespace: &str, obj: &Value) -> bool {
        self.namespace.as_deref().is_none_or(|ns| ns == namespace)
            && self.labels.matches(obj)
            && self.fields.matches(obj)
    }
}

fn line(type_: &str, object: &Value) -> Bytes {
    let mut v = serde_json::to_vec(&json!({"type": type_, "object": object})).unwrap_or_default();
    v.push(b'\n');
    Bytes::from(v)
}

fn bookmark(kind: Kind, rv: u64) -> Bytes {
    line(
        "BOOKMARK",
        &json!({"kind": kind.name(), "apiVersion": kind.api_version(),
                "metadata": {"resourceVersion": rv.to_string()}}),
    )
}

/// The events a watch sends for the changes after `cursor`, and the rv they reach.
fn events_after(s: &State, req: &WatchRequest, cursor: u64) -> (Vec<Bytes>, u64) {
    let start = s.history.partition_point(|c| c.rv <= cursor);
    let mut lines = Vec::new();
    for c in &s.history[start..] {
        if c.kind != req.kind {
            continue;
        }
        let now = req.selects(&c.namespace, &c.object);
        let before = c
            .previous
            .as_ref()
            .is_some_and(|p| req.selects(&c.namespace, p));
        let type_ = match (c.type_, before, now) {
            (EventType::Added, _, true) => Some(EventType::Added),
            (EventType::Deleted, _, true) => Some(EventType::Deleted),
            (EventType::Modified, true, true) => Some(EventType::Modified),
            (EventType::Modified, false, true) => Some(EventType::Added),
            (EventType::Modified, true, false) => Some(EventType::Deleted),
            _ => None,
        };
        if let Some(t) = type_ {
            lines.push(line(t.as_str(), &c.object));
        }
    }
    (lines, s.rv)
}

/// Starts a watch: the stream body, fed by a task that ends with the stream.
pub(crate) fn start(cluster: FakeCluster, req: WatchRequest) -> ResponseBody {
    let (mut tx, rx) = futures::channel::mpsc::channel::<Bytes>(64);
    let body = StreamBody::new(rx.map(|b| Ok::<_, Infallible>(Frame::data(b))));

    // Decided now, under the lock: an injected or real `Expired`, the initial state.
    let mut signal = cluster.subscribe();
    let epoch = signal.borrow_and_update().epoch;
    let opening = cluster.with_state(|s| {
        let from = req.from.unwrap_or(0);
        if s.watch.expire_next > 0 {
            s.watch.expire_next -= 1;
            return Err(ApiError::expired(from, s.rv));
        }
        if from != 0 && (from < s.watch.compacted_below || from > s.rv) {
            return Err(ApiError::expired(from, s.watch.compacted_below.max(1)));
        }
        if from == 0 {
            let added = s
                .objects
                .iter()
                .filter(|((k, ns, _), o)| *k == req.kind && req.selects(ns, o))
                .map(|(_, o)| line("ADDED", o))
                .collect();
            return Ok((added, s.rv));
        }
        Ok((Vec::new(), from))
    });
    let interval = cluster.with_state(|s| s.watch.bookmark_interval);
    let deadline = tokio::time::Instant::now() + req.timeout.unwrap_or(DEFAULT_TIMEOUT);

    tokio::spawn(async move {
        let (first, mut cursor) = match opening {
            Ok(o) => o,
            Err(e) => {
                let _ = tx.send(line("ERROR", &e.status())).await;
                return;
            }
        };
        for l in first {
            if tx.send(l).await.is_err() {
                return;
            }
        }
        let mut bookmark_due = false;
        loop {
            let (lines, reached) = cluster.with_state(|s| events_after(s, &req, cursor));
            for l in lines {
                if tx.send(l).await.is_err() {
                    return;
                }
            }
            cursor = reached;
            if std::mem::take(&mut bookmark_due)
                && tx.send(bookmark(req.kind, cursor)).await.is_err()
            {
                return;
            }
            if signal.borrow_and_update().epoch != epoch {
                return;
            }
            tokio::select! {
                changed = signal.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
                () = tokio::time::sleep_until(deadline) => {
                    if req.bookmarks {
                        let _ = tx.send(bookmark(req.kind, cursor)).await;
                    }
                    return;
                }
                () = tokio::time::sleep(interval), if req.bookmarks => bookmark_due = true,
            }
        }
    });
    body.boxed_unsync()
}
