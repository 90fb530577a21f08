"""Deterministic fake generation: completion tokens, logprobs, tool calls and R3 bytes.

Everything here is a pure function of (engine seed, request seed, prompt ids) so tests and
benchmarks can replay a reply exactly (R3 rows: of the engine seed and the token ids only).
Completions are made of whole words from a fixed list and cut only on word boundaries, so
`encode(content) == content ids` holds (the TITO checker relies on re-tokenization stability)
and `decode(content ids) == content`.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import random
import sys
from array import array
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

FinishReason = Literal["stop", "length", "tool_calls", "abort"]

# Plain lowercase English words: most are one token (with a leading space) in byte-level BPE
# vocabularies, which keeps `max_tokens` truncation exact.
WORDS: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be",
    "by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but",
    "have", "an", "had", "they", "you", "were", "their", "one", "all", "we", "can", "her",
    "has", "there", "been", "if", "more", "when", "will", "would", "who", "so", "no",
    "time", "model", "token", "data", "value", "state", "turn", "agent", "tool", "call",
    "result", "step", "plan", "check", "file", "code", "test", "run", "read", "write",
    "list", "next", "first", "then", "after", "before", "because", "answer", "question",
    "number", "small", "large", "good", "new", "old", "same", "other", "each", "some",
    "many", "most", "only", "also", "just", "very", "well", "here", "now", "done",
)  # fmt: skip

# Words outside ASCII (`--non-ascii`): byte-level BPE splits their characters over several
# tokens, so single tokens decode to "\ufffd" and stream steps can end inside a character.
NON_ASCII_WORDS: tuple[str, ...] = (
    "café", "naïve", "über", "señor", "größe", "déjà", "été", "façade", "日本", "東京",
    "数据", "模型", "привет", "мир", "λόγος", "🙂", "🚀", "½", "→",
)  # fmt: skip

# R3 rows come from one pool of random rows per (layers, topk, experts), built once and then
# only sliced per reply (blocks placed by a hash of the token prefix): this many bytes of
# base64 (4.5 MiB raw), rounded up to whole chunks.
R3_POOL_B64 = 6 << 20
# The pool's base64 is kept in chunks of at most this size (the app's send slice).
R3_POOL_CHUNK_B64 = 1 << 20
# A reply's rows are blocks of this many consecutive pool rows (a multiple of 3, so blocks
# are whole base64 groups); each block's place in the pool is hashed from the token prefix.
R3_BLOCK_ROWS = 96
# Runs of R3 slices smaller than this (small row shapes) are joined up to about _COALESCE_TO.
_COALESCE_BELOW = 16 << 10
_COALESCE_TO = 256 << 10
_TOOL_CALL_OPEN = "\n<tool_call>\n"
_TOOL_CALL_CLOSE = "\n</tool_call>"
# Reasoning block tags, as Qwen3 / DeepSeek-R1 style reasoning parsers expect them.
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# SGLang's graceful abort (FINISH_ABORT() without status code, schedule_batch.py).
ABORT_FINISH: dict[str, Any] = {
    "type": "abort",
    "message": "Aborted",
    "status_code": None,
    "err_type": None,
}


class TokenizerLike(Protocol):
    """The part of `sessiongate.tokenizer` the mock engine needs."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def end_of_turn_token_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...


@dataclass(frozen=True, slots=True)
class ToolCall:
    call_id: str
    name: str
    arguments: str  # JSON text, as OpenAI puts it in `function.arguments`

    def to_openai(self) -> dict[str, Any]:
        # SGLang's ToolCall field order: id, index, type, function.
        return {
            "id": self.call_id,
            "index": 0,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, slots=True)
class Completion:
    """One generated reply. `ids` are all sampled tokens (end-of-turn included when present).

    The text the ids spell (end token excluded) is `think_text + content + tool_call_text`:
    an optional reasoning block (`<think>...</think>`, possibly cut short), the assistant
    content, then the raw tool-call text.
    """

    key: bytes  # per-request RNG key (text, logprobs, tool-call ids)
    prompt_tokens: int
    ids: list[int]
    logprobs: list[float]
    content: str  # assistant text after any reasoning block and before any tool call
    content_token_count: int  # ids[think_token_count:][:content_token_count] spell `content`
    finish_reason: FinishReason  # OpenAI choice-level value
    meta_finish_reason: dict[str, Any]  # SGLang meta_info value
    tool_call: ToolCall | None = None
    tool_call_text: str = ""  # raw text of the tool-call tokens (between content and end)
    think_text: str = ""  # the reasoning block as generated ("" when none)
    think_token_count: int = 0
    token_texts: tuple[str, ...] = ()  # decode([id]) per id (logprob token text)
    # Each id's own bytes (byte-level BPE), () when the tokenizer is not byte-level.
    token_bytes: tuple[bytes, ...] = ()

    @property
    def completion_tokens(self) -> int:
        return len(self.ids)

    @property
    def has_end(self) -> bool:
        return self.finish_reason in ("stop", "tool_calls")

    @property
    def text(self) -> str:
        return self.think_text + self.content + self.tool_call_text

    @property
    def reasoning(self) -> str | None:
        """What a reasoning parser puts in `reasoning_content` (None without a block)."""
        if not self.think_text:
            return None
        body = self.think_text[len(THINK_OPEN) :]
        return body[: -len(THINK_CLOSE)] if body.endswith(THINK_CLOSE) else body

    @property
    def reasoning_tokens(self) -> int:
        """SGLang's count: every token up to and including the end tag (Req.reasoning_tokens)."""
        return self.think_token_count

    def output_token_logprobs(self, start: int = 0, stop: int | None = None) -> list[list[Any]]:
        """SGLang's `[[logprob, token_id, token_text], ...]`.

        The chat endpoint asks for text in logprobs (`return_text_in_logprobs=True`), so the
        text is each token decoded alone (special tokens kept), never null.
        """
        end = len(self.ids) if stop is None else stop
        return [[self.logprobs[i], self.ids[i], self.token_texts[i]] for i in range(start, end)]


@dataclass(frozen=True, slots=True)
class StreamPiece:
    """The tokens of one streamed step and what its chunks carry."""

    start: int
    stop: int
    content: str  # content delta ("" when these tokens add no content text)
    tool_call: ToolCall | None = None  # set on the step that completes the tool call
    reasoning: str = ""  # reasoning delta (text inside the think block)


@dataclass(slots=True)
class _WordTable:
    """Per-word token counts, used to pick how many words fit a token budget."""

    words: tuple[str, ...]
    first_len: dict[str, int] = field(default_factory=dict)
    next_len: dict[str, int] = field(default_factory=dict)


def request_key(
    engine_seed: int, request_seed: int | None, prompt_ids: Sequence[int], variant: str = ""
) -> bytes:
    """blake2b over the seeds and the prompt ids as little-endian uint32.

    `variant` (e.g. a LoRA adapter name) joins the key only when non-empty, so replies
    without one keep the historical key.
    """
    ids = array("I", prompt_ids) if array("I").itemsize == 4 else array("L", prompt_ids)
    if sys.byteorder == "big":
        ids.byteswap()
    h = hashlib.blake2b(digest_size=32, person=b"sg-mock-engine")
    h.update(f"{engine_seed}|{'' if request_seed is None else request_seed}|".encode())
    if variant:
        h.update(f"lora:{variant}|".encode())
    h.update(ids.tobytes())
    return h.digest()


def _rng(key: bytes, stream: bytes) -> random.Random:
    # Separate streams so e.g. truncation by max_tokens leaves earlier logprobs unchanged.
    return random.Random(hashlib.blake2b(key + stream, digest_size=16).digest())


class CompletionGenerator:
    """Turns prompt ids into a deterministic `Completion` for one tokenizer and config."""

    def __init__(
        self,
        tokenizer: TokenizerLike,
        *,
        engine_seed: int = 0,
        completion_tokens: int = 32,
        completion_tokens_jitter: int = 0,
        tool_call_rate: float = 0.0,
        non_ascii: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.engine_seed = engine_seed
        self.completion_tokens = completion_tokens
        self.jitter = completion_tokens_jitter
        self.tool_call_rate = tool_call_rate
        self.non_ascii = non_ascii
        self.end_id = tokenizer.end_of_turn_token_id
        self._table = self._build_table()

    def _build_table(self) -> _WordTable:
        enc = self.tokenizer.encode
        pool = WORDS + NON_ASCII_WORDS if self.non_ascii else WORDS
        first = {w: len(enc(w)) for w in pool}
        nxt = {w: len(enc(" " + w)) for w in pool}
        if self.non_ascii:
            # Multi-token words on purpose; a max_tokens cut takes exactly max_tokens ids
            # instead (`_plain`), possibly inside a character, as an engine does.
            return _WordTable(pool, first, nxt)
        single = tuple(w for w in WORDS if first[w] == 1 and nxt[w] == 1)
        # Prefer one-token words so a max_tokens cut lands exactly on the limit.
        words = single if len(single) >= 16 else WORDS
        return _WordTable(words, first, nxt)

    def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        request_seed: int | None = None,
        max_tokens: int | None = None,
        tools: Sequence[Any] | None = None,
        reasoning: bool = False,
        variant: str = "",
    ) -> Completion:
        """The reply to `prompt_ids`. `reasoning` opens it with a `<think>` block that takes
        about half of the natural length; `variant` (a LoRA adapter) changes the RNG key."""
        key = request_key(self.engine_seed, request_seed, prompt_ids, variant)
        rng = _rng(key, b"text")
        tool_name = _first_tool_name(tools)
        wants_tool = tool_name is not None and rng.random() < self.tool_call_rate
        target = self.completion_tokens + rng.randint(-self.jitter, self.jitter)
        words = self._draw_words(rng, target)
        think_text = ""
        think_ids: list[int] = []
        if reasoning:
            think_text, think_ids = self._think_block(key, target)
            target = max(1, target - len(think_ids))
            if max_tokens is not None and len(think_ids) >= max_tokens:
                # The budget ends inside the reasoning block: cut it at a token.
                cut = think_ids[:max_tokens]
                return self._finish(
                    key, prompt_ids, self.tokenizer.decode(cut), cut, "", [], [], "", None,
                    truncated=max_tokens,
                )  # fmt: skip
        budget = None if max_tokens is None else max_tokens - len(think_ids)
        completion: Completion | None = None
        if wants_tool and tool_name is not None:
            call = _make_tool_call(rng, key, tool_name, tools)
            completion = self._with_tool_call(
                key, prompt_ids, think_text, think_ids, words, target, call, budget, max_tokens
            )
        if completion is None:
            completion = self._plain(
                key, prompt_ids, think_text, think_ids, words, target, budget, max_tokens
            )
        return completion

    def _think_block(self, key: bytes, target: int) -> tuple[str, list[int]]:
        """`<think>words</think>` of about target/2 tokens (own RNG stream), or nothing when
        this tokenizer does not spell the tags back exactly."""
        enc = self.tokenizer.encode
        open_ids, close_ids = enc(THINK_OPEN), enc(THINK_CLOSE)
        budget = max(1, target // 2 - len(open_ids) - len(close_ids))
        rtext, rids = self._fit_words(self._draw_words(_rng(key, b"think"), budget), budget)
        text = THINK_OPEN + rtext + THINK_CLOSE
        ids = open_ids + rids + close_ids
        if self.tokenizer.decode(ids) != text:
            return "", []
        return text, ids

    def _draw_words(self, rng: random.Random, target: int) -> list[str]:
        # Enough words to fill `target` tokens by the per-word estimate; exact fit comes later.
        words: list[str] = []
        count = 0
        while count < target:
            w = rng.choice(self._table.words)
            count += (self._table.next_len if words else self._table.first_len)[w]
            words.append(w)
        return words

    def _fit_words(self, words: list[str], budget: int) -> tuple[str, list[int]]:
        """Longest word prefix whose encoding has <= budget tokens and round-trips exactly."""
        t = self._table
        k, count = 0, 0
        for i, w in enumerate(words):
            n = (t.next_len if i else t.first_len)[w]
            if count + n > budget:
                break
            count += n
            k += 1
        while k > 0:
            text = " ".join(words[:k])
            ids = self.tokenizer.encode(text)
            if len(ids) <= budget and self.tokenizer.decode(ids) == text:
                return text, ids
            k -= 1  # the estimate was off for this tokenizer: drop a word and re-check
        return "", []

    def _plain(
        self,
        key: bytes,
        prompt_ids: Sequence[int],
        think_text: str,
        think_ids: list[int],
        words: list[str],
        target: int,
        budget: int | None,
        max_tokens: int | None,
    ) -> Completion:
        text, ids = self._fit_words(words, target - 1)
        if budget is not None and len(ids) + 1 > budget:
            text, ids = self._fit_words(words, budget)
            if self.non_ascii and len(ids) < budget:
                # An engine stops at exactly max_tokens, mid-word or mid-character.
                cut = self.tokenizer.encode(" ".join(words))[:budget]
                if len(cut) == budget:
                    text, ids = self.tokenizer.decode(cut), cut
            return self._finish(
                key, prompt_ids, think_text, think_ids, text, ids, [], "", None,
                truncated=max_tokens,
            )  # fmt: skip
        return self._finish(
            key, prompt_ids, think_text, think_ids, text, ids, [], "", None, truncated=None
        )

    def _with_tool_call(
        self,
        key: bytes,
        prompt_ids: Sequence[int],
        think_text: str,
        think_ids: list[int],
        words: list[str],
        target: int,
        call: ToolCall,
        budget: int | None,
        max_tokens: int | None,
    ) -> Completion | None:
        call_text = (
            _TOOL_CALL_OPEN
            + json.dumps({"name": call.name, "arguments": json.loads(call.arguments)})
            + _TOOL_CALL_CLOSE
        )
        call_ids = self.tokenizer.encode(call_text)
        text, ids = self._fit_words(words, max(0, target - 1 - len(call_ids)))
        if budget is not None and len(ids) + len(call_ids) + 1 > budget:
            return None  # no room for a whole call: reply with plain (truncated) text instead
        if self.tokenizer.decode(think_ids + ids + call_ids) != think_text + text + call_text:
            return None  # this tokenizer does not concatenate cleanly; skip the tool call
        return self._finish(
            key, prompt_ids, think_text, think_ids, text, ids, call_ids, call_text, call,
            truncated=None,
        )  # fmt: skip

    def _finish(
        self,
        key: bytes,
        prompt_ids: Sequence[int],
        think_text: str,
        think_ids: list[int],
        text: str,
        content_ids: list[int],
        call_ids: list[int],
        call_text: str,
        call: ToolCall | None,
        *,
        truncated: int | None,
    ) -> Completion:
        ids = think_ids + content_ids + call_ids
        finish: FinishReason
        if truncated is not None:
            finish = "length"
            meta_finish: dict[str, Any] = {"type": "length", "length": truncated}
        else:
            ids.append(self.end_id)
            finish = "tool_calls" if call is not None else "stop"
            meta_finish = {"type": "stop", "matched": self.end_id}
        lp_rng = _rng(key, b"logprobs")
        # `or 0.0` turns -0.0 into 0.0; every value is <= 0 like a real log-probability.
        logprobs = [-round(lp_rng.expovariate(4.0), 6) or 0.0 for _ in ids]
        return Completion(
            key=key,
            prompt_tokens=len(prompt_ids),
            ids=ids,
            logprobs=logprobs,
            content=text,
            content_token_count=len(content_ids),
            finish_reason=finish,
            meta_finish_reason=meta_finish,
            tool_call=call,
            tool_call_text=call_text,
            think_text=think_text,
            think_token_count=len(think_ids),
            token_texts=tuple(self.tokenizer.decode([i]) for i in ids),
            token_bytes=token_bytes(self.tokenizer, ids),
        )

    def aborted(self, completion: Completion, tokens: int) -> Completion:
        """`completion` cut after `tokens` tokens and finished like SGLang's graceful abort.

        A cut inside the reasoning block leaves it open; a cut inside the tool call leaves
        its partial text as content (a tool-call parser cannot parse half a call).
        """
        k = max(0, min(tokens, completion.completion_tokens))
        n_think = min(k, completion.think_token_count)
        think_ids = completion.ids[:n_think]
        rest = completion.ids[n_think:k]
        if rest and rest[-1] == self.end_id and k == completion.completion_tokens:
            rest = rest[:-1]
        decode = self.tokenizer.decode
        think_text = (
            completion.think_text if n_think == completion.think_token_count else decode(think_ids)
        )
        return Completion(
            key=completion.key,
            prompt_tokens=completion.prompt_tokens,
            ids=completion.ids[:k],
            logprobs=completion.logprobs[:k],
            content=decode(rest) if rest else "",
            content_token_count=len(rest),
            finish_reason="abort",
            meta_finish_reason=dict(ABORT_FINISH),
            think_text=think_text if n_think else "",
            think_token_count=n_think,
            token_texts=completion.token_texts[:k],
            token_bytes=completion.token_bytes[:k],
        )

    def stream_pieces(self, completion: Completion, chunk_tokens: int) -> list[StreamPiece]:
        """The reply as the engine streams it: one step per `chunk_tokens` tokens (SGLang's
        `--stream-interval`, 1 by default), each with the text delta the detokenizer gives.

        The deltas follow managers/detokenizer_manager.py: a step whose new text decodes
        cleanly sends it; a step whose new text is empty or ends in an incomplete UTF-8
        character ("\ufffd") sends only its printable prefix (`_printable`) and decodes again
        with the next step; the final step sends the rest of the (stop-trimmed) text. So
        steps without text are common: the end-of-turn token (a special token decodes to
        nothing) and tokens inside a multi-byte character. Reasoning and content deltas
        concatenate to `completion.reasoning` and `completion.content`.
        """
        text = completion.text
        n_text = completion.completion_tokens - (1 if completion.has_end else 0)
        text_ids = completion.ids[:n_text]
        decode = self.tokenizer.decode
        r_lo = len(THINK_OPEN) if completion.think_text else 0
        r_hi = len(completion.think_text)
        if completion.think_text.endswith(THINK_CLOSE):
            r_hi -= len(THINK_CLOSE)
        c_lo = len(completion.think_text)
        c_hi = c_lo + len(completion.content)
        t_hi = len(text)
        pieces: list[StreamPiece] = []
        surr = read = 0  # the detokenizer's offsets into the ids
        committed = 0  # characters of `text` decoded cleanly
        sent = 0  # characters of `text` already streamed (committed + printable)
        for start in range(0, completion.completion_tokens, chunk_tokens):
            stop = min(start + chunk_tokens, completion.completion_tokens)
            shown = sent
            if stop >= completion.completion_tokens:
                shown = t_hi  # finished: the rest of the text
            else:
                upto = min(stop, n_text)
                new = decode(text_ids[surr:upto])[len(decode(text_ids[surr:read])) :]
                if new and not new.endswith("\ufffd"):
                    committed += len(new)
                    surr, read = read, upto
                    shown = max(sent, committed)
                else:
                    shown = max(sent, committed + len(_printable(new)))
            reasoning = text[max(sent, r_lo) : max(min(shown, r_hi), r_lo)] if r_hi else ""
            content = text[max(sent, c_lo) : max(min(shown, c_hi), c_lo)]
            call = None
            if completion.tool_call is not None and sent < t_hi <= shown:
                call = completion.tool_call
            sent = shown
            pieces.append(StreamPiece(start, stop, content, call, reasoning))
        return pieces


def _printable(text: str) -> str:
    """What the detokenizer streams of text that is not clean yet (its
    `find_printable_text`): all of it after a newline or a CJK character, all but the last
    character after a CJK one, else up to the last space."""
    if text.endswith("\n"):
        return text
    if text and _is_cjk(text[-1]):
        return text
    if len(text) > 1 and _is_cjk(text[-2]):
        return text[:-1]
    return text[: text.rfind(" ") + 1]


def _is_cjk(char: str) -> bool:
    code = ord(char)
    return any(lo <= code <= hi for lo, hi in _CJK_RANGES)


# The CJK Unified Ideographs blocks and their compatibility forms.
_CJK_RANGES = (
    (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F),
)  # fmt: skip


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


def _first_tool_name(tools: Sequence[Any] | None) -> str | None:
    if not tools:
        return None
    first = tools[0]
    if isinstance(first, Mapping):
        fn = first.get("function")
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str) and fn["name"]:
            return str(fn["name"])
    return None


def _make_tool_call(
    rng: random.Random, key: bytes, name: str, tools: Sequence[Any] | None
) -> ToolCall:
    """Arguments follow the first tool's JSON-schema property types, values from `rng`."""
    props: Mapping[str, Any] = {}
    if tools:
        params = tools[0].get("function", {}).get("parameters")
        if isinstance(params, Mapping) and isinstance(params.get("properties"), Mapping):
            props = params["properties"]
    args: dict[str, Any] = {}
    for prop, schema in list(props.items())[:4]:
        kind = schema.get("type") if isinstance(schema, Mapping) else None
        if kind == "integer":
            args[prop] = rng.randint(0, 100)
        elif kind == "number":
            args[prop] = round(rng.random() * 100, 2)
        elif kind == "boolean":
            args[prop] = rng.random() < 0.5
        else:
            args[prop] = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
    call_id = "call_" + hashlib.blake2b(key + b"call", digest_size=12).hexdigest()
    return ToolCall(call_id, name, json.dumps(args))


@functools.lru_cache(maxsize=16)
def _expert_tables(experts: int, topk: int) -> tuple[tuple[bytes, bytes], ...]:
    """Per slot k: (low byte, high byte) tables from a random byte b to an expert id.

    E <= 256: id = (b % E + k) % E. E > 256: id = ((b + k) % 256) * E // 256 (256 ids spread
    over the whole range). Both keep the `topk` ids of one (row, layer) distinct.
    """
    tables: list[tuple[bytes, bytes]] = []
    for k in range(topk):
        if experts <= 256:
            ids = [(b % experts + k) % experts for b in range(256)]
        else:
            ids = [((b + k) % 256) * experts // 256 for b in range(256)]
        tables.append((bytes(i & 0xFF for i in ids), bytes(i >> 8 for i in ids)))
    return tuple(tables)


def _random_rows(seed: bytes, rows: int, layers: int, topk: int, experts: int) -> bytearray:
    """Little-endian int32 `(rows, layers, topk)` expert ids drawn from `seed`.

    Bulk bytes operations only (no per-value Python objects): one random byte per (row, layer)
    from shake_256, mapped to the `topk` ids with `bytes.translate`, widened to int32 by
    strided slice assignment into a zeroed bytearray.
    """
    base = hashlib.shake_256(seed).digest(rows * layers)
    out = bytearray(rows * layers * topk * 4)
    for k, (lo, hi) in enumerate(_expert_tables(experts, topk)):
        out[4 * k :: 4 * topk] = base.translate(lo)
        if experts > 256:
            out[4 * k + 1 :: 4 * topk] = base.translate(hi)
    return out


@dataclass(frozen=True, slots=True)
class _R3Pool:
    """Pre-encoded random rows for one (layers, topk, experts), served to every request.

    The rows are counted in groups of 3: 3 rows of int32 are a multiple of 3 bytes, so the
    base64 of whole groups is unpadded and base64 slices cut at group boundaries concatenate
    into valid base64 of the concatenated rows.
    """

    groups: int  # 3-row groups in the pool (the pool's period is 3 * groups rows)
    group_b64: int  # base64 bytes of one group (4 * row bytes)
    chunk_groups: int  # groups per chunk
    chunks: tuple[bytes, ...]  # the pool's base64, `chunk_groups` groups per chunk


def _r3_pool(layers: int, topk: int, experts: int) -> _R3Pool:
    # The sizes are read at call time (and key the cache) so tests can shrink the pool.
    return _build_r3_pool(layers, topk, experts, R3_POOL_B64, R3_POOL_CHUNK_B64)


@functools.lru_cache(maxsize=8)
def _build_r3_pool(layers: int, topk: int, experts: int, pool_b64: int, chunk_b64: int) -> _R3Pool:
    """About `pool_b64` bytes of base64 random rows in chunks of at most `chunk_b64` bytes."""
    group_b64 = 4 * layers * topk * 4
    # Chunks no bigger than a send slice: whole chunks go out as the bytes objects they are.
    chunk_groups = max(1, chunk_b64 // group_b64)
    want_groups = max(1, pool_b64 // group_b64)
    n_chunks = -(-want_groups // chunk_groups)
    seed = b"sg-mock-r3-pool|%d|%d|%d|" % (layers, topk, experts)
    chunks = tuple(
        base64.b64encode(
            _random_rows(seed + i.to_bytes(8, "little"), 3 * chunk_groups, layers, topk, experts)
        )
        for i in range(n_chunks)
    )
    return _R3Pool(n_chunks * chunk_groups, group_b64, chunk_groups, chunks)


def r3_pool_rows(layers: int, topk: int, experts: int) -> int:
    """The pool's period in rows (it repeats, wrapping around, every this many)."""
    return 3 * _r3_pool(layers, topk, experts).groups


def _pool_slices(pool: _R3Pool, start: int, groups: int) -> list[bytes | memoryview]:
    """`groups` consecutive groups of the pool's base64 from group `start`, wrapping around."""
    parts: list[bytes | memoryview] = []
    at, left = start % pool.groups, groups
    while left:
        index, within = divmod(at, pool.chunk_groups)
        take = min(pool.chunk_groups - within, left)
        chunk = pool.chunks[index]
        if take == pool.chunk_groups:
            parts.append(chunk)  # the bytes object itself: the HTTP layer sends it uncopied
        else:
            lo = within * pool.group_b64
            parts.append(memoryview(chunk)[lo : lo + take * pool.group_b64])
        left -= take
        at = (at + take) % pool.groups
    return parts


def _block_offsets(
    tokens: Sequence[int], blocks: int, shape: tuple[int, int, int], seed: int, tag: bytes
) -> list[int]:
    """Pool group offset of each R3 block: a hash chain over the tokens, O(len(tokens)).

    Block j (rows `[j * B, (j + 1) * B)`) hashes the tokens `[0, j * B]`: the chain value of
    the block before it and the tokens since. Row r of block j is the routing of token r >= jB,
    so every row depends on its own token prefix only (never on tokens after it).
    """
    if blocks <= 0:
        return []
    B = R3_BLOCK_ROWS
    ids = array("q", tokens[: (blocks - 1) * B + 1])
    if sys.byteorder == "big":
        ids.byteswap()
    data = memoryview(ids).cast("B")
    pool_groups = _r3_pool(*shape).groups
    state = hashlib.blake2b(
        b"sg-mock-r3|%s|%d|%d|%d|%d" % (tag, seed, *shape), digest_size=16
    ).digest()
    offsets: list[int] = []
    lo = 0
    for j in range(blocks):
        hi = 8 * (j * B + 1)
        h = hashlib.blake2b(state, digest_size=16)
        h.update(data[lo:hi])
        state, lo = h.digest(), hi
        offsets.append(int.from_bytes(state[:8], "little") % pool_groups)
    return offsets


def _coalesce(parts: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """Runs of small slices (small row shapes) joined into bytes of up to ~256 KiB, so a big
    reply is not thousands of tiny sends; slices of 16 KiB or more stay as they are."""
    out: list[bytes | memoryview] = []
    run: list[bytes | memoryview] = []
    size = 0
    for part in parts:
        if len(part) >= _COALESCE_BELOW:
            if run:
                out.append(b"".join(run) if len(run) > 1 else run[0])
                run, size = [], 0
            out.append(part)
            continue
        run.append(part)
        size += len(part)
        if size >= _COALESCE_TO:
            out.append(b"".join(run))
            run, size = [], 0
    if run:
        out.append(b"".join(run) if len(run) > 1 else run[0])
    return out


def routed_experts_b64(
    tokens: Sequence[int],
    layers: int,
    topk: int,
    experts: int,
    start: int = 0,
    *,
    seed: int = 0,
    tag: bytes = b"r3",
) -> bytes:
    """Base64 (ASCII bytes) of little-endian int32 `(rows - start, layers, topk)` expert ids,
    `rows = len(tokens) - 1` (see `routed_experts_b64_parts`)."""
    parts = routed_experts_b64_parts(tokens, layers, topk, experts, start, seed=seed, tag=tag)
    return b"".join(parts)


def routed_experts_b64_parts(
    tokens: Sequence[int],
    layers: int,
    topk: int,
    experts: int,
    start: int = 0,
    *,
    seed: int = 0,
    tag: bytes = b"r3",
) -> list[bytes | memoryview]:
    """Rows `[start, len(tokens) - 1)` of the sequence's R3 as base64 slices (their
    concatenation), mostly zero-copy views of the shared pool.

    Row r is the routing of token r and, as in SGLang, a function of the token prefix
    `tokens[:r + 1]` only (plus the engine `seed`, `tag` and the shape): a later turn that
    extends a sequence repeats the earlier rows, which "addition R3" relies on. Rows come in
    blocks of `R3_BLOCK_ROWS` (a multiple of 3): block j is that many consecutive pool rows
    from a group offset hashed from `tokens[:j * B + 1]`, so sequences with different prefixes
    get different rows from the first block boundary at or after where they differ (row 0
    depends on token 0). A block cut short by the sequence's end is the start of the
    same block. Whole 3-row groups are the pool's own base64 (bytes chunks or memoryviews,
    sent as they are: joining 80 MiB costs a copy and a long GIL hold); only a final partial
    group (`rows % 3` rows, the only padded base64) is re-encoded. A `start` that is not a
    multiple of 3 (SGLang's routed_experts_start_len) re-encodes rows `[start, rows)` from
    the groups that cover them, so the cost follows the rows asked for.
    """
    rows = len(tokens) - 1
    if rows - start <= 0 or layers <= 0 or topk <= 0:
        return []
    if start % 3:
        aligned = start - start % 3
        parts = routed_experts_b64_parts(tokens, layers, topk, experts, aligned, seed=seed, tag=tag)
        raw = base64.b64decode(b"".join(parts))
        return [base64.b64encode(memoryview(raw)[(start - aligned) * layers * topk * 4 :])]
    B = R3_BLOCK_ROWS
    pool = _r3_pool(layers, topk, experts)
    offsets = _block_offsets(tokens, -(-rows // B), (layers, topk, experts), seed, tag)
    parts = []
    for j in range(start // B, len(offsets)):
        first = max(start, j * B) - j * B  # a multiple of 3
        groups, extra = divmod(min(rows, (j + 1) * B) - j * B - first, 3)
        at = offsets[j] + first // 3
        parts += _pool_slices(pool, at, groups)
        if extra:  # the sequence ends inside a group: its first rows, padded
            group = base64.b64decode(b"".join(_pool_slices(pool, at + groups, 1)))
            parts.append(base64.b64encode(group[: extra * layers * topk * 4]))
    return _coalesce(parts)
