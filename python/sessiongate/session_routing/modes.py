"""The five built-in session routing modes and their wire formats (see docs/routing.md).

Their stamping runs in the primitives (Rust core, or the Python twins): every header mode is
a `HeaderStamper`, and `dynamo_nvext` also splices its member into encoded bodies with
`nvext_session_control` (`transform_body_bytes`, used by the server).
"""

from __future__ import annotations

from typing import Any, cast

from pydantic import Field, field_validator, model_validator

from sessiongate.primitives import HeaderStamper, nvext_session_control
from sessiongate.primitives.header_names import split_header_names, validate_header_name
from sessiongate.session_routing.base import RoutingContext, RoutingOptions, SessionRoutingMode

DYNAMO_SESSION_HEADER = "X-Dynamo-Session-ID"
DYNAMO_PARENT_HEADER = "X-Dynamo-Parent-Session-ID"
SMG_ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
DEFAULT_SESSION_HEADER = "X-Session-ID"


class DynamoHeaders(SessionRoutingMode):
    name = "dynamo_headers"
    description = (
        "NVIDIA Dynamo session affinity headers: X-Dynamo-Session-ID, plus "
        "X-Dynamo-Parent-Session-ID on child sessions"
    )

    def __init__(self, options: RoutingOptions | None = None) -> None:
        super().__init__(options)
        self._stamp = HeaderStamper([DYNAMO_SESSION_HEADER], [DYNAMO_PARENT_HEADER], []).stamp

    def headers(self, ctx: RoutingContext) -> dict[str, str]:
        return self._stamp(ctx.session_id, ctx.parent_session_id, ctx.root_session_id)


class DynamoNvext(SessionRoutingMode):
    name = "dynamo_nvext"
    description = (
        "NVIDIA Dynamo body extension: nvext.session_control binds the session on every "
        "non-final turn and closes it on the final one"
    )
    mutates_body = True

    class Options(RoutingOptions):
        timeout_seconds: int = Field(
            default=300,
            ge=1,
            description="session_control timeout sent with every bind (seconds, >= 1)",
        )

    def __init__(self, options: RoutingOptions | None = None) -> None:
        super().__init__(options)
        self._timeout = cast(DynamoNvext.Options, self.options).timeout_seconds

    def headers(self, ctx: RoutingContext) -> dict[str, str]:
        return {}

    def transform_body_bytes(self, body: bytes, ctx: RoutingContext) -> bytes:
        """`transform_body` on the encoded body: the same result (parse-equal), spliced into
        the bytes instead of re-serialising the whole body (RequestRewriteError if `body` is
        not a JSON object)."""
        if ctx.is_final_turn:
            return nvext_session_control(body, ctx.session_id, "close", None)
        return nvext_session_control(body, ctx.session_id, "bind", self._timeout)

    def transform_body(self, body: dict[str, Any], ctx: RoutingContext) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise TypeError(f"dynamo_nvext needs a JSON object body, got {type(body).__name__}")
        # Copy only the containers on the path we write (body -> nvext -> session_control):
        # the caller's objects stay untouched and big siblings (messages) are not copied.
        nvext = body.get("nvext")
        new_nvext: dict[str, Any] = dict(nvext) if isinstance(nvext, dict) else {}
        control = new_nvext.get("session_control")
        new_control: dict[str, Any] = dict(control) if isinstance(control, dict) else {}
        new_control["session_id"] = ctx.session_id
        if ctx.is_final_turn:
            new_control["action"] = "close"
        else:
            new_control["action"] = "bind"
            new_control["timeout"] = self._timeout
        new_nvext["session_control"] = new_control
        new_body = dict(body)
        new_body["nvext"] = new_nvext
        return new_body


class SmgRoutingKey(SessionRoutingMode):
    name = "smg_routing_key"
    description = (
        "SGLang Model Gateway routing key header X-SMG-Routing-Key (manual / consistent-hash "
        "policies, sticky sessions)"
    )

    def __init__(self, options: RoutingOptions | None = None) -> None:
        super().__init__(options)
        self._stamp = HeaderStamper([SMG_ROUTING_KEY_HEADER], [], []).stamp

    def headers(self, ctx: RoutingContext) -> dict[str, str]:
        return self._stamp(ctx.session_id, ctx.parent_session_id, ctx.root_session_id)


class SessionIdHeader(SessionRoutingMode):
    name = "session_id_header"
    description = "the session id in one configurable header"

    class Options(RoutingOptions):
        header_name: str = Field(
            default=DEFAULT_SESSION_HEADER,
            description="header that carries the session id (an RFC 9110 token)",
        )

        @field_validator("header_name", mode="before")
        @classmethod
        def _strip(cls, value: object) -> object:
            return value.strip() if isinstance(value, str) else value

        @field_validator("header_name")
        @classmethod
        def _token(cls, value: str) -> str:
            return validate_header_name(value)

    def __init__(self, options: RoutingOptions | None = None) -> None:
        super().__init__(options)
        header = cast(SessionIdHeader.Options, self.options).header_name
        self._stamp = HeaderStamper([header], [], []).stamp

    def headers(self, ctx: RoutingContext) -> dict[str, str]:
        return self._stamp(ctx.session_id, ctx.parent_session_id, ctx.root_session_id)


_TIERS = ("session", "parent", "root")


class IdentityHeaders(SessionRoutingMode):
    name = "identity_headers"
    description = (
        "session, parent and root ids under any header names you choose "
        "(parent headers only on child sessions)"
    )

    class Options(RoutingOptions):
        session: tuple[str, ...] = Field(
            default=(), description="headers that carry the session id (comma list)"
        )
        parent: tuple[str, ...] = Field(
            default=(),
            description="headers that carry the parent session id, sent only by children",
        )
        root: tuple[str, ...] = Field(
            default=(), description="headers that carry the root session id (comma list)"
        )

        @field_validator(*_TIERS, mode="before")
        @classmethod
        def _split(cls, value: object) -> object:
            if isinstance(value, str | list | tuple):
                return split_header_names(value)
            return value

        @field_validator(*_TIERS)
        @classmethod
        def _tokens(cls, value: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(validate_header_name(n) for n in value)

        @model_validator(mode="after")
        def _unique_and_present(self) -> IdentityHeaders.Options:
            tiers = {tier: getattr(self, tier) for tier in _TIERS}
            if not any(tiers.values()):
                raise ValueError(
                    "identity_headers needs at least one header name: set session=, parent= "
                    "and/or root= (e.g. session=X-Session-ID)"
                )
            seen: dict[str, tuple[str, str]] = {}
            for tier, names in tiers.items():
                for name in names:
                    prior = seen.get(name.lower())
                    if prior is not None:
                        prior_tier, prior_name = prior
                        where = (
                            f"twice in {tier}"
                            if prior_tier == tier
                            else f"in {prior_tier} and {tier}"
                        )
                        raise ValueError(
                            f"header name {name!r} appears {where} (as {prior_name!r} and "
                            f"{name!r}; names are compared case-insensitively); give each "
                            "header one job"
                        )
                    seen[name.lower()] = (tier, name)
            return self

    def __init__(self, options: RoutingOptions | None = None) -> None:
        super().__init__(options)
        opts = cast(IdentityHeaders.Options, self.options)
        self._stamp = HeaderStamper(opts.session, opts.parent, opts.root).stamp

    def headers(self, ctx: RoutingContext) -> dict[str, str]:
        return self._stamp(ctx.session_id, ctx.parent_session_id, ctx.root_session_id)


BUILTIN_MODES: dict[str, type[SessionRoutingMode]] = {
    cls.name: cls
    for cls in (DynamoHeaders, DynamoNvext, SmgRoutingKey, SessionIdHeader, IdentityHeaders)
}
