"""Errors the session core raises; each carries its HTTP status (docs/api.md)."""

from __future__ import annotations


class GatewayError(Exception):
    """An error answered as `{"error": message}` with `status`."""

    status: int = 500

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status


class BadRequest(GatewayError):
    """Malformed JSON, a bad field, a non-append-only history, a deep rollback."""

    status = 400


class Unauthorized(GatewayError):
    status = 401


class SessionNotFound(GatewayError):
    status = 404


class Conflict(GatewayError):
    """The session's state cannot take this turn (tree mode: a path cut off at the length
    limit, or a tree at its node cap); resending the same request cannot succeed."""

    status = 409


class PayloadTooLarge(GatewayError):
    status = 413


class TitoMismatch(GatewayError):
    """The new token sequence does not extend the stored checkpoint."""

    status = 500


class UpstreamError(GatewayError):
    """A transport error talking to the upstream, or a 200 that breaks the contract."""

    status = 502


class SamplesError(GatewayError):
    """A session's records cannot be assembled into training samples (the rollout
    framework answers these with 422 and the assertion text)."""

    status = 422


class Unavailable(GatewayError):
    status = 503


class LimitReached(GatewayError):
    """A worker limit refused the request (docs/reliability.md, "Limits"); answered with a
    `Retry-After` header, since room comes back once clients delete finished sessions."""

    # Seconds a client should wait before retrying (the `Retry-After` header).
    retry_after: int = 5


class TooManySessions(LimitReached):
    """Creating one more session would pass `--max-sessions`."""

    status = 429


class RecordsBudgetFull(LimitReached):
    """The worker's records hold `--max-records-bytes` or more: no new turn until some go."""

    status = 503
