"""uvicorn's httptools protocol, hardened against slow, malformed and smuggling clients.

Stock uvicorn waits forever for a request's headers (a slowloris client holds a connection,
and its buffers, as long as it dribbles a byte now and then), accumulates headers without a
size cap, and answers unparsable requests with a plain-text 400 although the gateway's
documented error body is JSON. This subclass adds a header read timeout (408, or a silent
close when the client sent nothing), a cap on the bytes of a request line plus headers (431),
and JSON bodies for every error it writes itself. The body read timeout lives in the ASGI
app (`front/asgi.py`), where the body is read.

It also keeps the HTTP/1.1 rules a proxy must keep (the table in docs/reliability.md):
- The gateway never upgrades a connection. llhttp stops at the end of an upgrade request's
  head and hands what follows to "the new protocol", so stock uvicorn runs the request with
  an empty body and then parses the body bytes as a request of their own (a smuggled
  request). Here the head is parsed again without its upgrade, so the body is read as the
  framing says and `Upgrade` is simply ignored (RFC 9110 §7.8).
- A head is refused before any app sees it when it has no Host or two (400, RFC 9112 §3.2),
  an HTTP version other than 1.0 and 1.1 (505), a transfer coding other than `chunked`
  (501, RFC 9112 §6.1), `Transfer-Encoding` on HTTP/1.0 (400) or the CONNECT method (405).
- An error found in a pipelined request's head is answered after the replies to the
  requests before it, in order (RFC 9112 §9.3.2), not instead of them.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from sessiongate.config.front import DEFAULT_HEADER_TIMEOUT_S
from sessiongate.http.forwarding import header_list

# Generous: a 100 KB session id in a path must still reach id validation (a clear 400),
# while a client streaming endless headers is cut off long before it costs real memory.
DEFAULT_MAX_HEADER_BYTES = 1024 * 1024
# After an error reply, how long the connection keeps reading (and dropping) what the client
# still sends: closing with unread bytes makes the kernel send a reset, which can destroy the
# reply before the client reads it (the "lingering close" of nginx and Apache).
LINGER_S = 2.0
# The connection options that ask for an upgrade; they go with the Upgrade header.
_UPGRADE_OPTIONS = frozenset({"upgrade", "http2-settings"})

logger = logging.getLogger(__name__)


def json_error_response(
    status: int, message: str, default_headers: list[tuple[bytes, bytes]]
) -> bytes:
    """A complete `{"error": message}` response that closes the connection."""
    body = json.dumps({"error": message}, ensure_ascii=False, separators=(",", ":")).encode()
    head = [STATUS_LINE[status]]
    for name, value in default_headers:
        head += [name, b": ", value, b"\r\n"]
    head += [
        b"content-type: application/json\r\n",
        b"content-length: " + str(len(body)).encode() + b"\r\n",
        b"connection: close\r\n\r\n",
    ]
    return b"".join(head) + body


def head_problem(
    method: bytes, version: str, headers: list[tuple[bytes, bytes]]
) -> tuple[int, str] | None:
    """Why a parsed request head must be refused (status, message), or None. `headers` have
    lowercased names, as uvicorn collects them."""
    if version not in ("1.0", "1.1"):
        return 505, f"HTTP/{version} is not supported: the gateway speaks HTTP/1.1 and HTTP/1.0"
    hosts = sum(1 for name, _ in headers if name == b"host")
    if hosts > 1:
        return 400, "malformed HTTP request: more than one Host header"
    if hosts == 0 and version == "1.1":
        return 400, "malformed HTTP request: an HTTP/1.1 request needs a Host header"
    codings = [
        coding
        for name, value in headers
        if name == b"transfer-encoding"
        for coding in header_list(value.decode("latin-1"))
    ]
    if codings and version == "1.0":
        return 400, "malformed HTTP request: Transfer-Encoding in an HTTP/1.0 request"
    unknown = [c for c in codings if c != "chunked"]
    if unknown:
        return 501, f"transfer coding not supported: {', '.join(unknown)} (only chunked is)"
    if method == b"CONNECT":
        return 405, "CONNECT is not served: the gateway is not a forward proxy"
    return None


def head_without_upgrade(
    method: bytes, url: bytes, version: str, headers: list[tuple[bytes, bytes]]
) -> bytes:
    """The request head again, less `Upgrade`, `HTTP2-Settings` and the connection options
    naming them, for a parser that then reads the body as its framing says."""
    lines = [method + b" " + url + b" HTTP/" + version.encode() + b"\r\n"]
    for name, value in headers:
        if name in (b"upgrade", b"http2-settings"):
            continue
        if name == b"connection":
            options = header_list(value.decode("latin-1"))
            kept = [o for o in options if o not in _UPGRADE_OPTIONS]
            if not kept:
                continue
            value = ", ".join(kept).encode("latin-1")
        lines.append(name + b": " + value + b"\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a connection whose input is refused."""


class GatewayHttpProtocol(HttpToolsProtocol):
    """One HTTP/1.1 connection; see the module docstring for what it adds to uvicorn's."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        # True between the first byte of a request and its complete headers.
        self._reading_headers = False
        # True from a request's complete headers to its complete body: reads are not counted.
        self._in_body = False
        # Bytes received since the previous request's headers: this request's head so far.
        self._header_bytes = 0
        # Set once the input is refused: the rest of it is dropped unparsed.
        self._refused = False
        # An error to answer once the replies to earlier (pipelined) requests are out.
        self._pending_error: tuple[int, str] | None = None
        # Set once an error reply went out (the lingering close is under way).
        self._linger: asyncio.TimerHandle | None = None
        # The head of an upgrade request, rebuilt without the upgrade, to parse again.
        self._upgrade_head: bytes | None = None

    # Header timeout -------------------------------------------------------------------

    # uvicorn's signature (a Transport, narrower than asyncio's BaseTransport).
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # uvicorn has no timer for a fresh connection that never sends a byte.
        self._arm_header_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading_headers = True
        if self._header_timer is None:
            # A keep-alive connection's next request: the clock starts at its first byte.
            self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._reading_headers = False
        self._header_bytes = 0
        self._cancel_header_timer()
        method = self.parser.get_method()
        version = self.parser.get_http_version()
        problem = head_problem(method, version, self.headers)
        if problem is not None:
            self._refuse(*problem)
            raise _Refused
        self._in_body = True
        if self.parser.should_upgrade():
            # llhttp will stop here and take the rest for another protocol: parse the head
            # again without the upgrade (see the module docstring); no cycle for this one.
            self._upgrade_head = head_without_upgrade(method, self.url, version, self.headers)
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if self._upgrade_head is None:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_body = False
        if self._upgrade_head is None:
            super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._pending_error is not None and not self._answering():
            # Every earlier request has its reply: now the error.
            self._unset_keepalive_if_required()
            status, message = self._pending_error
            self._pending_error = None
            self._reject(status, message)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        if self._linger is not None:
            self._linger.cancel()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self._refused:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined request's headers stalled while the previous response is still
            # going out: writing a 408 now would corrupt that response. Judge it afterwards.
            self._arm_header_timer()
            return
        if not self._reading_headers:
            self.transport.close()  # nothing of a request arrived: nobody to answer
            return
        self._refuse(408, f"request headers not received within {self.header_timeout:g} s")

    # Malformed requests and oversized headers -----------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if not self._in_body:
            # Counts whole reads, so a read holding a head and the start of its body counts
            # the body bytes too: slack of one read (256 KiB) under a cap far above it.
            self._header_bytes += len(data)
            if self._header_bytes > self.max_header_bytes:
                self._refuse(
                    431, f"request line and headers over the limit of {self.max_header_bytes} bytes"
                )
                return
        self._unset_keepalive_if_required()
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            head, self._upgrade_head = self._upgrade_head, None
            if head is None:  # cannot happen: every upgrade head is rebuilt above
                self._refuse(400, "malformed HTTP request: unexpected protocol upgrade")
                return
            # A fresh parser reads the rebuilt head, then the bytes after the original one.
            self.parser = httptools.HttpRequestParser(self)
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
            self._feed(head + data[exc.args[0] :])
        except httptools.HttpParserError as exc:
            # A callback that raised (an undecodable path, say) is reported by httptools as
            # "the ... callback failed"; its cause says what was wrong.
            cause = exc.__cause__ or exc.__context__
            if isinstance(cause, _Refused):
                return  # answered (or to be answered) already
            detail = f"{exc}: {cause}" if cause is not None else str(exc)
            logger.info("malformed HTTP request from %s: %s", self.client, detail)
            self._refuse(400, f"malformed HTTP request: {detail}")

    def send_400_response(self, msg: str) -> None:
        # uvicorn's own callers of this get the JSON body too.
        self._refuse(400, f"malformed HTTP request: {msg}")

    def _answering(self) -> bool:
        """Whether replies to earlier, complete requests are still to go out."""
        if self.pipeline:
            return True
        return self.cycle is not None and not self.cycle.response_complete

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` and close; input from here on is dropped. An error in the head of
        a pipelined request waits for the replies to the requests before it."""
        if self._refused:
            return
        self._refused = True
        self._cancel_header_timer()
        self._reading_headers = False
        if not self._in_body and self._answering():
            self._pending_error = (status, message)
            return
        self._reject(status, message)

    def _reject(self, status: int, message: str) -> None:
        self._refused = True
        if self.transport.is_closing() or self._linger is not None:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # The app owns this connection's output (it started a response, or is reading a
            # body that turned out malformed): end the exchange; the app sees a disconnect.
            self.cycle.disconnected = True
            self.cycle.message_event.set()
            if self.cycle.response_started:
                self.transport.close()
                return
        self.transport.write(
            json_error_response(status, message, self.server_state.default_headers)
        )
        if not self.transport.can_write_eof():  # TLS: no half-close
            self.transport.close()
            return
        # Half-close: the reply and a FIN go out; keep draining the client until it hangs up
        # (eof_received closes the transport) or the linger time is over.
        self.transport.write_eof()
        self._linger = self.loop.call_later(LINGER_S, self.transport.close)


def gateway_protocol(
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
) -> type[GatewayHttpProtocol]:
    """A protocol class for `uvicorn.Config(http=...)`, which instantiates it itself."""
    return type(
        "GatewayHttpProtocol",
        (GatewayHttpProtocol,),
        {"header_timeout": header_timeout, "max_header_bytes": max_header_bytes},
    )
