"""An engine stand-in that records every request exactly as it arrived, for the tests of the
gateway's proxy rules (tests/front/test_proxy_rules.py).

It reads HTTP/1.1 strictly (CRLF lines, Content-Length or chunked bodies), so what it records
is what a real engine would take the bytes to mean: method, target, each header line as sent
and the body. Paths under `/v1/script/` answer as scripted below; every other request is
passed to a real engine (the mock) and its reply sent back, so session turns work through it.
The gateways' probes (`/health`, and the engine registry's `/ready`, `/model_info` and
`/server_info` with their `/get_` forms) are passed on but not recorded: they come all the time.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

from support.front_sockets import Reader
from support.procs import mock_engine

# What the gateways ask on their own, on a timer: not part of any test's traffic.
PROBES = frozenset(
    {"/health", "/ready", "/model_info", "/get_model_info", "/server_info", "/get_server_info"}
)
# Scripted replies, by path.
SCRIPT = "/v1/script/"
LIVENESS = 10.0


@dataclass(frozen=True)
class Arrived:
    method: str
    target: str
    headers: list[tuple[str, str]]  # names lowercased, in wire order
    body: bytes

    def header_names(self) -> set[str]:
        return {name for name, _ in self.headers}


class _Conn(Reader):
    """The compiled-front tests' socket reader, reading requests instead of replies."""

    def line(self) -> bytes:
        return self.until(b"\r\n")[:-2]

    def request(self) -> Arrived:
        method, target, version = self.line().decode("latin-1").split(" ")
        assert version == "HTTP/1.1", version
        headers: list[tuple[str, str]] = []
        while line := self.line():
            name, _, value = line.decode("latin-1").partition(":")
            headers.append((name.lower(), value.strip()))
        named = dict(headers)
        if named.get("transfer-encoding") == "chunked":
            body = b""
            while size := int(self.line().split(b";")[0], 16):
                body += self.exactly(size)
                assert self.exactly(2) == b"\r\n"
            while self.line():
                pass
        else:
            body = self.exactly(int(named.get("content-length", "0")))
        return Arrived(method, target, headers, body)


def _reply(status: int, body: bytes, *headers: str, reason: str = "OK") -> bytes:
    lines = [f"HTTP/1.1 {status} {reason}", *headers, f"Content-Length: {len(body)}", "", ""]
    return "\r\n".join(lines).encode() + body


class RawEngine:
    """Threaded loopback server; `arrived` lists the recorded requests in arrival order."""

    def __init__(self, backend_url: str) -> None:
        self.backend = urlsplit(backend_url)
        self.arrived: list[Arrived] = []
        self.connections = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._closing = False
        # Cleared by a test to hold requests in flight: recorded on arrival, answered once it
        # is set again (probes pass, so the engine stays healthy meanwhile).
        self.gate = threading.Event()
        self.gate.set()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def to(self, path: str) -> list[Arrived]:
        """The recorded requests whose target starts with `path`."""
        with self._lock:
            return [a for a in self.arrived if a.target.startswith(path)]

    def clear(self) -> None:
        with self._lock:
            self.arrived.clear()

    def close(self) -> None:
        self._closing = True
        self._listener.close()

    def stop(self) -> None:
        """Go down as a crashed engine does: refuse connections, drop the open ones."""
        try:
            # Closing alone leaves a socket blocked in accept() listening (Linux): shut it.
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.close()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._closing:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
                self._sockets.append(sock)
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        sock.settimeout(60)
        conn = _Conn(sock)
        with sock:
            try:
                while True:
                    request = conn.request()
                    if request.target not in PROBES:
                        with self._lock:
                            self.arrived.append(request)
                        self.gate.wait(LIVENESS)
                    if not self._answer(sock, request):
                        return
            except (EOFError, OSError, ValueError, AssertionError):
                return

    def _answer(self, sock: socket.socket, request: Arrived) -> bool:
        """Send the reply; False to close the connection."""
        if not request.target.startswith(SCRIPT):
            sock.sendall(self._relay(request))
            return True
        what = request.target[len(SCRIPT) :].split("?")[0]
        echo = json.dumps(
            {"method": request.method, "target": request.target, "body": request.body.hex()}
        ).encode()
        if what == "interim":
            # Interim replies first, as an engine behind uvicorn sends for `Expect`.
            sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            sock.sendall(b"HTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n")
            sock.sendall(_reply(200, echo, "Content-Type: application/json"))
        elif what == "switch":
            sock.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: foo\r\n\r\n")
            return False
        elif what == "bare-lf":
            whole = _reply(200, echo, "Content-Type: application/json")
            sock.sendall(whole.replace(b"\r\n", b"\n"))
        elif what == "drop":
            return False  # read it, answer nothing
        elif what == "hop-reply":
            sock.sendall(
                _reply(200, echo, "Connection: keep-alive, X-Up-Hop", "X-Up-Hop: 1", "X-Kept: 1")
            )
        else:
            sock.sendall(_reply(200, echo, "Content-Type: application/json"))
        return True

    def _relay(self, request: Arrived) -> bytes:
        """The real engine's reply to `request`, whole, with a Content-Length."""
        engine = http.client.HTTPConnection(
            self.backend.hostname, self.backend.port, timeout=LIVENESS
        )
        skip = {"host", "content-length", "connection", "transfer-encoding"}
        try:
            engine.putrequest(request.method, request.target, skip_accept_encoding=True)
            for name, value in request.headers:
                if name not in skip:
                    engine.putheader(name, value)
            engine.putheader("Content-Length", str(len(request.body)))
            engine.endheaders(request.body)
            reply = engine.getresponse()
            body = reply.read()
            content_type = reply.getheader("content-type", "application/json")
            return _reply(reply.status, body, f"Content-Type: {content_type}", reason=reply.reason)
        finally:
            engine.close()


@contextmanager
def recording_engine() -> Iterator[RawEngine]:
    """A `RawEngine` in front of a real mock engine process, for a test module's fixture."""
    with mock_engine() as mock:
        raw = RawEngine(mock.url)
        try:
            yield raw
        finally:
            raw.close()
