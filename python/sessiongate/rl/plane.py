"""The RL control plane under `/v1/rl`, contract for contract with smg 1.13's (`--enable-rl`),
so its `smg.rl.RL` client and the scripts written for it run unchanged against sessiongate:

- `GET /v1/rl/workers`: `{"protocol_version": 1, "workers": [row, ...], "total"}`, one row
  per engine of the registry (`worker_row`);
- `GET /v1/rl/workers/{id}`: one row; 404 `worker_not_found`;
- `GET|POST /v1/rl/workers/{id}/engine/{path}`: the call passed to that engine (method,
  query and body as sent), answered `{worker_id, url, status, latency_ms, body}` with the
  engine's status mirrored; 400 `invalid_engine_path` (empty, an empty / `.` / `..`
  segment, more than 4 segments), 502 `upstream_unreachable`, 504 `upstream_timeout`
  (`--rl-control-timeout-secs`);
- `GET|POST /v1/rl/engine/{path}?selector=S`: the same call to every engine `S` matches
  (rl/selector.py), `--rl-fanout-concurrency` at a time: `{results: {id: call}, failed:
  [{worker_id, url, error, message, status?}], total, succeeded}`, 200 when none failed and
  207 otherwise (even when none succeeded); 400 `selector_required`, `invalid_selector`
  (with `offset`), `no_workers_match` (with `selector`).

Errors here are smg's `{"error": code, "message": ...}`, not the gateway's `{"error":
message}`: its client reads the code. A client that leaves cancels its calls (the front
hands `/v1/rl` connections to the Python server, which sees the disconnect).

Past smg, the plane is also where the router learns what the trainer does to the engines
(docs/routing.md, "Weight versions and pauses"): a `pause_generation` holds the engine in
every pool *before* it is sent (no new request reaches it once the engine is paused), a
successful `continue_generation` releases it, and a successful weight update records the
engine's new weight version (read back from its model info).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode

from sessiongate.config.rl import RlConfig
from sessiongate.engines.client import EngineClient, EngineUnreachable, UpstreamError
from sessiongate.engines.registry import PROBING, READY, Engine, EngineRegistry
from sessiongate.protocol import CoreReply, CoreRequest, json_reply
from sessiongate.rl.selector import SelectorError, parse_selector, selector_is_blank

PREFIX = "/v1/rl"
PROTOCOL_VERSION = 1
MAX_ENGINE_SEGMENTS = 4
CONNECT_TIMEOUT_S = 10.0
# SGLang's control routes and what the plane learns from each (engine paths, first segment).
PAUSE = "pause_generation"
CONTINUE = "continue_generation"
# The weight updates, and the body field that carries the version each sets.
WEIGHT_UPDATES = {
    "update_weight_version": "new_version",
    "update_weights_from_disk": "weight_version",
    "update_weights_from_tensor": "weight_version",
    "update_weights_from_distributed": "weight_version",
    "update_weights_from_ipc": "weight_version",
}
PAUSE_MODES = ("abort", "retract", "in_place")
# What an SGLang engine can do, as smg 1.13 reports it for SGLang engines (a static table:
# SGLang 0.5.23's http_server.py serves every one of these routes).
CAPABILITIES: dict[str, object] = {
    "source": "static",
    "pause_modes": list(PAUSE_MODES),
    "update_from": ["disk", "tensor", "distributed"],
    "abort": True,
    "flush_cache": True,
    "sleep_wake": True,
    "reports_weight_version": True,
}
# Server-info and model-info fields smg copies into a worker's labels.
_INFO_LABELS = ("version", "served_model_name", "model_path", "weight_version", "is_generation")


class PlaneError(Exception):
    """An smg error reply: `status`, `{"error": code, "message": message, **extra}`."""

    def __init__(self, status: int, code: str, message: str, **extra: object) -> None:
        super().__init__(message)
        self.status = status
        self.document: dict[str, object] = {"error": code, "message": message, **extra}

    def reply(self) -> CoreReply:
        return json_reply(self.status, self.document)


@dataclass(frozen=True)
class CallOutcome:
    """One engine's answer to a passed call, or why there is none (`error` set)."""

    engine: Engine
    status: int | None = None
    latency_ms: int = 0
    body: object = None
    error: str | None = None  # upstream_unreachable, upstream_timeout
    message: str = ""

    def call_document(self) -> dict[str, object]:
        return {
            "worker_id": self.engine.id,
            "url": self.engine.url,
            "status": self.status,
            "latency_ms": self.latency_ms,
            "body": self.body,
        }

    def failure(self) -> dict[str, object] | None:
        """Its `failed[]` entry in a fan-out, or None when it succeeded (a 2xx)."""
        base: dict[str, object] = {"worker_id": self.engine.id, "url": self.engine.url}
        if self.error is not None:
            return {**base, "error": self.error, "message": self.message}
        if self.status is not None and not 200 <= self.status < 300:
            return {
                **base,
                "error": "upstream_error",
                "message": f"HTTP {self.status}",
                "status": self.status,
            }
        return None

    def raise_for_transport(self) -> None:
        """A single call's transport failure as its smg error reply."""
        if self.error is None:
            return
        status = 504 if self.error == "upstream_timeout" else 502
        raise PlaneError(
            status, self.error, self.message, worker_id=self.engine.id, url=self.engine.url
        )


def health_word(engine: Engine) -> str:
    """The row's `health`: smg's `ready`, else what the registry says of the engine."""
    if engine.state == READY:
        return "ready"
    if engine.state == PROBING:
        return "pending"
    if engine.state.startswith("refused"):
        return "refused"
    return "unhealthy"


def worker_row(engine: Engine) -> dict[str, object]:
    """One engine as smg's `/v1/rl/workers` lists it, plus `paused` and `pause_mode`."""
    server = engine.server_info or {}
    model = engine.model_info or {}
    labels: dict[str, str] = {}
    for name in _INFO_LABELS:
        value = model.get(name, server.get(name))
        if isinstance(value, bool):
            labels[name] = "true" if value else "false"
        elif isinstance(value, str):
            labels[name] = value
    if engine.weight_version is not None:
        labels["weight_version"] = engine.weight_version
    labels.update(engine.labels)
    model_id = model.get("served_model_name") or model.get("model_path")
    version = server.get("version")
    return {
        "id": engine.id,
        "url": engine.url,
        "base_url": engine.url,
        "engine": "sglang",
        "engine_version": version if isinstance(version, str) else None,
        "model_id": model_id if isinstance(model_id, str) else None,
        "worker_type": "regular",
        "connection_mode": "http",
        "control_url": engine.url,
        "tp_size": _int_or_none(server.get("tp_size")),
        "dp_size": _int_or_none(server.get("dp_size")),
        "pp_size": _int_or_none(server.get("pp_size")),
        "dp_ranks": 1,
        "role": engine.labels.get("role"),
        "health": health_word(engine),
        "weight_version": engine.weight_version,
        "labels": labels,
        "capabilities": dict(CAPABILITIES),
        "paused": engine.paused is not None,
        "pause_mode": engine.paused,
    }


def selector_fields(row: dict[str, Any]) -> dict[str, str | None]:
    """What a selector matches of a row: its labels, then smg's keys (which win)."""
    fields: dict[str, str | None] = dict(row["labels"])
    for key in ("id", "url", "engine", "worker_type", "health", "weight_version", "role"):
        value = row.get(key)
        fields[key] = value if isinstance(value, str) else None
    fields["model"] = row.get("model_id")
    return fields


def engine_path(raw: str) -> str:
    """The engine path of a plane route (`a/b`), checked as smg checks it."""
    if not raw:
        raise PlaneError(400, "invalid_engine_path", "invalid engine path: path is empty")
    segments = raw.split("/")
    if len(segments) > MAX_ENGINE_SEGMENTS:
        raise PlaneError(
            400,
            "invalid_engine_path",
            f"invalid engine path: path has more than {MAX_ENGINE_SEGMENTS} segments",
        )
    for segment in segments:
        if not segment:
            raise PlaneError(
                400, "invalid_engine_path", "invalid engine path: path has an empty segment"
            )
        if unquote(segment) in (".", ".."):
            raise PlaneError(
                400,
                "invalid_engine_path",
                "invalid engine path: path must not contain `.` or `..` segments",
            )
    return "/" + raw


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _decoded(body: bytes) -> object:
    """An engine's reply body as smg shows it: JSON when it is JSON, else its text."""
    if not body:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")


class RlPlane:
    """Answers `Op.RL` requests over an `EngineRegistry`."""

    def __init__(
        self,
        registry: EngineRegistry,
        config: RlConfig,
        client_factory: Callable[[str, float], EngineClient] | None = None,
    ) -> None:
        self.registry = registry
        self.config = config
        self._client = client_factory or (
            lambda url, timeout: EngineClient(
                url, timeout=timeout, connect_timeout=min(timeout, CONNECT_TIMEOUT_S)
            )
        )

    async def handle(self, request: CoreRequest) -> CoreReply:
        if not self.config.enable_rl:
            return json_reply(
                404,
                {
                    "error": f"no route for {request.method} {request.path}: the RL control "
                    "plane is off (start the gateway with --enable-rl)"
                },
            )
        try:
            return await self._route(request)
        except PlaneError as error:
            return error.reply()

    async def _route(self, request: CoreRequest) -> CoreReply:
        rest = request.path[len(PREFIX) :]
        if rest in ("/workers", "/workers/"):
            self._allow(request, "GET")
            rows = [worker_row(e) for e in self.registry.listing()]
            return json_reply(
                200, {"protocol_version": PROTOCOL_VERSION, "workers": rows, "total": len(rows)}
            )
        if rest.startswith("/workers/"):
            worker_id, slash, tail = rest[len("/workers/") :].partition("/")
            engine = self._engine(unquote(worker_id))
            if not slash:
                self._allow(request, "GET")
                return json_reply(200, worker_row(engine))
            if not tail.startswith("engine/") and tail != "engine":
                raise PlaneError(404, "not_found", f"no route {request.path}")
            self._allow(request, "GET", "POST")
            path = engine_path(tail[len("engine/") :])
            outcome = await self._call(engine, request, path, request.query)
            outcome.raise_for_transport()
            return json_reply(outcome.status or 502, outcome.call_document())
        if rest.startswith("/engine/") or rest == "/engine":
            self._allow(request, "GET", "POST")
            path = engine_path(rest[len("/engine/") :])
            return await self._fanout(request, path)
        raise PlaneError(404, "not_found", f"no route {request.path}")

    @staticmethod
    def _allow(request: CoreRequest, *methods: str) -> None:
        if request.method not in methods:
            raise PlaneError(
                405,
                "method_not_allowed",
                f"{request.method} is not allowed on {request.path} (use {' or '.join(methods)})",
            )

    def _engine(self, worker_id: str) -> Engine:
        engine = self.registry.engines.get(worker_id)
        if engine is None:
            raise PlaneError(
                404, "worker_not_found", f"worker `{worker_id}` not found", id=worker_id
            )
        return engine

    async def _fanout(self, request: CoreRequest, path: str) -> CoreReply:
        pairs = parse_qsl(request.query, keep_blank_values=True)
        text = next((v for k, v in pairs if k == "selector"), "")
        if selector_is_blank(text):
            raise PlaneError(
                400, "selector_required", "a non-empty `selector` query parameter is required"
            )
        try:
            selector = parse_selector(text)
        except SelectorError as exc:
            raise PlaneError(400, "invalid_selector", str(exc), offset=exc.offset) from None
        engines = [
            e for e in self.registry.listing() if selector.matches(selector_fields(worker_row(e)))
        ]
        if not engines:
            raise PlaneError(
                400, "no_workers_match", f"no workers match selector `{text}`", selector=text
            )
        # The selector is the plane's; the rest of the query is the engine's.
        query = urlencode([(k, v) for k, v in pairs if k != "selector"])
        gate = asyncio.Semaphore(self.config.fanout_concurrency)

        async def one(engine: Engine) -> CallOutcome:
            async with gate:
                return await self._call(engine, request, path, query)

        outcomes = await asyncio.gather(*(one(e) for e in engines))
        results = {
            o.engine.id: o.call_document()
            for o in sorted(outcomes, key=lambda o: o.engine.id)
            if o.error is None
        }
        failed = [f for o in sorted(outcomes, key=lambda o: o.engine.id) if (f := o.failure())]
        document = {
            "results": results,
            "failed": failed,
            "total": len(outcomes),
            "succeeded": len(outcomes) - len(failed),
        }
        return json_reply(207 if failed else 200, document)

    async def _call(
        self, engine: Engine, request: CoreRequest, path: str, query: str
    ) -> CallOutcome:
        """Pass one call to `engine`, learning what it does to the engine."""
        operation = path.strip("/").split("/", 1)[0]
        body = _json_body(request.body)
        self.registry.control_started(engine)
        try:
            if operation == PAUSE and request.method == "POST":
                mode = body.get("mode", "abort") if body is not None else "abort"
                # Held before the pause is sent: nothing new reaches the engine once it is
                # paused. A pause the engine refused releases it again.
                await self.registry.pause(engine, mode if mode in PAUSE_MODES else "abort")
            outcome = await self._send(engine, request, path, query)
            await self._learn(engine, request.method, operation, body, outcome)
            return outcome
        finally:
            self.registry.control_ended(engine)

    async def _learn(
        self,
        engine: Engine,
        method: str,
        operation: str,
        body: dict[str, Any] | None,
        outcome: CallOutcome,
    ) -> None:
        succeeded = outcome.error is None and outcome.status is not None
        succeeded = succeeded and 200 <= (outcome.status or 0) < 300
        if method != "POST":
            return
        if operation == PAUSE:
            # Refused (a 4xx, or nothing sent): the engine is not paused. A timeout may
            # have paused it: it stays held until its /ready says otherwise.
            refused = outcome.status is not None and not succeeded
            if refused or outcome.error == "upstream_unreachable":
                await self.registry.resume(engine)
        elif operation == CONTINUE and succeeded:
            await self.registry.resume(engine)
        elif operation in WEIGHT_UPDATES and succeeded:
            field = WEIGHT_UPDATES[operation]
            version = body.get(field) if body is not None else None
            await self.registry.weights_updated(
                engine, version if isinstance(version, str) else None
            )

    async def _send(
        self, engine: Engine, request: CoreRequest, path: str, query: str
    ) -> CallOutcome:
        timeout = float(self.config.control_timeout_secs)
        client = self._client(engine.url, timeout)
        headers = [(k, v) for k, v in request.headers if k in ("content-type", "accept")]
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout):
                stream = await client.open_stream(
                    request.method, path, query=query, headers=headers, body=request.body
                )
                try:
                    raw = await stream.read_all()
                finally:
                    await stream.aclose()
        except TimeoutError:
            return CallOutcome(
                engine,
                error="upstream_timeout",
                message=f"upstream `{engine.url}` timed out after {timeout:g}s",
            )
        except EngineUnreachable as exc:
            return CallOutcome(
                engine,
                error="upstream_unreachable",
                message=f"upstream `{engine.url}` unreachable: {exc.message}",
            )
        except UpstreamError as exc:
            timed_out = getattr(exc, "timed_out", False)
            return CallOutcome(
                engine,
                error="upstream_timeout" if timed_out else "upstream_unreachable",
                message=f"upstream `{engine.url}` "
                + (f"timed out after {timeout:g}s" if timed_out else f"unreachable: {exc.message}"),
            )
        finally:
            await client.aclose()
        latency = int((time.perf_counter() - started) * 1000)
        return CallOutcome(engine, stream.status, latency, _decoded(raw))


def _json_body(body: bytes) -> dict[str, Any] | None:
    try:
        document = json.loads(body) if body.strip() else None
    except ValueError:
        return None
    return document if isinstance(document, dict) else None
