"""Session routing: stamp session identity onto upstream requests for external routers.

See docs/routing.md. The server builds one mode with `load_mode` and one
`SessionFamilyRegistry` per worker, then per turn: `ctx = families.context_for(...)`,
`mode.headers(ctx)`, and `mode.transform_body(body, ctx)` when `mode.mutates_body`.
"""

from sessiongate.session_routing.base import RoutingContext, RoutingOptions, SessionRoutingMode
from sessiongate.session_routing.families import (
    FamilyStats,
    SessionFamilyRegistry,
    UnknownSessionError,
)
from sessiongate.session_routing.mode_registry import (
    ENTRY_POINT_GROUP,
    ModeInfo,
    OptionInfo,
    RoutingConfigError,
    available_mode_names,
    check_mode_class,
    list_modes,
    load_mode,
)
from sessiongate.session_routing.modes import (
    BUILTIN_MODES,
    DynamoHeaders,
    DynamoNvext,
    IdentityHeaders,
    SessionIdHeader,
    SmgRoutingKey,
)

# The earlier name of the family registry, kept for plugins written against it.
SessionTreeRegistry = SessionFamilyRegistry

__all__ = [
    "BUILTIN_MODES",
    "ENTRY_POINT_GROUP",
    "DynamoHeaders",
    "DynamoNvext",
    "FamilyStats",
    "IdentityHeaders",
    "ModeInfo",
    "OptionInfo",
    "RoutingConfigError",
    "RoutingContext",
    "RoutingOptions",
    "SessionFamilyRegistry",
    "SessionIdHeader",
    "SessionRoutingMode",
    "SessionTreeRegistry",
    "SmgRoutingKey",
    "UnknownSessionError",
    "available_mode_names",
    "check_mode_class",
    "list_modes",
    "load_mode",
]
