"""Settings of the session core (one set per worker)."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_APPEND_ROLES = frozenset({"tool", "user"})


@dataclass(frozen=True)
class SessionSettings:
    # Roles an agent may append after an assistant turn.
    allowed_append_roles: frozenset[str] = field(default=DEFAULT_APPEND_ROLES)
    # Trailing tokens of the previous checkpoint allowed to differ in the next one.
    max_trim_tokens: int = 0
    # Ask the upstream for routed experts (R3).
    r3: bool = False
    # Experts per token per layer, to shape R3 as [tokens, layers, topk] in trajectory files
    # (0: unknown, the shape is [tokens, layers * topk]).
    r3_topk: int = 0
    # Upstream path of the chat endpoint.
    chat_path: str = "/v1/chat/completions"
    # Header-identified sessions idle this long (seconds) are closed; 0 keeps them forever.
    header_session_ttl: float = 3600.0
    # Appended to "session not found" errors, e.g. when this worker replaced a lost one.
    not_found_note: str = ""
