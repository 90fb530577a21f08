"""The worker-selector grammar of smg 1.13's RL control plane (`?selector=S`).

`GET|POST /v1/rl/engine/{path}?selector=S` on smg (the Shepherd Model Gateway) 1.13.0 fans a
call out to every engine matching S. sessiongate serves the same route, so a client written
against smg must get the same answer from both: the same selectors parse, the same ones are
refused with the same message and byte offset, and a parsed selector picks the same engines.
This module is the grammar and the matching rule only. It was learned from the real smg
1.13.0 binary (its observed answers are pinned in tests/rl/test_selector.py); it is not smg's
code.

Grammar (`,` is AND; whitespace is allowed around every token):

    selector    := ws requirement ws ("," ws requirement ws)*
    requirement := key ws "=" ws value
                 | key ws "!=" ws value
                 | key ws "in" ws "(" ws value ws ("," ws value ws)* ")"
                 | key ws "notin" ws "(" ws value ws ("," ws value ws)* ")"
    key         := one or more characters, none whitespace or one of  = ! , ( ) "
    value       := unquoted | quoted
    unquoted    := one or more characters, none whitespace or one of  , ( )
                   (so `a=b=c` is key `a`, value `b=c`; `'x'` is the three characters 'x')
    quoted      := '"' (any character but '"' and '\\' | '\\"' | '\\\\')* '"'

`in` and `notin` are words: the run of key characters after the key (and its whitespace)
must be exactly one of them, so `a in(b)` parses and `ain (b)` is the key `ain` followed by
no operator. Keys and values are case-sensitive.

Matching: `k=v` holds iff k is present with value v; `k!=v` iff k is absent or has another
value; `k in (...)` iff k is present with one of the values; `k notin (...)` iff k is absent
or has none of them. Which keys a worker has (smg: engine, model, worker_type, health,
weight_version, url, id, role when set, and the worker's labels; not `model_id`) is the
caller's business: `Selector.matches` takes the worker's fields as a mapping.

Errors are `SelectorError`, whose message is smg's exactly: "invalid selector at byte N:
<reason>", N a UTF-8 byte offset into the selector. The offset is where the parser stood when
it failed, after skipping whitespace: the first character that is not what was expected
(the end of the selector when it ran out; for `expected operator`, the start of what stands
where the operator should be: the `!` of `a!b`). An empty or whitespace-only selector is
answered `selector_required` instead: `selector_is_blank` tells the caller to do that
(`parse_selector` on such text raises "expected key" at the end).

Readings the observed answers do not decide (chosen to be consistent with them):
- Whitespace is Rust's `char::is_whitespace` (Unicode White_Space), not Python's
  `str.isspace` (which also takes U+001C..U+001F) and not ASCII only: smg is Rust, and
  only ASCII spaces were probed.
- An invalid escape is reported just after the escaped character (smg: `a="x\\q"` at byte 6),
  measured after the whole character when it is not ASCII. A backslash that ends the
  selector is "unterminated quoted value" at the end.
- `""` is a value (the empty string), in `=`, `!=` and lists alike.
- A `"` inside an unquoted value is an ordinary character (`a=b"c` is the value `b"c`).
- "expected key after `,`" is only for a selector that ends (whitespace aside) after a
  comma, at the end; a comma followed by anything else that is not a key is "expected key"
  (smg: `a=b,` at byte 4; `engine=sglang,,a=b` "expected key" at byte 14).
- A lone surrogate (not valid UTF-8; a percent-decoded query string never has one) counts
  as the 3 bytes "surrogatepass" gives it.
- Whitespace-only is `selector_required` (from smg's contract as the plane was briefed;
  smg's notes show only its message, "a non-empty `selector` query parameter is required").
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "Operator",
    "Requirement",
    "Selector",
    "SelectorError",
    "parse_selector",
    "selector_is_blank",
]

# Rust's `char::is_whitespace`: the Unicode White_Space property.
_WHITESPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680"
    "\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)
_NOT_IN_KEY = frozenset('=!,()"')
_NOT_IN_VALUE = frozenset(",()")

EXPECTED_KEY = "expected key"
EXPECTED_OPERATOR = "expected operator (`=`, `!=`, `in`, `notin`)"
EXPECTED_VALUE = "expected value"
EXPECTED_OPEN = "expected `(`"
EXPECTED_COMMA_OR_CLOSE = "expected `,` or `)`"
EXPECTED_COMMA_OR_END = "expected `,` or end of selector"
EXPECTED_KEY_AFTER_COMMA = "expected key after `,`"
UNTERMINATED_QUOTE = "unterminated quoted value"
INVALID_ESCAPE = "invalid escape in quoted value"


class SelectorError(ValueError):
    """A selector smg refuses (`invalid_selector`, HTTP 400); `str()` is smg's message."""

    def __init__(self, offset: int, reason: str) -> None:
        self.offset = offset  # UTF-8 byte offset into the selector
        self.reason = reason
        super().__init__(f"invalid selector at byte {offset}: {reason}")


class Operator(enum.Enum):
    EQ = "="
    NE = "!="
    IN = "in"
    NOTIN = "notin"


@dataclass(frozen=True)
class Requirement:
    """One comma-separated term. `values` has one item for `=` and `!=`, one or more for
    `in` and `notin`."""

    key: str
    op: Operator
    values: tuple[str, ...]

    def matches(self, fields: Mapping[str, str | None]) -> bool:
        have = fields.get(self.key)
        if self.op is Operator.EQ or self.op is Operator.IN:
            return have is not None and have in self.values
        return have is None or have not in self.values


@dataclass(frozen=True)
class Selector:
    """A parsed selector: the AND of its requirements (never empty)."""

    requirements: tuple[Requirement, ...]

    def matches(self, fields: Mapping[str, str | None]) -> bool:
        """Whether a worker with these fields is selected; a key mapped to None, or not in
        the mapping, is a key the worker does not have."""
        return all(requirement.matches(fields) for requirement in self.requirements)


def selector_is_blank(text: str) -> bool:
    """True for a selector smg answers `selector_required` for (empty or whitespace only)."""
    return all(ch in _WHITESPACE for ch in text)


def parse_selector(text: str) -> Selector:
    """Parse a selector as smg 1.13 does, or raise `SelectorError` with smg's message.

    The caller checks `selector_is_blank` first (smg answers those `selector_required`)."""
    return _Parser(text).selector()


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0  # index in characters; errors convert it to bytes

    def fail(self, reason: str, at: int | None = None) -> SelectorError:
        index = self.pos if at is None else at
        offset = len(self.text[:index].encode("utf-8", "surrogatepass"))
        return SelectorError(offset, reason)

    def at_end(self) -> bool:
        return self.pos >= len(self.text)

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def skip_ws(self) -> None:
        text = self.text
        while self.pos < len(text) and text[self.pos] in _WHITESPACE:
            self.pos += 1

    def word(self) -> str:
        """A run of key characters (the key, or the `in` / `notin` keyword)."""
        text = self.text
        start = self.pos
        while self.pos < len(text):
            ch = text[self.pos]
            if ch in _WHITESPACE or ch in _NOT_IN_KEY:
                break
            self.pos += 1
        return text[start : self.pos]

    def selector(self) -> Selector:
        requirements: list[Requirement] = []
        self.skip_ws()
        while True:
            requirements.append(self.requirement())
            self.skip_ws()
            if self.at_end():
                return Selector(tuple(requirements))
            if self.peek() != ",":
                raise self.fail(EXPECTED_COMMA_OR_END)
            self.pos += 1
            self.skip_ws()
            if self.at_end():
                raise self.fail(EXPECTED_KEY_AFTER_COMMA)

    def requirement(self) -> Requirement:
        key = self.word()
        if not key:
            raise self.fail(EXPECTED_KEY)
        self.skip_ws()
        if self.text.startswith("!=", self.pos):
            self.pos += 2
            self.skip_ws()
            return Requirement(key, Operator.NE, (self.value(),))
        if self.peek() == "=":
            self.pos += 1
            self.skip_ws()
            return Requirement(key, Operator.EQ, (self.value(),))
        start = self.pos
        keyword = self.word()
        if keyword == "in":
            op = Operator.IN
        elif keyword == "notin":
            op = Operator.NOTIN
        else:
            raise self.fail(EXPECTED_OPERATOR, at=start)
        self.skip_ws()
        if self.peek() != "(":
            raise self.fail(EXPECTED_OPEN)
        self.pos += 1
        values: list[str] = []
        while True:
            self.skip_ws()
            values.append(self.value())
            self.skip_ws()
            ch = self.peek()
            if ch == ")":
                self.pos += 1
                return Requirement(key, op, tuple(values))
            if ch != ",":
                raise self.fail(EXPECTED_COMMA_OR_CLOSE)
            self.pos += 1

    def value(self) -> str:
        if self.peek() == '"':
            return self.quoted()
        text = self.text
        start = self.pos
        while self.pos < len(text):
            ch = text[self.pos]
            if ch in _WHITESPACE or ch in _NOT_IN_VALUE:
                break
            self.pos += 1
        if self.pos == start:
            raise self.fail(EXPECTED_VALUE)
        return text[start : self.pos]

    def quoted(self) -> str:
        text = self.text
        self.pos += 1  # the opening quote
        out: list[str] = []
        while True:
            if self.at_end():
                raise self.fail(UNTERMINATED_QUOTE)
            ch = text[self.pos]
            self.pos += 1
            if ch == '"':
                return "".join(out)
            if ch == "\\":
                if self.at_end():
                    raise self.fail(UNTERMINATED_QUOTE)
                escaped = text[self.pos]
                self.pos += 1
                if escaped not in ('"', "\\"):
                    raise self.fail(INVALID_ESCAPE)
                out.append(escaped)
            else:
                out.append(ch)
