"""What the mock engine needs from a tokenizer, and each token id's own bytes.

`TokenizerLike` is the small surface the generator and the chat route use (the built-in and
HF tokenizers both provide it). `token_bytes` gives the logprob `bytes` SGLang reports for a
byte-level BPE tokenizer, which differ from the token text when a token is part of a
multi-byte character.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from typing import Protocol


class TokenizerLike(Protocol):
    """The part of `sessiongate.tokenizer` the mock engine needs."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def end_of_turn_token_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character that stands for each byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(kept)
    extra = 0
    for b in range(256):
        if b not in kept:
            kept.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(kept, chars, strict=True)}


_BYTE_DECODER = _byte_decoder()


def token_bytes(tokenizer: TokenizerLike, ids: Sequence[int]) -> tuple[bytes, ...]:
    """Each id's bytes from its vocabulary piece, as SGLang's `token_id_to_bytes` gives the
    logprob `bytes` of a byte-level BPE tokenizer (entrypoints/openai/utils.py); () when the
    tokenizer is not byte-level (SGLang then encodes the token text)."""
    piece_of = getattr(tokenizer, "id_to_token", None)
    if piece_of is None or not _is_byte_level(tokenizer):
        return ()
    out: list[bytes] = []
    for i in ids:
        piece = piece_of(i) or ""
        raw = bytes(_BYTE_DECODER[c] for c in piece if c in _BYTE_DECODER)
        if not piece or len(raw) != len(piece):  # not byte-level representable
            raw = tokenizer.decode([i]).encode()
        out.append(raw)
    return tuple(out)


@functools.cache
def _is_byte_level_id(tokenizer: TokenizerLike) -> bool:
    # SGLang's probe: "é" is the piece chr(0xC3) + chr(0xA9) in a byte-level vocabulary.
    piece_of = getattr(tokenizer, "id_to_token", None)
    pieces = "".join(piece_of(i) or "" for i in tokenizer.encode("é")) if piece_of else ""
    return bytes(_BYTE_DECODER.get(c, 0) for c in pieces) == "é".encode()


def _is_byte_level(tokenizer: TokenizerLike) -> bool:
    if isinstance(tokenizer, Hashable):  # the cache's key
        try:
            return _is_byte_level_id(tokenizer)
        except TypeError:  # a hashable type holding unhashable values
            pass
    return _is_byte_level_id.__wrapped__(tokenizer)  # unhashable: probe every time
