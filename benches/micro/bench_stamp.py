"""Session routing stamping benchmarks: Rust core vs Python twin in one run.

Per request: the headers of the built-in header modes (`HeaderStamper.stamp`), the same with
the routing context built from the session tree registry first (Python in both), and the
`dynamo_nvext` body rewrite of a 4 KiB request. See docs/performance.md.

Run with ``pytest benches/micro/bench_stamp.py --benchmark-only``; with ``--benchmark-disable``
each case runs once as a test (results are still checked).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from sessiongate.primitives import get_impl
from sessiongate.session_routing import DynamoNvext, RoutingContext, SessionFamilyRegistry

IMPLS = ["rust", "python"]
N_REQUESTS = 1_000


def _requests() -> list[tuple[str, str | None, str]]:
    """(session, parent, root) of 1,000 turns: alternately a root's turn and a sub-agent's."""
    out: list[tuple[str, str | None, str]] = []
    for _ in range(N_REQUESTS // 2):
        root = uuid.uuid4().hex
        out.append((root, None, root))
        out.append((f"{root}.{uuid.uuid4().hex}", root, root))
    return out


REQUESTS = _requests()
# Tiers of the built-in header modes (identity_headers with a realistic choice of names).
MODES: dict[str, tuple[list[str], list[str], list[str]]] = {
    "dynamo_headers": (["X-Dynamo-Session-ID"], ["X-Dynamo-Parent-Session-ID"], []),
    "smg_routing_key": (["X-SMG-Routing-Key"], [], []),
    "identity_headers": (
        ["X-Session-ID", "X-SMG-Routing-Key"],
        ["X-Parent-Session-ID"],
        ["X-Root-Session-ID"],
    ),
}


def _expected(mode: str) -> list[dict[str, str]]:
    session, parent, root = MODES[mode]
    out = []
    for sid, pid, rid in REQUESTS:
        headers = dict.fromkeys(session, sid)
        if pid is not None:
            headers.update(dict.fromkeys(parent, pid))
        headers.update(dict.fromkeys(root, rid))
        out.append(headers)
    return out


@pytest.mark.parametrize("impl_name", IMPLS)
@pytest.mark.parametrize("mode", list(MODES))
def test_headers(benchmark, mode, impl_name):
    """`stamp` for 1,000 requests (half roots, half children) per round; divide by 1,000."""
    benchmark.group = f"headers {mode}: 1,000 requests"
    stamp = get_impl(impl_name).HeaderStamper(*MODES[mode]).stamp

    def run() -> list[dict[str, str]]:
        return [stamp(sid, pid, rid) for sid, pid, rid in REQUESTS]

    assert benchmark(run) == _expected(mode)


@pytest.mark.parametrize("impl_name", IMPLS)
def test_context_and_headers(benchmark, impl_name):
    """Per request as the server does it: the routing context from the tree registry
    (Python in both), then the dynamo_headers stamp."""
    benchmark.group = "context + headers dynamo_headers: 1,000 requests"
    stamp = get_impl(impl_name).HeaderStamper(*MODES["dynamo_headers"]).stamp
    tree = SessionFamilyRegistry()
    for sid, pid, _ in REQUESTS:
        tree.register(sid, pid)
    sessions = [sid for sid, _, _ in REQUESTS]
    context_for = tree.context_for

    def run() -> list[dict[str, str]]:
        out = []
        for sid in sessions:
            ctx = context_for(sid, is_final_turn=False)
            out.append(stamp(ctx.session_id, ctx.parent_session_id, ctx.root_session_id))
        return out

    assert benchmark(run) == _expected("dynamo_headers")


def _body_4k() -> bytes:
    """A 4 KiB chat request from a client, with a caller's `nvext` member to merge into."""
    doc: dict[str, Any] = {
        "model": "mock",
        "messages": [
            {"role": "system", "content": "You are a coding agent. Answer briefly."},
            {"role": "user", "content": ""},
        ],
        "tools": [{"type": "function", "function": {"name": "run", "parameters": {}}}],
        "nvext": {"annotations": ["agent", "eval"], "greed_sampling": False},
        "max_tokens": 256,
    }
    size = len(json.dumps(doc, separators=(",", ":")).encode())
    text = "Refactor the parser, keep the tests green. " * 100
    doc["messages"][1]["content"] = text[: 4096 - size]
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    assert len(body) == 4096
    return body


BODY_4K = _body_4k()
ROOT, CHILD = REQUESTS[0][0], REQUESTS[1][0]
# What the session core adds for the engine (TITO prompt ids of a ~300-token prompt).
FIELDS: dict[str, Any] = {
    "input_ids": list(range(1000, 1300)),
    "logprobs": True,
    "return_meta_info": True,
    "no_stop_trim": False,
    "stream": False,
}


def _bound(body: bytes, fields: dict[str, Any]) -> dict[str, Any]:
    doc = {**json.loads(body), **fields}
    doc["nvext"] = {
        **doc["nvext"],
        "session_control": {"session_id": CHILD, "action": "bind", "timeout": 600},
    }
    return doc


@pytest.mark.parametrize("impl_name", IMPLS)
def test_nvext_4k(benchmark, impl_name):
    """`nvext_session_control` (a bind) on a 4 KiB body."""
    benchmark.group = "nvext_session_control: 4 KiB body"
    nvext = get_impl(impl_name).nvext_session_control
    out = benchmark(nvext, BODY_4K, CHILD, "bind", 600)
    assert json.loads(out) == _bound(BODY_4K, {})


@pytest.mark.parametrize("path", ["bytes-path", "object-path"])
def test_nvext_upstream_body(benchmark, path):
    """The upstream body of a dynamo_nvext turn as the session core builds it (Rust core):
    `bytes-path` = nvext splice + rewrite_request (now); `object-path` = merge the TITO
    fields into the parsed body, `DynamoNvext.transform_body`, json.dumps (before; the body
    is parsed anyway to validate the messages, so json.loads is not counted)."""
    benchmark.group = "dynamo_nvext upstream body: 4 KiB request + TITO fields"
    mode = DynamoNvext(DynamoNvext.Options(timeout_seconds=600))
    ctx = RoutingContext(CHILD, ROOT, ROOT)
    rust = get_impl("rust")
    doc = json.loads(BODY_4K)
    if path == "bytes-path":

        def run() -> bytes:
            spliced = rust.nvext_session_control(BODY_4K, CHILD, "bind", 600)
            return rust.rewrite_request(spliced, FIELDS)

    else:

        def run() -> bytes:
            upstream = mode.transform_body({**doc, **FIELDS}, ctx)
            return json.dumps(upstream, ensure_ascii=False, separators=(",", ":")).encode()

    assert json.loads(benchmark(run)) == _bound(BODY_4K, FIELDS)
