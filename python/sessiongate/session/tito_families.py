"""Per-model-family TITO defaults (`--tito-model NAME`), named as the rollout framework's
`--tito-model` values.

The framework binds to each family a few rows (its TITO package's `SUPPORTED_TEMPLATES`,
miles_tito_tokenizers/tokenizer.py): for a set of roles an agent may append after an
assistant turn, the chat template that stays append-only for them (its own fixed template, or
the model's stock one) and the template variables that keep it so. The roles asked for pick
the smallest row that covers them; roles no row covers are refused. Those rows are restated
here as data (tests/peer checks them against the installed package), so `--help` and start-up
checks need no package; only a row's template file is read from it (`families` extra).

Besides the rows: how many trailing checkpoint tokens may differ, the junction facts a
generic renderer cannot derive from a template (GLM 4.7's stop tokens that open the next
message, Inkling's end-of-turn token), the prompt encoder of a family without a template
(DeepSeek), and the comparator `tito_session_mismatch` reports with.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from sessiongate.session.tito_compare import ComparatorSpec

# What a family without rows allows (the framework's DEFAULT family takes any roles).
ALL_APPEND_ROLES = frozenset({"tool", "user", "system", "assistant"})
_TOOL = frozenset({"tool"})
_TOOL_USER = frozenset({"tool", "user"})
_TOOL_USER_SYSTEM = frozenset({"tool", "user", "system"})


@dataclass(frozen=True)
class TemplateRow:
    """One row: appending `roles` is append-only with `template` (a file of the framework's
    TITO package; None: the tokenizer's own template) under `kwargs`."""

    roles: frozenset[str]
    template: str | None = None
    kwargs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class TitoFamily:
    """What `--tito-model NAME` sets. Explicit `--chat-template-kwargs` keys,
    `--chat-template-path`, `--allowed-append-roles` and `--max-trim-tokens` win."""

    name: str
    # The framework's rows; none: the stock template, any roles, nothing pinned.
    rows: tuple[TemplateRow, ...] = ()
    max_trim_tokens: int = 0
    # The framework renders this family with a fixed template its package does not ship:
    # give one with --chat-template-path (Inkling).
    brings_template: bool = False
    # A Python prompt encoder instead of any template (tokenizer/prompt_encoders.py).
    prompt_encoder: str | None = None
    # Stop tokens that also open the next message (GLM 4.7's `<|user|>`, `<|observation|>`:
    # its template closes no turn, the next role token does). The sampled one is dropped
    # where the next message joins, whichever it is, since the appended messages render their
    # own opener; nothing is inserted there. A record is compared with a re-render without
    # them at its end.
    boundary_stop_tokens: tuple[str, ...] = ()
    # The token that ends an assistant turn, when the first special token the template puts
    # after an assistant's content is not it (Inkling closes each block with
    # `<|end_message|>`; the turn ends at `<|content_model_end_sampling|>`).
    end_of_turn_token: str | None = None
    # How `tito_session_mismatch` compares a record with a re-render: the family's
    # `create_comparator` settings (session/tito_compare.py). The framework's DEFAULT family
    # names no assistant start, so every text difference there is `non_assistant_text`.
    comparator: ComparatorSpec = field(default_factory=ComparatorSpec)

    @property
    def default_roles(self) -> frozenset[str]:
        """The roles allowed when `--allowed-append-roles` is not given: the widest row's.

        The framework's session server defaults to `tool` alone; agents that answer with a
        user message after a tool turn are the common case here, so the default is the
        widest set the family keeps append-only (`--allowed-append-roles tool` gives the
        framework's).
        """
        if not self.rows:
            return ALL_APPEND_ROLES
        return max(self.rows, key=lambda row: len(row.roles)).roles

    @property
    def template_kwargs(self) -> Mapping[str, Any]:
        """The template variables pinned under the default roles."""
        row = self.row_for(self.default_roles)
        return row.kwargs if row is not None else MappingProxyType({})

    def row_for(self, roles: Iterable[str]) -> TemplateRow | None:
        """The smallest row covering `roles` (the framework's `resolve_fixed_chat_template`);
        None for a family without rows; ValueError naming the rows when none covers them."""
        if not self.rows:
            return None
        wanted = frozenset(roles)
        covering = [row for row in self.rows if wanted <= row.roles]
        if not covering:
            known = "; ".join(",".join(sorted(row.roles)) for row in self.rows)
            raise ValueError(
                f"the {self.name} family keeps appended roles {','.join(sorted(wanted))} "
                f"append-only under no template of the rollout framework (its rows: {known})"
            )
        return min(covering, key=lambda row: len(row.roles))


# Each family's `create_comparator` settings, as its TITOTokenizer subclass sets them in
# miles/utils/chat_template_utils/tito_tokenizer.py: `_default_assistant_start_str`,
# `special_token_ids`, `trailing_token_ids` (the newline Qwen3 and MiniMax templates put after
# a turn's stop token; GLM 4.7's stop tokens that open the next message).
_QWEN3 = ComparatorSpec("<|im_start|>assistant", trailing=("\n",))
_NEMOTRON3 = ComparatorSpec("<|im_start|>assistant\n", trailing=("\n",))
_KIMI = ComparatorSpec("<|im_assistant|>", not_boundaries=("<|im_middle|>",))
_MINIMAX = ComparatorSpec("]~b]ai", trailing=("\n",))
_GLM47 = ComparatorSpec("<|assistant|>", trailing=("<|observation|>", "<|user|>"))
_INKLING = ComparatorSpec(
    "<|message_model|>",
    boundaries=("<|message_user|>", "<|message_model|>", "<|message_system|>", "<|message_tool|>"),
)


# DeepSeek's role tokens are spelled with FULLWIDTH VERTICAL LINE (U+FF5C), as in its vocabulary.
_FW = "\uff5c"
_DS_USER, _DS_ASSISTANT = f"<{_FW}User{_FW}>", f"<{_FW}Assistant{_FW}>"
_DEEPSEEK = ComparatorSpec(_DS_ASSISTANT, boundaries=(_DS_USER, _DS_ASSISTANT))


def _rows(*rows: tuple[frozenset[str], str | None, dict[str, Any]]) -> tuple[TemplateRow, ...]:
    return tuple(
        TemplateRow(roles, template, MappingProxyType(kwargs)) for roles, template, kwargs in rows
    )


def _qwen_rows(template: str) -> tuple[TemplateRow, ...]:
    # Tool results alone keep the fixed template append-only as it is; a user message makes
    # it drop earlier reasoning unless clear_thinking is false.
    return _rows((_TOOL, template, {}), (_TOOL_USER, template, {"clear_thinking": False}))


def _minimax_rows(template: str) -> tuple[TemplateRow, ...]:
    # The stock template is append-only for tool results; a user message needs the fixed one.
    return _rows((_TOOL, None, {}), (_TOOL_USER, template, {"clear_thinking": False}))


# The rows as miles_tito_tokenizers 0.1.1 registers them (tokenizer.py, one class per family).
FAMILIES: Mapping[str, TitoFamily] = MappingProxyType(
    {
        f.name: f
        for f in (
            # The framework's DEFAULT: the stock template, any roles, nothing pinned.
            TitoFamily("default"),
            TitoFamily("qwen3", _qwen_rows("qwen3_fixed.jinja"), comparator=_QWEN3),
            TitoFamily("qwen35", _qwen_rows("qwen3.5_fixed.jinja"), comparator=_QWEN3),
            TitoFamily(
                "qwennext",
                _qwen_rows("qwen3_thinking_2507_and_next_fixed.jinja"),
                comparator=_QWEN3,
            ),
            # Stock template, append-only once history thinking is not truncated.
            TitoFamily(
                "nemotron3",
                _rows(
                    (_TOOL, None, {}),
                    (_TOOL_USER, None, {"truncate_history_thinking": False}),
                    (_TOOL_USER_SYSTEM, None, {"truncate_history_thinking": False}),
                ),
                comparator=_NEMOTRON3,
            ),
            # K2.5's stock template has no preserve_thinking switch; K2.6's has. Both have a
            # tool+user row only.
            TitoFamily(
                "kimi25",
                _rows((_TOOL_USER, "kimi_k25_fixed.jinja", {"preserve_thinking": True})),
                comparator=_KIMI,
            ),
            TitoFamily(
                "kimi26", _rows((_TOOL_USER, None, {"preserve_thinking": True})), comparator=_KIMI
            ),
            TitoFamily(
                "minimax_m25", _minimax_rows("minimax_m25_fixed.jinja"), comparator=_MINIMAX
            ),
            TitoFamily(
                "minimax_m27", _minimax_rows("minimax_m27_fixed.jinja"), comparator=_MINIMAX
            ),
            # GLM 4.7's stock template has the clear_thinking switch. One trailing token of
            # the previous checkpoint (the dropped stop token) may differ in the next.
            TitoFamily(
                "glm47",
                _rows(
                    (_TOOL, None, {}),
                    (_TOOL_USER, None, {"clear_thinking": False}),
                    (_TOOL_USER_SYSTEM, None, {"clear_thinking": False}),
                ),
                max_trim_tokens=1,
                boundary_stop_tokens=("<|user|>", "<|observation|>"),
                comparator=_GLM47,
            ),
            # DeepSeek's encoders: tool results only (a user message after them is merged
            # into the same user turn, which rewrites earlier text; V4 also drops earlier
            # reasoning at a new user message unless the request has tools).
            TitoFamily(
                "deepseekv32",
                _rows((_TOOL, None, {})),
                prompt_encoder="deepseek_v32",
                comparator=_DEEPSEEK,
            ),
            TitoFamily(
                "deepseekv4",
                _rows((_TOOL, None, {})),
                prompt_encoder="deepseek_v4",
                comparator=_DEEPSEEK,
            ),
            # Not in the framework's package 0.1.1: the framework renders Inkling with a fixed
            # template of its own (SGLang serves it with a token-level renderer, but the
            # gateway sends ids): nothing pinned, any roles, turns joined as they are.
            TitoFamily(
                "inkling",
                brings_template=True,
                end_of_turn_token="<|content_model_end_sampling|>",
                comparator=_INKLING,
            ),
        )
    }
)


def resolve_tito_family(name: str) -> TitoFamily:
    """The family called `name`; ValueError naming the known ones otherwise."""
    family = FAMILIES.get(name)
    if family is not None:
        return family
    raise ValueError(f"unknown model family {name!r} (known: {', '.join(FAMILIES)})")
