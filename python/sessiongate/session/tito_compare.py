"""`tito_session_mismatch` as the rollout framework computes it.

The framework compares a session's accumulated ids with a fresh render of its messages
(`add_generation_prompt=False`) using `TokenSeqComparator.compare_sequences`
(miles/utils/chat_template_utils/token_seq_comparator.py; the same class is
miles_tito_tokenizers/comparator.py in PyPI miles-tito-tokenizers 0.1.1), configured per
`--tito-model` family by `TITOTokenizer.create_comparator`
(miles/utils/chat_template_utils/tito_tokenizer.py). `compare_like_framework` is that
comparison, so the report means there what it means here:

- both sequences lose their trailing `trim` ids (the family's `trailing_token_ids`);
- each is cut into segments: every boundary (special) token alone, and each run of other
  ids between them (empty runs are no segment);
- segment counts, or the special/content pattern, differ: one `special_token_count` entry
  and nothing else;
- otherwise each aligned pair: specials with different ids are `special_token_type`; content
  whose *decoded text* differs is `assistant_text` when, in both sequences, the special before
  it decoded plus its first 20 ids decoded starts with the family's assistant start string,
  else `non_assistant_text`. Content with equal text but other ids is no mismatch.

Entries are the framework's `Mismatch.to_dict()`: `type`, `segment_index` (-1 for
`special_token_count`), `expected_text`, `actual_text`, `detail` (text for
`special_token_count`, else None).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["ComparatorSpec", "FrameworkComparator", "compare_like_framework"]

# `_is_assistant_content` decodes this many ids of a segment to find the role label.
_ROLE_PREFIX_IDS = 20


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...


@dataclass(frozen=True)
class ComparatorSpec:
    """A family's comparator settings, by token text (resolved against a tokenizer by
    `TitoEngine`), as `TITOTokenizer.create_comparator` passes them."""

    # `assistant_start_str`: None classifies every content difference as non-assistant (the
    # framework's DEFAULT family passes none).
    assistant_start: str | None = None
    # Boundary tokens when the family names them (`special_token_ids`); None: every special
    # token of the tokenizer (`collect_special_ids`) but `not_boundaries`.
    boundaries: tuple[str, ...] | None = None
    # Special tokens inside a role's turn that must not split it (Kimi's `<|im_middle|>`).
    not_boundaries: tuple[str, ...] = ()
    # `trailing_token_ids`, each text one token: stripped from both tails before comparing.
    trailing: tuple[str, ...] = ()


@dataclass(frozen=True)
class FrameworkComparator:
    """A comparator resolved against one tokenizer's ids."""

    assistant_start: str | None
    special_ids: frozenset[int]
    trim_ids: frozenset[int]


def compare_like_framework(
    decoder: _Decoder,
    comparator: FrameworkComparator,
    expected: Sequence[int],
    actual: Sequence[int],
) -> list[dict[str, Any]]:
    """`TokenSeqComparator.compare_sequences(expected, actual)`, as dicts (module docstring)."""

    def decode(ids: Sequence[int]) -> str:
        return decoder.decode(ids, skip_special_tokens=False)

    specials = comparator.special_ids
    exp_segs = _segments(_trim(expected, comparator.trim_ids), specials)
    act_segs = _segments(_trim(actual, comparator.trim_ids), specials)
    if len(exp_segs) != len(act_segs):
        detail = f"segment count differs: expected {len(exp_segs)}, got {len(act_segs)}"
    elif [s for s, _ in exp_segs] != [s for s, _ in act_segs]:
        detail = "segment structure (special/content pattern) differs"
    else:
        detail = ""
    if detail:
        return [
            _entry(
                "special_token_count",
                -1,
                _structure(decode, exp_segs),
                _structure(decode, act_segs),
                detail,
            )
        ]
    found: list[dict[str, Any]] = []
    for index, ((special, exp_ids), (_, act_ids)) in enumerate(
        zip(exp_segs, act_segs, strict=True)
    ):
        if special:
            if exp_ids != act_ids:
                found.append(
                    _entry("special_token_type", index, decode(exp_ids), decode(act_ids), None)
                )
            continue
        exp_text, act_text = decode(exp_ids), decode(act_ids)
        if exp_text == act_text:
            continue
        start = comparator.assistant_start
        in_assistant = (
            start is not None
            and _opens_with(decode, exp_segs, index, start)
            and _opens_with(decode, act_segs, index, start)
        )
        kind = "assistant_text" if in_assistant else "non_assistant_text"
        found.append(_entry(kind, index, exp_text, act_text, None))
    return found


def _entry(kind: str, index: int, expected: str, actual: str, detail: str | None) -> dict[str, Any]:
    return {
        "type": kind,
        "segment_index": index,
        "expected_text": expected,
        "actual_text": actual,
        "detail": detail,
    }


def _trim(ids: Sequence[int], trim: frozenset[int]) -> list[int]:
    end = len(ids)
    while end and ids[end - 1] in trim:
        end -= 1
    return list(ids[:end])


def _segments(ids: list[int], specials: frozenset[int]) -> list[tuple[bool, list[int]]]:
    """(is_special, ids) runs: each special id alone, non-empty runs of the others."""
    segments: list[tuple[bool, list[int]]] = []
    current: list[int] = []
    for token in ids:
        if token in specials:
            if current:
                segments.append((False, current))
                current = []
            segments.append((True, [token]))
        else:
            current.append(token)
    if current:
        segments.append((False, current))
    return segments


def _opens_with(
    decode: Any, segments: list[tuple[bool, list[int]]], index: int, start: str
) -> bool:
    # `_is_assistant_content`: the special before the segment and the segment's first ids,
    # decoded apart and joined.
    if index == 0 or not segments[index - 1][0]:
        return False
    head = decode(segments[index - 1][1]) + decode(segments[index][1][:_ROLE_PREFIX_IDS])
    return bool(head.startswith(start))


def _structure(decode: Any, segments: list[tuple[bool, list[int]]]) -> str:
    return " ".join(
        f"[{decode(ids)}]" if special else f"({len(ids)} tokens)" for special, ids in segments
    )
