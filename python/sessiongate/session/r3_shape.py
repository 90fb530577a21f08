"""The R3 (routed experts) shape of a model, read from its checkpoint's ``config.json``.

SGLang sizes the routed_experts it returns from the model's text config alone
(sglang/srt/state_capturer/routed_experts.py ``RoutedExpertsCapturer``): ``topk =
hf_text_config.num_experts_per_tok`` and ``layers = hf_text_config.num_hidden_layers``, every
layer counted, dense ones too (DeepSeek V2/V3, Kimi K2 and GLM-4 MoE replace the first
``first_k_dense_replace`` layers' MoE by an MLP; their rows are still there). Each token's row
is ``layers * topk`` int32 values. Multimodal checkpoints keep that text config in a sub-config,
picked as SGLang's ``get_hf_text_config`` does (utils/hf_transformers/common.py).

The names differ by family only in a few places: Qwen2/3-MoE, Qwen3.5, Mixtral, DeepSeek,
Kimi K2, GLM-4 MoE and MiniMax all write ``num_experts_per_tok`` and ``num_hidden_layers``;
Kimi Linear writes ``num_experts_per_token`` (its config class maps the usual name onto it);
gpt-oss checkpoints carry ``experts_per_token`` beside ``num_experts_per_tok``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["MoeShape", "read_moe_shape"]

CONFIG_FILE = "config.json"
# First name present wins: SGLang's own attribute first, then the aliases config classes map.
_TOPK_KEYS = ("num_experts_per_tok", "num_experts_per_token", "experts_per_token")
_LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layers")


@dataclass(frozen=True)
class MoeShape:
    """R3 rows of a model: `layers` x `topk` expert ids per token."""

    layers: int
    topk: int
    source: str  # the config file and sub-config the numbers came from


def _text_config(config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The sub-config SGLang reads MoE numbers from, and its path for messages."""
    thinker = config.get("thinker_config")
    if isinstance(thinker, dict):
        if isinstance(thinker.get("text_config"), dict):
            return thinker["text_config"], "thinker_config.text_config"
        return thinker, "thinker_config"
    for key in ("llm_config", "language_config", "text_config"):
        if isinstance(config.get(key), dict):
            return config[key], key
    return config, ""


def _positive_int(config: dict[str, Any], keys: tuple[str, ...]) -> tuple[int, str] | None:
    for key in keys:
        value = config.get(key)
        if value is None:
            continue
        if type(value) is not int or value <= 0:
            raise ValueError(f"{key} is {value!r}, not a positive integer")
        return value, key
    return None


def read_moe_shape(directory: str | Path | None) -> MoeShape | None:
    """The R3 shape of the checkpoint at `directory`, or None when it has no ``config.json``
    or the config names no experts per token (a dense model, or a family not covered).

    ValueError when the file is there but unreadable, or its numbers are not positive ints.
    """
    if directory is None:
        return None
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object")
    text, where = _text_config(config)
    try:
        topk = _positive_int(text, _TOPK_KEYS)
        layers = _positive_int(text, _LAYER_KEYS)
    except ValueError as exc:
        raise ValueError(f"{path}{f' ({where})' if where else ''}: {exc}") from exc
    if topk is None or layers is None:
        return None
    names = f"{where + '.' if where else ''}{topk[1]}, {layers[1]}"
    return MoeShape(layers=layers[0], topk=topk[0], source=f"{path} ({names})")
