"""The HTTP/1.1 rules a proxy keeps, held by both fronts alike (the table in
docs/reliability.md, "HTTP/1.1 rules", names this file for each rule).

Each case is raw bytes on a socket to a real `serve` process, once per front (`--front
compiled` and `--front python`, one parametrized test: that the fronts cannot be told apart
is part of the contract), and the engine's view of what arrived is read off a recording
engine (`raw_engine.py`) that parses HTTP strictly, as a real engine would.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from support.front_sockets import get, post
from support.procs import ServerProcess, free_port
from support.raw_engine import RawEngine, recording_engine

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

FRONTS = ("compiled", "python")
LIVENESS = 10.0
# How long a connection must stay silent to count as "no further reply".
QUIET = 0.5
SMUGGLED = b"GET /v1/script/SMUGGLED HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture(scope="module")
def engine() -> Iterator[RawEngine]:
    with recording_engine() as raw:
        yield raw


def start_gateway(engine: RawEngine, *args: str) -> ServerProcess:
    port = free_port()
    argv = ["serve", "--port", str(port), "--backend", engine.url, *args]
    return ServerProcess(argv, port, timeout=60).start()


@pytest.fixture(scope="module")
def gateways(engine: RawEngine) -> Iterator[dict[str, ServerProcess]]:
    started: dict[str, ServerProcess] = {}
    try:
        for front in FRONTS:
            started[front] = start_gateway(engine, "--workers", "0", "--front", front)
        yield started
    finally:
        for proc in started.values():
            proc.stop()


@pytest.fixture(params=FRONTS)
def port(request: pytest.FixtureRequest, gateways: dict[str, ServerProcess]) -> int:
    return gateways[request.param].port


@pytest.fixture(autouse=True)
def fresh_engine_log(engine: RawEngine) -> None:
    engine.clear()


# Raw exchanges -----------------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


@dataclass
class Exchange:
    replies: list[Reply]
    closed: bool  # the gateway closed the connection
    rest: bytes  # bytes after the last whole reply


def read_replies(sock: socket.socket, data: bytes = b"") -> Exchange:
    """Every reply the gateway sends until it closes or stays quiet for QUIET seconds."""
    closed = False
    deadline = time.monotonic() + LIVENESS
    sock.settimeout(QUIET)
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(1 << 20)
        except TimeoutError:
            break
        except ConnectionResetError:
            closed = True
            break
        if not chunk:
            closed = True
            break
        data += chunk
    replies = []
    while b"\r\n\r\n" in data:
        head, _, after = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {k.lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:])}
        if "content-length" in headers:
            length = int(headers["content-length"])
            if len(after) < length:
                break
            body, data = after[:length], after[length:]
        elif headers.get("transfer-encoding") == "chunked":
            body, data = b"", after
            while True:
                size_line, _, data = data.partition(b"\r\n")
                size = int(size_line, 16)
                body, data = body + data[:size], data[size + 2 :]
                if size == 0:
                    break
        else:
            body, data = b"", after
        replies.append(Reply(status, headers, body))
    return Exchange(replies, closed, data)


def exchange(port: int, raw: bytes) -> Exchange:
    with socket.create_connection(("127.0.0.1", port), timeout=LIVENESS) as sock:
        sock.sendall(raw)
        return read_replies(sock)


def echoed(reply: Reply) -> dict[str, str]:
    """What the recording engine's echo reply says it received."""
    echo: dict[str, str] = json.loads(reply.body)
    return echo


def only_error(result: Exchange, status: int, fragment: str) -> None:
    """One JSON error reply naming `fragment`, then the gateway closed."""
    assert [r.status for r in result.replies] == [status], result
    assert fragment in json.loads(result.replies[0].body)["error"]
    assert result.replies[0].headers.get("connection") == "close"
    assert result.closed


# Upgrade: never honoured, never a way to smuggle -------------------------------------------

UPGRADE_OFFERS = {
    "unknown protocol": ("Connection: Upgrade", "Upgrade: foo"),
    "h2c": (
        "Connection: Upgrade, HTTP2-Settings",
        "Upgrade: h2c",
        "HTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA",
    ),
    "websocket": (
        "Connection: keep-alive, Upgrade",
        "Upgrade: websocket",
        "Sec-WebSocket-Version: 13",
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
    ),
}


@pytest.mark.parametrize("offer", sorted(UPGRADE_OFFERS))
def test_an_upgrade_offer_is_ignored_and_its_body_read_as_framed(
    port: int, engine: RawEngine, offer: str
) -> None:
    result = exchange(port, post("/v1/script/echo", SMUGGLED, *UPGRADE_OFFERS[offer]))
    assert [r.status for r in result.replies] == [200], result
    assert bytes.fromhex(echoed(result.replies[0])["body"]) == SMUGGLED
    [arrived] = engine.arrived  # nothing smuggled in behind it
    assert arrived.body == SMUGGLED
    assert not {"upgrade", "http2-settings", "connection"} & arrived.header_names()
    assert not result.closed


def test_an_upgrade_offer_on_the_gateways_api_smuggles_nothing(
    port: int, engine: RawEngine
) -> None:
    # POST /sessions whose body is a request: one answer (its body is not JSON), no second.
    result = exchange(port, post("/sessions", SMUGGLED, *UPGRADE_OFFERS["unknown protocol"]))
    assert [r.status for r in result.replies] == [400], result
    assert "JSON" in json.loads(result.replies[0].body)["error"]
    assert engine.arrived == []


# Interim replies ---------------------------------------------------------------------------


def test_expect_100_continue_is_answered_by_the_gateway(port: int, engine: RawEngine) -> None:
    body = bytes(range(256)) * 6000  # 1.5 MB, the size curl sends Expect for
    head = (
        "POST /v1/script/echo HTTP/1.1\r\nHost: gw\r\nExpect: 100-continue\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=LIVENESS) as sock:
        sock.sendall(head.encode())
        assert sock.recv(64).startswith(b"HTTP/1.1 100 Continue\r\n")
        sock.sendall(body)
        result = read_replies(sock)
    assert [r.status for r in result.replies] == [200], result
    [arrived] = engine.arrived
    assert arrived.body == body
    assert "expect" not in arrived.header_names()


def test_an_engines_interim_replies_are_not_the_reply(port: int) -> None:
    result = exchange(port, get("/v1/script/interim"))
    assert [r.status for r in result.replies] == [200], result
    assert echoed(result.replies[0])["target"] == "/v1/script/interim"
    assert result.rest == b""


def test_an_unasked_101_from_the_engine_is_a_502(port: int) -> None:
    result = exchange(port, get("/v1/script/switch"))
    assert [r.status for r in result.replies] == [502], result
    assert "101 Switching Protocols" in json.loads(result.replies[0].body)["error"]


def test_a_bare_lf_reply_head_from_the_engine_is_read(port: int) -> None:
    result = exchange(port, get("/v1/script/bare-lf"))
    assert [r.status for r in result.replies] == [200], result
    assert echoed(result.replies[0])["target"] == "/v1/script/bare-lf"


# Retries -----------------------------------------------------------------------------------


def test_a_post_is_never_sent_twice(port: int, engine: RawEngine) -> None:
    # A first request leaves a pooled connection; the engine then reads the POST on it and
    # closes without a reply: a 502, and the engine saw the POST once.
    with socket.create_connection(("127.0.0.1", port), timeout=LIVENESS) as sock:
        sock.sendall(get("/v1/script/echo"))
        assert [r.status for r in read_replies(sock).replies] == [200]
        sock.sendall(post("/v1/script/drop", b"{}"))
        result = read_replies(sock)
    assert [r.status for r in result.replies] == [502], result
    assert len(engine.to("/v1/script/drop")) == 1


# Hop-by-hop headers ------------------------------------------------------------------------


def test_connection_named_headers_are_not_forwarded(port: int, engine: RawEngine) -> None:
    hop = ("Connection: keep-alive, X-Hop", "X-Hop: secret", "X-Kept: 1", "Keep-Alive: 5")
    result = exchange(port, post("/v1/script/echo", b"{}", *hop) + get("/v1/script/hop-reply"))
    assert [r.status for r in result.replies] == [200, 200], result
    names = engine.to("/v1/script/echo")[0].header_names()
    assert "x-kept" in names
    assert not {"x-hop", "keep-alive", "connection"} & names
    # The reply side: the engine's Connection names X-Up-Hop.
    reply_headers = result.replies[1].headers
    assert reply_headers["x-kept"] == "1"
    assert "x-up-hop" not in reply_headers


@pytest.mark.parametrize("layout", ["--workers 0", "--workers 1"])
def test_connection_named_headers_stay_off_session_traffic(engine: RawEngine, layout: str) -> None:
    hop = ("Connection: X-Hop", "X-Hop: secret")
    turn = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    with start_gateway(engine, *layout.split()) as gateway:
        created = exchange(gateway.port, post("/sessions", b""))
        session_id = json.loads(created.replies[0].body)["session_id"]
        raw = post(f"/sessions/{session_id}/v1/chat/completions", turn.encode(), *hop)
        raw += post("/v1/chat/completions", turn.encode(), "X-Session-ID: hdr-1", *hop)
        raw += get(f"/sessions/{session_id}/v1/models", *hop)
        result = exchange(gateway.port, raw)
    assert [r.status for r in result.replies] == [200, 200, 200], result
    arrived = engine.to("/v1/chat/completions") + engine.to("/v1/models")
    assert len(arrived) == 3
    for request in arrived:
        assert "x-hop" not in request.header_names(), request.headers


# The request head --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"GET /v1/script/echo HTTP/1.1\r\n\r\n", "needs a Host header"),
        (b"GET /v1/script/echo HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", "more than one Host"),
        (b"GET /sessions HTTP/1.1\r\nHost: a\r\nhost: a\r\n\r\n", "more than one Host"),
    ],
)
def test_a_request_without_one_host_is_400(
    port: int, engine: RawEngine, raw: bytes, fragment: str
) -> None:
    only_error(exchange(port, raw), 400, fragment)
    assert engine.arrived == []


def test_http_1_0_needs_no_host(port: int) -> None:
    result = exchange(port, b"GET /v1/script/echo HTTP/1.0\r\n\r\n")
    assert [r.status for r in result.replies] == [200], result


def test_a_bare_lf_head_is_400(port: int, engine: RawEngine) -> None:
    only_error(exchange(port, b"GET /v1/script/echo HTTP/1.1\nHost: gw\n\n"), 400, "CRLF")
    only_error(exchange(port, b"GET /v1/script/echo HTTP/1.1\r\nHost: gw\n\r\n"), 400, "")
    assert engine.arrived == []


def test_a_valid_request_then_garbage_gets_its_reply_then_400(port: int, engine: RawEngine) -> None:
    result = exchange(port, get("/v1/script/echo") + b"GARBAGE GARBAGE\r\n\r\n")
    assert [r.status for r in result.replies] == [200, 400], result
    assert result.closed
    assert len(engine.arrived) == 1


def test_pipelined_requests_are_answered_in_order_before_an_error(port: int) -> None:
    raw = get("/v1/script/echo?n=1") + get("/health") + get("/v1/script/echo?n=2")
    result = exchange(port, raw + b"GET /v1/x HTTP/1.1\r\n\r\n")  # no Host
    assert [r.status for r in result.replies] == [200, 200, 200, 400], result
    assert echoed(result.replies[2])["target"] == "/v1/script/echo?n=2"


@pytest.mark.parametrize(
    ("codings", "status", "fragment"),
    [
        (["gzip, chunked"], 501, "gzip"),
        (["identity, chunked"], 501, "identity"),
        (["gzip", "chunked"], 501, "gzip"),
        (["chunked, chunked"], 400, "Transfer-Encoding"),
    ],
)
def test_a_transfer_coding_other_than_chunked_is_refused(
    port: int, engine: RawEngine, codings: list[str], status: int, fragment: str
) -> None:
    te = "".join(f"Transfer-Encoding: {c}\r\n" for c in codings)
    raw = f"POST /v1/script/echo HTTP/1.1\r\nHost: gw\r\n{te}\r\n3\r\nabc\r\n0\r\n\r\n"
    only_error(exchange(port, raw.encode()), status, fragment)
    assert engine.arrived == []


def test_transfer_encoding_in_http_1_0_is_400(port: int, engine: RawEngine) -> None:
    raw = b"POST /v1/script/echo HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n"
    raw += b"3\r\nabc\r\n0\r\n\r\n"
    only_error(exchange(port, raw), 400, "HTTP/1.0")
    assert engine.arrived == []


def test_chunked_alone_is_decoded(port: int, engine: RawEngine) -> None:
    raw = b"POST /v1/script/echo HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n"
    result = exchange(port, raw + b"3\r\nabc\r\n0\r\n\r\n")
    assert [r.status for r in result.replies] == [200], result
    assert engine.arrived[0].body == b"abc"


@pytest.mark.parametrize("target", [b"/v1/caf\xc3\xa9", b"/sessions/\xff", b"/v1/a\x7fb"])
def test_a_raw_non_ascii_target_is_400(port: int, engine: RawEngine, target: bytes) -> None:
    only_error(exchange(port, b"GET " + target + b" HTTP/1.1\r\nHost: gw\r\n\r\n"), 400, "")
    assert engine.arrived == []


@pytest.mark.parametrize(
    ("version", "status", "fragment"),
    [
        ("HTTP/2.0", 505, "HTTP/2.0 is not supported"),
        ("HTTP/0.9", 505, "HTTP/0.9 is not supported"),
        ("HTTP/1.2", 400, "Invalid HTTP version"),
    ],
)
def test_an_http_version_other_than_1_x_is_505(
    port: int, engine: RawEngine, version: str, status: int, fragment: str
) -> None:
    raw = f"GET /v1/script/echo {version}\r\nHost: gw\r\n\r\n".encode()
    only_error(exchange(port, raw), status, fragment)
    assert engine.arrived == []


def test_connect_is_405(port: int, engine: RawEngine) -> None:
    raw = b"CONNECT engine:443 HTTP/1.1\r\nHost: engine:443\r\n\r\n"
    only_error(exchange(port, raw), 405, "forward proxy")
    assert engine.arrived == []
