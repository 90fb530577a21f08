//! Whether a parsed request head can take the fast path, as the Python server would see it:
//! anything it would answer differently (413, 401, 400 for a missing or repeated Host,
//! chunked bodies, `Expect`) is left to it by handing the connection off. An `Upgrade` offer
//! is not: the gateway never upgrades, so it serves such a request as a plain one (the
//! header is hop-by-hop and never forwarded), exactly as the Python server does.

/// What the fast path needs from a head that qualifies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fast {
    /// The body length (no Content-Length: no body).
    pub content_length: u64,
    /// The client sent `Connection: close`.
    pub close: bool,
}

/// `Some` when the head qualifies for the fast path. `version` is httparse's minor version.
pub fn check<'h, I>(version: u8, headers: I, max_body: u64, api_key: Option<&[u8]>) -> Option<Fast>
where
    I: Iterator<Item = (&'h str, &'h [u8])>,
{
    if version != 1 {
        return None;
    }
    let mut content_length = None;
    let mut close = false;
    let mut authorization = None;
    let mut hosts = 0;
    for (name, value) in headers {
        let is = |s: &str| name.eq_ignore_ascii_case(s);
        if is("transfer-encoding") || is("expect") {
            return None;
        }
        if is("host") {
            hosts += 1;
        } else if is("content-length") {
            if content_length.is_some() {
                return None;
            }
            content_length = Some(parse_digits(value)?);
        } else if is("connection") {
            close |= value
                .split(|&b| b == b',')
                .any(|token| token.trim_ascii().eq_ignore_ascii_case(b"close"));
        } else if is("authorization") && authorization.is_none() {
            // The first one, as the Python check reads it.
            authorization = Some(value);
        }
    }
    // RFC 9112 §3.2: exactly one Host (Python answers the 400).
    if hosts != 1 {
        return None;
    }
    let content_length = content_length.unwrap_or(0);
    if content_length > max_body {
        return None;
    }
    if let Some(key) = api_key {
        if !authorized(authorization.unwrap_or(b""), key) {
            return None;
        }
    }
    Some(Fast {
        content_length,
        close,
    })
}

/// A Content-Length value: one or more ASCII digits that fit a u64.
fn parse_digits(value: &[u8]) -> Option<u64> {
    if value.is_empty() {
        return None;
    }
    value.iter().try_fold(0u64, |acc, &b| {
        if !b.is_ascii_digit() {
            return None;
        }
        acc.checked_mul(10)?.checked_add(u64::from(b - b'0'))
    })
}

/// `Authorization: Bearer <key>`, checked as `front/asgi.py::_check_auth` does: split at the
/// first space, the scheme compared case-insensitively, the token in constant time.
fn authorized(value: &[u8], key: &[u8]) -> bool {
    let (scheme, token) = match value.iter().position(|&b| b == b' ') {
        Some(space) => (&value[..space], &value[space + 1..]),
        None => (value, &b""[..]),
    };
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return false;
    }
    // Python compares `token.encode()` of the latin-1 decoded value: the wire bytes as
    // latin-1 code points re-encoded as UTF-8.
    if token.is_ascii() {
        constant_time_eq(token, key)
    } else {
        let text: String = token.iter().map(|&b| char::from(b)).collect();
        constant_time_eq(text.as_bytes(), key)
    }
}

/// Equal bytes, in a time that depends on the lengths only (like `hmac.compare_digest`).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    // Keeps the compiler from turning the fold into an early-exit comparison.
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `check` of `headers` plus one Host.
    fn run(version: u8, headers: &[(&str, &str)], max: u64, key: Option<&str>) -> Option<Fast> {
        let host = [("Host", "front")];
        check(
            version,
            host.iter().chain(headers).map(|(k, v)| (*k, v.as_bytes())),
            max,
            key.map(str::as_bytes),
        )
    }

    #[test]
    fn plain_requests_qualify() {
        assert_eq!(
            run(1, &[], 10, None),
            Some(Fast {
                content_length: 0,
                close: false
            })
        );
        assert_eq!(
            run(
                1,
                &[
                    ("Content-Length", "10"),
                    ("Connection", "keep-alive, Close")
                ],
                10,
                None
            ),
            Some(Fast {
                content_length: 10,
                close: true
            })
        );
    }

    #[test]
    fn other_framing_and_versions_are_handed_off() {
        assert_eq!(run(0, &[], 10, None), None);
        assert_eq!(run(1, &[("Transfer-Encoding", "chunked")], 10, None), None);
        assert_eq!(run(1, &[("expect", "100-continue")], 10, None), None);
        // Upgrade offers are served as plain requests (the offer is not forwarded).
        assert!(run(1, &[("Upgrade", "websocket")], 10, None).is_some());
        // Exactly one Host: none or two are Python's 400.
        assert!(run(1, &[("host", "again")], 10, None).is_none());
        assert!(check(1, std::iter::empty(), 10, None).is_none());
        assert_eq!(
            run(
                1,
                &[("Content-Length", "1"), ("content-length", "1")],
                10,
                None
            ),
            None
        );
        for bad in [
            "",
            "-1",
            "+1",
            "1.0",
            "0x10",
            "1 1",
            "99999999999999999999999",
        ] {
            assert_eq!(
                run(1, &[("Content-Length", bad)], u64::MAX, None),
                None,
                "{bad:?}"
            );
        }
        assert_eq!(run(1, &[("Content-Length", "11")], 10, None), None);
    }

    #[test]
    fn api_key_is_checked_like_python() {
        let ok = |v: &str| run(1, &[("Authorization", v)], 0, Some("k3y")).is_some();
        assert!(ok("Bearer k3y"));
        assert!(ok("bEaReR k3y"));
        assert!(!ok("Bearer k3y "));
        assert!(!ok("Bearer  k3y"));
        assert!(!ok("Basic k3y"));
        assert!(!ok("Bearer"));
        assert!(!ok("k3y"));
        assert!(run(1, &[], 0, Some("k3y")).is_none());
        // The first Authorization header is the one checked.
        assert!(run(
            1,
            &[("authorization", "Bearer k3y"), ("Authorization", "x")],
            0,
            Some("k3y")
        )
        .is_some());
        // Latin-1 bytes on the wire compare as their UTF-8 encoding.
        let wire = [
            ("host", b"front".as_slice()),
            ("authorization", b"Bearer \xe9"),
        ];
        let key = "\u{e9}".as_bytes();
        assert!(check(1, wire.iter().copied(), 0, Some(key)).is_some());
        // An empty key still needs the scheme.
        assert!(run(1, &[("Authorization", "Bearer ")], 0, Some("")).is_some());
        assert!(run(1, &[], 0, Some("")).is_none());
    }
}
