"""Trainer-ready samples of one session (`POST /sessions/{id}/samples`, docs/samples.md).

The rollout framework's session server assembles these from its records and the trainer's
driver decodes them; this module gives the same samples and the same wire bytes from
sessiongate's `TurnRecord`s, as a pure function (no I/O, no numpy):

1. per turn: tokens = prompt + sampled ids, logprobs, loss mask 1, status from the finish
   reason; sampled tokens the next prompt does not contain (a stop token the template
   renders itself) are trimmed, up to `max_trim_tokens`, never on the last turn;
2. `max_seq_len`: turns are cut at turn boundaries before merging (the overflowing turn
   loses its tail and becomes "truncated", later turns are dropped);
3. merge into one sample: the tokens between two turns (tool results, template) join the
   response with loss mask 0 and logprob 0; merging stops after a turn that is not
   "completed" and before a turn that lacks a replay payload the turns before it had;
4. R3 / indexer top-k rows for the merged tokens (`r3_rows`), full or addition R3 alike.

Every turn's prompt is a prefix of the accumulated ids (TITO builds each prompt on the whole
previous checkpoint), so per-turn token lists are lengths into `accumulated`, not copies.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from sessiongate.errors import SamplesError
from sessiongate.formats.safetensors import Tensor, encode
from sessiongate.session import r3_rows
from sessiongate.session.r3_rows import ReplayError, ReplayRows
from sessiongate.session.state import TurnRecord

SAMPLES_META_KEY = "_samples_meta"
# The wire's tensor fields, in the framework's field order (its `nulls` lists follow it).
TENSOR_FIELDS = (
    "tokens",
    "loss_mask",
    "rollout_log_probs",
    "rollout_routed_experts",
    "rollout_indexer_topk",
)
COMPLETED, TRUNCATED, ABORTED, PENDING = "completed", "truncated", "aborted", "pending"
# The framework's mapping of the choice's finish reason; anything else stays "pending".
_STATUS = {"stop": COMPLETED, "tool_calls": COMPLETED, "length": TRUNCATED, "abort": ABORTED}
_INDEXER_LAYERS_KEY = b'"indexer_topk_num_layers":'


class TokenDecoder(Protocol):
    """What assembly needs from the tokenizer (`ChatTokenizer` is one)."""

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass
class _TurnSample:
    """One record as a per-turn sample: its tokens are `accumulated[:prompt_len + kept]`."""

    index: int
    prompt_len: int
    kept: int  # sampled tokens kept after trimming / truncation
    status: str
    has_r3: bool  # a full-R3 payload of its own (addition patches stay out of turns)
    has_indexer: bool
    lifecycle: dict[str, Any]

    @property
    def length(self) -> int:
        return self.prompt_len + self.kept


@dataclass
class Sample:
    """One assembled sample: the fields the framework's samples wire carries."""

    tokens: Sequence[int]
    response: str
    response_length: int
    loss_mask: bytearray
    rollout_log_probs: array[float]  # typecode "d"
    status: str
    weight_versions: list[str | None] = field(default_factory=list)
    prefix_cache_info: dict[str, int] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    # (rows, layers, topk) int32, rows = len(tokens) - 1
    rollout_routed_experts: tuple[tuple[int, int, int], ReplayRows] | None = None
    rollout_indexer_topk: tuple[tuple[int, int, int], ReplayRows] | None = None
    # Tree mode's wire carries it (the framework's v2 `reward`); None keeps the trainer's.
    reward: float | None = None


def build_samples_payload(
    records: Sequence[TurnRecord],
    accumulated: Sequence[int],
    session_metadata: dict[str, Any],
    *,
    tokenizer: TokenDecoder,
    max_trim_tokens: int,
    max_seq_len: int | None,
    r3_topk: int,
    indexer_topk: int = 0,
) -> bytes:
    """The samples reply of one session: one safetensors payload (`encode_samples` layout).

    Raises `SamplesError` (422) when the records cannot be assembled.
    """
    return b"".join(
        samples_payload_parts(
            records,
            accumulated,
            session_metadata,
            tokenizer=tokenizer,
            max_trim_tokens=max_trim_tokens,
            max_seq_len=max_seq_len,
            r3_topk=r3_topk,
            indexer_topk=indexer_topk,
        )
    )


def samples_payload_parts(
    records: Sequence[TurnRecord],
    accumulated: Sequence[int],
    session_metadata: dict[str, Any],
    *,
    tokenizer: TokenDecoder,
    max_trim_tokens: int,
    max_seq_len: int | None,
    r3_topk: int,
    indexer_topk: int = 0,
) -> list[bytes | memoryview]:
    """`build_samples_payload` as parts to stream (R3 goes out uncopied)."""
    samples, empty_reason = assemble_samples(
        records,
        accumulated,
        tokenizer=tokenizer,
        max_trim_tokens=max_trim_tokens,
        max_seq_len=max_seq_len,
        r3_topk=r3_topk,
        indexer_topk=indexer_topk,
    )
    meta = wire_session_metadata(session_metadata, accumulated, max_trim_tokens)
    return encode_samples(samples, meta, empty_reason)


def wire_session_metadata(
    metadata: dict[str, Any], accumulated: Sequence[int], max_trim_tokens: int
) -> dict[str, Any]:
    """The framework's session metadata (`tito_session_mismatch` when known,
    `accumulated_token_ids`, `max_trim_tokens`, in its order), then any other keys."""
    out: dict[str, Any] = {}
    if metadata.get("tito_session_mismatch") is not None:
        out["tito_session_mismatch"] = metadata["tito_session_mismatch"]
    out["accumulated_token_ids"] = list(accumulated)
    out["max_trim_tokens"] = metadata.get("max_trim_tokens", max_trim_tokens)
    for key, value in metadata.items():
        out.setdefault(key, value)
    return out


# -- assembly ----------------------------------------------------------------------------


def assemble_samples(
    records: Sequence[TurnRecord],
    accumulated: Sequence[int],
    *,
    tokenizer: TokenDecoder,
    max_trim_tokens: int,
    max_seq_len: int | None,
    r3_topk: int,
    indexer_topk: int = 0,
    replay: bool = True,
) -> tuple[list[Sample], str | None]:
    """The session's samples (one merged sample, or none) and the reason when none.

    `replay=False` leaves the R3 / indexer rows out (and unchecked): the tree mode's
    trajectory export picks leaves on such samples and writes its own rows.
    """
    if not records:
        return [], "no_records"
    try:
        turns = _turns(records, accumulated, max_trim_tokens)
        if replay:
            _check_turn_payloads(records, turns, r3_topk, indexer_topk)
        if max_seq_len is not None:
            turns = _truncate(turns, max_seq_len)
        if not turns:
            return [], "all_truncated"
        merged = _merge(turns)
        sample = _materialize(
            records, accumulated, merged, tokenizer, r3_topk, indexer_topk, replay
        )
        return [sample], None
    except ReplayError as exc:
        raise SamplesError(str(exc)) from exc


def _turns(
    records: Sequence[TurnRecord], accumulated: Sequence[int], max_trim_tokens: int
) -> list[_TurnSample]:
    """Per-turn samples, each trimmed of the trailing sampled tokens the accumulated ids do
    not contain (the framework's cursor walk over `accumulated_token_ids`)."""
    turns: list[_TurnSample] = []
    cursor = 0
    total = len(accumulated)
    addition = r3_rows.is_addition(records)
    for index, record in enumerate(records):
        is_last = index == len(records) - 1
        output = record.completion_ids
        if len(record.logprobs) != len(output):
            raise SamplesError(
                f"record {index} has {len(record.logprobs)} logprobs for {len(output)} tokens"
            )
        cursor = record.prompt_len
        if cursor > total:
            raise SamplesError(
                f"record {index} has a {cursor}-token prompt but the session holds "
                f"{total} accumulated tokens"
            )
        matched = _common_prefix(output, accumulated, cursor)
        trim = len(output) - matched
        allowed = 0 if is_last else max_trim_tokens
        if trim > allowed:
            raise SamplesError(
                f"trim_count {trim} exceeds allowed={allowed} (is_last={is_last}, "
                f"max_trim_tokens={max_trim_tokens}); output_ids[-3:]={list(output[-3:])}, "
                f"accumulated[cursor:cursor+3]={list(accumulated[cursor : cursor + 3])}"
            )
        cursor += matched
        turns.append(
            _TurnSample(
                index=index,
                prompt_len=record.prompt_len,
                kept=matched,
                status=_STATUS.get(record.finish_reason, PENDING),
                has_r3=record.routed_experts is not None and not addition,
                has_indexer=record.indexer_topk is not None,
                lifecycle=_lifecycle(record, records[index - 1] if index else None, index + 1),
            )
        )
    if cursor != total:
        raise SamplesError(
            f"cursor {cursor} != len(accumulated_token_ids) {total} after processing all "
            f"{len(records)} records"
        )
    return turns


def _common_prefix(output: Sequence[int], accumulated: Sequence[int], start: int) -> int:
    """How many leading `output` ids equal `accumulated[start:]`."""
    window = accumulated[start : start + len(output)]
    if len(window) == len(output) and list(output) == list(window):
        return len(output)  # the usual case, compared in C
    matched = 0
    for got, want in zip(output, window, strict=False):
        if got != want:
            break
        matched += 1
    return matched


def _lifecycle(record: TurnRecord, previous: TurnRecord | None, turn: int) -> dict[str, Any]:
    """The framework's per-turn timing segment (`attach_lifecycle_metadata`)."""
    # The engine's e2e latency (seconds) gives the segment start; without it t0 is null.
    latency = record.e2e_latency
    t1 = record.timestamp
    segment: dict[str, Any] = {"t0": t1 - latency if latency is not None else None, "t1": t1}
    segment["turn"] = turn
    if record.request_timestamp is not None:
        segment["req_ts"] = record.request_timestamp
    if previous is not None:
        segment["prev_t1"] = previous.timestamp
    return segment


def _check_turn_payloads(
    records: Sequence[TurnRecord], turns: Sequence[_TurnSample], r3_topk: int, indexer_topk: int
) -> None:
    """Every turn's own replay payload must hold whole rows for its untrimmed tokens: the
    framework decodes each one, so a bad payload fails the whole assembly even if the
    merged sample would not use it. Sizes come from the base64 length (nothing decoded)."""
    for turn in turns:
        record = records[turn.index]
        rows = r3_rows.record_rows(record)
        if turn.has_r3 and record.routed_experts is not None:
            what = f"record {turn.index} routed_experts"
            width = r3_rows.check_full_payload(record.routed_experts, rows, what)
            _routed_shape(rows, width, r3_topk, what)
        if record.indexer_topk is not None:
            what = f"record {turn.index} indexer_topk"
            width = r3_rows.check_full_payload(record.indexer_topk, rows, what)
            _indexer_shape(record, rows, width, indexer_topk, what)


def _truncate(turns: list[_TurnSample], max_seq_len: int) -> list[_TurnSample]:
    """Cut at turn boundaries so no turn exceeds `max_seq_len` tokens (prompt included)."""
    kept: list[_TurnSample] = []
    for turn in turns:
        if turn.length <= max_seq_len:
            kept.append(turn)
            continue
        overshoot = turn.length - max_seq_len
        if turn.kept - overshoot <= 0:
            break  # not one sampled token of this turn fits
        turn.kept -= overshoot
        turn.status = TRUNCATED
        kept.append(turn)
        break
    return kept


def _merge(turns: list[_TurnSample]) -> list[_TurnSample]:
    """The turns that merge into one sample, checked like the framework's pairwise merge."""
    merged = [turns[0]]
    for turn in turns[1:]:
        last = merged[-1]
        # Only a completed turn can be extended; a later turn without the replay payload the
        # earlier ones had would leave a gap in the rows, so the sample ends before it.
        if last.status != COMPLETED:
            break
        if (last.has_r3 and not turn.has_r3) or (last.has_indexer and not turn.has_indexer):
            break
        obs_len = turn.prompt_len - last.length
        if obs_len <= 0:
            raise SamplesError(
                f"obs_len must be > 0, got {obs_len} (record {turn.index}'s prompt of "
                f"{turn.prompt_len} tokens does not extend record {last.index}'s "
                f"{last.length} tokens with environment tokens)"
            )
        merged.append(turn)
    return merged


def _materialize(
    records: Sequence[TurnRecord],
    accumulated: Sequence[int],
    merged: list[_TurnSample],
    tokenizer: TokenDecoder,
    r3_topk: int,
    indexer_topk: int,
    replay: bool = True,
) -> Sample:
    first, last = merged[0], merged[-1]
    length = last.length
    response_length = length - first.prompt_len
    loss_mask = bytearray(response_length)
    logprobs = array("d", bytes(8 * response_length))
    texts: list[str] = []
    weight_versions: list[str | None] = []
    cached = prompt_tokens = 0
    at = first.prompt_len  # start of the current span in `accumulated`
    for turn in merged:
        record = records[turn.index]
        if turn.prompt_len > at:  # environment / template tokens since the previous turn
            texts.append(tokenizer.decode(accumulated[at : turn.prompt_len]))
        start, end = turn.prompt_len - first.prompt_len, turn.length - first.prompt_len
        loss_mask[start:end] = b"\x01" * turn.kept
        logprobs[start:end] = array("d", record.logprobs[: turn.kept])
        texts.append(tokenizer.decode(accumulated[turn.prompt_len : turn.length]))
        at = turn.length
        if record.weight_version is not None:
            weight_versions.append(record.weight_version)
        cached += record.cached_tokens or 0
        prompt_tokens += record.prompt_len
    if len(merged) == 1:
        metadata: dict[str, Any] = {"lifecycle": first.lifecycle}
    else:  # merging turns lists their segments (a lone turn keeps its one segment)
        metadata = {"lifecycle": [turn.lifecycle for turn in merged]}
    rows = max(0, length - 1)
    return Sample(
        tokens=accumulated[:length],
        response="".join(texts),
        response_length=response_length,
        loss_mask=loss_mask,
        rollout_log_probs=logprobs,
        status=last.status,
        weight_versions=weight_versions,
        prefix_cache_info={"cached_tokens": cached, "total_prompt_tokens": prompt_tokens},
        metadata=metadata,
        rollout_routed_experts=_merged_routed(records, last, rows, r3_topk) if replay else None,
        rollout_indexer_topk=_merged_indexer(records, last, rows, indexer_topk) if replay else None,
    )


def _merged_routed(
    records: Sequence[TurnRecord], last: _TurnSample, rows: int, r3_topk: int
) -> tuple[tuple[int, int, int], ReplayRows] | None:
    if r3_rows.is_addition(records):
        replay = r3_rows.addition_routed_rows(records, rows)
        what = "additional R3"
    else:
        # Full R3: the merged sample keeps its last turn's rows (the framework's merge).
        record = records[last.index]
        if not last.has_r3 or record.routed_experts is None:
            return None
        what = f"record {last.index} routed_experts"
        replay = r3_rows.full_rows(record.routed_experts, r3_rows.record_rows(record), rows, what)
    if replay is None:
        return None
    return _routed_shape(rows, replay.width, r3_topk, what), replay


def _merged_indexer(
    records: Sequence[TurnRecord], last: _TurnSample, rows: int, indexer_topk: int
) -> tuple[tuple[int, int, int], ReplayRows] | None:
    record = records[last.index]
    if not last.has_indexer or record.indexer_topk is None:
        return None
    what = f"record {last.index} indexer_topk"
    replay = r3_rows.full_rows(record.indexer_topk, r3_rows.record_rows(record), rows, what)
    return _indexer_shape(record, rows, replay.width, indexer_topk, what), replay


def _routed_shape(rows: int, width: int, topk: int, what: str) -> tuple[int, int, int]:
    """(rows, layers, topk): the trainer replays per layer, so a flat row is no use to it."""
    if rows == 0:
        return (0, 0, max(0, topk))
    if topk <= 0:
        raise SamplesError(
            f"{what}: routed experts are present but the MoE top-k is unknown "
            "(start the gateway with --r3-topk K)"
        )
    if width % topk:
        raise SamplesError(f"{what}: {width} values per token are not a multiple of top-k {topk}")
    return (rows, width // topk, topk)


def _indexer_shape(
    record: TurnRecord, rows: int, width: int, topk: int, what: str
) -> tuple[int, int, int]:
    """(rows, layers, topk): layers from the engine's `indexer_topk_num_layers` (what the
    framework reads), else from the configured indexer top-k."""
    if rows == 0:
        return (0, 0, max(0, topk))
    layers = _indexer_layers(record.response)
    if layers is None and topk > 0 and width % topk == 0:
        layers = width // topk
    if layers is None:
        raise SamplesError(
            f"{what}: the reply has no indexer_topk_num_layers and the indexer top-k is "
            "not configured"
        )
    if layers <= 0 or width % layers:
        raise SamplesError(f"{what}: {width} values per token do not split into {layers} layers")
    return (rows, layers, width // layers)


def _indexer_layers(response: bytes) -> int | None:
    """`meta_info.indexer_topk_num_layers` read from the reply bytes without parsing them.

    An unescaped `"name":` cannot occur inside a JSON string, so the first match is the key.
    """
    at = response.find(_INDEXER_LAYERS_KEY)
    if at < 0:
        return None
    at += len(_INDEXER_LAYERS_KEY)
    end = at
    while end < len(response) and response[end] in b" \t\r\n":
        end += 1
    digits = end
    while end < len(response) and 0x30 <= response[end] <= 0x39:
        end += 1
    return int(response[digits:end]) if end > digits else None


# -- wire ----------------------------------------------------------------------------------


def encode_samples(
    samples: Sequence[Sample],
    session_metadata: dict[str, Any],
    empty_reason: str | None,
    *,
    with_reward: bool = False,
) -> list[bytes | memoryview]:
    """The framework's samples wire (`encode_samples`): per sample i the tensors
    `tokens.i` int64, `loss_mask.i` uint8, `rollout_log_probs.i` float64 and, when present,
    `rollout_routed_experts.i` / `rollout_indexer_topk.i` int32; the JSON fields and null
    markers go in `_samples_meta`, a uint8 tensor of compact JSON. `with_reward` adds each
    sample's `reward` after `metadata`, as the framework's tree-serving (v2) wire does."""
    tensors: list[Tensor] = []
    metas: list[dict[str, Any]] = []
    for i, sample in enumerate(samples):
        nulls: list[str] = []
        tokens = array("q", sample.tokens)
        tensors.append(Tensor(f"tokens.{i}", "I64", (len(tokens),), tokens))
        mask = sample.loss_mask
        tensors.append(Tensor(f"loss_mask.{i}", "U8", (len(mask),), mask))
        lps = sample.rollout_log_probs
        tensors.append(Tensor(f"rollout_log_probs.{i}", "F64", (len(lps),), lps))
        for name, replay in (
            ("rollout_routed_experts", sample.rollout_routed_experts),
            ("rollout_indexer_topk", sample.rollout_indexer_topk),
        ):
            if replay is None:
                nulls.append(name)
            else:
                shape, rows = replay
                tensors.append(Tensor(f"{name}.{i}", "I32", shape, rows.data))
        sample_meta: dict[str, Any] = {
            "response": sample.response,
            "response_length": sample.response_length,
            "status": sample.status,
            "weight_versions": sample.weight_versions,
            "prefix_cache_info": sample.prefix_cache_info,
            "metadata": sample.metadata,
        }
        if with_reward:
            sample_meta["reward"] = sample.reward
        sample_meta["nulls"] = nulls
        metas.append(sample_meta)
    meta = {"samples": metas, "session_metadata": session_metadata, "empty_reason": empty_reason}
    text = json.dumps(meta, ensure_ascii=False, separators=(",", ":")).encode()
    tensors.append(Tensor(SAMPLES_META_KEY, "U8", (len(text),), text))
    return encode(tensors)
