"""The mock engine: deterministic generation (in-process) and its HTTP contract (real process)."""

from __future__ import annotations

import base64
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from array import array
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sessiongate.mock_engine import routed_experts
from sessiongate.mock_engine.body_slices import SEND_SLICE, send_slices
from sessiongate.mock_engine.config import MockEngineConfig
from sessiongate.mock_engine.generate import CompletionGenerator
from sessiongate.mock_engine.routed_experts import (
    r3_pool_rows,
    routed_experts_b64,
    routed_experts_b64_parts,
)
from sessiongate.tokenizer import load_tokenizer
from support.procs import ServerProcess, free_port, mock_engine

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

L, K, E = 4, 2, 16  # R3 shape of the shared engine
N, J = 24, 6  # completion length and jitter of the shared engine
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "k": {"type": "integer"}},
            },
        },
    }
]


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def gen(tok: Any) -> CompletionGenerator:
    return CompletionGenerator(
        tok, engine_seed=0, completion_tokens=N, completion_tokens_jitter=J, tool_call_rate=1.0
    )


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerProcess]:
    args = ["--r3-layers", str(L), "--r3-topk", str(K), "--r3-experts", str(E)]
    args += ["--completion-tokens", str(N), "--completion-tokens-jitter", str(J)]
    with mock_engine(*args, "--tool-call-rate", "1.0") as proc:
        yield proc


MESSAGES = [{"role": "user", "content": "hi"}]


def chat(engine: ServerProcess, body: Any, **kw: Any) -> httpx.Response:
    if isinstance(body, dict) and "input_ids" in body and "messages" not in body:
        body = {"messages": MESSAGES, **body}  # SGLang requires messages even with input_ids
    return httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=30, **kw)


def sse_events(engine: ServerProcess, body: dict[str, Any]) -> list[Any]:
    """The `data:` payloads of a streamed reply (JSON decoded, `[DONE]` kept as a string)."""
    events: list[Any] = []
    body = {"messages": MESSAGES, **body}
    with httpx.stream("POST", engine.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
            else:
                assert line == ""
    return events


PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


# ------------------------------------------------ generate.py and routed_experts.py, in-process


def test_generate_is_deterministic_and_seed_sensitive(gen: CompletionGenerator) -> None:
    a = gen.generate(PROMPT, request_seed=1)
    assert a == gen.generate(PROMPT, request_seed=1)
    assert a.ids != gen.generate(PROMPT, request_seed=2).ids
    assert a.ids != gen.generate([*PROMPT, 13], request_seed=1).ids
    other = CompletionGenerator(gen.tokenizer, engine_seed=1, completion_tokens=N)
    assert a.ids != other.generate(PROMPT, request_seed=1).ids


def test_generate_retokenizes_exactly(gen: CompletionGenerator, tok: Any) -> None:
    lengths = set()
    for i in range(60):
        c = gen.generate([3 + i, 40, 41], request_seed=i)
        content_ids = c.ids[: c.content_token_count]
        assert tok.encode(c.content) == content_ids
        assert tok.decode(content_ids) == c.content
        assert c.finish_reason == "stop"
        assert c.ids[-1] == tok.end_of_turn_token_id
        assert c.meta_finish_reason == {"type": "stop", "matched": tok.end_of_turn_token_id}
        assert len(c.logprobs) == c.completion_tokens
        assert all(lp <= 0 for lp in c.logprobs)
        assert N - J <= c.completion_tokens <= N + J
        lengths.add(c.completion_tokens)
    assert len(lengths) > 1  # the jitter does vary lengths


def test_generate_truncates_on_word_boundaries(gen: CompletionGenerator, tok: Any) -> None:
    full = gen.generate(PROMPT)
    cut = gen.generate(PROMPT, max_tokens=5)
    assert cut.finish_reason == "length"
    assert cut.meta_finish_reason == {"type": "length", "length": 5}
    assert tok.end_of_turn_token_id not in cut.ids
    assert 0 < cut.completion_tokens <= 5
    assert tok.encode(cut.content) == cut.ids
    assert full.content.startswith(cut.content)
    # A truncated reply is a prefix of the natural one, logprobs included.
    assert full.ids[: len(cut.ids)] == cut.ids
    assert full.logprobs[: len(cut.ids)] == cut.logprobs
    # A cap the natural reply fits in changes nothing.
    assert gen.generate(PROMPT, max_tokens=full.completion_tokens) == full


def test_generate_tool_call(gen: CompletionGenerator, tok: Any) -> None:
    c = gen.generate(PROMPT, tools=TOOLS)
    assert c.tool_call is not None and c.finish_reason == "tool_calls"
    assert c.tool_call.name == "search"
    args = json.loads(c.tool_call.arguments)
    assert set(args) == {"query", "k"} and isinstance(args["k"], int)
    assert c.ids[-1] == tok.end_of_turn_token_id
    assert tok.decode(c.ids[:-1]) == c.content + c.tool_call_text
    assert c.tool_call_text.startswith("\n<tool_call>\n")
    assert json.loads(c.tool_call_text.split("\n")[2]) == {"name": "search", "arguments": args}
    # No room for the whole call under max_tokens: plain truncated text instead.
    short = gen.generate(PROMPT, tools=TOOLS, max_tokens=3)
    assert short.tool_call is None and short.finish_reason == "length"


def test_stream_pieces_cover_tokens_and_content(gen: CompletionGenerator) -> None:
    for completion in (gen.generate(PROMPT), gen.generate(PROMPT, tools=TOOLS)):
        pieces = gen.stream_pieces(completion, 3)
        assert pieces[0].start == 0 and pieces[-1].stop == completion.completion_tokens
        assert all(a.stop == b.start for a, b in itertools.pairwise(pieces))
        assert "".join(p.content for p in pieces) == completion.content
        calls = [p.tool_call for p in pieces if p.tool_call is not None]
        assert calls == ([completion.tool_call] if completion.tool_call else [])


def decode_r3(encoded: bytes, rows: int, layers: int, topk: int, experts: int) -> list[bytes]:
    """Check the R3 contract and return the raw rows (`layers * topk * 4` bytes each)."""
    assert len(encoded) % 4 == 0
    # validate=True also rejects "=" anywhere but at the very end.
    raw = base64.b64decode(encoded, validate=True)
    values = array("i")
    values.frombytes(raw)
    if sys.byteorder == "big":
        values.byteswap()
    assert len(values) == rows * layers * topk
    if rows:
        assert 0 <= min(values) and max(values) < experts
    groups = [values[i : i + topk] for i in range(0, len(values), topk)]
    assert all(len(set(g)) == topk for g in groups)
    row_bytes = layers * topk * 4
    return [raw[i : i + row_bytes] for i in range(0, len(raw), row_bytes)]


@pytest.fixture
def small_pool(monkeypatch: pytest.MonkeyPatch) -> int:
    """Shrink the R3 pool to 2 chunks of 5 groups (30 rows at 3 x 4) so replies wrap."""
    monkeypatch.setattr(routed_experts, "R3_POOL_CHUNK_B64", 1000)  # 5 groups of 192 base64 bytes
    monkeypatch.setattr(routed_experts, "R3_POOL_B64", 2000)
    period = r3_pool_rows(3, 4, 16)
    assert period == 30
    return period


def seq(rows: int, first: int = 7) -> list[int]:
    """Token ids of a sequence with `rows` R3 rows (one more token than rows)."""
    return [first, *range(100, 100 + rows)]


@pytest.mark.parametrize("experts", [16, 64, 256, 300, 1000])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 8, 29, 31, 33, 64, 95, 97, 100, 1001])
def test_routed_experts_contract(small_pool: int, rows: int, experts: int) -> None:
    layers, topk = 3, 4
    tokens = seq(rows)
    parts = routed_experts_b64_parts(tokens, layers, topk, experts)
    encoded = routed_experts_b64(tokens, layers, topk, experts)
    assert b"".join(parts) == encoded
    assert encoded == routed_experts_b64(list(tokens), layers, topk, experts)  # deterministic
    full = decode_r3(encoded, rows, layers, topk, experts)
    if rows:  # another first token: another block offset (4 tries: the pool is 10 groups)
        others = [routed_experts_b64(seq(rows, f), layers, topk, experts) for f in range(8, 12)]
        assert any(o != encoded for o in others)
    for start in range(min(rows, 8)) if rows < 200 else (1, 95, 96, 97, 500, 999):
        part = routed_experts_b64(tokens, layers, topk, experts, start)
        assert decode_r3(part, rows - start, layers, topk, experts) == full[start:]
    assert routed_experts_b64(tokens, layers, topk, experts, rows) == b""


def test_routed_experts_rows_are_a_function_of_the_token_prefix() -> None:
    B = routed_experts.R3_BLOCK_ROWS
    tokens = [3000, *range(1, 400)]
    full = decode_r3(routed_experts_b64(tokens, 3, 4, 64), 399, 3, 4, 64)
    # Any prefix of the sequence (a shorter turn) has the same rows, whatever its length.
    for n in (1, 2, 3, 4, 5, 50, B, B + 1, B + 2, B + 4, 2 * B + 1, 398):
        rows = decode_r3(routed_experts_b64(tokens[: n + 1], 3, 4, 64), n, 3, 4, 64)
        assert rows == full[:n]
    # Another first token: other rows from row 0 on; the engine seed and the tag count too.
    other = decode_r3(routed_experts_b64([3001, *tokens[1:]], 3, 4, 64), 399, 3, 4, 64)
    assert other[0] != full[0] and other[B] != full[B]
    seeded = decode_r3(routed_experts_b64(tokens, 3, 4, 64, seed=1), 399, 3, 4, 64)
    assert seeded[0] != full[0]
    tagged = decode_r3(routed_experts_b64(tokens, 3, 4, 64, tag=b"indexer"), 399, 3, 4, 64)
    assert tagged[0] != full[0]
    # A token changed at p: rows before p unchanged; new rows from the next block boundary.
    p = B + 10
    changed = decode_r3(
        routed_experts_b64([*tokens[:p], 9999, *tokens[p + 1 :]], 3, 4, 64), 399, 3, 4, 64
    )
    assert changed[: 2 * B] == full[: 2 * B]
    assert changed[2 * B] != full[2 * B]


def test_routed_experts_blocks_are_consecutive_pool_rows(small_pool: int) -> None:
    # Block 0 (R3_BLOCK_ROWS rows) is pool rows from one group onwards, wrapping around.
    B = routed_experts.R3_BLOCK_ROWS
    out = decode_r3(routed_experts_b64(seq(B), 3, 4, 16), B, 3, 4, 16)
    assert all(out[i] == out[i + small_pool] for i in range(B - small_pool))
    assert len(set(out[:small_pool])) > small_pool // 2  # the pool itself is random


def test_routed_experts_default_pool_is_served_without_copies() -> None:
    # 512 x 8: 16 KiB rows, 64 KiB of base64 per 3-row group, 16 groups per 1 MiB chunk.
    layers, topk, rows = 512, 8, 1000
    assert r3_pool_rows(layers, topk, 64) < rows  # this reply wraps around the pool
    parts = routed_experts_b64_parts(seq(rows), layers, topk, 64)
    pool = set(map(id, routed_experts._r3_pool(layers, topk, 64).chunks))
    # Blocks are 96 rows (2 MiB of base64): mostly whole pool chunks or views into them.
    shared = sum(len(p) for p in parts if type(p) is memoryview or id(p) in pool)
    assert shared >= 0.99 * sum(len(p) for p in parts)
    assert all(type(p) in (bytes, memoryview) for p in parts)
    decode_r3(b"".join(parts), rows, layers, topk, 64)


def test_routed_experts_small_rows_are_joined_into_few_parts() -> None:
    # 4 x 2: 128 bytes of base64 per group, 4 KiB per block: sent in ~256 KiB parts.
    rows = 20_000
    parts = routed_experts_b64_parts(seq(rows), 4, 2, 16)
    assert len(parts) < 20
    decode_r3(b"".join(parts), rows, 4, 2, 16)


def test_send_slices_pass_small_bytes_through() -> None:
    small, big = b"a" * 10, b"b" * (2 * SEND_SLICE + 5)
    view = memoryview(b"c" * 100)[10:20]
    out = list(send_slices([small, view, big]))
    assert out[0] is small and out[1] is view  # no copies on the way to the transport
    assert all(len(p) <= SEND_SLICE for p in out)
    assert b"".join(out) == small + bytes(view) + big
    assert len(routed_experts_b64_parts([5], 40, 8, 64)) == 0


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="fail_rate"):
        MockEngineConfig(fail_rate=1.5)
    with pytest.raises(ValueError, match="jitter"):
        MockEngineConfig(completion_tokens=4, completion_tokens_jitter=4)


# ---------------------------------------------------------------- HTTP, real process


def test_health_models_stats(engine: ServerProcess) -> None:
    health = httpx.get(engine.url + "/health")
    assert health.status_code == 200 and health.content == b""
    models = httpx.get(engine.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "sessiongate-mock"
    stats = httpx.get(engine.url + "/mock/stats").json()
    assert {"requests", "failures", "tokens_generated"} <= set(stats)


def test_http_determinism_and_input_ids(engine: ServerProcess) -> None:
    body = {"input_ids": PROMPT, "seed": 7, "return_meta_info": True, "logprobs": True}
    a, b = chat(engine, body).json(), chat(engine, body).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert (
        a["choices"][0]["meta_info"]["output_token_logprobs"]
        == (b["choices"][0]["meta_info"]["output_token_logprobs"])
    )
    c = chat(engine, {**body, "seed": 8}).json()
    assert c["choices"][0]["message"]["content"] != a["choices"][0]["message"]["content"]
    assert (
        a["usage"]["prompt_tokens"] == len(PROMPT) == a["choices"][0]["meta_info"]["prompt_tokens"]
    )
    # SGLang's id is the request's rid: a bare uuid4 hex unless the request names one.
    assert a["object"] == "chat.completion" and len(a["id"]) == 32


def test_http_engine_seed_changes_reply(engine: ServerProcess) -> None:
    body = {"input_ids": PROMPT}
    with mock_engine("--seed", "1", "--completion-tokens", str(N)) as other:
        mine = chat(engine, body).json()["choices"][0]["message"]["content"]
        theirs = chat(other, body).json()["choices"][0]["message"]["content"]
    assert mine != theirs


def test_http_meta_info_and_retokenization(engine: ServerProcess, tok: Any) -> None:
    body = {"input_ids": PROMPT, "logprobs": True, "return_meta_info": True}
    reply = chat(engine, body).json()
    choice = reply["choices"][0]
    meta = choice["meta_info"]
    ids = [entry[1] for entry in meta["output_token_logprobs"]]
    assert len(ids) == meta["completion_tokens"] == reply["usage"]["completion_tokens"]
    assert all(entry[0] <= 0 for entry in meta["output_token_logprobs"])
    assert [entry[2] for entry in meta["output_token_logprobs"]] == [tok.decode([i]) for i in ids]
    assert choice["finish_reason"] == "stop"
    assert meta["finish_reason"] == {"type": "stop", "matched": tok.end_of_turn_token_id}
    assert [*tok.encode(choice["message"]["content"]), tok.end_of_turn_token_id] == ids
    assert "routed_experts" not in meta
    assert len(choice["logprobs"]["content"]) == len(ids)  # OpenAI-style logprobs as well
    assert "meta_info" not in chat(engine, {"input_ids": PROMPT, "logprobs": True}).json()
    plain = chat(engine, {"input_ids": PROMPT}).json()["choices"][0]
    assert "meta_info" not in plain and plain["message"] == choice["message"]


def test_http_openai_mode_uses_chat_template(engine: ServerProcess, tok: Any) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    reply = chat(engine, {"messages": messages, "return_meta_info": True}).json()
    expected = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert reply["usage"]["prompt_tokens"] == len(expected)
    same = chat(engine, {"input_ids": list(expected), "return_meta_info": True}).json()
    assert same["choices"][0]["message"] == reply["choices"][0]["message"]


def test_http_max_tokens_truncates(engine: ServerProcess, tok: Any) -> None:
    for field in ("max_tokens", "max_completion_tokens"):
        body = {"input_ids": PROMPT, field: 4, "return_meta_info": True, "logprobs": True}
        reply = chat(engine, body).json()
        choice = reply["choices"][0]
        meta = choice["meta_info"]
        assert choice["finish_reason"] == "length"
        assert meta["finish_reason"] == {"type": "length", "length": 4}
        assert meta["completion_tokens"] == len(meta["output_token_logprobs"]) <= 4
        ids = [entry[1] for entry in meta["output_token_logprobs"]]
        assert tok.encode(choice["message"]["content"]) == ids


def test_http_routed_experts(engine: ServerProcess) -> None:
    body = {"input_ids": PROMPT, "return_routed_experts": True, "return_meta_info": True}
    reply = chat(engine, body).json()
    meta = reply["choices"][0]["meta_info"]
    assert "sglext" not in reply  # with return_meta_info, R3 stays in meta_info only
    values = array("i")
    values.frombytes(base64.b64decode(meta["routed_experts"], validate=True))
    if sys.byteorder == "big":
        values.byteswap()
    rows = meta["prompt_tokens"] + meta["completion_tokens"] - 1
    assert len(values) == rows * L * K
    assert 0 <= min(values) and max(values) < E
    # Not asked for: not sent.
    meta = chat(engine, {"input_ids": PROMPT, "return_meta_info": True}).json()
    assert "routed_experts" not in meta["choices"][0]["meta_info"]


def test_http_routed_experts_large_rows_wrap_the_pool() -> None:
    # 512 layers: each reply spans several pool periods; the bytes match routed_experts.py exactly.
    prompt = list(range(5, 405))
    body = {"input_ids": prompt, "return_routed_experts": True}
    args = ["--r3-layers", "512", "--r3-topk", "8", "--completion-tokens", "24"]
    with mock_engine(*args) as eng:
        reply = chat(eng, {**body, "return_meta_info": True, "return_output_ids_in_sglext": True})
        meta = reply.json()["choices"][0]["meta_info"]
        output_ids = reply.json()["sglext"]["output_ids"][0]
        sglext = chat(eng, body).json()["sglext"]
        final = sse_events(eng, {**body, "stream": True})[-2]["sglext"]
    rows = meta["prompt_tokens"] + meta["completion_tokens"] - 1
    assert rows > r3_pool_rows(512, 8, 64)
    expected = routed_experts_b64([*prompt, *output_ids], 512, 8, 64)
    assert meta["routed_experts"].encode() == expected
    assert final["routed_experts"] == sglext["routed_experts"] == meta["routed_experts"]


def test_http_stream_matches_non_stream(engine: ServerProcess) -> None:
    body = {"input_ids": PROMPT, "logprobs": True, "return_routed_experts": True}
    whole = chat(engine, {**body, "return_meta_info": True}).json()["choices"][0]
    events = sse_events(engine, {**body, "stream": True, "return_output_ids_in_sglext": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {
        "reasoning_content": None,
        "role": "assistant",
        "content": "",
    }
    *steps, finish, sglext = chunks
    assert finish["choices"][0]["finish_reason"] == whole["finish_reason"] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in steps)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in steps)
    assert content == whole["message"]["content"]
    streamed = [e for c in steps[1:] for e in c["choices"][0]["logprobs"]["content"]]
    # Every step with text carries its logprobs; the end token's step has none (no parser).
    assert streamed == whole["logprobs"]["content"][:-1]
    assert not any("meta_info" in c["choices"][0] for c in [*steps, finish])
    assert sglext["choices"] == []
    assert sglext["sglext"]["routed_experts"] == whole["meta_info"]["routed_experts"]
    expected_ids = [e[1] for e in whole["meta_info"]["output_token_logprobs"]]
    assert sglext["sglext"]["output_ids"] == [expected_ids]


def test_http_tool_calls(engine: ServerProcess, tok: Any) -> None:
    body = {"messages": [{"role": "user", "content": "find x"}], "tools": TOOLS}
    choice = chat(engine, {**body, "return_meta_info": True, "logprobs": True}).json()
    choice = choice["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "search"
    assert set(json.loads(call["function"]["arguments"])) == {"query", "k"}
    ids = [entry[1] for entry in choice["meta_info"]["output_token_logprobs"]]
    text = tok.decode(ids[:-1])
    # SGLang's tool-call parser rewrites the finish dict in place (serving_chat.py).
    assert choice["meta_info"]["finish_reason"] == {"type": "tool_calls", "matched": None}
    assert text.startswith(choice["message"]["content"] + "\n<tool_call>\n")
    events = sse_events(engine, {**body, "stream": True})
    deltas = [c["choices"][0]["delta"] for c in events[:-1]]
    streamed_calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert streamed_calls == [[call]]
    assert "".join(d.get("content") or "" for d in deltas) == choice["message"]["content"]
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_http_bad_requests(engine: ServerProcess) -> None:
    url = engine.url + "/v1/chat/completions"
    assert httpx.post(url, content=b"{nope").status_code == 400
    json_type = {"content-type": "application/json"}
    assert httpx.post(url, content=b"[1, 2]", headers=json_type).json()["object"] == "error"
    m = MESSAGES
    bad_bodies = [
        {"messages": m, "input_ids": []},
        {"messages": m, "input_ids": "1 2 3"},
        {"messages": m, "input_ids": [1, "2"]},
        {"messages": m, "input_ids": [1, True]},
        {"messages": m, "input_ids": [1, 10**9]},
        {"messages": m, "input_ids": [-1]},
        {},
        {"input_ids": [1]},  # SGLang requires messages even with input_ids
        {"messages": "hi"},
        {"messages": []},
        {"messages": m, "input_ids": [1], "max_tokens": 0},
        {"messages": m, "input_ids": [1], "seed": "x"},
    ]
    for body in bad_bodies:
        reply = httpx.post(url, json=body)
        assert reply.status_code == 400, body
        error = reply.json()
        assert set(error) == {"object", "message", "type", "param", "code"}, body
        assert error["object"] == "error" and error["code"] == 400, body


def test_http_forced_failure_and_recent_requests(engine: ServerProcess) -> None:
    before = httpx.get(engine.url + "/mock/stats").json()["failures"]
    body = {"input_ids": [3, 4, 5], "marker": "forced"}
    reply = chat(engine, body, headers={"X-Mock-Fail": "503"})
    assert reply.status_code == 503 and reply.json()["message"] == "injected failure"
    assert httpx.get(engine.url + "/mock/stats").json()["failures"] == before + 1
    chat(engine, {"input_ids": [3, 4, 6], "marker": "second"})
    recent = httpx.get(engine.url + "/mock/requests", params={"last": 2}).json()["requests"]
    sent = {"messages": MESSAGES, "input_ids": [3, 4, 6], "marker": "second"}
    assert recent == [{"messages": MESSAGES, **body}, sent]
    assert len(httpx.get(engine.url + "/mock/requests", params={"last": 1}).json()["requests"]) == 1


def test_http_fail_rate_one_and_sigterm_exit_code() -> None:
    with mock_engine("--fail-rate", "1.0", "--fail-status", "502") as proc:
        for _ in range(3):
            reply = chat(proc, {"input_ids": PROMPT})
            assert reply.status_code == 502 and reply.json()["message"] == "injected failure"
        assert httpx.get(proc.url + "/mock/stats").json()["failures"] == 3
        assert proc.stop() == 0  # SIGTERM -> clean exit 0
        assert "mock-engine listening on http://127.0.0.1:" in proc.output()


def test_exits_when_parent_is_gone() -> None:
    # SESSIONGATE_PARENT_PID names a process that is not our parent: exit at once, cleanly.
    env = {**os.environ, "SESSIONGATE_PARENT_PID": "1"}
    cmd = [sys.executable, "-m", "sessiongate", "mock-engine", "--port", str(free_port())]
    assert subprocess.run(cmd, env=env, timeout=30).returncode == 0


def test_dies_with_parent() -> None:
    port = free_port()
    parent_code = (
        "import os, subprocess, sys, time\n"
        "env = {**os.environ, 'SESSIONGATE_PARENT_PID': str(os.getpid())}\n"
        "cmd = [sys.executable, '-m', 'sessiongate', 'mock-engine', '--port', sys.argv[1]]\n"
        "subprocess.Popen(cmd, env=env)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code, str(port)], start_new_session=True
    )
    url = f"http://127.0.0.1:{port}/health"
    try:
        _wait(lambda: _answers(url), 30)
        parent.kill()
        parent.wait()
        _wait(lambda: not _answers(url), 10)
    finally:
        try:
            os.killpg(parent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _wait(condition: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
