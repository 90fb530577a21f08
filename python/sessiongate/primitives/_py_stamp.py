"""Pure-Python twin of the session routing stamping primitives (``rust/stamp.rs``).

Same results, exception classes and messages as the Rust core (docs/routing.md, "Stamping in
Rust"):

- :class:`HeaderStamper`: header names per tier, validated once with the rules of
  ``primitives/header_names.py``; :meth:`HeaderStamper.stamp` builds one request's headers.
- :func:`nvext_session_control`: the request JSON with ``nvext.session_control`` set
  (``json.loads`` + merge + ``json.dumps`` here; a byte splice in the Rust core, which
  parses equal, and is byte-equal for compact bodies without duplicate keys).
"""

from __future__ import annotations

import json
import operator
import sys
from collections.abc import Sequence
from typing import Any

from ._py_relay import _BytesLike, _encode, _kind, _loadable, _view
from .errors import RequestRewriteError
from .header_names import validate_header_name

__all__ = ["HeaderStamper", "nvext_session_control"]

_TIERS = ("session", "parent", "root")


def _tier_names(names: object, tier: str) -> tuple[str, ...]:
    if not isinstance(names, list | tuple):
        raise TypeError(
            f"HeaderStamper() argument '{tier}' must be a list or tuple of str, not "
            f"{type(names).__name__}"
        )
    out = []
    for index, name in enumerate(names):
        if not isinstance(name, str):
            raise TypeError(
                f"HeaderStamper() argument '{tier}' item {index} must be str, not "
                f"{type(name).__name__}"
            )
        validate_header_name(name)
        out.append(sys.intern(str(name)))
    return tuple(out)


def _check_unique(tiers: Sequence[tuple[str, ...]]) -> None:
    """Same rule and message as ``IdentityHeaders.Options``: one job per name, compared
    case-insensitively."""
    seen: dict[str, tuple[str, str]] = {}
    for tier, names in zip(_TIERS, tiers, strict=True):
        for name in names:
            prior = seen.get(name.lower())
            if prior is not None:
                prior_tier, prior_name = prior
                where = f"twice in {tier}" if prior_tier == tier else f"in {prior_tier} and {tier}"
                raise ValueError(
                    f"header name {name!r} appears {where} (as {prior_name!r} and {name!r}; "
                    "names are compared case-insensitively); give each header one job"
                )
            seen[name.lower()] = (tier, name)


class HeaderStamper:
    """Header names per tier, validated once; :meth:`stamp` builds one request's headers."""

    __slots__ = ("_parent", "_root", "_session")

    def __init__(self, session: Sequence[str], parent: Sequence[str], root: Sequence[str]) -> None:
        tiers = (
            _tier_names(session, "session"),
            _tier_names(parent, "parent"),
            _tier_names(root, "root"),
        )
        _check_unique(tiers)
        self._session, self._parent, self._root = tiers

    @property
    def session(self) -> tuple[str, ...]:
        """Names that carry the session id."""
        return self._session

    @property
    def parent(self) -> tuple[str, ...]:
        """Names that carry the parent id (child sessions only)."""
        return self._parent

    @property
    def root(self) -> tuple[str, ...]:
        """Names that carry the root id."""
        return self._root

    def stamp(self, session_id: str, parent_id: str | None, root_id: str) -> dict[str, str]:
        """A new dict: ``session_id`` under every session name, ``parent_id`` under every
        parent name unless it is None, ``root_id`` under every root name."""
        if not isinstance(session_id, str):
            raise TypeError(
                f"stamp() argument 'session_id' must be str, not {type(session_id).__name__}"
            )
        if parent_id is not None and not isinstance(parent_id, str):
            raise TypeError(
                f"stamp() argument 'parent_id' must be str or None, not {type(parent_id).__name__}"
            )
        if not isinstance(root_id, str):
            raise TypeError(f"stamp() argument 'root_id' must be str, not {type(root_id).__name__}")
        out = dict.fromkeys(self._session, session_id)
        if parent_id is not None:
            for name in self._parent:
                out[name] = parent_id
        for name in self._root:
            out[name] = root_id
        return out

    def __repr__(self) -> str:
        return (
            f"HeaderStamper(session={self._session!r}, parent={self._parent!r}, "
            f"root={self._root!r})"
        )


def nvext_session_control(
    body: _BytesLike, session_id: str, action: str, timeout: int | None
) -> bytes:
    """The request JSON with ``nvext.session_control`` carrying ``session_id``, ``action``
    and, unless ``timeout`` is None, ``timeout``.

    The mode's keys replace the same keys of a ``session_control`` the client sent (and move
    to its end); its other keys and the other ``nvext`` keys survive; a ``nvext`` or
    ``session_control`` that is not an object is replaced by one; a missing ``nvext`` is
    added as the last member. Written like ``json.dumps(separators=(",", ":"),
    ensure_ascii=False)``.
    """
    view = _view(body, "nvext_session_control", "body")
    if not isinstance(session_id, str):
        raise TypeError(
            "nvext_session_control() argument 'session_id' must be str, not "
            f"{type(session_id).__name__}"
        )
    if not isinstance(action, str):
        raise TypeError(
            f"nvext_session_control() argument 'action' must be str, not {type(action).__name__}"
        )
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, int):
            raise TypeError(
                "nvext_session_control() argument 'timeout' must be int or None, not "
                f"{type(timeout).__name__}"
            )
        timeout = operator.index(timeout)  # an exact int (json.dumps writes it the same)
    try:
        document = json.loads(_loadable(body, view))
    except ValueError as exc:
        raise RequestRewriteError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise RequestRewriteError(f"request body must be a JSON object, got {_kind(document)}")
    nvext = document.get("nvext")
    if not isinstance(nvext, dict):
        nvext = {}
    control: Any = nvext.get("session_control")
    written = ("session_id", "action") if timeout is None else ("session_id", "action", "timeout")
    if isinstance(control, dict):
        control = {k: v for k, v in control.items() if k not in written}
    else:
        control = {}
    control["session_id"] = session_id
    control["action"] = action
    if timeout is not None:
        control["timeout"] = timeout
    nvext["session_control"] = control
    document["nvext"] = nvext
    return _encode(document)
