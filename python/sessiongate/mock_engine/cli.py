"""`sessiongate mock-engine`: run the mock engine under uvicorn until signalled or orphaned."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable, Generator
from types import FrameType
from typing import Any

import uvicorn

from sessiongate.mock_engine.config import MockEngineConfig

PARENT_PID_ENV = "SESSIONGATE_PARENT_PID"
_PR_SET_PDEATHSIG = 1
_PARENT_POLL_S = 0.5


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `mock-engine` subcommand on the top-level CLI."""
    d = MockEngineConfig()
    p: argparse.ArgumentParser = subparsers.add_parser(
        "mock-engine",
        help="run a deterministic SGLang-style chat engine (no GPU) for tests and benchmarks",
        description="Deterministic HTTP engine speaking the upstream chat contract "
        "(input_ids, meta_info, output_token_logprobs, routed_experts). See docs/mock-engine.md.",
    )
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--seed", type=int, default=d.seed, help="engine seed (default %(default)s)")
    p.add_argument(
        "--tokenizer",
        default=d.tokenizer,
        metavar="PATH",
        help="HF tokenizer dir (default: built-in ChatML tokenizer)",
    )
    p.add_argument("--model-name", default=d.model_name)
    p.add_argument(
        "--completion-tokens",
        type=int,
        default=d.completion_tokens,
        metavar="N",
        help="natural completion length incl. end token (default %(default)s)",
    )
    p.add_argument(
        "--completion-tokens-jitter",
        type=int,
        default=d.completion_tokens_jitter,
        metavar="J",
        help="lengths vary in [N-J, N+J] (default %(default)s)",
    )
    p.add_argument("--ttft-ms", type=float, default=d.ttft_ms, help="delay before first token")
    p.add_argument(
        "--token-delay-ms", type=float, default=d.token_delay_ms, help="delay per generated token"
    )
    p.add_argument(
        "--fail-rate",
        type=float,
        default=d.fail_rate,
        help="fraction of chat requests answered with --fail-status",
    )
    p.add_argument("--fail-status", type=int, default=d.fail_status)
    p.add_argument("--r3-layers", type=int, default=d.r3_layers, help="0 = no routed_experts")
    p.add_argument("--r3-topk", type=int, default=d.r3_topk)
    p.add_argument("--r3-experts", type=int, default=d.r3_experts)
    p.add_argument(
        "--tool-call-rate",
        type=float,
        default=d.tool_call_rate,
        help="probability of a tool call when the request has tools",
    )
    p.add_argument(
        "--stream-chunk-tokens",
        type=int,
        default=d.stream_chunk_tokens,
        help="tokens per SSE chunk (default %(default)s)",
    )
    p.add_argument(
        "--log-level",
        default=d.log_level,
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    p.set_defaults(run=run)
    return p


def config_from_args(args: argparse.Namespace) -> MockEngineConfig:
    return MockEngineConfig(
        host=args.host,
        port=args.port,
        seed=args.seed,
        tokenizer=args.tokenizer,
        model_name=args.model_name,
        completion_tokens=args.completion_tokens,
        completion_tokens_jitter=args.completion_tokens_jitter,
        ttft_ms=args.ttft_ms,
        token_delay_ms=args.token_delay_ms,
        fail_rate=args.fail_rate,
        fail_status=args.fail_status,
        r3_layers=args.r3_layers,
        r3_topk=args.r3_topk,
        r3_experts=args.r3_experts,
        tool_call_rate=args.tool_call_rate,
        stream_chunk_tokens=args.stream_chunk_tokens,
        log_level=args.log_level,
    )


class _Server(uvicorn.Server):
    """uvicorn's Server without re-raising the caught signal after shutdown.

    uvicorn re-raises SIGTERM once it has shut down, so the process would die *by* the signal
    (exit status -15); a clean shutdown should exit 0. `on_exit` lets the app cut its delays
    short so graceful shutdown does not wait for slow streams.
    """

    on_exit: Callable[[], None] | None = None

    def request_exit(self) -> None:
        self.should_exit = True
        if self.on_exit is not None:
            self.on_exit()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        def on_signal(sig: int, frame: FrameType | None) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # second Ctrl-C: stop waiting for connections
            self.request_exit()

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def _parent_pid() -> int | None:
    raw = os.environ.get(PARENT_PID_ENV)
    return int(raw) if raw and raw.isdigit() else None


def _die_with_parent(parent: int) -> bool:
    """Ask Linux for SIGTERM when the parent dies; False if the parent is already gone."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    # The parent may have died between fork and prctl: then we were already re-parented.
    return os.getppid() == parent


async def _serve_quietly(server: _Server) -> int:
    try:
        await server.serve()
    except SystemExit as exc:  # uvicorn exits this way when it cannot bind; it logged why
        return exc.code if isinstance(exc.code, int) else 1
    return 0


async def _serve(
    server: _Server, closing: asyncio.Event, config: MockEngineConfig, parent: int | None
) -> int:
    loop = asyncio.get_running_loop()
    server.on_exit = lambda: loop.call_soon_threadsafe(closing.set)
    task = asyncio.create_task(_serve_quietly(server))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if server.started:
        # Report the bound port, so `--port 0` works for callers that read this line.
        sockets = [sock for srv in server.servers for sock in srv.sockets]
        port = sockets[0].getsockname()[1] if sockets else config.port
        print(f"mock-engine listening on http://{config.host}:{port}", flush=True)
    while not task.done():
        # Belt and braces next to PDEATHSIG (non-Linux, or a reaper that re-parents us).
        if parent is not None and os.getppid() != parent and not server.should_exit:
            server.request_exit()
        await asyncio.wait({task}, timeout=_PARENT_POLL_S)
    return task.result()


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"sessiongate mock-engine: {exc}", file=sys.stderr)
        return 2
    parent = _parent_pid()
    if parent is not None and not _die_with_parent(parent):
        return 0

    from sessiongate.mock_engine.app import create_app

    app = create_app(config)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=False,
        loop="asyncio",
        http="auto",  # httptools when installed, else h11
        lifespan="off",
        timeout_graceful_shutdown=1,
    )
    closing: asyncio.Event = app.state.engine.closing
    return asyncio.run(_serve(_Server(uv_config), closing, config, parent))
