"""The compiled front's routing decision equals the specification (twin rule).

`server/routes.py::served_by_front` (built on `classify`, the one URL contract) says which
requests the compiled front answers itself; `_core.front_route` (rust/front/route.rs) is the
decision the Rust server makes. Generated request lines and headers must get the same
answer from both.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiongate._core import front_route
from sessiongate.server.routes import DEFAULT_SESSION_HEADERS, served_by_front

SESSION_HEADERS = list(DEFAULT_SESSION_HEADERS)


def spec(method: str, target: str, headers: list[tuple[str, str]], names: list[str]) -> str:
    # Python's front end classifies the raw path without its query (asgi.py).
    path = target.partition("?")[0]
    lowered = [(k.lower(), v) for k, v in headers]
    return "proxy" if served_by_front(method, path, lowered, names) else "handoff"


CASES = [
    ("POST", "/v1/chat/completions", [], "proxy"),
    ("GET", "/v1/models", [], "proxy"),
    ("POST", "/v1/completions?x=1", [], "proxy"),
    ("HEAD", "/v1/models", [], "handoff"),
    ("PUT", "/v1/models", [], "handoff"),
    ("post", "/v1/chat/completions", [], "handoff"),
    ("POST", "/v1/chat/completions", [("X-Session-ID", "abc")], "handoff"),
    ("POST", "/v1/chat/completions", [("x-session-id", "")], "proxy"),
    ("POST", "/v1/chat/completions", [("X-CORRELATION-ID", "s1")], "handoff"),
    # A session header only names a session on the chat path.
    ("POST", "/v1/completions", [("X-Session-ID", "abc")], "proxy"),
    ("GET", "/v1/chat/completions", [("X-Session-ID", "abc")], "proxy"),
    ("POST", "/v1/chat/completions?stream=1", [("X-Session-ID", "abc")], "handoff"),
    ("POST", "/v1", [], "handoff"),
    ("GET", "/health", [], "handoff"),
    ("POST", "/sessions", [], "handoff"),
    ("POST", "/sessions/abc/v1/chat/completions", [], "handoff"),
    ("GET", "/v1/../sessions", [], "proxy"),
    ("GET", "//v1/models", [], "handoff"),
]


@pytest.mark.parametrize(("method", "target", "headers", "expected"), CASES)
def test_known_requests(
    method: str, target: str, headers: list[tuple[str, str]], expected: str
) -> None:
    assert spec(method, target, headers, SESSION_HEADERS) == expected
    assert front_route(method, target, headers, SESSION_HEADERS) == expected


def test_configured_session_headers_replace_the_defaults() -> None:
    names = ["X-Trace"]
    headers = [("X-Session-ID", "abc")]
    assert front_route("POST", "/v1/chat/completions", headers, names) == "proxy"
    assert front_route("POST", "/v1/chat/completions", [("x-trace", "t")], names) == "handoff"


METHODS = st.sampled_from(["GET", "POST", "HEAD", "PUT", "DELETE", "get", "Post", "PATCH"])
SEGMENTS = st.sampled_from(
    ["v1", "chat", "completions", "models", "sessions", "health", "metrics", "", "V1", "%2F"]
)
PATHS = st.one_of(
    st.sampled_from(["/v1/chat/completions", "/v1/models", "/health", "/sessions", "/v1"]),
    st.lists(SEGMENTS, min_size=0, max_size=4).map(lambda parts: "/" + "/".join(parts)),
    st.text(alphabet="/v1chatompletinsd?=&%", max_size=30),
)
QUERIES = st.one_of(st.just(""), st.text(alphabet="ab=&?/", max_size=8).map(lambda q: "?" + q))
NAMES = st.sampled_from(
    [*DEFAULT_SESSION_HEADERS, "x-session-id", "X-SESSION-ID", "content-type", "X-Other"]
)
HEADERS = st.lists(st.tuples(NAMES, st.sampled_from(["", "s1", "a b", "0"])), max_size=5)
NAME_LISTS = st.one_of(
    st.just(SESSION_HEADERS),
    st.lists(st.sampled_from([*DEFAULT_SESSION_HEADERS, "X-Other"]), min_size=1, max_size=3),
)


@settings(max_examples=2000, deadline=None)
@given(method=METHODS, path=PATHS, query=QUERIES, headers=HEADERS, names=NAME_LISTS)
def test_compiled_decision_equals_the_specification(
    method: str, path: str, query: str, headers: list[tuple[str, str]], names: list[str]
) -> None:
    target = path + query
    assert front_route(method, target, headers, names) == spec(method, target, headers, names)
