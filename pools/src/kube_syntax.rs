//! What the Kubernetes API server (and the kubelet, for image references) accepts in the
//! strings a pools file hands to it, written from the rules of apimachinery's
//! `util/validation` and the pod validation of the API server, so a pools file the
//! cluster would refuse is refused by `--check-config` instead of failing every attempt.
//!
//! Each check returns `Err` with a sentence that says what the string must be; the
//! caller adds the field. Only ASCII is ever valid, so lengths are bytes.

use std::collections::BTreeMap;

/// Longest DNS-1123 label (namespaces, volume names).
pub const DNS_LABEL_MAX: usize = 63;
/// Longest DNS-1123 subdomain (ConfigMap, Secret, claim and ServiceAccount names).
pub const DNS_SUBDOMAIN_MAX: usize = 253;
/// Longest name part of a qualified name (label and annotation keys).
pub const QUALIFIED_NAME_MAX: usize = 63;
/// Longest label value.
pub const LABEL_VALUE_MAX: usize = 63;
/// Longest CSI driver name.
pub const CSI_DRIVER_MAX: usize = 63;
/// Most bytes an object's annotations take together, keys and values (256 KiB).
pub const ANNOTATIONS_MAX_BYTES: usize = 256 * 1024;
/// Longest image tag.
const TAG_MAX: usize = 128;
/// Longest image name (domain and path, without tag or digest).
const IMAGE_NAME_MAX: usize = 255;

/// Result of one check: `Err` says what the string must be.
pub type Check = Result<(), String>;

fn lower_alnum(b: u8) -> bool {
    b.is_ascii_lowercase() || b.is_ascii_digit()
}

/// A DNS-1123 label: at most 63 of lower-case `a-z`, `0-9` and `-`, starting and ending
/// with a letter or digit.
pub fn dns_label(s: &str) -> Check {
    let ok = !s.is_empty()
        && s.len() <= DNS_LABEL_MAX
        && s.bytes().all(|b| lower_alnum(b) || b == b'-')
        && s.bytes().next().is_some_and(lower_alnum)
        && s.bytes().last().is_some_and(lower_alnum);
    if ok {
        Ok(())
    } else {
        Err(format!(
            "`{}` is not a DNS-1123 label (at most {DNS_LABEL_MAX} lower-case letters, digits and `-`, starting and ending with a letter or digit)",
            s.escape_debug()
        ))
    }
}

/// A DNS-1123 subdomain: at most 253 characters of `.`-separated parts, each of
/// lower-case letters, digits and `-`, starting and ending with a letter or digit.
pub fn dns_subdomain(s: &str) -> Check {
    let part = |p: &str| {
        !p.is_empty()
            && p.bytes().all(|b| lower_alnum(b) || b == b'-')
            && p.bytes().next().is_some_and(lower_alnum)
            && p.bytes().last().is_some_and(lower_alnum)
    };
    if !s.is_empty() && s.len() <= DNS_SUBDOMAIN_MAX && s.split('.').all(part) {
        Ok(())
    } else {
        Err(format!(
            "`{}` is not a DNS-1123 subdomain (at most {DNS_SUBDOMAIN_MAX} characters of `.`-separated lower-case letters, digits and `-`, each part starting and ending with a letter or digit)",
            s.escape_debug()
        ))
    }
}

/// `[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?`, or empty.
fn label_chars(s: &str) -> bool {
    let alnum = |b: u8| b.is_ascii_alphanumeric();
    s.bytes()
        .all(|b| alnum(b) || matches!(b, b'-' | b'_' | b'.'))
        && s.bytes().next().is_none_or(alnum)
        && s.bytes().last().is_none_or(alnum)
}

/// A qualified name (label, annotation, toleration and node-affinity keys): a name of at
/// most 63 letters, digits, `-`, `_` and `.`, starting and ending with a letter or digit,
/// optionally after a DNS-1123 subdomain prefix and one `/` (`example.com/gpu`).
pub fn qualified_name(s: &str) -> Check {
    let shape = "a qualified name is an optional DNS-1123 subdomain and `/`, then at most 63 letters, digits, `-`, `_` and `.`, starting and ending with a letter or digit";
    let shown = s.escape_debug();
    let (prefix, name) = match s.split_once('/') {
        Some((_, name)) if name.contains('/') => {
            return Err(format!("`{shown}` has more than one `/`; {shape}"));
        }
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, s),
    };
    if let Some(prefix) = prefix {
        dns_subdomain(prefix).map_err(|e| format!("the prefix of `{shown}`: {e}"))?;
    }
    if name.is_empty() || name.len() > QUALIFIED_NAME_MAX || !label_chars(name) {
        return Err(format!("`{shown}` is not a qualified name: {shape}"));
    }
    Ok(())
}

/// An annotation key: a qualified name once lower-cased (the API server lower-cases
/// annotation keys before it checks them, so upper-case prefixes pass).
pub fn annotation_key(s: &str) -> Check {
    qualified_name(&s.to_ascii_lowercase())
}

/// A label value: empty, or at most 63 letters, digits, `-`, `_` and `.`, starting and
/// ending with a letter or digit.
pub fn label_value(s: &str) -> Check {
    if s.len() <= LABEL_VALUE_MAX && label_chars(s) {
        Ok(())
    } else {
        Err(format!(
            "`{}` is not a label value (empty, or at most {LABEL_VALUE_MAX} letters, digits, `-`, `_` and `.`, starting and ending with a letter or digit)",
            s.escape_debug()
        ))
    }
}

/// The annotations of one object: at most 256 KiB, keys and values together.
pub fn annotations_size(annotations: &BTreeMap<String, String>) -> Check {
    let total: usize = annotations.iter().map(|(k, v)| k.len() + v.len()).sum();
    if total <= ANNOTATIONS_MAX_BYTES {
        Ok(())
    } else {
        Err(format!(
            "the annotations take {total} bytes; Kubernetes allows {ANNOTATIONS_MAX_BYTES} (256 KiB) in all"
        ))
    }
}

/// A CSI driver name: at most 63 letters, digits, `-`, `_` and `.`, starting and ending
/// with a letter or digit, that is a DNS-1123 subdomain once lower-cased.
pub fn csi_driver(s: &str) -> Check {
    let ok = s.len() <= CSI_DRIVER_MAX
        && !s.is_empty()
        && label_chars(s)
        && dns_subdomain(&s.to_ascii_lowercase()).is_ok();
    if ok {
        Ok(())
    } else {
        Err(format!(
            "`{}` is not a CSI driver name (at most {CSI_DRIVER_MAX} characters, a DNS-1123 subdomain such as `gcsfuse.csi.storage.gke.io`)",
            s.escape_debug()
        ))
    }
}

/// A container mount path: absolute, without `:` (the runtime reads it as a separator)
/// or control characters.
pub fn mount_path(s: &str) -> Check {
    if !s.starts_with('/') {
        return Err(format!("`{}` is not an absolute path", s.escape_debug()));
    }
    if s.contains(':') || s.chars().any(char::is_control) {
        return Err(format!(
            "`{}` may not contain `:` or control characters",
            s.escape_debug()
        ));
    }
    Ok(())
}

/// The one value of a `Gt` or `Lt` node-affinity requirement: a 64-bit integer.
pub fn integer(s: &str) -> Check {
    s.parse::<i64>().map(|_| ()).map_err(|_| {
        format!(
            "`{}` is not an integer (Gt and Lt compare node labels as numbers)",
            s.escape_debug()
        )
    })
}

/// An image reference as the kubelet parses it: `[domain[:port]/]path[:tag][@digest]`,
/// the path of lower-case components (`a-z0-9` joined by `.`, `_`, `__` or `-`s), a tag of
/// at most 128 of `\w`, `.` and `-` (not starting with `.` or `-`), a digest of
/// `sha256:` and 64 lower-case hex digits. Says nothing about pinning ([`image_pinned`]).
pub fn image_reference(s: &str) -> Check {
    let bad = |why: &str| {
        Err(format!(
            "`{}` is not an image reference: {why}",
            s.escape_debug()
        ))
    };
    let (rest, digest) = match s.split_once('@') {
        Some((rest, digest)) => (rest, Some(digest)),
        None => (s, None),
    };
    if let Some(digest) = digest {
        let hex = digest.strip_prefix("sha256:");
        let ok = hex.is_some_and(|h| {
            h.len() == 64
                && h.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        });
        if !ok {
            return bad("a digest is `sha256:` and 64 lower-case hex digits");
        }
    }
    let last_slash = rest.rfind('/').map_or(0, |i| i + 1);
    let (name, tag) = match rest[last_slash..].rfind(':') {
        Some(i) => (&rest[..last_slash + i], Some(&rest[last_slash + i + 1..])),
        None => (rest, None),
    };
    if let Some(tag) = tag {
        let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
        let ok = !tag.is_empty()
            && tag.len() <= TAG_MAX
            && tag.bytes().next().is_some_and(word)
            && tag.bytes().all(|b| word(b) || b == b'.' || b == b'-');
        if !ok {
            return bad(
                "a tag is at most 128 letters, digits, `_`, `.` and `-`, not starting with `.` or `-`",
            );
        }
    }
    if name.is_empty() || name.len() > IMAGE_NAME_MAX {
        return bad("the name is empty or longer than 255 characters");
    }
    let mut components: Vec<&str> = name.split('/').collect();
    let first = components[0];
    // As the reference grammar reads it: a first component with `.` or `:`, or
    // `localhost`, is the registry's domain; the rest is the path.
    if components.len() > 1 && (first.contains(['.', ':']) || first == "localhost") {
        if !image_domain(first) {
            return bad("the registry must be a host name or address, with an optional `:port`");
        }
        components.remove(0);
    }
    if !components.iter().all(|c| path_component(c)) {
        return bad(
            "each part of the path is lower-case letters and digits, joined by `.`, `_`, `__` or `-`",
        );
    }
    Ok(())
}

/// `host[:port]`: dot-separated parts of letters, digits and inner `-`, or a bracketed
/// IPv6 address; the port digits.
fn image_domain(domain: &str) -> bool {
    let (host, port) = if let Some(rest) = domain.strip_prefix('[') {
        let Some((v6, after)) = rest.split_once(']') else {
            return false;
        };
        if v6.parse::<std::net::Ipv6Addr>().is_err() {
            return false;
        }
        match after {
            "" => return true,
            _ => match after.strip_prefix(':') {
                Some(port) => ("", Some(port)),
                None => return false,
            },
        }
    } else {
        match domain.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (domain, None),
        }
    };
    let part = |p: &str| {
        !p.is_empty()
            && p.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !p.starts_with('-')
            && !p.ends_with('-')
    };
    let host_ok = domain.starts_with('[') || host.split('.').all(part);
    let port_ok = port.is_none_or(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
    host_ok && port_ok
}

/// `[a-z0-9]+` joined by `.`, `_`, `__` or one or more `-`.
fn path_component(c: &str) -> bool {
    let bytes = c.as_bytes();
    if !bytes.first().is_some_and(|b| lower_alnum(*b))
        || !bytes.last().is_some_and(|b| lower_alnum(*b))
    {
        return false;
    }
    let mut i = 0;
    while i < bytes.len() {
        if lower_alnum(bytes[i]) {
            i += 1;
            continue;
        }
        let start = i;
        while i < bytes.len() && !lower_alnum(bytes[i]) {
            i += 1;
        }
        let sep = &c[start..i];
        if !(sep == "." || sep == "_" || sep == "__" || sep.bytes().all(|b| b == b'-')) {
            return false;
        }
    }
    true
}

/// Whether an image reference is pinned: it has a digest, or a tag other than `latest`.
pub fn image_pinned(s: &str) -> bool {
    if s.contains('@') {
        return true;
    }
    let last_slash = s.rfind('/').map_or(0, |i| i + 1);
    match s[last_slash..].rsplit_once(':') {
        Some((_, tag)) => tag != "latest",
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(check: Check) -> String {
        match check {
            Ok(()) => panic!("accepted"),
            Err(e) => e,
        }
    }

    #[test]
    fn dns_labels() {
        for ok in ["a", "tuneq", "a-1", "0", &"a".repeat(63)] {
            assert_eq!(dns_label(ok), Ok(()), "{ok}");
        }
        for bad in [
            "",
            "-a",
            "a-",
            "A",
            "a_b",
            "a.b",
            "a b",
            "ü",
            &"a".repeat(64),
        ] {
            assert!(dns_label(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn dns_subdomains() {
        let long_part = "a".repeat(100);
        for ok in ["a", "a.b", "config-1.tuneq", long_part.as_str()] {
            assert_eq!(dns_subdomain(ok), Ok(()), "{ok}");
        }
        let too_long = format!("{}.a", "a".repeat(252));
        // The probe's examples: ConfigMap `A B`, claim `../x`, Secret `UPPER`.
        for bad in [
            "",
            "A B",
            "../x",
            "UPPER",
            "a..b",
            ".a",
            "a.",
            "a_b",
            too_long.as_str(),
        ] {
            assert!(dns_subdomain(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn qualified_names() {
        for ok in [
            "gpu",
            "cloud.google.com/gke-spot",
            "node.kubernetes.io/instance-type",
            "A_b.c-D",
            &"a".repeat(63),
        ] {
            assert_eq!(qualified_name(ok), Ok(()), "{ok}");
        }
        // The probe's examples: `a/b/c`, `-bad`, `a:b`, `a b`.
        assert!(refused(qualified_name("a/b/c")).contains("more than one `/`"));
        for bad in [
            "-bad",
            "a:b",
            "a b",
            "",
            "/a",
            "a/",
            "bad-",
            "ü",
            &"a".repeat(64),
        ] {
            assert!(qualified_name(bad).is_err(), "{bad}");
        }
        assert!(refused(qualified_name("Ex_ample.com/a")).contains("prefix"));
        assert!(qualified_name(&format!("{}/a", "a".repeat(254))).is_err());
    }

    #[test]
    fn annotation_keys_are_checked_lower_cased() {
        assert_eq!(annotation_key("Example.COM/Key"), Ok(()));
        assert_eq!(annotation_key("gke-gcsfuse/volumes"), Ok(()));
        // The probe's example: an underscore never makes a DNS prefix.
        assert!(annotation_key("UPPER_/x").is_err());
        assert!(annotation_key("a b").is_err());
    }

    #[test]
    fn label_values() {
        for ok in ["", "a", "nvidia-l4", "1.2_3", &"v".repeat(63)] {
            assert_eq!(label_value(ok), Ok(()), "{ok}");
        }
        // The probe's examples: `has space`, `ü`.
        for bad in ["has space", "ü", "-a", "a.", "a/b", &"v".repeat(64)] {
            assert!(label_value(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn annotations_total_at_most_256_kib() {
        let mut a = BTreeMap::from([("k".to_string(), "v".repeat(ANNOTATIONS_MAX_BYTES - 1))]);
        assert_eq!(annotations_size(&a), Ok(()));
        a.insert("x".into(), String::new());
        assert!(refused(annotations_size(&a)).contains("262145 bytes"));
        // The probe's example: one 300 KB annotation.
        let big = BTreeMap::from([("a".to_string(), "x".repeat(300_000))]);
        assert!(annotations_size(&big).is_err());
    }

    #[test]
    fn csi_drivers() {
        for ok in ["gcsfuse.csi.storage.gke.io", "ebs.csi.aws.com", "Disk.CSI"] {
            assert_eq!(csi_driver(ok), Ok(()), "{ok}");
        }
        // The probe's example: `a b`.
        for bad in ["a b", "", "-a", "a_b", &"a".repeat(64)] {
            assert!(csi_driver(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn mount_paths() {
        assert_eq!(mount_path("/models"), Ok(()));
        assert_eq!(mount_path("/var/cache/tuneq"), Ok(()));
        // The probe's example: `/a:b`.
        assert!(refused(mount_path("/a:b")).contains("`:`"));
        assert!(mount_path("models").is_err());
        assert!(mount_path("/a\nb").is_err());
    }

    #[test]
    fn integers() {
        assert_eq!(integer("8"), Ok(()));
        assert_eq!(integer("-3"), Ok(()));
        // The probe's example: `Gt` with `abc`.
        assert!(integer("abc").is_err());
        assert!(integer("1.5").is_err());
        assert!(integer("99999999999999999999").is_err());
    }

    #[test]
    fn image_references() {
        let digest = format!("sha256:{}", "0a".repeat(32));
        let ok = [
            "example.com/tuneq:0.1.0".to_string(),
            "ghcr.io/tuneq/tuneq:v1.2.3-rc_1".to_string(),
            "localhost:5000/tuneq:1".to_string(),
            "localhost/tuneq:1".to_string(),
            "tuneq:1".to_string(),
            "registry.example.com:443/a/b__c/d-e.f:1".to_string(),
            "[::1]:5000/tuneq:1".to_string(),
            format!("example.com/tuneq@{digest}"),
            format!("example.com/tuneq:1@{digest}"),
        ];
        for r in &ok {
            assert_eq!(image_reference(r), Ok(()), "{r}");
        }
        // The probe's example: `@sha256:xyz`.
        assert!(refused(image_reference("example.com/tuneq@sha256:xyz")).contains("sha256"));
        let bad = [
            format!("example.com/tuneq@sha512:{}", "0".repeat(128)),
            format!("example.com/tuneq@sha256:{}", "0A".repeat(32)),
            "example.com/Tuneq:1".into(),
            "example.com/tuneq:-1".into(),
            format!("example.com/tuneq:{}", "1".repeat(129)),
            "example.com/tuneq:".into(),
            "exa_mple.com/tuneq:1".into(),
            "example.com:x/tuneq:1".into(),
            "example.com//tuneq:1".into(),
            "example.com/tu..neq:1".into(),
            "a b:1".into(),
            ":1".into(),
        ];
        for r in &bad {
            assert!(image_reference(r).is_err(), "{r}");
        }
    }

    #[test]
    fn pinned_images() {
        assert!(image_pinned("example.com/tuneq:0.1.0"));
        assert!(image_pinned("example.com/tuneq@sha256:abc"));
        assert!(!image_pinned("example.com/tuneq:latest"));
        assert!(!image_pinned("example.com/tuneq"));
        // A registry port is no tag.
        assert!(!image_pinned("example.com:5000/tuneq"));
        assert!(image_pinned("example.com:5000/tuneq:2"));
    }
}
