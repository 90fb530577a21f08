"""Pydantic models of every route's request and reply, for the OpenAPI document only.

The gateway never validates traffic with these: the front end does not parse bodies and the
session core checks exactly the fields it reads (docs/api.md). They describe the wire format
truthfully, so they are loose where the wire is (extra members pass through, upstream replies
are the upstream's), and `tests/front/test_schema.py` holds the served replies to them.
Imported only by `front/openapi.py`, itself loaded on the first `/openapi.json` or `/docs`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Header-supplied and path session ids: 1-256 visible ASCII characters (primitives.validate).
SESSION_ID_PATTERN = r"^[\x21-\x7e]{1,256}$"


class Open(BaseModel):
    """A JSON object that may carry members beyond the documented ones."""

    model_config = ConfigDict(extra="allow")


class ErrorBody(BaseModel):
    """Every error the gateway itself answers."""

    error: str = Field(description="What was wrong: names the field, index or session.")


class AnthropicErrorDetail(BaseModel):
    type: str = Field(description="Anthropic's error type, e.g. `invalid_request_error`.")
    message: str


class AnthropicError(BaseModel):
    """Every error on `POST /sessions/{id}/v1/messages`, in Anthropic's envelope."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class ResponsesErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ResponsesError(BaseModel):
    """Every error on `POST /sessions/{id}/v1/responses`, in SGLang's envelope there."""

    error: ResponsesErrorDetail


# -- health ----------------------------------------------------------------------------------


class UpstreamState(Open):
    url: str
    healthy: bool
    last_error: str | None = None


class WorkerHealth(Open):
    """One worker as the router sees it (remote workers add endpoint, transport, ...)."""

    index: int
    state: str = Field(description="up, down, starting; remote: connecting, up, reconnecting")
    pid: int | None = None
    generation: int | None = None
    sessions: int | None = None
    inflight: int | None = None
    heartbeat_age_s: float | None = None
    upstream: str | None = None
    upstreams: list[UpstreamState] | None = None


class Health(Open):
    """Router layout: `workers`; in-process layout (`--workers 0`): the core's counters."""

    status: Literal["ok", "degraded"]
    upstream: str | None = Field(None, description='"ok", or "down" when an engine is down')
    reason: str | None = None
    sessions: int | None = None
    workers: list[WorkerHealth] | None = None
    upstreams: list[UpstreamState] | None = None


class HealthDown(Health):
    """503: a worker is down (router), or every upstream with `?upstream=required`."""

    error: str | None = None


# -- sessions --------------------------------------------------------------------------------


class CreateSession(Open):
    """Optional body of `POST /sessions`; other members are ignored."""

    parent_session_id: str | None = Field(
        None,
        description="Make a child (sub-agent) session, id `<root_id>.<32 hex>`.",
        pattern=SESSION_ID_PATTERN,
    )


class SessionCreated(BaseModel):
    session_id: str


class SessionRecord(Open):
    """One recorded turn: the body sent upstream and the upstream's reply as received."""

    timestamp: float
    request_timestamp: float | None = None
    method: str
    path: str
    status_code: int
    status: Literal["completed", "truncated", "aborted"] | None = None
    finish_reason: str | None = None
    weight_version: str | None = None
    cached_tokens: int | None = None
    request: dict[str, Any]
    response: dict[str, Any]


class SessionMetadata(Open):
    accumulated_token_ids: list[int]
    max_trim_tokens: int
    tito_session_mismatch: list[dict[str, Any]] | None = None
    # sessiongate's finer view of the same comparison (docs/tokenizer.md).
    tito_session_mismatch_detail: list[dict[str, Any]] | None = None
    parent_session_id: str | None = None
    child_session_ids: list[str] = []
    num_turns: int = 0


class SessionDump(BaseModel):
    session_id: str
    records: list[SessionRecord]
    metadata: SessionMetadata


class SamplesRequest(Open):
    """Optional body of `POST /sessions/{id}/samples`; other members are ignored."""

    max_seq_len: int | None = None


# -- chat ------------------------------------------------------------------------------------


class ChatMessage(Open):
    role: str = Field(min_length=1, examples=["user"])
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None


class StreamOptions(Open):
    include_usage: bool | None = None


class ChatCompletionRequest(Open):
    """An OpenAI chat body; every member the gateway does not read passes through upstream
    (docs/api.md, "Chat turns", lists what a session turn sets)."""

    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    max_tokens: int | None = None
    temperature: float | None = None


class ChatChoice(Open):
    index: int
    message: ChatMessage
    finish_reason: str | None = None


class ChatCompletion(Open):
    """The upstream's reply, minus R3 (`routed_experts`, `indexer_topk`)."""

    id: str
    object: str = Field(examples=["chat.completion"])
    created: int | None = None
    model: str | None = None
    choices: list[ChatChoice]
    usage: dict[str, Any] | None = None
