"""A deterministic SGLang-style chat engine (no GPU) for tests, the demo and benchmarks."""

from sessiongate.mock_engine.config import MockEngineConfig

__all__ = ["MockEngineConfig"]
