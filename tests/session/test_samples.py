"""Samples assembly (`session/samples.py`) and its wire payload, checked against the rollout
framework's semantics: per-turn samples, trailing-token trim, truncation at turn boundaries,
the pairwise merge, statuses, weight versions, prefix-cache counts, lifecycle metadata and
R3 / indexer rows (full and addition R3 give the same bytes).

Records are built the way the gateway records turns: SGLang-style reply bytes (tokens and
logprobs from the mock engine's generator), with the R3 / indexer base64 as views into them.
The payload is read by a decoder written here from the framework's wire description, and
cross-checked with the real `safetensors` package when it is installed.
"""

from __future__ import annotations

import base64
import json
import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiongate.errors import SamplesError
from sessiongate.mock_engine.generate import CompletionGenerator
from sessiongate.session.r3_rows import ReplayError, session_routed_rows
from sessiongate.session.samples import assemble_samples, build_samples_payload
from sessiongate.session.state import TurnRecord
from sessiongate.session.trajectory import build_trajectory
from sessiongate.tokenizer import load_tokenizer
from support.samples import (
    check_with_safetensors,
    decode_samples_payload,
    read_safetensors,
)

TOKENIZER = load_tokenizer(None)
EOT = TOKENIZER.end_of_turn_token_id
GENERATOR = CompletionGenerator(TOKENIZER, completion_tokens=10, completion_tokens_jitter=4)
LAYERS, TOPK = 3, 2
WIDTH = LAYERS * TOPK

# -- records as the gateway keeps them ------------------------------------------------------


def sglang_reply(
    ids: Sequence[int],
    logprobs: Sequence[float],
    finish: str,
    *,
    prompt_tokens: int,
    routed_experts: bytes | None = None,
    indexer_topk: bytes | None = None,
    indexer_layers: int | None = None,
    weight_version: str | None = "w0",
    cached_tokens: int | None = 0,
    e2e_latency: float | None = 0.25,
) -> bytes:
    """A non-stream SGLang chat reply (return_meta_info, logprobs) as the engine sends it."""
    meta: dict[str, Any] = {
        "id": "req",
        "finish_reason": {"type": "stop" if finish == "tool_calls" else finish},
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(ids),
        "output_token_logprobs": [[lp, i, None] for lp, i in zip(logprobs, ids, strict=True)],
    }
    if e2e_latency is not None:
        meta["e2e_latency"] = e2e_latency
    if cached_tokens is not None:
        meta["cached_tokens"] = cached_tokens
    if weight_version is not None:
        meta["weight_version"] = weight_version
    if routed_experts is not None:
        meta["routed_experts"] = routed_experts.decode()
    if indexer_topk is not None:
        meta["indexer_topk"] = indexer_topk.decode()
    if indexer_layers is not None:
        meta["indexer_topk_num_layers"] = indexer_layers
    body = {
        "id": "req",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": TOKENIZER.decode(ids)},
                "finish_reason": finish,
                "meta_info": meta,
            }
        ],
    }
    return json.dumps(body, separators=(",", ":")).encode()


def string_view(body: bytes, key: str) -> memoryview | None:
    """The JSON string value of `key` as a view into `body` (what the gateway records)."""
    marker = f'"{key}":"'.encode()
    at = body.find(marker)
    if at < 0:
        return None
    start = at + len(marker)
    return memoryview(body)[start : body.index(b'"', start)]


def make_record(
    prompt: Sequence[int],
    ids: Sequence[int],
    logprobs: Sequence[float] | None = None,
    *,
    finish: str = "stop",
    r3_start_row: int = 0,
    timestamp: float = 100.0,
    **reply: Any,
) -> TurnRecord:
    if logprobs is None:
        logprobs = [-0.125 * (k + 1) for k in range(len(ids))]
    request = {"messages": [{"role": "user", "content": "x"}], "input_ids": list(prompt)}
    if r3_start_row:
        request["routed_experts_start_len"] = r3_start_row
    response = sglang_reply(ids, logprobs, finish, prompt_tokens=len(prompt), **reply)
    meta = json.loads(response)["choices"][0]["meta_info"]
    return TurnRecord(
        timestamp=timestamp,
        method="POST",
        path="/v1/chat/completions",
        status_code=200,
        request=json.dumps(request).encode(),
        response=response,
        prompt_len=len(prompt),
        completion_ids=array("i", ids),
        logprobs=array("f", logprobs),
        finish_reason=finish,
        routed_experts=string_view(response, "routed_experts"),
        r3_start_row=r3_start_row,
        indexer_topk=string_view(response, "indexer_topk"),
        request_timestamp=timestamp - 1.0,
        weight_version=meta.get("weight_version"),
        cached_tokens=meta.get("cached_tokens"),
        e2e_latency=meta.get("e2e_latency"),
    )


def rows_table(rows: int, width: int, seed: int) -> array[int]:
    """The rows an engine would route: token r's row is table[r * width:(r + 1) * width]."""
    rng = random.Random(seed)
    return array("i", [rng.randrange(64) for _ in range(rows * width)])


def b64_rows(table: array[int], start: int, end: int, width: int = WIDTH) -> bytes:
    return base64.b64encode(table[start * width : end * width].tobytes())


@dataclass
class Session:
    records: list[TurnRecord]
    accumulated: list[int]
    prompts: list[list[int]]


def build_session(
    turns: int,
    *,
    seed: int = 0,
    r3: str | None = None,
    indexer: bool = False,
    finishes: Sequence[str] = (),
    max_tokens: Sequence[int | None] = (),
) -> Session:
    """A multi-turn session: mock-engine completions, tool results between turns, and the
    TITO prompt of each turn = previous checkpoint + junction + new message + generation
    prompt. `r3`: None, "full" (every turn all rows) or "addition" (each turn its patch)."""
    prompt = TOKENIZER.apply_chat_template(
        [{"role": "user", "content": f"task {seed}"}], add_generation_prompt=True
    )
    records: list[TurnRecord] = []
    prompts: list[list[int]] = []
    checkpoint: list[int] = []
    table = rows_table(4096, WIDTH, seed)
    index_table = rows_table(4096, 4, seed + 1)
    for turn in range(turns):
        if turn:
            junction = [] if checkpoint[-1] == EOT else [EOT]
            tail = f"\n<|im_start|>tool\nresult {seed}-{turn}<|im_end|>\n<|im_start|>assistant\n"
            prompt = [*checkpoint, *junction, *TOKENIZER.encode(tail)]
        limit = max_tokens[turn] if turn < len(max_tokens) else None
        completion = GENERATOR.generate(prompt, request_seed=seed * 100 + turn, max_tokens=limit)
        finish = finishes[turn] if turn < len(finishes) else completion.finish_reason
        end = len(prompt) + len(completion.ids) - 1
        start = max(0, len(checkpoint) - 1) if r3 == "addition" else 0
        reply: dict[str, Any] = {"weight_version": f"w{turn}", "cached_tokens": len(checkpoint)}
        if r3 is not None:
            reply["routed_experts"] = b64_rows(table, start, end)
        if indexer:
            reply["indexer_topk"] = b64_rows(index_table, 0, end, 4)
            reply["indexer_layers"] = 2
        records.append(
            make_record(
                prompt,
                completion.ids,
                completion.logprobs,
                finish=finish,
                r3_start_row=start,
                timestamp=1000.0 + turn,
                **reply,
            )
        )
        prompts.append(list(prompt))
        checkpoint = [*prompt, *completion.ids]
    return Session(records, checkpoint, prompts)


def assemble(
    session: Session,
    *,
    max_seq_len: int | None = None,
    max_trim_tokens: int = 0,
    r3_topk: int = TOPK,
    indexer_topk: int = 0,
) -> dict[str, Any]:
    """Build the payload and decode it with the test's own wire decoder: the one sample."""
    payload = build_samples_payload(
        session.records,
        session.accumulated,
        {"max_trim_tokens": max_trim_tokens, "tito_session_mismatch": []},
        tokenizer=TOKENIZER,
        max_trim_tokens=max_trim_tokens,
        max_seq_len=max_seq_len,
        r3_topk=r3_topk,
        indexer_topk=indexer_topk,
    )
    reply = decode_samples_payload(payload)
    check_with_safetensors(payload, reply)
    assert len(reply["samples"]) == 1, reply["empty_reason"]
    return reply["samples"][0]


# -- the wire, decoded from the framework's description --------------------------------------


def r3_of(sample: dict[str, Any]) -> tuple[tuple[int, ...], list[int]]:
    shape, values = sample["rollout_routed_experts"]
    return shape, list(values)


# -- per-turn samples and the merge -----------------------------------------------------------


def test_single_turn_sample() -> None:
    session = build_session(1, r3="full")
    record = session.records[0]
    sample = assemble(session)
    completion = list(record.completion_ids)
    assert sample["tokens"] == session.accumulated == session.prompts[0] + completion
    assert sample["response_length"] == len(completion)
    assert sample["loss_mask"] == [1] * len(completion)
    # float64 of what the record holds (the record keeps float32)
    assert sample["rollout_log_probs"] == [float(x) for x in record.logprobs]
    assert sample["response"] == TOKENIZER.decode(completion)
    assert sample["status"] == "completed"
    assert sample["weight_versions"] == ["w0"]
    assert sample["prefix_cache_info"] == {
        "cached_tokens": 0,
        "total_prompt_tokens": record.prompt_len,
    }
    # One turn keeps its one lifecycle segment (the framework merges nothing then); it starts
    # the engine's e2e_latency before the record's timestamp (miles/utils/lifecycle.py).
    assert sample["metadata"] == {
        "lifecycle": {"t0": 1000.0 - 0.25, "t1": 1000.0, "turn": 1, "req_ts": 999.0}
    }
    shape = r3_of(sample)[0]
    assert shape == (len(sample["tokens"]) - 1, LAYERS, TOPK)
    assert sample["rollout_indexer_topk"] is None


def test_three_turns_merge_into_one_sample() -> None:
    session = build_session(3, r3="full")
    sample = assemble(session)
    tokens = session.accumulated
    first = session.records[0].prompt_len
    assert sample["tokens"] == tokens
    assert sample["response_length"] == len(tokens) - first
    mask = [0] * len(tokens)
    logprobs = [0.0] * len(tokens)
    for record in session.records:
        end = record.prompt_len + len(record.completion_ids)
        mask[record.prompt_len : end] = [1] * len(record.completion_ids)
        logprobs[record.prompt_len : end] = list(record.logprobs)
    assert sample["loss_mask"] == mask[first:]
    assert sample["rollout_log_probs"] == logprobs[first:]
    # Response text: each turn's completion and each environment span, decoded apiece.
    pieces, at = [], first
    for record in session.records:
        if record.prompt_len > at:
            pieces.append(TOKENIZER.decode(tokens[at : record.prompt_len]))
        at = record.prompt_len + len(record.completion_ids)
        pieces.append(TOKENIZER.decode(tokens[record.prompt_len : at]))
    assert sample["response"] == "".join(pieces)
    assert "result 0-1" in sample["response"] and "result 0-2" in sample["response"]
    assert sample["weight_versions"] == ["w0", "w1", "w2"]
    assert sample["prefix_cache_info"] == {
        "cached_tokens": sum(r.cached_tokens or 0 for r in session.records),
        "total_prompt_tokens": sum(r.prompt_len for r in session.records),
    }
    lifecycle = sample["metadata"]["lifecycle"]
    assert [seg["turn"] for seg in lifecycle] == [1, 2, 3]
    assert "prev_t1" not in lifecycle[0]
    assert [seg["prev_t1"] for seg in lifecycle[1:]] == [1000.0, 1001.0]
    assert [seg["t0"] for seg in lifecycle] == [1000.0 - 0.25, 1001.0 - 0.25, 1002.0 - 0.25]
    # Full R3: the last turn's rows, which cover every token but the last.
    shape, rows = r3_of(sample)
    assert shape == (len(tokens) - 1, LAYERS, TOPK)
    assert rows == list(rows_table(4096, WIDTH, 0)[: (len(tokens) - 1) * WIDTH])


def test_session_metadata_and_empty_session() -> None:
    payload = build_samples_payload(
        [],
        [],
        {"max_trim_tokens": 2},
        tokenizer=TOKENIZER,
        max_trim_tokens=2,
        max_seq_len=None,
        r3_topk=0,
    )
    reply = decode_samples_payload(payload)
    check_with_safetensors(payload, reply)
    assert reply == {
        "samples": [],
        "session_metadata": {"accumulated_token_ids": [], "max_trim_tokens": 2},
        "empty_reason": "no_records",
    }
    session = build_session(2)
    payload = build_samples_payload(
        session.records,
        session.accumulated,
        {"max_trim_tokens": 0, "tito_session_mismatch": [], "extra": 1},
        tokenizer=TOKENIZER,
        max_trim_tokens=0,
        max_seq_len=None,
        r3_topk=0,
    )
    meta = decode_samples_payload(payload)["session_metadata"]
    assert list(meta) == [
        "tito_session_mismatch",
        "accumulated_token_ids",
        "max_trim_tokens",
        "extra",
    ]
    assert meta["accumulated_token_ids"] == session.accumulated


# -- trailing-token trim ----------------------------------------------------------------------

STOP = 99


class FakeDecoder:
    def decode(self, ids: Sequence[int]) -> str:
        return "".join(f"[{i}]" for i in ids)


def trim_session() -> tuple[list[TurnRecord], list[int]]:
    """The framework's worked example: each non-final turn's stop token is consumed by the
    next prompt's template, so the accumulated ids do not contain it."""
    records = [
        make_record([1, 2, 3], [10, STOP], [-0.5, -0.25]),
        make_record([1, 2, 3, 10, 4, 5, 6], [20, STOP], [-0.75, -0.25]),
        make_record([1, 2, 3, 10, 4, 5, 6, 20, 7, 8, 9], [30, STOP], [-1.0, -0.5]),
    ]
    return records, [1, 2, 3, 10, 4, 5, 6, 20, 7, 8, 9, 30, STOP]


def test_trim_trailing_stop_tokens() -> None:
    records, accumulated = trim_session()
    (sample,), reason = assemble_samples(
        records,
        accumulated,
        tokenizer=FakeDecoder(),
        max_trim_tokens=1,
        max_seq_len=None,
        r3_topk=0,
    )
    assert reason is None
    assert list(sample.tokens) == accumulated
    assert list(sample.loss_mask) == [1, 0, 0, 0, 1, 0, 0, 0, 1, 1]
    assert list(sample.rollout_log_probs) == [-0.5, 0, 0, 0, -0.75, 0, 0, 0, -1.0, -0.5]
    assert sample.response == "[10][4][5][6][20][7][8][9][30][99]"
    assert sample.response_length == 10


@pytest.mark.parametrize(
    ("records", "accumulated", "match"),
    [
        (
            [make_record([1, 2], [10, STOP, STOP]), make_record([1, 2, 10, 3, 4], [20])],
            [1, 2, 10, 3, 4, 20],
            "trim_count 2 exceeds allowed=1",
        ),
        (
            [make_record([1, 2], [10, STOP]), make_record([1, 2, 10, 3], [20])],
            [1, 2, 10, 3, 20, 99],
            r"cursor 5 != len\(accumulated_token_ids\) 6",
        ),
        # The last turn never trims: its sampled tokens end the accumulated ids.
        ([make_record([1, 2], [10, STOP])], [1, 2, 10], "trim_count 1 exceeds allowed=0"),
        # No environment tokens between two turns: the framework's merge refuses it.
        (
            [make_record([1, 2], [10]), make_record([1, 2, 10], [20])],
            [1, 2, 10, 20],
            "obs_len must be > 0",
        ),
        ([make_record([1, 2, 3, 4], [10])], [1, 2], "4-token prompt"),
    ],
)
def test_assembly_errors_are_422(
    records: list[TurnRecord], accumulated: list[int], match: str
) -> None:
    with pytest.raises(SamplesError, match=match) as info:
        assemble_samples(
            records,
            accumulated,
            tokenizer=FakeDecoder(),
            max_trim_tokens=1,
            max_seq_len=None,
            r3_topk=0,
        )
    assert info.value.status == 422


# -- truncation at turn boundaries --------------------------------------------------------------


def test_truncation_cuts_the_overflowing_turn_and_drops_later_ones() -> None:
    session = build_session(3, r3="full")
    second = session.records[1]
    limit = second.prompt_len + 2  # two sampled tokens of turn 2 fit
    sample = assemble(session, max_seq_len=limit)
    assert sample["tokens"] == session.accumulated[:limit]
    assert sample["status"] == "truncated"
    assert sample["loss_mask"][-2:] == [1, 1]
    assert (
        len(sample["loss_mask"])
        == sample["response_length"]
        == limit - session.records[0].prompt_len
    )
    shape = r3_of(sample)[0]
    assert shape[0] == limit - 1
    assert sample["weight_versions"] == ["w0", "w1"]
    assert len(sample["metadata"]["lifecycle"]) == 2


def test_truncation_before_a_turns_first_token_keeps_earlier_turns() -> None:
    session = build_session(3)
    limit = session.records[1].prompt_len  # turn 2's prompt fits, none of its output
    sample = assemble(session, max_seq_len=limit)
    first_end = session.records[0].prompt_len + len(session.records[0].completion_ids)
    assert sample["tokens"] == session.accumulated[:first_end]
    assert sample["status"] == "completed"


def test_everything_truncated() -> None:
    session = build_session(2)
    samples, reason = assemble_samples(
        session.records,
        session.accumulated,
        tokenizer=TOKENIZER,
        max_trim_tokens=0,
        max_seq_len=session.records[0].prompt_len,
        r3_topk=0,
    )
    assert samples == [] and reason == "all_truncated"


# -- statuses ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("finish", "status"),
    [("stop", "completed"), ("tool_calls", "completed"), ("length", "truncated"),
     ("abort", "aborted"), ("", "pending")],
)  # fmt: skip
def test_status_of_the_last_turn(finish: str, status: str) -> None:
    session = build_session(2, finishes=["stop", finish])
    assert assemble(session)["status"] == status


@pytest.mark.parametrize(("finish", "status"), [("abort", "aborted"), ("length", "truncated")])
def test_a_turn_that_did_not_complete_ends_the_merge(finish: str, status: str) -> None:
    session = build_session(3, r3="addition", finishes=["stop", finish, "stop"])
    sample = assemble(session)
    second = session.records[1]
    end = second.prompt_len + len(second.completion_ids)
    assert sample["tokens"] == session.accumulated[:end]
    assert sample["status"] == status
    assert sample["weight_versions"] == ["w0", "w1"]
    assert r3_of(sample)[0][0] == end - 1


def test_addition_patches_past_the_merged_tokens_are_not_needed() -> None:
    # The framework's example: a truncated turn bounds the rows, so a later turn without a
    # patch does not matter.
    session = build_session(3, r3="addition", finishes=["stop", "length", "stop"])
    third = session.records[2]
    session.records[2] = make_record(
        session.prompts[2], third.completion_ids, r3_start_row=third.r3_start_row
    )
    sample = assemble(session)
    assert sample["status"] == "truncated"
    rows = len(sample["tokens"]) - 1
    assert r3_of(sample)[1] == list(rows_table(4096, WIDTH, 0)[: rows * WIDTH])


def test_missing_weight_version_is_left_out() -> None:
    session = build_session(2)
    session.records[0] = make_record(
        session.prompts[0], session.records[0].completion_ids, weight_version=None
    )
    assert assemble(session)["weight_versions"] == ["w1"]


def test_lifecycle_t0_is_null_without_the_engine_s_e2e_latency() -> None:
    # miles/utils/lifecycle.py: t0 = timestamp - meta_info.e2e_latency, None when not reported.
    session = build_session(2)
    session.records[0] = make_record(
        session.prompts[0], session.records[0].completion_ids, e2e_latency=None
    )
    lifecycle = assemble(session)["metadata"]["lifecycle"]
    assert [seg["t0"] for seg in lifecycle] == [None, 1001.0 - 0.25]


# -- R3 ---------------------------------------------------------------------------------------


def payload_of(session: Session, max_seq_len: int | None = None) -> bytes:
    return build_samples_payload(
        session.records,
        session.accumulated,
        {"max_trim_tokens": 0},
        tokenizer=TOKENIZER,
        max_trim_tokens=0,
        max_seq_len=max_seq_len,
        r3_topk=TOPK,
    )


def trajectory_of(session: Session) -> bytes:
    parts = build_trajectory("s", session.records, session.accumulated, {}, r3_topk=TOPK)
    return b"".join(parts)


@settings(max_examples=40, deadline=None)
@given(
    turns=st.integers(1, 5),
    seed=st.integers(0, 10_000),
    cut=st.one_of(st.none(), st.integers(1, 400)),
    lengths=st.lists(st.one_of(st.none(), st.integers(1, 12)), max_size=5),
)
def test_full_and_addition_r3_give_the_same_bytes(
    turns: int, seed: int, cut: int | None, lengths: list[int | None]
) -> None:
    full = build_session(turns, seed=seed, r3="full", max_tokens=lengths)
    addition = build_session(turns, seed=seed, r3="addition", max_tokens=lengths)
    assert full.accumulated == addition.accumulated
    if turns > 1:
        assert addition.records[-1].r3_start_row > 0
    assert payload_of(full, cut) == payload_of(addition, cut)
    assert trajectory_of(full) == trajectory_of(addition)
    rows = len(full.accumulated) - 1
    for session in (full, addition):
        replay = session_routed_rows(session.records, rows)
        assert (
            replay is not None
            and bytes(replay.data) == rows_table(4096, WIDTH, seed)[: rows * WIDTH].tobytes()
        )


def test_addition_r3_patches_are_checked() -> None:
    session = build_session(3, r3="addition")
    base = session.records
    table = rows_table(4096, WIDTH, 0)

    def with_record(index: int, **changes: Any) -> Session:
        record = base[index]
        kwargs: dict[str, Any] = {
            "finish": record.finish_reason,
            "r3_start_row": record.r3_start_row,
            "timestamp": record.timestamp,
        }
        end = record.prompt_len + len(record.completion_ids) - 1
        kwargs["routed_experts"] = b64_rows(table, record.r3_start_row, end)
        kwargs.update(changes)
        records = list(base)
        records[index] = make_record(
            session.prompts[index], record.completion_ids, list(record.logprobs), **kwargs
        )
        return Session(records, session.accumulated, session.prompts)

    start = base[1].r3_start_row
    end = base[1].prompt_len + len(base[1].completion_ids) - 1
    cases = [
        (with_record(1, r3_start_row=start - 1), f"record 1 starts at row {start - 1}"),
        (with_record(2, routed_experts=None), "record 2 has no routed_experts payload"),
        (with_record(1, routed_experts=b64_rows(table, start, end - 1)), "not a whole number"),
        (
            with_record(1, routed_experts=base64.b64encode(bytes(4 * 4 * (end - start)))),
            "4 values per row; earlier patches have 6",
        ),
        (with_record(1, routed_experts=b""), "payload presence does not match"),
        (with_record(1, routed_experts=b"AAA*"), "not valid base64"),
    ]
    for broken, match in cases:
        with pytest.raises(SamplesError, match=match):
            payload_of(broken)
        # The trajectory keeps going without R3 and says why.
        header = json.loads(trajectory_of(broken)[8:].split(b"}}", 1)[0] + b"}}")
        assert header["__metadata__"]["routed_experts"].startswith("invalid: ")


def test_full_r3_errors() -> None:
    session = build_session(2, r3="full")
    record = session.records[0]
    short = b64_rows(rows_table(64, WIDTH, 0), 0, record.prompt_len - 1)
    broken = Session(
        [make_record(session.prompts[0], record.completion_ids, routed_experts=short),
         session.records[1]],
        session.accumulated,
        session.prompts,
    )  # fmt: skip
    # Every turn's own payload is checked, even one the merged sample does not use.
    with pytest.raises(SamplesError, match="record 0 routed_experts holds"):
        payload_of(broken)
    with pytest.raises(SamplesError, match="--r3-topk"):
        assemble(session, r3_topk=0)
    with pytest.raises(SamplesError, match="not a multiple of top-k 4"):
        assemble(session, r3_topk=4)


def test_a_turn_without_r3_ends_the_merge_in_full_mode() -> None:
    session = build_session(3, r3="full")
    third = session.records[2]
    session.records[2] = make_record(
        session.prompts[2], third.completion_ids, list(third.logprobs), timestamp=1002.0
    )
    sample = assemble(session)
    second = session.records[1]
    end = second.prompt_len + len(second.completion_ids)
    assert sample["tokens"] == session.accumulated[:end]
    assert r3_of(sample)[0] == (end - 1, LAYERS, TOPK)


def test_session_without_r3_has_null_markers() -> None:
    sample = assemble(build_session(2), r3_topk=0)
    assert sample["rollout_routed_experts"] is None and sample["rollout_indexer_topk"] is None


def test_full_mode_session_rows_pick_the_covering_turn() -> None:
    session = build_session(3, r3="full")
    first_rows = session.records[0].prompt_len + len(session.records[0].completion_ids) - 1
    replay = session_routed_rows(session.records[:1], first_rows)
    assert replay is not None and replay.rows == first_rows and replay.width == WIDTH
    with pytest.raises(ReplayError, match="covers"):
        session_routed_rows(session.records[:1], len(session.accumulated) - 1)


# -- indexer top-k ----------------------------------------------------------------------------


def test_indexer_rows_follow_the_merged_tokens() -> None:
    session = build_session(3, r3="addition", indexer=True)
    sample = assemble(session)
    shape, values = sample["rollout_indexer_topk"]
    rows = len(session.accumulated) - 1
    assert shape == (rows, 2, 2)  # layers from indexer_topk_num_layers, top-k from the size
    assert list(values) == list(rows_table(4096, 4, 1)[: rows * 4])
    limit = session.records[1].prompt_len + 1
    shape, values = assemble(session, max_seq_len=limit)["rollout_indexer_topk"]
    assert shape == (limit - 1, 2, 2)


def test_indexer_layers_from_the_configured_top_k() -> None:
    session = build_session(1, indexer=True)
    record = session.records[0]
    end = record.prompt_len + len(record.completion_ids) - 1
    table = rows_table(4096, 4, 1)
    session.records[0] = make_record(
        session.prompts[0], record.completion_ids, indexer_topk=b64_rows(table, 0, end, 4)
    )
    shape, _ = assemble(session, indexer_topk=1)["rollout_indexer_topk"]
    assert shape == (end, 4, 1)
    with pytest.raises(SamplesError, match="indexer_topk_num_layers"):
        assemble(session)


def test_a_turn_without_indexer_rows_ends_the_merge() -> None:
    session = build_session(2, indexer=True)
    second = session.records[1]
    session.records[1] = make_record(session.prompts[1], second.completion_ids)
    sample = assemble(session)
    first = session.records[0]
    assert sample["tokens"] == session.accumulated[: first.prompt_len + len(first.completion_ids)]
    assert sample["metadata"]["lifecycle"]["turn"] == 1


# -- the wire ---------------------------------------------------------------------------------


def test_payload_matches_the_reference_writer() -> None:
    pytest.importorskip("numpy", reason="numpy (the `test` extra) is needed for this check")
    pytest.importorskip(
        "safetensors", reason="the safetensors package (the `test` extra) is not installed"
    )
    for session in (build_session(3, r3="addition", indexer=True), build_session(1)):
        payload = payload_of(session)
        check_with_safetensors(payload, decode_samples_payload(payload))


def test_wire_layout() -> None:
    payload = payload_of(build_session(2, r3="full"))
    tensors = read_safetensors(payload)
    assert {name: t[0] for name, t in tensors.items()} == {
        "tokens.0": "I64",
        "loss_mask.0": "U8",
        "rollout_log_probs.0": "F64",
        "rollout_routed_experts.0": "I32",
        "_samples_meta": "U8",
    }
    meta = json.loads(tensors["_samples_meta"][2])
    assert list(meta) == ["samples", "session_metadata", "empty_reason"]
    assert list(meta["samples"][0]) == [
        "response",
        "response_length",
        "status",
        "weight_versions",
        "prefix_cache_info",
        "metadata",
        "nulls",
    ]
    assert meta["samples"][0]["nulls"] == ["rollout_indexer_topk"]
    assert b'", "' not in tensors["_samples_meta"][2]  # compact separators
