"""Session routing: stamp session identity onto upstream requests for external routers.

See docs/routing.md. The server builds one mode with `load_mode` and one
`SessionTreeRegistry` per worker, then per turn: `ctx = tree.context_for(...)`,
`mode.headers(ctx)`, and `mode.transform_body(body, ctx)` when `mode.mutates_body`.
"""

from sessiongate.routing.base import RoutingContext, RoutingOptions, SessionRoutingMode
from sessiongate.routing.modes import (
    BUILTIN_MODES,
    DynamoHeaders,
    DynamoNvext,
    IdentityHeaders,
    SessionIdHeader,
    SmgRoutingKey,
)
from sessiongate.routing.registry import (
    ENTRY_POINT_GROUP,
    ModeInfo,
    OptionInfo,
    RoutingConfigError,
    available_mode_names,
    check_mode_class,
    list_modes,
    load_mode,
)
from sessiongate.routing.tree import SessionTreeRegistry, TreeStats, UnknownSessionError

__all__ = [
    "BUILTIN_MODES",
    "ENTRY_POINT_GROUP",
    "DynamoHeaders",
    "DynamoNvext",
    "IdentityHeaders",
    "ModeInfo",
    "OptionInfo",
    "RoutingConfigError",
    "RoutingContext",
    "RoutingOptions",
    "SessionIdHeader",
    "SessionRoutingMode",
    "SessionTreeRegistry",
    "SmgRoutingKey",
    "TreeStats",
    "UnknownSessionError",
    "available_mode_names",
    "check_mode_class",
    "list_modes",
    "load_mode",
]
