"""Slow and malformed clients cannot hold the gateway (docs/reliability.md).

Real `serve` processes, both layouts (router + worker, and in-process), driven with raw
sockets: slowloris connections are cut off with a 408 while `/health` keeps answering, a
body shorter than its Content-Length gets a 408 and records nothing, malformed HTTP gets a
JSON 400, and a client that never reads a large records GET costs bounded memory.
"""

from __future__ import annotations

import json
import selectors
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.procs import ServerProcess, free_port

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

HEADER_TIMEOUT = 2.0
BODY_TIMEOUT = 2.0
# Liveness bounds only: how long past a timeout a connection may take to be cut off on a
# loaded CI machine before the test calls it hung.
SLACK = 10.0
LAYOUTS = {"workers": ["--workers", "1"], "inprocess": ["--workers", "0"]}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def gateway(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    port = free_port()
    args = [
        "serve",
        "--port",
        str(port),
        *LAYOUTS[request.param],
        "--header-timeout",
        str(HEADER_TIMEOUT),
        "--body-timeout",
        str(BODY_TIMEOUT),
    ]
    with ServerProcess(args, port, timeout=60) as proc:
        yield proc


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes
    closed: bool  # the server closed the connection after the reply

    def json(self) -> Any:
        return json.loads(self.body)


def parse_response(raw: bytes, closed: bool) -> Response:
    head, sep, body = raw.partition(b"\r\n\r\n")
    assert sep, f"no complete response head in {raw[:200]!r}"
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return Response(int(status_line.split()[1]), headers, body, closed)


def exchange(port: int, data: bytes, timeout: float = BODY_TIMEOUT + SLACK) -> Response:
    """Send `data` on a fresh connection, then read until the server closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        if data:
            sock.sendall(data)
        raw = b""
        while True:
            chunk = sock.recv(65536)  # a hang shows as socket.timeout: the defect
            if not chunk:
                return parse_response(raw, closed=True)
            raw += chunk


def assert_json_error(response: Response, status: int, prefix: str) -> str:
    assert response.status == status, response
    assert response.headers.get("content-type") == "application/json", response
    message: str = response.json()["error"]
    assert message.startswith(prefix), message
    assert response.closed
    return message


def assert_healthy(gateway: ServerProcess) -> None:
    reply = httpx.get(gateway.url + "/health", timeout=10)
    assert reply.status_code == 200, reply.text


# 1. Header read timeout ------------------------------------------------------------------


@dataclass
class SlowConnection:
    sock: socket.socket
    opened: float
    received: bytes = b""
    ended: float | None = None  # monotonic time the server closed the connection


@dataclass
class Slowloris:
    """`count` connections that send a partial request head, then one more byte every
    `interval` seconds (never finishing it), from one thread."""

    port: int
    count: int
    interval: float
    deadline_s: float
    conns: list[SlowConnection] = field(default_factory=list)

    # Half stall inside the request line, half inside the headers.
    HEADS = (b"GET /hea", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")

    def run(self) -> None:
        selector = selectors.DefaultSelector()
        try:
            for index in range(self.count):
                sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
                sock.sendall(self.HEADS[index % 2])
                sock.setblocking(False)
                conn = SlowConnection(sock, time.monotonic())
                self.conns.append(conn)
                selector.register(sock, selectors.EVENT_READ, conn)
            deadline = time.monotonic() + self.deadline_s
            next_byte = time.monotonic() + self.interval
            while any(c.ended is None for c in self.conns) and time.monotonic() < deadline:
                for key, _ in selector.select(timeout=0.05):
                    conn = key.data
                    try:
                        chunk = conn.sock.recv(65536)
                    except ConnectionResetError:
                        chunk = b""
                    conn.received += chunk
                    if not chunk:
                        conn.ended = time.monotonic()
                        selector.unregister(conn.sock)
                if time.monotonic() >= next_byte:
                    next_byte += self.interval
                    for conn in self.conns:
                        if conn.ended is None and not conn.received:
                            try:
                                conn.sock.send(b"a")
                            except OSError:
                                pass  # the server hung up; the read side reports it
        finally:
            selector.close()
            for conn in self.conns:
                conn.sock.close()


def health_probe(port: int) -> float:
    """Seconds for one `/health` on a new connection (raw socket: a client library's own
    overhead would hide the gateway's)."""
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    elapsed = time.perf_counter() - started
    assert parse_response(raw, closed=True).status == 200, raw
    return elapsed


def summary(latencies: list[float]) -> str:
    return (
        f"n={len(latencies)} p50={statistics.median(latencies) * 1e3:.2f} ms "
        f"max={max(latencies) * 1e3:.2f} ms"
    )


def test_slowloris_connections_get_408_and_health_keeps_answering(
    gateway: ServerProcess,
) -> None:
    baseline = [health_probe(gateway.port) for _ in range(20)]
    attack = Slowloris(gateway.port, count=200, interval=0.5, deadline_s=HEADER_TIMEOUT + SLACK)
    thread = threading.Thread(target=attack.run, daemon=True)
    thread.start()
    latencies = []
    other_clients = []
    with httpx.Client(base_url=gateway.url, timeout=10) as client:
        while thread.is_alive():
            latencies.append(health_probe(gateway.port))
            if len(latencies) % 10 == 0:
                other_clients.append(client.post("/sessions").status_code)
            time.sleep(0.01)
    thread.join()
    print(f"\n/health before: {summary(baseline)}; during 200 slowloris: {summary(latencies)}")
    assert len(attack.conns) == 200
    assert set(other_clients) == {200}
    for conn in attack.conns:
        assert conn.ended is not None, "a slowloris connection is still open"
        assert conn.ended - conn.opened < HEADER_TIMEOUT + SLACK
        # The clock does not restart with each dribbled byte.
        assert conn.ended - conn.opened >= HEADER_TIMEOUT - 0.5
        response = parse_response(conn.received, closed=True)
        message = assert_json_error(response, 408, "request headers not received within")
        assert message == f"request headers not received within {HEADER_TIMEOUT:g} s"
    assert_healthy(gateway)


def test_connection_that_sends_nothing_is_closed_without_reply(gateway: ServerProcess) -> None:
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=HEADER_TIMEOUT + SLACK) as s:
        started = time.monotonic()
        assert s.recv(1024) == b""
        assert time.monotonic() - started >= HEADER_TIMEOUT - 0.5


def test_header_timeout_applies_to_the_next_request_on_a_kept_alive_connection(
    gateway: ServerProcess,
) -> None:
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=HEADER_TIMEOUT + SLACK) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        raw = b""
        while b"\r\n\r\n" not in raw:
            raw += s.recv(65536)
        length = int(parse_response(raw, closed=False).headers["content-length"])
        while len(raw.partition(b"\r\n\r\n")[2]) < length:
            raw += s.recv(65536)
        assert parse_response(raw, closed=False).status == 200
        s.sendall(b"GET /health HTTP/1.1\r\nHo")  # and then nothing more
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    assert_json_error(parse_response(raw, closed=True), 408, "request headers not received")


def test_oversized_request_head_gets_431(gateway: ServerProcess) -> None:
    # Stock uvicorn keeps accumulating a header that never ends until the header timeout;
    # at loopback speed that is gigabytes.
    head = b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * (4 * 1024 * 1024)
    response = exchange(gateway.port, head)
    assert_json_error(response, 431, "request line and headers over the limit")
    assert_healthy(gateway)


# 2. Body read timeout --------------------------------------------------------------------


def test_short_body_gets_408_and_records_nothing(gateway: ServerProcess) -> None:
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        sid = client.post("/sessions").json()["session_id"]
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
        request = (
            f"POST /sessions/{sid}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body) + 100}\r\n\r\n"
        ).encode() + body
        started = time.monotonic()
        response = exchange(gateway.port, request)
        assert time.monotonic() - started >= BODY_TIMEOUT - 0.5
        message = assert_json_error(response, 408, "request body not received")
        assert message == f"request body not received within {BODY_TIMEOUT:g} s"
        assert response.headers.get("connection") == "close"
        assert client.get(f"/sessions/{sid}").json()["records"] == []
        # The worker is unaffected: the same session takes a turn.
        turn = client.post(
            f"/sessions/{sid}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}]},
        )
        assert turn.status_code == 200, turn.text
        assert len(client.get(f"/sessions/{sid}").json()["records"]) == 1
        assert client.delete(f"/sessions/{sid}").status_code == 204
    assert_healthy(gateway)


def test_slow_but_live_body_is_not_cut_off(gateway: ServerProcess) -> None:
    # The body timeout is idle time between chunks, not a deadline for the whole body.
    parts = [b"{", b" " * 10, b" " * 10, b" " * 10, b"}"]
    total = sum(map(len, parts))
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=30) as sock:
        sock.sendall(
            f"POST /sessions HTTP/1.1\r\nHost: x\r\nContent-Length: {total}\r\n"
            "Connection: close\r\n\r\n".encode()
        )
        for part in parts:
            time.sleep(BODY_TIMEOUT * 0.4)  # 2 s of body in all, no gap over 0.8 s
            sock.sendall(part)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    response = parse_response(raw, closed=True)
    assert response.status == 200, response
    assert "session_id" in response.json()


# 3. Malformed HTTP -----------------------------------------------------------------------

MALFORMED = {
    "negative-content-length": b"POST /sessions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    "bad-chunk-size": b"POST /sessions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"zz\r\nabc\r\n0\r\n\r\n",
    "content-length-and-transfer-encoding": b"POST /sessions HTTP/1.1\r\nHost: x\r\n"
    b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "invalid-request-line": b"THIS IS NOT HTTP\r\n\r\n",
    "bad-header-name": b"GET /health HTTP/1.1\r\nBad Header: x\r\n\r\n",
    "undecodable-path": b"GET /sessions/\xff\xfe HTTP/1.1\r\nHost: x\r\n\r\n",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_http_gets_json_400(gateway: ServerProcess, case: str) -> None:
    response = exchange(gateway.port, MALFORMED[case])
    message = assert_json_error(response, 400, "malformed HTTP request: ")
    assert len(message) > len("malformed HTTP request: ")
    assert_healthy(gateway)


# 4. A client that never reads a large GET ------------------------------------------------

R3_MOCK = "--r3-layers 512 --r3-topk 8 --completion-tokens 24 --completion-tokens-jitter 0"
STALL_S = 4.0
RSS_BOUND = 64 * 1024 * 1024


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def router_and_worker(gw: ServerProcess) -> tuple[int, int]:
    """The supervisor's children: workers by /health, the router by its `_router` argv."""
    assert gw.proc is not None
    workers = [w["pid"] for w in httpx.get(gw.url + "/health").json()["workers"]]
    pid = gw.proc.pid
    children = map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
    routers = [c for c in children if b"_router" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(workers) == 1 and len(routers) == 1, (workers, routers)
    return routers[0], workers[0]


def test_stalled_reader_of_a_large_get_holds_bounded_memory() -> None:
    port = free_port()
    args = ["serve", "--port", str(port), "--workers", "1", "--r3", "--mock-args", R3_MOCK]
    # Nothing touched at start: that memory grows the worker on a schedule of its own (a
    # thread after start), which this test must not count as the stalled GET's.
    args += ["--warm-records-bytes", "0"]
    with (
        ServerProcess(args, port, timeout=60) as gw,
        httpx.Client(base_url=gw.url, timeout=60) as client,
    ):
        sid = client.post("/sessions").json()["session_id"]
        messages: list[dict[str, Any]] = [{"role": "user", "content": " ".join(["word"] * 1500)}]
        for turn in range(5):  # ~27-30 MB of base64 R3 per turn, growing with the session
            reply = client.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": messages})
            assert reply.status_code == 200, reply.text
            messages += [
                reply.json()["choices"][0]["message"],
                {"role": "tool", "content": f"{turn}"},
            ]
        router, worker = router_and_worker(gw)
        before = {"router": rss_bytes(router), "worker": rss_bytes(worker)}
        peak = dict(before)
        health = []
        with socket.socket() as sock:
            # A small receive window, so the kernel buffers little on the client's behalf.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            sock.connect(("127.0.0.1", port))
            sock.sendall(f"GET /sessions/{sid} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            end = time.monotonic() + STALL_S
            while time.monotonic() < end:  # read nothing, watch the gateway
                peak["router"] = max(peak["router"], rss_bytes(router))
                peak["worker"] = max(peak["worker"], rss_bytes(worker))
                health.append(health_probe(port))
                time.sleep(0.05)
        dump = client.get(f"/sessions/{sid}")  # the whole dump, read normally
        assert dump.status_code == 200
        growth = {role: peak[role] - before[role] for role in before}
        print(
            f"\nrecords dump {len(dump.content) / 2**20:.0f} MiB; RSS growth while stalled: "
            f"router {growth['router'] / 2**20:.1f} MiB, worker {growth['worker'] / 2**20:.1f} "
            f"MiB; /health meanwhile {summary(health)}"
        )
        assert len(dump.content) > 100 * 2**20
        assert growth["router"] < RSS_BOUND, growth
        assert growth["worker"] < RSS_BOUND, growth
        assert client.delete(f"/sessions/{sid}").status_code == 204
