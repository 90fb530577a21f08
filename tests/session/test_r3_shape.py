"""The R3 top-k is known before the first turn: --r3-topk, the checkpoint's config.json, or
the embedded mock's own shape; otherwise `serve --r3` refuses to start.

SGLang sizes routed_experts as `hf_text_config.num_hidden_layers` x
`hf_text_config.num_experts_per_tok` (sglang/srt/state_capturer/routed_experts.py
`RoutedExpertsCapturer.__init__`; the text config picked by
sglang/srt/utils/hf_transformers/common.py `get_hf_text_config`); its `/model_info` and
`/server_info` (sglang/srt/entrypoints/http_server.py) carry neither number.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from sessiongate.session.r3_shape import MoeShape, read_moe_shape
from sessiongate.tokenizer import BUILTIN_TOKENIZER_DIR
from support.framework_client import agent_episode, collect_samples, decode_samples
from support.procs import ServerProcess, free_port, mock_engine

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

# Family configs, cut to the keys that matter, with the names each family's config.json uses.
FAMILIES: dict[str, tuple[dict[str, Any], tuple[int, int]]] = {
    "qwen3-moe": (
        {"model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8,
         "num_hidden_layers": 48},
        (48, 8),
    ),
    "qwen2-moe": (
        {"model_type": "qwen2_moe", "num_experts": 60, "num_experts_per_tok": 4,
         "num_hidden_layers": 24, "shared_expert_intermediate_size": 5632},
        (24, 4),
    ),
    # Dense first layers are still rows of SGLang's buffer: all num_hidden_layers count.
    "deepseek-v3": (
        {"model_type": "deepseek_v3", "n_routed_experts": 256, "num_experts_per_tok": 8,
         "num_hidden_layers": 61, "first_k_dense_replace": 3, "num_nextn_predict_layers": 1},
        (61, 8),
    ),
    "deepseek-v2-lite": (
        {"model_type": "deepseek_v2", "n_routed_experts": 64, "num_experts_per_tok": 6,
         "num_hidden_layers": 27, "first_k_dense_replace": 1},
        (27, 6),
    ),
    "kimi-k2": (
        {"model_type": "kimi_k2", "n_routed_experts": 384, "num_experts_per_tok": 8,
         "num_hidden_layers": 61, "first_k_dense_replace": 1},
        (61, 8),
    ),
    "mixtral": (
        {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2,
         "num_hidden_layers": 32},
        (32, 2),
    ),
    "glm4-moe": (
        {"model_type": "glm4_moe", "n_routed_experts": 160, "num_experts_per_tok": 8,
         "num_hidden_layers": 92, "first_k_dense_replace": 3},
        (92, 8),
    ),
    "minimax-m2": (
        {"model_type": "minimax_m2", "num_local_experts": 256, "num_experts_per_tok": 8,
         "num_hidden_layers": 62},
        (62, 8),
    ),
    "gpt-oss": (
        {"model_type": "gpt_oss", "num_local_experts": 32, "num_experts_per_tok": 4,
         "experts_per_token": 4, "num_hidden_layers": 24},
        (24, 4),
    ),
    # sglang/srt/configs/kimi_linear.py maps num_experts_per_tok onto this name.
    "kimi-linear": (
        {"model_type": "kimi_linear", "num_experts": 256, "num_experts_per_token": 8,
         "num_hidden_layers": 27},
        (27, 8),
    ),
    "qwen3.5-moe": (
        {"model_type": "qwen3_5_moe", "vision_config": {"depth": 27},
         "text_config": {"num_experts_per_tok": 8, "num_hidden_layers": 40, "num_experts": 256}},
        (40, 8),
    ),
    "qwen3-omni-moe": (
        {"model_type": "qwen3_omni_moe",
         "thinker_config": {"text_config": {"num_experts_per_tok": 8, "num_hidden_layers": 48}}},
        (48, 8),
    ),
}  # fmt: skip


def checkpoint(path: Path, config: dict[str, Any] | None) -> Path:
    """A checkpoint directory: the built-in tokenizer's files and `config` as config.json."""
    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUILTIN_TOKENIZER_DIR / name, path / name)
    if config is not None:
        (path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_shape_of_each_family(tmp_path: Path, family: str) -> None:
    config, (layers, topk) = FAMILIES[family]
    shape = read_moe_shape(checkpoint(tmp_path, config))
    assert isinstance(shape, MoeShape)
    assert (shape.layers, shape.topk) == (layers, topk)
    assert str(tmp_path / "config.json") in shape.source


def test_no_shape_without_a_moe_config(tmp_path: Path) -> None:
    assert read_moe_shape(None) is None
    assert read_moe_shape(checkpoint(tmp_path / "none", None)) is None
    dense = {"model_type": "llama", "num_hidden_layers": 32}
    assert read_moe_shape(checkpoint(tmp_path / "dense", dense)) is None
    bad = {"num_experts_per_tok": "8", "num_hidden_layers": 4}
    with pytest.raises(ValueError, match="num_experts_per_tok is '8'"):
        read_moe_shape(checkpoint(tmp_path / "bad", bad))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{", encoding="utf-8")
    with pytest.raises(ValueError, match="not readable JSON"):
        read_moe_shape(tmp_path / "broken")


def _serve_exits(*args: str) -> subprocess.CompletedProcess[str]:
    port = free_port()
    argv = [sys.executable, "-m", "sessiongate", "serve", "--port", str(port), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def test_serve_r3_without_a_known_topk_refuses_to_start(tmp_path: Path) -> None:
    # Nothing is started (the upstream URL is never contacted): the mistake surfaces before
    # the first turn instead of as a 422 from /samples after the rollout.
    upstream = ["--backend", f"http://127.0.0.1:{free_port()}", "--workers", "1"]
    builtin = _serve_exits("--r3", *upstream)
    assert builtin.returncode != 0
    assert "--r3 needs the model's MoE top-k" in builtin.stderr
    assert "--r3-topk K" in builtin.stderr
    dense = checkpoint(tmp_path / "dense", {"num_hidden_layers": 2})
    refused = _serve_exits("--r3", "--tokenizer", str(dense), *upstream)
    assert refused.returncode != 0
    assert f"--tokenizer {dense} has no config.json naming num_experts_per_tok" in refused.stderr


def _samples_shape(gateway: ServerProcess) -> tuple[int, ...]:
    session_id = agent_episode(gateway.url, turns=2)
    tokens = httpx.get(f"{gateway.url}/sessions/{session_id}").json()["metadata"]
    samples, _, _ = decode_samples(collect_samples(gateway.url, session_id, None))
    assert samples[0]["tokens"].tolist() == tokens["accumulated_token_ids"]
    return tuple(samples[0]["rollout_routed_experts"].shape)


def test_topk_learned_from_the_checkpoint_config(tmp_path: Path) -> None:
    # An engine serving a 3-layer top-4 MoE, a gateway given only its checkpoint directory.
    model = checkpoint(tmp_path / "moe", {"num_experts_per_tok": 4, "num_hidden_layers": 3})
    with mock_engine("--r3-layers", "3", "--r3-topk", "4", "--completion-tokens", "8") as eng:
        port = free_port()
        argv = ["serve", "--port", str(port), "--workers", "1", "--backend", eng.url, "--r3"]
        with ServerProcess([*argv, "--tokenizer", str(model)], port, timeout=60) as gateway:
            rows, layers, topk = _samples_shape(gateway)
    assert (layers, topk) == (3, 4) and rows > 0


def test_topk_of_the_embedded_mock(tmp_path: Path) -> None:
    # `serve` configures the embedded engine, so it knows the shape it gave it.
    port = free_port()
    argv = ["serve", "--port", str(port), "--workers", "0", "--r3"]
    argv += ["--mock-args", "--r3-layers 2 --r3-topk=3 --completion-tokens 8"]
    with ServerProcess(argv, port, timeout=60) as gateway:
        rows, layers, topk = _samples_shape(gateway)
    assert (layers, topk) == (2, 3) and rows > 0
