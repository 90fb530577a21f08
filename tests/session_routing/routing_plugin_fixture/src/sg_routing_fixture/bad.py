"""Plugins that break the contract; the loader must refuse each with a clear message."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from sessiongate.session_routing import RoutingContext, SessionRoutingMode


class LyingMode(SessionRoutingMode):
    """Rewrites bodies but says it does not (the server would skip transform_body)."""

    name = "fixture_lying"
    mutates_body = False

    def headers(self, ctx: RoutingContext) -> dict[str, str]:
        return {}

    def transform_body(self, body: dict[str, Any], ctx: RoutingContext) -> dict[str, Any]:
        return {**body, "lie": True}


class ClaimsBodyMode(SessionRoutingMode):
    """Says it rewrites bodies but inherits the identity transform_body."""

    name = "fixture_claims_body"
    mutates_body = True

    def headers(self, ctx: RoutingContext) -> dict[str, str]:
        return {}


class LaxOptionsMode(SessionRoutingMode):
    """Options that would silently accept unknown keys."""

    name = "fixture_lax"

    class Options(BaseModel):
        x: int = 1

    def headers(self, ctx: RoutingContext) -> dict[str, str]:
        return {}


class NoHeadersMode(SessionRoutingMode):
    """Forgets to implement the abstract headers()."""

    name = "fixture_no_headers"


NOT_A_MODE = object()
