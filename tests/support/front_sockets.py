"""Raw loopback sockets around the compiled front: a scripted upstream and a client reader."""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

from sessiongate._core import CompiledFront
from sessiongate.front.routes import DEFAULT_SESSION_HEADERS

LIVENESS = 10.0


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Exchanges the front cancels (a client that left, a stop) end in broken pipes.
        pass


class Upstream:
    """Threaded HTTP/1.1 server recording each request it gets.

    `/health` answers 200; `/v1/stream` sends one SSE chunk, waits for `release`, then the
    rest; `/v1/big-stream` sends three chunks of 300 kB; `/v1/slow` waits for `release`
    before a JSON reply; `/v1/status/N` answers N; anything else echoes the request as JSON
    (with Server and Date headers, which the front must not relay)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.replies: list[bytes] = []
        self.got_request = threading.Event()
        self.first_chunk_sent = threading.Event()
        self.release = threading.Event()
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                upstream.handle(self)

            do_POST = do_GET

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def requests_to(self, path: str) -> list[dict[str, Any]]:
        return [r for r in self.seen if r["path"].startswith(path)]

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("content-length") or 0)
        body = h.rfile.read(length)
        if h.path != "/health":
            self.seen.append(
                {
                    "method": h.command,
                    "path": h.path,
                    "headers": [(k.lower(), v) for k, v in h.headers.items()],
                    "body": body,
                }
            )
            self.got_request.set()
        if h.path == "/health":
            self._send(h, 200, b"ok", "text/plain", record=False)
        elif h.path.startswith("/v1/stream"):
            h.send_response(200)
            h.send_header("content-type", "text/event-stream")
            h.send_header("transfer-encoding", "chunked")
            h.end_headers()
            self._chunk(h, b"data: 0\n\n")
            self.first_chunk_sent.set()
            self.release.wait(LIVENESS)
            for i in (1, 2, 3):
                self._chunk(h, f"data: {i}\n\n".encode())
            h.wfile.write(b"0\r\n\r\n")
        elif h.path.startswith("/v1/big-stream"):
            h.send_response(200)
            h.send_header("transfer-encoding", "chunked")
            h.end_headers()
            for i in range(3):
                self._chunk(h, bytes([65 + i]) * 300_000)
            h.wfile.write(b"0\r\n\r\n")
        elif h.path.startswith("/v1/slow"):
            self.release.wait(LIVENESS)
            self._send(h, 200, b'{"slow":true}')
        elif h.path.startswith("/v1/status/"):
            status = int(h.path.rsplit("/", 1)[1])
            self._send(h, status, b"" if status == 204 else b'{"status":true}')
        else:
            reply = json.dumps(
                {"method": h.command, "path": h.path, "echo": body.decode("latin-1")},
                ensure_ascii=False,
            ).encode()
            self._send(h, 200, reply, extra=[("x-upstream", "yes")])

    def _send(
        self,
        h: BaseHTTPRequestHandler,
        status: int,
        body: bytes,
        content_type: str = "application/json",
        extra: list[tuple[str, str]] = [],  # noqa: B006 (never mutated)
        record: bool = True,
    ) -> None:
        if record:  # probes run concurrently with the tests' requests
            self.replies.append(body)
        h.send_response(status)
        h.send_header("content-type", content_type)
        for name, value in extra:
            h.send_header(name, value)
        if status != 204:
            h.send_header("content-length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    @staticmethod
    def _chunk(h: BaseHTTPRequestHandler, data: bytes) -> None:
        h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        h.wfile.flush()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


class Reader:
    """HTTP/1.1 replies read off a client socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise EOFError("connection closed")
        self.buf += data

    def until(self, sep: bytes) -> bytes:
        while sep not in self.buf:
            self._fill()
        out, _, self.buf = self.buf.partition(sep)
        return out + sep

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def head(self) -> tuple[int, list[tuple[str, str]], bytes]:
        raw = self.until(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        assert lines[0].startswith("HTTP/1.1 ")
        headers = [
            (k.lower(), v.strip()) for k, v in (line.split(":", 1) for line in lines[1:] if line)
        ]
        return status, headers, raw

    def chunk(self) -> bytes:
        """One chunk's data; b"" for the terminating chunk."""
        size = int(self.until(b"\r\n")[:-2], 16)
        data = self.exactly(size)
        assert self.exactly(2) == b"\r\n"
        return data

    def response(self) -> tuple[int, dict[str, str], bytes]:
        status, headers, _ = self.head()
        named = dict(headers)
        if "content-length" in named:
            body = self.exactly(int(named["content-length"]))
        elif named.get("transfer-encoding") == "chunked":
            body = b"".join(iter(self.chunk, b""))
        else:
            body = b""
        return status, named, body

    def at_eof(self) -> bool:
        if self.buf:
            return False
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True


def post(path: str, body: bytes, *headers: str) -> bytes:
    extra = "".join(f"{h}\r\n" for h in headers)
    head = f"POST {path} HTTP/1.1\r\nHost: front\r\n{extra}Content-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def get(path: str, *headers: str) -> bytes:
    extra = "".join(f"{h}\r\n" for h in headers)
    return f"GET {path} HTTP/1.1\r\nHost: front\r\n{extra}\r\n".encode()


CHAT = "/v1/chat/completions"


class Front:
    """A CompiledFront on a fresh listening socket, plus the hand-off pipe."""

    def __init__(self, upstreams: list[str], **overrides: Any) -> None:
        self.listener = socket.socket()
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.adopted: list[socket.socket] = []
        self.clients: list[socket.socket] = []
        options: dict[str, Any] = {
            "max_body_bytes": 1 << 20,
            "api_key": None,
            "session_headers": list(DEFAULT_SESSION_HEADERS),
            "header_timeout": 5.0,
            "body_timeout": 5.0,
            "keepalive_timeout": 5.0,
            "upstream_timeout": LIVENESS,
            "connect_timeout": 2.0,
            "threads": 2,
            "latency_buckets": [0.001, 0.01, 0.1, 1.0],
            **overrides,
        }
        try:
            self.listener.bind(("127.0.0.1", 0))
            self.listener.listen(128)
            self.address = self.listener.getsockname()
            self.core = CompiledFront(self.listener.fileno(), self.wake_w, upstreams, **options)
        except BaseException:
            self._close_fds()
            raise

    def connect(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=LIVENESS)
        self.clients.append(sock)
        return sock

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self.core.stats()
        return stats

    def wait_handoff(self) -> tuple[socket.socket, bytes]:
        """The next handed-off connection (closed at teardown) and its bytes."""
        deadline = time.monotonic() + LIVENESS
        while time.monotonic() < deadline:
            select.select([self.wake_r], [], [], deadline - time.monotonic())
            with contextlib.suppress(BlockingIOError):
                os.read(self.wake_r, 4096)
            handoffs = self.core.take_handoffs()
            for fd, _ in handoffs:
                self.adopted.append(socket.socket(fileno=fd))
            if handoffs:
                assert len(handoffs) == 1, handoffs
                sock = self.adopted[-1]
                sock.setblocking(True)
                sock.settimeout(LIVENESS)
                return sock, handoffs[0][1]
        raise AssertionError("no hand-off arrived")

    def wait_until(self, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        deadline = time.monotonic() + LIVENESS
        while True:
            stats = self.stats()
            if predicate(stats):
                return stats
            assert time.monotonic() < deadline, stats
            time.sleep(0.01)

    def _close_fds(self) -> None:
        for sock in self.adopted + self.clients:
            sock.close()
        for fd in (self.wake_r, self.wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.listener.close()

    def close(self) -> None:
        # Clients first, so that stop() has no connection to wait for.
        for sock in self.adopted + self.clients:
            sock.close()
        try:
            if hasattr(self, "core"):
                self.core.stop(1.0)
        finally:
            self._close_fds()


F = TypeVar("F", bound=Front)


@contextlib.contextmanager
def fronts_of(kind: type[F]) -> Iterator[Callable[..., F]]:
    """A maker of `kind` fronts, all closed at the end."""
    fronts: list[F] = []

    def make(upstreams: list[str], **overrides: Any) -> F:
        front = kind(upstreams, **overrides)
        fronts.append(front)
        return front

    try:
        yield make
    finally:
        for front in fronts:
            front.close()
