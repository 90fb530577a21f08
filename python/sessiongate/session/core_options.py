"""What the session core makes of its engines and sessions options: the engine URL list as
the core uses it, the appended roles, trim and expiry, and the session routing mode checked
once at start (SystemExit naming the flag). The options themselves are declared in
config/engines.py and config/sessions.py."""

from __future__ import annotations

from typing import Any

from sessiongate.config.engines import MOCK_BACKEND, NO_BACKEND, EnginesConfig
from sessiongate.config.sessions import SessionRoutingConfig, SessionsConfig

__all__ = [
    "MOCK_BACKEND",
    "NO_BACKEND",
    "check_session_routing",
    "core_settings",
    "engine_urls",
]


def engine_urls(engines: EnginesConfig, *, embedded_mock: bool) -> list[str]:
    """The --backend URLs, validated (SystemExit); serve's default is `[MOCK_BACKEND]`,
    `none` is `[]` (engines register at run time)."""
    given = list(engines.urls or ())
    if not embedded_mock:
        if NO_BACKEND in given:
            if len(given) > 1:
                raise SystemExit("--backend none cannot be combined with other --backend URLs")
            return []
        for url in given:
            if not url.startswith(("http://", "https://")):
                raise SystemExit(f"--backend {url!r} must be an http:// or https:// URL")
        return given
    urls = given or [MOCK_BACKEND]
    if NO_BACKEND in urls:
        if len(urls) > 1:
            raise SystemExit("--backend none cannot be combined with other --backend URLs")
        return []
    if MOCK_BACKEND in urls and len(urls) > 1:
        raise SystemExit("--backend mock cannot be combined with other --backend URLs")
    for url in urls:
        if url != MOCK_BACKEND and not url.startswith(("http://", "https://")):
            raise SystemExit(f"--backend {url!r} must be an http:// or https:// URL, or 'mock'")
    if len(set(urls)) != len(urls):
        raise SystemExit(f"--backend URLs must be distinct: {urls}")
    return urls


def core_settings(sessions: SessionsConfig) -> dict[str, Any]:
    """The SessionSettings fields of these options, validated (SystemExit on bad values);
    `sessions` has its --tito-model defaults resolved (turn_options.resolve_sessions)."""
    assert sessions.allowed_append_roles is not None and sessions.max_trim_tokens is not None
    roles = frozenset(r.strip() for r in sessions.allowed_append_roles.split(",") if r.strip())
    if not roles:
        raise SystemExit("--allowed-append-roles must name at least one role")
    if sessions.max_trim_tokens < 0:
        raise SystemExit("--max-trim-tokens must be >= 0")
    if sessions.max_rollback_steps < 1:
        raise SystemExit("--max-rollback-steps must be >= 1")
    if sessions.reclaimed_ids < 0 or sessions.reclaimed_ttl < 0:
        raise SystemExit("--reclaimed-ids and --reclaimed-ttl must be >= 0")
    if sessions.header_session_ttl < 0:
        raise SystemExit("--header-session-ttl must be >= 0")
    return {
        "allowed_append_roles": roles,
        "max_trim_tokens": sessions.max_trim_tokens,
        "max_rollback_steps": sessions.max_rollback_steps,
        "reclaimed_ids": sessions.reclaimed_ids,
        "reclaimed_ttl": sessions.reclaimed_ttl,
        "header_session_ttl": sessions.header_session_ttl,
    }


def check_session_routing(routing: SessionRoutingConfig, program: str) -> None:
    """Load the routing mode once, so a bad one stops the start with one clear message."""
    from sessiongate.session_routing import RoutingConfigError, load_mode

    try:
        load_mode(routing.mode, list(routing.options))
    except RoutingConfigError as exc:
        raise SystemExit(f"{program}: {exc}") from None
