"""cached_tokens_in: the first `"cached_tokens"` value of a reply read in pieces, the watch
the compiled front keeps over relayed replies (rust/cached_tokens.rs) against its twin,
which reads the pieces joined. Generated replies mix the key with strings that hold it,
keys without a colon, spaces, signs, floats and long digit runs, cut anywhere."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiongate.primitives import get_impl

RUST = get_impl("rust")
PY = get_impl("python")

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
def test_rust_watch_over_pieces_equals_the_twin(pieces: list[bytes]) -> None:
    whole = b"".join(pieces)
    want = PY.cached_tokens_in([whole])
    assert RUST.cached_tokens_in(pieces) == want
    assert RUST.cached_tokens_in([whole]) == want
    assert PY.cached_tokens_in(pieces) == want
    assert RUST.cached_tokens_in([bytes([b]) for b in whole]) == want


@pytest.mark.parametrize("impl", [RUST, PY], ids=["rust", "python"])
def test_sglang_replies(impl: object) -> None:
    generate = {
        "text": 'say "cached_tokens": 9',
        "output_ids": [1, 2],
        "meta_info": {"prompt_tokens": 40, "cached_tokens": 32, "routed_experts": "AAAA"},
    }
    chat = {"usage": {"prompt_tokens_details": {"cached_tokens": 5}}}
    stream = b'data: {"meta_info":{"cached_tokens":3}}\n\ndata: {"meta_info":{"cached_tokens":3}}'
    read = impl.cached_tokens_in  # type: ignore[attr-defined]
    assert read([json.dumps(generate).encode()]) == 32
    assert read([json.dumps(generate, separators=(",", ":")).encode()]) == 32
    assert read([json.dumps(chat).encode()]) == 5
    assert read([stream[:20], stream[20:]]) == 3
    assert read([b'{"meta_info":{"cached_tokens":null}}']) is None
    assert read([b'{"meta_info":{"prompt_tokens":4}}']) is None
    assert read([bytearray(b'{"cached_tokens":'), memoryview(b"8}")]) == 8
    with pytest.raises(TypeError, match="cached_tokens_in\\(\\) argument 'piece' must be"):
        read([b"x", "text"])


@settings(max_examples=200, deadline=None)
@given(pieces=cut())
def test_watches_fed_piece_by_piece_agree(pieces: list[bytes]) -> None:
    rust, py = RUST.CachedTokensWatch(), PY.CachedTokensWatch()
    for piece in pieces:
        rust.feed(piece)
        py.feed(memoryview(piece))
        assert rust.done == py.done
    assert rust.finish() == py.finish() == PY.cached_tokens_in([b"".join(pieces)])
