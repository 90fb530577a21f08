"""Each SGLang release's rendering rules, rule by rule, against what its wheel does.

Sources (all under `sglang/srt/entrypoints/openai/` of the wheel named in each test):
protocol.py `Function`, `Tool`, `ChatCompletionMessageGenericParam`; serving_chat.py
`_process_messages` (`tools = [item.model_dump() for item in request.tools]`) and
`_apply_jinja_template` (`messages = [msg.model_dump() for msg in request.messages]`, then
null members dropped by sglang/srt/parser/jinja_template_utils.py
`process_content_for_template_format`).

SGLang's protocol.py cannot be imported here (sglang imports torch), so `Function` and
`Tool` of 0.5.16 and 0.5.23 are restated below, field for field and serializer for
serializer as the wheels have them, and `template_tools` is held to their dumps.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

import pytest
from pydantic import BaseModel, Field, ValidationError, model_serializer, model_validator

from sessiongate.sglang_rules import (
    NEWEST,
    OLDEST,
    SGLANG_0_5_16,
    SGLANG_0_5_20,
    SGLANG_0_5_23,
    SglangRules,
    rules_for,
)
from sessiongate.tokenizer import TokenizerError, load_tokenizer
from sessiongate.tokenizer.message_shape import sglang_messages
from sessiongate.tokenizer.tool_schema import template_tools
from support.tool_templates import tokenizer_dir

# --- the models, restated --------------------------------------------------------------

# ruff: noqa: UP045 (Optional kept as the wheels write it)


class Function0516(BaseModel):
    """sglang-0.5.16 protocol.py `Function` (0.5.19, 0.5.20, 0.5.21, 0.5.22: the same)."""

    description: Optional[str] = Field(default=None, examples=[None])
    name: str
    parameters: Optional[object] = None
    strict: bool = False
    defer_loading: Optional[bool] = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> Any:
        data = handler(self)
        if self.defer_loading is None:
            data.pop("defer_loading", None)
        return data


class Tool0516(BaseModel):
    """sglang-0.5.16 protocol.py `Tool` (unchanged in 0.5.23 but for its `Function`)."""

    type: str = Field(default="function", examples=["function"])
    function: Function0516
    defer_loading: Optional[bool] = None

    @model_validator(mode="after")
    def _propagate_defer_loading(self) -> Tool0516:
        if self.defer_loading is not None and self.function.defer_loading is None:
            self.function.defer_loading = self.defer_loading
        return self


class Function0523(BaseModel):
    """sglang-0.5.23 protocol.py `Function`."""

    description: Optional[str] = Field(default=None, examples=[None])
    name: str
    parameters: Optional[object] = None
    strict: Optional[bool] = None
    defer_loading: Optional[bool] = None
    key_order: list[str] = Field(default_factory=list, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _capture_key_order(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = dict(data)
            data["key_order"] = list(data.keys())
        return data

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> Any:
        data = handler(self)
        if self.defer_loading is None:
            data.pop("defer_loading", None)
        if self.strict is None:
            data.pop("strict", None)
        order = self.key_order
        if order:
            rest = [k for k in data if k not in order]
            data = {k: data[k] for k in order + rest if k in data}
        return data


class Tool0523(BaseModel):
    """sglang-0.5.23 protocol.py `Tool`."""

    type: str = Field(default="function", examples=["function"])
    function: Function0523
    defer_loading: Optional[bool] = None

    @model_validator(mode="after")
    def _propagate_defer_loading(self) -> Tool0523:
        if self.defer_loading is not None and self.function.defer_loading is None:
            self.function.defer_loading = self.defer_loading
        return self


RESTATED: dict[SglangRules, type[BaseModel]] = {
    SGLANG_0_5_16: Tool0516,
    SGLANG_0_5_20: Tool0516,
    SGLANG_0_5_23: Tool0523,
}

SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}
TOOLS: list[dict[str, Any]] = [
    SEARCH,
    {"function": {"parameters": {}, "name": "p", "x-vendor": 1}, "cache_control": {}},
    {"function": {"name": "s", "strict": "yes", "description": "d"}},
    {"function": {"name": "off", "strict": False}},
    {"type": "function", "function": {"name": "later"}, "defer_loading": True},
    {"function": {"name": "own", "defer_loading": False}, "defer_loading": True},
]


# --- which rules a version gets --------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "rules"),
    [
        ("0.5.16", SGLANG_0_5_16),
        ("0.5.19", SGLANG_0_5_16),  # read: the 0.5.19 wheel's models are 0.5.16's
        ("0.5.20", SGLANG_0_5_20),
        ("0.5.22", SGLANG_0_5_20),  # read: the 0.5.22 wheel's are 0.5.20's
        ("0.5.22rc1", SGLANG_0_5_20),
        ("0.5.23", SGLANG_0_5_23),
        ("0.5.23.post1", SGLANG_0_5_23),
        ("v0.5.16", SGLANG_0_5_16),
        ("0.6.0", NEWEST),  # newer than any known: the newest rules
    ],
)
def test_a_version_gets_the_rules_of_the_newest_release_not_after_it(
    version: str, rules: SglangRules
) -> None:
    assert rules_for(version) is rules


@pytest.mark.parametrize(
    ("version", "rules"), [("0.4.9", OLDEST), ("nightly", NEWEST), ("0.0.0.dev0", NEWEST)]
)
def test_versions_nobody_read_get_a_warning(
    version: str, rules: SglangRules, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert rules_for(version) is rules
    assert version in caplog.text and rules.label in caplog.text


def test_the_default_is_0_5_23() -> None:
    assert NEWEST is SGLANG_0_5_23
    assert template_tools([SEARCH]) == template_tools([SEARCH], SGLANG_0_5_23)


# --- tools: key order and strict ------------------------------------------------------


@pytest.mark.parametrize("rules", list(RESTATED))
def test_template_tools_is_the_restated_models_dump(rules: SglangRules) -> None:
    expected = [RESTATED[rules].model_validate(tool).model_dump() for tool in TOOLS]
    dumped = template_tools(TOOLS, rules)
    # Equal as JSON text, so key order counts.
    assert json.dumps(dumped) == json.dumps(expected)


def test_0_5_16_lists_description_first_and_writes_strict_false() -> None:
    # sglang-0.5.16 protocol.py `Function`: declaration order, `strict: bool = False`.
    assert template_tools([SEARCH], SGLANG_0_5_16) == [
        {
            "type": "function",
            "function": {
                "description": "Search the web.",
                "name": "search",
                "parameters": SEARCH["function"]["parameters"],
                "strict": False,
            },
            "defer_loading": None,
        }
    ]
    dumped = template_tools([SEARCH], SGLANG_0_5_16)
    assert dumped is not None
    assert list(dumped[0]["function"]) == ["description", "name", "parameters", "strict"]


def test_0_5_23_keeps_the_clients_keys_in_the_clients_order() -> None:
    # sglang-0.5.23 protocol.py `Function._serialize`: `key_order`, strict dropped unset.
    dumped = template_tools([SEARCH], SGLANG_0_5_23)
    assert dumped is not None
    assert list(dumped[0]["function"]) == ["name", "description", "parameters"]


def test_a_null_strict_is_refused_by_0_5_16_and_dropped_by_0_5_23() -> None:
    tool = {"function": {"name": "f", "strict": None}}
    with pytest.raises(ValidationError):
        Tool0516.model_validate(tool)  # the restated model: `strict: bool`
    with pytest.raises(TokenizerError, match=r"tools\[0\]\.function\.strict"):
        template_tools([tool], SGLANG_0_5_16)
    assert template_tools([tool], SGLANG_0_5_23) == [
        {
            "type": "function",
            "function": {"name": "f", "description": None, "parameters": None},
            "defer_loading": None,
        }
    ]


# --- messages: declared members and roles ------------------------------------------------

PHASED = {"role": "assistant", "content": "x", "phase": "commentary", "prefix": True}


@pytest.mark.parametrize(
    ("rules", "kept"),
    [
        # sglang-0.5.16 `ChatCompletionMessageGenericParam`: neither member declared.
        (SGLANG_0_5_16, {"role": "assistant", "content": "x"}),
        # sglang-0.5.20 (and 0.5.21, 0.5.22): `phase` declared, `prefix` not.
        (SGLANG_0_5_20, {"role": "assistant", "content": "x", "phase": "commentary"}),
        # sglang-0.5.23: both declared.
        (SGLANG_0_5_23, PHASED),
    ],
)
def test_members_a_release_does_not_declare_are_dropped(
    rules: SglangRules, kept: dict[str, Any]
) -> None:
    assert sglang_messages([PHASED], rules) == [kept]


@pytest.mark.parametrize("rules", [SGLANG_0_5_16, SGLANG_0_5_20])
def test_the_root_role_is_refused_before_0_5_23(rules: SglangRules) -> None:
    # `_GenericMessageRole` gains "root" in sglang-0.5.23's protocol.py.
    with pytest.raises(TokenizerError, match=r"messages\[0\]: role 'Root'"):
        sglang_messages([{"role": "Root", "content": "x"}], rules)
    assert sglang_messages([{"role": "root", "content": "x"}], SGLANG_0_5_23) == [
        {"role": "root", "content": "x"}
    ]


def test_rules_shared_by_every_release_hold_under_each(
    # null content "", null members dropped, JSON-text arguments parsed, tool parts joined:
    # serving_chat.py and jinja_template_utils.py of 0.5.16 and 0.5.23 alike.
) -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    messages = [
        {"role": "assistant", "content": None, "reasoning_content": None, "tool_calls": [call]},
        {"role": "tool", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    shaped = {rules: sglang_messages(messages, rules) for rules in RESTATED}
    assert shaped[SGLANG_0_5_16] == shaped[SGLANG_0_5_23]
    assert shaped[SGLANG_0_5_16][0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert shaped[SGLANG_0_5_16][1]["content"] == "a b"


# --- the tokenizer renders with the rules it was given ---------------------------------

PRINTS_TOOLS = """\
{%- if tools -%}{{- '<|im_start|>system\\n' + (tools | tojson) + '<|im_end|>\\n' -}}{%- endif -%}
{%- for m in messages -%}
    {{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenizer_dir(tmp_path_factory.mktemp("rules"), PRINTS_TOOLS)


@pytest.mark.parametrize("rules", list(RESTATED))
def test_chat_tokenizer_renders_with_its_rules(directory: Path, rules: SglangRules) -> None:
    tok = load_tokenizer(directory, sglang_rules=rules)
    assert tok.sglang_rules is rules
    hi = [{"role": "user", "content": "hi"}]
    text = tok.render(hi, add_generation_prompt=True, tools=[SEARCH])
    dump = json.dumps([RESTATED[rules].model_validate(SEARCH).model_dump()])
    assert text.startswith(f"<|im_start|>system\n{dump}<|im_end|>\n")


def test_the_builtin_tokenizer_is_one_per_rule_set() -> None:
    assert load_tokenizer(None).sglang_rules is NEWEST
    old = load_tokenizer(None, sglang_rules=SGLANG_0_5_16)
    assert old.sglang_rules is SGLANG_0_5_16
    assert load_tokenizer(None, sglang_rules=SGLANG_0_5_16) is old
