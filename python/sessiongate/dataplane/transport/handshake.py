"""The connection handshake of a TCP worker channel (docs/ipc.md "TCP transport").

Before any frame, router and worker prove to each other that they hold the same shared
secret, without sending it: a challenge-response with HMAC-SHA256 over the whole handshake
transcript (both sides' random nonces, the protocol version in every message header, and the
router's hello). The worker only proves itself to a router that proved itself first, so an
unauthenticated client learns nothing from the worker but its protocol version.

Every handshake message is `MAGIC | u16 version | u8 kind | u16 length | payload`. That
13-byte header and the ERROR message are frozen for all versions, so two releases that speak
different protocol versions can always tell each other so before closing.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import re
import struct
from typing import Any

# PNG-style: a high-bit byte catches 7-bit channels, CR LF catches newline translation, and
# no HTTP method or TLS record starts like this.
MAGIC = b"\x89SGIPC\r\n"
PROTOCOL_VERSION = 1
NONCE_SIZE = 32
MAC_SIZE = 32
MAX_PAYLOAD = 4096

KIND_HELLO = 1  # router -> worker: nonce + JSON router info
KIND_CHALLENGE = 2  # worker -> router: nonce
KIND_PROOF = 3  # router -> worker: HMAC
KIND_ACCEPT = 4  # worker -> router: HMAC + JSON worker info
KIND_ERROR = 0xFF  # either way: UTF-8 reason, then the sender closes

_HEADER = struct.Struct(">8sHBH")
HEADER_SIZE = _HEADER.size  # 13
_ROUTER_LABEL = b"sessiongate router proof\x00"
_WORKER_LABEL = b"sessiongate worker proof\x00"
_HTTP_START = re.compile(rb"[A-Z]{3,8}( |$)")

HTTP_REFUSAL_TEXT = (
    "This is a sessiongate worker port: it speaks sessiongate's framed IPC protocol to a "
    "sessiongate router (after an authenticated handshake), not HTTP. Send HTTP requests to "
    "the router (`sessiongate serve`).\n"
)


class HandshakeError(Exception):
    """The handshake failed; the message says why (and whose side refused)."""


def encode_message(kind: int, payload: bytes = b"", version: int = PROTOCOL_VERSION) -> bytes:
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"handshake payload of {len(payload)} bytes is over {MAX_PAYLOAD}")
    return _HEADER.pack(MAGIC, version, kind, len(payload)) + payload


def encode_error(reason: str) -> bytes:
    return encode_message(KIND_ERROR, reason.encode()[:MAX_PAYLOAD])


def looks_like_http(head: bytes) -> bool:
    """True for the first bytes of an HTTP/1.x request line (`GET /...`, `POST ...`)."""
    return _HTTP_START.match(head) is not None


def http_refusal() -> bytes:
    body = HTTP_REFUSAL_TEXT.encode()
    return (
        b"HTTP/1.1 400 Bad Request\r\n"
        b"Content-Type: text/plain; charset=utf-8\r\n"
        b"Connection: close\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    )


def _mac(secret: bytes, label: bytes, transcript: bytes) -> bytes:
    return hmac.new(secret, label + transcript, hashlib.sha256).digest()


async def _read_message(reader: asyncio.StreamReader, head: bytes = b"") -> tuple[int, int, bytes]:
    """(version, kind, payload) of one message; `head` = bytes of it already read."""
    header = head + await reader.readexactly(HEADER_SIZE - len(head))
    magic, version, kind, length = _HEADER.unpack(header)
    if magic != MAGIC:
        raise HandshakeError(f"not a sessiongate handshake (first bytes {header[:8]!r})")
    if length > MAX_PAYLOAD:
        raise HandshakeError(f"handshake message of {length} bytes is over {MAX_PAYLOAD}")
    return version, kind, await reader.readexactly(length)


def _json(payload: bytes, what: str) -> dict[str, Any]:
    try:
        document = json.loads(payload)
    except ValueError as exc:
        raise HandshakeError(f"malformed {what}: {exc}") from None
    if not isinstance(document, dict):
        raise HandshakeError(f"malformed {what}: not a JSON object")
    return document


async def _send(writer: asyncio.StreamWriter, message: bytes) -> None:
    writer.write(message)
    await writer.drain()


async def refuse(writer: asyncio.StreamWriter, reason: str) -> None:
    """Tell the peer why (an ERROR message), best effort; the caller closes."""
    try:
        await _send(writer, encode_error(reason))
    except (ConnectionError, OSError):
        pass


def _refusal(payload: bytes) -> str:
    return f"the worker refused the connection: {payload.decode(errors='replace')}"


async def client_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    secret: bytes,
    info: dict[str, Any],
    *,
    version: int = PROTOCOL_VERSION,
) -> dict[str, Any]:
    """The router's side; returns the worker's info. Raises HandshakeError (the worker
    refused, or failed to prove the secret), IncompleteReadError or OSError."""
    hello = encode_message(KIND_HELLO, os.urandom(NONCE_SIZE) + json.dumps(info).encode(), version)
    await _send(writer, hello)
    peer_version, kind, payload = await _read_message(reader)
    if kind == KIND_ERROR:
        raise HandshakeError(_refusal(payload))
    if peer_version != version:
        reason = (
            f"protocol version mismatch: the router speaks IPC protocol v{version}, the "
            f"worker v{peer_version}; run the same sessiongate release on both"
        )
        await refuse(writer, reason)
        raise HandshakeError(reason)
    if kind != KIND_CHALLENGE or len(payload) != NONCE_SIZE:
        raise HandshakeError(f"unexpected handshake message (kind {kind}) instead of a challenge")
    challenge = encode_message(KIND_CHALLENGE, payload, peer_version)
    transcript = hello + challenge
    proof = encode_message(KIND_PROOF, _mac(secret, _ROUTER_LABEL, transcript), version)
    await _send(writer, proof)
    _, kind, payload = await _read_message(reader)
    if kind == KIND_ERROR:
        raise HandshakeError(_refusal(payload))
    if kind != KIND_ACCEPT or len(payload) < MAC_SIZE:
        raise HandshakeError(f"unexpected handshake message (kind {kind}) instead of an accept")
    mac, details = payload[:MAC_SIZE], payload[MAC_SIZE:]
    expected = _mac(secret, _WORKER_LABEL, transcript + proof + details)
    if not hmac.compare_digest(mac, expected):
        reason = "authentication failed: the worker's proof does not match the router's secret"
        await refuse(writer, reason)
        raise HandshakeError(reason)
    return _json(details, "worker info")


async def server_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    secret: bytes,
    info: dict[str, Any],
    *,
    refuse_reason: str | None = None,
) -> dict[str, Any]:
    """The worker's side; returns the router's info once it proved the secret. On any
    refusal the peer has been told why (ERROR message, or HTTP 400 for an HTTP client) and
    HandshakeError is raised; the caller closes the connection. With `refuse_reason` a
    well-formed hello is refused with that reason (e.g. TLS is required)."""
    head = await reader.readexactly(len(MAGIC))
    if head != MAGIC:
        if looks_like_http(head):
            # Read the request head first: closing with unread data would reset the
            # connection and the client might never see the answer.
            try:
                await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                pass
            writer.write(http_refusal())
            await writer.drain()
            raise HandshakeError("plain HTTP request on the worker port (answered 400)")
        reason = "not a sessiongate router: the connection did not start with the IPC handshake"
        await refuse(writer, reason)
        raise HandshakeError(f"{reason} (first bytes {head!r})")
    version, kind, payload = await _read_message(reader, head)
    if refuse_reason is not None:
        await refuse(writer, refuse_reason)
        raise HandshakeError(refuse_reason)
    if version != PROTOCOL_VERSION:
        reason = (
            f"protocol version mismatch: this worker speaks IPC protocol v{PROTOCOL_VERSION}, "
            f"the router sent v{version}; run the same sessiongate release on the router "
            "and its workers"
        )
        await refuse(writer, reason)
        raise HandshakeError(reason)
    if kind != KIND_HELLO or len(payload) < NONCE_SIZE:
        reason = f"expected a hello, got handshake message kind {kind}"
        await refuse(writer, reason)
        raise HandshakeError(reason)
    hello = encode_message(kind, payload, version)
    challenge = encode_message(KIND_CHALLENGE, os.urandom(NONCE_SIZE))
    await _send(writer, challenge)
    transcript = hello + challenge
    _, kind, mac = await _read_message(reader)
    if kind != KIND_PROOF or not hmac.compare_digest(mac, _mac(secret, _ROUTER_LABEL, transcript)):
        reason = (
            "authentication failed: wrong shared secret (the router's proof does not match "
            "this worker's secret)"
            if kind == KIND_PROOF
            else f"expected a proof, got handshake message kind {kind}"
        )
        await refuse(writer, reason)
        raise HandshakeError(reason)
    # Only now is the router's info trustworthy: the proof covers it.
    router_info = _json(payload[NONCE_SIZE:], "router info")
    proof = encode_message(KIND_PROOF, mac, version)
    details = json.dumps(info).encode()
    accept = _mac(secret, _WORKER_LABEL, transcript + proof + details) + details
    await _send(writer, encode_message(KIND_ACCEPT, accept))
    return router_info
