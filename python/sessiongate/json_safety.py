"""Limits that keep a hostile JSON request body a 400 instead of a crash.

Two things in a body that `json.loads` accepts can still break code further on:

- Deep nesting. CPython's parser and every recursive walk after it (the history matchers,
  jinja's `tojson`, `json.dumps`, the Python relay twin) count against the interpreter's
  recursion limit, so 100k nested arrays raise RecursionError somewhere. Bodies nested deeper
  than `MAX_JSON_DEPTH` are refused: a RecursionError from the parser is caught, and an
  iterative walk measures what it accepted.
- Lone surrogates. A `"\\ud800"` escape (or the UTF-8 bytes of a surrogate, which
  `json.loads` takes with "surrogatepass") gives a `str` that cannot be encoded as UTF-8: the
  tokenizer, `.encode()` and the Rust primitives all refuse it.

Import-light on purpose: the router uses these through `protocol.parse_json_object`.
"""

from __future__ import annotations

import json
import re
from typing import Any

# Deepest nesting of arrays and objects a request body may have. Equal to the Rust JSON
# scanner's limit (rust/json_scan.rs MAX_DEPTH), so no accepted body falls back to the slower
# Python twin for depth alone, and it leaves three quarters of CPython's default recursion
# limit (1000) to the code that walks the parsed body. Real chat bodies (JSON schemas in
# `tools` included) nest a few tens of levels at most.
MAX_JSON_DEPTH = 256

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_CONTAINERS = frozenset((dict, list))
# Paths in error messages quote at most this much of each key (keys are client text).
_KEY_SHOWN = 40


class TooDeep(ValueError):
    """The document nests arrays/objects deeper than the limit."""


class NotUnicode(ValueError):
    """The document holds a string that cannot be encoded as UTF-8; `where` says which."""

    def __init__(self, where: str) -> None:
        super().__init__(f"{where} is not valid Unicode")
        self.where = where


def loads_checked(body: bytes | bytearray, limit: int = MAX_JSON_DEPTH) -> Any:
    """`json.loads(body)`, but TooDeep when it nests deeper than `limit` (however deep:
    never a RecursionError) and NotUnicode when a string in it (key or value) holds a lone
    surrogate. Other invalid text: json.loads' own ValueError."""
    try:
        document = json.loads(body)
    except RecursionError as exc:
        raise TooDeep(f"nested more than {limit} levels deep") from exc
    # Strings are only checked in bodies that can hold a surrogate at all: one needs a \u
    # escape of D800-DFFF, the bytes ED A0..ED BF (json.loads decodes UTF-8 with
    # "surrogatepass") or UTF-16/32 text. The depth walk visits containers only.
    data = bytes(body)  # the same object for bytes
    strings = (
        (b"\\" in data and _SURROGATE_ESCAPE.search(data) is not None)
        or b"\xed" in data
        or json.detect_encoding(data) not in ("utf-8", "utf-8-sig")
    )
    if not strings and _brackets_at_most(data, limit):
        # Every container opens with a [ or { byte in UTF-8 text (escapes cannot make one),
        # so with no more than `limit` of them no container can lie deeper than `limit`.
        return document
    problem = _scan(document, limit, strings=strings)
    if problem == "deep":
        raise TooDeep(f"nested more than {limit} levels deep")
    if problem == "unicode":
        raise NotUnicode(find_unencodable(document) or "a string")
    return document


def _brackets_at_most(data: bytes, limit: int) -> bool:
    """Whether `data` holds at most `limit` bytes that are [ or { (counted at C speed)."""
    opened = data.count(b"{")
    return opened <= limit and opened + data.count(b"[") <= limit


def _scan(document: Any, limit: int, *, strings: bool) -> str | None:
    """ "deep", "unicode" (only looked for when `strings`) or None: one iterative pass, no
    paths (the rare failure finds its path with a second pass)."""
    stack: list[tuple[Any, int]] = [(document, 1)]
    while stack:
        value, depth = stack.pop()
        if type(value) is dict:
            if strings and not all(map(_encodable, value)):
                return "unicode"
            items: Any = value.values()
        elif type(value) is list:
            items = value
        else:
            if strings and type(value) is str and not _encodable(value):
                return "unicode"
            continue
        if depth > limit:
            return "deep"
        if not strings and type(value) is list and len(value) > 16:
            # Long lists are mostly scalars (ids, numbers): skip them at C speed.
            if not _CONTAINERS.intersection(map(type, value)):
                continue
        for item in items:
            kind = type(item)
            if kind is dict or kind is list:
                stack.append((item, depth + 1))
            elif strings and kind is str and not _encodable(item):
                return "unicode"
    return None


def find_unencodable(document: Any) -> str | None:
    """Where the first string in `document` (key or value) is that cannot be encoded as
    UTF-8 (a lone surrogate): `messages[0].content`, `a key of tools[1]`; None if none is.
    Iterative: `document` may be as deep as the parser allowed."""
    stack: list[tuple[Any, str]] = [(document, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _encodable(value):
                return path or "the document"
        elif isinstance(value, dict):
            children = []
            for key, item in value.items():
                if not _encodable(key):
                    return f"a key of {path or 'the top-level object'}"
                shown = key if len(key) <= _KEY_SHOWN else key[:_KEY_SHOWN] + "..."
                children.append((item, f"{path}.{shown}" if path else shown))
            # Reversed so the first offending member is the one reported.
            stack.extend(reversed(children))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in reversed(list(enumerate(value))))
    return None


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def json_type(value: object) -> str:
    """The JSON name of a parsed value's type, for error messages ("a string", "null")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
