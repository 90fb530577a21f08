"""sessiongate: a session-aware gateway for multi-turn and agentic LLM traffic."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("sessiongate")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0"

__all__ = ["__version__"]
