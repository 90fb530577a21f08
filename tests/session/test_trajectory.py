"""Trajectory export: the safetensors container, and a round trip through the real server
that rebuilds every turn's tokens and logprobs from the file."""

from __future__ import annotations

import base64
import json
import random
import struct
from array import array
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sessiongate.demo.verify import completion_ids
from sessiongate.formats.safetensors import (
    SafetensorsError,
    Tensor,
    decode,
    encode_bytes,
    typed,
)
from sessiongate.session.state import TurnRecord
from sessiongate.session.trajectory import build_trajectory
from support.procs import ServerProcess, free_port

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs


@given(
    ints=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=50),
    floats=st.lists(st.floats(width=32, allow_nan=False), max_size=50),
    mask=st.binary(max_size=50),
    meta=st.dictionaries(st.text(max_size=10), st.text(max_size=20), max_size=5),
)
def test_safetensors_round_trip(
    ints: list[int], floats: list[float], mask: bytes, meta: dict[str, str]
) -> None:
    tensors = [
        Tensor("a", "I32", (len(ints),), array("i", ints)),
        Tensor("b", "F32", (len(floats),), array("f", floats)),
        Tensor("c", "U8", (len(mask),), mask),
    ]
    data = encode_bytes(tensors, meta)
    (header_len,) = struct.unpack("<Q", data[:8])
    assert header_len % 8 == 0
    decoded, metadata = decode(data)
    assert metadata == meta
    assert list(typed(decoded["a"])) == ints
    assert list(typed(decoded["b"])) == list(array("f", floats))
    assert bytes(decoded["c"].data) == mask


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00" * 7,
        struct.pack("<Q", 1 << 40) + b"{}",
        struct.pack("<Q", 2) + b"[]",
        struct.pack("<Q", 8) + b'{"x":1}} ',
    ],
)
def test_safetensors_rejects_broken_files(data: bytes) -> None:
    with pytest.raises(SafetensorsError):
        decode(data)


def test_safetensors_checks_shapes() -> None:
    with pytest.raises(SafetensorsError, match="do not fit shape"):
        encode_bytes([Tensor("x", "I32", (3,), b"\x00" * 8)])


@pytest.fixture(scope="module")
def gateway() -> Iterator[ServerProcess]:
    port = free_port()
    with ServerProcess(["serve", "--port", str(port), "--workers", "1", "--r3"], port) as proc:
        yield proc


def test_trajectory_round_trip_rebuilds_every_turn(gateway: ServerProcess) -> None:
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        sid = client.post("/sessions").json()["session_id"]
        messages: list[dict[str, Any]] = [{"role": "user", "content": "start"}]
        for turn in range(5):
            # Alternate natural stops and length cut-offs.
            body = {"messages": messages, "max_tokens": 6 if turn % 2 else 64}
            reply = client.post(f"/sessions/{sid}/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            messages.append(reply.json()["choices"][0]["message"])
            messages.append({"role": "tool", "content": f"result {turn}"})
        records_body = client.get(f"/sessions/{sid}")
        session = records_body.json()
        exported = client.get(f"/sessions/{sid}/trajectory")
    assert exported.status_code == 200
    assert exported.headers["content-type"] == "application/octet-stream"
    tensors, metadata = decode(exported.content)
    token_ids = list(typed(tensors["token_ids"]))
    logprobs = typed(tensors["logprobs"])
    mask = bytes(tensors["loss_mask"].data)
    assert token_ids == session["metadata"]["accumulated_token_ids"]
    turns = json.loads(metadata["turns"])
    assert len(turns) == len(session["records"]) == 5
    sampled = set()
    for record, info in zip(session["records"], turns, strict=True):
        prompt = record["request"]["input_ids"]
        completion = completion_ids(record["response"])
        start, end = info["completion_start"], info["completion_end"]
        assert token_ids[:start] == prompt
        assert token_ids[start:end] == completion
        expected = [
            e[0] for e in record["response"]["choices"][0]["meta_info"]["output_token_logprobs"]
        ]
        assert list(logprobs[start:end]) == list(array("f", expected))
        sampled.update(range(start, end))
    assert [i for i, m in enumerate(mask) if m] == sorted(sampled)
    assert (
        json.loads(metadata["tito_session_mismatch"])
        == session["metadata"]["tito_session_mismatch"]
    )
    # R3 of the last turn covers every token but the last.
    last_meta = session["records"][-1]["response"]["choices"][0]["meta_info"]
    raw = base64.b64decode(last_meta["routed_experts"])
    r3 = tensors["routed_experts"]
    assert r3.shape == (len(token_ids) - 1, 4, 2)
    assert bytes(r3.data) == raw
    assert len(exported.content) < len(records_body.content) / 2


def test_trajectory_of_unknown_or_empty_session(gateway: ServerProcess) -> None:
    assert httpx.get(f"{gateway.url}/sessions/{'0' * 32}/trajectory").status_code == 404
    sid = httpx.post(gateway.url + "/sessions").json()["session_id"]
    tensors, metadata = decode(httpx.get(f"{gateway.url}/sessions/{sid}/trajectory").content)
    assert tensors["token_ids"].shape == (0,) and "routed_experts" not in tensors
    assert metadata["routed_experts"] == "absent"


# -- addition R3: the file does not depend on how the session asked for R3 --------------------

_LAYERS, _TOPK = 2, 3
_WIDTH = _LAYERS * _TOPK


def _r3_record(
    prompt_len: int, completion: list[int], table: array[int], start: int, *, final: bool
) -> TurnRecord:
    """A recorded turn whose reply carries R3 rows [start, prompt_len + completion - 1)."""
    end = prompt_len + len(completion) - 1
    b64 = base64.b64encode(table[start * _WIDTH : end * _WIDTH].tobytes()).decode()
    body = json.dumps({"choices": [{"meta_info": {"routed_experts": b64}}]}).encode()
    at = body.index(b64.encode())
    return TurnRecord(
        timestamp=1.0,
        method="POST",
        path="/v1/chat/completions",
        status_code=200,
        request=b"{}",
        response=body,
        prompt_len=prompt_len,
        completion_ids=array("i", completion),
        logprobs=array("f", [-0.5] * len(completion)),
        finish_reason="stop" if final else "length",
        routed_experts=memoryview(body)[at : at + len(b64)],
        r3_start_row=start,
    )


def _r3_session(
    turns: list[tuple[int, int]], seed: int, *, addition: bool
) -> tuple[list[TurnRecord], list[int], array[int]]:
    """`turns` = (environment tokens before the turn, sampled tokens) per turn."""
    rng = random.Random(seed)
    table = array("i", [rng.randrange(128) for _ in range(4096 * _WIDTH)])
    records: list[TurnRecord] = []
    ids: list[int] = []
    for env, sampled in turns:
        start = max(0, len(ids) - 1) if addition else 0
        ids += [rng.randrange(1000) for _ in range(env)]
        completion = [rng.randrange(1000) for _ in range(sampled)]
        records.append(_r3_record(len(ids), completion, table, start, final=True))
        ids += completion
    return records, ids, table


@given(
    turns=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 20)), min_size=1, max_size=6),
    seed=st.integers(0, 1000),
)
def test_trajectory_is_the_same_with_full_or_addition_r3(
    turns: list[tuple[int, int]], seed: int
) -> None:
    full, ids, table = _r3_session(turns, seed, addition=False)
    addition, ids_again, _ = _r3_session(turns, seed, addition=True)
    assert ids == ids_again
    files = [
        b"".join(build_trajectory("s", records, ids, {}, r3_topk=_TOPK))
        for records in (full, addition)
    ]
    assert files[0] == files[1]
    tensors, metadata = decode(files[0])
    assert metadata["routed_experts"] == "present"
    r3 = tensors["routed_experts"]
    assert r3.shape == (len(ids) - 1, _LAYERS, _TOPK)
    assert bytes(r3.data) == table[: (len(ids) - 1) * _WIDTH].tobytes()


def test_trajectory_notes_a_gap_between_addition_patches() -> None:
    records, ids, table = _r3_session([(5, 4), (3, 4), (2, 2)], 7, addition=True)
    second = records[1]
    records[1] = _r3_record(
        second.prompt_len,
        list(second.completion_ids),
        table,
        second.r3_start_row + 1,
        final=True,
    )
    tensors, metadata = decode(b"".join(build_trajectory("s", records, ids, {}, r3_topk=_TOPK)))
    assert "routed_experts" not in tensors
    assert metadata["routed_experts"].startswith("invalid: additional R3: record 1 starts at row")
    assert list(typed(tensors["token_ids"])) == ids


def test_safetensors_layout_matches_the_reference_writer() -> None:
    np = pytest.importorskip("numpy", reason="numpy (the `test` extra) is not installed")
    st_numpy = pytest.importorskip(
        "safetensors.numpy", reason="safetensors (the `test` extra) is not installed"
    )
    tensors = [
        Tensor("mask", "U8", (3,), b"\x01\x00\x01"),
        Tensor("ids", "I64", (2,), array("q", [5, -6])),
        Tensor("rows", "I32", (1, 3), array("i", [1, 2, 3])),
        Tensor("lp", "F64", (2,), array("d", [-0.5, 0.25])),
        Tensor("f", "F32", (1,), array("f", [1.5])),
    ]
    reference = st_numpy.save(
        {
            "mask": np.array([1, 0, 1], dtype=np.uint8),
            "ids": np.array([5, -6], dtype=np.int64),
            "rows": np.array([[1, 2, 3]], dtype=np.int32),
            "lp": np.array([-0.5, 0.25]),
            "f": np.array([1.5], dtype=np.float32),
        }
    )
    assert encode_bytes(tensors) == reference
