"""A plain HTTP server on a loopback thread that answers every GET with 200 and one small
JSON object, counting the GETs by path: an engine stand-in that is healthy and has model
info, or another service squatting on a port."""

from __future__ import annotations

import contextlib
import json
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

# A whole chat completion as an engine answers it (what stand-in engines reply to POSTs).
CHAT_COMPLETION = json.dumps(
    {
        "id": "c",
        "object": "chat.completion",
        "created": 0,
        "model": "stub",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()


class QuietJsonHandler(BaseHTTPRequestHandler):
    """A handler that answers JSON and logs nothing."""

    def send_json(self, body: bytes, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class LoopbackServer(ThreadingHTTPServer):
    """A threaded server on a free loopback port; `lock` guards what handlers count."""

    daemon_threads = True

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.lock = threading.Lock()  # handlers run on threads of their own
        super().__init__(("127.0.0.1", 0), handler)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class JsonStub(LoopbackServer):
    def __init__(self, body: bytes) -> None:
        self.body = body
        self.gets: Counter[str] = Counter()
        super().__init__(_Handler)


class _Handler(QuietJsonHandler):
    server: JsonStub

    def do_GET(self) -> None:
        with self.server.lock:
            self.server.gets[self.path] += 1
        self.send_json(self.server.body)


Server = TypeVar("Server", bound=ThreadingHTTPServer)


@contextlib.contextmanager
def serving(server: Server) -> Iterator[Server]:
    """`server` answering on a thread of its own until the block ends, then closed."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@contextlib.contextmanager
def json_stub(body: bytes = b'{"status":"ok"}') -> Iterator[JsonStub]:
    """The stub serving until the block ends."""
    with serving(JsonStub(body)) as server:
        yield server
