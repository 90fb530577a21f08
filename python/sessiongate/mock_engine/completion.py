"""What one generation is: the `Completion` record, its tool call and its stream steps.

These records are what the generator produces and what the reply and stream builders read;
they hold no generation logic beyond views of their own fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

FinishReason = Literal["stop", "length", "tool_calls", "abort"]

# Reasoning block tags, as Qwen3 / DeepSeek-R1 style reasoning parsers expect them.
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


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
