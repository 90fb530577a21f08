"""The contract between the gateway and a session routing mode.

A mode turns a `RoutingContext` (who is asking, where in its session family, how final) into
the headers and/or body rewrite a router in front of the engines understands. One mode
instance serves a whole worker, so modes must be cheap per call and keep no per-request
state; per-session state, if any, is released in `on_session_end`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


@dataclass(frozen=True, slots=True)
class RoutingContext:
    """What a mode knows about the turn being stamped.

    `is_parent_final` is None for roots and when the parent is unknown; `is_family_final` is
    False whenever finality of the whole family cannot be proven (see docs/routing.md).
    """

    session_id: str
    parent_session_id: str | None
    root_session_id: str
    is_final_turn: bool = False
    is_parent_final: bool | None = None
    is_family_final: bool = False

    @classmethod
    def for_root(cls, session_id: str, *, is_final_turn: bool = False) -> RoutingContext:
        """Context of a session that is known to be its family's root and to have no children.

        Such a family is final exactly when this turn is (no family registry needed).
        """
        return cls(
            session_id=session_id,
            parent_session_id=None,
            root_session_id=session_id,
            is_final_turn=is_final_turn,
            is_parent_final=None,
            is_family_final=is_final_turn,
        )

    @property
    def is_tree_final(self) -> bool:
        """The earlier name of `is_family_final`, kept for plugins written against it."""
        return self.is_family_final


class RoutingOptions(BaseModel):
    """Base of every mode's `Options`: unknown keys are errors, instances are immutable.

    Validators should coerce and canonicalise (split comma strings, strip) so modes read
    ready-to-use values on the hot path.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)


class SessionRoutingMode(ABC):
    """Base class of built-in and third-party routing modes.

    Subclasses set `name` (the value of `--session-routing`), `description` (one line for
    `sessiongate plugins`), `mutates_body`, and a nested `Options` model derived from
    `RoutingOptions`. `mutates_body` must be True exactly when the class overrides
    `transform_body`: the loader refuses a mode that says otherwise, because the server
    skips `transform_body` (and its body re-encoding) for modes that declare False.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    mutates_body: ClassVar[bool] = False
    Options: ClassVar[type[RoutingOptions]] = RoutingOptions

    def __init__(self, options: RoutingOptions | None = None) -> None:
        if options is None:
            options = self.Options()
        elif not isinstance(options, self.Options):
            raise TypeError(
                f"{type(self).__name__} expects {self.Options.__qualname__}, "
                f"got {type(options).__qualname__}"
            )
        self.options = options

    @abstractmethod
    def headers(self, ctx: RoutingContext) -> dict[str, str]:
        """Headers to add to the upstream request of this turn (a new dict each call)."""

    def transform_body(self, body: dict[str, Any], ctx: RoutingContext) -> dict[str, Any]:
        """Return the body to send upstream; never mutate `body` or anything inside it.

        Overriders return a new top-level object and copy every container on the path they
        change; untouched sub-structures may be shared with the input (treat both as
        read-only). The base implementation is the identity and is never called by the
        server for modes with `mutates_body = False`.
        """
        return body

    def on_session_end(self, session_id: str) -> None:  # noqa: B027 - optional hook
        """Called exactly once per session when it ends (final turn, DELETE, lost, shutdown)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.options!r}>"
