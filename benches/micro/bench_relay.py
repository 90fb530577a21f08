"""JSON relay benchmarks: extract + strip of upstream replies (docs/performance.md, "JSON relay").

Rust core vs the `json` twin vs an `orjson` path (skipped when orjson is not importable), on
mock-engine replies of 1, 16 and 128 MiB dominated by `routed_experts`; and the 16 MiB
extract on 4 threads vs 1 thread (the scan runs without the GIL).

Run with ``pytest benches/micro/bench_relay.py --benchmark-only``. Under ``--benchmark-disable``
each case runs once as a test, and the 128 MiB cases are skipped (building that reply and
parsing it with the twin takes seconds).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from sessiongate.primitives import get_impl

MIB = 1 << 20
SIZES = {"1MiB": 1 * MIB, "16MiB": 16 * MIB, "128MiB": 128 * MIB}
ROUNDS = {"1MiB": 40, "16MiB": 10, "128MiB": 5}
LAYERS, TOPK, EXPERTS = 48, 8, 256  # 2048 base64 characters of R3 per token
COMPLETION = 256
R3_KEYS = ("routed_experts", "indexer_topk")


@functools.cache
def reply_body(size: int) -> bytes:
    """A mock-engine reply (non-stream, meta_info, logprobs, R3) of about `size` bytes."""
    from sessiongate.mock_engine.chat_request import ChatRequest
    from sessiongate.mock_engine.config import MockEngineConfig
    from sessiongate.mock_engine.generate import CompletionGenerator
    from sessiongate.mock_engine.reply import build_reply
    from sessiongate.mock_engine.state import EngineState
    from sessiongate.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    cfg = MockEngineConfig(
        r3_layers=LAYERS, r3_topk=TOPK, r3_experts=EXPERTS, completion_tokens=COMPLETION
    )
    gen = CompletionGenerator(tok, completion_tokens=COMPLETION)
    rows = size // (4 * LAYERS * TOPK * 4 // 3)
    prompt = [(i * 7919) % 50_000 for i in range(max(1, rows - COMPLETION + 1))]
    completion = gen.generate(prompt)
    req = ChatRequest(
        prompt_ids=prompt,
        seed=None,
        max_tokens=None,
        tools=None,
        stream=False,
        want_meta=True,
        want_logprobs=True,  # SGLang puts output_token_logprobs in meta_info only then
        want_r3=True,
        model="mock",
    )
    return b"".join(build_reply(req, completion, EngineState(cfg, tok, gen), "bench"))


def _orjson_extract(body: bytes) -> tuple[list[int], list[float], bytes, bytes | None]:
    """The same work with orjson: parse, check, extract, strip, serialize the client body."""
    import orjson

    doc = orjson.loads(body)
    choice = doc["choices"][0]
    meta = choice["meta_info"]
    if choice["message"].get("content") is None:
        raise ValueError("content is null")
    entries = meta["output_token_logprobs"]
    if len(entries) != meta["completion_tokens"]:
        raise ValueError("length mismatch")
    ids = [e[1] for e in entries]
    logprobs = [float(e[0]) for e in entries]
    r3 = meta.get("routed_experts")
    stripped = []
    for c in doc["choices"]:
        m = c.get("meta_info") if isinstance(c, dict) else None
        if isinstance(m, dict):
            c = {**c, "meta_info": {k: v for k, v in m.items() if k not in R3_KEYS}}
        stripped.append(c)
    client = orjson.dumps({**doc, "choices": stripped})
    return ids, logprobs, client, None if r3 is None else r3.encode()


def _extractor(name: str) -> Callable[[bytes], Any]:
    """`rust` and `python` return the R3 text as bytes (for Rust: the copy is made when
    `routed_experts` is read, so it is read here); `rust-view` takes the zero-copy view."""
    if name == "orjson":
        pytest.importorskip("orjson")
        return _orjson_extract
    extract = get_impl("rust" if name == "rust-view" else name).extract_reply
    attr = "routed_experts_view" if name == "rust-view" else "routed_experts"

    def run(body: bytes) -> tuple[list[int], list[float], bytes, Any]:
        reply = extract(body)
        return reply.completion_ids, reply.logprobs, reply.client_body, getattr(reply, attr)

    return run


def _skip_big_when_disabled(request: pytest.FixtureRequest, size: str) -> None:
    if size == "128MiB" and request.config.getoption("benchmark_disable"):
        pytest.skip("128 MiB only when benchmarking (building and parsing it takes seconds)")


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("impl_name", ["rust", "rust-view", "python", "orjson"])
def test_extract_strip(benchmark, request, impl_name, size):
    """extract_reply (contract checks, ids, logprobs, R3 text, client body) of one reply."""
    _skip_big_when_disabled(request, size)
    extract = _extractor(impl_name)
    body = reply_body(SIZES[size])
    benchmark.group = f"extract+strip: {size} reply"
    benchmark.extra_info["body_bytes"] = len(body)
    ids, _, client, r3 = benchmark.pedantic(extract, (body,), rounds=ROUNDS[size], warmup_rounds=1)
    assert len(ids) == COMPLETION and r3 is not None
    assert len(client) + len(r3) < len(body) and len(client) < 64 * 1024
    if size == "1MiB":
        want = json.loads(get_impl("python").extract_reply(body).client_body)
        assert json.loads(client) == want


THREADS = 4


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(THREADS) as executor:
        yield executor


@pytest.mark.parametrize("threads", [1, THREADS])
@pytest.mark.parametrize("r3", ["bytes", "view"])
def test_extract_threads(benchmark, pool, threads, r3):
    """16 extracts of a 16 MiB reply: in a row on 1 thread, or 4 at a time on 4 threads.

    Equal work, so the time ratio is the throughput ratio (>= 1.7x expected on 2 cores).
    `bytes` also copies the R3 text out (`routed_experts`), `view` takes the zero-copy
    `routed_experts_view`. Each result is dropped in the thread that made it, so both
    variants reuse memory the same way (else page faults, not the extract, set the ratio).
    """
    extract = get_impl("rust").extract_reply
    attr = "routed_experts" if r3 == "bytes" else "routed_experts_view"
    body = reply_body(SIZES["16MiB"])
    benchmark.group = f"extract+strip: 16 x 16 MiB, 1 vs {THREADS} threads, R3 {r3}"

    def four(data: bytes) -> list[int]:
        out = []
        for _ in range(4):
            reply = extract(data)
            out.append(len(reply.completion_ids) + len(getattr(reply, attr)))
        return out

    def one_thread() -> list[int]:
        return [n for _ in range(THREADS) for n in four(body)]

    def many_threads() -> list[int]:
        return [n for part in pool.map(four, [body] * THREADS) for n in part]

    run = one_thread if threads == 1 else many_threads
    results = benchmark.pedantic(run, rounds=15, warmup_rounds=2)
    assert len(results) == 16 and len(set(results)) == 1 and results[0] > 16 * MIB * 0.9


REQUEST = json.dumps(
    {
        "model": "mock",
        "messages": [{"role": "user", "content": "word " * 40}] * 40,
        "temperature": 0.7,
        "tools": [],
    }
).encode()
TITO_FIELDS = {
    "input_ids": list(range(1_000_000)),
    "logprobs": True,
    "return_meta_info": True,
    "no_stop_trim": False,
    "stream": False,
    "return_routed_experts": True,
}


@pytest.mark.parametrize("impl_name", ["rust", "python"])
def test_rewrite_request(benchmark, impl_name):
    """rewrite_request adding the TITO fields with 1,000,000 input_ids to a chat request."""
    rewrite = get_impl(impl_name).rewrite_request
    benchmark.group = "rewrite_request: 1M input_ids"
    out = benchmark.pedantic(rewrite, (REQUEST, TITO_FIELDS), rounds=10, warmup_rounds=1)
    assert json.loads(out)["input_ids"][-1] == 999_999


@pytest.mark.parametrize("impl_name", ["rust", "python"])
def test_decode_r3(benchmark, impl_name):
    """decode_r3 of the R3 of the 16 MiB reply (about 12 MiB of int32)."""
    decode = get_impl(impl_name).decode_r3
    r3 = get_impl("rust").extract_reply(reply_body(SIZES["16MiB"])).routed_experts
    benchmark.group = "decode_r3: 16 MiB of base64"
    view = benchmark.pedantic(
        decode, (r3,), {"layers": LAYERS, "topk": TOPK}, rounds=10, warmup_rounds=1
    )
    assert view.shape[1:] == (LAYERS, TOPK)
