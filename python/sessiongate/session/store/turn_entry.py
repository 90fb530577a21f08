"""What a session's file holds: one OPEN entry (who the session is), then one TURN entry per
committed turn, each enough to replay the session's state (messages, token checkpoints,
records) without the engine or the tokenizer.

TURN payload: a u32 length, a JSON head, then binary blobs in this order: the prompt ids
past the kept checkpoint (int64), the completion ids (int32) and logprobs (float64) exactly
as the record holds them, the request bytes and the response bytes. Arrays are in the
machine's byte order (files move between little-endian hosts only).

Tree sessions (docs/trajectory-trees.md) say so in their OPEN entry (`"mode": "tree"`), and
each TURN head carries `"tree": {"id", "parent", "response_id"}`: the node the turn became
and the node it attached to (null: a new root), so recovery rebuilds the tree exactly.
Linear sessions' entries are unchanged (neither key), so older files read as before.
"""

from __future__ import annotations

import json
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sessiongate.session.state import TurnRecord

_HEAD_LEN = struct.Struct("<I")
# Blob order after the head; their byte lengths are listed in the head under "lengths".
BLOBS = ("prompt_tail", "completion_ids", "logprobs", "request", "response")
Span = tuple[int, int]


@dataclass(frozen=True)
class OpenEntry:
    session_id: str
    parent_id: str | None
    root_id: str
    created_at: float
    from_header: bool
    mode: str = "linear"  # "tree": the session is a trajectory tree


def encode_open(entry: OpenEntry) -> bytes:
    document: dict[str, Any] = {
        "session_id": entry.session_id,
        "parent_id": entry.parent_id,
        "root_id": entry.root_id,
        "created_at": entry.created_at,
        "from_header": entry.from_header,
    }
    if entry.mode != "linear":  # linear files stay as they were
        document["mode"] = entry.mode
    return json.dumps(document).encode()


def decode_open(payload: bytes) -> OpenEntry:
    document = json.loads(payload)
    return OpenEntry(
        session_id=str(document["session_id"]),
        parent_id=document["parent_id"],
        root_id=str(document["root_id"]),
        created_at=float(document["created_at"]),
        from_header=bool(document["from_header"]),
        mode=str(document.get("mode", "linear")),
    )


@dataclass(frozen=True)
class TreeLink:
    """Where a tree session's turn sits: its node id (commit order), the node it attached
    to (None: a new root), and the reply's id."""

    node_id: int
    parent: int | None
    response_id: str = ""


@dataclass(frozen=True)
class TurnEntry:
    """A committed turn as the session's state needs it back."""

    kept: int  # checkpoints (and records) kept before this turn: < the count = a rollback
    base_len: int  # stored messages kept before this turn's new ones
    messages: list[Any]  # the new messages: appended by the client, then the assistant's
    tools: Any
    template_kwargs: dict[str, Any]
    prompt_tail: array[int]  # prompt ids past the kept checkpoint
    record: TurnRecord
    routed_span: Span | None  # of routed_experts in the response
    indexer_span: Span | None
    request_offset: int = 0  # of the request bytes, from the payload's start
    response_offset: int = 0
    tree: TreeLink | None = None  # set for tree sessions only


def encode_turn(entry: TurnEntry) -> list[bytes | memoryview]:
    """The payload as parts (the request and response bytes are not copied)."""
    record = entry.record
    blobs: list[bytes | memoryview] = [
        array("q", entry.prompt_tail).tobytes(),
        record.completion_ids.tobytes(),
        record.logprobs.tobytes(),
        record.request,
        record.response,
    ]
    head_fields: dict[str, Any] = {
        "kept": entry.kept,
        "base_len": entry.base_len,
        "messages": entry.messages,
        "tools": entry.tools,
        "template_kwargs": entry.template_kwargs,
        "record": {
            "timestamp": record.timestamp,
            "request_timestamp": record.request_timestamp,
            "method": record.method,
            "path": record.path,
            "status_code": record.status_code,
            "prompt_len": record.prompt_len,
            "finish_reason": record.finish_reason,
            "r3_start_row": record.r3_start_row,
            "weight_version": record.weight_version,
            "cached_tokens": record.cached_tokens,
            "e2e_latency": record.e2e_latency,
            "rollback_steps": record.rollback_steps,
            **_dialect_fields(record),
        },
        "routed_span": entry.routed_span,
        "indexer_span": entry.indexer_span,
        "lengths": [len(blob) for blob in blobs],
    }
    if entry.tree is not None:
        head_fields["tree"] = {
            "id": entry.tree.node_id,
            "parent": entry.tree.parent,
            "response_id": entry.tree.response_id,
        }
    head = json.dumps(head_fields, separators=(",", ":")).encode()
    return [_HEAD_LEN.pack(len(head)), head, *blobs]


def _dialect_fields(record: TurnRecord) -> dict[str, Any]:
    """A dialect turn's record fields in the head (none on chat turns, whose entries keep
    their layout). The client's body is JSON text, kept as a string."""
    if record.dialect is None:
        return {}
    fields: dict[str, Any] = {"dialect": record.dialect}
    if record.client_request is not None:
        fields["client_request"] = record.client_request.decode("utf-8")
    return fields


def _client_request(meta: dict[str, Any]) -> bytes | None:
    text = meta.get("client_request")
    return text.encode("utf-8") if isinstance(text, str) else None


def blob_offsets(parts: Sequence[bytes | memoryview]) -> tuple[int, int]:
    """Offsets of the request and response bytes in a payload made by encode_turn."""
    request = sum(len(part) for part in parts[:-2])
    return request, request + len(parts[-2])


def decode_turn_head(head_and_arrays: bytes) -> tuple[dict[str, Any], int]:
    """The JSON head of a TURN payload and where its blobs start (payload-relative)."""
    (length,) = _HEAD_LEN.unpack_from(head_and_arrays)
    head = json.loads(head_and_arrays[_HEAD_LEN.size : _HEAD_LEN.size + length])
    return head, _HEAD_LEN.size + length


def head_bytes_needed(prefix: bytes) -> int:
    (length,) = _HEAD_LEN.unpack_from(prefix)
    return _HEAD_LEN.size + length


def decode_turn(
    head: dict[str, Any], blobs_start: int, arrays: bytes, request: Any, response: Any
) -> TurnEntry:
    """`arrays` holds the three id/logprob blobs; request and response are given as the
    caller holds them (bytes in memory, or empty when they stay on disk)."""
    lengths = [int(n) for n in head["lengths"]]
    tail_len, completion_len, logprob_len = lengths[:3]
    prompt_tail = array("q")
    prompt_tail.frombytes(arrays[:tail_len])
    completion_ids = array("i")
    completion_ids.frombytes(arrays[tail_len : tail_len + completion_len])
    logprobs = array("d")
    logprobs.frombytes(arrays[tail_len + completion_len : tail_len + completion_len + logprob_len])
    routed = _span(head.get("routed_span"))
    indexer = _span(head.get("indexer_span"))
    meta = head["record"]
    record = TurnRecord(
        timestamp=float(meta["timestamp"]),
        method=str(meta["method"]),
        path=str(meta["path"]),
        status_code=int(meta["status_code"]),
        request=request,
        response=response,
        prompt_len=int(meta["prompt_len"]),
        completion_ids=completion_ids,
        logprobs=logprobs,
        finish_reason=str(meta["finish_reason"]),
        routed_experts=_view(response, routed),
        r3_start_row=int(meta["r3_start_row"]),
        indexer_topk=_view(response, indexer),
        request_timestamp=meta["request_timestamp"],
        weight_version=meta["weight_version"],
        cached_tokens=meta["cached_tokens"],
        # Absent from entries written before it was kept: t0 stays unknown for those.
        e2e_latency=meta.get("e2e_latency"),
        rollback_steps=int(meta.get("rollback_steps", 0)),
        dialect=meta.get("dialect"),
        client_request=_client_request(meta),
    )
    request_offset = blobs_start + tail_len + completion_len + logprob_len
    return TurnEntry(
        kept=int(head["kept"]),
        base_len=int(head["base_len"]),
        messages=list(head["messages"]),
        tools=head["tools"],
        template_kwargs=dict(head["template_kwargs"]),
        prompt_tail=prompt_tail,
        record=record,
        routed_span=routed,
        indexer_span=indexer,
        request_offset=request_offset,
        response_offset=request_offset + lengths[3],
        tree=_tree_link(head.get("tree")),
    )


def _tree_link(value: Any) -> TreeLink | None:
    if value is None:
        return None
    parent = value["parent"]
    return TreeLink(
        node_id=int(value["id"]),
        parent=None if parent is None else int(parent),
        response_id=str(value.get("response_id", "")),
    )


def _span(value: Any) -> Span | None:
    return None if value is None else (int(value[0]), int(value[1]))


def _view(body: Any, span: Span | None) -> memoryview | None:
    if span is None or not len(body):
        return None
    return memoryview(body)[span[0] : span[1]]


def span_in(body: bytes, view: memoryview | None, key: bytes) -> Span | None:
    """Where `view` (a JSON string's text, e.g. routed_experts) lies in `body`.

    The extractor hands out views without offsets. A JSON key with unescaped quotes cannot
    occur inside a string value, so the candidates are the key's occurrences; length and
    both ends must match (a full compare of 64 MiB would cost more than the write)."""
    if view is None:
        return None
    size = len(view)
    needle = b'"' + key + b'":'
    probe = min(size, 64)
    head, tail = bytes(view[:probe]), bytes(view[size - probe :])
    at = body.find(needle)
    while at >= 0:
        start = at + len(needle)
        while body[start : start + 1] in (b" ", b"\t", b"\n", b"\r"):
            start += 1
        start += 1  # the string's opening quote
        end = start + size
        if (
            body[start - 1 : start] == b'"'
            and body[end : end + 1] == b'"'
            and body[start : start + probe] == head
            and body[end - probe : end] == tail
        ):
            return start, end
        at = body.find(needle, at + 1)
    return None
