"""CachedTokensWatch: the first `"cached_tokens"` value of a reply read in pieces, the watch
the relays keep over replies (rust/cached_tokens.rs) against its twin, both against an
oracle here that reads the pieces joined. Generated replies mix the key with strings that
hold it, keys without a colon, spaces, signs, floats and long digit runs, cut anywhere."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiongate.primitives import get_impl

RUST = get_impl("rust")
PY = get_impl("python")
KEY = b'"cached_tokens"'
SPACE = b" \t\n\r"


def oracle(body: bytes) -> int | None:
    """The value the watch must find in `body`, read whole: the first key followed by a
    colon (a key without one is searched past), then a run of at most 18 digits not
    followed by a float's `.`, `e` or `E`."""
    start = 0
    while (found := body.find(KEY, start)) >= 0:
        at = found + len(KEY)
        while at < len(body) and body[at] in SPACE:
            at += 1
        if body[at : at + 1] == b":":
            break
        start = at
    else:
        return None
    at += 1
    while at < len(body) and body[at] in SPACE:
        at += 1
    end = at
    while body[end : end + 1].isdigit():
        end += 1
    if end == at or end - at > 18 or body[end : end + 1] in (b".", b"e", b"E"):
        return None
    return int(body[at:end])


def read(impl: Any, pieces: list[bytes] | list[memoryview]) -> int | None:
    watch = impl.CachedTokensWatch()
    for piece in pieces:
        watch.feed(piece)
    value: int | None = watch.finish()
    return value


FRAGMENTS = st.sampled_from(
    [
        b'"cached_tokens"',
        b'"cached_tokens":',
        b'"cached_tokens_details":',
        b'\\"cached_tokens\\"',
        b"cached_tokens",
        b'"',
        b":",
        b" ",
        b"\n\t",
        b",",
        b"-",
        b".",
        b"e",
        b"null",
        b"0",
        b"7",
        b"123",
        b"9" * 19,
        b'{"meta_info":{',
        b"}",
    ]
)


@st.composite
def cut(draw: st.DrawFn) -> list[bytes]:
    body = b"".join(draw(st.lists(FRAGMENTS, max_size=24)))
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=6)))
    edges = [0, *cuts, len(body)]
    return [body[a:b] for a, b in itertools.pairwise(edges)]


@settings(max_examples=400, deadline=None)
@given(pieces=cut())
def test_watches_over_pieces_equal_the_oracle(pieces: list[bytes]) -> None:
    whole = b"".join(pieces)
    want = oracle(whole)
    for impl in (RUST, PY):
        assert read(impl, pieces) == want
        assert read(impl, [whole]) == want
        assert read(impl, [bytes([b]) for b in whole]) == want


@pytest.mark.parametrize("impl", [RUST, PY], ids=["rust", "python"])
def test_sglang_replies(impl: object) -> None:
    generate = {
        "text": 'say "cached_tokens": 9',
        "output_ids": [1, 2],
        "meta_info": {"prompt_tokens": 40, "cached_tokens": 32, "routed_experts": "AAAA"},
    }
    chat = {"usage": {"prompt_tokens_details": {"cached_tokens": 5}}}
    stream = b'data: {"meta_info":{"cached_tokens":3}}\n\ndata: {"meta_info":{"cached_tokens":3}}'
    assert read(impl, [json.dumps(generate).encode()]) == 32
    assert read(impl, [json.dumps(generate, separators=(",", ":")).encode()]) == 32
    assert read(impl, [json.dumps(chat).encode()]) == 5
    assert read(impl, [stream[:20], stream[20:]]) == 3
    assert read(impl, [b'{"meta_info":{"cached_tokens":null}}']) is None
    assert read(impl, [b'{"meta_info":{"prompt_tokens":4}}']) is None
    assert read(impl, [memoryview(b'{"cached_tokens":'), memoryview(b"8}")]) == 8
    watch = impl.CachedTokensWatch()  # type: ignore[attr-defined]
    watch.feed(bytearray(b'{"cached_tokens": 9,'))
    assert watch.done and watch.finish() == 9
    with pytest.raises(TypeError, match="feed\\(\\) argument 'piece' must be"):
        watch.feed("text")


@settings(max_examples=200, deadline=None)
@given(pieces=cut())
def test_watches_fed_piece_by_piece_agree(pieces: list[bytes]) -> None:
    rust, py = RUST.CachedTokensWatch(), PY.CachedTokensWatch()
    for piece in pieces:
        rust.feed(piece)
        py.feed(memoryview(piece))
        assert rust.done == py.done
    assert rust.finish() == py.finish() == oracle(b"".join(pieces))
