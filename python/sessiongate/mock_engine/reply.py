"""The non-stream chat reply: choice, message, logprobs, usage, meta_info, sglext, metadata.

Shapes follow SGLang 0.5.23's `entrypoints/openai/serving_chat.py` (`_build_chat_response`),
`protocol.py` (models and their field order), `usage_processor.py` and
`managers/tokenizer_manager.py` (meta_info). The pieces the stream shares (logprobs, usage,
finish reason, R3 rows, cached-token details) live here too.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from sessiongate.mock_engine.body_slices import Part, dumps_spliced
from sessiongate.mock_engine.chat_request import ChatRequest
from sessiongate.mock_engine.completion import Completion
from sessiongate.mock_engine.config import MockEngineConfig
from sessiongate.mock_engine.routed_experts import routed_experts_b64_parts
from sessiongate.mock_engine.state import EngineState

# Stand in for the big base64 strings while the small rest of the reply goes through
# json.dumps; the bytes are spliced in afterwards (json.dumps of an 80 MiB string is waste).
ROUTED_EXPERTS_PLACEHOLDER = "@@sessiongate-mock-routed-experts@@"
_INDEXER_PLACEHOLDER = "@@sessiongate-mock-indexer-topk@@"
# Indexer top-k values are KV positions; the mock draws them in [0, this).
INDEXER_POSITIONS = 4096


def routed_experts_parts(
    req: ChatRequest, completion: Completion, cfg: MockEngineConfig
) -> list[Part]:
    # Rows [start, prompt + completion - 1) (io_struct.py GenerateReqInput docs); row r is
    # the routing of token r, a function of the tokens up to it (see routed_experts_b64_parts).
    return routed_experts_b64_parts(
        [*req.prompt_ids, *completion.ids],
        cfg.r3_layers,
        cfg.r3_topk,
        cfg.r3_experts,
        req.r3_start,
        seed=cfg.seed,
    )


def _indexer_parts(req: ChatRequest, completion: Completion, cfg: MockEngineConfig) -> list[Part]:
    return routed_experts_b64_parts(
        [*req.prompt_ids, *completion.ids],
        cfg.indexer_layers,
        cfg.indexer_topk,
        INDEXER_POSITIONS,
        seed=cfg.seed,
        tag=b"indexer",
    )


def meta_info(
    req: ChatRequest,
    completion: Completion,
    *,
    cached_tokens: int,
    weight_version: str,
    e2e_latency: float,
    with_r3: bool,
    cfg: MockEngineConfig,
) -> tuple[dict[str, Any], dict[str, list[Part]]]:
    """SGLang's meta_info (tokenizer_manager.py `_handle_batch_output`, keys in its order),
    and the big base64 values to splice in for their placeholders."""
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": completion.meta_finish_reason,
        "prompt_tokens": completion.prompt_tokens,
        "weight_version": weight_version,
        "num_retractions": 0,
    }
    if req.want_logprobs:  # add_logprob_to_meta_info: only when logprobs were asked for
        meta["input_token_logprobs"] = []  # logprob_start_len -1 = output logprobs only
        meta["output_token_logprobs"] = completion.output_token_logprobs()
        meta["output_token_logprobs_length"] = completion.completion_tokens
    meta["reasoning_tokens"] = completion.reasoning_tokens
    meta["completion_tokens"] = completion.completion_tokens
    meta["cached_tokens"] = cached_tokens
    # utils/weight_versions.py `add_weight_versions_to_meta_info`: the spans of output tokens
    # per weight version; the mock samples a whole reply under one version.
    meta["weight_versions"] = weight_version_spans(weight_version, completion.completion_tokens)
    # scheduler_components/output_streamer.py `get_cached_tokens_details`: null without a
    # cache hit, else the split by cache tier (no hierarchical cache: all on the device).
    meta["cached_tokens_details"] = (
        {"device": cached_tokens, "host": 0} if cached_tokens > 0 else None
    )
    splices: dict[str, list[Part]] = {}
    if with_r3:
        meta["routed_experts"] = ROUTED_EXPERTS_PLACEHOLDER
        splices[ROUTED_EXPERTS_PLACEHOLDER] = routed_experts_parts(req, completion, cfg)
    if req.want_indexer:
        meta["indexer_topk"] = _INDEXER_PLACEHOLDER
        meta["indexer_topk_num_layers"] = cfg.indexer_layers
        splices[_INDEXER_PLACEHOLDER] = _indexer_parts(req, completion, cfg)
    meta["e2e_latency"] = e2e_latency
    # tokenizer_manager.py stamps the wall-clock time just before handing the finished output
    # to the endpoint.
    meta["response_sent_to_client_ts"] = time.time()
    return meta, splices


def weight_version_spans(version: str, completion_tokens: int) -> list[dict[str, Any]]:
    """`meta_info.weight_versions` of a reply sampled under one weight version."""
    return [{"version": version, "start": 0, "end": completion_tokens}]


def choice_logprobs(completion: Completion, start: int, stop: int) -> dict[str, Any]:
    """ChoiceLogprobs (serving_chat.py `_build_token_logprobs_from_raw`): token text and
    bytes, no token ids; field order token, bytes, logprob, top_logprobs."""
    content = []
    for i in range(start, stop):
        text = completion.token_texts[i]
        content.append(
            {
                "token": text,
                # From the token id (byte-level BPE): a piece of a character has text
                # "\ufffd" but its own bytes.
                "bytes": list(completion.token_bytes[i])
                if completion.token_bytes
                else list(text.encode()),
                "logprob": completion.logprobs[i],
                "top_logprobs": [],
            }
        )
    return {"content": content}


def usage_info(completion: Completion, cached: int, cfg: MockEngineConfig) -> dict[str, Any]:
    """UsageInfo (usage_processor.py `calculate_token_usage`, protocol.py field order)."""
    reasoning = completion.reasoning_tokens
    return {
        "prompt_tokens": completion.prompt_tokens,
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
        "completion_tokens": completion.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached} if cfg.enable_cache_report else None,
        "reasoning_tokens": reasoning,
        "completion_tokens_details": {"reasoning_tokens": reasoning} if reasoning else None,
    }


def cached_tokens_details(req: ChatRequest, cached: int) -> dict[str, int] | None:
    """sglext.cached_tokens_details when asked (serving_chat.py): the scheduler reports none
    for a request with nothing cached, else the device / host split (output_streamer.py
    `get_cached_tokens_details`; the mock's cache is all device memory)."""
    if not req.want_cached_details or cached <= 0:
        return None
    return {"device": cached, "host": 0}


def choice_finish(completion: Completion, *, stream: bool) -> tuple[str, Any, dict[str, Any]]:
    """(choice finish_reason, matched_stop, meta_info finish_reason).

    Non-stream, SGLang's tool-call parser rewrites the engine's stop dict in place to
    `{"type": "tool_calls", "matched": None}` (serving_chat.py `_process_tool_calls`), so
    meta_info shows it too. The stream keeps the engine's dict: its finish chunk says
    "tool_calls" but matched_stop is still the stop token.
    """
    meta = dict(completion.meta_finish_reason)
    if completion.finish_reason == "tool_calls":
        if stream:
            return "tool_calls", meta.get("matched"), meta
        meta = {"type": "tool_calls", "matched": None}
    return meta["type"], meta.get("matched"), meta


@dataclass(frozen=True, slots=True)
class Outcome:
    """A finished generation as the reply builders see it."""

    completion: Completion
    cached_tokens: int
    weight_version: str
    e2e_latency: float


def build_reply(
    req: ChatRequest,
    out: Outcome | Completion,
    state: EngineState,
    request_id: str | None = None,
) -> list[Part]:
    """The whole non-stream reply body (serving_chat.py `_build_chat_response`).

    A bare `Completion` stands for an uncached reply at the engine's weight version (the
    in-process callers); `request_id` fills in a request without a rid.
    """
    cfg = state.config
    if isinstance(out, Completion):
        out = Outcome(out, 0, state.weight_version, 0.0)
    if request_id is not None and not req.rid:
        req = dataclasses.replace(req, rid=request_id)
    completion = out.completion
    finish, matched, meta_finish = choice_finish(completion, stream=False)
    reasoning = completion.reasoning
    message: dict[str, Any] = {
        "role": "assistant",
        "content": completion.content,
        "reasoning_content": reasoning if reasoning else None,
    }
    if completion.tool_call is not None:
        message["tool_calls"] = [completion.tool_call.to_openai()]
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": finish,
        "matched_stop": matched,
    }
    if req.want_logprobs:
        choice["logprobs"] = choice_logprobs(completion, 0, completion.completion_tokens)
    splices: dict[str, list[Part]] = {}
    if req.want_meta:
        # With return_meta_info the engine's routed_experts stay in meta_info only.
        meta, splices = meta_info(
            req,
            completion,
            cached_tokens=out.cached_tokens,
            weight_version=out.weight_version,
            e2e_latency=out.e2e_latency,
            with_r3=req.want_r3,
            cfg=cfg,
        )
        meta["finish_reason"] = meta_finish
        choice["meta_info"] = meta
    sglext: dict[str, Any] = {}
    if req.want_r3 and not req.want_meta:
        sglext["routed_experts"] = ROUTED_EXPERTS_PLACEHOLDER
        splices[ROUTED_EXPERTS_PLACEHOLDER] = routed_experts_parts(req, completion, cfg)
    details = cached_tokens_details(req, out.cached_tokens)
    if details is not None:
        sglext["cached_tokens_details"] = details
    if req.want_input_ids:
        sglext["input_ids"] = req.prompt_ids
    if req.want_output_ids:
        sglext["output_ids"] = [completion.ids]
    payload: dict[str, Any] = {
        "id": req.rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [choice],
        "usage": usage_info(completion, out.cached_tokens, cfg),
        # utils/weight_versions.py `build_endpoint_weight_version_metadata`, from the
        # engine's meta_info whether or not the client asked to see it.
        "metadata": {
            "weight_version": out.weight_version,
            "weight_versions": weight_version_spans(
                out.weight_version, completion.completion_tokens
            ),
        },
    }
    if sglext:
        payload["sglext"] = sglext
    return dumps_spliced(payload, splices)
