//! What tenants may see of where things are kept: locations relative to their own
//! prefix, and messages (trainer errors passed through) without server paths, buckets or
//! store prefixes. The operator's log keeps the full detail.

/// A stored object's location as its tenant sees it: the key below the tenant's own
/// prefix (`jobs/ftjob-…/output/adapter`), never the store's bucket, prefix or a
/// server path. A location outside the tenant's prefix shows only its last segment.
pub fn tenant_location(uri: &str, tenant: &str) -> String {
    let marker = format!("tenants/{tenant}/");
    match uri.find(&marker) {
        Some(at) => uri[at + marker.len()..].trim_end_matches('/').to_string(),
        None => last_segment(uri).to_string(),
    }
}

fn last_segment(location: &str) -> &str {
    location
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or(location)
}

/// `text` with every absolute path and `file://`, `s3://`, `gs://` URI cut to its last
/// segment: `cannot read /srv/tuneq/objects/tenants/a/files/f/content.jsonl` becomes
/// `cannot read content.jsonl`.
pub fn paths(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some((start, len)) = next_location(rest) {
        out.push_str(&rest[..start]);
        let found = &rest[start..start + len];
        // Punctuation that ends a sentence is not part of the path.
        let trimmed = found.trim_end_matches(['.', ',', ';', ':', ')', ']', '\'', '"', '`']);
        out.push_str(last_segment(trimmed));
        out.push_str(&found[trimmed.len()..]);
        rest = &rest[start + len..];
    }
    out.push_str(rest);
    out
}

/// Where the next location in `text` starts and how long it is: a URI with a storage
/// scheme, or a `/` that begins a word and is followed by another `/` before the word
/// ends (so `a/b` and a lone `/` are left alone).
fn next_location(text: &str) -> Option<(usize, usize)> {
    let bytes = text.as_bytes();
    let word_end = |from: usize| {
        text[from..]
            .find(|c: char| c.is_whitespace() || c == '"' || c == '\'' || c == '`' || c == ',')
            .map_or(text.len(), |n| from + n)
    };
    for (i, _) in text.char_indices() {
        let starts_word = i == 0 || {
            let prev = bytes[i - 1];
            prev.is_ascii_whitespace() || b"\"'`(=[:".contains(&prev)
        };
        if !starts_word {
            continue;
        }
        let word = &text[i..word_end(i)];
        let is_uri = ["file://", "s3://", "gs://"]
            .iter()
            .any(|s| word.starts_with(s));
        let is_path = word.starts_with('/') && word[1..].contains('/');
        if is_uri || is_path {
            return Some((i, word.len()));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_are_shown_below_the_tenants_prefix() {
        assert_eq!(
            tenant_location(
                "s3://bucket/prefix/tenants/acme/jobs/ftjob-1/output/adapter",
                "acme"
            ),
            "jobs/ftjob-1/output/adapter"
        );
        assert_eq!(
            tenant_location(
                "file:///srv/data/objects/tenants/acme/jobs/j/output/checkpoints/step-2/",
                "acme"
            ),
            "jobs/j/output/checkpoints/step-2"
        );
        assert_eq!(tenant_location("/elsewhere/thing", "acme"), "thing");
    }

    #[test]
    fn paths_and_uris_in_messages_keep_only_their_last_segment() {
        assert_eq!(
            paths("cannot read /srv/tuneq/objects/tenants/a/files/f/content.jsonl: No such file"),
            "cannot read content.jsonl: No such file"
        );
        assert_eq!(
            paths("trainer exited with status 1: error: gs://bkt/pre/tenants/a/x.bin (denied)."),
            "trainer exited with status 1: error: x.bin (denied)."
        );
        assert_eq!(
            paths("loss went to NaN at step 3/10"),
            "loss went to NaN at step 3/10"
        );
        assert_eq!(paths("a/b and / alone"), "a/b and / alone");
        assert_eq!(paths("path=\"/a/b/c\""), "path=\"c\"");
    }
}
