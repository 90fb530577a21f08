"""Per-model-family TITO defaults (`--tito-model NAME`), named as the rollout framework's
`--tito-model` values.

The framework pins, per family, template variables that keep its chat template append-only
(a later message must not change how earlier turns render), the roles an agent may append
after an assistant turn (narrowed where the template drops a role), and how many trailing
checkpoint tokens may differ. These are the values read in its
`miles/utils/chat_template_utils/tito_tokenizer.py`, with the two junction facts the generic
renderer cannot derive from a template (GLM 4.7's stop tokens that open the next message,
Inkling's end-of-turn token). Families whose prompts need more than that are named with the
reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from sessiongate.session.tito_compare import ComparatorSpec

# What the framework allows when a family does not narrow it.
ALL_APPEND_ROLES = frozenset({"tool", "user", "system", "assistant"})
# Families whose template ignores a system message after the first (MiniMax) or refuses it
# (Qwen3.5): an appended system message would vanish from the prompt without an error.
_NO_SYSTEM = frozenset({"tool", "user", "assistant"})


@dataclass(frozen=True)
class TitoFamily:
    """What `--tito-model NAME` sets. Explicit `--chat-template-kwargs` keys,
    `--allowed-append-roles` and `--max-trim-tokens` win over these."""

    name: str
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    allowed_append_roles: frozenset[str] = ALL_APPEND_ROLES
    max_trim_tokens: int = 0
    # The framework renders this family with its own fixed template; the model's stock
    # template does not honour `template_kwargs`, so give one that does with
    # --chat-template-path.
    needs_fixed_template: bool = False
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


def _family(name: str, kwargs: dict[str, Any], **rest: Any) -> TitoFamily:
    return TitoFamily(name, MappingProxyType(kwargs), **rest)


FAMILIES: Mapping[str, TitoFamily] = MappingProxyType(
    {
        f.name: f
        for f in (
            # The framework's DEFAULT: the stock template, every role, nothing pinned.
            _family("default", {}),
            _family(
                "qwen3", {"clear_thinking": False}, needs_fixed_template=True, comparator=_QWEN3
            ),
            _family(
                "qwen35",
                {"clear_thinking": False},
                allowed_append_roles=_NO_SYSTEM,
                needs_fixed_template=True,
                comparator=_QWEN3,
            ),
            _family(
                "qwennext", {"clear_thinking": False}, needs_fixed_template=True, comparator=_QWEN3
            ),
            # Stock template, append-only once history thinking is not truncated.
            _family("nemotron3", {"truncate_history_thinking": False}, comparator=_NEMOTRON3),
            # K2.5's stock template has no preserve_thinking switch; K2.6's has.
            _family(
                "kimi25", {"preserve_thinking": True}, needs_fixed_template=True, comparator=_KIMI
            ),
            _family("kimi26", {"preserve_thinking": True}, comparator=_KIMI),
            _family(
                "minimax_m25",
                {"clear_thinking": False},
                allowed_append_roles=_NO_SYSTEM,
                needs_fixed_template=True,
                comparator=_MINIMAX,
            ),
            _family(
                "minimax_m27",
                {"clear_thinking": False},
                allowed_append_roles=_NO_SYSTEM,
                needs_fixed_template=True,
                comparator=_MINIMAX,
            ),
            # GLM 4.7's stock template has the clear_thinking switch. One trailing token of
            # the previous checkpoint (the dropped stop token) may differ in the next.
            _family(
                "glm47",
                {"clear_thinking": False},
                max_trim_tokens=1,
                boundary_stop_tokens=("<|user|>", "<|observation|>"),
                comparator=_GLM47,
            ),
            # The framework renders Inkling with its fixed template (SGLang serves it with a
            # token-level renderer, but the gateway sends ids): nothing pinned, every role,
            # turns joined as they are.
            _family(
                "inkling",
                {},
                needs_fixed_template=True,
                end_of_turn_token="<|content_model_end_sampling|>",
                comparator=_INKLING,
            ),
        )
    }
)

# Framework families the gateway cannot serve token-exactly yet, and why.
NOT_SUPPORTED: Mapping[str, str] = MappingProxyType(
    {
        "deepseekv32": "no Jinja chat template: the framework renders with DeepSeek's Python "
        "encoder, whose prompt text (tool-use instructions included) sessiongate does not "
        "reproduce",
        "deepseekv4": "no Jinja chat template (DeepSeek's Python encoder, as for deepseekv32), "
        "and appended tool/user turns are merged, so the framework re-renders the whole "
        "history",
    }
)


def resolve_tito_family(name: str) -> TitoFamily:
    """The family called `name`; ValueError naming the known ones otherwise."""
    family = FAMILIES.get(name)
    if family is not None:
        return family
    known = ", ".join(FAMILIES)
    if name in NOT_SUPPORTED:
        raise ValueError(f"{name!r} is not supported yet: {NOT_SUPPORTED[name]} (known: {known})")
    raise ValueError(f"unknown model family {name!r} (known: {known})")
