"""The rollout framework's client path: an agent episode, then its samples."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

np = pytest.importorskip("numpy", reason="numpy is in the test extra")


st_numpy = pytest.importorskip("safetensors.numpy", reason="safetensors is in the test extra")


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "search the notes",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


# codec.py SAMPLES_VALUE_SPEC: the tensor fields and their wire dtypes.
TENSOR_FIELDS = {
    "tokens": "int64",
    "loss_mask": "uint8",
    "rollout_log_probs": "float64",
    "rollout_routed_experts": "int32",
    "rollout_indexer_topk": "int32",
}


JSON_FIELDS = (
    "response",
    "response_length",
    "status",
    "weight_versions",
    "prefix_cache_info",
    "metadata",
)


def decode_samples(payload: bytes) -> tuple[list[dict[str, Any]], dict[str, Any], Any]:
    """(samples, session_metadata, empty_reason), refusing what the framework refuses."""
    tensors = st_numpy.load(payload)
    meta_tensor = tensors.pop("_samples_meta")
    assert meta_tensor.ndim == 1 and meta_tensor.dtype == np.uint8
    meta = json.loads(meta_tensor.tobytes().decode("utf-8"))
    samples = []
    for index, sample_meta in enumerate(meta["samples"]):
        nulls = set(sample_meta["nulls"])
        assert nulls <= set(TENSOR_FIELDS)
        sample = {field: sample_meta[field] for field in JSON_FIELDS}
        for field, dtype in TENSOR_FIELDS.items():
            if field in nulls:
                sample[field] = None
                continue
            array = tensors.pop(f"{field}.{index}")
            assert array.dtype == np.dtype(dtype), (field, array.dtype)
            sample[field] = array
        samples.append(sample)
    assert not tensors, f"unreferenced tensors: {sorted(tensors)}"
    return samples, meta["session_metadata"], meta["empty_reason"]


def agent_episode(base_url: str, turns: int) -> str:
    """An OpenAI-style agent loop on `/sessions/{id}/v1`: tool results after tool calls,
    user follow-ups otherwise; the assistant message appended as the API returned it."""
    session_id: str = httpx.post(f"{base_url}/sessions", json={}).json()["session_id"]
    v1 = f"{base_url}/sessions/{session_id}/v1"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a research agent."},
        {"role": "user", "content": "Find the launch date."},
    ]
    with httpx.Client(timeout=30) as client:
        for turn in range(turns):
            reply = client.post(
                f"{v1}/chat/completions",
                json={"model": "policy", "messages": messages, "tools": TOOLS, "max_tokens": 64},
            )
            assert reply.status_code == 200, reply.text
            message = reply.json()["choices"][0]["message"]
            messages.append(message)
            for call in message.get("tool_calls") or []:
                messages.append(
                    {"role": "tool", "tool_call_id": call["id"], "content": f"note {turn}"}
                )
            if not message.get("tool_calls"):
                messages.append({"role": "user", "content": f"Keep going ({turn})."})
    return session_id


def collect_samples(base_url: str, session_id: str, max_seq_len: int | None) -> bytes:
    """The tracer's collect step: samples, then delete (with a `{}` body) whatever happened."""
    url = f"{base_url}/sessions/{session_id}"
    try:
        reply = httpx.post(f"{url}/samples", json={"max_seq_len": max_seq_len}, timeout=30)
        assert reply.status_code == 200, reply.text
        assert reply.headers["content-type"] == "application/octet-stream"
        return reply.content
    finally:
        deleted = httpx.request("DELETE", url, json={}, timeout=30)
        assert deleted.status_code == 204
