"""The rollout framework's client path, unchanged, against a real gateway.

Written from the framework's documented session API (radixark/miles: the tracer in
`miles/rollout/generate_utils/openai_endpoint_utils.py` creates a session with
`POST /sessions {}`, the agent talks to an OpenAI-compatible `/sessions/{id}/v1`, then the
tracer posts `{"max_seq_len": N}` to `/sessions/{id}/samples`, deletes the session with a
`{}` body, and decodes the safetensors reply as `samples/codec.py` documents: one
`_samples_meta` uint8 JSON tensor, `<field>.<i>` tensors with pinned dtypes, `nulls` naming
absent tensors, and no unreferenced tensor). The decoder below is ours, not theirs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from support.framework_client import (
    agent_episode,
    collect_samples,
    decode_samples,
)
from support.procs import ServerProcess, free_port
from support.tool_templates import TEMPLATES, tokenizer_dir

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs


@pytest.fixture(scope="module")
def gateway() -> Iterator[ServerProcess]:
    port = free_port()
    argv = ["serve", "--port", str(port), "--workers", "2", "--r3", "--r3-topk", "2"]
    # Completions end naturally (12 tokens, under max_tokens): a "length" turn would end the
    # merged sample there, as the framework's merge does.
    mock = "--r3-layers 3 --r3-topk 2 --tool-call-rate 0.5 --completion-tokens 12"
    argv += ["--mock-args", mock]
    with ServerProcess(argv, port, timeout=60) as proc:
        yield proc


def test_agent_loop_then_samples_is_token_exact(gateway: ServerProcess) -> None:
    session_id = agent_episode(gateway.url, turns=5)
    session = httpx.get(f"{gateway.url}/sessions/{session_id}").json()
    records = session["records"]
    accumulated = session["metadata"]["accumulated_token_ids"]
    payload = collect_samples(gateway.url, session_id, max_seq_len=None)
    assert httpx.get(f"{gateway.url}/sessions/{session_id}").status_code == 410  # reclaimed

    samples, metadata, empty_reason = decode_samples(payload)
    assert empty_reason is None and len(samples) == 1
    sample = samples[0]
    assert metadata["accumulated_token_ids"] == accumulated
    tokens = sample["tokens"].tolist()
    assert tokens == accumulated
    first_prompt = len(records[0]["request"]["input_ids"])
    assert sample["response_length"] == len(tokens) - first_prompt
    assert len(sample["loss_mask"]) == len(sample["rollout_log_probs"]) == sample["response_length"]
    # Sampled tokens carry their logprob and mask 1; tool and user tokens between turns 0.
    expected_mask = [0] * len(tokens)
    expected_lp = [0.0] * len(tokens)
    for record in records:
        start = len(record["request"]["input_ids"])
        entries = record["response"]["choices"][0]["meta_info"]["output_token_logprobs"]
        for offset, (logprob, token_id, *_) in enumerate(entries):
            assert tokens[start + offset] == token_id
            expected_mask[start + offset] = 1
            expected_lp[start + offset] = logprob
    assert sample["loss_mask"].tolist() == expected_mask[first_prompt:]
    assert sample["rollout_log_probs"].tolist() == expected_lp[first_prompt:]
    assert sample["status"] == "completed"
    assert sample["weight_versions"] == [r["weight_version"] for r in records]
    # Records keep the engine's whole reply, the fields SGLang 0.5.23 added included.
    for record in records:
        response = record["response"]
        meta = response["choices"][0]["meta_info"]
        spans = [
            {
                "version": record["weight_version"],
                "start": 0,
                "end": len(meta["output_token_logprobs"]),
            }
        ]
        assert meta["weight_versions"] == response["metadata"]["weight_versions"] == spans
        assert "cached_tokens_details" in meta
        assert isinstance(meta["response_sent_to_client_ts"], float)
        assert record["cached_tokens"] == meta["cached_tokens"]
    # R3: one row per token but the last, [layers, top-k] each, as the last turn sent it.
    assert sample["rollout_routed_experts"].shape == (len(tokens) - 1, 3, 2)
    assert sample["rollout_indexer_topk"] is None
    # miles/utils/lifecycle.py `attach_lifecycle_metadata`: one segment per merged turn, ending
    # at the record's timestamp and starting the engine's e2e_latency (seconds) before it.
    lifecycle = sample["metadata"]["lifecycle"]
    assert len(lifecycle) == len(records)
    for turn, (segment, record) in enumerate(zip(lifecycle, records, strict=True)):
        latency = record["response"]["choices"][0]["meta_info"]["e2e_latency"]
        assert isinstance(latency, float) and latency >= 0
        assert segment["t1"] == record["timestamp"]
        assert segment["t0"] == record["timestamp"] - latency
        assert segment["turn"] == turn + 1
        assert segment["req_ts"] == record["request_timestamp"]


def test_samples_truncated_to_max_seq_len(gateway: ServerProcess) -> None:
    session_id = agent_episode(gateway.url, turns=3)
    records = httpx.get(f"{gateway.url}/sessions/{session_id}").json()["records"]
    second_prompt = len(records[1]["request"]["input_ids"])
    limit = second_prompt + 2  # inside the second turn's completion
    samples, _, empty_reason = decode_samples(collect_samples(gateway.url, session_id, limit))
    assert empty_reason is None
    sample = samples[0]
    assert len(sample["tokens"]) == limit
    assert sample["status"] == "truncated"
    assert sample["rollout_routed_experts"].shape[0] == limit - 1


def test_max_seq_len_of_zero_or_less_truncates_everything(gateway: ServerProcess) -> None:
    # miles/rollout/session/samples/merge.py `truncate_samples_by_total_tokens` keeps nothing
    # when no turn fits, and core.py `collect_samples` answers that with a 200 payload of no
    # samples and empty_reason "all_truncated"; an empty session stays "no_records".
    session_id = agent_episode(gateway.url, turns=2)
    accumulated = httpx.get(f"{gateway.url}/sessions/{session_id}").json()["metadata"][
        "accumulated_token_ids"
    ]
    for limit in (0, -1, -(10**30)):
        reply = httpx.post(
            f"{gateway.url}/sessions/{session_id}/samples", json={"max_seq_len": limit}
        )
        assert reply.status_code == 200, reply.text
        assert reply.headers["content-type"] == "application/octet-stream"
        samples, metadata, empty_reason = decode_samples(reply.content)
        assert samples == [] and empty_reason == "all_truncated"
        assert metadata["accumulated_token_ids"] == accumulated
    samples, _, empty_reason = decode_samples(collect_samples(gateway.url, session_id, None))
    assert empty_reason is None and len(samples) == 1  # nothing was consumed
    empty = httpx.post(f"{gateway.url}/sessions", json={}).json()["session_id"]
    samples, _, empty_reason = decode_samples(collect_samples(gateway.url, empty, 0))
    assert samples == [] and empty_reason == "no_records"


def test_samples_of_an_empty_session_and_bad_input(gateway: ServerProcess) -> None:
    session_id = httpx.post(f"{gateway.url}/sessions", json={}).json()["session_id"]
    bad = httpx.post(f"{gateway.url}/sessions/{session_id}/samples", json={"max_seq_len": "x"})
    assert bad.status_code == 400 and "max_seq_len" in bad.json()["error"]
    samples, _, empty_reason = decode_samples(collect_samples(gateway.url, session_id, None))
    assert samples == [] and empty_reason == "no_records"
    missing = httpx.post(f"{gateway.url}/sessions/{'0' * 32}/samples", json={})
    assert missing.status_code == 404


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_agent_tool_loop_on_mapping_templates(tmp_path: Path, name: str) -> None:
    # Templates that iterate tool-call arguments as a mapping (Qwen3.5 `arguments|items`,
    # MiniMax `arguments.items()`) get the engine's JSON text parsed, as SGLang and the
    # framework's `normalize_tool_arguments` give it to them: the turn after a tool call
    # renders, and the record keeps the text the engine sent.
    directory = tokenizer_dir(tmp_path / name, TEMPLATES[name])
    port = free_port()
    argv = ["serve", "--port", str(port), "--workers", "1", "--tokenizer", str(directory)]
    argv += ["--mock-args", "--tool-call-rate 1 --completion-tokens 12"]
    with ServerProcess(argv, port, timeout=60) as gateway:
        session_id = agent_episode(gateway.url, turns=3)
        session = httpx.get(f"{gateway.url}/sessions/{session_id}").json()
        samples, _, _ = decode_samples(collect_samples(gateway.url, session_id, None))
    records = session["records"]
    assert len(records) == 3
    for record in records:
        call = record["response"]["choices"][0]["message"]["tool_calls"][0]
        assert isinstance(call["function"]["arguments"], str)
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
    assert samples[0]["tokens"].tolist() == session["metadata"]["accumulated_token_ids"]
