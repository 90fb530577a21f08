"""The mock engine against SGLang 0.5.23's OpenAI chat contract, over real HTTP.

Every test names the SGLang source (file and function) the shape it checks comes from; all
paths are under `sglang/srt/` in the sglang-0.5.23 wheel. The mock runs as a real process.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from sessiongate.tokenizer import load_tokenizer
from support.procs import ServerProcess, mock_engine
from support.tool_templates import QWEN35_STYLE, tokenizer_dir

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

L, K, E = 4, 2, 16  # R3 shape
IL, IK = 3, 5  # indexer layers / top-k
MESSAGES = [{"role": "user", "content": "hi"}]
ERROR_KEYS = {"object", "message", "type", "param", "code"}


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerProcess]:
    args = ["--r3-layers", str(L), "--r3-topk", str(K), "--r3-experts", str(E)]
    args += ["--indexer-layers", str(IL), "--indexer-topk", str(IK)]
    args += ["--lora-adapters", "alpha,beta", "--weight-version", "w0"]
    args += ["--enable-cache-report", "--completion-tokens", "20"]
    with mock_engine(*args) as proc:
        yield proc


@pytest.fixture(scope="module")
def thinker() -> Iterator[ServerProcess]:
    with mock_engine("--reasoning-parser", "qwen3", "--completion-tokens", "24") as proc:
        yield proc


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer(None)


def post(engine: ServerProcess, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=30, **kw)


def sse(
    engine: ServerProcess, body: dict[str, Any], headers: dict[str, str] | None = None
) -> list[tuple[str | None, Any]]:
    """(event name or None, decoded data) per SSE event; `[DONE]` stays a string."""
    events: list[tuple[str | None, Any]] = []
    url = engine.url + "/v1/chat/completions"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        name: str | None = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = line[len("data: ") :]
                events.append((name, data if data == "[DONE]" else json.loads(data)))
                name = None
            else:
                assert line == ""
    return events


def rows(b64: str, layers: int, topk: int) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64, validate=True), "<i4").reshape(-1, layers, topk)


def unique_prompt(seed: int, n: int = 12) -> list[int]:
    # Distinct first tokens keep these prompts out of each other's prefix-cache hits.
    return [3000 + seed, *range(100 + seed, 100 + seed + n - 1)]


# ---------------------------------------------------------------- fact 1


def test_stream_with_return_meta_info_is_a_400_error_response(engine: ServerProcess) -> None:
    # entrypoints/openai/serving_chat.py `_convert_to_internal_request` raises ValueError for
    # stream + return_meta_info; serving_base.py `handle_request` answers it with
    # `create_error_response(..., err_type="BadRequest", status_code=400)`, whose body is
    # protocol.py `ErrorResponse` (object, message, type, param, code).
    body = {"messages": MESSAGES, "stream": True, "return_meta_info": True}
    reply = post(engine, body)
    assert reply.status_code == 400
    assert reply.json() == {
        "object": "error",
        "message": "return_meta_info is not supported with streaming. "
        "Please set stream=false when using return_meta_info=true.",
        "type": "BadRequest",
        "param": None,
        "code": 400,
    }
    # serving_chat.py `_validate_request` -> create_error_response default "BadRequestError".
    empty = post(engine, {"messages": []})
    assert empty.status_code == 400
    assert empty.json() == {
        "object": "error",
        "message": "Messages cannot be empty.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    # The mock's own failures use the same body.
    forced = post(engine, {"messages": MESSAGES}, headers={"X-Mock-Fail": "503"})
    assert forced.status_code == 503 and set(forced.json()) == ERROR_KEYS
    assert forced.json()["code"] == 503


# ---------------------------------------------------------------- fact 2


def test_stream_chunks_are_shaped_like_sglang(engine: ServerProcess, tok: Any) -> None:
    # entrypoints/openai/serving_chat.py `_generate_chat_stream` / `_generate_stream_content`;
    # sse_utils.py `build_sse_content` (msgspec, omit_defaults: delta always carries
    # reasoning_content, role/content only when set, no usage key); protocol.py
    # ChatCompletionStreamResponse / SglExt (None fields dropped) for the `choices: []`
    # chunks; usage_processor.py `calculate_streaming_usage`; the sglext ids opt-in headers
    # in `_convert_to_internal_request`; `_process_streaming_logprobs` (no token ids).
    prompt = unique_prompt(1)
    body = {"messages": MESSAGES, "input_ids": prompt, "seed": 3, "logprobs": True}
    body["return_routed_experts"] = True
    headers = {"x-sglext-return-output-ids": "1", "x-sglext-return-input-ids": "1"}
    events = sse(
        engine, {**body, "stream": True, "stream_options": {"include_usage": True}}, headers
    )
    assert events[-1] == (None, "[DONE]")
    chunks = [data for _, data in events[:-1]]
    *steps, finish, ext, usage = chunks
    head_keys = {"id", "object", "created", "model", "choices"}
    choice_keys = {"index", "delta", "logprobs", "finish_reason", "matched_stop"}
    for c in [*steps, finish]:
        assert set(c) == head_keys and c["object"] == "chat.completion.chunk"
        assert set(c["choices"][0]) == choice_keys  # no meta_info in any chunk
    assert steps[0]["choices"][0] == {
        "index": 0,
        "delta": {"reasoning_content": None, "role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
        "matched_stop": None,
    }
    for c in steps[1:]:
        choice = c["choices"][0]
        assert set(choice["delta"]) == {"reasoning_content", "content"}
        assert choice["delta"]["reasoning_content"] is None
        assert choice["finish_reason"] is None and choice["matched_stop"] is None
        for entry in choice["logprobs"]["content"]:
            assert list(entry) == ["token", "bytes", "logprob", "top_logprobs"]
            assert entry["bytes"] == list(entry["token"].encode())
    assert finish["choices"][0] == {
        "index": 0,
        "delta": {"reasoning_content": None},
        "logprobs": None,
        "finish_reason": "stop",
        "matched_stop": tok.end_of_turn_token_id,
    }
    assert ext["choices"] == [] and ext["usage"] is None
    assert list(ext["sglext"]) == ["routed_experts", "input_ids", "output_ids"]
    assert set(usage) == {*head_keys, "usage"} and usage["choices"] == []

    # Everything streamed adds up to the non-stream reply for the same request.
    whole = post(engine, {**body, "return_meta_info": True}).json()
    choice = whole["choices"][0]
    meta = choice["meta_info"]
    streamed = [e for c in steps[1:] for e in c["choices"][0]["logprobs"]["content"]]
    # The end token's step has no text, so no chunk carries its logprob (no parser).
    assert streamed == choice["logprobs"]["content"][:-1]
    text = "".join(c["choices"][0]["delta"]["content"] for c in steps[1:])
    assert text == choice["message"]["content"]
    assert ext["sglext"]["output_ids"] == [[e[1] for e in meta["output_token_logprobs"]]]
    assert ext["sglext"]["input_ids"] == prompt
    assert ext["sglext"]["routed_experts"] == meta["routed_experts"]
    assert usage["usage"] == {
        "prompt_tokens": len(prompt),
        "total_tokens": len(prompt) + meta["completion_tokens"],
        "completion_tokens": meta["completion_tokens"],
        "prompt_tokens_details": {"cached_tokens": 0},
        "reasoning_tokens": 0,
        "completion_tokens_details": None,
    }

    # Nothing asked for: no sglext chunk, no usage chunk.
    plain = [d for _, d in sse(engine, {"messages": MESSAGES, "stream": True})]
    assert plain[-1] == "[DONE]" and plain[-2]["choices"][0]["finish_reason"] == "stop"
    assert all(c["choices"] for c in plain[:-1])
    # x-sglext-ids-framed: the ids ride in a named `sglext_ids` event, R3 in a plain one.
    framed = sse(engine, {**body, "stream": True}, {**headers, "x-sglext-ids-framed": "1"})
    *_, (n1, non_ids), (n2, ids), _done = framed
    assert n1 is None and list(non_ids["sglext"]) == ["routed_experts"]
    assert n2 == "sglext_ids" and list(ids["sglext"]) == ["input_ids", "output_ids"]


# ---------------------------------------------------------------- fact 3


def test_non_stream_meta_info_metadata_and_cached_tokens(engine: ServerProcess, tok: Any) -> None:
    # managers/tokenizer_manager.py `_handle_batch_output` (meta_info keys and order:
    # `weight_versions` from utils/weight_versions.py `add_weight_versions_to_meta_info`,
    # `cached_tokens_details` from managers/scheduler_components/output_streamer.py
    # `get_cached_tokens_details`, `response_sent_to_client_ts` stamped by
    # `_wait_one_response` once the output is finished) and
    # `add_logprob_to_meta_info` / `detokenize_logprob_tokens` (text in logprobs: the chat
    # endpoint sets return_text_in_logprobs=True in serving_chat.py); serving_chat.py
    # `_build_chat_response` (top-level metadata from utils/weight_versions.py
    # `build_endpoint_weight_version_metadata`); protocol.py ChatCompletionRequest
    # (`messages` required even with input_ids; unknown fields ignored) and http_server.py's
    # RequestValidationError handler (400, type "Bad Request").
    prompt = unique_prompt(2)
    body = {"messages": MESSAGES, "input_ids": prompt, "logprobs": True, "return_meta_info": True}
    before = time.time()
    first = post(engine, {**body, "some_unknown_field": {"x": 1}})
    assert first.status_code == 200
    reply = first.json()
    meta = reply["choices"][0]["meta_info"]
    assert list(meta) == [
        "id",
        "finish_reason",
        "prompt_tokens",
        "weight_version",
        "num_retractions",
        "input_token_logprobs",
        "output_token_logprobs",
        "output_token_logprobs_length",
        "reasoning_tokens",
        "completion_tokens",
        "cached_tokens",
        "weight_versions",
        "cached_tokens_details",
        "e2e_latency",
        "response_sent_to_client_ts",
    ]
    ids = [e[1] for e in meta["output_token_logprobs"]]
    assert [e[2] for e in meta["output_token_logprobs"]] == [tok.decode([i]) for i in ids]
    assert meta["output_token_logprobs_length"] == meta["completion_tokens"] == len(ids)
    assert meta["id"] == reply["id"] and meta["weight_version"] == "w0"
    spans = [{"version": "w0", "start": 0, "end": len(ids)}]
    assert meta["weight_versions"] == spans
    assert reply["metadata"] == {"weight_version": "w0", "weight_versions": spans}
    assert meta["cached_tokens"] == 0 and meta["cached_tokens_details"] is None
    sent = meta["response_sent_to_client_ts"]
    assert isinstance(sent, float) and before <= sent <= time.time()
    assert reply["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    # Next turn: the previous prompt and all but its last sampled token are cached.
    turn2 = post(engine, {**body, "input_ids": [*prompt, *ids, 7, 8, 9]}).json()
    expected = len(prompt) + len(ids) - 1
    assert turn2["choices"][0]["meta_info"]["cached_tokens"] == expected
    details = turn2["choices"][0]["meta_info"]["cached_tokens_details"]
    assert details == {"device": expected, "host": 0}
    assert turn2["usage"]["prompt_tokens_details"] == {"cached_tokens": expected}
    # Without logprobs the engine adds no logprob keys.
    bare = post(engine, {**body, "logprobs": False}).json()["choices"][0]["meta_info"]
    assert "output_token_logprobs" not in bare
    # Without return_meta_info the top-level metadata still has the spans.
    plain = post(engine, {"messages": MESSAGES, "input_ids": unique_prompt(9)}).json()
    completion_tokens = plain["usage"]["completion_tokens"]
    assert plain["metadata"]["weight_versions"] == [
        {"version": "w0", "start": 0, "end": completion_tokens}
    ]
    # messages is required even with input_ids.
    missing = post(engine, {"input_ids": prompt})
    assert missing.status_code == 400
    error = missing.json()
    assert set(error) == ERROR_KEYS and error["type"] == "Bad Request"
    assert "messages" in error["message"] and "Field required" in error["message"]


# ---------------------------------------------------------------- fact 4


def test_routed_experts_start_len(engine: ServerProcess) -> None:
    # protocol.py ChatCompletionRequest.routed_experts_start_len -> io_struct.py
    # GenerateReqInput ("response covers [routed_experts_start_len, seqlen - 1)");
    # scheduler_components/batch_result_processor.py `_maybe_collect_routed_experts`
    # (expected rows seqlen - 1 - start_len); scheduler.py `handle_generate_request`
    # (start_len outside [0, prompt_tokens] aborts with 400).
    prompt = unique_prompt(3, 40)
    body = {"messages": MESSAGES, "input_ids": prompt, "return_routed_experts": True}
    full_reply = post(engine, {**body, "return_meta_info": True}).json()
    n = full_reply["choices"][0]["meta_info"]["completion_tokens"]
    full = rows(full_reply["choices"][0]["meta_info"]["routed_experts"], L, K)
    assert len(full) == len(prompt) + n - 1
    for start in (1, 2, 4, 5, 17, len(prompt)):
        sglext = post(engine, {**body, "routed_experts_start_len": start}).json()["sglext"]
        part = rows(sglext["routed_experts"], L, K)
        assert len(part) == len(prompt) + n - 1 - start
        assert np.array_equal(part, full[start:])
    events = sse(engine, {**body, "stream": True, "routed_experts_start_len": 9})
    streamed = rows(events[-2][1]["sglext"]["routed_experts"], L, K)
    assert np.array_equal(streamed, full[9:])
    too_far = post(engine, {**body, "routed_experts_start_len": len(prompt) + 1})
    assert too_far.status_code == 400
    assert "is higher than the number of input tokens" in too_far.json()["message"]
    assert too_far.json()["type"] == "BadRequestError"


# ---------------------------------------------------------------- fact 5


def test_indexer_topk(engine: ServerProcess, thinker: ServerProcess) -> None:
    # SGLang 0.5.23's ChatCompletionRequest (protocol.py) has no return_indexer_topk: only
    # io_struct.py GenerateReqInput does, and tokenizer_manager.py `_handle_batch_output`
    # puts the detokenizer's base64 (detokenizer_manager.py `_b64_encode_per_request`) in
    # meta_info["indexer_topk"]. The rollout framework (miles generate_endpoint_utils.py
    # `get_indexer_topk_from_response`) reads meta_info.indexer_topk and
    # meta_info.indexer_topk_num_layers, rows = all tokens - 1; the mock serves that shape.
    prompt = unique_prompt(4)
    body = {"messages": MESSAGES, "input_ids": prompt, "return_meta_info": True}
    meta = post(engine, {**body, "return_indexer_topk": True}).json()["choices"][0]["meta_info"]
    assert meta["indexer_topk_num_layers"] == IL
    values = rows(meta["indexer_topk"], IL, IK)
    assert len(values) == len(prompt) + meta["completion_tokens"] - 1
    assert "indexer_topk" not in post(engine, body).json()["choices"][0]["meta_info"]
    # An engine without the capture on never sends it (SGLang needs a server feature flag).
    off = post(thinker, {**body, "return_indexer_topk": True}).json()["choices"][0]["meta_info"]
    assert "indexer_topk" not in off


# ---------------------------------------------------------------- fact 6


def test_lora_path(engine: ServerProcess, thinker: ServerProcess) -> None:
    # managers/tokenizer_manager.py `_validate_and_resolve_lora` / `_resolve_lora_path`
    # (ValueError -> 400 BadRequestError via serving_chat.py `_handle_non_streaming_request`);
    # serving_base.py `_resolve_lora_path` ('base:adapter' model wins over lora_path).
    body = {"messages": MESSAGES, "input_ids": unique_prompt(5), "seed": 1}
    unknown = post(engine, {**body, "lora_path": "gamma"})
    assert unknown.status_code == 400
    assert unknown.json() == {
        "object": "error",
        "message": "Got LoRA adapter that has never been loaded: gamma\n"
        "All loaded adapters: dict_keys(['alpha', 'beta']).",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    base = post(engine, body).json()["choices"][0]["message"]["content"]
    alpha = post(engine, {**body, "lora_path": "alpha"}).json()
    assert alpha["choices"][0]["message"]["content"] != base
    by_model = post(engine, {**body, "model": "default:alpha"}).json()
    assert by_model["choices"][0]["message"] == alpha["choices"][0]["message"]
    assert by_model["model"] == "default:alpha"
    disabled = post(thinker, {**body, "lora_path": "alpha"})
    assert disabled.status_code == 400
    assert disabled.json()["message"].startswith(
        "LoRA adapter 'alpha' was requested, but LoRA is not enabled."
    )


# ---------------------------------------------------------------- fact 7


def test_weight_version(engine: ServerProcess, thinker: ServerProcess) -> None:
    # arg_groups/fields/serving.py weight_version (default "default"); http_server.py
    # `/update_weight_version` (UpdateWeightVersionReqInput, reply body) and `/model_info`;
    # tokenizer_manager.py meta_info["weight_version"]; utils/weight_versions.py metadata.
    body = {"messages": MESSAGES, "return_meta_info": True}
    assert post(thinker, body).json()["metadata"]["weight_version"] == "default"
    update = httpx.post(engine.url + "/update_weight_version", json={"new_version": "w1"})
    try:
        assert update.status_code == 200
        assert update.json() == {
            "success": True,
            "message": "Weight version updated to w1",
            "new_version": "w1",
        }
        reply = post(engine, body).json()
        assert reply["metadata"]["weight_version"] == "w1"
        assert [s["version"] for s in reply["metadata"]["weight_versions"]] == ["w1"]
        assert reply["choices"][0]["meta_info"]["weight_version"] == "w1"
        assert httpx.get(engine.url + "/model_info").json()["weight_version"] == "w1"
    finally:
        httpx.post(engine.url + "/update_weight_version", json={"new_version": "w0"})


# ---------------------------------------------------------------- fact 8


def test_graceful_abort(engine: ServerProcess) -> None:
    # managers/schedule_batch.py FINISH_ABORT().to_json() (message "Aborted", no status);
    # tokenizer_manager.py `_handle_abort_finish_reason` lets an abort without status_code
    # through as a normal reply; serving_chat.py `_build_chat_response` (finish_reason the
    # type, matched_stop None without "matched") and `_generate_chat_stream` (same in the
    # finish chunk). POST /mock/abort_next is the mock's deterministic trigger.
    body = {"messages": MESSAGES, "input_ids": unique_prompt(6), "logprobs": True}
    body["return_meta_info"] = True
    full = post(engine, body).json()["choices"][0]
    assert httpx.post(engine.url + "/mock/abort_next", json={"after_tokens": 3}).status_code == 200
    cut = post(engine, body).json()["choices"][0]
    assert cut["finish_reason"] == "abort" and cut["matched_stop"] is None
    assert cut["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }
    assert cut["meta_info"]["completion_tokens"] == 3
    lps = full["meta_info"]["output_token_logprobs"]
    assert cut["meta_info"]["output_token_logprobs"] == lps[:3]
    httpx.post(engine.url + "/mock/abort_next", json={"after_tokens": 2})
    stream_body = {k: v for k, v in body.items() if k != "return_meta_info"}
    events = [d for _, d in sse(engine, {**stream_body, "stream": True})]
    finish = events[-2]["choices"][0]
    assert finish["finish_reason"] == "abort" and finish["matched_stop"] is None
    assert sum(len(c["choices"][0]["logprobs"]["content"]) for c in events[1:-2]) == 2


def test_abort_request_endpoint_aborts_a_running_request() -> None:
    # http_server.py `/abort_request` (AbortReq: rid, abort_all) -> scheduler.py
    # `abort_request` (rid prefix match, running request finishes with FINISH_ABORT()).
    args = ["--token-delay-ms", "20", "--completion-tokens", "300"]
    with mock_engine(*args) as slow:
        result: dict[str, Any] = {}

        def call() -> None:
            body = {"messages": MESSAGES, "rid": "rollout-7-turn-2", "return_meta_info": True}
            result["reply"] = post(slow, body).json()

        worker = threading.Thread(target=call)
        worker.start()
        time.sleep(0.5)
        assert httpx.post(slow.url + "/abort_request", json={"rid": "rollout-7"}).status_code == 200
        worker.join(10)
        choice = result["reply"]["choices"][0]
        assert result["reply"]["id"] == "rollout-7-turn-2"
        assert choice["finish_reason"] == "abort"
        assert 0 < choice["meta_info"]["completion_tokens"] < 300


# ---------------------------------------------------------------- fact 9


def test_reasoning_parser(thinker: ServerProcess, tok: Any) -> None:
    # parser/reasoning_parser.py Qwen3Detector / BaseReasoningFormatDetector
    # (`detect_and_parse`, `parse_streaming_increment`); serving_chat.py
    # `_build_chat_response` (message.reasoning_content) and `_generate_stream_content`
    # (reasoning chunk first, with the step's logprobs); protocol.py separate_reasoning
    # default True; schedule_batch.py `update_reasoning_tokens` (tokens through </think>);
    # usage_processor.py (reasoning_tokens, completion_tokens_details).
    body = {"messages": MESSAGES, "logprobs": True, "seed": 5}
    choice = post(thinker, {**body, "return_meta_info": True}).json()
    usage = choice["usage"]
    choice = choice["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] and message["content"]
    ids = [e[1] for e in choice["meta_info"]["output_token_logprobs"]]
    text = f"<think>{message['reasoning_content']}</think>{message['content']}"
    assert tok.decode(ids[:-1]) == text
    n_think = len(tok.encode(f"<think>{message['reasoning_content']}</think>"))
    assert choice["meta_info"]["reasoning_tokens"] == usage["reasoning_tokens"] == n_think
    assert usage["completion_tokens_details"] == {"reasoning_tokens": n_think}

    steps = [d["choices"][0] for _, d in sse(thinker, {**body, "stream": True})[1:-2]]
    # A step whose text the parser holds back (the <think> tag) sends its logprobs alone.
    texts = [s for s in steps if s["delta"]["reasoning_content"] or s["delta"].get("content")]
    kinds = ["reasoning" if s["delta"]["reasoning_content"] else "content" for s in texts]
    assert kinds == sorted(kinds, key=lambda k: k == "content")  # all reasoning first
    assert (
        "".join(s["delta"]["reasoning_content"] or "" for s in steps)
        == message["reasoning_content"]
    )
    assert "".join(s["delta"].get("content") or "" for s in steps) == message["content"]
    streamed = [e for s in steps if s["logprobs"] for e in s["logprobs"]["content"]]
    assert streamed == choice["logprobs"]["content"]

    off = {**body, "chat_template_kwargs": {"enable_thinking": False}, "return_meta_info": True}
    plain = post(thinker, off).json()["choices"][0]
    assert plain["message"]["reasoning_content"] is None
    assert plain["meta_info"]["reasoning_tokens"] == 0
    assert "<think>" not in plain["message"]["content"]


# ---------------------------------------------------------------- fact 10


def test_routed_experts_rows_follow_the_token_prefix(engine: ServerProcess) -> None:
    # SGLang returns the routing captured for each token: state_capturer/base.py
    # `BaseTopkCapturer.on_forward_end` stores each forward's top-k rows at the tokens' KV
    # slots and `get_topk` reads rows [start_len, seqlen - 1) through req_to_token, called
    # from scheduler_components/batch_result_processor.py `_maybe_collect_routed_experts`;
    # entrypoints/openai/serving_chat.py passes routed_experts_start_len through and returns
    # the rows (sglext / meta_info). A token's routing depends on the tokens up to it only,
    # so a later turn repeats an earlier turn's rows for the shared prefix. The rollout
    # framework's addition R3 (miles/rollout/session/core.py `_maybe_request_addition_r3`)
    # relies on it: it asks for rows from len(checkpoint) - 1 on, asserting "the checkpoint's
    # N - 1 rows must remain a causal prefix of the new prompt", and concatenates the patches.
    # Indexer top-k is the same: state_capturer/indexer_topk.py `IndexerTopkCapturer` is a
    # BaseTopkCapturer, read by batch_result_processor.py `_maybe_collect_indexer_topk`.
    prompt = unique_prompt(10, 150)  # longer than the mock's 96-row blocks
    base = {"messages": MESSAGES, "return_routed_experts": True, "return_meta_info": True}
    base |= {"return_indexer_topk": True, "return_output_ids_in_sglext": True}

    def turn(ids: list[int], **extra: Any) -> tuple[np.ndarray, np.ndarray, list[int]]:
        reply = post(engine, {**base, "input_ids": ids, **extra}).json()
        meta = reply["choices"][0]["meta_info"]
        r3, topk = rows(meta["routed_experts"], L, K), rows(meta["indexer_topk"], IL, IK)
        assert len(r3) == len(topk) == len(ids) + meta["completion_tokens"] - 1
        return r3, topk, reply["sglext"]["output_ids"][0]

    r3_1, topk_1, out_1 = turn(prompt, seed=1)
    prompt_2 = [*prompt, *out_1, *range(500, 630)]  # turn 2: the whole turn 1, then more
    r3_2, topk_2, _ = turn(prompt_2, seed=2)
    shared = len(prompt) + len(out_1) - 1
    assert len(r3_1) == shared and np.array_equal(r3_2[:shared], r3_1)
    assert np.array_equal(topk_2[:shared], topk_1)

    # Addition R3: the rows from start_len on are those of the full reply, streamed or not.
    body = {"messages": MESSAGES, "input_ids": prompt_2, "return_routed_experts": True}
    for start in (shared, shared - 1, shared + 1, 97, len(prompt_2)):
        patch = post(engine, {**body, "routed_experts_start_len": start}).json()["sglext"]
        assert np.array_equal(rows(patch["routed_experts"], L, K), r3_2[start:])
    events = sse(engine, {**body, "stream": True, "routed_experts_start_len": shared})
    assert np.array_equal(rows(events[-2][1]["sglext"]["routed_experts"], L, K), r3_2[shared:])

    # Other sessions (other token prefixes) get other rows, from row 0 on.
    r3_a, topk_a, _ = turn(unique_prompt(11))
    r3_b, topk_b, _ = turn(unique_prompt(12))
    assert not np.array_equal(r3_a[0], r3_b[0]) and not np.array_equal(r3_a[0], r3_1[0])
    assert not np.array_equal(topk_a[0], topk_b[0])


# ---------------------------------------------------------------- tool-call arguments


def test_assistant_tool_call_arguments_are_parsed_before_the_template(
    engine: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # entrypoints/openai/serving_chat.py `_apply_jinja_template` runs
    # `normalize_assistant_tool_call_arguments(message, strict=True)` on every message before
    # rendering: JSON-text arguments reach the template as an object (`parse_tool_call_arguments`),
    # so a template reading `arguments|items` renders the history an agent echoes back; text
    # that is not a JSON object is a ValueError, answered by serving_base.py `handle_request`
    # as a 400 "BadRequest".
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"q": 1}'}}
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    directory = tokenizer_dir(tmp_path_factory.mktemp("qwen35"), QWEN35_STYLE)
    with mock_engine("--tokenizer", str(directory)) as qwen35:
        reply = post(qwen35, {"messages": history, "max_tokens": 2})
        assert reply.status_code == 200, reply.text
    for arguments, reason in (
        ('{"q": ', "must be valid JSON"),
        ("[1]", "must be a JSON object"),
    ):
        bad = {**call, "function": {"name": "f", "arguments": arguments}}
        body = {"messages": [history[0], {**history[1], "tool_calls": [bad]}, history[2]]}
        refused = post(engine, body)
        assert refused.status_code == 400
        assert refused.json() == {
            "object": "error",
            "message": f"Assistant tool call function.arguments {reason}.",
            "type": "BadRequest",
            "param": None,
            "code": 400,
        }


# ---------------------------------------------------------------- health and meta-only flags


def test_health_is_an_empty_200(engine: ServerProcess) -> None:
    # entrypoints/http_server.py `health_generate` serves GET /health: `Response(status_code=200)`
    # once the engine answers, no body.
    reply = httpx.get(engine.url + "/health", timeout=10)
    assert reply.status_code == 200
    assert reply.content == b""


@pytest.mark.parametrize("flag", ["return_sampling_mask", "return_flat_raw_output_top_logprobs"])
def test_meta_info_only_flags_need_return_meta_info(engine: ServerProcess, flag: str) -> None:
    # entrypoints/openai/serving_chat.py `_validate_request`: "<flag> requires
    # return_meta_info=true.", answered by serving_base.py `handle_request` with
    # `create_error_response` (400, "BadRequestError"); protocol.py declares both as bool.
    refused = post(engine, {"messages": MESSAGES, flag: True})
    assert refused.status_code == 400
    assert refused.json() == {
        "object": "error",
        "message": f"{flag} requires return_meta_info=true.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    assert post(engine, {"messages": MESSAGES, flag: True, "return_meta_info": True}).is_success
    assert post(engine, {"messages": MESSAGES, flag: False}).is_success
    mistyped = post(engine, {"messages": MESSAGES, flag: "yes"})
    assert mistyped.status_code == 400 and mistyped.json()["type"] == "Bad Request"
