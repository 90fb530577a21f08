"""Reply bodies as lists of byte slices: JSON with big base64 values spliced in, sent uncopied.

A reply with R3 can be 100 MiB of base64. Both the non-stream reply and the stream's sglext
chunk build their small JSON with `json.dumps` around a placeholder and splice the base64
slices (mostly the shared R3 pool's own chunks) in afterwards; the slices then go to the
socket in bounded sends without being joined.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any, TypeAlias

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from sessiongate.mock_engine.routed_experts import R3_POOL_CHUNK_B64

# A body slice: bytes, or a read-only view into the shared R3 pool.
Part: TypeAlias = bytes | memoryview

# Large bodies go out in slices this big: each send blocks the event loop only briefly and
# uvicorn's flow control paces them (one 80 MiB write would be copied into asyncio's buffer).
# The R3 pool's chunks are at most this big, so they go out as they are (see `send_slices`).
SEND_SLICE = R3_POOL_CHUNK_B64


def json_response(payload: Any, status: int = 200) -> Response:
    """`payload` as compact JSON (error bodies and the small admin replies)."""
    body = json.dumps(payload, separators=(",", ":")).encode()
    return Response(body, status_code=status, media_type="application/json")


def dumps_spliced(payload: Any, splices: Mapping[str, list[Part]]) -> list[Part]:
    """Compact JSON of `payload` as byte slices, each placeholder string replaced by its
    slices (base64, so no escaping is needed). First and last slices are `bytes`."""
    body = json.dumps(payload, separators=(",", ":")).encode()
    if not splices:
        return [body]
    slots = {json.dumps(k).encode(): v for k, v in splices.items()}
    parts: list[Part] = []
    rest = body
    while True:
        found = [(rest.find(slot), slot) for slot in slots if slot in rest]
        if not found:
            break
        at, slot = min(found)
        parts.append(rest[:at] + b'"')
        parts.extend(slots[slot])
        rest = b'"' + rest[at + len(slot) :]
    parts.append(rest)
    return parts


def send_slices(parts: list[Part]) -> Iterator[Part]:
    """`parts` cut to at most SEND_SLICE bytes each, without copying.

    A `bytes` part that is small enough goes out as that very object: h11 passes a lone bytes
    object through (`b"".join([b])` is `b`) but copies a memoryview, so the R3 pool's chunks
    reach the socket uncopied.
    """
    for part in parts:
        if len(part) <= SEND_SLICE:
            yield part
            continue
        view = memoryview(part)
        for start in range(0, len(view), SEND_SLICE):
            yield view[start : start + SEND_SLICE]


class PartsResponse(Response):
    """A response whose body is a list of byte slices, sent without joining them."""

    def __init__(self, parts: list[Part], status_code: int = 200) -> None:
        super().__init__(b"", status_code=status_code, media_type="application/json")
        self.parts = parts
        length = str(sum(len(p) for p in parts)).encode()
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self.raw_headers.append((b"content-length", length))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        for chunk in send_slices(self.parts):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
