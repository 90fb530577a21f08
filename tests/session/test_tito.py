"""TITO prompt construction with the built-in tokenizer, in process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiongate.errors import BadRequest, TitoMismatch
from sessiongate.session.tito import (
    TitoEngine,
    compare_token_sequences,
    merge_chat_template_kwargs,
    parse_chat_template_kwargs,
)
from sessiongate.session.tito_families import FAMILIES as TITO_FAMILIES
from sessiongate.tokenizer import ChatTokenizer, load_tokenizer
from support.family_templates import FAMILIES, family_tokenizer_dir
from support.tool_templates import TEMPLATES, tokenizer_dir

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


# --- chat_template_kwargs --------------------------------------------------------------------

NO_THINK = TOKENIZER.encode("<think>\n\n</think>\n\n")
USER = [{"role": "user", "content": "hello"}]


def test_enable_thinking_changes_the_generation_prompt() -> None:
    plain = ENGINE.first_turn_ids(USER, None)
    assert ENGINE.first_turn_ids(USER, None, {"enable_thinking": True}) == plain
    assert ENGINE.first_turn_ids(USER, None, {"enable_thinking": False}) == [*plain, *NO_THINK]
    stub = {"role": "assistant", "content": "hi"}
    appended = [{"role": "user", "content": "more"}]
    later = ENGINE.appended_ids(stub, appended, None)
    off = ENGINE.appended_ids(stub, appended, None, {"enable_thinking": False})
    assert off == [*later, *NO_THINK]


def test_request_kwargs_override_the_server_default() -> None:
    engine = TitoEngine(TOKENIZER, chat_template_kwargs={"enable_thinking": False, "k": 1})
    assert engine.resolve_chat_template_kwargs(None) == {"enable_thinking": False, "k": 1}
    assert engine.resolve_chat_template_kwargs({}) == {"enable_thinking": False, "k": 1}
    on = engine.resolve_chat_template_kwargs({"enable_thinking": True})
    assert on == {"enable_thinking": True, "k": 1}
    plain = ENGINE.first_turn_ids(USER, None)
    # No kwargs given: the server's defaults apply.
    assert engine.first_turn_ids(USER, None) == [*plain, *NO_THINK]
    assert engine.first_turn_ids(USER, None, on) == plain
    assert merge_chat_template_kwargs({"a": 1, "b": 2}, {"b": 3}) == {"a": 1, "b": 3}


@pytest.mark.parametrize("bad", [[], ["enable_thinking"], "enable_thinking=false", 0, True])
def test_non_object_chat_template_kwargs_is_a_bad_request(bad: object) -> None:
    with pytest.raises(BadRequest, match="chat_template_kwargs must be an object"):
        ENGINE.resolve_chat_template_kwargs(bad)
    with pytest.raises(BadRequest, match="chat_template_kwargs must be an object"):
        parse_chat_template_kwargs(bad)


@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt"])
def test_kwargs_may_not_replace_the_request(key: str) -> None:
    with pytest.raises(BadRequest, match=f"may not set '{key}'"):
        ENGINE.resolve_chat_template_kwargs({key: []})
    with pytest.raises(ValueError, match=f"may not set '{key}'"):
        TitoEngine(TOKENIZER, chat_template_kwargs={key: []})


# Turn separator chosen by a template variable: the junction must follow it.
SEPARATOR_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>' -}}"
    "{{- sep if sep is defined else '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def test_turn_suffix_is_cached_per_kwargs() -> None:
    tok = ChatTokenizer(
        TOKENIZER.backend,
        chat_template=SEPARATOR_TEMPLATE,
        eos_token="<|im_end|>",
        name_or_path="separator-test",
    )
    engine = TitoEngine(tok)
    stop = [*tok.encode("answer"), engine.end_of_turn_id]
    assert engine.junction_ids(stop) == tok.encode("\n")
    wide = {"sep": "\n\n"}
    assert engine.junction_ids(stop, wide) == tok.encode("\n\n")
    assert engine.junction_ids(stop[:-1], wide) == [engine.end_of_turn_id, *tok.encode("\n\n")]
    assert engine.junction_ids(stop) == tok.encode("\n")  # the default is not overwritten
    # Incremental prompt == full render under the same kwargs.
    messages = [{"role": "user", "content": "q"}]
    first = engine.first_turn_ids(messages, None, wide)
    reply = {"role": "assistant", "content": "answer"}
    appended = [{"role": "user", "content": "again"}]
    checkpoint = [*first, *stop]
    prompt = [
        *checkpoint,
        *engine.junction_ids(checkpoint, wide),
        *engine.appended_ids(reply, appended, None, wide),
    ]
    full = [*messages, reply, *appended]
    assert prompt == tok.apply_chat_template(
        full, add_generation_prompt=True, chat_template_kwargs=wide
    )
    assert engine.mismatches([*messages, reply], None, checkpoint, wide) == []
    assert engine.mismatches([*messages, reply], None, checkpoint) != []


# Templates that iterate tool-call arguments as a mapping (Qwen3.5, MiniMax): the session
# records the engine's JSON text, the template gets the object, and the incremental prompt
# still equals a full render of the history, token for token.
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_tool_turn_on_mapping_templates_is_token_exact(tmp_path: Path, name: str) -> None:
    tokenizer = load_tokenizer(tokenizer_dir(tmp_path / name, TEMPLATES[name]))
    engine = TitoEngine(tokenizer)
    arguments = '{"city": "Zürich", "days": [1, 2], "units": {"t": "C"}}'
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": arguments}}
    assistant = {"role": "assistant", "content": "", "tool_calls": [call]}
    history: list[dict[str, Any]] = [{"role": "user", "content": "Weather?"}]
    checkpoint = engine.first_turn_ids(history, None)
    # The engine samples the tool-call text the template would render for the call.
    without = tokenizer.render(history, add_generation_prompt=True)
    with_call = tokenizer.render([*history, assistant], add_generation_prompt=False)
    reply = with_call[len(without) :].removesuffix("\n")
    checkpoint += [*tokenizer.encode(reply.removesuffix("<|im_end|>")), engine.end_of_turn_id]
    appended = [{"role": "tool", "tool_call_id": "c1", "content": "21"}]
    prompt = [
        *checkpoint,
        *engine.junction_ids(checkpoint),
        *engine.appended_ids(assistant, appended, None),
    ]
    assert engine.mismatches([*history, assistant], None, checkpoint) == []
    history += [assistant, *appended]
    assert prompt == tokenizer.apply_chat_template(history, add_generation_prompt=True)
    assert call["function"]["arguments"] == arguments  # the record's text is untouched


# --- mismatch labels on templates whose assistant header is not "<|im_start|>assistant" -----


def _family_tokenizer(tmp_path: Path, name: str) -> ChatTokenizer:
    if name in FAMILIES:
        return load_tokenizer(family_tokenizer_dir(tmp_path / name, name))
    return load_tokenizer(tokenizer_dir(tmp_path / name, TEMPLATES[name]))


@pytest.mark.parametrize("name", [*sorted(FAMILIES), "minimax-style"])
def test_assistant_differences_are_labelled_assistant_text(tmp_path: Path, name: str) -> None:
    # Kimi opens an assistant turn with <|im_assistant|>...<|im_middle|> and MiniMax with
    # "]~b]ai" (or "ai" after <|im_start|>): no segment starts with the word "assistant",
    # and the framework treats non_assistant_text as a hard failure.
    tok = _family_tokenizer(tmp_path, name)
    # GLM 4.7 closes no turn: its turns start at role tokens (TitoEngine.turn_openers).
    family = TITO_FAMILIES.get(name)
    engine = TitoEngine(tok, boundary_stop_tokens=family.boundary_stop_tokens if family else ())
    openers = engine.turn_openers
    user = {"role": "user", "content": "hello"}
    exact = tok.apply_chat_template(
        [user, {"role": "assistant", "content": "world"}], add_generation_prompt=False
    )
    other = tok.apply_chat_template(
        [user, {"role": "assistant", "content": "planet"}], add_generation_prompt=False
    )
    found = compare_token_sequences(tok, exact, other, engine.end_of_turn_id, turn_openers=openers)
    assert [m["type"] for m in found] == ["assistant_text"]
    # A user's text is still non-assistant text.
    other_user = tok.apply_chat_template(
        [{"role": "user", "content": "howdy"}, {"role": "assistant", "content": "world"}],
        add_generation_prompt=False,
    )
    found = compare_token_sequences(
        tok, exact, other_user, engine.end_of_turn_id, turn_openers=openers
    )
    assert [m["type"] for m in found] == ["non_assistant_text"]


def test_assistant_header_is_derived_from_the_template(tmp_path: Path) -> None:
    assert TOKENIZER.assistant_header == "<|im_start|>assistant"
    assert _family_tokenizer(tmp_path, "minimax_m25").assistant_header == "]~b]ai"
    kimi = _family_tokenizer(tmp_path, "kimi26").assistant_header
    assert kimi.startswith("<|im_assistant|>assistant<|im_middle|>")
    # A template whose only role marker is shared by every role cannot tell them apart.
    shared = ChatTokenizer(
        TOKENIZER.backend,
        chat_template="{%- for m in messages -%}<|im_start|>{{ m.content }}<|im_end|>"
        "{%- endfor -%}{%- if add_generation_prompt -%}<|im_start|>{%- endif -%}",
        eos_token="<|im_end|>",
        name_or_path="shared-marker",
    )
    assert shared.assistant_header == ""
