"""Pure-Python twin of the Rust shard primitives (``rust/shard.rs``).

Results, exception types and messages match the Rust implementation; see ``docs/ipc.md``
and docs/architecture.md "Wire contracts". This module is also the baseline the benchmarks compare
the Rust core against, so the hot paths avoid needless per-call work.
"""

from __future__ import annotations

import hashlib
import operator
import uuid
from collections.abc import Iterable

__all__ = [
    "MAX_SESSION_ID_LEN",
    "new_session_id",
    "shard_index",
    "shard_indices",
    "shard_key",
    "validate_session_id",
]

MAX_SESSION_ID_LEN = 256

_blake2b = hashlib.blake2b
_from_bytes = int.from_bytes


def _modulus(n: object, func: str) -> int:
    try:
        m = operator.index(n)  # type: ignore[arg-type]  # any object: a TypeError is the answer
    except TypeError:
        raise TypeError(f"{func}() argument 'n' must be int, not {type(n).__name__}") from None
    if m < 1:
        raise ValueError(f"{func}(): n must be >= 1, got {m}")
    return m


def _key_type_error(func: str, what: str, key: object) -> TypeError:
    return TypeError(f"{func}() argument {what} must be str or bytes, not {type(key).__name__}")


def shard_index(key: str | bytes, n: int) -> int:
    """blake2b-64 of ``key`` (str is UTF-8 encoded), big-endian, modulo ``n``."""
    if isinstance(key, str):
        data = key.encode()
    elif isinstance(key, bytes):
        data = key
    else:
        raise _key_type_error("shard_index", "'key'", key)
    if type(n) is not int or n < 1:
        n = _modulus(n, "shard_index")
    return _from_bytes(_blake2b(data, digest_size=8).digest(), "big") % n


def shard_indices(keys: Iterable[str | bytes], n: int) -> list[int]:
    """``[shard_index(k, n) for k in keys]``, validated once for the whole batch."""
    if isinstance(keys, (str, bytes, bytearray, memoryview)):
        # A str is iterable too, but hashing its characters one by one is never what is meant.
        raise TypeError(
            "shard_indices() argument 'keys' must be an iterable of str or bytes, "
            f"not {type(keys).__name__}"
        )
    m = _modulus(n, "shard_indices")
    out: list[int] = []
    append = out.append
    for i, key in enumerate(keys):
        if type(key) is str:
            data = key.encode()
        elif type(key) is bytes:
            data = key
        elif isinstance(key, str):
            data = key.encode()
        elif isinstance(key, bytes):
            data = bytes(key)
        else:
            raise _key_type_error("shard_indices", f"'keys' item {i}", key)
        append(_from_bytes(_blake2b(data, digest_size=8).digest(), "big") % m)
    return out


def shard_key(session_id: str) -> str:
    """The text before the first '.', or the whole id: a child shards with its root."""
    if not isinstance(session_id, str):
        raise TypeError(
            f"shard_key() argument 'session_id' must be str, not {type(session_id).__name__}"
        )
    return session_id.partition(".")[0]


def _session_id_error(session_id: str, what: str) -> ValueError | None:
    size = len(session_id)
    if not 1 <= size <= MAX_SESSION_ID_LEN:
        return ValueError(f"{what} must be 1-{MAX_SESSION_ID_LEN} characters long, got {size}")
    # Fast path: visible ASCII is exactly "ASCII, printable, no space".
    if session_id.isascii() and session_id.isprintable() and " " not in session_id:
        return None
    for pos, ch in enumerate(session_id):
        if not "!" <= ch <= "~":
            return ValueError(
                f"{what} has invalid character U+{ord(ch):04X} at position {pos}; "
                "only visible ASCII (0x21-0x7E) is allowed"
            )
    return None  # pragma: no cover - the fast path above covers valid ids


def validate_session_id(session_id: str) -> str:
    """Return ``session_id`` unchanged if it is 1-256 visible ASCII chars, else ValueError."""
    if not isinstance(session_id, str):
        raise TypeError(
            "validate_session_id() argument 'session_id' must be str, "
            f"not {type(session_id).__name__}"
        )
    err = _session_id_error(session_id, "session id")
    if err is not None:
        raise err
    return session_id


def new_session_id(parent: str | None = None) -> str:
    """A root id (uuid4 hex) or, with ``parent``, ``<root of parent>.<uuid4 hex>``."""
    if parent is None:
        return uuid.uuid4().hex
    if not isinstance(parent, str):
        raise TypeError(
            f"new_session_id() argument 'parent' must be str or None, not {type(parent).__name__}"
        )
    err = _session_id_error(parent, "parent session id")
    if err is not None:
        raise err
    root = parent.partition(".")[0]
    if len(root) + 33 > MAX_SESSION_ID_LEN:
        raise ValueError(
            f"parent session id's root part is {len(root)} characters long; a child id "
            f"(root + '.' + 32 hex) would exceed {MAX_SESSION_ID_LEN} characters"
        )
    return f"{root}.{uuid.uuid4().hex}"
