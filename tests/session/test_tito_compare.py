"""`tito_session_mismatch` is the rollout framework's report on the same ids.

The reference below is the framework's comparator, restated: `TokenSeqComparator` in
miles/utils/chat_template_utils/token_seq_comparator.py (PyPI miles-tito-tokenizers 0.1.1:
miles_tito_tokenizers/comparator.py), `compare_sequences` with its `_trim_trailing`,
`segment_by_special_tokens`, `_check_segment_structure`, `_compare_single_segment`,
`_is_assistant_content`, `_describe_structure` and `Mismatch.to_dict`. The package itself is
not a test dependency (it needs transformers and tiktoken); this file is small enough to
keep the comparator's semantics next to the checks.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer

from sessiongate.session.tito import TitoEngine
from sessiongate.session.tito_compare import FrameworkComparator, compare_like_framework
from sessiongate.session.tito_families import FAMILIES as TITO_FAMILIES
from sessiongate.tokenizer import ChatTokenizer, load_tokenizer
from support.family_templates import family_tokenizer_dir


def framework_compare(
    tok: ChatTokenizer,
    expected: Sequence[int],
    actual: Sequence[int],
    *,
    specials: frozenset[int],
    assistant_start: str | None,
    trim: frozenset[int],
) -> list[dict[str, Any]]:
    """TokenSeqComparator(tok, assistant_start, specials, trim).compare_sequences(...),
    as `[m.to_dict() for m in ...]` (the session server's `compute_session_mismatch`)."""

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=False)

    def trim_tail(ids: Sequence[int]) -> list[int]:
        ids = list(ids)
        while ids and ids[-1] in trim:
            ids.pop()
        return ids

    def segment(ids: list[int]) -> list[tuple[list[int], bool]]:
        segs: list[tuple[list[int], bool]] = []
        current: list[int] = []
        for t in ids:
            if t in specials:
                if current:
                    segs.append((current, False))
                    current = []
                segs.append(([t], True))
            else:
                current.append(t)
        if current:
            segs.append((current, False))
        return segs

    def describe(segs: list[tuple[list[int], bool]]) -> str:
        return " ".join(f"[{decode(i)}]" if s else f"({len(i)} tokens)" for i, s in segs)

    def is_assistant(segs: list[tuple[list[int], bool]], idx: int) -> bool:
        if assistant_start is None or segs[idx][1] or idx == 0 or not segs[idx - 1][1]:
            return False
        return (decode(segs[idx - 1][0]) + decode(segs[idx][0][:20])).startswith(assistant_start)

    exp, act = segment(trim_tail(expected)), segment(trim_tail(actual))
    if len(exp) != len(act):
        detail = f"segment count differs: expected {len(exp)}, got {len(act)}"
    elif [s for _, s in exp] != [s for _, s in act]:
        detail = "segment structure (special/content pattern) differs"
    else:
        detail = None
    if detail is not None:
        return [
            {
                "type": "special_token_count",
                "segment_index": -1,
                "expected_text": describe(exp),
                "actual_text": describe(act),
                "detail": detail,
            }
        ]
    out = []
    for idx, ((e, special), (a, _)) in enumerate(zip(exp, act, strict=True)):
        if special:
            if e != a:
                out.append(
                    {
                        "type": "special_token_type",
                        "segment_index": idx,
                        "expected_text": decode(e),
                        "actual_text": decode(a),
                        "detail": None,
                    }
                )
            continue
        if decode(e) == decode(a):
            continue
        kind = (
            "assistant_text"
            if is_assistant(exp, idx) and is_assistant(act, idx)
            else "non_assistant_text"
        )
        out.append(
            {
                "type": kind,
                "segment_index": idx,
                "expected_text": decode(e),
                "actual_text": decode(a),
                "detail": None,
            }
        )
    return out


def same_as_framework(
    tok: ChatTokenizer, comparator: FrameworkComparator, expected: list[int], actual: list[int]
) -> list[dict[str, Any]]:
    ours = compare_like_framework(tok, comparator, expected, actual)
    theirs = framework_compare(
        tok,
        expected,
        actual,
        specials=comparator.special_ids,
        assistant_start=comparator.assistant_start,
        trim=comparator.trim_ids,
    )
    assert ours == theirs
    return ours


def family_engine(tmp_path: Path, name: str, directory: Path | None = None) -> TitoEngine:
    tok = load_tokenizer(directory or family_tokenizer_dir(tmp_path / name, name))
    family = TITO_FAMILIES[name]
    return TitoEngine(
        tok,
        chat_template_kwargs=family.template_kwargs,
        boundary_stop_tokens=family.boundary_stop_tokens,
        end_of_turn_token=family.end_of_turn_token,
        comparator=family.comparator,
    )


def with_double_newline_token(directory: Path) -> Path:
    # Qwen's vocabulary has "\n\n" as one token; the built-in one spells it "\n" "\n".
    path = directory / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    tok.add_tokens([AddedToken("\n\n", normalized=False, special=False)])
    tok.save(str(path))
    return directory


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "<think>\n\n</think>\n\nHello."},
]


def test_qwen35_non_thinking_turn_with_equal_text_is_no_mismatch(tmp_path: Path) -> None:
    # The model samples "\n" "</think>" where the re-render's tokenizer merges "\n\n": other
    # ids, the same text. The framework compares decoded text: nothing to report. The detail
    # still shows the re-tokenization (text_equal true).
    directory = with_double_newline_token(family_tokenizer_dir(tmp_path / "q", "qwen35"))
    engine = family_engine(tmp_path, "qwen35", directory)
    tok = engine.tokenizer
    prompt = engine.first_turn_ids(HISTORY[:2], None)
    pieces = ["<think>\n", "\n", "</think>", "\n\n", "Hello."]
    sampled = [i for piece in pieces for i in tok.encode(piece)] + tok.encode("<|im_end|>")
    accumulated = prompt + sampled
    expected = tok.apply_chat_template(HISTORY, add_generation_prompt=False)
    assert expected[-len(sampled) - 1 : -1] != sampled  # the ids differ ...
    assert tok.decode(expected[:-1]) == tok.decode(accumulated)  # ... the text does not
    report, detail = engine.mismatch_report(HISTORY, None, accumulated)
    assert (
        report == [] == same_as_framework(tok, engine.framework_comparator, expected, accumulated)
    )
    assert [(d["type"], d["text_equal"]) for d in detail] == [("assistant_text", True)]


def test_a_turn_cut_off_before_its_end_is_special_token_count(tmp_path: Path) -> None:
    # No <|im_end|> was sampled: the framework counts a segment less. The detail leaves out
    # what was never sampled.
    engine = family_engine(tmp_path, "qwen3")
    tok = engine.tokenizer
    accumulated = engine.first_turn_ids(HISTORY[:2], None) + tok.encode(HISTORY[2]["content"])
    report, detail = engine.mismatch_report(HISTORY, None, accumulated)
    expected = tok.apply_chat_template(HISTORY, add_generation_prompt=False)
    assert report == same_as_framework(tok, engine.framework_comparator, expected, accumulated)
    assert [m["type"] for m in report] == ["special_token_count"]
    assert report[0]["detail"] == "segment count differs: expected 11, got 10"
    assert detail == []


@pytest.mark.parametrize(
    ("name", "kind", "tail"),
    [("qwen3", "assistant_text", ""), ("default", "non_assistant_text", "\n")],
)
def test_assistant_text_needs_the_familys_assistant_start(
    tmp_path: Path, name: str, kind: str, tail: str
) -> None:
    # The framework's DEFAULT family names no assistant start (every text difference is
    # non-assistant) and trims nothing (`tail`: the "\n" after <|im_end|> must be there).
    directory = family_tokenizer_dir(tmp_path / "chatml", "qwen3")
    engine = family_engine(tmp_path, name, directory)
    tok = engine.tokenizer
    prompt = engine.first_turn_ids(HISTORY[:2], None)
    accumulated = prompt + tok.encode("Hallo.<|im_end|>" + tail)
    history = [*HISTORY[:2], {"role": "assistant", "content": "Hello."}]
    expected = tok.apply_chat_template(history, add_generation_prompt=False)
    found = same_as_framework(tok, engine.framework_comparator, expected, accumulated)
    assert found == engine.mismatches(history, None, accumulated)
    assert [(m["type"], m["expected_text"], m["actual_text"]) for m in found] == [
        (kind, "assistant\nHello.", "assistant\nHallo.")
    ]
    assert found[0]["segment_index"] == 9 and found[0]["detail"] is None


def test_the_default_family_counts_the_unsampled_newline(tmp_path: Path) -> None:
    # A ChatML turn that stopped at <|im_end|> lacks the "\n" the template renders after
    # it; the framework's DEFAULT family trims nothing, so its report is special_token_count.
    engine = family_engine(tmp_path, "default", family_tokenizer_dir(tmp_path / "c", "qwen3"))
    tok = engine.tokenizer
    accumulated = engine.first_turn_ids(HISTORY[:2], None) + tok.encode(
        HISTORY[2]["content"] + "<|im_end|>"
    )
    report, detail = engine.mismatch_report(HISTORY, None, accumulated)
    assert [m["type"] for m in report] == ["special_token_count"]
    assert detail == []  # the detail drops only what was never sampled


def test_kimis_im_middle_does_not_split_a_turn(tmp_path: Path) -> None:
    # Kimi families leave <|im_middle|> out of the boundaries, so the assistant's text is
    # one segment after <|im_assistant|>, which the assistant start names.
    engine = family_engine(tmp_path, "kimi26")
    tok = engine.tokenizer
    assert tok.token_to_id("<|im_middle|>") not in engine.framework_comparator.special_ids
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    prompt = engine.first_turn_ids(history[:1], None)
    accumulated = prompt + tok.encode("Hallo.<|im_end|>")
    expected = tok.apply_chat_template(history, add_generation_prompt=False)
    found = same_as_framework(tok, engine.framework_comparator, expected, accumulated)
    assert [m["type"] for m in found] == ["assistant_text"]
    assert found[0]["actual_text"].startswith("assistant<|im_middle|>")
    assert found[0]["actual_text"].endswith("Hallo.")


def test_without_a_family_the_comparator_comes_from_the_template(tmp_path: Path) -> None:
    for name in ("qwen3", "kimi26", "minimax_m25", "glm47"):
        directory = family_tokenizer_dir(tmp_path / name, name)
        family = TITO_FAMILIES[name]
        derived = TitoEngine(
            load_tokenizer(directory), boundary_stop_tokens=family.boundary_stop_tokens
        ).framework_comparator
        pinned = family_engine(tmp_path, name, directory).framework_comparator
        assert (derived.special_ids, derived.trim_ids) == (pinned.special_ids, pinned.trim_ids)
        # The template's header may run on (Kimi's generation prompt opens the reasoning).
        assert (derived.assistant_start or "").startswith(pinned.assistant_start or ""), name


def test_random_sequences_give_the_frameworks_report(tmp_path: Path) -> None:
    engine = family_engine(tmp_path, "qwen3")
    tok = engine.tokenizer
    alphabet = [
        *(tok.token_to_id(t) or 0 for t in ("<|im_start|>", "<|im_end|>")),
        *tok.encode("assistant\nuser\n hello world 42"),
    ]
    rng = random.Random(7)
    for _ in range(400):
        expected = [rng.choice(alphabet) for _ in range(rng.randrange(12))]
        actual = list(expected)
        for _ in range(rng.randrange(3)):  # a few edits keep most pairs aligned
            if actual and rng.random() < 0.5:
                actual[rng.randrange(len(actual))] = rng.choice(alphabet)
            else:
                actual.insert(rng.randrange(len(actual) + 1), rng.choice(alphabet))
        same_as_framework(tok, engine.framework_comparator, expected, actual)


def test_families_compare_with_the_frameworks_settings() -> None:
    # miles/utils/chat_template_utils/tito_tokenizer.py: each TITOTokenizer subclass's
    # `_default_assistant_start_str` / `_DEFAULT_ASSISTANT_START`, `special_token_ids` and
    # `trailing_token_ids`.
    settings = {
        name: (f.comparator.assistant_start, f.comparator.boundaries, f.comparator.trailing)
        for name, f in TITO_FAMILIES.items()
    }
    qwen = ("<|im_start|>assistant", None, ("\n",))
    DS_ROLES = ("<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>")
    assert settings == {
        "default": (None, None, ()),
        "qwen3": qwen,
        "qwen35": qwen,
        "qwennext": qwen,
        "nemotron3": ("<|im_start|>assistant\n", None, ("\n",)),
        "kimi25": ("<|im_assistant|>", None, ()),
        "kimi26": ("<|im_assistant|>", None, ()),
        "minimax_m25": ("]~b]ai", None, ("\n",)),
        "minimax_m27": ("]~b]ai", None, ("\n",)),
        "glm47": ("<|assistant|>", None, ("<|observation|>", "<|user|>")),
        # DeepSeekV32/V4TITOTokenizer: `special_token_ids` are the two role tokens only.
        "deepseekv32": ("<\uff5cAssistant\uff5c>", DS_ROLES, ()),
        "deepseekv4": ("<\uff5cAssistant\uff5c>", DS_ROLES, ()),
        "inkling": (
            "<|message_model|>",
            ("<|message_user|>", "<|message_model|>", "<|message_system|>", "<|message_tool|>"),
            (),
        ),
    }
    assert {n for n, f in TITO_FAMILIES.items() if f.comparator.not_boundaries} == {
        "kimi25",
        "kimi26",
    }
