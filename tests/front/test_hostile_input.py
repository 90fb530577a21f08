"""Hostile request input gets a clear 4xx with a JSON body, never a 5xx, a traceback or a hang
(docs/reliability.md, "Bad input"; docs/api.md, "Hostile input").

Three layers: unit tests of the guards (`json_safety.py`, `front/routes.py`,
`session/request_checks.py`); property tests (hypothesis, bounded for CI) of adversarial
bodies against an in-process `SessionCore` whose upstream is a real mock engine; and the
regressions of what a hostile client found, end to end through `serve --workers 1`.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessiongate.engines.pool import EnginePool
from sessiongate.errors import BadRequest, GatewayError
from sessiongate.front.routes import classify
from sessiongate.json_safety import MAX_JSON_DEPTH
from sessiongate.protocol import CoreReply, CoreRequest, parse_json_object
from sessiongate.session.core import SessionCore
from sessiongate.session.request_checks import check_turn_fields
from sessiongate.tokenizer import load_tokenizer
from support.procs import ServerProcess, free_port, mock_engine

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

JSON_CT = {"content-type": "application/json"}
HELLO = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
DEEP = 100_000
# What a client may see from the session routes for any body (docs/api.md, "Errors").
CLIENT_STATUSES = {200, 400, 404, 413}
LEAKS = ("Traceback", "internal error", "RecursionError", "TypeError", "UnicodeEncodeError")


def nested(depth: int, open_: bytes = b"[", close: bytes = b"]") -> bytes:
    return open_ * depth + close * depth


def deep_body(where: str, depth: int = DEEP) -> bytes:
    """A chat body whose `where` ("messages" or an extra field) nests `depth` arrays."""
    if where == "messages":
        return b'{"messages":' + nested(depth) + b"}"
    return b'{"messages":[{"role":"user","content":"hi"}],"extra":' + nested(depth) + b"}"


def surrogate_body(**extra: Any) -> bytes:
    """json.dumps escapes a lone surrogate as \\ud800, exactly as a hostile client sends it."""
    body = {"messages": [{"role": "user", "content": "a\ud800b"}], "max_tokens": 4, **extra}
    return json.dumps(body).encode()


# --- unit: the JSON guard ------------------------------------------------------------------


@pytest.mark.parametrize("where", ["messages", "extra"])
def test_deep_nesting_is_refused_before_recursion(where: str) -> None:
    with pytest.raises(BadRequest, match="nested too deeply"):
        parse_json_object(deep_body(where), "request body")


def test_depth_limit_is_exact() -> None:
    # The top-level object is level 1: MAX_JSON_DEPTH - 1 arrays inside it still fit.
    fits = b'{"a":' + nested(MAX_JSON_DEPTH - 1) + b"}"
    assert parse_json_object(fits, "request body")["a"]
    with pytest.raises(BadRequest, match=f"more than {MAX_JSON_DEPTH} levels"):
        parse_json_object(b'{"a":' + nested(MAX_JSON_DEPTH) + b"}", "request body")
    objects = b'{"a":' * (MAX_JSON_DEPTH + 1) + b"1" + b"}" * (MAX_JSON_DEPTH + 1)
    with pytest.raises(BadRequest, match="nested too deeply"):
        parse_json_object(objects, "request body")
    # Unbalanced: the parser itself recurses too deep; still the same clean 400.
    with pytest.raises(BadRequest, match="nested too deeply"):
        parse_json_object(b'{"a":' + b"[" * DEEP, "request body")
    # Brackets inside strings are text, not nesting.
    assert parse_json_object(json.dumps({"a": "[" * DEEP}).encode(), "request body")


@pytest.mark.parametrize(
    ("body", "where"),
    [
        (surrogate_body(), "messages[0].content"),
        (
            b'{"messages":[{"role":"user","content":[{"type":"text","text":"\\udfff"}]}]}',
            "messages[0].content[0].text",
        ),
        (b'{"tools":[{"function":{"name":"x\\ud800"}}]}', "tools[0].function.name"),
        (b'{"chat_template_kwargs":{"k":"\\udc00"}}', "chat_template_kwargs.k"),
        (b'{"a":{"\\ud800":1}}', "a key of a"),
        # The UTF-8 bytes of a surrogate: json.loads decodes with "surrogatepass".
        (b'{"x":"\xed\xa0\x80"}', "x"),
        # UTF-16 text, which json.loads detects and accepts.
        ('{"x":"\ud800"}'.encode("utf-16", "surrogatepass"), "x"),
    ],
)
def test_lone_surrogates_are_named(body: bytes, where: str) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_json_object(body, "request body")
    assert f"request body: {where} is not valid Unicode" in caught.value.message
    # The message itself must be sendable (the error reply is UTF-8 JSON).
    caught.value.message.encode()


def test_surrogate_pairs_and_nul_are_text() -> None:
    document = parse_json_object(b'{"a":"\\ud83d\\ude00","b":"\\u0000"}', "request body")
    assert document == {"a": "\U0001f600", "b": "\x00"}


def test_check_turn_fields() -> None:
    check_turn_fields({"stream": True, "tools": [], "stream_options": {"include_usage": True}})
    check_turn_fields({"stream": None, "tools": None, "stream_options": None})
    for body, fragment in [
        ({"stream": "yes"}, "field 'stream' must be a boolean"),
        ({"stream": 1}, "field 'stream' must be a boolean"),
        ({"tools": {"type": "function"}}, "field 'tools' must be a list"),
        ({"tools": ["lookup"]}, "tools[0] must be an object"),
        ({"stream_options": "usage"}, "field 'stream_options' must be an object"),
        ({"stream_options": {"include_usage": "yes"}}, "include_usage' must be a boolean"),
    ]:
        with pytest.raises(BadRequest, match=fragment.replace("[", r"\[").replace("]", r"\]")):
            check_turn_fields(body)


# --- unit: session ids in the path -----------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/sessions/%zz", "/sessions/%e2%28", "/sessions/%", "/sessions/a%2"]
)
def test_invalid_percent_encoding_is_400(path: str) -> None:
    for suffix in ("", "/v1/chat/completions", "/samples"):
        with pytest.raises(BadRequest, match="invalid percent-encoding in the session id"):
            classify("POST" if suffix else "GET", path + suffix, [])


@pytest.mark.parametrize(
    ("quoted", "status"),
    [
        ("%00", 400),
        ("a%0Ab", 400),
        ("%7F", 400),
        ("%C3%A9", 400),  # valid UTF-8, but ids are visible ASCII
        ("a" * 100_000, 400),
        ("..", None),  # a valid (if odd) id: the core answers 404
        ("%2e%2e", None),
        ("a%2Fb", None),  # "/" inside an id is allowed percent-encoded
    ],
)
def test_odd_session_ids(quoted: str, status: int | None) -> None:
    if status is None:
        assert classify("GET", f"/sessions/{quoted}", []).op == "get"
        return
    with pytest.raises(GatewayError) as caught:
        classify("GET", f"/sessions/{quoted}", [])
    assert caught.value.status == status
    assert len(caught.value.message) < 300  # a 100 KB id is not echoed back


# --- property tests against the in-process core ------------------------------------------


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerProcess]:
    with mock_engine() as proc:
        yield proc


class CoreHarness:
    """A SessionCore on its own event loop, driven synchronously (hypothesis is sync)."""

    def __init__(self, upstream_url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.core = SessionCore(load_tokenizer(None), EnginePool([upstream_url], timeout=30))

    def call(self, op: str, body: bytes = b"", session_id: str | None = None) -> CoreReply:
        request = CoreRequest(
            op=op,
            session_id=session_id,
            path="/v1/chat/completions" if op in ("chat", "proxy") else "",
            method="POST",
            headers=[("content-type", "application/json")],
            body=body,
        )
        return self.loop.run_until_complete(self._call(request))

    async def _call(self, request: CoreRequest) -> CoreReply:
        # A generous bound: a hang is a failure, not a stuck CI job.
        reply = await asyncio.wait_for(self.core.handle(request), 60)
        if reply.stream is not None:
            parts = [part async for part in reply.stream]
            reply = CoreReply(reply.status, reply.headers, b"".join(parts))
        return reply

    def new_session(self) -> str:
        reply = self.call("create")
        assert reply.status == 200, reply.body
        session_id: str = json.loads(reply.body)["session_id"]
        return session_id

    def close(self) -> None:
        self.loop.run_until_complete(self.core.aclose())
        self.loop.close()


@pytest.fixture(scope="module")
def harness(engine: ServerProcess) -> Iterator[CoreHarness]:
    h = CoreHarness(engine.url)
    yield h
    h.close()


def assert_clean(reply: CoreReply, statuses: set[int] = CLIENT_STATUSES) -> None:
    text = reply.body.decode("utf-8", "replace")
    assert reply.status in statuses, (reply.status, text[:500])
    for leak in LEAKS:
        assert leak not in text, text[:500]
    if reply.status != 200:
        document = json.loads(reply.body)
        # Ours are {"error": ...}; an upstream 4xx passes through in SGLang's shape.
        assert "error" in document or document.get("object") == "error", text[:500]


def assert_still_serves(harness: CoreHarness) -> None:
    session_id = harness.new_session()
    reply = harness.call("chat", json.dumps(HELLO).encode(), session_id)
    assert reply.status == 200, reply.body
    assert harness.call("delete", session_id=session_id).status == 204


JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
# Text with the characters that break things: lone surrogates, NUL, controls, non-BMP.
NASTY_TEXT = st.lists(
    st.one_of(
        st.characters(min_codepoint=0, max_codepoint=0x10FFFF),
        st.characters(min_codepoint=0x20, max_codepoint=0x7E),
        st.sampled_from(
            ["\ud800", "\udfff", "\x00", "\x1b", "\U0001f600", "{{", "{%", "<|im_end|>"]
        ),
    ),
    max_size=8,
).map("".join)
ROLES = (
    st.sampled_from(["user", "user", "system", "assistant", "tool", "", "developer"]) | NASTY_TEXT
)
CONTENT = (
    st.none()
    | NASTY_TEXT
    | st.lists(
        st.fixed_dictionaries({"type": st.just("text"), "text": NASTY_TEXT})
        | st.fixed_dictionaries({"type": NASTY_TEXT})
        | JSON_VALUES,
        max_size=3,
    )
    | JSON_VALUES
)
TOOL_CALL = st.fixed_dictionaries(
    {
        "id": NASTY_TEXT,
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": NASTY_TEXT, "arguments": NASTY_TEXT | JSON_VALUES}
        ),
    }
)
MESSAGE = st.fixed_dictionaries(
    {"role": ROLES},
    optional={
        "content": CONTENT,
        "name": NASTY_TEXT | JSON_VALUES,
        "tool_calls": st.lists(TOOL_CALL, max_size=2) | JSON_VALUES,
        "tool_call_id": NASTY_TEXT,
        "reasoning_content": NASTY_TEXT | JSON_VALUES,
    },
)
TOOL = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": NASTY_TEXT, "parameters": JSON_VALUES}),
    }
)
CHAT_BODY = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, min_size=1, max_size=3) | JSON_VALUES},
    optional={
        "stream": JSON_VALUES,
        "tools": st.lists(TOOL, max_size=2) | JSON_VALUES,
        "chat_template_kwargs": st.dictionaries(NASTY_TEXT, JSON_VALUES, max_size=2) | JSON_VALUES,
        "stream_options": JSON_VALUES,
        "max_tokens": st.integers(-2, 8) | JSON_VALUES,
        "temperature": JSON_VALUES,
        "extra": JSON_VALUES,
    },
)


def encode_body(document: Any, style: str) -> bytes:
    """A body as a client could send it: escaped ASCII, raw UTF-8 (surrogates as the bytes
    ED A0 80 ...), or UTF-16."""
    if style == "ascii":
        return json.dumps(document).encode()
    text = json.dumps(document, ensure_ascii=False)
    if style == "utf-16":
        return text.encode("utf-16", "surrogatepass")
    return text.encode("utf-8", "surrogatepass")


def deep_value(depth: int, kind: str) -> bytes:
    if kind == "array":
        return nested(depth)
    return b'{"a":' * depth + b"0" + b"}" * depth


RAW_BODIES = st.one_of(
    st.binary(max_size=64),
    st.text(max_size=40).map(str.encode),
    JSON_VALUES.filter(lambda v: not isinstance(v, dict)).map(lambda v: json.dumps(v).encode()),
    st.sampled_from(
        [
            b"",
            b"{",
            b'{"messages":[}',
            b'{"messages":[{"role":"user","content":"a\x00b"}]}',  # raw NUL: invalid JSON
            b'{"messages":NaN}',
            b'{"messages":1e999999}',
            b'{"messages":' + b"9" * 5000 + b"}",  # over int_max_str_digits
            b'{"messages":"\\ud800"}',
            b"\xef\xbb\xbf{}",
            b"\xff\xfe",
        ]
    ),
    st.builds(
        lambda depth, kind, field: b'{"' + field.encode() + b'":' + deep_value(depth, kind) + b"}",
        st.sampled_from([MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 900, 5_000, DEEP]),
        st.sampled_from(["array", "object"]),
        st.sampled_from(["messages", "tools", "chat_template_kwargs", "extra", "stream"]),
    ),
)

PROPERTY_SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@PROPERTY_SETTINGS
@given(
    body=RAW_BODIES
    | st.tuples(CHAT_BODY, st.sampled_from(["ascii", "utf-8", "utf-16"])).map(
        lambda pair: encode_body(*pair)
    )
)
def test_chat_bodies_never_break_the_core(harness: CoreHarness, body: bytes) -> None:
    session_id = harness.new_session()
    try:
        assert_clean(harness.call("chat", body, session_id))
    finally:
        harness.call("delete", session_id=session_id)


@PROPERTY_SETTINGS
@given(
    first=st.tuples(CHAT_BODY, st.sampled_from(["ascii", "utf-8"])),
    appended=st.lists(MESSAGE, min_size=1, max_size=2),
)
def test_appended_messages_never_break_the_core(
    harness: CoreHarness, first: tuple[Any, str], appended: list[Any]
) -> None:
    """The second turn renders only the appended messages: a path of its own."""
    session_id = harness.new_session()
    try:
        reply = harness.call("chat", json.dumps(HELLO).encode(), session_id)
        assert reply.status == 200
        assistant = json.loads(reply.body)["choices"][0]["message"]
        document = first[0] if isinstance(first[0].get("messages"), list) else {}
        body = {**document, "messages": [*HELLO["messages"], assistant, *appended]}
        assert_clean(harness.call("chat", encode_body(body, first[1]), session_id))
    finally:
        harness.call("delete", session_id=session_id)


CREATE_BODIES = RAW_BODIES | st.dictionaries(
    st.sampled_from(["parent_session_id", "x"]), JSON_VALUES | NASTY_TEXT, max_size=2
).map(lambda d: encode_body(d, "ascii"))


@PROPERTY_SETTINGS
@given(body=CREATE_BODIES)
def test_create_bodies_never_break_the_core(harness: CoreHarness, body: bytes) -> None:
    reply = harness.call("create", body)
    assert_clean(reply)
    if reply.status == 200:
        harness.call("delete", session_id=json.loads(reply.body)["session_id"])


@PROPERTY_SETTINGS
@given(
    body=RAW_BODIES
    | st.dictionaries(st.just("max_seq_len"), JSON_VALUES, max_size=1).map(
        lambda d: encode_body(d, "ascii")
    )
)
def test_samples_bodies_never_break_the_core(harness: CoreHarness, body: bytes) -> None:
    session_id = harness.new_session()
    try:
        reply = harness.call("samples", body, session_id)
        # An empty session has no samples: the rollout framework's 422 (docs/samples.md).
        assert_clean(reply, CLIENT_STATUSES | {422})
    finally:
        harness.call("delete", session_id=session_id)


@PROPERTY_SETTINGS
@given(body=RAW_BODIES)
def test_stateless_bodies_get_the_engines_4xx(harness: CoreHarness, body: bytes) -> None:
    reply = harness.call("proxy", body)
    assert 200 <= reply.status < 500, (reply.status, reply.body[:300])


def test_ten_thousand_messages(harness: CoreHarness) -> None:
    messages = [{"role": "user", "content": f"message {i}"} for i in range(10_000)]
    session_id = harness.new_session()
    body = json.dumps({"messages": messages, "max_tokens": 4}).encode()
    assert_clean(harness.call("chat", body, session_id))
    harness.call("delete", session_id=session_id)


def test_core_still_serves_after_the_hostile_bodies(harness: CoreHarness) -> None:
    # Runs after the properties above in file order; also cheap enough to stand alone.
    assert_still_serves(harness)


# --- regressions, end to end through `serve --workers 1` ------------------------------------


@pytest.fixture(scope="module")
def gateway(engine: ServerProcess) -> Iterator[ServerProcess]:
    port = free_port()
    argv = ["serve", "--port", str(port), "--workers", "1", "--backend", engine.url]
    with ServerProcess(argv, port) as proc:
        yield proc


@pytest.fixture()
def client(gateway: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=60) as c:
        yield c


def new_session(client: httpx.Client) -> str:
    session_id: str = client.post("/sessions").json()["session_id"]
    return session_id


def post(client: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return client.post(path, content=body, headers=JSON_CT)


def assert_400(response: httpx.Response, fragment: str) -> None:
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert fragment in error, error
    for leak in LEAKS:
        assert leak not in error


@pytest.mark.parametrize("where", ["messages", "extra"])
def test_deep_nesting_on_a_session_turn_is_400(client: httpx.Client, where: str) -> None:
    session_id = new_session(client)
    path = f"/sessions/{session_id}/v1/chat/completions"
    assert_400(post(client, path, deep_body(where)), "request body is nested too deeply")
    # The session is untouched and the worker alive.
    assert post(client, path, json.dumps(HELLO).encode()).status_code == 200


def test_deep_nesting_on_samples_and_header_sessions_is_400(client: httpx.Client) -> None:
    session_id = new_session(client)
    samples = post(client, f"/sessions/{session_id}/samples", deep_body("extra"))
    assert_400(samples, "nested too deeply")
    header_turn = client.post(
        "/v1/chat/completions",
        content=deep_body("messages"),
        headers={**JSON_CT, "X-Session-ID": "hostile-deep"},
    )
    assert_400(header_turn, "nested too deeply")
    deep_create = post(client, "/sessions", b'{"x":' + nested(20_000) + b"}")
    assert_400(deep_create, "nested too deeply")


def test_deep_nesting_on_the_stateless_path_is_the_engines_400(client: httpx.Client) -> None:
    response = post(client, "/v1/chat/completions", deep_body("messages"))
    assert response.status_code == 400, response.text[:300]
    assert response.json()["object"] == "error"


def test_lone_surrogate_in_first_turn_is_400(client: httpx.Client) -> None:
    session_id = new_session(client)
    path = f"/sessions/{session_id}/v1/chat/completions"
    assert_400(post(client, path, surrogate_body()), "messages[0].content is not valid Unicode")
    tools = [{"type": "function", "function": {"name": "t\udc00"}}]
    assert_400(post(client, path, surrogate_body(tools=tools)), "not valid Unicode")
    kwargs = surrogate_body(chat_template_kwargs={"x": "\ud800"})
    assert_400(post(client, path, kwargs), "not valid Unicode")
    assert post(client, path, json.dumps(HELLO).encode()).status_code == 200


def test_lone_surrogate_in_an_appended_turn_is_400(client: httpx.Client) -> None:
    session_id = new_session(client)
    path = f"/sessions/{session_id}/v1/chat/completions"
    first = post(client, path, json.dumps(HELLO).encode())
    assert first.status_code == 200
    messages = [*HELLO["messages"], first.json()["choices"][0]["message"]]
    appended = {"role": "tool", "content": "ok", "tool_call_id": "c1", "name": "f\ud800"}
    body = json.dumps({"messages": [*messages, appended], "max_tokens": 4}).encode()
    assert_400(post(client, path, body), "messages[2].name is not valid Unicode")
    # Raw UTF-8 bytes of a surrogate, not an escape.
    raw = json.dumps(
        {"messages": [*messages, {"role": "user", "content": "\udfff"}]}, ensure_ascii=False
    ).encode("utf-8", "surrogatepass")
    assert_400(post(client, path, raw), "messages[2].content is not valid Unicode")


def test_stream_must_be_a_boolean(client: httpx.Client) -> None:
    session_id = new_session(client)
    body = json.dumps({**HELLO, "stream": "yes"}).encode()
    assert_400(
        post(client, f"/sessions/{session_id}/v1/chat/completions", body),
        "field 'stream' must be a boolean",
    )
    tools = json.dumps({**HELLO, "tools": {"type": "function"}}).encode()
    assert_400(
        post(client, f"/sessions/{session_id}/v1/chat/completions", tools),
        "field 'tools' must be a list",
    )


@pytest.mark.parametrize("quoted", ["%zz", "%e2%28", "%", "ab%4"])
def test_invalid_percent_encoding_end_to_end(client: httpx.Client, quoted: str) -> None:
    assert_400(client.get(f"/sessions/{quoted}"), "invalid percent-encoding in the session id")
    chat = post(client, f"/sessions/{quoted}/v1/chat/completions", json.dumps(HELLO).encode())
    assert_400(chat, "invalid percent-encoding in the session id")


def raw_request(gateway: ServerProcess, target: bytes) -> tuple[int, bytes]:
    """One request with an exact request target (httpx would normalise `..`)."""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=30) as sock:
        sock.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


@pytest.mark.parametrize(
    ("target", "status"),
    [
        (b"/sessions/..", 404),
        (b"/sessions/%2e%2e", 404),
        (b"/sessions/%2e%2e/v1/models", 404),
        (b"/sessions/../health", 404),
        (b"/sessions/%00", 400),
        (b"/sessions/%1b%5b2J", 400),
        (b"/sessions/" + b"a" * 8_000, 400),
    ],
)
def test_odd_session_ids_end_to_end(gateway: ServerProcess, target: bytes, status: int) -> None:
    got, body = raw_request(gateway, target)
    assert got == status, body[:300]
    assert "error" in json.loads(body)


def test_huge_session_id_is_not_a_5xx(gateway: ServerProcess) -> None:
    # 100 KB ids may be refused by the HTTP parser before the app sees them: any 4xx will do.
    got, body = raw_request(gateway, b"/sessions/" + b"a" * 100_000)
    assert 400 <= got < 500, body[:300]
