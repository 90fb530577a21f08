"""The upstream chat reply, read once through the `extract_reply` primitive (Rust: one pass,
GIL released, R3 stripped by splicing; `SESSIONGATE_IMPL=python`: the json twin).

A reply that breaks the contract is a 502: the engine answered, but not with what a
token-exact trajectory needs. Messages are in docs/api.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from sessiongate.errors import UpstreamError
from sessiongate.primitives import ReplyContractError, extract_reply
from sessiongate.session.messages import Message


@dataclass(frozen=True)
class ParsedReply:
    completion_ids: list[int]
    logprobs: list[float]
    completion_tokens: int
    finish_reason: object
    assistant_message: Message
    # The reply for the client: the upstream bytes without routed_experts / indexer_topk.
    client_body: bytes
    # The base64 text of choices[0].meta_info.routed_experts: a view into the reply bytes
    # the record keeps anyway (no copy), or None.
    routed_experts: memoryview | None
    # choices[0].meta_info.indexer_topk (base64), the same kind of view, or None.
    indexer_topk: memoryview | None
    weight_version: str | None
    cached_tokens: int | None
    # choices[0].meta_info.e2e_latency (seconds) when a number: the samples' lifecycle t0.
    e2e_latency: float | None = None


def parse_reply(body: bytes) -> ParsedReply:
    try:
        extracted = extract_reply(body)
    except ReplyContractError as exc:
        raise UpstreamError(str(exc)) from exc
    return ParsedReply(
        completion_ids=extracted.completion_ids,
        logprobs=extracted.logprobs,
        completion_tokens=extracted.completion_tokens,
        finish_reason=extracted.finish_reason,
        assistant_message=extracted.message,
        client_body=extracted.client_body,
        routed_experts=extracted.routed_experts_view,
        indexer_topk=extracted.indexer_topk_view,
        weight_version=extracted.weight_version,
        cached_tokens=extracted.cached_tokens,
        e2e_latency=extracted.e2e_latency,
    )


def finish_reason_text(reason: object) -> str:
    """SGLang's `{"type": "stop", ...}` or OpenAI's "stop" as one word."""
    if isinstance(reason, dict):
        reason = reason.get("type")
    return reason if isinstance(reason, str) else ""
