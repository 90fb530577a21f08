"""The mock engine against SGLang 0.5.23's native API: `/generate`, `/flush_cache`,
`/v1/loads`, `/metrics`, and the 404 of a path it does not serve, over real HTTP.

Every test names the SGLang source the fact was read from; paths are under `sglang/srt/`
in the sglang-0.5.23 wheel (the contract gate is `sglang/api/v1/api_types.py`).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sessiongate.tokenizer import load_tokenizer
from support.procs import ServerProcess, mock_engine

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

L, K, E = 4, 2, 16
META_KEYS = [
    "id",
    "finish_reason",
    "prompt_tokens",
    "weight_version",
    "num_retractions",
    "reasoning_tokens",
    "completion_tokens",
    "cached_tokens",
    "weight_versions",
    "cached_tokens_details",
    "e2e_latency",
    "response_sent_to_client_ts",
]


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerProcess]:
    args = ["--r3-layers", str(L), "--r3-topk", str(K), "--r3-experts", str(E)]
    args += ["--lora-adapters", "alpha", "--completion-tokens", "12"]
    with mock_engine(*args) as proc:
        yield proc


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer(None)


def gen(engine: ServerProcess, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(engine.url + "/generate", json=body, timeout=30, **kw)


def events(resp: httpx.Response) -> list[Any]:
    out: list[Any] = []
    for block in resp.text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_reply_shape_text_output_ids_meta_info(engine: ServerProcess, tok: Any) -> None:
    # managers/tokenizer_manager.py `_handle_batch_output`: {"text", "output_ids",
    # "meta_info"}, meta_info keys in this order; `_stream_one_response` adds
    # response_sent_to_client_ts to the finished output.
    r = gen(engine, {"text": "hello there", "sampling_params": {"max_new_tokens": 50}})
    assert r.status_code == 200
    out = r.json()
    assert list(out) == ["text", "output_ids", "meta_info"]
    meta = out["meta_info"]
    assert list(meta) == META_KEYS
    assert meta["prompt_tokens"] == len(tok.encode("hello there"))
    assert meta["completion_tokens"] == len(out["output_ids"])
    # A natural stop: the end token is in output_ids, not in the text (skip_special_tokens).
    assert meta["finish_reason"] == {"type": "stop", "matched": out["output_ids"][-1]}
    assert out["text"] == tok.decode(out["output_ids"][:-1])
    assert meta["weight_versions"] == [
        {"version": "default", "start": 0, "end": meta["completion_tokens"]}
    ]


def test_max_new_tokens_finishes_with_length(engine: ServerProcess) -> None:
    # managers/schedule_batch.py FINISH_LENGTH.to_json: {"type": "length", "length": n}.
    out = gen(engine, {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert len(out["output_ids"]) == 3


def test_ignore_eos_runs_to_max_new_tokens(engine: ServerProcess) -> None:
    # sampling/sampling_params.py `ignore_eos`: the end token does not finish the request.
    sp = {"max_new_tokens": 30, "ignore_eos": True}
    out = gen(engine, {"input_ids": [5, 6, 7], "sampling_params": sp}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 30}


def test_stop_string_is_trimmed_from_text(engine: ServerProcess, tok: Any) -> None:
    # managers/schedule_batch.py `check_finished` (stop strings), detokenizer_manager.py
    # `trim_matched_stop`: the text ends before the matched stop; matched is the string.
    base = gen(engine, {"input_ids": [9, 9, 9], "sampling_params": {"max_new_tokens": 8}}).json()
    word = base["text"].split()[2]
    sp = {"max_new_tokens": 8, "stop": [word]}
    out = gen(engine, {"input_ids": [9, 9, 9], "sampling_params": sp}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}
    assert word not in out["text"]
    assert base["text"].startswith(out["text"])


def test_stop_token_ids_keep_the_token_in_output_ids(engine: ServerProcess) -> None:
    # schedule_batch.py `check_finished` (stop_token_ids): matched is the id, which stays in
    # output_ids; the text stops before it.
    base = gen(engine, {"input_ids": [4, 4], "sampling_params": {"max_new_tokens": 6}}).json()
    stop_id = base["output_ids"][2]
    sp = {"max_new_tokens": 6, "stop_token_ids": [stop_id]}
    out = gen(engine, {"input_ids": [4, 4], "sampling_params": sp}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["output_ids"] == base["output_ids"][: base["output_ids"].index(stop_id) + 1]


def test_logprobs_are_logprob_id_text_triples(engine: ServerProcess, tok: Any) -> None:
    # tokenizer_manager.py `detokenize_logprob_tokens`: (logprob, id, text or None);
    # `add_logprob_to_meta_info`: input/output lists and output_token_logprobs_length right
    # after num_retractions. logprob_start_len -1 (io_struct.py default): no input logprobs.
    body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 4}}
    meta = gen(engine, {**body, "return_logprob": True}).json()["meta_info"]
    assert list(meta)[5:8] == [
        "input_token_logprobs",
        "output_token_logprobs",
        "output_token_logprobs_length",
    ]
    assert meta["input_token_logprobs"] == []
    assert all(e[2] is None for e in meta["output_token_logprobs"])
    assert meta["output_token_logprobs_length"] == 4
    with_text = gen(engine, {**body, "return_logprob": True, "return_text_in_logprobs": True})
    entries = with_text.json()["meta_info"]["output_token_logprobs"]
    assert [e[2] for e in entries] == [tok.decode([e[1]]) for e in entries]


def test_logprob_start_len_gives_prompt_logprobs_first_is_null(engine: ServerProcess) -> None:
    # io_struct.py `logprob_start_len`: prompt logprobs from that position; the first
    # prompt token has no logprob (None). top_logprobs_num adds input/output top lists.
    body = {
        "input_ids": [3, 4, 5, 6],
        "sampling_params": {"max_new_tokens": 2},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
    }
    meta = gen(engine, body).json()["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == [3, 4, 5, 6]
    assert meta["input_token_logprobs"][0][0] is None
    assert meta["input_top_logprobs"][0] is None
    assert all(len(row) == 2 for row in meta["output_top_logprobs"])


def test_batch_text_gets_a_list_and_rid_prefix(engine: ServerProcess) -> None:
    # io_struct.py `_normalize_rid`: a string rid in a batch becomes "<rid>_<i>";
    # `_handle_batch_request` answers a non-stream batch with a list in input order.
    r = gen(engine, {"text": ["one", "two"], "rid": "b", "sampling_params": {"max_new_tokens": 2}})
    outs = r.json()
    assert [o["meta_info"]["id"] for o in outs] == ["b_0", "b_1"]


def test_batch_input_ids(engine: ServerProcess) -> None:
    # io_struct.py `_determine_batch_size`: a list of lists is a batch.
    outs = gen(engine, {"input_ids": [[1, 2], [3, 4, 5]]}).json()
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [2, 3]


def test_no_prompt_is_a_value_error(engine: ServerProcess) -> None:
    # io_struct.py `_validate_inputs` -> http_server.py `_create_error_response`.
    r = gen(engine, {"sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400
    msg = "Either text, input_ids or input_embeds should be provided."
    assert r.json() == {"error": {"message": msg}}


def test_empty_input_ids_is_a_value_error(engine: ServerProcess) -> None:
    # io_struct.py `_determine_batch_size`: "input_ids cannot be empty." (no session).
    r = gen(engine, {"input_ids": []})
    assert (r.status_code, r.json()) == (400, {"error": {"message": "input_ids cannot be empty."}})


def test_contract_gate_refuses_wrong_types(engine: ServerProcess) -> None:
    # entrypoints/http_server.py `generate_request` + api_types.py `decode_GenerateRequest`:
    # serde's text as {"error": "<text>"}, status 400.
    r = gen(engine, {"text": "hi", "stream": 1})
    assert r.status_code == 400
    assert r.json() == {"error": "invalid type: integer `1`, expected a boolean"}


def test_contract_gate_refuses_unknown_sampling_params(engine: ServerProcess) -> None:
    # api_types.py `decode_SamplingParams`: unknown keys are refused (the top level ignores
    # them).
    r = gen(engine, {"text": "hi", "sampling_params": {"seed": 3}, "whatever": 1})
    assert r.status_code == 400
    assert r.json()["error"].startswith("unknown field `seed`, expected one of `max_new_tokens`")


def test_sampling_verify_refuses_negative_temperature(engine: ServerProcess) -> None:
    # sampling/sampling_params.py `verify`.
    r = gen(engine, {"text": "hi", "sampling_params": {"temperature": -1}})
    msg = "temperature must be a non-negative finite number, got -1."
    assert (r.status_code, r.json()) == (400, {"error": {"message": msg}})


def test_duplicate_rids_refused(engine: ServerProcess) -> None:
    # io_struct.py `_validate_rid_uniqueness`.
    r = gen(engine, {"text": ["a", "b"], "rid": ["x", "x"]})
    msg = "Duplicate request IDs detected within the request: ['x']"
    assert (r.status_code, r.json()) == (400, {"error": {"message": msg}})


def test_single_extra_key_must_be_a_string(engine: ServerProcess) -> None:
    # io_struct.py `_normalize_single_inputs`.
    r = gen(engine, {"text": "a", "extra_key": ["k"]})
    msg = "extra_key should be a string for a single request."
    assert (r.status_code, r.json()) == (400, {"error": {"message": msg}})


def test_unknown_lora_is_refused(engine: ServerProcess) -> None:
    # managers/tokenizer_manager.py `_validate_and_resolve_lora`.
    r = gen(engine, {"text": "a", "lora_path": "nope"})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("Got LoRA adapter that has never been loaded")


def test_value_error_in_a_stream_is_an_event_in_a_200(engine: ServerProcess) -> None:
    # http_server.py `stream_results`: the ValueError surfaces inside the generator, after
    # the 200; one error event with type invalid_request_error, then [DONE].
    r = gen(engine, {"stream": True, "sampling_params": {}})
    assert r.status_code == 200
    evs = events(r)
    assert evs[-1] == "[DONE]"
    assert evs[0] == {
        "error": {
            "message": "Either text, input_ids or input_embeds should be provided.",
            "type": "invalid_request_error",
            "code": 400,
            "retryable": False,
        }
    }


def test_stream_chunks_are_cumulative(engine: ServerProcess) -> None:
    # tokenizer_manager.py `_handle_batch_output` (non-incremental streaming, the default):
    # each chunk has the whole text and output_ids so far; only the last a finish reason;
    # `_stream_one_response` stamps response_sent_to_client_ts on the first chunk only.
    body = {"input_ids": [7, 8], "sampling_params": {"max_new_tokens": 5}}
    whole = gen(engine, body).json()
    evs = events(gen(engine, {**body, "stream": True}))
    assert evs[-1] == "[DONE]"
    chunks = evs[:-1]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["text"] == whole["text"]
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    assert "response_sent_to_client_ts" in chunks[0]["meta_info"]
    assert all("response_sent_to_client_ts" not in c["meta_info"] for c in chunks[1:])
    assert "e2e_latency" in chunks[-1]["meta_info"]


def test_batch_stream_chunks_carry_index(engine: ServerProcess) -> None:
    # tokenizer_manager.py `_stream_batch_responses`: result["index"] = the prompt's place.
    evs = events(gen(engine, {"text": ["a", "b"], "stream": True}))
    assert {c["index"] for c in evs[:-1]} == {0, 1}


def test_routed_experts_in_meta_info(engine: ServerProcess) -> None:
    # tokenizer_manager.py `_handle_batch_output`: meta_info.routed_experts, base64 int32
    # (seqlen - 1 - routed_experts_start_len, L, K) rows (io_struct.py).
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
    out = gen(engine, {**body, "return_routed_experts": True}).json()
    raw = base64.b64decode(out["meta_info"]["routed_experts"])
    assert len(raw) == (3 + 4 - 1) * L * K * 4


def test_cached_tokens_come_before_routed_experts(engine: ServerProcess) -> None:
    # tokenizer_manager.py `_handle_batch_output`: `meta_info.update({..., "cached_tokens"})`
    # runs before `meta_info["routed_experts"] = ...`, so in the reply's bytes the count
    # precedes the R3 string: the compiled front's watch for it (rust/cached_tokens.rs)
    # stops before the bulk, whole or streamed.
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
    for stream in (False, True):
        raw = gen(engine, {**body, "return_routed_experts": True, "stream": stream}).content
        assert raw.count(b'"routed_experts"') == 1, "only the last chunk carries R3"
        assert 0 <= raw.find(b'"cached_tokens"') < raw.find(b'"routed_experts"')


def test_routed_experts_start_len_out_of_range(engine: ServerProcess) -> None:
    # scheduler.py `handle_generate_request` -> tokenizer_manager.py
    # `_handle_abort_finish_reason`: a 400 ValueError for a non-stream request.
    body = {"input_ids": [1, 2], "return_routed_experts": True, "routed_experts_start_len": 5}
    r = gen(engine, body)
    assert r.status_code == 400
    assert "is higher than the number of input tokens" in r.json()["error"]["message"]


def test_return_prompt_token_ids(engine: ServerProcess) -> None:
    # tokenizer_manager.py `_handle_batch_output`: prompt_token_ids after meta_info.
    out = gen(engine, {"input_ids": [1, 2, 3], "return_prompt_token_ids": True}).json()
    assert list(out)[-1] == "prompt_token_ids"
    assert out["prompt_token_ids"] == [1, 2, 3]


def test_cached_tokens_count_the_prefix_left_by_a_finished_request(engine: ServerProcess) -> None:
    # managers/schedule_batch.py `_compute_max_prefix_len`: at most prompt - 1 tokens
    # match; a finished request leaves prompt + output (but the last token) in the cache.
    prompt = [11, 12, 13, 14, 15, 16]
    first = gen(engine, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 3}}).json()
    assert first["meta_info"]["cached_tokens"] == 0
    turn2 = prompt + first["output_ids"] + [17]
    later = gen(engine, {"input_ids": turn2}).json()
    assert later["meta_info"]["cached_tokens"] == len(prompt) + 3 - 1
    again = gen(engine, {"input_ids": prompt}).json()
    assert again["meta_info"]["cached_tokens"] == len(prompt) - 1
    assert again["meta_info"]["cached_tokens_details"] == {"device": 5, "host": 0}


def test_extra_key_and_lora_have_their_own_cache(engine: ServerProcess) -> None:
    # schedule_batch.py `Req.__init__` (lora_id appended to extra_key), mem_cache/radix_cache.py
    # RadixKey: prefixes are matched only within the same extra_key.
    prompt = [21, 22, 23, 24, 25]
    gen(engine, {"input_ids": prompt, "extra_key": "k1"})
    other = gen(engine, {"input_ids": prompt, "extra_key": "k2"}).json()
    assert other["meta_info"]["cached_tokens"] == 0
    lora = gen(engine, {"input_ids": prompt, "extra_key": "k1", "lora_path": "alpha"}).json()
    assert lora["meta_info"]["cached_tokens"] == 0
    same = gen(engine, {"input_ids": prompt, "extra_key": "k1"}).json()
    assert same["meta_info"]["cached_tokens"] == len(prompt) - 1


def test_flush_cache_empties_it(engine: ServerProcess) -> None:
    # entrypoints/http_server.py `flush_cache` (GET or POST): 200 and this text;
    # scheduler.py `flush_cache` resets the tree.
    prompt = [31, 32, 33, 34]
    gen(engine, {"input_ids": prompt})
    for method in ("GET", "POST"):
        r = httpx.request(method, engine.url + "/flush_cache", timeout=10)
        assert r.status_code == 200
        assert r.text.startswith("Cache flushed.\nPlease check backend logs")
    assert gen(engine, {"input_ids": prompt}).json()["meta_info"]["cached_tokens"] == 0


def test_flush_cache_negative_timeout_refused(engine: ServerProcess) -> None:
    # http_server.py `flush_cache(timeout: float = Query(0.0, ge=0.0))`: a validation 400.
    r = httpx.post(engine.url + "/flush_cache?timeout=-1", timeout=10)
    assert r.status_code == 400
    assert r.json()["type"] == "Bad Request"


def test_v1_loads_shape(engine: ServerProcess) -> None:
    # entrypoints/v1_loads.py `get_loads` and managers/load_snapshot.py
    # `LoadSnapshot.to_dict`: the envelope, then per DP rank the core keys in field order.
    body = httpx.get(engine.url + "/v1/loads", timeout=10).json()
    assert list(body) == ["timestamp", "version", "accelerator", "num_accelerators", "loads"]
    (load,) = body["loads"]
    assert list(load)[:6] == [
        "timestamp",
        "dp_rank",
        "num_running_reqs",
        "num_waiting_reqs",
        "num_waiting_uncached_tokens",
        "num_used_tokens",
    ]
    core = httpx.get(engine.url + "/v1/loads?include=core", timeout=10).json()["loads"][0]
    assert "queues" not in core and "disaggregation" not in core
    assert list(core)[-1] == "decode_moments"


def test_v1_loads_bad_include_is_a_500(engine: ServerProcess) -> None:
    # load_snapshot.py `to_dict` raises ValueError outside v1_loads.py's try: a 500.
    r = httpx.get(engine.url + "/v1/loads?include=nope", timeout=10)
    assert r.status_code == 500


def test_get_load_is_not_served(engine: ServerProcess) -> None:
    # sglang-router 0.3.2 (sgl-model-gateway worker_service.rs) polls GET /get_load, which
    # 0.5.23's http_server.py does not register: FastAPI's 404 {"detail": "Not Found"}.
    r = httpx.get(engine.url + "/get_load", timeout=10)
    assert (r.status_code, r.json()) == (404, {"detail": "Not Found"})


def test_metrics_is_prometheus_text(engine: ServerProcess) -> None:
    # utils/common.py `add_prometheus_middleware` (with --enable-metrics): prometheus_client's
    # `make_asgi_app` mounted at /metrics, so its text format and CONTENT_TYPE_LATEST.
    # observability/metrics_collector.py: the families' names and help texts; the
    # scheduler's labels (`SchedulerMetricsCollector`: model_name, engine_type, tp_rank,
    # pp_rank, moe_ep_rank) with disaggregation/utils.py `to_engine_type` "unified" when it
    # is off; the tokenizer's (`tokenizer_metric_labels` plus "is_streaming") on the token
    # counters.
    gen(engine, {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    r = httpx.get(engine.url + "/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    lines = r.text.splitlines()
    scheduler = (
        'model_name="sessiongate-mock",engine_type="unified",tp_rank="0",pp_rank="0",'
        'moe_ep_rank="0"'
    )
    for name, kind, text in (
        ("sglang:num_running_reqs", "gauge", "The number of running requests."),
        ("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue."),
        ("sglang:cache_hit_rate", "gauge", "The prefix cache hit rate."),
    ):
        at = lines.index(f"# HELP {name} {text}")
        assert lines[at + 1] == f"# TYPE {name} {kind}"
        assert lines[at + 2].startswith(f"{name}{{{scheduler}}} ")
    assert f"sglang:num_running_reqs{{{scheduler}}} 0.0" in lines
    at = lines.index("# HELP sglang:prompt_tokens_total Number of prefill tokens processed.")
    assert lines[at + 1] == "# TYPE sglang:prompt_tokens_total counter"
    sample = lines[at + 2]
    prefix = (
        'sglang:prompt_tokens_total{model_name="sessiongate-mock",engine_type="unified",'
        'is_streaming="false"} '
    )
    assert sample.startswith(prefix) and float(sample[len(prefix) :]) >= 3.0
