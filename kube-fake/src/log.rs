//! The request log: every request the fake served, for tests that assert what a client
//! sent ("no PUT", "every DELETE carried `propagationPolicy=Background`", "every list
//! carried the managed-by selector").

use serde_json::Value;

/// One request, as the fake received it.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestRecord {
    /// `GET`, `POST`, `PATCH`, `PUT`, `DELETE`.
    pub method: String,
    /// The path, without the query.
    pub path: String,
    /// The query's pairs, percent-decoded, in order.
    pub query: Vec<(String, String)>,
    /// The `Content-Type` header, when there was one.
    pub content_type: Option<String>,
    /// The body, when it was JSON.
    pub body: Option<Value>,
    /// The status code answered.
    pub status: u16,
}

impl RequestRecord {
    /// The query parameter `name`, when given.
    pub fn query_param(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// A parameter that may come in the query or as a top-level field of the JSON body
    /// (`DeleteOptions` travel in the body from kube-rs): `propagationPolicy`,
    /// `gracePeriodSeconds`, `dryRun`. Body values that are not strings are written as
    /// JSON (`["All"]`, `0`).
    pub fn param(&self, name: &str) -> Option<String> {
        if let Some(v) = self.query_param(name) {
            return Some(v.to_string());
        }
        match self.body.as_ref()?.get(name)? {
            Value::String(s) => Some(s.clone()),
            Value::Null => None,
            other => Some(other.to_string()),
        }
    }

    /// Whether this was a watch (`watch=true` or `watch=1`).
    pub fn is_watch(&self) -> bool {
        matches!(self.query_param("watch"), Some("true" | "1"))
    }
}
