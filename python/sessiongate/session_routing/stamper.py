"""Per-worker glue between the session core and a routing mode: finality and branch headers
from the client, the family registry, stamping each upstream turn, and on_session_end exactly
once per session."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from sessiongate.errors import BadRequest
from sessiongate.session_routing.base import RoutingContext, SessionRoutingMode
from sessiongate.session_routing.families import SessionFamilyRegistry

logger = logging.getLogger(__name__)

# A client marks the last turn of a session with either header set to "true".
FINAL_TURN_HEADERS = ("x-session-final", "x-dynamo-session-final")
# "N" (N >= 1 children) or "true" (some, count unknown) on a turn that spawns sub-agents.
BRANCH_HEADER = "x-session-branch"
_TRUE = frozenset({"true", "1", "yes"})
_FALSE = frozenset({"false", "0", "no", ""})


def _header(headers: Sequence[tuple[str, str]], name: str) -> str | None:
    return next((v for k, v in headers if k.lower() == name), None)


def is_final_turn(headers: Sequence[tuple[str, str]]) -> bool:
    for name in FINAL_TURN_HEADERS:
        value = _header(headers, name)
        if value is not None and value.strip().lower() in _TRUE:
            return True
    return False


def branch_declaration(headers: Sequence[tuple[str, str]]) -> tuple[bool, int | None]:
    """(declared, count): count None means "some children, number unknown"."""
    value = _header(headers, BRANCH_HEADER)
    if value is None or value.strip().lower() in _FALSE:
        return False, None
    text = value.strip().lower()
    # A number is a child count ("1" is one child, not "true").
    if text.isdigit() and int(text) >= 1:
        return True, int(text)
    if text in _TRUE:
        return True, None
    raise BadRequest(f"header X-Session-Branch must be 'true' or a child count >= 1, not {value!r}")


class SessionStamper:
    def __init__(self, mode: SessionRoutingMode) -> None:
        self.mode = mode
        self.families = SessionFamilyRegistry()
        self.ended = 0
        # The mode's rewrite of encoded bodies, if it has one (dynamo_nvext): the server then
        # splices into the bytes instead of re-serialising the parsed body.
        body_bytes = getattr(mode, "transform_body_bytes", None) if mode.mutates_body else None
        self._body_bytes: Callable[[bytes, RoutingContext], bytes] | None = (
            body_bytes if callable(body_bytes) else None
        )

    def register(self, session_id: str, parent_id: str | None) -> None:
        self.families.register(session_id, parent_id)

    def begin_turn(
        self, session_id: str, headers: Sequence[tuple[str, str]]
    ) -> tuple[RoutingContext, bool]:
        declared, count = branch_declaration(headers)
        if declared:
            self.families.declare_branch(session_id, count)
        final = is_final_turn(headers)
        return self.families.context_for(session_id, is_final_turn=final), final

    @property
    def mutates_body(self) -> bool:
        return self.mode.mutates_body

    def headers(self, ctx: RoutingContext) -> list[tuple[str, str]]:
        return list(self.mode.headers(ctx).items())

    def transform(self, body: dict[str, Any], ctx: RoutingContext) -> dict[str, Any]:
        """The mode's body rewrite (a new object; the caller's is untouched)."""
        return self.mode.transform_body(body, ctx) if self.mode.mutates_body else body

    @property
    def has_bytes_path(self) -> bool:
        """True when `transform_bytes` rewrites (the mode has `transform_body_bytes`)."""
        return self._body_bytes is not None

    def transform_bytes(self, body: bytes, ctx: RoutingContext) -> bytes | None:
        """The mode's body rewrite on the encoded JSON body (new bytes), or None when the mode
        has no bytes path (use `transform` on the parsed body then)."""
        return self._body_bytes(body, ctx) if self._body_bytes is not None else None

    def finish_turn(self, session_id: str, *, final: bool, succeeded: bool) -> None:
        # A final turn that failed may be retried by the client: not final yet.
        if self.families.finish_turn(session_id, final=final and succeeded):
            self._ended(session_id)

    def end(self, session_id: str) -> None:
        if session_id in self.families and self.families.end_session(session_id):
            self._ended(session_id)

    def release_all(self) -> None:
        for session_id in self.families.release_all():
            self._ended(session_id)

    def _ended(self, session_id: str) -> None:
        self.ended += 1
        try:
            self.mode.on_session_end(session_id)
        except Exception:  # a plugin's hook must not break session bookkeeping
            logger.exception(
                "routing mode %s: on_session_end(%s) failed", self.mode.name, session_id
            )
