//! What the compiled front does with a request: the twin of
//! `python/sessiongate/front/routes.py::front_decision`. Stateless "proxy" requests it
//! serves itself; the other requests of the gateway's API go to Python as requests
//! ("dispatch"); the rest (other methods, the documentation pages, odd targets) take the
//! whole connection to the Python server ("handoff").
//!
//! The engine routes (`/workers`, `/add_worker`, ...) and the Gateway's fan-out routes
//! (`/flush_cache`, `/engine_metrics`) are dispatched like every other API route: they are
//! answered by the process that owns the engine registry, never relayed to one engine.

/// The one chat path whose session headers make it a session turn.
pub const CHAT_PATH: &[u8] = b"/v1/chat/completions";
const PROXY_PREFIX: &[u8] = b"/v1/";
/// SGLang's native generation route, relayed like `/v1/...` (`routes.py::GENERATE_PATH`).
const GENERATE_PATH: &[u8] = b"/generate";
/// Served by FastAPI through the ASGI server (`routes.py::DOCS_PATHS`).
const DOCS_PATHS: [&[u8]; 2] = [b"/openapi.json", b"/docs"];
/// smg's RL control plane (`routes.py::RL_PATH`, `RL_PREFIX`): under `/v1/` but never
/// relayed; the connection goes to Python, whose server sees a client that leaves (its
/// control calls are then cancelled).
const RL_PATH: &[u8] = b"/v1/rl";
const RL_PREFIX: &[u8] = b"/v1/rl/";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// A stateless proxy request: relayed upstream by the front.
    Proxy,
    /// A request Python answers, the connection staying with the front.
    Dispatch,
    /// Anything else: the connection goes to Python.
    Handoff,
}

impl Decision {
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::Proxy => "proxy",
            Decision::Dispatch => "dispatch",
            Decision::Handoff => "handoff",
        }
    }
}

/// The path of a request target: up to the first "?", neither decoded nor normalised (the
/// Python side routes on the raw path too).
pub fn target_path(target: &[u8]) -> &[u8] {
    match target.iter().position(|&b| b == b'?') {
        Some(end) => &target[..end],
        None => target,
    }
}

/// A byte RFC 3986 allows in an origin-form target (path and query): unreserved,
/// sub-delims, ":", "@", "/", "?" and "%". Targets with others go to the Python server,
/// whose parser decides what they mean.
fn target_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@/?%".contains(&b)
}

/// The routing decision. `has_session` says whether a session header is present; it is only
/// asked for a POST to the chat path, the one route where it matters.
pub fn decide(method: &[u8], target: &[u8], has_session: impl FnOnce() -> bool) -> Decision {
    let is_post = method == b"POST";
    let is_get = method == b"GET";
    if !(is_post || is_get || method == b"DELETE") {
        return Decision::Handoff;
    }
    // An odd target (non-ASCII bytes, say) is Python's to judge, whatever its route.
    if !target.starts_with(b"/") || !target.iter().all(|&b| target_byte(b)) {
        return Decision::Handoff;
    }
    let path = target_path(target);
    if path == RL_PATH || path.starts_with(RL_PREFIX) {
        return Decision::Handoff;
    }
    if (is_post || is_get)
        && (path.starts_with(PROXY_PREFIX) || path == GENERATE_PATH)
        && !(is_post && path == CHAT_PATH && has_session())
    {
        return Decision::Proxy;
    }
    if DOCS_PATHS.contains(&path) {
        return Decision::Handoff;
    }
    Decision::Dispatch
}

/// Whether a session header is present, as `routes.py::header_session_id` sees it: the first
/// configured name that is present decides, and it counts only with a non-empty value; names
/// compare case-insensitively and, as in the dict Python builds, the last duplicate wins.
///
/// `names` must already be lowercased as Python's `str.lower()` does. Header names from the
/// wire are ASCII tokens, whose lowercase is the ASCII one, so an ASCII-insensitive compare
/// against the lowered name is exact.
pub fn has_session_header<'h, I>(headers: I, names: &[Vec<u8>]) -> bool
where
    I: DoubleEndedIterator<Item = (&'h [u8], &'h [u8])> + Clone,
{
    for name in names {
        let last = headers
            .clone()
            .rev()
            .find(|(header, _)| header.eq_ignore_ascii_case(name));
        if let Some((_, value)) = last {
            // An empty value is as good as absent: the next name is consulted.
            if !value.is_empty() {
                return true;
            }
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<Vec<u8>> {
        ["x-session-id", "x-smg-routing-key"]
            .iter()
            .map(|n| n.as_bytes().to_vec())
            .collect()
    }

    fn route(method: &str, target: &str, headers: &[(&str, &str)]) -> Decision {
        let pairs: Vec<(&[u8], &[u8])> = headers
            .iter()
            .map(|(k, v)| (k.as_bytes(), v.as_bytes()))
            .collect();
        let names = names();
        decide(method.as_bytes(), target.as_bytes(), || {
            has_session_header(pairs.iter().copied(), &names)
        })
    }

    #[test]
    fn stateless_v1_requests_are_proxied() {
        assert_eq!(route("POST", "/v1/chat/completions", &[]), Decision::Proxy);
        assert_eq!(route("GET", "/v1/models", &[]), Decision::Proxy);
        assert_eq!(route("POST", "/v1/completions?x=1", &[]), Decision::Proxy);
        assert_eq!(route("GET", "/v1/", &[]), Decision::Proxy);
        assert_eq!(route("POST", "/generate", &[]), Decision::Proxy);
        assert_eq!(route("GET", "/generate?x=1", &[]), Decision::Proxy);
        // The query is not part of the path.
        assert_eq!(
            route("POST", "/v1/chat/completions?a=/b", &[]),
            Decision::Proxy
        );
    }

    #[test]
    fn the_api_python_answers_is_dispatched() {
        for (method, target) in [
            ("GET", "/health"),
            ("GET", "/metrics"),
            ("POST", "/sessions"),
            ("GET", "/sessions/abc"),
            ("DELETE", "/sessions/abc"),
            ("GET", "/sessions/abc/v1/models"),
            ("POST", "/sessions/a%2Fb/v1/chat/completions?x=1"),
            ("GET", "/v1"),
            ("GET", "/V1/models"),
            ("DELETE", "/v1/models"),
            ("GET", "/nowhere"),
            ("GET", "/openapi.json/x"),
            ("DELETE", "/generate"),
            ("POST", "/generate/x"),
            ("POST", "/Generate"),
            // Not decoded: "%2F" is not a slash.
            ("GET", "/v1%2Fmodels"),
            // The Gateway's fan-out routes: Python sends them to every engine.
            ("POST", "/flush_cache"),
            ("GET", "/flush_cache?timeout=5"),
            ("GET", "/engine_metrics"),
        ] {
            assert_eq!(
                route(method, target, &[]),
                Decision::Dispatch,
                "{method} {target}"
            );
        }
    }

    #[test]
    fn the_rl_control_plane_is_handed_off() {
        for (method, target) in [
            ("GET", "/v1/rl"),
            ("GET", "/v1/rl/workers"),
            (
                "POST",
                "/v1/rl/engine/pause_generation?selector=engine%3Dsglang",
            ),
            ("DELETE", "/v1/rl/workers/x"),
        ] {
            assert_eq!(
                route(method, target, &[]),
                Decision::Handoff,
                "{method} {target}"
            );
        }
        // Only the plane's own path: a longer name under /v1/ is still relayed.
        assert_eq!(route("GET", "/v1/rlx", &[]), Decision::Proxy);
    }

    #[test]
    fn everything_else_is_handed_off() {
        for (method, target) in [
            ("get", "/v1/models"),
            ("HEAD", "/v1/models"),
            ("HEAD", "/health"),
            ("HEAD", "/engine_metrics"),
            ("PUT", "/v1/models"),
            ("OPTIONS", "/sessions"),
            ("GET", "?/v1/models"),
            ("GET", "http://host/v1/models"),
            ("GET", "*"),
            ("GET", "/openapi.json"),
            ("GET", "/docs"),
            ("GET", "/docs?x"),
            ("POST", "/docs"),
            ("GET", "/sessions/a b"),
            ("GET", "/sessions/a\"b"),
            ("GET", "/sessions/{x}"),
            ("GET", "/v1/caf\u{e9}"),
            ("POST", "/v1/chat/completions?q=\"x\""),
            ("GET", "/v1/{x}"),
        ] {
            assert_eq!(
                route(method, target, &[]),
                Decision::Handoff,
                "{method} {target}"
            );
        }
    }

    #[test]
    fn session_headers_make_a_chat_post_a_session_turn() {
        let chat = "/v1/chat/completions";
        assert_eq!(
            route("POST", chat, &[("X-Session-ID", "s")]),
            Decision::Dispatch
        );
        assert_eq!(
            route("POST", chat, &[("x-smg-routing-key", "k")]),
            Decision::Dispatch
        );
        assert_eq!(
            route("POST", "/v1/chat/completions?q", &[("X-SESSION-ID", "s")]),
            Decision::Dispatch
        );
        // Other paths and methods ignore them.
        assert_eq!(
            route("GET", chat, &[("X-Session-ID", "s")]),
            Decision::Proxy
        );
        assert_eq!(
            route("POST", "/v1/completions", &[("X-Session-ID", "s")]),
            Decision::Proxy
        );
        assert_eq!(
            route("POST", "/v1/chat/completions/", &[("X-Session-ID", "s")]),
            Decision::Proxy
        );
        // Unconfigured names do nothing.
        assert_eq!(route("POST", chat, &[("X-Other", "s")]), Decision::Proxy);
    }

    #[test]
    fn empty_values_and_duplicates_follow_the_python_dict() {
        let chat = "/v1/chat/completions";
        assert_eq!(
            route("POST", chat, &[("X-Session-ID", "")]),
            Decision::Proxy
        );
        // An empty first name falls through to the next one.
        assert_eq!(
            route(
                "POST",
                chat,
                &[("X-Session-ID", ""), ("X-SMG-Routing-Key", "k")]
            ),
            Decision::Dispatch
        );
        // The last duplicate wins, whatever the case of its name.
        assert_eq!(
            route("POST", chat, &[("X-Session-ID", "s"), ("x-session-id", "")]),
            Decision::Proxy
        );
        assert_eq!(
            route("POST", chat, &[("X-Session-ID", ""), ("x-session-id", "s")]),
            Decision::Dispatch
        );
    }
}
