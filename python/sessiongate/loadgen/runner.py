"""Wire one run together: HTTP client, target, driver, pacing, progress, Ctrl-C, summary.

Used by the `bench` CLI and by `sessiongate demo` (which adds a records hook to verify
every session token-exactly, and a tree hook to verify every leaf of tree sessions).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sessiongate.http.client import HttpClient
from sessiongate.loadgen.driver import Driver, RequestOptions
from sessiongate.loadgen.http import exchange
from sessiongate.loadgen.pacing import Pacing, drive
from sessiongate.loadgen.progress import PLAIN_INTERVAL_S, ProgressDisplay
from sessiongate.loadgen.stats import Collector, summarize
from sessiongate.loadgen.targets import OpenAITarget, RecordsHook, SessiongateTarget, Target
from sessiongate.loadgen.tree_check import TreeTally
from sessiongate.loadgen.tree_driver import TreeDriver, TreeHook
from sessiongate.loadgen.tree_log import PICKERS
from sessiongate.loadgen.tree_workload import TreeSessionSpec
from sessiongate.loadgen.workload import SessionSpec
from sessiongate.session_routing import load_mode

TARGETS = ("sessiongate", "openai")
DEFAULT_MODEL = "default"
CLEANUP_TIMEOUT_S = 3.0  # best-effort DELETE of open sessions after Ctrl-C


@dataclass(slots=True)
class BenchConfig:
    url: str
    pacing: Pacing
    target: str = "sessiongate"
    model: str | None = None  # None: the first id of GET /v1/models, else "default"
    stream: bool = False
    timeout: float | None = 600.0
    tools: list[dict[str, Any]] | None = None
    r3: bool = False
    ignore_eos: bool = False
    records: bool = True  # sessiongate target: GET every session's records before DELETE
    api_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    session_routing: str | None = None
    session_routing_opts: list[str] = field(default_factory=list)
    chat_path: str = "/v1/chat/completions"
    progress: str = "auto"
    progress_interval_s: float = PLAIN_INTERVAL_S
    workload_label: str = "synthetic"
    verify_tls: bool = True
    tree: bool = False  # the workload is tree sessions (TreeSessionSpec roots)
    tree_pick: str = "drop_retries"  # the gateway's pick hook, for the expected samples

    def check(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"--target must be one of {', '.join(TARGETS)}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url {self.url!r} must be an http:// or https:// URL")
        if self.target != "openai" and (self.session_routing or self.session_routing_opts):
            raise ValueError(
                "--session-routing stamps identity client-side and needs --target openai; "
                "with --target sessiongate the gateway stamps upstream requests itself "
                "(sessiongate serve --session-routing ...)"
            )
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError("--timeout must be > 0")
        if self.tree and self.target != "sessiongate":
            raise ValueError(
                "tree sessions need --target sessiongate: the driver checks each session's "
                "tree through the session API (GET /sessions/{id}, POST .../samples)"
            )
        if self.tree_pick not in PICKERS:
            raise ValueError(f"--tree-expect-pick must be one of {', '.join(PICKERS)}")
        self.pacing.check()


@dataclass(slots=True)
class BenchOutcome:
    collector: Collector
    summary: dict[str, Any]
    interrupted: bool


def _auth(config: BenchConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}


def build_target(
    config: BenchConfig, client: HttpClient, records_hook: RecordsHook | None
) -> Target:
    common: dict[str, Any] = {
        "timeout": config.timeout,
        "stream": config.stream,
        "headers": config.headers,
        "auth_headers": _auth(config),
    }
    if config.target == "openai":
        mode = load_mode(config.session_routing, config.session_routing_opts)
        return OpenAITarget(client, config.url, mode=mode, chat_path=config.chat_path, **common)
    return SessiongateTarget(
        client, config.url, records=config.records, records_hook=records_hook, **common
    )


async def discover_model(client: HttpClient, config: BenchConfig) -> str:
    """The endpoint's first model id (OpenAI `GET /v1/models`), else "default"."""
    ex = await exchange(
        client, "models", "GET", config.url.rstrip("/") + "/v1/models",
        headers=_auth(config), timeout=5.0,
    )  # fmt: skip
    try:
        model = (ex.document or {})["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        return DEFAULT_MODEL
    return model if isinstance(model, str) and model else DEFAULT_MODEL


def run_info(config: BenchConfig, model: str) -> dict[str, Any]:
    p = config.pacing
    routing = None
    if config.session_routing:
        routing = " ".join([config.session_routing, *config.session_routing_opts])
    return {
        "target": config.target,
        "url": config.url,
        "model": model,
        "workload": config.workload_label,
        "stream": config.stream,
        "sessions": p.sessions,
        "concurrency": p.concurrency,
        "request_rate": p.request_rate,
        "duration_s": p.duration_s,
        "warmup_sessions": p.warmup_sessions,
        "warmup_s": p.warmup_s,
        "session_routing": routing,
    }


async def run_bench(
    config: BenchConfig,
    workload: Iterable[SessionSpec] | Iterable[TreeSessionSpec],
    *,
    total_trees: int | None = None,
    records_hook: RecordsHook | None = None,
    tree_hook: TreeHook | None = None,
) -> BenchOutcome:
    """Run the workload as configured; Ctrl-C (SIGINT) stops it and keeps what was measured."""
    config.check()
    client = HttpClient(verify_tls=config.verify_tls)
    try:
        target = build_target(config, client, records_hook)
        model = config.model or await discover_model(client, config)
        options = RequestOptions(
            model=model,
            stream=config.stream,
            tools=config.tools,
            r3=config.r3,
            ignore_eos=config.ignore_eos,
            stream_usage=config.target == "openai",
        )
        collector = Collector(sessions_planned=total_trees)
        run_tree: Any = Driver(target, collector, options).run_tree
        if config.tree:
            assert isinstance(target, SessiongateTarget)  # config.check()
            collector.tree = TreeTally(picker=config.tree_pick)
            tree_driver = TreeDriver(
                target, collector, options, picker=config.tree_pick, hook=tree_hook
            )
            run_tree = tree_driver.run_tree
        display = ProgressDisplay(
            collector,
            mode=config.progress,
            total_trees=total_trees,
            duration_s=config.pacing.duration_s,
            interval_s=config.progress_interval_s,
        )

        def measured_phase_begins() -> None:
            if config.pacing.warmup_s:
                collector.warmup_until_s = collector.elapsed() + config.pacing.warmup_s

        loop = asyncio.get_running_loop()
        task = asyncio.create_task(
            drive(workload, run_tree, config.pacing, on_measured=measured_phase_begins)
        )
        interrupted = False

        def on_sigint() -> None:
            nonlocal interrupted
            interrupted = True
            task.cancel()
            # A second Ctrl-C gets Python's default behaviour: stop at once.
            loop.remove_signal_handler(signal.SIGINT)

        try:
            loop.add_signal_handler(signal.SIGINT, on_sigint)
            handler = True
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
            handler = False
        display.start()
        try:
            await task
        except asyncio.CancelledError:
            if not interrupted:
                raise
        finally:
            if handler:
                with contextlib.suppress(Exception):
                    loop.remove_signal_handler(signal.SIGINT)
            await display.stop()
        if interrupted:
            await target.cleanup(CLEANUP_TIMEOUT_S)
    finally:
        await client.aclose()
    summary = {"run": run_info(config, model), **summarize(collector, interrupted=interrupted)}
    return BenchOutcome(collector, summary, interrupted)
