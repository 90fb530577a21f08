"""TITO prompt construction with the built-in tokenizer, in process."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiongate.session.errors import TitoMismatch
from sessiongate.session.tito import TitoEngine, compare_token_sequences
from sessiongate.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer(None)
ENGINE = TitoEngine(TOKENIZER)
text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="<>"),
    min_size=1,
    max_size=40,
)


def sampled(content: str, stop: bool = True) -> list[int]:
    """What an engine would sample for `content`: its tokens and the end-of-turn token."""
    ids = TOKENIZER.encode(content)
    return [*ids, ENGINE.end_of_turn_id] if stop else ids


def test_turn_suffix_is_the_newline_after_end_of_turn() -> None:
    assert ENGINE.turn_suffix_ids == TOKENIZER.encode("\n")


@settings(max_examples=60, deadline=None)
@given(
    system=text,
    user=text,
    replies=st.lists(text, min_size=1, max_size=4),
    observations=st.lists(
        st.tuples(st.sampled_from(["tool", "user"]), text), min_size=4, max_size=4
    ),
)
def test_incremental_prompt_equals_full_render(
    system: str, user: str, replies: list[str], observations: list[tuple[str, str]]
) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": user},
    ]
    checkpoint = ENGINE.first_turn_ids(messages, None)
    assert checkpoint == TOKENIZER.apply_chat_template(messages, add_generation_prompt=True)
    for reply, (role, observation) in zip(replies, observations, strict=False):
        checkpoint = checkpoint + sampled(reply)
        assistant = {"role": "assistant", "content": reply}
        appended = [{"role": role, "content": observation}]
        messages += [assistant, *appended]
        prompt = [
            *checkpoint,
            *ENGINE.junction_ids(checkpoint),
            *ENGINE.appended_ids(assistant, appended, None),
        ]
        ENGINE.check_extends(checkpoint, prompt, "s")
        # Token-exact and template-exact: the same ids a full re-render would give, as long
        # as the sampled text tokenizes canonically.
        if all(TOKENIZER.encode(m["content"]) for m in messages):
            assert prompt == TOKENIZER.apply_chat_template(messages, add_generation_prompt=True)
        checkpoint = prompt


def test_length_cut_turn_gets_end_of_turn_inserted() -> None:
    cut = TOKENIZER.encode("partial answer")
    assert ENGINE.junction_ids(cut) == [ENGINE.end_of_turn_id, *ENGINE.turn_suffix_ids]
    assert ENGINE.junction_ids([*cut, ENGINE.end_of_turn_id]) == ENGINE.turn_suffix_ids


def test_tool_calls_render_after_the_assistant_stub() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ids = ENGINE.appended_ids(
        {"role": "assistant", "content": "", "tool_calls": [call]},
        [{"role": "tool", "content": "42"}],
        [{"type": "function", "function": {"name": "f"}}],
    )
    assert TOKENIZER.decode(ids).endswith("<|im_start|>assistant\n")
    assert "42" in TOKENIZER.decode(ids)


def test_check_extends_reports_first_difference() -> None:
    with pytest.raises(TitoMismatch, match="first difference at index 2"):
        ENGINE.check_extends([1, 2, 3, 4], [1, 2, 9, 4, 5], "sess")
    ENGINE.check_extends([1, 2, 3], [1, 2, 3, 4], "sess")
    TitoEngine(TOKENIZER, max_trim_tokens=1).check_extends([1, 2, 3], [1, 2, 7, 8], "sess")


def test_mismatch_classification() -> None:
    messages = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "world"},
    ]
    exact = TOKENIZER.apply_chat_template(messages, add_generation_prompt=False)
    assert ENGINE.mismatches(messages, None, exact[: -len(ENGINE.turn_suffix_ids)]) == []
    other = TOKENIZER.apply_chat_template(
        [messages[0], {"role": "assistant", "content": "planet"}], add_generation_prompt=False
    )
    found = compare_token_sequences(TOKENIZER, exact, other, ENGINE.end_of_turn_id)
    assert [m["type"] for m in found] == ["assistant_text"]
    found = compare_token_sequences(TOKENIZER, exact, exact[:-2], ENGINE.end_of_turn_id)
    assert found[0]["type"] == "special_token_count"
