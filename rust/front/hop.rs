//! Which headers a proxy passes on, both ways: the twin of
//! `python/sessiongate/http/forwarding.py` (see its docstring for the rule and the RFC
//! sections), applied to requests the front relays (`upstream.rs`) and to the replies it
//! relays back (`reply.rs`).

/// Never forwarded in either direction: hop-by-hop fields, the framing the sender
/// recomputes, and `Expect` (the gateway answers it itself).
pub const HOP_BY_HOP: [&str; 15] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "http2-settings",
    "expect",
    "host",
    "content-length",
    "content-encoding",
    "accept-encoding",
];

/// Reply headers the answering server sets itself: never relayed from an upstream.
pub const OWN_REPLY_HEADERS: [&str; 2] = ["date", "server"];

/// The elements of a comma-separated field value (RFC 9110 §5.6.1), trimmed of spaces and
/// tabs; empty elements are skipped.
pub fn header_list(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value
        .split(|&b| b == b',')
        .map(trim_ows)
        .filter(|item| !item.is_empty())
}

fn trim_ows(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = s {
        s = rest;
    }
    s
}

/// The field names the `Connection` headers (all of them) list, lowercased.
pub fn connection_named<'h, I>(headers: I) -> Vec<Vec<u8>>
where
    I: Iterator<Item = (&'h [u8], &'h [u8])>,
{
    let mut named = Vec::new();
    for (name, value) in headers {
        if name.eq_ignore_ascii_case(b"connection") {
            named.extend(header_list(value).map(<[u8]>::to_ascii_lowercase));
        }
    }
    named
}

/// Whether a request header is forwarded, given what the request's `Connection` named.
pub fn forwarded(name: &[u8], named: &[Vec<u8>]) -> bool {
    !HOP_BY_HOP
        .iter()
        .any(|drop| name.eq_ignore_ascii_case(drop.as_bytes()))
        && !named.iter().any(|n| name.eq_ignore_ascii_case(n))
}

/// Whether a reply header is relayed, given what the reply's `Connection` named.
pub fn relayed(name: &[u8], named: &[Vec<u8>]) -> bool {
    forwarded(name, named)
        && !OWN_REPLY_HEADERS
            .iter()
            .any(|own| name.eq_ignore_ascii_case(own.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_are_split_trimmed_and_empty_items_skipped() {
        let items: Vec<&[u8]> = header_list(b" a,\tB ,, c\t, ").collect();
        assert_eq!(items, [&b"a"[..], b"B", b"c"]);
        assert_eq!(header_list(b"").count(), 0);
    }

    #[test]
    fn connection_named_fields_are_dropped() {
        let headers = [
            (&b"Connection"[..], &b"keep-alive, X-Hop"[..]),
            (b"connection", b"x-other"),
            (b"X-Hop", b"secret"),
        ];
        let named = connection_named(headers.iter().copied());
        assert_eq!(
            named,
            [
                b"keep-alive".to_vec(),
                b"x-hop".to_vec(),
                b"x-other".to_vec()
            ]
        );
        assert!(!forwarded(b"x-HOP", &named));
        assert!(!forwarded(b"X-Other", &named));
        assert!(!forwarded(b"Upgrade", &[]));
        assert!(!forwarded(b"expect", &[]));
        assert!(forwarded(b"x-kept", &named));
        assert!(!relayed(b"Server", &[]));
        assert!(relayed(b"content-type", &[]));
    }
}
