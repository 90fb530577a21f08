"""Engine routing: which engine a stateless request goes to (`--policy`).

Not to be confused with `session_routing`, which stamps session identity onto requests for
an external router. The policies are specified here in Python (`policies/`) and twinned in
Rust (`rust/engine_policy/`), which the compiled front uses; `EnginePolicy` is the Rust class
unless `SESSIONGATE_IMPL=python` (as the other primitives, `sessiongate.primitives`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from sessiongate.config.engines import (
    DEFAULT_POLICY,
    POLICIES,
    EngineRoutingConfig,
)
from sessiongate.engines.policy.engine_policy import EnginePolicy as PyEnginePolicy

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "EnginePolicy",
    "EngineRoutingConfig",
    "PyEnginePolicy",
    "get_engine_policy",
]


def get_engine_policy(impl: Literal["rust", "python"]) -> type[PyEnginePolicy]:
    """The `EnginePolicy` class of one implementation, for side-by-side tests."""
    if impl == "python":
        return PyEnginePolicy
    from sessiongate.primitives import get_impl

    get_impl("rust")  # ImportError naming the cause when the core is missing
    from sessiongate._core import EnginePolicy as RustEnginePolicy

    return RustEnginePolicy  # type: ignore[return-value]


def _active() -> type[PyEnginePolicy]:
    from sessiongate.primitives import IMPL

    return get_engine_policy("python" if IMPL == "python" else "rust")


if TYPE_CHECKING:
    EnginePolicy = PyEnginePolicy
else:

    def __getattr__(name: str) -> object:
        # Resolved on first use: option parsing alone must not load the compiled core.
        if name == "EnginePolicy":
            return _active()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
