"""The engine management routes, in both dialects of the rollout framework's router client
(which one it speaks depends on its installed sglang_router version):

- old (`--use-miles-router`, sglang_router <= 0.2.1): `POST /add_worker?url=` (or
  `worker_url=`, or a JSON body `{"url"}` / `{"worker_url"}`), `POST /remove_worker?url=`,
  `GET /list_workers` -> `{"urls": [...]}`;
- new (>= 0.3.0): `POST /workers {"url", "worker_type"?, "bootstrap_port"?}` -> 202,
  `GET /workers`, `DELETE /workers/{id}`, and for 0.2.2-0.2.x clients
  `DELETE /workers/{percent-encoded url}`.

The client calls `raise_for_status()` on each reply, so any 2xx is success; listed URLs are
the engines' own (its abort path posts `/abort_request` to each of them directly).
Prefill/decode disaggregation is not supported: such registrations are refused with a 400
naming what was asked. ("worker" is the client's word for an engine; ours are the session
worker processes.)
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, unquote

from sessiongate.engines.registry import BadEngineUrl, Engine, EngineRegistry
from sessiongate.errors import BadRequest, EngineNotFound, GatewayError, MethodNotAllowed
from sessiongate.protocol import CoreReply, CoreRequest, error_reply, json_reply, parse_json_object

# Registration bodies are a URL and two small fields.
MAX_BODY = 64 * 1024


def _query_value(query: str, *names: str) -> str | None:
    values = parse_qs(query, keep_blank_values=True)
    for name in names:
        found = values.get(name)
        if found and found[0]:
            return found[0]
    return None


def _body(request: CoreRequest) -> dict[str, Any]:
    if len(request.body) > MAX_BODY:
        raise BadRequest(f"the body is {len(request.body)} bytes, over {MAX_BODY}")
    if not request.body.strip():
        return {}
    return parse_json_object(request.body, "the request body")


def _url_field(document: dict[str, Any], *names: str) -> str | None:
    for name in names:
        value = document.get(name)
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise BadRequest(f'"{name}" must be a non-empty string (the engine\'s base URL)')
        return value
    return None


def _labels(document: dict[str, Any]) -> dict[str, str]:
    """The registration's `"labels"` (smg's field): what RL selectors match (rl/plane.py)."""
    labels = document.get("labels")
    if labels is None:
        return {}
    if not isinstance(labels, dict) or not all(
        isinstance(k, str) and k and isinstance(v, str) for k, v in labels.items()
    ):
        raise BadRequest('"labels" must be an object of non-empty string keys to string values')
    for key in labels:
        if any(c.isspace() or c in '=!,()"' for c in key):
            raise BadRequest(f'label key {key!r} cannot hold spaces or any of = ! , ( ) "')
    return dict(labels)


def _check_regular(document: dict[str, Any]) -> None:
    """Only regular engines: prefill/decode disaggregation is not supported."""
    kind = document.get("worker_type", "regular")
    if kind is None:
        kind = "regular"
    if not isinstance(kind, str):
        raise BadRequest('"worker_type" must be a string ("regular")')
    if kind in ("prefill", "decode"):
        raise BadRequest(
            f'worker_type "{kind}" is not supported: sessiongate does not do prefill/decode '
            'disaggregation; register regular engines ("worker_type": "regular")'
        )
    if kind != "regular":
        raise BadRequest(f'unknown worker_type "{kind}" (only "regular" is supported)')
    if document.get("bootstrap_port") is not None:
        raise BadRequest(
            '"bootstrap_port" is for prefill/decode disaggregation, which sessiongate does '
            "not support"
        )


class EngineManagement:
    """Answers `Op.ENGINES` requests from an `EngineRegistry`."""

    def __init__(self, registry: EngineRegistry) -> None:
        self.registry = registry

    async def handle(self, request: CoreRequest) -> CoreReply:
        try:
            return await self._handle(request)
        except BadEngineUrl as exc:
            return error_reply(BadRequest(str(exc)))
        except GatewayError as error:
            return error_reply(error)

    async def _handle(self, request: CoreRequest) -> CoreReply:
        path, method = request.path, request.method
        if path == "/add_worker":
            self._allow(method, path, "POST")
            return await self._add_old(request)
        if path == "/remove_worker":
            self._allow(method, path, "POST")
            return await self._remove_old(request)
        if path == "/list_workers":
            self._allow(method, path, "GET")
            return json_reply(200, {"urls": [e.url for e in self._serving()]})
        if path == "/workers":
            self._allow(method, path, "GET", "POST")
            if method == "GET":
                return self._list_new()
            return await self._add_new(request)
        key = path[len("/workers/") :]
        if not key:
            raise EngineNotFound("missing engine id in the path")
        self._allow(method, "/workers/{id}", "GET", "DELETE")
        # An id, or a percent-encoded URL (0.2.2-0.2.x clients delete by URL).
        key = unquote(key)
        engine = self.registry.find(key)
        if engine is None:
            raise EngineNotFound(f"no engine {key!r} is registered")
        if method == "GET":
            return json_reply(200, engine.describe())
        await self.registry.remove(engine.id)
        return json_reply(
            200,
            {
                "status": "removed",
                "worker_id": engine.id,
                "url": engine.url,
                "message": f"engine {engine.url} removed; requests in flight on it finish",
            },
        )

    @staticmethod
    def _allow(method: str, path: str, *methods: str) -> None:
        if method not in methods:
            raise MethodNotAllowed(
                f"{method} is not allowed on {path} (use {' or '.join(methods)})"
            )

    def _serving(self) -> list[Engine]:
        """The engines the old listing shows: registered ones and the static ones, but not
        the embedded mock while it only stands in (the abort path would post to it)."""
        if self.registry.placeholder:
            return [e for e in self.registry.listing() if not e.static]
        return self.registry.listing()

    async def _add_old(self, request: CoreRequest) -> CoreReply:
        url = _query_value(request.query, "url", "worker_url")
        if url is None:
            document = _body(request)
            url = _url_field(document, "url", "worker_url")
            _check_regular(document)
        if url is None:
            raise BadRequest('the engine URL is required (use ?url=... or a JSON body {"url"})')
        engine, _ = await self.registry.add(url)
        return json_reply(
            200,
            {
                "status": "success",
                "worker_id": engine.id,
                "url": engine.url,
                "state": engine.state,
                "worker_urls": [e.url for e in self._serving()],
            },
        )

    async def _remove_old(self, request: CoreRequest) -> CoreReply:
        url = _query_value(request.query, "url", "worker_url")
        if url is None:
            url = _url_field(_body(request), "url", "worker_url")
        if url is None:
            raise BadRequest('the engine URL is required (use ?url=... or a JSON body {"url"})')
        engine = await self.registry.remove(url)
        if engine is None:
            raise EngineNotFound(f"no engine {url!r} is registered")
        return json_reply(
            200,
            {
                "status": "success",
                "worker_id": engine.id,
                "url": engine.url,
                "worker_urls": [e.url for e in self._serving()],
            },
        )

    async def _add_new(self, request: CoreRequest) -> CoreReply:
        document = _body(request)
        url = _url_field(document, "url")
        if url is None:
            raise BadRequest(
                'the body must be {"url": "http://host:port", "worker_type": "regular"}'
            )
        _check_regular(document)
        engine, created = await self.registry.add(url, _labels(document))
        return json_reply(
            202,
            {
                "status": "accepted",
                "worker_id": engine.id,
                "url": engine.url,
                "message": (
                    f"engine {engine.url} registered ({engine.state})"
                    if created
                    else f"engine {engine.url} was already registered ({engine.state})"
                ),
            },
        )

    def _list_new(self) -> CoreReply:
        engines = self._serving()
        workers = [e.describe() for e in engines]
        healthy = sum(1 for e in engines if e.healthy)
        return json_reply(
            200,
            {
                "workers": workers,
                "total": len(workers),
                "stats": {
                    "prefill_count": 0,
                    "decode_count": 0,
                    "regular_count": len(workers),
                    "healthy_count": healthy,
                    "in_rotation": sum(1 for e in engines if e.admitted),
                },
            },
        )
