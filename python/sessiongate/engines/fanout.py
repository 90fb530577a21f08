"""The routes that fan out to every engine of the set, as the SGLang Model Gateway
(sglang-router) serves them to the rollout framework:

- `/flush_cache` (GET or POST; the Gateway takes POST only, SGLang itself both): every
  engine's `POST /flush_cache`, concurrently, the client's query (`?timeout=`) passed on.
  200 with the Gateway's `{"status": "success", ...}` when every engine flushed; else the
  Gateway's 206 `{"status": "partial_success", ..., "failed": [{"worker", "error"}]}`
  naming each engine that did not (busy: SGLang's 400; down: the transport error). Both
  replies add `engines`: each engine's URL, HTTP status (null when it did not answer),
  whether it flushed and why not.
- `GET /engine_metrics`: every engine's `/metrics` (Prometheus text), concurrently, each
  bounded by `METRICS_TIMEOUT_S`, merged as the Gateway merges them: names with ":" written
  "_" (`sglang:num_running_reqs` -> `sglang_num_running_reqs`), a `worker_addr` label with
  the engine's URL on every sample, `# HELP` / `# TYPE` once per metric. An engine that
  cannot be read does not fail the route (the Gateway leaves it out silently): a comment
  line says why, and `sessiongate_engine_metrics_up{worker_addr}` is 0 for it, 1 for the
  others.

The engine set is the registry's admitted one (static `--backend` engines and registered
ones), what the session cores route to; an empty set is a 503, as every request then is.
"""

from __future__ import annotations

import asyncio
import http
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from sessiongate.engines.client import EngineClient, UpstreamError
from sessiongate.engines.pool import NO_ENGINE
from sessiongate.errors import GatewayError, Unavailable
from sessiongate.protocol import CoreReply, CoreRequest, error_reply, json_reply

FLUSH_PATH = "/flush_cache"
METRICS_PATH = "/engine_metrics"
# An engine's /metrics is a few hundred kB at most; one that does not answer within this
# must not hold the scrape (the framework's scraper itself waits 10 s for the whole route).
METRICS_TIMEOUT_S = 5.0
# SGLang answers /flush_cache at once, or after waiting up to its `?timeout=` for idleness.
FLUSH_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 2.0
# How much of an engine's failed reply the flush listing quotes.
REPLY_QUOTE = 200
# prometheus_client's content type, which SGLang's /metrics answers with.
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
ENGINE_LABEL = "worker_addr"  # the Gateway's label (the framework's scraper reads it)
UP_METRIC = "sessiongate_engine_metrics_up"


class MethodNotAllowed(GatewayError):
    status = 405


@dataclass
class EngineAnswer:
    url: str
    status: int | None = None  # None: no reply (connection, timeout)
    body: bytes = b""
    error: str | None = None  # why the call failed, None when it succeeded


async def _call(
    url: str, method: str, path: str, query: str, timeout: float, ok: int = 200
) -> EngineAnswer:
    """One request to one engine, on a fresh client (nothing shared with the pools, so a
    slow engine holds none of their connections)."""
    client = EngineClient(url, timeout=timeout, connect_timeout=min(timeout, CONNECT_TIMEOUT_S))
    answer = EngineAnswer(url)
    try:
        async with asyncio.timeout(timeout):
            stream = await client.open_stream(method, path, query=query)
            answer.status = stream.status
            answer.body = await stream.read_all()
    except TimeoutError:
        answer.error = f"{method} {url}{path} timed out after {timeout:g}s"
    except UpstreamError as exc:
        answer.error = str(exc)
    finally:
        await client.aclose()
    if answer.error is None and answer.status != ok:
        # The Gateway's wording ("HTTP 400 Bad Request"), so a client matching it still does.
        phrase = _phrase(answer.status)
        answer.error = f"HTTP {answer.status} {phrase}".rstrip()
    return answer


def _phrase(status: int | None) -> str:
    try:
        return http.HTTPStatus(status or 0).phrase
    except ValueError:
        return ""


async def _each(
    urls: Sequence[str], method: str, path: str, query: str, timeout: float
) -> list[EngineAnswer]:
    return list(await asyncio.gather(*(_call(u, method, path, query, timeout) for u in urls)))


async def handle_fanout(request: CoreRequest, urls: Sequence[str]) -> CoreReply:
    """The reply to `/flush_cache` or `/engine_metrics` over the engines at `urls`."""
    try:
        if request.path == FLUSH_PATH:
            if request.method not in ("GET", "POST"):
                raise MethodNotAllowed(
                    f"{request.method} is not allowed on {FLUSH_PATH} (use POST or GET)"
                )
            return await flush_cache(urls, request.query)
        if request.method not in ("GET", "HEAD"):
            raise MethodNotAllowed(f"{request.method} is not allowed on {METRICS_PATH} (use GET)")
        return await engine_metrics(urls)
    except GatewayError as error:
        return error_reply(error)


def _flush_timeout(query: str) -> float:
    """Our bound on one engine's flush: SGLang's own wait (`?timeout=`) plus a margin."""
    for part in query.split("&"):
        name, _, value = part.partition("=")
        if name == "timeout":
            try:
                wait = float(value)
            except ValueError:
                return FLUSH_TIMEOUT_S  # the engine answers the bad value with its 422
            if wait >= 0:
                return wait + FLUSH_TIMEOUT_S
    return FLUSH_TIMEOUT_S


async def flush_cache(urls: Sequence[str], query: str = "") -> CoreReply:
    if not urls:
        raise Unavailable(NO_ENGINE)
    # POST, as the Gateway sends it (SGLang takes both).
    answers = await _each(urls, "POST", FLUSH_PATH, query, _flush_timeout(query))
    flushed = [a for a in answers if a.error is None]
    failed = [a for a in answers if a.error is not None]
    engines: list[dict[str, object]] = []
    for answer in answers:
        entry: dict[str, object] = {
            "url": answer.url,
            "status": answer.status,
            "flushed": answer.error is None,
        }
        if answer.error is not None:
            entry["error"] = answer.error
            if answer.body:
                entry["reply"] = answer.body[:REPLY_QUOTE].decode("utf-8", "replace")
        engines.append(entry)
    document: dict[str, object] = {
        "status": "success" if not failed else "partial_success",
        "message": (
            f"Successfully flushed cache on all {len(urls)} HTTP workers"
            if not failed
            else f"Cache flush: {len(flushed)} succeeded, {len(failed)} failed"
        ),
        "workers_flushed": len(flushed),
        "total_http_workers": len(urls),
        "total_workers": len(urls),
    }
    if failed:
        document["successful"] = [a.url for a in flushed]
        document["failed"] = [{"worker": a.url, "error": a.error} for a in failed]
    document["engines"] = engines
    # 206 is the Gateway's status for a partial (or total) failure: a 2xx, so a client that
    # only calls raise_for_status() must read "status" to know.
    return json_reply(200 if not failed else 206, document)


# -- /engine_metrics ----------------------------------------------------------------------

# A sample line: name, optional {labels}, then the value (and an optional timestamp).
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+(?:\s+\S+)?)\s*$")
# Labels whose place is last, as the Gateway writes them (histogram and summary bounds).
_BOUND_LABELS = ("le", "quantile")


@dataclass
class Metric:
    help: str | None = None
    kind: str | None = None
    samples: list[str] = field(default_factory=list)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _split_labels(text: str) -> list[str]:
    """`a="x",b="y,z"` -> [`a="x"`, `b="y,z"`]: commas inside quoted values stay."""
    parts: list[str] = []
    current: list[str] = []
    quoted = escaped = False
    for char in text:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            quoted = not quoted
        elif char == "," and not quoted:
            parts.append("".join(current).strip())
            current = []
            continue
        current.append(char)
    if "".join(current).strip():
        parts.append("".join(current).strip())
    return parts


def _with_engine(labels: str | None, url: str) -> str:
    """The sample's labels plus the engine's, bounds (`le`, `quantile`) kept last."""
    parts = _split_labels(labels[1:-1]) if labels else []
    parts = [p for p in parts if p.partition("=")[0].strip() != ENGINE_LABEL]
    bounds = [p for p in parts if p.partition("=")[0].strip() in _BOUND_LABELS]
    rest = [p for p in parts if p not in bounds]
    return "{" + ",".join([*rest, f'{ENGINE_LABEL}="{_escape(url)}"', *bounds]) + "}"


def _metric_of(name: str, metrics: dict[str, Metric]) -> str:
    """The declared metric a sample belongs to (`x_bucket` -> `x` for a histogram)."""
    if name in metrics:
        return name
    for suffix in ("_bucket", "_sum", "_count", "_created", "_total"):
        if name.endswith(suffix) and name[: -len(suffix)] in metrics:
            return name[: -len(suffix)]
    return name


def merge_metrics(texts: Sequence[tuple[str, str]]) -> dict[str, Metric]:
    """Families by normalised name, in first-seen order, from `(engine url, text)` pairs."""
    metrics: dict[str, Metric] = {}
    for url, text in texts:
        for raw in text.splitlines():
            line = raw.strip()
            if not line:
                continue
            if line.startswith("#"):
                words = line.split(None, 3)
                if len(words) >= 3 and words[1] in ("HELP", "TYPE"):
                    metric = metrics.setdefault(words[2].replace(":", "_"), Metric())
                    rest = words[3] if len(words) > 3 else ""
                    if words[1] == "HELP" and metric.help is None:
                        metric.help = rest
                    elif words[1] == "TYPE" and metric.kind is None:
                        metric.kind = rest
                continue  # other comments (and an engine's EOF marker) are its own
            match = _SAMPLE.match(line)
            if match is None:
                continue  # not a sample line: dropped rather than breaking the whole text
            name, labels, value = match.groups()
            name = name.replace(":", "_")
            metric = metrics.setdefault(_metric_of(name, metrics), Metric())
            metric.samples.append(f"{name}{_with_engine(labels, url)} {value}")
    return metrics


async def engine_metrics(urls: Sequence[str]) -> CoreReply:
    answers = await _each(urls, "GET", "/metrics", "", METRICS_TIMEOUT_S)
    metrics = merge_metrics(
        [(a.url, a.body.decode("utf-8", "replace")) for a in answers if a.error is None]
    )
    lines: list[str] = []
    for answer in answers:
        if answer.error is not None:
            lines.append(f"# sessiongate: engine {answer.url} left out: {answer.error}")
    lines.append(
        f"# HELP {UP_METRIC} 1 when the engine's /metrics was read for this reply, else 0."
    )
    lines.append(f"# TYPE {UP_METRIC} gauge")
    for answer in answers:
        up = int(answer.error is None)
        lines.append(f'{UP_METRIC}{{{ENGINE_LABEL}="{_escape(answer.url)}"}} {up}')
    for name, metric in metrics.items():
        if metric.help is not None:
            lines.append(f"# HELP {name} {metric.help}")
        if metric.kind is not None:
            lines.append(f"# TYPE {name} {metric.kind}")
        lines.extend(metric.samples)
    body = ("\n".join(lines) + "\n").encode()
    return CoreReply(200, [("content-type", PROMETHEUS_TEXT)], body)
