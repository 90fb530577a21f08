"""HTTP header-name rules shared by the routing modes' option models.

Header names come from the command line, so they are checked once at startup: a name that is
not an RFC 9110 token would be rejected (or worse, smuggled) by the HTTP client on every
request, and a name the gateway sets itself would corrupt the upstream request.
"""

from __future__ import annotations

import string
from collections.abc import Iterable

# RFC 9110 section 5.6.2: token = 1*tchar.
_TCHARS = frozenset("!#$%&'*+-.^_`|~" + string.ascii_letters + string.digits)

# Names the gateway (or the HTTP client) owns on every upstream request; stamping them
# would break framing or hop-by-hop semantics, so a mode may not use them.
RESERVED_HEADER_NAMES = frozenset(
    {
        "connection",
        "content-length",
        "content-type",
        "expect",
        "host",
        "http2-settings",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)


def is_token(value: str) -> bool:
    """True when `value` is an RFC 9110 token (non-empty, tchar only)."""
    return bool(value) and all(c in _TCHARS for c in value)


def validate_header_name(name: str) -> str:
    """Return `name` unchanged when it may be stamped; raise ValueError saying why not.

    The spelling is kept as given (some routers are case-sensitive in practice even though
    HTTP is not); comparisons elsewhere are case-insensitive.
    """
    if not name:
        raise ValueError("header name is empty")
    if not is_token(name):
        bad = sorted({c for c in name if c not in _TCHARS})
        shown = ", ".join(repr(c) for c in bad)
        raise ValueError(
            f"header name {name!r} is not an RFC 9110 token (offending characters: {shown}); "
            "use letters, digits and !#$%&'*+-.^_`|~ only"
        )
    if name.lower() in RESERVED_HEADER_NAMES:
        raise ValueError(
            f"header name {name!r} is set by the gateway itself and cannot carry session identity"
        )
    return name


def split_header_names(value: str | Iterable[str]) -> tuple[str, ...]:
    """Canonicalise a comma string or a sequence of names into a stripped tuple.

    An empty or blank string means "no names". An empty item inside a list (`a,,b`, a
    trailing comma) is an error rather than silently dropped: it is usually a typo.
    """
    if isinstance(value, str):
        if not value.strip():
            return ()
        items: list[str] = value.split(",")
    else:
        items = []
        for item in value:
            if not isinstance(item, str):
                raise ValueError(f"header names must be strings, got {item!r}")
            items.append(item)
    names = tuple(item.strip() for item in items)
    if any(not n for n in names):
        raise ValueError(f"empty header name in {value!r}; remove the stray comma")
    return names
