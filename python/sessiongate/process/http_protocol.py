"""uvicorn's httptools protocol, hardened against slow and malformed clients.

Stock uvicorn waits forever for a request's headers (a slowloris client holds a connection,
and its buffers, as long as it dribbles a byte now and then), accumulates headers without a
size cap, and answers unparsable requests with a plain-text 400 although the gateway's
documented error body is JSON. This subclass adds a header read timeout (408, or a silent
close when the client sent nothing), a cap on the bytes of a request line plus headers (431),
and JSON bodies for every error it writes itself. The body read timeout lives in the ASGI
app (`server/asgi.py`), where the body is read.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

DEFAULT_HEADER_TIMEOUT_S = 10.0
# Generous: a 100 KB session id in a path must still reach id validation (a clear 400),
# while a client streaming endless headers is cut off long before it costs real memory.
DEFAULT_MAX_HEADER_BYTES = 1024 * 1024
# After an error reply, how long the connection keeps reading (and dropping) what the client
# still sends: closing with unread bytes makes the kernel send a reset, which can destroy the
# reply before the client reads it (the "lingering close" of nginx and Apache).
LINGER_S = 2.0

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
        # Set once an error reply went out: the rest of the input is dropped unparsed.
        self._linger: asyncio.TimerHandle | None = None

    # Header timeout -------------------------------------------------------------------

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
        self._in_body = True
        self._header_bytes = 0
        self._cancel_header_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_body = False
        super().on_message_complete()

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
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined request's headers stalled while the previous response is still
            # going out: writing a 408 now would corrupt that response. Judge it afterwards.
            self._arm_header_timer()
            return
        if not self._reading_headers:
            self.transport.close()  # nothing of a request arrived: nobody to answer
            return
        self._reject(408, f"request headers not received within {self.header_timeout:g} s")

    # Malformed requests and oversized headers -----------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._linger is not None:
            return
        if not self._in_body:
            # Counts whole reads, so a read holding a head and the start of its body counts
            # the body bytes too: slack of one read (256 KiB) under a cap far above it.
            self._header_bytes += len(data)
            if self._header_bytes > self.max_header_bytes:
                self._reject(
                    431, f"request line and headers over the limit of {self.max_header_bytes} bytes"
                )
                return
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError as exc:
            # A callback that raised (an undecodable path, say) is reported by httptools as
            # "the ... callback failed"; its cause says what was wrong.
            cause = exc.__cause__ or exc.__context__
            detail = f"{exc}: {cause}" if cause is not None else str(exc)
            logger.info("malformed HTTP request from %s: %s", self.client, detail)
            self._reject(400, f"malformed HTTP request: {detail}")

    def send_400_response(self, msg: str) -> None:
        # uvicorn's own callers of this get the JSON body too.
        self._reject(400, f"malformed HTTP request: {msg}")

    def _reject(self, status: int, message: str) -> None:
        self._cancel_header_timer()
        self._reading_headers = False
        if self.transport.is_closing():
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
