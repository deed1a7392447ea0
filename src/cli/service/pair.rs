//! `NAME=VALUE` arguments (`--model`, `--pool`).

use crate::cli::BadInput;
use anyhow::Result;

/// Parses `NAME=VALUE`.
pub fn pair(text: &str, what: &str) -> Result<(String, String)> {
    text.split_once('=')
        .map(|(a, b)| (a.trim().to_string(), b.trim().to_string()))
        .filter(|(a, b)| !a.is_empty() && !b.is_empty())
        .ok_or_else(|| BadInput(format!("{what} must be NAME=VALUE, not `{text}`")).into())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn pairs_need_a_name_and_a_value() {
        assert_eq!(pair("a=b", "pool").unwrap(), ("a".into(), "b".into()));
        assert!(pair("a", "pool").is_err());
    }
}
