//! Label selectors (equality and set-based) and field selectors, as lists, watches and
//! deletecollection take them.

use serde_json::Value;

/// One requirement of a label selector.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Requirement {
    Exists(String),
    NotExists(String),
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

/// A parsed `labelSelector`: every requirement must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector(Vec<Requirement>);

/// Splits at commas outside parentheses.
fn split_top(s: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
        .into_iter()
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect()
}

fn set_values(s: &str) -> Result<Vec<String>, String> {
    let inner = s
        .trim()
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| format!("expected a parenthesised set of values, got {s:?}"))?;
    Ok(inner
        .split(',')
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .collect())
}

impl LabelSelector {
    /// Parses `a=b,c!=d,e in (f,g),h notin (i),j,!k`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut reqs = Vec::new();
        for term in split_top(s) {
            let req = if let Some((k, v)) = term.split_once(" notin ") {
                Requirement::NotIn(k.trim().into(), set_values(v)?)
            } else if let Some((k, v)) = term.split_once(" in ") {
                Requirement::In(k.trim().into(), set_values(v)?)
            } else if let Some((k, v)) = term.split_once("!=") {
                Requirement::NotEquals(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = term.split_once("==") {
                Requirement::Equals(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = term.split_once('=') {
                Requirement::Equals(k.trim().into(), v.trim().into())
            } else if let Some(k) = term.strip_prefix('!') {
                Requirement::NotExists(k.trim().into())
            } else if term.contains(char::is_whitespace) || term.contains('(') {
                return Err(format!("unable to parse requirement: {term:?}"));
            } else {
                Requirement::Exists(term.into())
            };
            reqs.push(req);
        }
        Ok(Self(reqs))
    }

    /// Whether `obj`'s `metadata.labels` satisfy every requirement.
    pub fn matches(&self, obj: &Value) -> bool {
        let labels = obj.pointer("/metadata/labels");
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.0.iter().all(|r| match r {
            Requirement::Exists(k) => get(k).is_some(),
            Requirement::NotExists(k) => get(k).is_none(),
            Requirement::Equals(k, v) => get(k) == Some(v.as_str()),
            Requirement::NotEquals(k, v) => get(k) != Some(v.as_str()),
            Requirement::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            Requirement::NotIn(k, vs) => get(k).is_none_or(|x| vs.iter().all(|v| v != x)),
        })
    }
}

/// A parsed `fieldSelector`: `path=value`, `path==value`, `path!=value`, comma-separated,
/// on any dotted path of the object (`metadata.name`, `metadata.namespace`,
/// `involvedObject.name`, `spec.nodeName`, `status.phase`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector(Vec<(String, String, bool)>);

impl FieldSelector {
    /// Parses a field selector.
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut terms = Vec::new();
        for term in s.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            let (path, value, equal) = if let Some((p, v)) = term.split_once("!=") {
                (p, v, false)
            } else if let Some((p, v)) = term.split_once("==") {
                (p, v, true)
            } else if let Some((p, v)) = term.split_once('=') {
                (p, v, true)
            } else {
                return Err(format!("invalid field selector: {term:?}"));
            };
            terms.push((path.trim().to_string(), value.trim().to_string(), equal));
        }
        Ok(Self(terms))
    }

    /// Whether `obj` satisfies every term (a missing field reads as `""`).
    pub fn matches(&self, obj: &Value) -> bool {
        self.0.iter().all(|(path, value, equal)| {
            let pointer = format!("/{}", path.replace('.', "/"));
            let actual = match obj.pointer(&pointer) {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Null) | None => String::new(),
                Some(other) => other.to_string(),
            };
            (actual == *value) == *equal
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    fn obj(labels: Value) -> Value {
        json!({"metadata": {"name": "a", "namespace": "ns", "labels": labels}})
    }

    #[test]
    fn label_selectors_of_every_form() {
        let o = obj(json!({"app": "tuneq", "tier": "gpu"}));
        let yes = [
            "app=tuneq",
            "app==tuneq",
            "app!=other",
            "app in (x, tuneq)",
            "tier notin (cpu)",
            "app",
            "!missing",
            "app=tuneq,tier in (gpu,tpu),!missing",
            "missing!=x",
            "missing notin (x)",
        ];
        for s in yes {
            assert!(LabelSelector::parse(s).unwrap().matches(&o), "{s}");
        }
        let no = [
            "app=other",
            "app!=tuneq",
            "app in (x,y)",
            "tier notin (gpu)",
            "missing",
            "!app",
            "missing in (x)",
        ];
        for s in no {
            assert!(!LabelSelector::parse(s).unwrap().matches(&o), "{s}");
        }
        assert!(LabelSelector::parse("a in b").is_err());
        assert!(LabelSelector::parse("").unwrap().matches(&o));
    }

    #[test]
    fn field_selectors_on_dotted_paths() {
        let o = obj(json!({}));
        assert!(FieldSelector::parse("metadata.name=a").unwrap().matches(&o));
        assert!(
            FieldSelector::parse("metadata.name=a,metadata.namespace=ns")
                .unwrap()
                .matches(&o)
        );
        assert!(!FieldSelector::parse("metadata.name=b").unwrap().matches(&o));
        assert!(
            FieldSelector::parse("metadata.name!=b")
                .unwrap()
                .matches(&o)
        );
        assert!(FieldSelector::parse("spec.nodeName=").unwrap().matches(&o));
        assert!(FieldSelector::parse("nonsense").is_err());
    }
}
