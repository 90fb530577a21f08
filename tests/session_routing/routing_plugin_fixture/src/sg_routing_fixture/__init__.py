"""A third-party routing mode as a plugin author would write it (test fixture)."""

from __future__ import annotations

from typing import cast

from pydantic import Field

from sessiongate.session_routing import RoutingContext, RoutingOptions, SessionRoutingMode


class TraceHeader(SessionRoutingMode):
    name = "fixture_trace"
    description = "test plugin: X-Fixture-Trace: <prefix><root>/<session>"

    class Options(RoutingOptions):
        prefix: str = Field(default="", description="text put before the ids")
        upper: bool = Field(default=False, description="upper-case the value")

    def __init__(self, options: RoutingOptions | None = None) -> None:
        super().__init__(options)
        opts = cast(TraceHeader.Options, self.options)
        self._prefix = opts.prefix
        self._upper = opts.upper
        self.ended: list[str] = []

    def headers(self, ctx: RoutingContext) -> dict[str, str]:
        value = f"{self._prefix}{ctx.root_session_id}/{ctx.session_id}"
        return {"X-Fixture-Trace": value.upper() if self._upper else value}

    def on_session_end(self, session_id: str) -> None:
        self.ended.append(session_id)


class ContextHeader(SessionRoutingMode):
    """Exposes the whole routing context in one header, so tests can see the finality flags
    the server computed for every upstream request."""

    name = "fixture_context"
    description = "test plugin: X-Fixture-Context: <the routing context as JSON>"

    def headers(self, ctx: RoutingContext) -> dict[str, str]:
        import dataclasses
        import json

        return {"X-Fixture-Context": json.dumps(dataclasses.asdict(ctx), sort_keys=True)}
