"""The compiled front's routing decision equals the specification (twin rule).

`front/routes.py::front_decision` (built on `classify`, the one URL contract) says which
requests the compiled front answers itself, which it passes to Python as requests and which
connections it hands off; `_core.front_route` (rust/front/route.rs) is the decision the Rust
server makes. Generated request lines and headers must get the same answer from both.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiongate._core import front_route
from sessiongate.front.routes import DEFAULT_SESSION_HEADERS, front_decision

SESSION_HEADERS = list(DEFAULT_SESSION_HEADERS)


def spec(method: str, target: str, headers: list[tuple[str, str]], names: list[str]) -> str:
    lowered = [(k.lower(), v) for k, v in headers]
    return front_decision(method, target, lowered, names)


CASES = [
    ("POST", "/v1/chat/completions", [], "proxy"),
    ("GET", "/v1/models", [], "proxy"),
    ("POST", "/v1/completions?x=1", [], "proxy"),
    ("HEAD", "/v1/models", [], "handoff"),
    ("PUT", "/v1/models", [], "handoff"),
    ("post", "/v1/chat/completions", [], "handoff"),
    ("POST", "/v1/chat/completions", [("X-Session-ID", "abc")], "dispatch"),
    ("POST", "/v1/chat/completions", [("x-session-id", "")], "proxy"),
    ("POST", "/v1/chat/completions", [("X-CORRELATION-ID", "s1")], "dispatch"),
    # A session header only names a session on the chat path.
    ("POST", "/v1/completions", [("X-Session-ID", "abc")], "proxy"),
    ("GET", "/v1/chat/completions", [("X-Session-ID", "abc")], "proxy"),
    ("POST", "/v1/chat/completions?stream=1", [("X-Session-ID", "abc")], "dispatch"),
    ("POST", "/v1", [], "dispatch"),
    # SGLang's native route is relayed like /v1/... (the rollout framework's rollouts).
    ("POST", "/generate", [], "proxy"),
    ("GET", "/generate?rid=1", [], "proxy"),
    ("PUT", "/generate", [], "handoff"),
    ("DELETE", "/generate", [], "dispatch"),
    ("POST", "/generate/", [], "dispatch"),
    ("GET", "/health", [], "dispatch"),
    ("HEAD", "/health", [], "handoff"),
    ("POST", "/sessions", [], "dispatch"),
    ("DELETE", "/sessions/a%2Fb", [], "dispatch"),
    ("PUT", "/sessions/abc", [], "handoff"),
    ("POST", "/sessions/abc/v1/chat/completions", [], "dispatch"),
    ("GET", "/v1/../sessions", [], "proxy"),
    ("GET", "//v1/models", [], "dispatch"),
    ("GET", "/docs", [], "handoff"),
    ("GET", "/openapi.json?x", [], "handoff"),
    ("GET", '/sessions/a"b', [], "handoff"),
    ("GET", "/sessions/\u00e9", [], "handoff"),
    # The engine management routes (both dialects of the framework's router client): Python's.
    ("POST", "/add_worker?url=http://127.0.0.1:30001", [], "dispatch"),
    ("POST", "/remove_worker?url=http://127.0.0.1:30001", [], "dispatch"),
    ("GET", "/list_workers", [], "dispatch"),
    ("POST", "/workers", [], "dispatch"),
    ("GET", "/workers", [], "dispatch"),
    ("DELETE", "/workers/engine-0123456789ab", [], "dispatch"),
    ("DELETE", "/workers/http%3A%2F%2F127.0.0.1%3A30001", [], "dispatch"),
    ("PUT", "/workers", [], "handoff"),
    # The Gateway's fan-out routes: Python answers them from every engine of the set.
    ("POST", "/flush_cache", [], "dispatch"),
    ("GET", "/flush_cache?timeout=5", [], "dispatch"),
    ("GET", "/engine_metrics", [], "dispatch"),
    ("HEAD", "/engine_metrics", [], "handoff"),
    ("PUT", "/flush_cache", [], "handoff"),
    ("GET", "*", [], "handoff"),
    ("GET", "http://h/health", [], "handoff"),
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
    assert front_route("POST", "/v1/chat/completions", [("x-trace", "t")], names) == "dispatch"


METHODS = st.sampled_from(["GET", "POST", "HEAD", "PUT", "DELETE", "get", "Post", "PATCH"])
SEGMENTS = st.sampled_from(
    [
        *("v1", "chat", "completions", "models", "sessions", "health", "metrics", "", "V1"),
        *("%2F", "generate", "Generate", "workers", "add_worker", "list_workers"),
        *("remove_worker", "engine-0123456789ab", "flush_cache", "engine_metrics"),
    ]
)
PATHS = st.one_of(
    st.sampled_from(
        [
            *("/v1/chat/completions", "/v1/models", "/health", "/sessions", "/v1", "/generate"),
            *("/workers", "/workers/engine-0123456789ab", "/add_worker", "/list_workers"),
            *("/flush_cache", "/engine_metrics"),
        ]
    ),
    st.lists(SEGMENTS, min_size=0, max_size=4).map(lambda parts: "/" + "/".join(parts)),
    st.text(alphabet="/v1chatompletinsd?=&%", max_size=30),
    st.text(max_size=12),
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


ANY_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=6)


@settings(max_examples=400, deadline=None)
@given(
    method=METHODS | ANY_TEXT,
    target=st.tuples(
        st.sampled_from(
            ["/v1/chat/completions", "/v1/", "/v1", "/health", "/sessions/a", "/docs", "", "*"]
        ),
        st.sampled_from(["", "?", "?a=1", "/x", "x", "#f"]),
        ANY_TEXT,
    ).map("".join),
    headers=st.lists(
        st.tuples(NAMES | ANY_TEXT, st.sampled_from(["", "s1"]) | ANY_TEXT), max_size=5
    ),
    names=NAME_LISTS | st.lists(NAMES | ANY_TEXT, max_size=3),
)
def test_any_text_gets_the_same_decision(
    method: str, target: str, headers: list[tuple[str, str]], names: list[str]
) -> None:
    assert front_route(method, target, headers, names) == spec(method, target, headers, names)
