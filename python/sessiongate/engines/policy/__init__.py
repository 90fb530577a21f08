"""Engine routing: which engine a stateless request goes to (`--policy`).

Not to be confused with `session_routing`, which stamps session identity onto requests for
an external router. The policies are specified here in Python (`policies/`) and twinned in
Rust (`rust/engine_policy/`), which the compiled front uses; `EnginePolicy` is the Rust class
unless `SESSIONGATE_IMPL=python`, chosen by `sessiongate.twins.pick` as every other primitive.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sessiongate.config.engines import (
    DEFAULT_POLICY,
    POLICIES,
    EngineRoutingConfig,
)
from sessiongate.engines.policy.base import LoadReport
from sessiongate.engines.policy.engine_policy import EnginePolicy as PyEnginePolicy
from sessiongate.twins import Impl, pick

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "EnginePolicy",
    "EngineRoutingConfig",
    "LoadReport",
    "PyEnginePolicy",
    "get_engine_policy",
]


def get_engine_policy(impl: Impl | None = None) -> type[PyEnginePolicy]:
    """The `EnginePolicy` class of one implementation (None: the active one), for
    side-by-side tests. The core is imported only when the Rust class is asked for."""
    return pick("EnginePolicy", PyEnginePolicy, impl)


if TYPE_CHECKING:
    EnginePolicy = PyEnginePolicy
else:

    def __getattr__(name: str) -> object:
        # Resolved on first use: option parsing alone must not load the compiled core.
        if name == "EnginePolicy":
            return get_engine_policy()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
