"""`sessiongate demo`: the gateway and its mock engine, a short bench run, full verification.

It is `sessiongate serve` (mock engine) plus `sessiongate bench --target sessiongate` with a
fixed agent-like workload (tool turns, one sub-agent child per session), the bench's own
progress and summary, and one more check the bench does not do: every session's records
(fetched by the bench before DELETE) must be token-exact.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from sessiongate.demo.verify import RecordsVerifier
from sessiongate.loadgen.pacing import Pacing
from sessiongate.loadgen.report import print_summary
from sessiongate.loadgen.runner import BenchConfig, BenchOutcome, run_bench
from sessiongate.loadgen.workload import DEFAULT_TOOLS, SyntheticOptions, SyntheticWorkload
from sessiongate.process import free_port, wait_http_ready
from sessiongate.process.children import PARENT_PID_ENV

SHOWN_PROBLEMS = 20


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = sub.add_parser(
        "demo",
        help="start the mock engine and gateway, run a short bench workload, verify it",
        description="Start `sessiongate serve` with the built-in mock engine, drive concurrent "
        "multi-turn sessions with tool turns and one sub-agent child each (the `bench` load "
        "driver), fetch and delete every session, check that every trajectory is "
        "token-exact, and report. Exits 1 on any error.",
    )
    parser.add_argument("--sessions", type=int, default=40, help="root sessions (40)")
    parser.add_argument("--turns", type=int, default=6, help="turns per root session (6)")
    parser.add_argument("--child-turns", type=int, default=2, help="turns per sub-agent (2)")
    parser.add_argument("--concurrency", type=int, default=8, help="trees in flight (8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", default=None, help="use a running gateway instead of starting one")
    parser.add_argument("--serve-args", default="", help="extra arguments for `sessiongate serve`")
    parser.add_argument(
        "--progress", choices=("auto", "rich", "plain", "off"), default="auto", help="(auto)"
    )
    parser.set_defaults(run=run)


def demo_workload(args: argparse.Namespace) -> SyntheticWorkload:
    # The first turn of every root spawns one sub-agent and waits for it, like an agent
    # that delegates a search and reads its result; later turns append tool results or
    # user follow-ups (the two roles the gateway accepts by default).
    return SyntheticWorkload(
        SyntheticOptions(
            seed=args.seed,
            turns=args.turns,
            child_turns=args.child_turns,
            system_tokens=12,
            prompt_tokens=24,
            append_tokens=12,
            tool_ratio=0.5,
            max_tokens=48,
            child_prob=1.0,
            fanout=1,
            depth=1,
            max_spawns=1,
        )
    )


class _Gateway:
    """`sessiongate serve` as a child whose chatter goes to a log shown only on failure."""

    def __init__(self, serve_args: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="sessiongate-demo-", suffix=".log")
        env = {**os.environ, PARENT_PID_ENV: str(os.getpid())}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sessiongate", "serve", "--port", str(self.port), *serve_args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _bench(url: str, args: argparse.Namespace, verifier: RecordsVerifier) -> BenchOutcome:
    config = BenchConfig(
        url=url,
        pacing=Pacing(sessions=args.sessions, concurrency=args.concurrency, seed=args.seed),
        target="sessiongate",
        tools=DEFAULT_TOOLS,
        timeout=120.0,
        progress=args.progress,
        progress_interval_s=2.0,
        workload_label="demo: tool turns + one sub-agent per session",
    )
    workload = demo_workload(args)
    return asyncio.run(
        run_bench(config, workload, total_trees=args.sessions, records_hook=verifier)
    )


def run(args: argparse.Namespace) -> int:
    console = Console()
    if args.sessions < 1 or args.turns < 1 or args.child_turns < 1 or args.concurrency < 1:
        console.print("--sessions, --turns, --child-turns and --concurrency must be >= 1")
        return 2
    gateway: _Gateway | None = None
    url = args.url
    if url is None:
        gateway = _Gateway(shlex.split(args.serve_args))
        url = gateway.url
    verifier = RecordsVerifier()
    try:
        if gateway is not None:
            try:
                wait_http_ready(url + "/health", timeout=60.0, proc=gateway.proc)
            except RuntimeError as exc:
                console.print(
                    f"[red]gateway did not start[/red]: {escape(str(exc))}\n"
                    + escape(gateway.output())
                )
                return 1
        console.print(
            f"sessiongate demo: {args.sessions} sessions x {args.turns} turns, a "
            f"{args.child_turns}-turn sub-agent each, {args.concurrency} in flight"
        )
        console.print(f"gateway: {url}", highlight=False)
        outcome = _bench(url, args, verifier)
    finally:
        if gateway is not None:
            gateway.stop()
    print_summary(outcome.summary, console, title="sessiongate demo")
    expected = args.sessions * 2
    console.print(
        f"sessions verified token-exact: {verifier.exact}/{expected} ({verifier.checked} fetched)"
    )
    problems = list(verifier.problems)
    if verifier.checked != expected:
        problems.append(f"fetched the records of {verifier.checked} sessions, expected {expected}")
    errors = outcome.summary["errors"]["total"]
    failed = [r for r in outcome.collector.records if r.error_key is not None]
    for record in failed[:SHOWN_PROBLEMS]:
        console.print(
            f"[red]error[/red] {record.kind} {record.session_id} turn {record.turn}: "
            + escape(f"{record.error_key} {record.error}"),
            highlight=False,
        )
    for problem in problems[:SHOWN_PROBLEMS]:
        console.print(f"[red]not token-exact[/red] {escape(problem)}", highlight=False)
    if outcome.interrupted:
        return 130
    return 1 if errors or problems else 0
