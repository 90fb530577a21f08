"""JSON documents as models (objects as ordered pairs, duplicate keys allowed) and a writer
that spells them with random valid whitespace, escapes and number forms: the generators
behind the relay and stamping property tests."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any


@dataclass
class Obj:
    """A JSON object as ordered pairs (duplicate keys allowed)."""

    pairs: list[tuple[str, Any]]


class Writer:
    """Writes JSON with random whitespace, escapes and number forms, all valid."""

    def __init__(self, rnd: random.Random, pretty: bool) -> None:
        self.rnd = rnd
        self.pretty = pretty

    def ws(self) -> str:
        if not self.pretty or self.rnd.random() < 0.5:
            return ""
        return self.rnd.choice([" ", "\n", "\t", "\r\n  ", "  "])

    def string(self, s: str) -> str:
        out = ['"']
        for ch in s:
            code = ord(ch)
            if ch == '"':
                out.append('\\"')
            elif ch == "\\":
                out.append("\\\\")
            elif code < 0x20:
                out.append(self.rnd.choice([f"\\u{code:04x}", f"\\u{code:04X}"]))
            elif (
                code >= 0x80 or ch == "/" or self.rnd.random() < 0.02
            ) and self.rnd.random() < 0.5:
                if ch == "/" and self.rnd.random() < 0.5:
                    out.append("\\/")
                elif code >= 0x10000:
                    hi = 0xD800 + ((code - 0x10000) >> 10)
                    lo = 0xDC00 + ((code - 0x10000) & 0x3FF)
                    out.append(f"\\u{hi:04x}\\u{lo:04X}")
                else:
                    out.append(f"\\u{code:04x}")
            else:
                out.append(ch)
        out.append('"')
        return "".join(out)

    def number(self, v: float | int) -> str:
        if isinstance(v, float) and v == v and abs(v) != float("inf") and self.rnd.random() < 0.5:
            form = self.rnd.choice([f"{v:.17e}", f"{v:.17E}", f"{v:.20g}"])
            return form if any(c in form for c in ".eE") else form + ".0"  # stay a float
        return json.dumps(v)

    def value(self, v: Any) -> str:
        if isinstance(v, Obj):
            if not v.pairs:
                return "{" + self.ws() + "}"
            parts = [
                self.ws() + self.string(k) + self.ws() + ":" + self.ws() + self.value(x) + self.ws()
                for k, x in v.pairs
            ]
            return "{" + ",".join(parts) + "}"
        if isinstance(v, list):
            if not v:
                return "[" + self.ws() + "]"
            return "[" + ",".join(self.ws() + self.value(x) + self.ws() for x in v) + "]"
        if isinstance(v, str):
            return self.string(v)
        if v is None or isinstance(v, bool):
            return json.dumps(v)
        return self.number(v)

    def document(self, v: Any) -> bytes:
        return (self.ws() + self.value(v) + self.ws()).encode()


def plain(v: Any) -> Any:
    """The Python value json.loads gives for a model value (last duplicate wins)."""
    if isinstance(v, Obj):
        out: dict[str, Any] = {}
        for k, x in v.pairs:
            out[k] = plain(x)
        return out
    if isinstance(v, list):
        return [plain(x) for x in v]
    return v
