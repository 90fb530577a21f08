"""What an engine routing policy sees, and the pieces the policies share.

A policy sees the request (`RoutingRequest`: its headers and body, the routing key material
read from the body on demand) and the engines (`EngineStates`: their URLs, health, requests in
flight, reported load and `/v1/loads` report), and answers with an engine's index. It never
sees an empty engine list, and it picks among `EngineStates.candidates()`: the healthy
engines, or all of them when none is (a request then finds out for itself, as the round robin
always did).

This package is the specification; `rust/engine_policy/` is its compiled twin, which must
make the same picks for the same sequence of calls (tests/engines/test_engine_policy_twin.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple, Protocol

# Declared with the option that names it; the policies read it from here.
from sessiongate.config.engines import ROUTING_KEY_HEADER as ROUTING_KEY_HEADER

TARGET_WORKER_HEADER = "x-smg-target-worker"
# The headers consistent_hashing reads a key from when the request names none (the Gateway's).
IMPLICIT_KEY_HEADERS = ("authorization", "x-forwarded-for", "cookie")
# Token ids are kept as 32-bit units (vocabularies are far smaller); a list with anything else
# is not token ids.
MAX_TOKEN_ID = 1 << 32
MASK64 = (1 << 64) - 1

Units = str | list[int]


@dataclass(frozen=True)
class KeyMaterial:
    """What the body says about the prompt, for prefix matching.

    `ids`: the token ids (`input_ids`, or a `prompt` of integers), None without them. `text`:
    `text`, else `prompt` (a string, or strings joined by a space), else the message contents
    (strings and the `text` of content parts, joined by a space), else "". `adapter`: the LoRA
    adapter (`lora_path`, or a `model` of the form `base:adapter`). `extra_key`: SGLang's
    cache-isolation key. `rid`: the request id SGLang takes (`rid`, a string), which
    sticky sessions read a routing key from."""

    ids: list[int] | None = None
    text: str = ""
    adapter: str | None = None
    extra_key: str | None = None
    rid: str | None = None


EMPTY = KeyMaterial()


def _token_ids(value: object) -> list[int] | None:
    if isinstance(value, list) and all(type(x) is int and 0 <= x < MAX_TOKEN_ID for x in value):
        return value
    return None


def _text(doc: dict[str, object]) -> str:
    text = doc.get("text")
    if isinstance(text, str):
        return text
    prompt = doc.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return " ".join(prompt)
    messages = doc.get("messages")
    if not isinstance(messages, list):
        return ""
    pieces: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, str):
            pieces.append(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    pieces.append(part["text"])
    return " ".join(pieces)


def key_material(body: bytes) -> KeyMaterial:
    """The routing key material of a request body; EMPTY when it is not a JSON object in
    UTF-8 (without a byte order mark)."""
    try:
        doc = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return EMPTY
    if not isinstance(doc, dict):
        return EMPTY
    ids = _token_ids(doc.get("input_ids"))
    if ids is None:
        ids = _token_ids(doc.get("prompt"))
    lora = doc.get("lora_path")
    model = doc.get("model")
    if isinstance(lora, str):
        adapter: str | None = lora
    elif isinstance(model, str) and ":" in model:
        adapter = model
    else:
        adapter = None
    extra_key = doc.get("extra_key")
    rid = doc.get("rid")
    return KeyMaterial(
        ids=ids,
        text=_text(doc),
        adapter=adapter,
        extra_key=extra_key if isinstance(extra_key, str) else None,
        rid=rid if isinstance(rid, str) else None,
    )


class LoadReport(NamedTuple):
    """What an engine's `GET /v1/loads` says, summed over its DP ranks as smg does
    (`WorkerLoadResponse`): the `loads[]` entries' `num_running_reqs`, `num_waiting_reqs`,
    `num_waiting_uncached_tokens` and `gen_throughput` summed, `token_usage` averaged.

    The shape `EnginePolicy.set_loads` takes (a plain 5-tuple in this order does too, which
    is what the compiled twin receives)."""

    running_reqs: int
    waiting_reqs: int
    waiting_tokens: int
    token_usage: float
    throughput: float

    def problem(self) -> str | None:
        """What makes this report unusable, or None."""
        for name in ("running_reqs", "waiting_reqs", "waiting_tokens"):
            value = getattr(self, name)
            if type(value) is not int or not 0 <= value < 1 << 63:
                return f"{name} must be an integer in [0, 2**63), got {value!r}"
        for name in ("token_usage", "throughput"):
            value = getattr(self, name)
            if type(value) is not float or not (math.isfinite(value) and value >= 0):
                return f"{name} must be a finite number >= 0, got {value!r}"
        return None


class RoutingRequest:
    """One request as a policy sees it; the body is read only by a policy that asks."""

    __slots__ = ("__dict__", "body", "headers")

    def __init__(self, headers: Sequence[tuple[str, str]], body: bytes) -> None:
        self.headers = headers
        self.body = body

    def header(self, name: str) -> str | None:
        """The first `name` header (`name` lowercase), None when absent or empty. Names
        compare ASCII-case-insensitively, as HTTP header names are ASCII tokens."""
        for key, value in self.headers:
            if key.isascii() and key.lower() == name:
                return value or None
        return None

    @cached_property
    def material(self) -> KeyMaterial:
        return key_material(self.body)


class EngineStates:
    """The engines as the policies see them (the router keeps them up to date)."""

    def __init__(self, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError("at least one engine is needed")
        self.urls = list(urls)
        self.healthy = [True] * len(urls)
        self.in_flight = [0] * len(urls)
        # What the engine's /get_load last said, None when unknown.
        self.load: list[int | None] = [None] * len(urls)
        # Work in flight per engine as cache_aware estimates it: at each pick, the units the
        # request will prefill there, plus one; a request's end takes off the engine's mean.
        self.work = [0] * len(urls)
        # What the engine's GET /v1/loads last said (None: unknown, or aged out), and the
        # tokens and requests the load-aware policies sent it since (reset by each report,
        # kept only while there is one: a poll is stale between intervals, and without the
        # credit every pick of an interval would go to the same engine).
        self.loads: list[LoadReport | None] = [None] * len(urls)
        self.since_tokens = [0] * len(urls)
        self.since_reqs = [0] * len(urls)
        # Overload protection's thresholds (queued requests, KV token usage), None when off.
        self.overload: tuple[int, float] | None = None

    def __len__(self) -> int:
        return len(self.urls)

    def candidates(self) -> list[int]:
        """The healthy engines, or every engine when none is; with overload protection, those
        of them not overloaded, or when all are, the ones with the fewest queued requests."""
        live = [i for i, ok in enumerate(self.healthy) if ok] or list(range(len(self.urls)))
        if self.overload is None:
            return live
        under = [i for i in live if not self.overloaded(i)]
        if under:
            return under
        # Every live engine is overloaded, so each has a report.
        return least(live, [r.waiting_reqs if r else 0 for r in self.loads])

    def overloaded(self, index: int) -> bool:
        """Whether the engine's last `/v1/loads` report is at or over a threshold."""
        report = self.loads[index]
        if report is None or self.overload is None:
            return False
        waiting, usage = self.overload
        return report.waiting_reqs >= waiting or report.token_usage >= usage

    def reported_load(self, index: int) -> int:
        """The engine's reported load when known, else its requests in flight."""
        load = self.load[index]
        return self.in_flight[index] if load is None else load


class Rng:
    """splitmix64: tiny, seedable and the same in both twins (random picks must match)."""

    __slots__ = ("state",)

    def __init__(self, seed: int) -> None:
        self.state = seed & MASK64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        """A number in [0, n) (n > 0); the modulo bias is below 2**-40 for any engine count."""
        return self.next() % n


def least(candidates: Sequence[int], key: Sequence[int]) -> list[int]:
    """The candidates with the smallest `key[i]`, in candidate order."""
    best = min(key[i] for i in candidates)
    return [i for i in candidates if key[i] == best]


class Policy(Protocol):
    """One routing policy: `pick` answers an index of `engines`; `evict(now)` trims its state
    (`now`: seconds on a monotonic clock), called every `eviction_interval_secs`."""

    name: str

    def pick(self, request: RoutingRequest, engines: EngineStates) -> int: ...

    def evict(self, now: float) -> None: ...
