"""Is an engine ready to take traffic? A registered engine is admitted only once it answers
like an SGLang engine: `GET /health` with a 2xx, then its model (`/model_info`, or the older
`/get_model_info`) as a JSON object. Its `/server_info` (or `/get_server_info`) is read
when it has one and shown in the listing; it is not required, so a lean engine (the mock)
still qualifies. A wrong URL (nothing listening, another service) fails one of these and
is reported as `unreachable: <why>`, without touching the other engines."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from sessiongate.engines.client import EngineClient, EngineTransportError

# Each probe request's bound: an engine that takes longer than this to say it is healthy is
# not ready yet (it is probed again on the health interval).
PROBE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ProbeResult:
    error: str | None  # None: ready
    model_info: dict[str, object] | None = None
    server_info: dict[str, object] | None = None


async def _get_json(
    client: EngineClient, paths: tuple[str, ...]
) -> tuple[dict[str, object] | None, str]:
    """The first of `paths` answering a JSON object, or None and what the last one said."""
    why = ""
    for path in paths:
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                stream = await client.open_stream("GET", path)
                try:
                    body = await stream.read_all()
                finally:
                    await stream.aclose()
        except (EngineTransportError, TimeoutError) as exc:
            return None, f"GET {path} failed: {exc or type(exc).__name__}"
        if not 200 <= stream.status < 300:
            why = f"GET {path} answered {stream.status}"
            continue
        try:
            document = json.loads(body)
        except ValueError:
            why = f"GET {path} did not answer JSON"
            continue
        if isinstance(document, dict):
            return document, ""
        why = f"GET {path} did not answer a JSON object"
    return None, why


async def check(url: str, path: str = "/health", timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """One health probe of the engine at `url`: None when `path` answers a 2xx within
    `timeout`, else why not (the text `/health` shows as the engine's `last_error`). A fresh
    client each time, as a pool's client would be: a probe that reused the pools' kept-alive
    connection would say nothing about whether a new one can be made."""
    client = EngineClient(url)
    try:
        return await client.check(path, timeout)
    finally:
        await client.aclose()


async def readiness(url: str, timeout: float = PROBE_TIMEOUT_S) -> bool | None:
    """Whether the engine takes new requests, by SGLang's `GET /ready`: 200 yes, 503 no (it
    is paused, or not up: http_server.py `ready`, tokenizer_manager.py `is_ready`); None
    when it does not say (no such route, another status, no answer)."""
    client = EngineClient(url, timeout=timeout, connect_timeout=timeout)
    try:
        async with asyncio.timeout(timeout):
            stream = await client.open_stream("GET", "/ready")
            await stream.aclose()
    except (EngineTransportError, TimeoutError):
        return None
    finally:
        await client.aclose()
    if stream.status == 200:
        return True
    if stream.status == 503:
        return False
    return None


async def describe(url: str, *, timeout: float = PROBE_TIMEOUT_S) -> ProbeResult:
    """The engine's model and server info (a health check passed already); an error when it
    has no model info."""
    client = EngineClient(url, timeout=timeout, connect_timeout=timeout)
    try:
        server_info, _ = await _get_json(client, ("/server_info", "/get_server_info"))
        model_info, why = await _get_json(client, ("/model_info", "/get_model_info"))
    finally:
        await client.aclose()
    if model_info is None:
        return ProbeResult(f"{url}: no model info ({why})", server_info=server_info)
    return ProbeResult(None, model_info, server_info)


async def probe(url: str, *, timeout: float = PROBE_TIMEOUT_S) -> ProbeResult:
    """Whether a registered engine may be admitted: its health, then its model info."""
    problem = await check(url, "/health", timeout)
    if problem is not None:
        return ProbeResult(problem)
    return await describe(url, timeout=timeout)
