"""What the mock engine accepts as a chat request, and what it refuses the way SGLang does.

A chat body is checked in SGLang's order (pydantic schema, `_validate_request`,
`_convert_to_internal_request`, prompt rendering, LoRA resolution, the scheduler's
routed_experts_start_len check) and each refusal carries SGLang's status, error type and
message, so clients and the gateway see the same errors as from a real engine. The result is
a `ChatRequest`: everything the reply and the stream need from the body.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from starlette.responses import Response

from sessiongate.mock_engine.body_slices import json_response
from sessiongate.mock_engine.state import EngineState
from sessiongate.mock_engine.tokens import TokenizerLike
from sessiongate.sglang_rules import SglangRules
from sessiongate.tokenizer.message_shape import sglang_messages
from sessiongate.tokenizer.tool_arguments import ToolArgumentsError

# SGLang's ChatCompletionRequest.model default (protocol.py DEFAULT_MODEL_NAME).
DEFAULT_MODEL = "default"
# serving_chat.py `_convert_to_internal_request`, checked in this order with `stream`.
_STREAM_ERRORS = (
    (
        "return_prompt_token_ids",
        "return_prompt_token_ids is not supported with streaming. "
        "Please set stream=false when using return_prompt_token_ids=true.",
    ),
    (
        "return_token_ids",
        "return_token_ids is not supported with streaming on /v1/chat/completions. "
        "Please set stream=false when using return_token_ids=true.",
    ),
    (
        "return_meta_info",
        "return_meta_info is not supported with streaming. "
        "Please set stream=false when using return_meta_info=true.",
    ),
)


class ApiError(Exception):
    """A chat request SGLang would refuse; answered with its `ErrorResponse` body."""

    def __init__(self, message: str, err_type: str = "BadRequestError", status: int = 400):
        super().__init__(message)
        self.message = message
        self.err_type = err_type
        self.status = status

    def response(self) -> Response:
        return error_response(self.message, self.err_type, self.status)


def error_response(message: str, err_type: str, status: int) -> Response:
    """SGLang's `OpenAIServingBase.create_error_response` body (serving_base.py)."""
    body = {"object": "error", "message": message, "type": err_type, "param": None}
    return json_response({**body, "code": status}, status)


def validation_error(errors: list[dict[str, Any]]) -> ApiError:
    """What SGLang's RequestValidationError handler (http_server.py) answers for a body that
    fails pydantic validation: 400, type "Bad Request", the errors in the message. (FastAPI
    also echoes each error's input; the mock leaves it out.)"""
    return ApiError(str(errors), HTTPStatus.BAD_REQUEST.phrase, 400)


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """What the engine needs from a validated chat body (defaults: a plain request, so
    in-process callers such as the relay tests can build one by hand)."""

    prompt_ids: list[int]
    seed: int | None
    max_tokens: int | None
    tools: list[Any] | None  # None when the tool-call parser is not active for the request
    stream: bool
    want_meta: bool  # return_meta_info
    want_logprobs: bool
    want_r3: bool  # return_routed_experts and the engine has R3 on
    model: str = DEFAULT_MODEL
    rid: str = ""  # "" = set by the caller (build_reply's request_id)
    r3_start: int = 0
    want_indexer: bool = False
    want_input_ids: bool = False
    want_output_ids: bool = False
    ids_framed: bool = False
    include_usage: bool = False
    reasoning: bool = False
    lora: str | None = None
    # A stream the scheduler aborted at once (a bad routed_experts_start_len): its message.
    abort_message: str | None = None
    want_cached_details: bool = False  # return_cached_tokens_details


_INT_FIELDS = ("seed", "max_tokens", "max_completion_tokens", "routed_experts_start_len")
_BOOL_FIELDS = (
    "stream",
    "logprobs",
    "return_meta_info",
    "return_routed_experts",
    "return_indexer_topk",
    "return_input_ids_in_sglext",
    "return_output_ids_in_sglext",
    "separate_reasoning",
    "return_sampling_mask",
    "return_flat_raw_output_top_logprobs",
)
# serving_chat.py `_validate_request`: flags that only make sense with meta_info, refused
# (400 "BadRequestError") when it is off.
_NEEDS_META_INFO = ("return_sampling_mask", "return_flat_raw_output_top_logprobs")


def _schema_errors(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The pydantic errors SGLang's ChatCompletionRequest would raise, for the fields the
    mock reads (unknown fields are ignored, as pydantic's default `extra="ignore"` does)."""
    errors: list[dict[str, Any]] = []

    def bad(name: str, kind: str, msg: str) -> None:
        errors.append({"type": kind, "loc": ("body", name), "msg": msg})

    if "messages" not in body:
        bad("messages", "missing", "Field required")
    elif not isinstance(body["messages"], list):
        bad("messages", "list_type", "Input should be a valid list")
    elif not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in body["messages"]):
        bad("messages", "union_tag_invalid", "Every message must be an object with a role")
    for name in _INT_FIELDS:
        value = body.get(name)
        if value is not None and type(value) is not int:
            bad(name, "int_type", "Input should be a valid integer")
    for name in _BOOL_FIELDS:
        value = body.get(name)
        if value is not None and type(value) is not bool:
            bad(name, "bool_type", "Input should be a valid boolean")
    ids = body.get("input_ids")
    if ids is not None and (not isinstance(ids, list) or not all(type(i) is int for i in ids)):
        bad("input_ids", "int_type", "Input should be a list of valid integers")
    for name, kind in (("tools", list), ("chat_template_kwargs", dict), ("stream_options", dict)):
        value = body.get(name)
        if value is not None and not isinstance(value, kind):
            bad(name, f"{kind.__name__}_type", f"Input should be a valid {kind.__name__}")
    for name in ("rid", "model", "lora_path"):
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            bad(name, "string_type", "Input should be a valid string")
    return errors


def _prompt_ids(body: dict[str, Any], tokenizer: TokenizerLike, rules: SglangRules) -> list[int]:
    ids = body.get("input_ids")
    if ids is not None:
        # SGLang bypasses the chat template when input_ids are given (protocol.py).
        if not ids:
            raise ApiError("input_ids must be a non-empty list of token ids")
        low, high = min(ids), max(ids)
        if low < 0 or high >= tokenizer.vocab_size:
            raise ApiError(f"input_ids out of range [0, {tokenizer.vocab_size})")
        return list(ids)
    # serving_chat.py `_apply_jinja_template` shapes the messages before it renders
    # (tokenizer/message_shape.py): arguments parsed (`normalize_assistant_tool_call_arguments`,
    # strict; its ValueError is a 400 "BadRequest" in serving_base.py `handle_request`), null
    # content "", null members dropped, a tool's text parts joined.
    try:
        messages = sglang_messages(body["messages"], rules)
    except ToolArgumentsError as exc:
        raise ApiError(exc.reason, "BadRequest") from exc
    kwargs = body.get("chat_template_kwargs") or {}
    try:
        # ChatTokenizer's method; TokenizerLike holds only what the generator needs.
        ids = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            messages,
            add_generation_prompt=True,
            tools=body.get("tools"),
            chat_template_kwargs=kwargs or None,
        )
    except Exception as exc:  # a template error is the caller's malformed message
        raise ApiError(f"cannot render messages with the chat template: {exc}") from exc
    return list(ids)


def _lora(body: dict[str, Any], served_model: str, loaded: tuple[str, ...]) -> str | None:
    """The adapter a request names ('base:adapter' model wins over lora_path, as in
    serving_base.py `_resolve_lora_path`), checked like tokenizer_manager.py does."""
    model = body.get("model") or DEFAULT_MODEL
    adapter: str | None = None
    if ":" in model and model != served_model:
        if model.startswith(served_model + ":"):
            adapter = model[len(served_model) + 1 :].strip() or None
        else:
            adapter = model.split(":", 1)[1].strip() or None
    if adapter is None:
        adapter = body.get("lora_path") or None
    if adapter is None:
        return None
    if not loaded:
        raise ApiError(
            f"LoRA adapter '{adapter}' was requested, but LoRA is not enabled. "
            "Please launch the server with --enable-lora flag and preload adapters "
            "using --lora-paths or /load_lora_adapter endpoint."
        )
    if adapter not in loaded:
        names = "dict_keys([" + ", ".join(repr(n) for n in loaded) + "])"
        raise ApiError(
            f"Got LoRA adapter that has never been loaded: {adapter}\nAll loaded adapters: {names}."
        )
    return adapter


def parse_chat(body: dict[str, Any], headers: Mapping[str, str], state: EngineState) -> ChatRequest:
    """Validate a chat body in SGLang's order and resolve its prompt (worker thread)."""
    cfg = state.config
    errors = _schema_errors(body)
    if errors:
        raise validation_error(errors)
    # serving_chat.py `_validate_request`.
    if not body["messages"]:
        raise ApiError("Messages cannot be empty.")
    for flag in _NEEDS_META_INFO:
        if body.get(flag) is True and body.get("return_meta_info") is not True:
            raise ApiError(f"{flag} requires return_meta_info=true.")
    stream = body.get("stream") is True
    # serving_chat.py `_convert_to_internal_request` raises ValueError, which
    # `handle_request` answers with err_type "BadRequest".
    for name, message in _STREAM_ERRORS if stream else ():
        if body.get(name) is True:
            raise ApiError(message, "BadRequest")
    caps = [body[c] for c in ("max_tokens", "max_completion_tokens") if body.get(c) is not None]
    if any(c < 1 for c in caps):
        raise ApiError("max_tokens must be >= 1")
    prompt_ids = _prompt_ids(body, state.tokenizer, cfg.sglang_rules)
    lora = _lora(body, state.served_model_name, cfg.lora_adapters)
    want_r3 = body.get("return_routed_experts") is True
    r3_start = body.get("routed_experts_start_len") or 0
    r3_error: str | None = None
    if want_r3:  # scheduler.py `handle_generate_request`: FINISH_ABORT, status 400
        if r3_start < 0:
            r3_error = (
                f"recv_req.routed_experts_start_len={r3_start} is lower than 0. "
                "Please use a non-negative routed_experts_start_len."
            )
        if r3_start > len(prompt_ids):
            r3_error = (
                f"recv_req.routed_experts_start_len={r3_start} is higher than the number of "
                f"input tokens len(req.origin_input_ids)={len(prompt_ids)}. Please use a "
                "smaller routed_experts_start_len."
            )
    if r3_error is not None and not stream:
        # tokenizer_manager.py `_handle_abort_finish_reason`: status 400 -> ValueError -> 400.
        raise ApiError(r3_error)
    tools = body.get("tools") or None
    if body.get("tool_choice") == "none":
        tools = None  # SGLang's tool-call parser is off for tool_choice "none"
    kwargs = body.get("chat_template_kwargs") or {}
    stream_options = body.get("stream_options") or {}
    model = body.get("model")
    return ChatRequest(
        rid=body["rid"] if body.get("rid") else uuid.uuid4().hex,
        prompt_ids=prompt_ids,
        seed=body.get("seed"),
        max_tokens=min(caps) if caps else None,
        tools=tools,
        stream=stream,
        want_meta=body.get("return_meta_info") is True,
        want_logprobs=body.get("logprobs") is True,
        want_r3=want_r3 and cfg.r3_enabled,
        r3_start=r3_start,
        want_indexer=body.get("return_indexer_topk") is True and cfg.indexer_enabled,
        want_input_ids=body.get("return_input_ids_in_sglext") is True
        or headers.get("x-sglext-return-input-ids") == "1",
        want_output_ids=body.get("return_output_ids_in_sglext") is True
        or headers.get("x-sglext-return-output-ids") == "1",
        ids_framed=headers.get("x-sglext-ids-framed") == "1",
        include_usage=stream_options.get("include_usage") is True,
        reasoning=cfg.reasoning_parser is not None and kwargs.get("enable_thinking") is not False,
        lora=lora,
        abort_message=r3_error,
        want_cached_details=body.get("return_cached_tokens_details") is True,
        model=model if isinstance(model, str) and model else DEFAULT_MODEL,
    )
