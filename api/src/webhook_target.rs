//! Webhook targets: which URLs the server may deliver to. The SSRF guard: a target must
//! be `https://` to a host whose every address is public (no loopback, private,
//! link-local — cloud metadata lives there — CGNAT, multicast or reserved ranges). The
//! URL is checked when a job is created (`check_url`) and the resolved addresses again
//! at every try (`is_public`, see `webhooks`). An operator whose receivers are on a
//! private network allows private targets (and plain `http://`) with
//! [`WebhookPolicy::allow_private`].

use std::net::{IpAddr, Ipv4Addr};

/// Longest accepted webhook URL.
const MAX_URL_LEN: usize = 2048;
/// Which webhook targets the server accepts.
#[derive(Debug, Clone, Default)]
pub struct WebhookPolicy {
    /// Also private, loopback and link-local addresses, and plain `http://`: for
    /// receivers on the operator's own network (and tests). Off by default.
    pub allow_private: bool,
}

/// Checks a webhook URL given at create: the reason it is refused, if it is.
pub(crate) fn check_url(raw: &str, policy: &WebhookPolicy) -> Result<url::Url, String> {
    if raw.len() > MAX_URL_LEN {
        return Err(format!(
            "webhook_url is longer than {MAX_URL_LEN} characters."
        ));
    }
    let url = url::Url::parse(raw).map_err(|e| format!("webhook_url is not a URL: {e}."))?;
    match url.scheme() {
        "https" => {}
        "http" if policy.allow_private => {}
        "http" => return Err("webhook_url must use https://.".into()),
        other => return Err(format!("webhook_url must use https://, not {other}://.")),
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(
            "webhook_url must not carry credentials; put a token in the path or query.".into(),
        );
    }
    let Some(host) = url.host() else {
        return Err("webhook_url has no host.".into());
    };
    if policy.allow_private {
        return Ok(url);
    }
    match host {
        url::Host::Ipv4(ip) if !is_public(IpAddr::V4(ip)) => Err(format!(
            "webhook_url points at {ip}, which is not a public address."
        )),
        url::Host::Ipv6(ip) if !is_public(IpAddr::V6(ip)) => Err(format!(
            "webhook_url points at {ip}, which is not a public address."
        )),
        url::Host::Domain(name) if is_internal_name(name) => Err(format!(
            "webhook_url points at {name}, which is not a public host."
        )),
        _ => Ok(url),
    }
}

/// Host names that only ever mean something inside a network.
fn is_internal_name(name: &str) -> bool {
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    name == "localhost"
        || [
            ".localhost",
            ".local",
            ".internal",
            ".localdomain",
            ".home.arpa",
        ]
        .iter()
        .any(|suffix| name.ends_with(suffix))
        || !name.contains('.')
}

/// Whether `ip` is reachable on the public internet (and so a fair webhook target).
/// IPv6 forms that carry an IPv4 address (mapped, compatible, translated, NAT64, 6to4,
/// Teredo) are
/// not public whatever they carry: a relay or translator may deliver them to the
/// embedded address, which is how a guard that reads only the v6 bits is walked around.
pub(crate) fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(ip) => is_public_v4(ip),
        IpAddr::V6(ip) => {
            if let Some(v4) = ip.to_ipv4_mapped() {
                return is_public_v4(v4);
            }
            let s = ip.segments();
            !(ip.is_unspecified()
                || ip.is_loopback()
                || ip.is_multicast()
                // Reserved 0000::/16: IPv4-compatible (::/96), IPv4-translated
                // (::ffff:0:0/96, SIIT), and nothing that is routed on the internet.
                || s[0] == 0
                || (s[0] == 0x64 && s[1] == 0xff9b) // NAT64: 64:ff9b::/96 and 64:ff9b:1::/48
                || s[0] == 0x2002 // 6to4
                || (s[0] == 0x2001 && s[1] == 0) // Teredo (2001::/32)
                || (s[0] == 0x2001 && s[1] < 0x0200) // IETF protocol assignments (2001::/23)
                || (s[0] & 0xfe00) == 0xfc00 // unique local
                || (s[0] & 0xffc0) == 0xfe80 // link-local
                || (s[0] & 0xffc0) == 0xfec0 // site-local (deprecated)
                || (s[0] == 0x2001 && s[1] == 0x0db8) // documentation
                || (s[0] == 0x3fff && s[1] < 0x1000) // documentation (3fff::/20)
                || (s[0] == 0x0100 && s[1..4] == [0, 0, 0])) // discard-only
        }
    }
}

fn is_public_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    !(ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local()
        || ip.is_broadcast()
        || ip.is_multicast()
        || ip.is_documentation()
        || a == 0
        || (a == 100 && (64..128).contains(&b)) // carrier-grade NAT
        || (a == 192 && b == 0 && c == 0) // IETF protocol assignments
        || (a == 192 && b == 88 && c == 99) // 6to4 relay anycast (deprecated)
        || (a == 198 && (18..20).contains(&b)) // benchmarking
        || a >= 240) // reserved
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn only_public_addresses_are_targets() {
        for private in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "255.255.255.255",
            "224.0.0.1",
            "198.18.0.1",
            "240.0.0.1",
            "::1",
            "::",
            "fd00::1",
            "fe80::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "64:ff9b::a00:1",
            "2001:db8::1",
            "ff02::1",
            "192.88.99.1",
            "::7f00:1",
            "::a9fe:a9fe",
            "64:ff9b:1::a00:1",
            "64:ff9b::808:808",
            "2002:7f00:1::",
            "2002:808:808::1",
            "2001:0:4136:e378:8000:63bf:3fff:fdd2",
            "fec0::1",
            "3fff::1",
            // IPv4-translated (SIIT, ::ffff:0:0/96): 169.254.169.254 and 127.0.0.1,
            // and one carrying a public address (a translator decides where it goes).
            "::ffff:0:a9fe:a9fe",
            "::ffff:0:7f00:1",
            "::ffff:0:808:808",
            "::1:2:3:4",
        ] {
            assert!(!is_public(private.parse().unwrap()), "{private}");
        }
        for public in ["8.8.8.8", "1.1.1.1", "2606:4700::1111", "::ffff:8.8.8.8"] {
            assert!(is_public(public.parse().unwrap()), "{public}");
        }
    }

    #[test]
    fn urls_are_checked_before_a_job_is_accepted() {
        let strict = WebhookPolicy::default();
        assert!(check_url("https://hooks.example.com/tuneq?token=x", &strict).is_ok());
        for (bad, why) in [
            ("http://hooks.example.com/", "https"),
            ("ftp://hooks.example.com/", "https"),
            ("https://127.0.0.1/", "public"),
            ("https://[::1]:8443/", "public"),
            ("https://169.254.169.254/latest/meta-data", "public"),
            ("https://localhost/", "public"),
            ("https://metadata.google.internal/", "public"),
            ("https://[::ffff:0:a9fe:a9fe]/", "public"),
            ("https://[::ffff:0:7f00:1]/", "public"),
            ("https://printer/", "public"),
            ("https://user:pass@hooks.example.com/", "credentials"),
            ("not a url", "not a URL"),
        ] {
            let reason = check_url(bad, &strict).unwrap_err();
            assert!(reason.contains(why), "{bad}: {reason}");
        }
        let open = WebhookPolicy {
            allow_private: true,
        };
        assert!(check_url("http://127.0.0.1:9000/hook", &open).is_ok());
        assert!(check_url("ftp://127.0.0.1/", &open).is_err());
        // A backslash is a path separator to the url crate: the host is example.com,
        // and the URL kept is the one that will be called.
        let url = check_url("https://example.com\\@127.0.0.1/", &strict).unwrap();
        assert_eq!(url.host_str(), Some("example.com"));
        assert_eq!(url.as_str(), "https://example.com/@127.0.0.1/");
    }
}
