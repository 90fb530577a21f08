"""The cached_tokens watch over relayed replies: Rust core vs Python twin in one run.

What the relay pays per reply so that cache_aware learns from `cached_tokens`
(docs/routing.md, "What a reply's cached_tokens teaches"): a `CachedTokensWatch` fed the
reply as it arrives, in 64 KiB pieces. Four replies: a `/generate` reply of about 4 KB; a
chat reply whose `usage` (and the key) comes after 64 KB of content; a 16 MiB `/generate`
reply whose `meta_info.cached_tokens` precedes the R3 string, as SGLang writes it (the watch
stops at the value and reads no more); and 16 MiB without the key (the worst case: one
search over every byte). docs/performance.md, "The cached_tokens watch", has the figures.

Run with ``pytest benches/micro/bench_cached_tokens.py --benchmark-only``; with
``--benchmark-disable`` each case runs once as a test (results are still checked).
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from sessiongate.primitives import get_impl

IMPLS = ["rust", "python"]
PIECE = 64 << 10
MIB = 1 << 20


def _generate(r3_bytes: int) -> bytes:
    meta: dict[str, Any] = {
        "id": "a" * 32,
        "finish_reason": {"type": "length", "length": 256},
        "prompt_tokens": 2000,
        "completion_tokens": 256,
        "cached_tokens": 1744,
    }
    if r3_bytes:
        meta["routed_experts"] = base64.b64encode(bytes(r3_bytes * 3 // 4)).decode()
    reply = {"text": "word " * 256, "output_ids": list(range(1000, 1256)), "meta_info": meta}
    return json.dumps(reply, separators=(",", ":")).encode()


def _chat() -> bytes:
    reply = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * 65536}}],
        "usage": {"prompt_tokens": 2000, "prompt_tokens_details": {"cached_tokens": 1744}},
    }
    return json.dumps(reply).encode()


REPLIES: dict[str, tuple[bytes, int | None]] = {
    "generate 4KB": (_generate(0), 1744),
    "chat, usage after 64KB": (_chat(), 1744),
    "generate + R3 16MiB": (_generate(16 * MIB), 1744),
    "16MiB, no key": (b"A" * (16 * MIB), None),
}


def _pieces(body: bytes) -> list[memoryview]:
    view = memoryview(body)
    return [view[i : i + PIECE] for i in range(0, len(body), PIECE)]


@pytest.mark.parametrize("reply", list(REPLIES))
@pytest.mark.parametrize("impl", IMPLS)
def test_watch(benchmark: Any, impl: str, reply: str) -> None:
    watch_class = get_impl(impl).CachedTokensWatch  # type: ignore[arg-type]
    body, want = REPLIES[reply]
    pieces = _pieces(body)

    def watch_reply() -> int | None:
        watch = watch_class()
        for piece in pieces:
            if watch.done:
                break
            watch.feed(piece)
        result: int | None = watch.finish()
        return result

    benchmark.extra_info["bytes"] = len(body)
    assert benchmark(watch_reply) == want
