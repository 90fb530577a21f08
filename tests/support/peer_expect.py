"""The rollout framework's side of the peer test: what its TITO package
(`miles-tito-tokenizers`) says each prompt of a trajectory must be, what a model would have
sampled, and its mismatch report.

Everything here is computed by the package itself (`get_tito_tokenizer(...).render_messages`,
`.merge_tokens`, `.create_comparator()`); the test only feeds it the same messages, ids,
tools and template variables the gateway got.

One accepted difference is substituted, not hidden: SGLang 0.5.23 hands the chat template
each tool as its pydantic `Tool.model_dump()` (a tool-level `"defer_loading": null`,
`description` / `parameters` always present, the function's keys in the client's order), and
sessiongate renders tools that way, as the engine would from the same request; the package's
`extract_tool_dicts` (an older copy of the framework's) dumps `{type, function: {name,
description, parameters}}`. For templates that print the tools (`tools | tojson`) the turn-1
text differs there. `sglang_tool_dump` restates SGLang 0.5.23's dump and `sglang_tools`
puts it in the package's place, so every package render (turn 1, merged turns, re-renders
for the comparator) is compared token for token over the whole prompt. Comparing "from the
first difference onward" instead would need a resynchronisation after each tool's text, and
would still leave the comparator reports unequal on the same ids (the package's re-render
would differ from sessiongate's there). `known_tool_difference` shows that the substitution
changes nothing else, and the test names it (`test_known_tool_difference`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from support.peer_families import GLM47_STOPS, STOP_TOKEN, Deployment

Message = dict[str, Any]


def sglang_tool_dump(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """`tools` as SGLang 0.5.23 passes them to the template (protocol.py `Tool` /
    `Function` `model_dump()`, serving_chat.py `_process_messages`): `type` (default
    "function"), `function` with the client's keys in their order then `description` and
    `parameters` (null when absent), and the tool's `defer_loading` (null when unset).
    Restated for the mock trajectories' tools only: they have no key SGLang would drop or
    coerce (`strict`, extra members), so none is handled here."""
    if not tools:
        return None
    dumped = []
    for tool in tools:
        function = dict(tool["function"])
        for key in ("description", "parameters"):
            function.setdefault(key, None)
        dumped.append(
            {
                "type": tool.get("type", "function"),
                "function": function,
                "defer_loading": tool.get("defer_loading"),
            }
        )
    return dumped


@contextmanager
def sglang_tools() -> Iterator[None]:
    """Within: the package dumps tools as SGLang 0.5.23 does (see the module docstring)."""
    import miles_tito_tokenizers.template as template

    original = template.extract_tool_dicts
    template.extract_tool_dicts = sglang_tool_dump
    try:
        yield
    finally:
        template.extract_tool_dicts = original


def known_tool_difference(tito: Any, messages: list[Message], tools: list[Any]) -> str:
    """The package's own turn-1 text with `"defer_loading": null` put after each tool's
    function: equal to the render with SGLang's dump when that is the only difference."""
    text = tito.render_messages(messages, add_generation_prompt=True, tools=tools)
    for tool in tools:
        # `tools | tojson` as it is, or with compact separators (Kimi K2.5's template).
        for comma, colon in ((", ", ": "), (",", ":")):
            function = json.dumps(tool["function"], ensure_ascii=False, separators=(comma, colon))
            text = text.replace(function + "}", f'{function}{comma}"defer_loading"{colon}null}}')
    return text


def wire(message: Message) -> Message:
    """A message as an OpenAI client sends it: tool-call `arguments` as JSON text (content
    null stays null)."""
    out = copy.deepcopy(message)
    for call in out.get("tool_calls") or []:
        arguments = call["function"].get("arguments")
        if not isinstance(arguments, str):
            call["function"]["arguments"] = json.dumps(arguments, ensure_ascii=False)
    return out


def without_reasoning(messages: Sequence[Message]) -> list[Message]:
    """Thinking off: the model produced no reasoning, so no message carries any."""
    out = []
    for message in messages:
        message = dict(message)
        message.pop("reasoning_content", None)
        out.append(message)
    return out


def split_turns(messages: Sequence[Message]) -> list[tuple[list[Message], Message]]:
    """(request messages, assistant reply) per generated turn, as the package's
    mock_trajectories `_split_turns` cuts a trajectory."""
    turns = []
    for index, message in enumerate(messages):
        if message["role"] == "assistant":
            turns.append((list(messages[:index]), message))
    return turns


@dataclass(frozen=True)
class Sampled:
    """What the replay engine answers for a turn: the message and the sampled ids."""

    message: Message
    ids: list[int]
    texts: list[str]


class FrameworkSide:
    """The package configured for one deployment, trajectory and thinking mode."""

    def __init__(
        self,
        hf_tokenizer: Any,
        deployment: Deployment,
        append_roles: frozenset[str],
        template_kwargs: Mapping[str, Any],
    ) -> None:
        from miles_tito_tokenizers import get_tito_tokenizer

        self.tok = hf_tokenizer
        self.family = deployment.family
        self.tito = get_tito_tokenizer(
            hf_tokenizer,
            deployment.family,
            chat_template_kwargs=dict(template_kwargs),
            allowed_append_roles=sorted(append_roles),
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def render(self, messages: list[Message], tools: Any, *, generation: bool) -> str:
        with sglang_tools():
            text = self.tito.render_messages(
                messages, add_generation_prompt=generation, tools=tools
            )
        assert isinstance(text, str)
        return text

    def first_prompt(self, messages: list[Message], tools: Any) -> list[int]:
        """Turn 1 (or a resumed session's first turn): the full render, tokenized."""
        return self.encode(self.render(messages, tools, generation=True))

    def merged_prompt(
        self, old: list[Message], new: list[Message], pretokenized: list[int], tools: Any
    ) -> list[int]:
        """A later turn: the package's `merge_tokens`, with the one accepted difference of
        the `default` family (`default_family_junction`)."""
        with sglang_tools():
            merged = list(self.tito.merge_tokens(old, new, pretokenized, tools))
        if self.family == "default":
            return default_family_junction(self.tok, pretokenized, merged)
        return merged

    def sampled(self, request: list[Message], assistant: Message, tools: Any) -> Sampled:
        """The ids a model would emit for `assistant` after `request`'s generation prompt:
        the assistant's rendered text past the prompt, cut right after the turn's stop
        token (GLM 4.7: its stop token appended, see GLM47_STOPS)."""
        prompt = self.render(request, tools, generation=True)
        full = self.render([*request, assistant], tools, generation=False)
        text = full[self._divergence(prompt, full) :]
        if self.family == "glm47":
            stop = GLM47_STOPS["tool_calls" if assistant.get("tool_calls") else "plain"]
            assert stop not in text, text
            text += stop
        else:
            stop = STOP_TOKEN[self.family]
            end = text.index(stop) + len(stop)
            assert not text[end:].strip(), f"text after the stop token: {text[end:]!r}"
            text = text[:end]
        ids = self.encode(text)
        reply = wire(assistant)
        if reply.get("content") is None:
            reply["content"] = ""  # SGLang's reply carries a string (the gateway needs one)
        return Sampled(reply, ids, [self.tok.decode([i]) for i in ids])

    def _divergence(self, prompt: str, full: str) -> int:
        """Where the model's text starts in `full`: the end of `prompt` when `full` extends
        it. Else the generation prompt opens a block that the assistant's re-render lacks
        (GLM 4.7 and MiniMax open `<think>` in the prompt but render a history assistant
        without reasoning with `</think>` alone / no think block): the model continued from
        the prompt with the re-render's text from where the two part, backed up to a token
        boundary of the prompt. The prompt's opener stays in the trajectory, as in a real
        rollout, and both sides' mismatch reports must show it alike."""
        if full.startswith(prompt):
            return len(prompt)
        common = next(i for i, (a, b) in enumerate(zip(prompt, full, strict=False)) if a != b)
        offsets = self.tok(prompt, add_special_tokens=False, return_offsets_mapping=True)
        return max((end for _, end in offsets["offset_mapping"] if end <= common), default=0)

    def report(self, messages: list[Message], tools: Any, actual: list[int]) -> list[dict]:
        """The package's comparator on `actual` against a fresh render of `messages`."""
        expected = self.encode(self.render(messages, tools, generation=False))
        comparator = self.tito.create_comparator()
        return [m.to_dict() for m in comparator.compare_sequences(expected, actual)]


def default_family_junction(tok: Any, pretokenized: list[int], merged: list[int]) -> list[int]:
    """The accepted difference, named: after a sampled `<|im_end|>` the package's generic
    (DEFAULT) family joins the next message directly, while sessiongate inserts what the
    template renders after it (ChatML's newline, as the package's qwen3 family does), so its
    prompt equals the full render (docs/tokenizer.md, Model families, `default`). Everything
    else must be the package's."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    if not pretokenized or pretokenized[-1] != end:
        return merged
    cut = len(pretokenized)
    return [*merged[:cut], *tok.encode("\n", add_special_tokens=False), *merged[cut:]]


def first_difference(tok: Any, expected: list[int], actual: list[int], width: int = 6) -> str:
    """Where two id lists part, with the decoded tokens around it on each side."""
    index = next(
        (i for i, (a, b) in enumerate(zip(expected, actual, strict=False)) if a != b),
        min(len(expected), len(actual)),
    )
    lo = max(0, index - width)

    def around(ids: list[int]) -> str:
        return (
            repr(tok.decode(ids[lo:index])) + " | " + repr(tok.decode(ids[index : index + width]))
        )

    return (
        f"first difference at index {index} (lengths {len(expected)} / {len(actual)}):\n"
        f"  package:     {around(expected)}\n"
        f"  sessiongate: {around(actual)}"
    )
