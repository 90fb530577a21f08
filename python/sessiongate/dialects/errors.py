"""The one refusal a dialect conversion raises.

A dialect module is pure (a request body in, a chat body out), so it cannot answer HTTP
itself: it raises `DialectError`, and the route that called it renders the dialect's own
error envelope (for the OpenAI Responses dialect `responses.error_body`). The fields are
kept to `status`, `error_type` and `message` (plus the optional `param` the OpenAI
envelopes carry) so that every dialect shares this one class.
"""

from __future__ import annotations


class DialectError(Exception):
    """A request the dialect refuses: HTTP `status`, the envelope's `error_type`, `message`,
    and the request field at fault (`param`, None when no one field is)."""

    def __init__(
        self, status: int, error_type: str, message: str, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message
        self.param = param

    def __repr__(self) -> str:
        return f"DialectError({self.status}, {self.error_type!r}, {self.message!r})"
