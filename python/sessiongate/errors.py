"""Every error the gateway answers over HTTP, each with its status (docs/api.md).

One module, so a status has one class wherever it is raised (the front's routing, the engine
routes, the session core, the records store) and a handler can catch a whole family
(`NotFound`) without knowing which part raised it. The exceptions shared with the Rust core
are apart, in `primitives/errors.py`: they are not HTTP answers.
"""

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


class NotFound(GatewayError):
    """404: the thing a request names does not exist (a route, an engine, a session)."""

    status = 404


class SessionNotFound(NotFound):
    """No such session: never created, deleted, expired, or closing."""


class RouteNotFound(NotFound):
    """No route answers this method and path in this process."""


class EngineNotFound(NotFound):
    """No engine of the registry has this id or URL (the engine management routes)."""


class SessionGone(GatewayError):
    """410: the session existed and was deleted (reclaimed by its trainer) recently; a late
    turn should stop, not retry (session/reclaimed.py)."""

    status = 410


class MethodNotAllowed(GatewayError):
    """The path exists but not with this method; the message names the ones it takes."""

    status = 405


class BodyTimeout(GatewayError):
    """The client stopped sending its body: answered 408 and the connection closed."""

    status = 408


class Conflict(GatewayError):
    """The session's state cannot take this turn (tree mode: a path cut off at the length
    limit, or a tree at its node cap); resending the same request cannot succeed."""

    status = 409


class PayloadTooLarge(GatewayError):
    status = 413


class MatcherError(GatewayError):
    """A matcher loaded by import path raised or returned a non-bool: a configuration error
    (500), never a match or a mismatch."""

    status = 500


class RecordsFileError(GatewayError):
    """A record's file could not be read (removed underneath, an I/O error)."""

    status = 500


class StoreWriteFailed(GatewayError):
    """The records directory refused a write (disk full, permissions): nothing recorded."""

    status = 507


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
