//! Bytes the front writes to clients: relayed reply heads, chunk framing, JSON errors.

use hyper::{HeaderMap, StatusCode};

use super::hop::{connection_named, relayed};

/// How a relayed body is framed towards the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// 1xx, 204, 304: no body at all.
    Empty,
    Length(u64),
    Chunked,
}

/// Statuses whose replies never carry a body.
pub fn bodiless(status: u16) -> bool {
    status < 200 || status == 204 || status == 304
}

fn status_line(out: &mut Vec<u8>, status: u16) {
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.to_string().as_bytes());
    out.push(b' ');
    let reason = StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("");
    out.extend_from_slice(reason.as_bytes());
    out.extend_from_slice(b"\r\n");
}

fn header(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// The framing and connection headers the front sets, then the blank line.
fn end_head(out: &mut Vec<u8>, framing: Framing, close: bool) {
    match framing {
        Framing::Empty => {}
        Framing::Length(n) => header(out, b"content-length", n.to_string().as_bytes()),
        Framing::Chunked => header(out, b"transfer-encoding", b"chunked"),
    }
    if close {
        header(out, b"connection", b"close");
    }
    out.extend_from_slice(b"\r\n");
}

/// The head of a relayed upstream reply, appended to `out`.
pub fn relay_head(
    out: &mut Vec<u8>,
    status: u16,
    headers: &HeaderMap,
    framing: Framing,
    close: bool,
) {
    status_line(out, status);
    let named = connection_named(
        headers
            .get_all(hyper::header::CONNECTION)
            .iter()
            .map(|v| (&b"connection"[..], v.as_bytes())),
    );
    for (name, value) in headers {
        if relayed(name.as_str().as_bytes(), &named) {
            header(out, name.as_str().as_bytes(), value.as_bytes());
        }
    }
    end_head(out, framing, close);
}

/// Headers of a Python reply the front writes itself (framing, connection).
const FRAMING_HEADERS: [&[u8]; 3] = [b"content-length", b"transfer-encoding", b"connection"];

/// The head of a reply from Python (`dispatch.rs`; names lowercased), appended to `out`.
pub fn app_head(
    out: &mut Vec<u8>,
    status: u16,
    headers: &[(Vec<u8>, Vec<u8>)],
    framing: Framing,
    close: bool,
) {
    status_line(out, status);
    for (name, value) in headers {
        if !FRAMING_HEADERS.contains(&name.as_slice()) {
            header(out, name, value);
        }
    }
    end_head(out, framing, close);
}

/// One chunk of a chunked body (`data` must not be empty: that is the terminator).
pub fn chunk(out: &mut Vec<u8>, data: &[u8]) {
    chunk_size(out, data.len());
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

/// The size line of a chunk whose data (and CRLF) the caller writes.
pub fn chunk_size(out: &mut Vec<u8>, len: usize) {
    out.extend_from_slice(format!("{len:x}\r\n").as_bytes());
}

pub const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// A complete `{"error": message}` reply, as the Python server writes its own errors.
pub fn error(status: u16, message: &str, close: bool) -> Vec<u8> {
    // A map with one string member cannot fail to serialise; the fallback is unreachable.
    let body = serde_json::to_vec(&serde_json::json!({ "error": message }))
        .unwrap_or_else(|_| b"{}".to_vec());
    let mut out = Vec::with_capacity(160 + body.len());
    status_line(&mut out, status);
    header(&mut out, b"content-type", b"application/json");
    header(
        &mut out,
        b"content-length",
        body.len().to_string().as_bytes(),
    );
    if close {
        header(&mut out, b"connection", b"close");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(&body);
    out
}

/// `format(x, "g")` of Python: 6 significant digits, trailing zeros dropped, exponent form
/// below 1e-4 and from 1e6. Error messages quote configured timeouts this way.
pub fn fmt_g(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf" } else { "-inf" }.into();
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0" } else { "0" }.into();
    }
    // The exponent after rounding to 6 significant digits decides the notation.
    let sci = format!("{x:.5e}");
    let (mantissa, exp) = match sci.split_once('e') {
        Some((m, e)) => (m, e.parse::<i32>().unwrap_or(0)),
        None => (sci.as_str(), 0),
    };
    if (-4..6).contains(&exp) {
        let digits = usize::try_from(5 - exp).unwrap_or(0);
        strip_zeros(&format!("{x:.digits$}")).to_string()
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{}e{sign}{:02}", strip_zeros(mantissa), exp.abs())
    }
}

fn strip_zeros(s: &str) -> &str {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.')
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fmt_g_matches_python() {
        for (x, want) in [
            (2.0, "2"),
            (0.5, "0.5"),
            (10.0, "10"),
            (1.0, "1"),
            (0.1, "0.1"),
            (2.5, "2.5"),
            (100.0, "100"),
            (123456.0, "123456"),
            (1234567.0, "1.23457e+06"),
            (1e6, "1e+06"),
            (999999.0, "999999"),
            (9999995.0, "1e+07"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1e100, "1e+100"),
            (0.333333333, "0.333333"),
            (2.0 / 3.0, "0.666667"),
            (-2.5, "-2.5"),
            (0.0, "0"),
            (f64::INFINITY, "inf"),
            (f64::NAN, "nan"),
        ] {
            assert_eq!(fmt_g(x), want, "{x}");
        }
    }

    #[test]
    fn error_reply_is_compact_json_without_ascii_escapes() {
        let out = error(502, "bad \"x\" é", true);
        let text = String::from_utf8(out).unwrap_or_default();
        assert!(text.starts_with("HTTP/1.1 502 Bad Gateway\r\n"));
        assert!(text.contains("content-type: application/json\r\n"));
        assert!(text.contains("connection: close\r\n"));
        let body = "{\"error\":\"bad \\\"x\\\" é\"}";
        assert!(text.contains(&format!("content-length: {}\r\n", body.len())));
        assert!(text.contains("\r\n\r\n{"));
        assert!(text.ends_with(body));
    }

    #[test]
    fn relayed_head_drops_hop_by_hop_and_own_headers() {
        let mut headers = HeaderMap::new();
        for (k, v) in [
            ("content-type", "text/event-stream"),
            ("date", "x"),
            ("server", "engine"),
            ("connection", "keep-alive, x-up-hop"),
            ("x-up-hop", "1"),
            ("content-length", "5"),
            ("x-request-id", "7"),
        ] {
            headers.append(
                hyper::header::HeaderName::from_static(k),
                hyper::header::HeaderValue::from_static(v),
            );
        }
        let mut out = Vec::new();
        relay_head(&mut out, 200, &headers, Framing::Chunked, false);
        assert_eq!(
            out,
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-request-id: 7\r\n\
              transfer-encoding: chunked\r\n\r\n"
        );
        let mut out = Vec::new();
        relay_head(&mut out, 204, &HeaderMap::new(), Framing::Empty, true);
        assert_eq!(out, b"HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n");
    }
}
