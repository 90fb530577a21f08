"""Seeded fuzz cases for the wire primitives, shared by the bounded CI run
(tests/primitives/test_fuzz.py) and the long run (`python benches/stress/fuzz.py --cases 1000000`).

Each target takes a `random.Random` and runs one case against the Rust core and its
Python twin, returning the outcome both gave (or raising `FuzzFailure`): a decoder may
accept or refuse its input, but only with its documented error, never another exception,
and the two implementations must agree.
"""

from __future__ import annotations

import json
import random
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from sessiongate.primitives import get_impl
from sessiongate.primitives.errors import FrameError, ReplyContractError

RUST = get_impl("rust")
PY = get_impl("python")
U64_MAX = 2**64 - 1
SMALL_CAP = 1 << 16


class FuzzFailure(AssertionError):
    """A case broke a promise; the message names the target and how to replay it."""


def _outcome(fn: Callable[..., Any], allowed: type[Exception], *args: Any) -> tuple[Any, ...]:
    try:
        return ("ok", fn(*args))
    except allowed as exc:
        return ("err", type(exc).__name__)
    except MemoryError:
        return ("err", "MemoryError")  # an impossible allocation the decoder refused


def _frame(frame_type: int, request_id: int, payload: bytes) -> bytes:
    return struct.pack(">QQB", 9 + len(payload), request_id, frame_type) + payload


def _lying_header(rng: random.Random) -> bytes:
    length = rng.choice([0, 1, 8, 9, SMALL_CAP + 1, 2**63, U64_MAX, rng.randrange(U64_MAX)])
    return struct.pack(">QQB", length, rng.choice([0, U64_MAX, rng.randrange(U64_MAX)]), 1)


def frame_stream_case(rng: random.Random) -> tuple[Any, ...]:
    """A byte stream of good frames, lying headers, random bytes and truncations, fed in
    random pieces to a fresh decoder of each implementation."""
    parts: list[bytes] = []
    for _ in range(rng.randrange(1, 6)):
        kind = rng.random()
        if kind < 0.5:
            payload = rng.randbytes(rng.choice([0, 1, 17, rng.randrange(2000)]))
            parts.append(_frame(rng.randrange(256), rng.randrange(U64_MAX), payload))
        elif kind < 0.7:
            parts.append(_lying_header(rng))
        elif kind < 0.9:
            parts.append(rng.randbytes(rng.randrange(64)))
        else:
            whole = _frame(2, 7, rng.randbytes(rng.randrange(100)))
            parts.append(whole[: rng.randrange(len(whole))])
    stream = b"".join(parts)
    cuts = sorted(rng.randrange(len(stream) + 1) for _ in range(rng.randrange(6)))
    traces = []
    for impl in (RUST, PY):
        decoder = impl.FrameDecoder(max_frame=SMALL_CAP)
        trace: list[Any] = []
        start = 0
        for cut in [*cuts, len(stream)]:
            result = _outcome(decoder.feed, FrameError, stream[start:cut])
            start = cut
            trace.append(result)
            if result[0] == "err":
                break
        traces.append((trace, decoder.buffered if trace[-1][0] == "ok" else None))
    if traces[0] != traces[1]:
        raise FuzzFailure(
            f"frame decoders disagree: rust {traces[0]!r:.300} python {traces[1]!r:.300}"
        )
    return ("frames", traces[0][0][-1][0])


def envelope_case(rng: random.Random) -> tuple[Any, ...]:
    """Envelope payloads: lying meta lengths (u64 extremes), junk and non-object meta."""
    meta = rng.choice(
        [
            b'{"op":"chat","session_id":"x","headers":[]}',
            b"[]",
            b"{",
            b'{"a":"\\ud800"}',
            b'{"a":1e999}',
            b"\xff\xfe",
            b"[" * rng.randrange(1, 3000),
            rng.randbytes(rng.randrange(40)),
        ]
    )
    declared = rng.choice([len(meta), 0, len(meta) + 1, U64_MAX, 2**63, rng.randrange(U64_MAX)])
    payload = struct.pack(">Q", declared) + meta + rng.randbytes(rng.randrange(8))
    if rng.random() < 0.2:
        payload = payload[: rng.randrange(len(payload) + 1)]
    results = []
    for impl in (RUST, PY):
        kind, value = _outcome(impl.decode_envelope, FrameError, payload)
        results.append((kind, repr(value[0]) if kind == "ok" else None))
    if results[0] != results[1]:
        raise FuzzFailure(f"envelope decoders disagree on {payload[:80]!r}: {results}")
    return ("envelope", results[0][0])


def _valid_reply(rng: random.Random) -> dict[str, Any]:
    count = rng.randrange(1, 6)
    entries = [[-rng.random(), rng.randrange(150_000), f"t{i}"] for i in range(count)]
    return {
        "id": "r",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi", "reasoning_content": None},
                "finish_reason": "stop",
                "meta_info": {
                    "completion_tokens": count,
                    "output_token_logprobs": entries,
                    "cached_tokens": 0,
                    "weight_version": "default",
                    "routed_experts": "AAAAAA==",
                },
            }
        ],
        "metadata": {"weight_version": "default"},
    }


def _mutate(rng: random.Random, body: bytes) -> bytes:
    kind = rng.randrange(8)
    at = rng.randrange(len(body) + 1)
    if kind == 0:  # deep nesting, up to 100k levels, inside a value or as the whole body
        depth = rng.choice([10, 200, 5000, 100_000])
        nested = b"[" * depth + b"1" + b"]" * depth
        return body.replace(b'"id":"r"', b'"id":' + nested, 1) if rng.random() < 0.5 else nested
    if kind == 1:  # huge numbers
        number = rng.choice([b"1e400", b"-1e400", b"9" * 5000, b"1" + b"0" * 400])
        return body.replace(b'"completion_tokens":', b'"completion_tokens":' + number + b',"x":', 1)
    if kind == 2:  # invalid UTF-8
        return body[:at] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80"]) + body[at:]
    if kind == 3:  # duplicate keys: the last one wins, as in json.loads
        return body.replace(b'"choices":', b'"choices":[],"choices":', 1)
    if kind == 4:  # a missing field
        key = rng.choice([b'"message"', b'"meta_info"', b'"output_token_logprobs"'])
        return body.replace(key, b'"x' + key[1:], 1)
    if kind == 5:  # truncation
        return body[:at]
    if kind == 6:  # random bytes spliced in
        return body[:at] + rng.randbytes(rng.randrange(1, 8)) + body[at:]
    return body  # unchanged: must be accepted


def reply_case(rng: random.Random) -> tuple[Any, ...]:
    """An upstream chat reply, valid or adversarially broken: accepted with identical fields
    or refused with ReplyContractError, by both implementations."""
    body = _mutate(rng, json.dumps(_valid_reply(rng), separators=(",", ":")).encode())
    results = []
    for impl in (RUST, PY):
        kind, value = _outcome(impl.extract_reply, ReplyContractError, body)
        if kind == "ok":
            value = (value.completion_ids, value.logprobs, value.finish_reason, value.message)
        results.append((kind, value))
    if results[0] != results[1]:
        raise FuzzFailure(f"extract_reply disagrees on {body[:120]!r}: {results!r:.400}")
    return ("reply", results[0][0])


# -- malformed HTTP against a running gateway ------------------------------------------

_SID = "0123456789abcdef0123456789abcdef"
_PATHS = [
    "/health",
    "/sessions",
    f"/sessions/{_SID}",
    f"/sessions/{_SID}/v1/chat/completions",
    f"/sessions/{_SID}/samples",
    f"/sessions/{_SID}/trajectory",
    "/sessions/%zz",
    "/sessions/%2e%2e",
    "/sessions/..",
    "/sessions/" + "a" * 5000,
    "/sessions/%e2%28/v1/chat/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/nope",
    "*",
]
_BODIES = [
    b"",
    b"{",
    b"[1,2]",
    b"null",
    b'{"messages":"hi"}',
    b'{"messages":[{"role":"user","content":"\\ud800"}]}',
    b'{"messages":[{"role":"user","content":"a\\u0000b"}],"stream":"yes"}',
    b'{"messages":[{"role":"user","content":"hi"}],"tools":{}}',
    b'{"max_seq_len":"x"}',
    b'{"parent_session_id":5}',
    b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b"\xff\xfe\x00",
]


def http_request_case(rng: random.Random) -> bytes:
    """One raw HTTP/1.1 request, malformed or hostile in one or more ways, that a server
    must answer (every case has a request line)."""
    method = rng.choice(["GET", "POST", "DELETE", "PUT", "PATCH", "HEAD", "OPTIONS", "BREW"])
    path = rng.choice(_PATHS)
    body = rng.choice(_BODIES)
    headers = [("Host", "fuzz"), ("Content-Type", "application/json")]
    framing = rng.random()
    if framing < 0.6:
        headers.append(("Content-Length", str(len(body))))
    elif framing < 0.7:  # a lying length: longer than the body (the body timeout answers)
        headers.append(("Content-Length", str(len(body) + rng.randrange(1, 100))))
    elif framing < 0.8:
        headers.append(("Content-Length", rng.choice(["-1", "abc", "1e3", "99999999999999999999"])))
    elif framing < 0.9:  # chunked, sometimes with a bad size
        size = rng.choice([f"{len(body):x}", "zz", "-5", "fffffffffffffffffff"])
        headers.append(("Transfer-Encoding", "chunked"))
        body = size.encode() + b"\r\n" + body + b"\r\n0\r\n\r\n"
    else:  # both framings at once
        headers += [("Content-Length", str(len(body))), ("Transfer-Encoding", "chunked")]
    extra = rng.random()
    if extra < 0.15:
        headers.append(("X-Session-ID", rng.choice(["", " ", "a" * 300, "\x01", _SID])))
    elif extra < 0.25:
        headers += [("X-Repeated", str(i)) for i in range(rng.randrange(1, 200))]
    elif extra < 0.3:
        headers.append(("X-Big", "v" * rng.choice([100, 10_000, 70_000])))
    elif extra < 0.35:
        headers.append(("Bad Header", "x"))
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
    return head.encode("latin-1") + b"\r\n" + body


# 5xx a hostile request may legitimately get: the upstream's or a worker's failure.
UPSTREAM_5XX = frozenset({502, 503, 504})


def http_exchange(port: int, request: bytes, timeout: float) -> int | None:
    """Send one raw request; the response's status, or None when the server closed the
    connection without answering within `timeout` seconds."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(request)
        except OSError:
            pass  # the server may answer (and close) before the whole request is sent
        received = b""
        deadline = time.monotonic() + timeout
        while b"\r\n" not in received and time.monotonic() < deadline:
            try:
                piece = sock.recv(65536)
            except (TimeoutError, OSError):
                break
            if not piece:
                break
            received += piece
    line = received.split(b"\r\n", 1)[0].split(b" ")
    return int(line[1]) if len(line) >= 2 and line[1].isdigit() else None


def http_case(rng: random.Random, port: int, timeout: float) -> tuple[Any, ...]:
    """One hostile request against the gateway on `port`: answered, and not with a 5xx of
    the gateway's own (502/503/504 are the upstream's or a worker's, documented)."""
    request = http_request_case(rng)
    status = http_exchange(port, request, timeout)
    if status is None:
        raise FuzzFailure(f"no response within {timeout} s to {request[:200]!r}")
    if status >= 500 and status not in UPSTREAM_5XX:
        raise FuzzFailure(f"status {status} for {request[:200]!r}")
    return ("http", "ok" if status < 400 else "err")


TARGETS: dict[str, Callable[[random.Random], tuple[Any, ...]]] = {
    "frames": frame_stream_case,
    "envelope": envelope_case,
    "reply": reply_case,
}


def run(target: str, seed: int, cases: int, start: int = 0) -> dict[str, int]:
    """Cases `start .. start + cases` of one target from `seed`; counts of accepted and
    refused inputs."""
    counts = {"ok": 0, "err": 0}
    for index in range(start, start + cases):
        rng = random.Random(f"{target}:{seed}:{index}")
        try:
            _, kind = TARGETS[target](rng)
        except FuzzFailure as exc:
            raise FuzzFailure(f"{target} seed={seed} case={index}: {exc}") from None
        except Exception as exc:
            raise FuzzFailure(
                f"{target} seed={seed} case={index}: unexpected {type(exc).__name__}: {exc}"
            ) from exc
        counts[kind] += 1
    return counts
