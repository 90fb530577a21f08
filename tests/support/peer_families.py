"""What the peer test (tests/peer/test_framework_tito.py) deploys per model family, as the
rollout framework's TITO package (`miles-tito-tokenizers`) configures that family.

The package picks, per family and set of appended roles, a row of the family's
`SUPPORTED_TEMPLATES` (`resolve_fixed_chat_template`): a fixed template it ships (qwen3,
qwen35, qwennext, kimi25, and the minimax families' tool+user row), or `template=None`, the
model's stock template. Stock templates are model files we do not have, so those rows use the
test styles of tests/support/family_templates.py in their place: GLM47_STYLE (glm47),
KIMI_STYLE (kimi26), MINIMAX_STYLE (the minimax tool-only row), and QWEN3_STYLE for the
framework's `default` family; nemotron3 gets NEMOTRON3_STYLE (QWEN3_STYLE with Nemotron's own
history-thinking switch, `truncate_history_thinking`, which the package's row pins). DeepSeek
V3.2 / V4 have no template: the package renders them with its Python encoders.

A deployment is one (family, template) pair: one `sessiongate serve` and one replay engine,
through which every trajectory that resolves to that row runs as its own session. MiniMax has
two (its rows name different templates). A trajectory whose appended roles no row of the
family covers is refused by the package itself (`resolve_fixed_chat_template` raises), and is
skipped with that reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from miles_tito_tokenizers.encoders import deepseek_v4, deepseek_v32

from support.family_templates import (
    GLM47_STYLE,
    KIMI_STYLE,
    MINIMAX_STYLE,
    NEMOTRON3_STYLE,
    QWEN3_STYLE,
)

FAMILIES = (
    "default",
    "qwen3",
    "qwen35",
    "qwennext",
    "glm47",
    "nemotron3",
    "kimi25",
    "kimi26",
    "minimax_m25",
    "minimax_m27",
    "deepseekv32",
    "deepseekv4",
)

# Stand-ins for the stock templates of rows that say `template=None`.
STOCK_STYLES: dict[str, tuple[str, str]] = {
    "default": ("QWEN3_STYLE", QWEN3_STYLE),
    "glm47": ("GLM47_STYLE", GLM47_STYLE),
    "nemotron3": ("NEMOTRON3_STYLE", NEMOTRON3_STYLE),
    "kimi26": ("KIMI_STYLE", KIMI_STYLE),
    "minimax_m25": ("MINIMAX_STYLE", MINIMAX_STYLE),
    "minimax_m27": ("MINIMAX_STYLE", MINIMAX_STYLE),
}
DEEPSEEK = frozenset({"deepseekv32", "deepseekv4"})

# The template variable that switches thinking, for the templates that have one (the qwen3
# and qwen3.5 fixed templates' `enable_thinking`, Kimi K2.5's fixed template's `thinking`;
# the DeepSeek encoders take `enable_thinking` as their `thinking_mode`). The test styles and
# the qwennext / minimax fixed templates have none.
THINKING_SWITCH: dict[str, str] = {
    "qwen3": "enable_thinking",
    "qwen35": "enable_thinking",
    "kimi25": "thinking",
    "deepseekv32": "enable_thinking",
    "deepseekv4": "enable_thinking",
}

# The token the model stops at, which ends its sampled ids: ChatML's `<|im_end|>` (not the
# template's newline after it), MiniMax's `[e~[`, DeepSeek's end of sentence. GLM 4.7 closes
# no turn: see GLM47_STOPS.
STOP_TOKEN: dict[str, str] = {
    "default": "<|im_end|>",
    "qwen3": "<|im_end|>",
    "qwen35": "<|im_end|>",
    "qwennext": "<|im_end|>",
    "nemotron3": "<|im_end|>",
    "kimi25": "<|im_end|>",
    "kimi26": "<|im_end|>",
    "minimax_m25": "[e~[",
    "minimax_m27": "[e~[",
    "deepseekv32": deepseek_v32.eos_token,
    "deepseekv4": deepseek_v4.eos_token,
}
# GLM 4.7: after a tool call the model stops at `<|observation|>`, else at `<|user|>`, and
# emits that token (the next message's opener, which the template renders itself).
GLM47_STOPS = {"tool_calls": "<|observation|>", "plain": "<|user|>"}


@dataclass(frozen=True)
class Deployment:
    """One `serve` + replay engine: a family with the template its resolved row names."""

    family: str
    # A fixed template's file name, a test style's name, or "encoder" (DeepSeek).
    template_name: str
    # The template file to give both sides, or None (DeepSeek: the package's encoder).
    template_path: Path | None
    template_text: str | None

    @property
    def label(self) -> str:
        return f"{self.family}[{self.template_name}]"

    @property
    def thinking_switch(self) -> str | None:
        return THINKING_SWITCH.get(self.family)


def resolve(family: str, append_roles: frozenset[str]) -> tuple[Deployment, dict[str, object]]:
    """The deployment the package's row for `append_roles` names, and the row's extra
    template variables. ValueError (the package's) when no row covers the roles."""
    from miles_tito_tokenizers import resolve_fixed_chat_template

    if family == "default":
        # get_tito_tokenizer resolves no row for DEFAULT: the stock template, every role.
        name, text = STOCK_STYLES[family]
        return Deployment(family, name, None, text), {}
    path, extra = resolve_fixed_chat_template(family, set(append_roles))
    if family in DEEPSEEK:
        return Deployment(family, "encoder", None, None), extra
    if path is not None:
        file = Path(path)
        return Deployment(family, file.name, file, file.read_text(encoding="utf-8")), extra
    name, text = STOCK_STYLES[family]
    return Deployment(family, name, None, text), extra


def template_args(deployment: Deployment, style_file: Path | None) -> list[str]:
    """The `serve` flags that choose the deployment's template. A family whose row names one
    of the package's fixed templates gets none: sessiongate resolves the same file from the
    installed package by itself (its widest row, which the deployment's row equals or shares
    the file with). A stock-template row gets the test style as --chat-template-path (the
    real stock templates are not on PyPI). DeepSeek: none (the package's encoder)."""
    if deployment.template_path is not None:
        return []
    if style_file is not None:
        return ["--chat-template-path", str(style_file)]
    return []
