"""The in-process gateway for embedding: one session core behind the ASGI front end, built by
the same factory as every layout's core."""

from __future__ import annotations

from collections.abc import Sequence

from sessiongate.front.asgi import FrontendSettings, GatewayApp
from sessiongate.session.core import SessionCore
from sessiongate.session.core_config import CoreConfig
from sessiongate.session.factory import build_core
from sessiongate.session.settings import SessionSettings
from sessiongate.tokenizer import ChatTokenizer


def app_for(
    config: CoreConfig,
    frontend_settings: FrontendSettings | None = None,
    *,
    tokenizer: ChatTokenizer | None = None,
) -> tuple[GatewayApp, SessionCore]:
    """The gateway app over a core built from `config` (routing mode, records store and
    all), and that core (close it on shutdown)."""
    core = build_core(config, tokenizer=tokenizer)
    return GatewayApp(core.handle, frontend_settings), core


def create_app(
    tokenizer: ChatTokenizer,
    backend_urls: str | Sequence[str],
    *,
    session_settings: SessionSettings | None = None,
    frontend_settings: FrontendSettings | None = None,
    upstream_timeout: float = 600.0,
) -> tuple[GatewayApp, SessionCore]:
    """The gateway app and the core it hands requests to (close the core on shutdown)."""
    config = CoreConfig(
        settings=session_settings or SessionSettings(),
        engine_urls=(backend_urls,) if isinstance(backend_urls, str) else tuple(backend_urls),
        timeout=upstream_timeout,
    )
    return app_for(config, frontend_settings, tokenizer=tokenizer)
