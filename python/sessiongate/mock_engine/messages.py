"""`POST /v1/messages` and `/v1/messages/count_tokens`: SGLang 0.5.23's stateless Anthropic
Messages routes (http_server.py `anthropic_v1_messages`, `anthropic_v1_count_tokens`).

Why the mock has them: a client of an SGLang engine can ask in Anthropic's API, and the
gateway's session route (`/sessions/{id}/v1/messages`) is held to what the engine itself
would answer. The conversion is the gateway's own (sessiongate.dialects.anthropic, the
restatement of serving.py), run here as serving.py runs it: the Messages body becomes a chat
body, the chat route answers it, and its reply becomes the Messages reply. The engine's
traits come from its flags: with `--reasoning-parser` thinking toggles `enable_thinking` and
prior thinking goes back as `reasoning_content`; without one, thinking is refused and
history thinking dropped, as SGLang does. A stream is made from the whole reply (the same
events SGLang sends, not paced token by token).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import Response

from sessiongate.dialects import DialectError
from sessiongate.dialects.anthropic import (
    AnthropicDialect,
    EngineTraits,
    engine_error_to_envelope,
    error_envelope,
)
from sessiongate.mock_engine.body_slices import PartsResponse, json_response
from sessiongate.mock_engine.chat_request import ApiError, parse_chat
from sessiongate.mock_engine.config import MockEngineConfig
from sessiongate.mock_engine.state import EngineState


def engine_traits(config: MockEngineConfig) -> EngineTraits:
    """What serving_chat.py would find in this engine (see the module's docstring)."""
    parser = config.reasoning_parser is not None
    return EngineTraits(
        merge_inline_system=False,
        native_reasoning_history=parser,
        reasoning_wrap=None,
        reasoning_toggle="enable_thinking" if parser else None,
    )


def _error(status: int, message: str, error_type: str | None = None) -> Response:
    return json_response(error_envelope(status, message, error_type), status)


def _body_of(response: Response) -> bytes:
    if isinstance(response, PartsResponse):
        return b"".join(bytes(p) for p in response.parts)
    return bytes(response.body)


@dataclass(eq=False)
class MessagesRoute:
    """The two Anthropic routes over the engine's chat route (`chat`: its ASGI handler)."""

    config: MockEngineConfig
    state: EngineState
    chat: Any  # OpenAIChatRoute.chat

    @property
    def dialect(self) -> AnthropicDialect:
        return AnthropicDialect(engine_traits(self.config), tool_links=False)

    async def _read(self, request: Request) -> dict[str, Any] | Response:
        """http_server.py `validate_json_request` and the body's parse, as 400 envelopes."""
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media != "application/json":
            return _error(
                400,
                "header.content-type: Unsupported Media Type: Only 'application/json' is allowed",
            )
        try:
            body = json.loads(await request.body())
        except (ValueError, RecursionError):
            return _error(400, "JSON decode error")
        if not isinstance(body, dict):
            return _error(
                400, "Input should be a valid dictionary or object to extract fields from"
            )
        return body

    async def messages(self, request: Request) -> Response:
        body = await self._read(request)
        if isinstance(body, Response):
            return body
        dialect = self.dialect
        try:
            chat_body = dialect.to_chat(body)
        except DialectError as exc:
            return _error(exc.status, exc.message, exc.error_type)
        # One whole chat reply; a stream is made from it below.
        chat_body["stream"] = False
        chat_body.pop("stream_options", None)
        reply = await self.chat(self._chat_request(request, chat_body))
        raw = _body_of(reply)
        if reply.status_code != 200:
            return json_response(
                engine_error_to_envelope(reply.status_code, raw), reply.status_code
            )
        chat_reply = json.loads(raw)
        if body.get("stream"):
            events = dialect.stream_events(chat_reply, body)
            return Response(
                events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        return Response(dialect.from_chat(chat_reply, body), media_type="application/json")

    async def count_tokens(self, request: Request) -> Response:
        """serving.py `handle_count_tokens`: the converted chat body's prompt length."""
        body = await self._read(request)
        if isinstance(body, Response):
            return body
        keys = ("model", "messages", "system", "thinking", "tools", "tool_choice", "output_config")
        document = {k: body[k] for k in keys if k in body}
        document["max_tokens"] = 1
        try:
            chat_body = self.dialect.to_chat(document)
        except DialectError as exc:
            return _error(exc.status, exc.message, exc.error_type)
        chat_body["stream"] = False
        headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            parsed = await anyio.to_thread.run_sync(parse_chat, chat_body, headers, self.state)
        except ApiError as exc:
            return _error(exc.status, exc.message)
        return json_response({"input_tokens": len(parsed.prompt_ids)})

    @staticmethod
    def _chat_request(request: Request, chat_body: dict[str, Any]) -> Request:
        """The chat route's request: the client's, on the chat path, with the chat body."""
        payload = json.dumps(chat_body).encode()
        headers = [
            (k, v)
            for k, v in request.scope["headers"]
            if k not in (b"content-type", b"content-length")
        ]
        headers += [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
        ]
        scope = {**request.scope, "path": "/v1/chat/completions", "headers": headers}
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": payload, "more_body": False}

        return Request(scope, receive)
