"""Deterministic fake generation: tokens, logprobs, reasoning, tool calls, aborts, stream steps.

Everything here is a pure function of (engine seed, request seed, prompt ids) so tests and
benchmarks can replay a reply exactly. Completions are made of whole words from a fixed list
and cut only on word boundaries, so `encode(content) == content ids` holds (the TITO checker
relies on re-tokenization stability) and `decode(content ids) == content`.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sessiongate.mock_engine.completion import (
    THINK_CLOSE,
    THINK_OPEN,
    Completion,
    FinishReason,
    StreamPiece,
    ToolCall,
)
from sessiongate.mock_engine.tokens import TokenizerLike, token_bytes

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

_TOOL_CALL_OPEN = "\n<tool_call>\n"
_TOOL_CALL_CLOSE = "\n</tool_call>"
# SGLang's graceful abort (FINISH_ABORT() without status code, schedule_batch.py).
ABORT_FINISH: dict[str, Any] = {
    "type": "abort",
    "message": "Aborted",
    "status_code": None,
    "err_type": None,
}


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
        natural_tokens: int | None = None,
    ) -> Completion:
        """The reply to `prompt_ids`. `reasoning` opens it with a `<think>` block that takes
        about half of the natural length; `variant` (a LoRA adapter) changes the RNG key;
        `natural_tokens` overrides the natural length (ignore_eos: run to max_tokens)."""
        key = request_key(self.engine_seed, request_seed, prompt_ids, variant)
        rng = _rng(key, b"text")
        tool_name = _first_tool_name(tools)
        wants_tool = tool_name is not None and rng.random() < self.tool_call_rate
        target = self.completion_tokens + rng.randint(-self.jitter, self.jitter)
        if natural_tokens is not None:
            target = natural_tokens
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
