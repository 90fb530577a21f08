"""The compiled front door (`_core.CompiledFront`, rust/front/) over real loopback sockets.

An in-process threaded HTTP/1.1 server stands in for the engine; clients are raw sockets, so
the bytes relayed and the bytes handed off to Python are checked exactly. Timeouts here only
bound a hang (LIVENESS); no test measures time.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.front_sockets import CHAT, LIVENESS, Front, Reader, Upstream, fronts_of, get, post

# An engine stand-in ------------------------------------------------------------------------


def closed_port_url() -> str:
    """An http:// URL nothing listens on (a port just bound and released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


# The front and its clients -----------------------------------------------------------------


@pytest.fixture
def make_front() -> Iterator[Callable[..., Front]]:
    with fronts_of(Front) as make:
        yield make


# The fast path -----------------------------------------------------------------------------


def test_stateless_post_is_relayed_byte_exactly(upstream: Upstream, make_front: Any) -> None:
    front = make_front([upstream.url + "/"])
    client = front.connect()
    body = '{"messages":[{"role":"user","content":"héllo"}]}'.encode()
    client.sendall(post(CHAT + "?trace=1", body, "Content-Type: application/json", "TE: x"))
    reader = Reader(client)
    status, headers, raw_head = reader.head()
    assert status == 200
    named = dict(headers)
    body_out = reader.exactly(int(named["content-length"]))
    assert body_out == upstream.replies[-1]
    assert named["content-type"] == "application/json"
    assert named["x-upstream"] == "yes"
    # The front's own server answers: the engine's Server and Date are not relayed.
    assert "server" not in named and "date" not in named
    assert raw_head.startswith(b"HTTP/1.1 200 OK\r\n")

    [seen] = upstream.seen
    assert seen["method"] == "POST"
    assert seen["path"] == CHAT + "?trace=1"
    assert seen["body"] == body
    sent = dict(seen["headers"])
    assert seen["headers"][0] == ("accept-encoding", "identity")
    assert sent["host"] == upstream.url.removeprefix("http://")
    assert sent["content-type"] == "application/json"
    assert sent["content-length"] == str(len(body))
    assert "te" not in sent

    # Counted once the last byte is written, which may be just after the client read it.
    stats = front.wait_until(lambda s: s["latency"]["count"] == 1)
    assert stats["requests"] == {200: 1}
    assert stats["latency"]["sum"] > 0
    assert stats["latency"]["buckets"][-1] <= 1
    assert stats["handoffs"] == 0
    # The relayed request is counted on its engine, and is in flight no more.
    assert stats["upstreams"] == [
        {
            "url": upstream.url,
            "healthy": True,
            "in_flight": 0,
            "sent": 1,
            "circuit_breaker": "closed",
            "retries": 0,
            "lost": 0,
        }
    ]


def test_a_kept_alive_connection_serves_several_requests(
    upstream: Upstream, make_front: Any
) -> None:
    front = make_front([upstream.url])
    client = front.connect()
    reader = Reader(client)
    for i in range(3):
        client.sendall(post(CHAT, f'{{"n":{i}}}'.encode()))
        status, _, body = reader.response()
        assert status == 200
        assert json.loads(body)["echo"] == f'{{"n":{i}}}'
        client.sendall(get("/v1/models"))
        status, _, body = reader.response()
        assert (status, json.loads(body)["method"]) == (200, "GET")
    assert front.stats()["connections"] == 1
    # Pipelined: both requests in one write, both answered in order.
    client.sendall(post(CHAT, b'{"a":1}') + get("/v1/models?x=2"))
    assert json.loads(reader.response()[2])["echo"] == '{"a":1}'
    assert json.loads(reader.response()[2])["path"] == "/v1/models?x=2"
    stats = front.wait_until(lambda s: s["latency"]["count"] == 8)
    assert stats["requests"] == {200: 8}
    assert stats["handoffs"] == 0


def test_a_sse_stream_is_relayed_chunk_by_chunk(upstream: Upstream, make_front: Any) -> None:
    front = make_front([upstream.url])
    client = front.connect()
    client.sendall(post("/v1/stream", b'{"stream":true}'))
    reader = Reader(client)
    status, headers, _ = reader.head()
    assert status == 200
    named = dict(headers)
    assert named["transfer-encoding"] == "chunked"
    assert named["content-type"] == "text/event-stream"
    # The first event arrives while the engine still holds the rest back.
    assert reader.chunk() == b"data: 0\n\n"
    assert not upstream.release.is_set()
    upstream.release.set()
    rest = b"".join(iter(reader.chunk, b""))
    assert rest == b"data: 1\n\ndata: 2\n\ndata: 3\n\n"
    # The connection stays usable after the terminating chunk.
    client.sendall(get("/v1/models"))
    assert reader.response()[0] == 200


def test_large_bodies_both_ways(upstream: Upstream, make_front: Any) -> None:
    front = make_front([upstream.url], max_body_bytes=8 << 20)
    client = front.connect()
    reader = Reader(client)
    body = bytes(range(256)) * 12_000  # 3 MB, every byte value
    client.sendall(post(CHAT, body))
    status, _, reply = reader.response()
    assert status == 200
    assert reply == upstream.replies[-1]
    assert upstream.seen[-1]["body"] == body
    client.sendall(get("/v1/big-stream"))
    status, headers, reply = reader.response()
    assert (status, headers["transfer-encoding"]) == (200, "chunked")
    assert reply == b"A" * 300_000 + b"B" * 300_000 + b"C" * 300_000


def test_statuses_and_bodiless_replies_pass_through(upstream: Upstream, make_front: Any) -> None:
    front = make_front([upstream.url])
    client = front.connect()
    reader = Reader(client)
    client.sendall(get("/v1/status/404"))
    assert reader.response()[:1] == (404,)
    client.sendall(get("/v1/status/204"))
    status, headers, body = reader.response()
    assert (status, body) == (204, b"")
    assert "content-length" not in headers and "transfer-encoding" not in headers
    client.sendall(get("/v1/models", "Connection: close"))
    status, headers, _ = reader.response()
    assert (status, headers["connection"]) == (200, "close")
    assert reader.at_eof()
    front.wait_until(lambda s: s["requests"] == {200: 1, 204: 1, 404: 1})


def test_api_key_is_checked_and_not_forwarded(upstream: Upstream, make_front: Any) -> None:
    front = make_front([upstream.url], api_key="s3cret")
    client = front.connect()
    client.sendall(get("/v1/models", "Authorization: bearer s3cret"))
    assert Reader(client).response()[0] == 200
    assert "authorization" not in dict(upstream.seen[-1]["headers"])
    assert front.stats()["handoffs"] == 0


# Upstream failures -------------------------------------------------------------------------


def test_502_when_the_only_upstream_refuses(make_front: Any) -> None:
    url = closed_port_url()
    port = url.rsplit(":", 1)[1]
    front = make_front([url])
    client = front.connect()
    client.sendall(post(CHAT, b"{}"))
    status, headers, body = Reader(client).response()
    assert status == 502
    assert headers["content-type"] == "application/json"
    message = json.loads(body)["error"]
    prefix = (
        f"upstream transport error: POST {url}{CHAT} failed "
        f"(ConnectFailed: cannot connect to 127.0.0.1:{port}: "
    )
    assert message.startswith(prefix) and message.endswith(")"), message
    assert body == json.dumps({"error": message}, separators=(",", ":")).encode()
    [state] = front.stats()["upstreams"]
    assert state["healthy"] is False
    assert state["last_error"]
    front.wait_until(lambda s: s["requests"] == {502: 1})
    # Still kept alive: the client's connection did nothing wrong.
    client.sendall(get("/v1/models"))
    assert Reader(client).response()[0] == 502


def test_a_connect_failure_retries_on_the_other_upstream(
    upstream: Upstream, make_front: Any
) -> None:
    first = closed_port_url()
    front = make_front([first, upstream.url])
    # A probe found it up (the process's prober feeds the front its verdicts); now it is
    # gone, and round robin starts with it.
    assert front.core.probed(first, None)
    client = front.connect()
    client.sendall(post(CHAT, b'{"retry":1}'))
    status, _, body = Reader(client).response()
    assert status == 200
    assert json.loads(body)["echo"] == '{"retry":1}'
    assert len(upstream.requests_to(CHAT)) == 1
    down, up = front.stats()["upstreams"]
    assert down["url"] == first and down["healthy"] is False
    assert down["last_error"].startswith(
        f"upstream transport error: POST {first}{CHAT} failed (ConnectFailed: "
    )
    # Both attempts count as sent, the refused one was retried (on the other engine): a
    # retry counted on the first; the reply relayed, nothing stays in flight.
    assert (down["sent"], down["retries"]) == (1, 1)
    assert (up["url"], up["healthy"], up["sent"], up["circuit_breaker"], up["retries"]) == (
        upstream.url,
        True,
        1,
        "closed",
        0,
    )
    front.wait_until(lambda s: [u["in_flight"] for u in s["upstreams"]] == [0, 0])
    # Round robin now skips the one that is down.
    for _ in range(3):
        client.sendall(get("/v1/models"))
        assert Reader(client).response()[0] == 200


def test_a_client_leaving_during_a_slow_upstream(upstream: Upstream, make_front: Any) -> None:
    front = make_front([upstream.url])
    client = front.connect()
    client.sendall(get("/v1/slow"))
    assert upstream.got_request.wait(LIVENESS)
    client.close()
    front.wait_until(lambda s: s["connections"] == 0)
    upstream.release.set()
    # The front is unharmed.
    other = front.connect()
    other.sendall(get("/v1/models"))
    assert Reader(other).response()[0] == 200


# Hand-offs ---------------------------------------------------------------------------------

HANDOFFS = {
    "session header": post(CHAT, b'{"m":1}', "X-Session-ID: s-1"),
    "session header, other name": post(CHAT, b"{}", "x-correlation-id: c"),
    "health": get("/health"),
    "session route": post("/sessions", b"{}"),
    "malformed request line": b"\x00\x01 nonsense\r\n\r\n",
    "HTTP/1.0": b"GET /v1/models HTTP/1.0\r\nHost: front\r\n\r\n",
    "chunked body": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: front\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    ),
    "expect": post(CHAT, b"{}", "Expect: 100-continue"),
    "body over the limit": post(CHAT, b"x" * 2000),
    "HEAD": b"HEAD /v1/models HTTP/1.1\r\nHost: front\r\n\r\n",
    "fragment": post(CHAT + "#x", b"{}", "X-Session-ID: s-1"),
    "two content-lengths": (
        b"POST /v1/models HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}"
    ),
}


def check_handoff(front: Front, client: socket.socket, sent: bytes) -> None:
    """`sent` goes to Python whole: the handed-off bytes plus what is still unread on the
    socket are exactly it, and a reply written on the fd reaches the client."""
    client.sendall(sent)
    adopted, data = front.wait_handoff()
    assert sent.startswith(data)
    rest = b""
    while len(data) + len(rest) < len(sent):
        chunk = adopted.recv(65536)
        assert chunk, "the handed-off socket closed early"
        rest += chunk
    assert data + rest == sent
    adopted.sendall(b"HTTP/1.1 299 Python\r\ncontent-length: 6\r\n\r\npython")
    assert Reader(client).response()[::2] == (299, b"python")


@pytest.mark.parametrize("case", sorted(HANDOFFS))
def test_requests_python_serves_are_handed_off(
    case: str, upstream: Upstream, make_front: Any
) -> None:
    front = make_front([upstream.url], max_body_bytes=1000)
    check_handoff(front, front.connect(), HANDOFFS[case])
    stats = front.wait_until(lambda s: s["connections"] == 0)
    assert stats["handoffs"] == 1
    assert stats["requests"] == {}
    assert upstream.seen == []


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", "Basic s3cret", "Bearers3cret"])
def test_a_wrong_api_key_is_handed_off(
    authorization: str | None, upstream: Upstream, make_front: Any
) -> None:
    front = make_front([upstream.url], api_key="s3cret")
    headers = [f"Authorization: {authorization}"] if authorization else []
    check_handoff(front, front.connect(), get("/v1/models", *headers))
    assert upstream.seen == []


def test_a_session_request_after_a_stateless_one(upstream: Upstream, make_front: Any) -> None:
    front = make_front([upstream.url])
    client = front.connect()
    client.sendall(post(CHAT, b'{"first":1}'))
    assert json.loads(Reader(client).response()[2])["echo"] == '{"first":1}'
    check_handoff(front, client, post(CHAT, b'{"turn":2}', "X-Session-ID: abc"))
    assert len(upstream.seen) == 1
    front.wait_until(lambda s: (s["requests"], s["handoffs"]) == ({200: 1}, 1))


def test_a_pipelined_session_request_is_handed_off_with_its_bytes(
    upstream: Upstream, make_front: Any
) -> None:
    front = make_front([upstream.url])
    client = front.connect()
    second = post(CHAT, b'{"turn":2}', "X-SMG-Routing-Key: r")
    client.sendall(post(CHAT, b'{"first":1}') + second)
    reader = Reader(client)
    assert json.loads(reader.response()[2])["echo"] == '{"first":1}'
    adopted, data = front.wait_handoff()
    rest = b""
    while len(data) + len(rest) < len(second):
        rest += adopted.recv(65536)
    assert data + rest == second
    assert len(upstream.seen) == 1


# Timeouts ----------------------------------------------------------------------------------


def test_408_when_the_head_never_completes(upstream: Upstream, make_front: Any) -> None:
    front = make_front([upstream.url], header_timeout=0.5)
    client = front.connect()
    client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: front\r\n")
    reader = Reader(client)
    status, headers, body = reader.response()
    assert status == 408
    assert headers["connection"] == "close"
    assert json.loads(body) == {"error": "request headers not received within 0.5 s"}
    # Half-closed after the reply: the client sees the end of it.
    assert reader.at_eof()
    front.wait_until(lambda s: s["requests"] == {408: 1})


def test_408_when_the_body_stalls(upstream: Upstream, make_front: Any) -> None:
    front = make_front([upstream.url], body_timeout=0.5)
    client = front.connect()
    client.sendall(post(CHAT, b"{}")[:-1])
    status, headers, body = Reader(client).response()
    assert (status, headers["connection"]) == (408, "close")
    assert json.loads(body) == {"error": "request body not received within 0.5 s"}
    assert upstream.seen == []


def test_a_silent_connection_is_closed_without_a_reply(upstream: Upstream, make_front: Any) -> None:
    front = make_front([upstream.url], header_timeout=0.3)
    client = front.connect()
    assert Reader(client).at_eof()
    assert front.stats()["requests"] == {}


# Lifecycle ---------------------------------------------------------------------------------


def test_stop_closes_idle_connections_and_the_port(upstream: Upstream, make_front: Any) -> None:
    front = make_front([upstream.url])
    idle = front.connect()
    idle.sendall(get("/v1/models"))
    reader = Reader(idle)
    assert reader.response()[0] == 200
    front.core.stop(LIVENESS)
    # An idle kept-alive connection is closed at once, not after the grace period.
    assert reader.at_eof()
    front.core.stop(0.0)  # idempotent
    assert front.core.take_handoffs() == []
    assert front.stats()["connections"] == 0
    front.listener.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(front.address, timeout=LIVENESS).close()


def test_stop_lets_an_in_flight_request_finish(upstream: Upstream, make_front: Any) -> None:
    front = make_front([upstream.url])
    client = front.connect()
    client.sendall(get("/v1/slow"))
    assert upstream.got_request.wait(LIVENESS)
    stopper = threading.Thread(target=front.core.stop, args=(LIVENESS,))
    stopper.start()
    try:
        upstream.release.set()
        reader = Reader(client)
        assert reader.response()[::2] == (200, b'{"slow":true}')
        # Then closed (with `connection: close` in the head if stop() began before it).
        assert reader.at_eof()
    finally:
        stopper.join(LIVENESS)
    assert not stopper.is_alive()


def test_stop_closes_untaken_handoffs(upstream: Upstream, make_front: Any) -> None:
    front = make_front([upstream.url])
    client = front.connect()
    client.sendall(get("/health"))
    front.wait_until(lambda s: s["handoffs"] == 1)
    front.core.stop(0.0)
    assert Reader(client).at_eof()


def test_an_engine_set_given_at_run_time_replaces_the_start_up_one(
    upstream: Upstream, make_front: Any
) -> None:
    """Started without engines (they register later), the front hands stateless requests
    to Python; `set_engines` gives it a pool to relay to, and a bad set changes nothing."""
    front = make_front([])
    client = front.connect()
    client.sendall(post(CHAT, b"{}", "Content-Type: application/json"))
    front.wait_until(lambda s: s["handoffs"] == 1)
    assert front.stats()["upstreams"] == []
    for bad, fragment in [([], "at least one engine"), (["https://e:443"], "https://e:443")]:
        with pytest.raises(ValueError, match=fragment):
            front.core.set_engines(bad)
    assert front.stats()["upstreams"] == []
    front.core.set_engines([upstream.url])
    front.core.set_relay(True)
    client = front.connect()
    client.sendall(post(CHAT, b'{"n": 1}', "Content-Type: application/json"))
    status, _, _ = Reader(client).head()
    assert status == 200
    assert [seen["body"] for seen in upstream.seen] == [b'{"n": 1}']
    [state] = front.stats()["upstreams"]
    assert (state["url"], state["healthy"], state["sent"]) == (upstream.url, True, 1)
    assert front.stats()["handoffs"] == 1


@pytest.mark.parametrize(
    ("upstreams", "fragment"),
    [
        (["https://engine:443"], "'https://engine:443'"),
        (["engine:8000"], "'engine:8000'"),
        (["http://a:1", "http://a:1/"], "'http://a:1'"),
    ],
)
def test_bad_upstreams_are_refused(upstreams: list[str], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        Front(upstreams)


def test_bad_settings_are_refused(upstream: Upstream) -> None:
    for overrides in (
        {"threads": 0},
        {"header_timeout": 0.0},
        {"body_timeout": float("nan")},
        {"latency_buckets": [1.0, 0.5]},
        {"max_body_bytes": -1},
    ):
        with pytest.raises(ValueError):
            Front([upstream.url], **overrides)


def test_a_down_upstream_is_reported_by_the_probe(make_front: Any) -> None:
    """The front probes nothing itself: the verdicts of its process's prober (the engine
    registry's) flip an engine's health at the thresholds, as `EnginePool._probed` does."""
    url = closed_port_url()
    front = make_front([url + "/"])
    why = f"GET {url}/health failed (ConnectFailed: cannot connect)"
    health = lambda: front.stats()["upstreams"][0]  # noqa: E731
    for _ in range(2):  # below the failure threshold (3)
        assert front.core.probed(url, why)
        assert health()["healthy"] is True and "last_error" not in health()
    assert front.core.probed(url, why)
    assert health()["healthy"] is False and health()["last_error"] == why
    assert front.core.probed(url, None)  # below the success threshold (2)
    assert health()["healthy"] is False and health()["last_error"] == why
    assert front.core.probed(url)
    assert health()["healthy"] is True and "last_error" not in health()
    assert not front.core.probed("http://127.0.0.1:1", None)  # not an engine of its set


# Whole requests on the wire: served or handed off, as the specification says ---------------

_WIRE_HEADERS = [
    ("Host", "front"),
    ("X-Session-ID", "s1"),
    ("X-Session-ID", ""),
    ("Content-Type", "application/json"),
    ("Transfer-Encoding", "chunked"),
    ("Expect", "100-continue"),
    ("Upgrade", "websocket"),
    ("Bad Header", "x"),
    ("Content-Length", "abc"),
    ("Content-Length", "-1"),
    ("Content-Length", "2, 2"),
]


def predicted_to_serve(
    method: str, target: str, version: str, headers: list[tuple[str, str]], body: bytes
) -> bool:
    """Whether the front answers this request itself: the routing spec (`served_by_front`)
    plus the transport conditions under which Python must see the request instead."""
    from sessiongate.front.routes import served_by_front

    names = [name.lower() for name, _ in headers]
    lengths = [value for name, value in headers if name.lower() == "content-length"]
    return (
        version == "HTTP/1.1"
        and served_by_front(method, target.partition("?")[0], [(k.lower(), v) for k, v in headers])
        and not {"transfer-encoding", "expect", "bad header"} & set(names)
        and names.count("host") == 1  # none or two: Python's 400
        and len(lengths) <= 1
        and all(value.isdigit() for value in lengths)
    )


@settings(max_examples=60, deadline=None)
@given(
    method=st.sampled_from(["GET", "POST", "HEAD", "PUT", "post"]),
    target=st.sampled_from([CHAT, "/v1/models?x=1", "/v1/echo", "/health", "/sessions", "/v1"]),
    version=st.sampled_from(["HTTP/1.1", "HTTP/1.1", "HTTP/1.0"]),
    headers=st.lists(st.sampled_from(_WIRE_HEADERS), max_size=4, unique=True),
    body=st.binary(max_size=64),
)
def test_every_request_is_served_or_handed_off_whole(
    method: str, target: str, version: str, headers: list[tuple[str, str]], body: bytes
) -> None:
    has_length = any(name == "Content-Length" for name, _ in headers)
    if not has_length and body:
        headers = [*headers, ("Content-Length", str(len(body)))]
    raw = f"{method} {target} {version}\r\n".encode()
    raw += b"".join(f"{k}: {v}\r\n".encode() for k, v in headers) + b"\r\n"
    # A declared length the front would wait for is sent whole (no timeout is exercised).
    raw += body if not has_length else b""
    serves = predicted_to_serve(method, target, version, headers, body if not has_length else b"")
    with contextlib.ExitStack() as stack:
        upstream = Upstream()
        stack.callback(upstream.close)
        front = Front([upstream.url])
        stack.callback(front.close)
        client = front.connect()
        if not serves:
            check_handoff(front, client, raw)
            assert front.stats()["requests"] == {}
            return
        client.sendall(raw)
        status, _, _ = Reader(client).response()
        assert status == 200  # the echo upstream answers every method and path
        assert front.stats()["handoffs"] == 0
