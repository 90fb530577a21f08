"""The in-process gateway: one session core behind the ASGI front end."""

from __future__ import annotations

from collections.abc import Sequence

from sessiongate.front.asgi import FrontendSettings, GatewayApp
from sessiongate.session.core import SessionCore
from sessiongate.session.settings import SessionSettings
from sessiongate.tokenizer import ChatTokenizer
from sessiongate.upstream import UpstreamPool


def create_app(
    tokenizer: ChatTokenizer,
    backend_urls: str | Sequence[str],
    *,
    session_settings: SessionSettings | None = None,
    frontend_settings: FrontendSettings | None = None,
    upstream_timeout: float = 600.0,
) -> tuple[GatewayApp, SessionCore]:
    """The gateway app and the core it hands requests to (close the core on shutdown)."""
    core = SessionCore(
        tokenizer,
        UpstreamPool(
            [backend_urls] if isinstance(backend_urls, str) else list(backend_urls),
            timeout=upstream_timeout,
        ),
        session_settings,
    )
    return GatewayApp(core.handle, frontend_settings), core
