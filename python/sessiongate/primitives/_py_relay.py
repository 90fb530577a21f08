"""Pure-Python twin of the Rust JSON relay primitives (``rust/relay.rs``, ``rust/r3.rs``).

Built on ``json.loads`` / ``json.dumps`` (the baseline the Rust core is measured against),
with the same results, exception classes and messages as the Rust core; client bodies are
re-serialized here, spliced there, and parse equal. See docs/relay.md.

- :func:`extract_reply`: the contract checks and messages of
  ``sessiongate.session.reply.parse_reply``, raised as :class:`ReplyContractError`.
- :func:`rewrite_request`: the request body with top-level members set.
- :func:`decode_r3`: base64 R3 to an int32 memoryview ``(n_tokens, layers, topk)``.
- :class:`CachedTokensWatch`: the first ``"cached_tokens"`` value
  of a reply read piece by piece (``rust/cached_tokens.rs``, the watch the compiled front
  reads relayed replies with).
"""

from __future__ import annotations

import binascii
import json
import math
import operator
import re
import sys
from array import array
from typing import Any

from ._py_bytes import byte_view as _view
from .errors import ReplyContractError, RequestRewriteError

__all__ = [
    "CachedTokensWatch",
    "ExtractedReply",
    "decode_r3",
    "extract_reply",
    "rewrite_request",
]

# Members of `meta_info` that only the trainer needs; they can be hundreds of MiB.
RECORD_ONLY_META_KEYS = ("routed_experts", "indexer_topk")
_CONTRACT = "upstream reply breaks the chat contract: "
_INT_TYPECODES = frozenset("bBhHiIlLqQ")


def _int_array_items(obj: object) -> list[int]:
    """json's `default` hook: an integer `array` (a session's token ids) is written as the
    list of its items; anything else is refused as json.dumps refuses it."""
    if type(obj) is array and obj.typecode in _INT_TYPECODES:
        return obj.tolist()
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


_DUMPS = json.JSONEncoder(
    separators=(",", ":"), ensure_ascii=False, default=_int_array_items
).encode
_DUMPS_ASCII = json.JSONEncoder(separators=(",", ":"), default=_int_array_items).encode
_BytesLike = bytes | bytearray | memoryview

# R3 base64
MAX_DIM = 1 << 20
_B64_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_NOT_B64 = re.compile(rb"[^A-Za-z0-9+/]")


def _loadable(obj: object, view: memoryview) -> bytes | bytearray:
    """What ``json.loads`` takes: the object itself when it is bytes / bytearray."""
    if isinstance(obj, bytes | bytearray):
        return obj
    return view.tobytes()


def _encode(obj: object) -> bytes:
    """``json.dumps(obj, separators=(",", ":"), ensure_ascii=False)`` as UTF-8.

    Strings with lone surrogates cannot be UTF-8: then the whole value is written with
    ``ensure_ascii=True`` (escapes), which parses back to the same value.
    """
    text = _DUMPS(obj)
    try:
        return text.encode()
    except UnicodeEncodeError:
        return _DUMPS_ASCII(obj).encode()


def _kind(value: object) -> str:
    """The JSON name of a parsed value's type."""
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return "number"


# ---------------------------------------------------------------------------------------
# extract_reply


class ExtractedReply:
    """What :func:`extract_reply` returns (read-only attributes, like the Rust class)."""

    __slots__ = (
        "_r3_view",
        "_topk_view",
        "cached_tokens",
        "client_body",
        "completion_ids",
        "completion_tokens",
        "e2e_latency",
        "finish_reason",
        "indexer_topk",
        "logprobs",
        "message",
        "prompt_tokens",
        "routed_experts",
        "weight_version",
    )
    completion_ids: list[int]
    logprobs: list[float]
    completion_tokens: int
    finish_reason: object
    message: dict[str, Any]
    client_body: bytes
    routed_experts: bytes | None
    indexer_topk: bytes | None
    prompt_tokens: int | None
    cached_tokens: int | None
    weight_version: str | None
    e2e_latency: float | None
    _r3_view: memoryview | None
    _topk_view: memoryview | None

    def __init__(
        self,
        *,
        completion_ids: list[int],
        logprobs: list[float],
        completion_tokens: int,
        finish_reason: object,
        message: dict[str, Any],
        client_body: bytes,
        routed_experts: bytes | None,
        prompt_tokens: int | None,
        indexer_topk: bytes | None = None,
        cached_tokens: int | None = None,
        weight_version: str | None = None,
        e2e_latency: float | None = None,
        r3_view: memoryview | None = None,
        topk_view: memoryview | None = None,
    ) -> None:
        setter = object.__setattr__
        setter(self, "_r3_view", r3_view)
        setter(self, "_topk_view", topk_view)
        setter(self, "completion_ids", completion_ids)
        setter(self, "logprobs", logprobs)
        setter(self, "completion_tokens", completion_tokens)
        setter(self, "finish_reason", finish_reason)
        setter(self, "message", message)
        setter(self, "client_body", client_body)
        setter(self, "routed_experts", routed_experts)
        setter(self, "prompt_tokens", prompt_tokens)
        setter(self, "indexer_topk", indexer_topk)
        setter(self, "cached_tokens", cached_tokens)
        setter(self, "weight_version", weight_version)
        setter(self, "e2e_latency", e2e_latency)

    @property
    def routed_experts_view(self) -> memoryview | None:
        """``routed_experts`` as a read-only memoryview (the Rust core's is a zero-copy slice
        of the reply when the reply is ``bytes``)."""
        if self._r3_view is not None:
            return self._r3_view
        return None if self.routed_experts is None else memoryview(self.routed_experts)

    @property
    def indexer_topk_view(self) -> memoryview | None:
        """``indexer_topk`` as a read-only memoryview (zero-copy like ``routed_experts_view``)."""
        if self._topk_view is not None:
            return self._topk_view
        return None if self.indexer_topk is None else memoryview(self.indexer_topk)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"attribute '{name}' of 'ExtractedReply' objects is not writable")

    def __repr__(self) -> str:
        r3 = "None" if self.routed_experts is None else f"<{len(self.routed_experts)} bytes>"
        return (
            f"ExtractedReply(completion_tokens={self.completion_tokens!r}, "
            f"finish_reason={self.finish_reason!r}, prompt_tokens={self.prompt_tokens!r}, "
            f"routed_experts={r3})"
        )


def _broken(detail: str) -> ReplyContractError:
    return ReplyContractError(f"{_CONTRACT}{detail}")


def _client_body(document: dict[str, Any]) -> bytes:
    """The reply without the record-only members of any ``choices[i].meta_info``."""
    choices = document.get("choices")
    if isinstance(choices, list):
        stripped = []
        for choice in choices:
            meta = choice.get("meta_info") if isinstance(choice, dict) else None
            if isinstance(meta, dict) and any(k in meta for k in RECORD_ONLY_META_KEYS):
                meta = {k: v for k, v in meta.items() if k not in RECORD_ONLY_META_KEYS}
                choice = {**choice, "meta_info": meta}
            stripped.append(choice)
        document = {**document, "choices": stripped}
    return _encode(document)


def extract_reply(body: _BytesLike) -> ExtractedReply:
    """Validate an upstream chat reply and extract what the session core needs.

    Checks and messages are those of ``sessiongate.session.reply.parse_reply`` (plus two:
    a ``routed_experts`` or an ``indexer_topk`` that is neither a string nor null), raised
    as ReplyContractError.
    """
    data = _loadable(body, _view(body, "extract_reply", "body"))
    try:
        document = json.loads(data)
    except ValueError as exc:
        raise _broken(f"body is not valid JSON ({exc})") from exc
    except RecursionError:
        # Deeper than the interpreter's stack allows (the Rust scanner hands such bodies
        # here): refused like any broken reply, never an internal error.
        raise _broken("body is nested too deeply to parse") from None
    if not isinstance(document, dict):
        raise _broken("body is not a JSON object")
    choices = document.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _broken("'choices' is missing or empty")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise _broken("choices[0].message is missing")
    if message.get("content") is None:
        raise _broken("choices[0].message.content is null")
    meta = choice.get("meta_info")
    if not isinstance(meta, dict):
        raise _broken("choices[0].meta_info is missing (was return_meta_info honoured?)")
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list):
        raise _broken("choices[0].meta_info.output_token_logprobs is missing")
    completion_tokens = meta.get("completion_tokens")
    if not isinstance(completion_tokens, int) or isinstance(completion_tokens, bool):
        raise _broken("choices[0].meta_info.completion_tokens is missing")
    if len(entries) != completion_tokens:
        raise _broken(
            f"output_token_logprobs has {len(entries)} entries but completion_tokens is "
            f"{completion_tokens}"
        )
    ids: list[int] = []
    logprobs: list[float] = []
    for index, entry in enumerate(entries):
        if (
            not isinstance(entry, list)
            or len(entry) < 2
            or not isinstance(entry[1], int)
            or isinstance(entry[1], bool)
            or not isinstance(entry[0], int | float)
        ):
            raise _broken(
                f"output_token_logprobs[{index}] is not [logprob, token_id, ...]: {entry!r:.80}"
            )
        logprobs.append(float(entry[0]))
        ids.append(entry[1])
    r3 = _b64_member(meta, "routed_experts")
    topk = _b64_member(meta, "indexer_topk")
    assistant: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str):
        assistant["reasoning_content"] = reasoning
    if message.get("tool_calls"):
        assistant["tool_calls"] = message["tool_calls"]
    weight_version = meta.get("weight_version")
    if not isinstance(weight_version, str):
        metadata = document.get("metadata")
        weight_version = metadata.get("weight_version") if isinstance(metadata, dict) else None
        if not isinstance(weight_version, str):
            weight_version = None
    encoded = None if r3 is None else r3.encode("utf-8", "surrogatepass")
    encoded_topk = None if topk is None else topk.encode("utf-8", "surrogatepass")
    return ExtractedReply(
        completion_ids=ids,
        logprobs=logprobs,
        completion_tokens=completion_tokens,
        finish_reason=meta.get("finish_reason", choice.get("finish_reason")),
        message=assistant,
        client_body=_client_body(document),
        routed_experts=encoded,
        prompt_tokens=_int_or_none(meta.get("prompt_tokens")),
        indexer_topk=encoded_topk,
        cached_tokens=_int_or_none(meta.get("cached_tokens")),
        weight_version=weight_version,
        e2e_latency=_float_or_none(meta.get("e2e_latency")),
        r3_view=_slice_of(body, encoded),
        topk_view=_slice_of(body, encoded_topk),
    )


def _b64_member(meta: dict[str, Any], name: str) -> str | None:
    """``meta[name]`` when it is a string, None when absent or null, else a contract error."""
    value = meta.get(name)
    if value is not None and not isinstance(value, str):
        raise _broken(f"choices[0].meta_info.{name} is not a base64 string (got {_kind(value)})")
    return value


def _float_or_none(value: object) -> float | None:
    """A JSON number as a float (an integer too, as the Rust core parses its text), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:  # an integer beyond float range: the text parses to +-inf
        return math.inf if value > 0 else -math.inf


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _slice_of(body: _BytesLike, text: bytes | None) -> memoryview | None:
    """`text` as a zero-copy slice of an immutable `body` that spells it unescaped (as the
    Rust core's view is), so a record keeping the view holds no second copy of R3."""
    if not text or type(body) is not bytes:
        return None
    start = body.find(text)
    return None if start < 0 else memoryview(body)[start : start + len(text)]


# ---------------------------------------------------------------------------------------
# rewrite_request


def rewrite_request(body: _BytesLike, fields: dict[str, Any]) -> bytes:
    """The request body with the top-level members of ``fields`` set (appended at the end,
    replacing every member of the same name); values written like ``json.dumps(v,
    separators=(",", ":"), ensure_ascii=False)``."""
    view = _view(body, "rewrite_request", "body")
    if not isinstance(fields, dict):
        raise TypeError(
            f"rewrite_request() argument 'fields' must be dict, not {type(fields).__name__}"
        )
    for key in fields:
        if not isinstance(key, str):
            raise TypeError(
                f"rewrite_request() keys of 'fields' must be str, not {type(key).__name__}"
            )
    try:
        document = json.loads(_loadable(body, view))
    except ValueError as exc:
        raise RequestRewriteError(f"request body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise RequestRewriteError("request body is nested too deeply to parse") from None
    if not isinstance(document, dict):
        raise RequestRewriteError(f"request body must be a JSON object, got {_kind(document)}")
    for key in fields:
        document.pop(key, None)
    head = _encode(document)
    if not fields:
        return head
    tail = b",".join(_encode(key) + b":" + _encode(value) for key, value in fields.items())
    return head[:-1] + (b"," if document else b"") + tail + b"}"


# ---------------------------------------------------------------------------------------
# decode_r3


def _dim(value: object, arg: str) -> int:
    try:
        v = operator.index(value)  # type: ignore[arg-type]  # any object: a TypeError is the answer
    except TypeError:
        raise TypeError(
            f"decode_r3() argument '{arg}' must be int, not {type(value).__name__}"
        ) from None
    if not 1 <= v <= MAX_DIM:
        raise ValueError(f"decode_r3() argument '{arg}' must be in 1..{MAX_DIM}, got {v}")
    return v


def _b64_problem(raw: bytes) -> str:
    """Why ``raw`` is not valid base64 (the first of: a bad character, too much padding,
    a length that is not a multiple of 4)."""
    n = len(raw)
    pad = n - len(raw.rstrip(b"="))
    bad = _NOT_B64.search(raw, 0, n - pad)
    if bad is not None:
        i = bad.start()
        if raw[i] == ord("="):
            return f"'=' at offset {i} is not at the end"
        return f"character at offset {i} is not in the base64 alphabet"
    if pad > 2:
        return f"{pad} '=' at the end (at most 2)"
    return f"length {n} is not a multiple of 4"


def decode_r3(data: str | _BytesLike, *, layers: int, topk: int) -> memoryview:
    """The base64 text of ``routed_experts`` (little-endian int32) as a read-only memoryview
    of format ``'i'`` and shape ``(n_tokens, layers, topk)``; 1-D and empty for no data."""
    if isinstance(data, str):
        raw = data.encode("ascii") if data.isascii() else data.encode("utf-8", "surrogatepass")
    else:
        view = _view(data, "decode_r3", "data", "str or a bytes-like object")
        raw = data if isinstance(data, bytes) else view.tobytes()
    n_layers = _dim(layers, "layers")
    n_topk = _dim(topk, "topk")
    n = len(raw)
    stripped = raw.rstrip(b"=")
    if n - len(stripped) > 2 or n % 4 or stripped.translate(None, _B64_ALPHABET):
        raise ValueError(f"R3 data is not valid base64: {_b64_problem(raw)}")
    decoded = binascii.a2b_base64(raw)
    row = 4 * n_layers * n_topk
    if len(decoded) % row:
        raise ValueError(
            f"R3 data decodes to {len(decoded)} bytes, not a multiple of 4*layers*topk = "
            f"4*{n_layers}*{n_topk} = {row} bytes"
        )
    if sys.byteorder == "big":
        values = array("i")
        values.frombytes(decoded)
        values.byteswap()
        decoded = values.tobytes()
    tokens = len(decoded) // row
    if tokens == 0:
        return memoryview(decoded).cast("i")
    return memoryview(decoded).cast("i", (tokens, n_layers, n_topk))


_CACHED_KEY = b'"cached_tokens"'
_JSON_SPACE = b" \t\n\r"
# More digits may not fit the core's u64: not a count of tokens.
_MAX_CACHED_DIGITS = 18
_DIGITS = b"0123456789"
# The watch's states (rust/cached_tokens.rs): looking for the key, after it, after its
# colon, in the value's digits, done.
_SEARCH, _KEY, _COLON, _VALUE, _DONE = range(5)


class CachedTokensWatch:
    """The first `"cached_tokens"` value (the quoted name, then a colon) of a reply fed
    piece by piece: `finish()` is it, None when there is none or it is not a non-negative
    integer of at most 18 digits. No parse: inside a JSON string every quote is escaped,
    so the key followed by a colon is a key. `done` once known; later pieces are not read."""

    def __init__(self) -> None:
        self._state = _SEARCH
        self._held = 0  # bytes of the key that ended the last piece
        self._value = 0
        self._digits = 0
        self._result: int | None = None

    @property
    def done(self) -> bool:
        return self._state == _DONE

    def feed(self, piece: _BytesLike) -> None:
        data = _view(piece, "feed", "piece").tobytes() if type(piece) is not bytes else piece
        i, end = 0, len(data)
        while i < end and self._state != _DONE:
            if self._state == _SEARCH:
                if self._held:
                    want = _CACHED_KEY[self._held :]
                    have = data[i : i + len(want)]
                    if want.startswith(have):
                        i += len(have)
                        if len(have) == len(want):
                            self._state, self._held = _KEY, 0
                        else:
                            self._held += len(have)
                        continue
                    # The key's only quotes are its first and last byte: search afresh.
                    self._held = 0
                found = data.find(_CACHED_KEY, i)
                if found < 0:
                    self._held = _tail_match(data[max(i, end - len(_CACHED_KEY) + 1) :])
                    return
                i, self._state = found + len(_CACHED_KEY), _KEY
            elif self._state == _KEY:
                byte = data[i]
                if byte == 0x3A:  # ':'
                    self._state = _COLON
                    i += 1
                elif byte in _JSON_SPACE:
                    i += 1
                else:
                    self._state = _SEARCH  # a string "cached_tokens" that is not a key
            elif self._state == _COLON:
                byte = data[i]
                if byte in _JSON_SPACE:
                    i += 1
                elif byte in _DIGITS:
                    self._state, self._value, self._digits = _VALUE, 0, 0
                else:
                    self._state = _DONE
            else:
                byte = data[i]
                if byte in _DIGITS:
                    if self._digits == _MAX_CACHED_DIGITS:
                        self._state = _DONE
                    else:
                        self._value = self._value * 10 + byte - 0x30
                        self._digits += 1
                    i += 1
                elif byte in b".eE":
                    self._state = _DONE  # a float is not a count
                else:
                    self._state, self._result = _DONE, self._value

    def finish(self) -> int | None:
        """The value once the reply has ended (or as soon as known)."""
        if self._state == _VALUE:
            return self._value
        return self._result


def _tail_match(data: bytes) -> int:
    """How many leading bytes of the key end `data` (a cut key starts at its one quote)."""
    tail = data[-(len(_CACHED_KEY) - 1) :]
    at = tail.rfind(b'"')
    return len(tail) - at if at >= 0 and _CACHED_KEY.startswith(tail[at:]) else 0
