"""--tito-model: per-family TITO defaults, and a short agent session per supported family
rendered with a template in that family's style (tests/support/family_templates.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sessiongate.cli import build_parser
from sessiongate.config.gateway import GatewayConfig
from sessiongate.errors import BadRequest
from sessiongate.server.serve import serve_config, serve_core_config
from sessiongate.session.core_config import worker_config
from sessiongate.session.settings import SessionSettings
from sessiongate.session.tito import TitoEngine
from sessiongate.session.tito_families import FAMILIES as TITO_FAMILIES
from sessiongate.session.tito_families import TitoFamily
from sessiongate.tokenizer import ChatTokenizer, load_tokenizer
from support.family_templates import FAMILIES, family_tokenizer_dir


def serve_args(*argv: str) -> GatewayConfig:
    return serve_config(build_parser().parse_args(["serve", *argv]))


def settings(*argv: str) -> SessionSettings:
    return serve_core_config(serve_args(*argv)).settings


def test_without_a_family_the_defaults_are_unchanged() -> None:
    s = settings()
    assert s.allowed_append_roles == {"tool", "user"}
    assert s.max_trim_tokens == 0
    assert dict(s.chat_template_kwargs) == {}


@pytest.mark.parametrize(
    ("name", "kwargs", "roles"),
    [
        # The widest of the framework's rows for the family (miles_tito_tokenizers
        # tokenizer.py SUPPORTED_TEMPLATES).
        ("qwen3", {"clear_thinking": False}, {"tool", "user"}),
        ("qwen35", {"clear_thinking": False}, {"tool", "user"}),
        ("kimi26", {"preserve_thinking": True}, {"tool", "user"}),
        # MiniMax's template renders only a leading system message: a later one would vanish.
        ("minimax_m25", {"clear_thinking": False}, {"tool", "user"}),
        ("nemotron3", {"truncate_history_thinking": False}, {"tool", "user", "system"}),
        ("deepseekv4", {}, {"tool"}),
    ],
)
def test_a_family_sets_its_defaults(name: str, kwargs: dict[str, Any], roles: set[str]) -> None:
    s = settings("--tito-model", name)
    assert dict(s.chat_template_kwargs) == kwargs
    assert s.allowed_append_roles == roles
    assert s.max_trim_tokens == 0


def test_explicit_flags_win_over_the_family() -> None:
    s = settings(
        "--tito-model",
        "nemotron3",
        "--allowed-append-roles",
        "tool,user,system",
        "--max-trim-tokens",
        "2",
        "--chat-template-kwargs",
        '{"clear_thinking": true, "x": 1}',
    )
    assert s.allowed_append_roles == {"tool", "user", "system"}
    assert s.max_trim_tokens == 2
    assert dict(s.chat_template_kwargs) == {
        "truncate_history_thinking": False,
        "clear_thinking": True,
        "x": 1,
    }


def test_the_roles_pick_the_frameworks_row_and_its_template() -> None:
    # resolve_fixed_chat_template: the smallest row covering the roles. MiniMax's tool row is
    # the stock template with nothing pinned; its tool+user row the fixed template.
    tool_only = serve_core_config(
        serve_args("--tito-model", "minimax_m25", "--allowed-append-roles", "tool")
    )
    assert tool_only.chat_template_path is None
    assert dict(tool_only.settings.chat_template_kwargs) == {}
    with_user = serve_core_config(serve_args("--tito-model", "minimax_m25"))
    assert Path(with_user.chat_template_path or "").name == "minimax_m25_fixed.jinja"
    assert dict(with_user.settings.chat_template_kwargs) == {"clear_thinking": False}
    # A template given wins over the row's.
    given = serve_core_config(serve_args("--tito-model", "qwen3", "--chat-template-path", __file__))
    assert given.chat_template_path == __file__


@pytest.mark.parametrize(
    ("name", "roles"),
    [("minimax_m25", "tool,user,system"), ("qwen3", "tool,user,assistant"), ("deepseekv4", "user")],
)
def test_roles_no_row_covers_are_refused_at_start(name: str, roles: str) -> None:
    with pytest.raises(SystemExit, match=rf"--allowed-append-roles: the {name} family keeps"):
        settings("--tito-model", name, "--allowed-append-roles", roles)


def test_workers_are_started_with_the_family_and_the_resolved_values() -> None:
    args = serve_args("--tito-model", "qwen35")
    core = serve_core_config(args)
    sessions = worker_config(args, core.engine_urls, local_workers=1).sessions
    assert sessions.tito_model == "qwen35"
    # Resolved in the configuration the workers get (serve resolves these two itself).
    assert sessions.allowed_append_roles == "tool,user"
    assert sessions.max_trim_tokens == 0


def test_unknown_names_are_clear_errors() -> None:
    with pytest.raises(SystemExit, match=r"unknown model family 'qwen9'.*known: default, qwen3"):
        settings("--tito-model", "qwen9")


@pytest.mark.parametrize(
    ("name", "encoder"), [("deepseekv32", "deepseek_v32"), ("deepseekv4", "deepseek_v4")]
)
def test_deepseek_families_render_with_their_encoder(name: str, encoder: str) -> None:
    core = serve_core_config(serve_args("--tito-model", name))
    assert (core.prompt_encoder, core.chat_template_path) == (encoder, None)
    # A template given replaces the encoder.
    given = serve_core_config(serve_args("--tito-model", name, "--chat-template-path", __file__))
    assert given.prompt_encoder is None


def _row_kwargs(family: TitoFamily) -> dict[str, Any]:
    return dict(family.template_kwargs)


# --- a short agent session per family -----------------------------------------------------

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]


def _sample(
    tok: ChatTokenizer,
    engine: TitoEngine,
    history: list[dict[str, Any]],
    reply: dict[str, Any],
    kwargs: dict[str, Any],
) -> list[int]:
    """The ids an engine samples for `reply`: the text the template renders for it after the
    generation prompt, through the end-of-turn token."""
    prompt = tok.render(
        history, add_generation_prompt=True, tools=TOOLS, chat_template_kwargs=kwargs
    )
    full = tok.render(
        [*history, reply], add_generation_prompt=False, tools=TOOLS, chat_template_kwargs=kwargs
    )
    assert full.startswith(prompt)
    ids = tok.encode(full[len(prompt) :])
    if engine.boundary_stop_ids:
        # GLM 4.7 closes no turn: the model stops at the token that opens what follows, an
        # observation after a tool call, else a user turn.
        stop = "<|observation|>" if reply.get("tool_calls") else "<|user|>"
        return [*ids, tok.token_to_id(stop)]
    return ids[: ids.index(engine.end_of_turn_id) + 1]


def run_agent_session(
    name: str, tok: ChatTokenizer, kwargs: dict[str, Any], sampled_with: dict[str, Any]
) -> tuple[bool, list[dict[str, Any]]]:
    """system, user -> reasoning + tool call -> tool -> reasoning + answer -> user ->
    reasoning + answer. Returns whether every prompt equalled a full render of the history,
    and the mismatches of the accumulated ids against a fresh render at the end.

    The gateway renders with `kwargs`; the model's replies are what the template renders
    under `sampled_with` (the model reasons whatever the gateway was told).
    """
    family = settings("--tito-model", name)
    engine = TitoEngine(
        tok,
        chat_template_kwargs=kwargs,
        boundary_stop_tokens=family.boundary_stop_tokens,
        end_of_turn_token=family.end_of_turn_token,
    )
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helper."},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    replies = [
        (
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "Use the tool.",
                "tool_calls": [CALL],
            },
            [{"role": "tool", "tool_call_id": "call_1", "content": "21 C"}],
        ),
        (
            {"role": "assistant", "content": "It is 21 C.", "reasoning_content": "Got it."},
            [{"role": "user", "content": "Thanks!"}],
        ),
        ({"role": "assistant", "content": "You are welcome.", "reasoning_content": "Polite."}, []),
    ]
    accumulated = engine.first_turn_ids(history, TOOLS)
    exact = True
    for reply, appended in replies:
        accumulated = accumulated + _sample(tok, engine, history, reply, sampled_with)
        history.append(reply)
        if not appended:
            break
        accumulated = [
            *engine.junction_prefix(accumulated),
            *engine.junction_ids(accumulated),
            *engine.appended_ids(reply, appended, TOOLS),
        ]
        history += appended
        exact = exact and accumulated == tok.apply_chat_template(
            history, add_generation_prompt=True, tools=TOOLS, chat_template_kwargs=kwargs
        )
    return exact, engine.mismatches(history, TOOLS, accumulated)


@pytest.mark.parametrize("name", sorted(FAMILIES))  # every supported family but default
def test_agent_session_is_token_exact_with_the_family_defaults(tmp_path: Path, name: str) -> None:
    tok = load_tokenizer(family_tokenizer_dir(tmp_path / name, name))
    kwargs = dict(settings("--tito-model", name).chat_template_kwargs)
    assert kwargs == _row_kwargs(TITO_FAMILIES[name])
    assert run_agent_session(name, tok, kwargs, kwargs) == (True, [])
    if not kwargs:
        return  # nothing pinned (Inkling)
    # Without them the template drops earlier reasoning once the history grows: the prompts
    # and the record are no longer what a re-render gives.
    exact, found = run_agent_session(name, tok, {}, kwargs)
    assert not exact
    assert found != []


@pytest.mark.parametrize("name", ["minimax_m25", "qwen35"])
def test_families_without_system_appends_lose_or_refuse_them(tmp_path: Path, name: str) -> None:
    # Why those families leave `system` out of the appended roles.
    tok = load_tokenizer(family_tokenizer_dir(tmp_path / name, name))
    engine = TitoEngine(tok)
    stub = {"role": "assistant", "content": "ok"}
    appended = [{"role": "system", "content": "New rule."}]
    if name == "qwen35":
        with pytest.raises(BadRequest, match="System message must be at the beginning"):
            engine.appended_ids(stub, appended, None)
    else:
        assert "New rule." not in tok.decode(engine.appended_ids(stub, appended, None))
    assert "system" not in settings("--tito-model", name).allowed_append_roles


def test_every_supported_family_has_a_test_template() -> None:
    # DeepSeek's families have no template: tests/tokenizer/test_prompt_encoders.py.
    assert set(TITO_FAMILIES) - {"default", "deepseekv32", "deepseekv4"} == set(FAMILIES)


# --- GLM 4.7: the stop token is the next message's opener ---------------------------------


@pytest.fixture
def glm(tmp_path: Path) -> tuple[ChatTokenizer, TitoEngine]:
    tok = load_tokenizer(family_tokenizer_dir(tmp_path / "glm47", "glm47"))
    family = TITO_FAMILIES["glm47"]
    engine = TitoEngine(
        tok,
        chat_template_kwargs=_row_kwargs(family),
        max_trim_tokens=family.max_trim_tokens,
        boundary_stop_tokens=family.boundary_stop_tokens,
    )
    return tok, engine


def test_glm47_drops_the_sampled_stop_token_whichever_message_follows(
    glm: tuple[ChatTokenizer, TitoEngine],
) -> None:
    # miles/utils/chat_template_utils/tito_tokenizer.py GLM47TITOTokenizer.merge_tokens: the
    # prefix's last token is dropped when it is <|user|> or <|observation|>, also when the
    # next message opens with the other one; nothing is inserted.
    tok, engine = glm
    user, observation = tok.token_to_id("<|user|>"), tok.token_to_id("<|observation|>")
    sampled = [*tok.encode("<|assistant|><think>r</think>ok"), observation]
    assert list(engine.junction_prefix(sampled)) == sampled[:-1]
    assert list(engine.junction_prefix([*sampled[:-1], user])) == sampled[:-1]
    assert engine.junction_ids(sampled) == []
    # A length cut-off sampled no stop token: nothing is dropped, nothing inserted.
    assert list(engine.junction_prefix(sampled[:-1])) == sampled[:-1]
    assert engine.junction_ids(sampled[:-1]) == []
    appended = engine.appended_ids(
        {"role": "assistant", "content": "ok"}, [{"role": "user", "content": "next"}], None
    )
    assert tok.decode(appended) == "<|user|>next<|assistant|><think>"


def test_glm47_records_compare_without_the_trailing_stop_token_and_label_assistant_text(
    glm: tuple[ChatTokenizer, TitoEngine],
) -> None:
    tok, engine = glm
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok", "reasoning_content": "r"},
    ]
    prompt = engine.first_turn_ids(history[:1], None)
    stop = tok.token_to_id("<|user|>")
    exact = [*prompt, *tok.encode("r</think>ok"), stop]
    assert engine.mismatches(history, None, exact) == []
    assert engine.mismatches(history, None, exact[:-1]) == []  # cut off before the stop
    other = [*prompt, *tok.encode("r</think>OK"), stop]
    found = engine.mismatches(history, None, other)
    assert [m["type"] for m in found] == ["assistant_text"]
    s = settings("--tito-model", "glm47")
    assert (s.max_trim_tokens, s.boundary_stop_tokens) == (1, ("<|user|>", "<|observation|>"))
    assert dict(s.chat_template_kwargs) == {"clear_thinking": False}


# --- Inkling: the turn ends at its stop token, not at the first special token ---------------


def test_inkling_turns_end_at_the_stop_token_after_the_block_closers(tmp_path: Path) -> None:
    # miles/utils/chat_template_utils/tito_tokenizer.py InklingTITOTokenizer: the fixed
    # template (templates/inkling_fixed.jinja) ends an assistant turn with
    # <|content_model_end_sampling|> after each block's <|end_message|>, and turns are joined
    # as they are (no merge rule, max_trim_tokens 0).
    tok = load_tokenizer(family_tokenizer_dir(tmp_path / "inkling", "inkling"))
    assert tok.decode([tok.end_of_turn_token_id]) == "<|end_message|>"  # the first special
    family = TITO_FAMILIES["inkling"]
    engine = TitoEngine(tok, end_of_turn_token=family.end_of_turn_token)
    assert tok.decode([engine.end_of_turn_id]) == "<|content_model_end_sampling|>"
    assert engine.turn_suffix_ids == []
    # Taking the block closer for the end of the turn would insert one and the stop token
    # again after every sampled turn (which ends at the stop token).
    assert TitoEngine(tok).turn_suffix_ids == tok.encode("<|content_model_end_sampling|>")
    s = settings("--tito-model", "inkling")
    assert (s.end_of_turn_token, s.max_trim_tokens) == ("<|content_model_end_sampling|>", 0)
    assert s.allowed_append_roles == {"tool", "user", "system", "assistant"}


# --- the rows are the framework's ----------------------------------------------------------


def test_the_rows_are_the_framework_packages() -> None:
    # miles_tito_tokenizers tokenizer.py: each family's SUPPORTED_TEMPLATES, as registered in
    # tokenizer_type.py TITOTokenizerType; sessiongate restates them so --help and start-up
    # checks need no package. Inkling is sessiongate's own (not in the package 0.1.1).
    types = pytest.importorskip("miles_tito_tokenizers.tokenizer_type")
    theirs = {
        t.value: {
            (row.allowed_roles, row.template, tuple(sorted(row.extra_kwargs.items())))
            for row in types.TITOTokenizerType.get_tokenizer_class(t).SUPPORTED_TEMPLATES
        }
        for t in types.TITOTokenizerType
    }
    ours = {
        name: {(row.roles, row.template, tuple(sorted(row.kwargs.items()))) for row in f.rows}
        for name, f in TITO_FAMILIES.items()
        if name != "inkling"
    }
    assert ours == theirs
