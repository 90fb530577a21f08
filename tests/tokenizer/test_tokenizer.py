"""Tests for sessiongate.tokenizer: built-in tokenizer, chat template, HF directory loading."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessiongate.tokenizer import (
    BUILTIN_TOKENIZER_DIR,
    ChatTokenizer,
    TokenizerError,
    load_tokenizer,
)
from support.tool_templates import TEMPLATES, tokenizer_dir

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "scripts" / "build_builtin_tokenizer.py"

TOK = load_tokenizer(None)
IM_START = TOK.token_to_id("<|im_start|>")
IM_END = TOK.token_to_id("<|im_end|>")
NL = TOK.encode("\n")[0]
GEN_PROMPT = "<|im_start|>assistant\n"

PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- strategies ----------------------------------------------------------------------------

# Text with the characters that stress the template and BPE boundaries mixed in.
_pieces = st.one_of(
    st.text(max_size=12),
    st.sampled_from(
        [
            "\n",
            "\n\n",
            " ",
            "  ",
            "\t",
            "\r\n",
            "<|im_end|>",
            "<|im_start|>",
            "<tool_call>",
            "</think>",
            '{"a": [1, 2.5, null]}',
            "é",
            "日本語",
            "😀",
            "assistant",
        ]
    ),
)
texts = st.lists(_pieces, max_size=6).map("".join)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)


@st.composite
def tool_calls(draw: st.DrawFn) -> dict[str, Any]:
    args = draw(st.dictionaries(st.text(max_size=6), json_values, max_size=3))
    arguments: Any = (
        json.dumps(args, ensure_ascii=draw(st.booleans())) if draw(st.booleans()) else args
    )
    name = draw(st.from_regex(r"[a-z_]{1,12}", fullmatch=True))
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}


@st.composite
def messages(draw: st.DrawFn) -> dict[str, Any]:
    role = draw(st.sampled_from(["system", "user", "assistant", "tool"]))
    msg: dict[str, Any] = {"role": role, "content": draw(texts)}
    if role == "assistant":
        if draw(st.booleans()):
            msg["tool_calls"] = draw(st.lists(tool_calls(), min_size=1, max_size=2))
            if draw(st.booleans()):
                msg["content"] = None
        if draw(st.integers(0, 4)) == 0:
            msg["reasoning_content"] = draw(texts)
    if role == "user" and draw(st.integers(0, 4)) == 0:
        msg["content"] = [{"type": "text", "text": draw(texts)}, {"type": "text", "text": "x"}]
    if role == "tool":
        msg["tool_call_id"] = "call_1"
    return msg


conversations = st.lists(messages(), min_size=1, max_size=6)
tool_lists = st.none() | st.lists(
    st.builds(
        lambda n, d: {"type": "function", "function": {"name": n, "description": d}},
        st.from_regex(r"[a-z]{1,8}", fullmatch=True),
        texts,
    ),
    min_size=1,
    max_size=2,
)

# --- built-in tokenizer --------------------------------------------------------------------


def test_builtin_basics():
    assert isinstance(TOK, ChatTokenizer)
    assert load_tokenizer(None) is TOK and load_tokenizer("builtin") is TOK
    assert TOK.name_or_path == "builtin"
    assert 4096 <= TOK.vocab_size <= 8192
    assert TOK.eos_token == "<|im_end|>"
    assert TOK.eos_token_id == IM_END == TOK.end_of_turn_token_id
    assert TOK.special_token_ids == frozenset(
        TOK.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    )
    assert TOK.id_to_token(IM_START) == "<|im_start|>"
    assert TOK.token_to_id("no such token") is None
    size = sum(p.stat().st_size for p in BUILTIN_TOKENIZER_DIR.iterdir())
    assert size < 1_000_000


def test_special_and_added_tokens_are_single_ids():
    for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]:
        assert TOK.encode(t) == [TOK.token_to_id(t)]
    for t in [
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
    ]:
        (i,) = TOK.encode(t)
        assert i == TOK.token_to_id(t) and i not in TOK.special_token_ids
    ids = TOK.encode("<|im_start|>x<tool_call>y<|im_end|>")
    assert TOK.decode(ids, skip_special_tokens=True) == "x<tool_call>y"


def test_message_boundary_tokens():
    assert TOK.encode("<|im_end|>\n<|im_start|>") == [IM_END, NL, IM_START]
    assert TOK.generation_prompt_ids == TOK.encode(GEN_PROMPT)
    assert TOK.generation_prompt_ids[0] == IM_START and TOK.generation_prompt_ids[-1] == NL
    text = TOK.render(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there!"}],
        add_generation_prompt=False,
    )
    ids = TOK.encode(text)
    assert ids[-2:] == [IM_END, NL]
    assert ids.count(IM_END) == 2
    # A newline never merges with its neighbours, whatever surrounds it.
    for s in ["a\nb", " \n ", "\n\n\n", "x.\n{", "\nHello"]:
        assert [TOK.decode([i]) for i in TOK.encode(s)].count("\n") == s.count("\n")


def test_generation_prompt_ids_is_a_copy():
    TOK.generation_prompt_ids.append(0)
    assert TOK.generation_prompt_ids == TOK.encode(GEN_PROMPT)


@PROPS
@given(st.text())
def test_roundtrip_any_text(s: str):
    assert TOK.decode(TOK.encode(s)) == s


def test_roundtrip_examples():
    for s in ["", "\x00", "\ud7ff\ue000\U0010ffff", "a\r\nb", "  lead", "trail  ", "日本語 😀 é"]:
        assert TOK.decode(TOK.encode(s)) == s


# --- chat template -------------------------------------------------------------------------


def test_render_layout():
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "w", "arguments": {"city": "Zürich"}}},
                {"type": "function", "function": {"name": "w", "arguments": '{"city":"Bern"}'}},
            ],
        },
        {"role": "tool", "content": "21"},
    ]
    assert TOK.render(msgs, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '\n<tool_call>\n{"name": "w", "arguments": {"city": "Zürich"}}\n</tool_call>'
        # JSON text reaches the template parsed, as under SGLang: the `tojson` spelling.
        '\n<tool_call>\n{"name": "w", "arguments": {"city": "Bern"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n21<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert TOK.render([], add_generation_prompt=False) == ""


def test_render_tools_block():
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Ünïcode"}}]
    user = {"role": "user", "content": "hi"}
    with_system = TOK.render(
        [{"role": "system", "content": "SYS"}, user], add_generation_prompt=False, tools=tools
    )
    assert with_system.startswith("<|im_start|>system\nSYS\n\n# Tools\n")
    # The tool as SGLang's pydantic dump gives it (tests/tokenizer/test_tool_schema.py), not
    # as sent.
    dumped = {
        "type": "function",
        "function": {"name": "get_weather", "description": "Ünïcode", "parameters": None},
        "defer_loading": None,
    }
    assert json.dumps(dumped, ensure_ascii=False) in with_system
    assert with_system.count("<|im_start|>system") == 1
    without_system = TOK.render([user], add_generation_prompt=False, tools=tools)
    assert without_system.startswith("<|im_start|>system\n# Tools\n")
    assert without_system.endswith("<|im_start|>user\nhi<|im_end|>\n")


@PROPS
@given(conversations, tool_lists, st.data())
def test_template_is_append_only(conv: list[dict[str, Any]], tools: Any, data: st.DataObject):
    full = TOK.render(conv, add_generation_prompt=False, tools=tools)
    full_gp = TOK.render(conv, add_generation_prompt=True, tools=tools)
    assert full + GEN_PROMPT == full_gp
    k = data.draw(st.integers(0, len(conv) - 1))
    head = TOK.render(conv[:k], add_generation_prompt=False, tools=tools)
    assert full.startswith(head) and full_gp.startswith(head)
    # Token level (what TITO concatenates): ids of the head, then ids of only the rest.
    assert TOK.encode(head) + TOK.encode(full[len(head) :]) == TOK.encode(full)
    ids = TOK.apply_chat_template(conv, add_generation_prompt=False, tools=tools)
    assert ids == TOK.encode(full)
    assert ids[-2:] == [IM_END, NL]
    assert TOK.apply_chat_template(conv, add_generation_prompt=True, tools=tools) == (
        ids + TOK.generation_prompt_ids
    )


@PROPS
@given(conversations, texts)
def test_sampled_assistant_tokens_match_rerendering(conv: list[dict[str, Any]], content: str):
    # If the engine samples the canonical ids of `content` then <|im_end|>, re-rendering the
    # history with that assistant message reproduces prompt + completion (+ the "\n").
    prompt = TOK.apply_chat_template(conv, add_generation_prompt=True)
    completion = [*TOK.encode(content), IM_END]
    after = TOK.apply_chat_template(
        [*conv, {"role": "assistant", "content": content}], add_generation_prompt=False
    )
    assert after == prompt + completion + [NL]


def test_render_is_thread_safe():
    convs = [
        [
            {"role": "user", "content": f"message {i} " * (i % 7)},
            {"role": "assistant", "content": str(i)},
        ]
        for i in range(200)
    ]
    expected = [TOK.render(c, add_generation_prompt=True) for c in convs]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda c: TOK.render(c, add_generation_prompt=True), convs))
    assert got == expected


@pytest.mark.parametrize(
    ("msgs", "where"),
    [
        ([{"role": "user", "content": "a"}, "user"], "messages[1]"),
        ([{"content": "a"}], "messages[0]"),
        ([{"role": "user", "content": "a"}, {"role": 3}], "messages[1]"),
    ],
)
def test_bad_messages(msgs: list[Any], where: str):
    with pytest.raises(TokenizerError, match=re.escape(where)):
        TOK.render(msgs, add_generation_prompt=True)


def test_bad_messages_container_and_tools():
    with pytest.raises(TokenizerError, match="list"):
        TOK.render({"role": "user"}, add_generation_prompt=True)  # type: ignore[arg-type]
    with pytest.raises(TokenizerError, match="tools"):
        TOK.render([], add_generation_prompt=True, tools={"a": 1})  # type: ignore[arg-type]


def test_caller_messages_not_mutated():
    msgs = [{"role": "user", "content": "hi"}]
    tools = [{"function": {"name": "x"}, "defer_loading": True}]
    snapshot = json.dumps([msgs, tools])
    TOK.render(msgs, add_generation_prompt=True, tools=tools)
    assert json.dumps([msgs, tools]) == snapshot


# --- reproducible build --------------------------------------------------------------------


def test_build_is_reproducible(tmp_path: Path):
    subprocess.run(
        [sys.executable, str(BUILD_SCRIPT), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (BUILTIN_TOKENIZER_DIR / name).read_bytes(), name


# --- loading HF-style directories ----------------------------------------------------------

OTHER_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "[{{ m.role | upper }}] {{ m.content }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
)


def make_hf_dir(path: Path, config: dict[str, Any], jinja: str | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    shutil.copy(BUILTIN_TOKENIZER_DIR / "tokenizer.json", path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja, encoding="utf-8")
    return path


def test_load_hf_dir_with_config_template(tmp_path: Path):
    d = make_hf_dir(
        tmp_path / "m",
        {
            "chat_template": OTHER_TEMPLATE,
            "bos_token": "<|endoftext|>",
            "eos_token": {"content": "<|im_end|>", "special": True, "lstrip": False},
        },
    )
    tok = load_tokenizer(d)
    assert tok.name_or_path == str(d)
    text = tok.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "<|endoftext|>[USER] hi<|im_end|>\n[ASSISTANT] "
    assert tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    ) == tok.encode(text)
    assert tok.eos_token == "<|im_end|>"
    assert tok.end_of_turn_token_id == tok.eos_token_id
    assert tok.generation_prompt_ids == tok.encode("[ASSISTANT] ")
    # Extra template kwargs reach the template.
    tok2 = load_tokenizer(
        make_hf_dir(tmp_path / "k", {"chat_template": "{{ greeting }}", "eos_token": "<|im_end|>"})
    )
    assert tok2.render([], add_generation_prompt=False, greeting="hej") == "hej"


def test_load_hf_dir_with_jinja_file(tmp_path: Path):
    # The .jinja file wins over a config key, as in recent transformers; missing bos is "".
    d = make_hf_dir(
        tmp_path / "m", {"chat_template": "ignored", "eos_token": "<|im_end|>"}, OTHER_TEMPLATE
    )
    tok = load_tokenizer(str(d))
    assert tok.render([{"role": "user", "content": "hi"}], add_generation_prompt=False) == (
        "[USER] hi<|im_end|>\n"
    )


def test_load_hf_dir_named_templates(tmp_path: Path):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    tok = load_tokenizer(
        make_hf_dir(tmp_path / "a", {"chat_template": named, "eos_token": "<|im_end|>"})
    )
    assert tok.render([], add_generation_prompt=False) == "D"
    with pytest.raises(TokenizerError, match="default"):
        load_tokenizer(
            make_hf_dir(tmp_path / "b", {"chat_template": named[:1], "eos_token": "<|im_end|>"})
        )


def test_end_of_turn_derived_from_template(tmp_path: Path):
    # eos is <|endoftext|>, but assistant turns end with <|im_end|>: derive it from the template.
    d = make_hf_dir(
        tmp_path / "m",
        {"chat_template": TOK.chat_template, "eos_token": "<|endoftext|>"},
    )
    tok = load_tokenizer(d)
    assert tok.eos_token_id == tok.token_to_id("<|endoftext|>")
    assert tok.end_of_turn_token_id == IM_END


def test_environment_features(tmp_path: Path):
    template = (
        "{{ messages | tojson(indent=2) }}|{{ strftime_now('%Y') | length }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    tok = load_tokenizer(
        make_hf_dir(tmp_path / "m", {"chat_template": template, "eos_token": "<|im_end|>"})
    )
    msgs = [{"role": "user", "content": "é😀"}, {"role": "user", "content": "second"}]
    assert tok.render(msgs, add_generation_prompt=False) == (
        json.dumps(msgs, ensure_ascii=False, indent=2) + "|4|é😀"
    )


@pytest.mark.parametrize(
    ("config", "jinja", "match"),
    [
        ({"eos_token": "<|im_end|>"}, None, "no chat template"),
        ({"chat_template": "{% if %}", "eos_token": "<|im_end|>"}, None, "does not compile"),
        ({"chat_template": "x"}, None, "no eos_token"),
        ({"chat_template": "x", "eos_token": "<nope>"}, None, "not in its tokenizer vocabulary"),
        ({"eos_token": "<|im_end|>"}, "{% for %}", "chat_template.jinja"),
    ],
)
def test_bad_directories(tmp_path: Path, config: dict[str, Any], jinja: str | None, match: str):
    with pytest.raises(TokenizerError, match=match):
        load_tokenizer(make_hf_dir(tmp_path / "m", config, jinja))


def test_missing_paths(tmp_path: Path):
    with pytest.raises(TokenizerError, match="not found"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(TokenizerError, match="not a directory"):
        load_tokenizer(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match=r"tokenizer\.json is missing"):
        load_tokenizer(tmp_path / "empty")
    d = make_hf_dir(tmp_path / "noconf", {})
    (d / "tokenizer_config.json").unlink()
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json is missing"):
        load_tokenizer(d)
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not readable JSON"):
        load_tokenizer(d)
    (d / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match="could not be loaded"):
        load_tokenizer(d)


def test_templates_that_raise(tmp_path: Path):
    template = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
        "{% if messages[0].content == 'boom' %}{{ messages[0].content.nope() }}{% endif %}"
        "{% if messages[0].content == 'mutate' %}{{ messages.append(1) }}{% endif %}ok"
    )
    tok = load_tokenizer(
        make_hf_dir(tmp_path / "m", {"chat_template": template, "eos_token": "<|im_end|>"})
    )
    assert tok.render([{"role": "user", "content": "x"}], add_generation_prompt=False) == "ok"
    with pytest.raises(TokenizerError, match="first must be user"):
        tok.render([{"role": "system", "content": "x"}], add_generation_prompt=False)
    for content in ("boom", "mutate"):  # an error inside jinja / the sandbox refusing a mutation
        with pytest.raises(TokenizerError, match="failed to render"):
            tok.render([{"role": "user", "content": content}], add_generation_prompt=False)
    # A value of the wrong type (a hostile-input find: `true` where the template loops) is
    # said as such, without the Python class name the client has no use for.
    looping = load_tokenizer(
        make_hf_dir(
            tmp_path / "loop",
            {
                "chat_template": "{% for c in messages[0].content %}{{ c }}{% endfor %}",
                "eos_token": "<|im_end|>",
            },
        )
    )
    with pytest.raises(TokenizerError, match="failed to render: a value of the wrong type") as e:
        looping.render([{"role": "user", "content": True}], add_generation_prompt=False)
    assert "TypeError" not in str(e.value)


def test_non_append_only_generation_prompt_is_reported(tmp_path: Path):
    template = "{% if add_generation_prompt %}A{% else %}B{% endif %}"
    tok = load_tokenizer(
        make_hf_dir(tmp_path / "m", {"chat_template": template, "eos_token": "<|im_end|>"})
    )
    with pytest.raises(TokenizerError, match="append-only"):
        _ = tok.generation_prompt_ids


# --- chat_template_kwargs --------------------------------------------------------------------


def test_builtin_template_honours_enable_thinking():
    conv = [{"role": "user", "content": "hi"}]
    base = TOK.render(conv, add_generation_prompt=True)
    assert base.endswith(GEN_PROMPT)
    for off in ({"enable_thinking": False},):
        assert (
            TOK.render(conv, add_generation_prompt=True, chat_template_kwargs=off)
            == base + "<think>\n\n</think>\n\n"
        )
        assert TOK.render(conv, add_generation_prompt=True, **off) == base + (
            "<think>\n\n</think>\n\n"
        )
        # Only the generation prompt changes: history renders the same, so it stays a suffix.
        assert TOK.render(conv, add_generation_prompt=False, chat_template_kwargs=off) == (
            TOK.render(conv, add_generation_prompt=False)
        )
    # Like Qwen3: only a real false switches thinking off.
    for on in ({"enable_thinking": True}, {"enable_thinking": 0}, {}):
        assert TOK.render(conv, add_generation_prompt=True, chat_template_kwargs=on) == base
    ids = TOK.apply_chat_template(
        conv, add_generation_prompt=True, chat_template_kwargs={"enable_thinking": False}
    )
    assert ids[-6:] == [
        TOK.token_to_id("<think>"),
        NL,
        NL,
        TOK.token_to_id("</think>"),
        NL,
        NL,
    ]


def test_chat_template_kwargs_are_template_variables(tmp_path: Path):
    tok = load_tokenizer(
        make_hf_dir(
            tmp_path / "k",
            {"chat_template": "{{ greeting }}|{{ eos_token }}", "eos_token": "<|im_end|>"},
        )
    )
    kw = {"greeting": "hej", "eos_token": "E"}  # kwargs may override special-token variables
    assert tok.render([], add_generation_prompt=False, chat_template_kwargs=kw) == "hej|E"
    # Python keyword arguments win over the mapping.
    assert (
        tok.render([], add_generation_prompt=False, chat_template_kwargs=kw, greeting="hi")
        == "hi|E"
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ([("a", 1)], "must be an object, got list"),
        ("enable_thinking", "must be an object, got str"),
        ({"tools": []}, "may not set 'tools'"),
        ({"messages": []}, "may not set 'messages'"),
        ({"add_generation_prompt": False}, "may not set 'add_generation_prompt'"),
        ({1: True}, "keys must be strings"),
    ],
)
def test_bad_chat_template_kwargs(kwargs: Any, match: str):
    with pytest.raises(TokenizerError, match=match):
        TOK.render(
            [{"role": "user", "content": "hi"}],
            add_generation_prompt=True,
            chat_template_kwargs=kwargs,
        )


# --- tool-call arguments reach the template as objects ------------------------------------
# SGLang parses an assistant tool call's JSON-text arguments into an object before any Jinja
# template renders (sglang/srt/entrypoints/openai/serving_chat.py
# `normalize_assistant_tool_call_arguments`, strict), and so does the rollout framework
# (miles/utils/chat_template_utils/template.py `normalize_tool_arguments`): templates that
# iterate arguments as a mapping fail on the string the engine returned.

WEATHER_CALL = {"id": "c1", "type": "function", "function": {"name": "weather"}}


def _tool_turn(arguments: Any) -> list[dict[str, Any]]:
    call = {**WEATHER_CALL, "function": {**WEATHER_CALL["function"], "arguments": arguments}}
    return [
        {"role": "user", "content": "Weather in Bern?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
    ]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "qwen3.5-style",
            "<function=weather>\n<parameter=city>\nBern\n</parameter>\n"
            "<parameter=days>\n[1, 2]\n</parameter>\n</function>",
        ),
        (
            "minimax-style",
            '<invoke name="weather"><parameter name="city">Bern</parameter>'
            '<parameter name="days">[1, 2]</parameter></invoke>',
        ),
    ],
)
def test_mapping_templates_render_json_text_arguments(
    tmp_path: Path, name: str, expected: str
) -> None:
    tok = load_tokenizer(tokenizer_dir(tmp_path / name, TEMPLATES[name]))
    text = '{"city": "Bern", "days": [1, 2]}'
    messages = _tool_turn(text)
    rendered = tok.render(messages, add_generation_prompt=True)
    assert expected in rendered
    assert rendered == tok.render(_tool_turn(json.loads(text)), add_generation_prompt=True)
    # The caller's messages (a session's record) keep the engine's text.
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == text


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ('{"city": ', "must be valid JSON"),
        ("", "must be valid JSON"),
        ('{"n": NaN}', "must be valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('"Bern"', "must be a JSON object"),
    ],
)
def test_arguments_that_are_not_a_json_object_are_refused(arguments: str, message: str) -> None:
    with pytest.raises(TokenizerError) as info:
        TOK.render(_tool_turn(arguments), add_generation_prompt=True)
    assert str(info.value) == (
        "messages[1].tool_calls[0].function.arguments: Assistant tool call "
        f"function.arguments {message}."
    )


def test_object_arguments_and_other_roles_pass_through() -> None:
    messages = _tool_turn({"city": "Bern"})
    # A user message's stray tool_calls are not the template's business (SGLang only
    # normalises assistant messages).
    messages[0]["tool_calls"] = [{"function": {"name": "x", "arguments": "not json"}}]
    assert '"arguments": {"city": "Bern"}' in TOK.render(messages, add_generation_prompt=False)
