"""Per-session state: history, token checkpoints, turn records, and turn bookkeeping."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sessiongate.session.messages import Message
from sessiongate.session.tree import SessionTree


@dataclass(frozen=True)
class TurnRecord:
    """One recorded turn, kept as the bytes that crossed the wire.

    `request` is the body sent upstream (with `input_ids`), `response` the upstream's reply
    exactly as received (R3 included). Keeping bytes avoids holding 100+ MiB replies as
    Python objects and lets GET concatenate instead of re-serialising.
    """

    timestamp: float
    method: str
    path: str
    status_code: int
    request: bytes
    response: bytes
    # What the trajectory export needs, extracted once when the turn was recorded.
    prompt_len: int = 0
    completion_ids: array[int] = field(default_factory=lambda: array("i"))
    # float64, as JSON gave them: samples carry the exact sampled logprobs.
    logprobs: array[float] = field(default_factory=lambda: array("d"))
    finish_reason: str = ""
    # choices[0].meta_info.routed_experts (base64) as a view into `response`, or None.
    routed_experts: memoryview | None = None
    # First R3 row the turn asked for (`routed_experts_start_len`, addition R3): the
    # turn's routed_experts hold rows [r3_start_row, prompt_len + completion - 1).
    r3_start_row: int = 0
    # choices[0].meta_info.indexer_topk (base64 int32) as a view into `response`, or None.
    indexer_topk: memoryview | None = None
    # When the turn's request arrived (`timestamp` is when it was recorded).
    request_timestamp: float | None = None
    # The engine's weight version that sampled the turn (meta_info or response metadata).
    weight_version: str | None = None
    # Prompt tokens the engine served from its prefix cache (meta_info.cached_tokens).
    cached_tokens: int | None = None
    # The engine's seconds from the request to its finish (meta_info.e2e_latency): the
    # samples' lifecycle segment starts that long before `timestamp`.
    e2e_latency: float | None = None
    # Assistant steps this turn rolled back (the records it replaced; 0: none).
    rollback_steps: int = 0
    # The client API the turn was asked in when not OpenAI chat (`"anthropic"`; None: chat),
    # and the client's body exactly as sent (`request` is the chat body it became).
    dialect: str | None = None
    client_request: bytes | None = None

    @property
    def aborted(self) -> bool:
        """The engine aborted the turn (finish reason "abort"): recorded, but marked."""
        return self.finish_reason == "abort"

    @property
    def status(self) -> str:
        """The turn's sample status, as the rollout framework names them."""
        if self.finish_reason == "abort":
            return "aborted"
        if self.finish_reason == "length":
            return "truncated"
        return "completed"

    @property
    def size(self) -> int:
        return len(self.request) + len(self.response)

    def json_parts(self) -> Iterable[bytes]:
        """The record's JSON object as parts to concatenate (the bodies are not copied)."""
        return (self.json_head(), self.request, b',"response":', self.response, b"}")

    def json_head(self) -> bytes:
        """The record's JSON up to its request body: `{...,"request":`."""
        head = json.dumps(
            {
                "timestamp": self.timestamp,
                "request_timestamp": self.request_timestamp,
                "method": self.method,
                "path": self.path,
                "status_code": self.status_code,
                # Trainers filter and weight turns by these without parsing the bodies.
                "status": self.status,
                "finish_reason": self.finish_reason,
                "weight_version": self.weight_version,
                "cached_tokens": self.cached_tokens,
                "rollback_steps": self.rollback_steps,
            },
            separators=(",", ":"),
        ).encode()
        if self.dialect is not None:
            # Only on dialect turns, so a chat record's JSON is what it always was.
            dialect = json.dumps(self.dialect).encode()
            head = head[:-1] + b',"dialect":' + dialect + b"}"
            if self.client_request is not None:
                head = head[:-1] + b',"client_request":' + self.client_request + b"}"
        return head[:-1] + b',"request":'

    def to_json(self) -> bytes:
        return b"".join(self.json_parts())


@dataclass
class Session:
    session_id: str
    parent_id: str | None
    root_id: str
    created_at: float
    messages: list[Message] = field(default_factory=list)
    # Checkpoint i = prompt ids + completion ids after assistant turn i; records[i] is that
    # turn. Only the last one is held whole; each earlier one as a link to the one after it:
    # the length both share and its own ids past that (each turn extends its predecessor
    # but for up to --max-trim-tokens trailing ids, so a link is a few ids). A rollback to
    # any depth (plan_history) costs no memory per step: holding every checkpoint made long
    # sessions O(turns^2). As int64 arrays, which the garbage collector never scans.
    last_checkpoint: array[int] | None = None
    checkpoint_links: list[tuple[int, array[int]]] = field(default_factory=list)
    records: list[TurnRecord] = field(default_factory=list)
    # OpenAI Responses turns: response id -> (the id it continued from, what it added);
    # session/response_history.py.
    responses: dict[str, tuple[str | None, list[dict[str, Any]]]] = field(default_factory=dict)
    # sum(r.size for r in records), kept by the core's commits (the worker's records budget).
    records_bytes: int = 0
    # checkpoint_ends[i] = how many messages the history held after generated turn i (a
    # client may bring assistant messages of its own, e.g. few-shot examples).
    checkpoint_ends: list[int] = field(default_factory=list)
    tools: object = None
    # The chat template variables the last turn was rendered with.
    template_kwargs: dict[str, object] = field(default_factory=dict)
    children: list[str] = field(default_factory=list)
    # Tree mode (docs/trajectory-trees.md): the session's nodes; `records[i]` is node i's
    # record, and messages / checkpoints above stay empty. None: a linear session.
    tree: SessionTree | None = None
    # Created on first use by a session header: expires after the idle TTL.
    from_header: bool = False
    last_active: float = field(default_factory=time.monotonic)
    # Bumped by every committed turn, so a turn that raced another one can tell.
    version: int = 0
    closing: bool = False
    inflight: int = 0
    # The write of its OPEN entry to the records directory, if there is one.
    opened: concurrent.futures.Future[int] | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()

    @property
    def accumulated_ids(self) -> array[int]:
        return self.last_checkpoint if self.last_checkpoint is not None else array("q")

    @property
    def checkpoint_count(self) -> int:
        return len(self.checkpoint_links) + (self.last_checkpoint is not None)

    def checkpoint(self, count: int) -> array[int]:
        """The ids after generated turn `count` (1-based), rebuilt from the last one through
        the links in between (LookupError for a turn the session does not have)."""
        total = self.checkpoint_count
        if not 1 <= count <= total or self.last_checkpoint is None:
            raise LookupError(f"session {self.session_id} has no checkpoint {count} of {total}")
        ids = self.last_checkpoint
        for shared, tail in reversed(self.checkpoint_links[count - 1 :]):
            ids = ids[:shared] + tail
        return ids

    def commit_checkpoint(self, kept: int, ids: Sequence[int]) -> None:
        """Keep `kept` checkpoints (the later ones are rolled back), then append `ids`."""
        new = array("q", ids)
        if kept == 0:
            self.checkpoint_links = []
        else:
            base = self.checkpoint(kept)
            shared = _shared_length(base, new)
            self.checkpoint_links = [*self.checkpoint_links[: kept - 1], (shared, base[shared:])]
        self.last_checkpoint = new

    def turn_started(self) -> None:
        self.inflight += 1
        self.idle.clear()

    def turn_finished(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.set()

    def recorded_bytes(self) -> int:
        return sum(len(r.request) + len(r.response) for r in self.records)


def _shared_length(a: array[int], b: array[int]) -> int:
    """The length of the longest common prefix of `a` and `b` (a binary search over prefix
    equality, each comparison at C speed: a turn extends its base, so usually all of `a`)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low
