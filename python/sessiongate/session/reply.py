"""Validation of an upstream chat reply against the SGLang-style contract, and the client view.

A reply that breaks the contract is a 502: the engine answered, but not with what a
token-exact trajectory needs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sessiongate.session.errors import UpstreamError
from sessiongate.session.messages import Message

# Members of `meta_info` that only the trainer needs; they can be hundreds of MiB.
RECORD_ONLY_META_KEYS = ("routed_experts", "indexer_topk")


@dataclass(frozen=True)
class ParsedReply:
    completion_ids: list[int]
    logprobs: list[float]
    completion_tokens: int
    finish_reason: object
    assistant_message: Message
    document: dict[str, Any]


def _contract_error(detail: str) -> UpstreamError:
    return UpstreamError(f"upstream reply breaks the chat contract: {detail}")


def parse_reply(body: bytes) -> ParsedReply:
    try:
        document = json.loads(body)
    except ValueError as exc:
        raise _contract_error(f"body is not valid JSON ({exc})") from exc
    if not isinstance(document, dict):
        raise _contract_error("body is not a JSON object")
    choices = document.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _contract_error("'choices' is missing or empty")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise _contract_error("choices[0].message is missing")
    if message.get("content") is None:
        raise _contract_error("choices[0].message.content is null")
    meta = choice.get("meta_info")
    if not isinstance(meta, dict):
        raise _contract_error("choices[0].meta_info is missing (was return_meta_info honoured?)")
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list):
        raise _contract_error("choices[0].meta_info.output_token_logprobs is missing")
    completion_tokens = meta.get("completion_tokens")
    if not isinstance(completion_tokens, int) or isinstance(completion_tokens, bool):
        raise _contract_error("choices[0].meta_info.completion_tokens is missing")
    if len(entries) != completion_tokens:
        raise _contract_error(
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
            raise _contract_error(
                f"output_token_logprobs[{index}] is not [logprob, token_id, ...]: {entry!r:.80}"
            )
        logprobs.append(float(entry[0]))
        ids.append(entry[1])
    assistant: Message = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        assistant["tool_calls"] = message["tool_calls"]
    return ParsedReply(
        completion_ids=ids,
        logprobs=logprobs,
        completion_tokens=completion_tokens,
        finish_reason=meta.get("finish_reason", choice.get("finish_reason")),
        assistant_message=assistant,
        document=document,
    )


def client_view(document: dict[str, Any]) -> bytes:
    """The reply sent to the client: the upstream JSON without the record-only members."""
    choices = document.get("choices")
    if isinstance(choices, list) and any(
        isinstance(c, dict)
        and isinstance(c.get("meta_info"), dict)
        and any(k in c["meta_info"] for k in RECORD_ONLY_META_KEYS)
        for c in choices
    ):
        stripped_choices = []
        for choice in choices:
            meta = choice.get("meta_info") if isinstance(choice, dict) else None
            if isinstance(meta, dict):
                meta = {k: v for k, v in meta.items() if k not in RECORD_ONLY_META_KEYS}
                choice = {**choice, "meta_info": meta}
            stripped_choices.append(choice)
        document = {**document, "choices": stripped_choices}
    return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode()


def finish_reason_text(reason: object) -> str:
    """SGLang's `{"type": "stop", ...}` or OpenAI's "stop" as one word."""
    if isinstance(reason, dict):
        reason = reason.get("type")
    return reason if isinstance(reason, str) else ""
