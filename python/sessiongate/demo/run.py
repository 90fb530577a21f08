"""`sessiongate demo`: the gateway and its mock engine, a short bench run, full verification.

It is `sessiongate serve` (mock engine) plus `sessiongate bench --target sessiongate` with a
fixed agent-like workload (tool turns, one sub-agent child per session), the bench's own
progress and summary, and one more check the bench does not do: every session's records
(fetched by the bench before DELETE) must be token-exact. Then a second gateway in
`--session-mode tree` (started alongside the first, in-process) gets a few tree sessions
(a retry, a fork, a resume: `trees.py`), and every leaf's sample is verified token-exact
(`verify_trees.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from sessiongate.demo.trees import SHAPES, shape_of, tree_sessions
from sessiongate.demo.verify import RecordsVerifier
from sessiongate.loadgen.pacing import Pacing
from sessiongate.loadgen.report import print_summary
from sessiongate.loadgen.runner import BenchConfig, BenchOutcome, run_bench
from sessiongate.loadgen.workload import DEFAULT_TOOLS, SyntheticOptions, SyntheticWorkload
from sessiongate.process import free_port, wait_http_ready
from sessiongate.process.children import PARENT_PID_ENV

if TYPE_CHECKING:
    # Loads the tokenizer: imported where used, so `sessiongate _router` (which parses the
    # same CLI) never loads it (tests/dataplane/test_dataplane.py).
    from sessiongate.demo.verify_trees import TreeVerifier

SHOWN_PROBLEMS = 20
# `--quick`: a smoke test of an install (the wheel tests run it on every interpreter).
QUICK = {"sessions": 4, "turns": 3, "child_turns": 1, "concurrency": 2, "trees": 1}
TREE_GATEWAY_ARGS = ["--workers", "0", "--session-mode", "tree"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "demo",
        help="start the mock engine and gateway, run a short bench workload, verify it",
        description="Start `sessiongate serve` with the built-in mock engine, drive concurrent "
        "multi-turn sessions with tool turns and one sub-agent child each (the `bench` load "
        "driver), fetch and delete every session, check that every trajectory is "
        "token-exact; then drive a few tree sessions (a retry, a fork, a resume) through a "
        "second gateway in --session-mode tree and check every leaf's sample token-exact; "
        "report. Exits 1 on any error.",
    )
    parser.add_argument("--sessions", type=int, default=40, help="root sessions (40)")
    parser.add_argument("--turns", type=int, default=6, help="turns per root session (6)")
    parser.add_argument("--child-turns", type=int, default=2, help="turns per sub-agent (2)")
    parser.add_argument("--concurrency", type=int, default=8, help="trees in flight (8)")
    parser.add_argument(
        "--trees",
        type=int,
        default=len(SHAPES),
        help=f"tree sessions, cycling retry / fork / resume / all three ({len(SHAPES)}; "
        "0 skips them; skipped with --url)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the smallest run that still checks every trajectory token-exact: "
        f"{QUICK['sessions']} sessions of {QUICK['turns']} turns, one tree "
        "(sets --sessions, --turns, --child-turns, --concurrency and --trees)",
    )
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


def _config(url: str, args: argparse.Namespace, sessions: int, label: str) -> BenchConfig:
    return BenchConfig(
        url=url,
        pacing=Pacing(sessions=sessions, concurrency=args.concurrency, seed=args.seed),
        target="sessiongate",
        tools=DEFAULT_TOOLS,
        timeout=120.0,
        progress=args.progress,
        progress_interval_s=2.0,
        workload_label=label,
    )


def _bench(url: str, args: argparse.Namespace, verifier: RecordsVerifier) -> BenchOutcome:
    config = _config(url, args, args.sessions, "demo: tool turns + one sub-agent per session")
    workload = demo_workload(args)
    return asyncio.run(
        run_bench(config, workload, total_trees=args.sessions, records_hook=verifier)
    )


def _tree_bench(url: str, args: argparse.Namespace, verifier: TreeVerifier) -> BenchOutcome:
    label = "demo: tree sessions (retry, fork, resume)"
    config = dataclasses.replace(_config(url, args, args.trees, label), tree=True)
    sessions = tree_sessions(args.trees, args.seed)
    return asyncio.run(run_bench(config, sessions, total_trees=args.trees, tree_hook=verifier))


def _print_failed(console: Console, outcome: BenchOutcome) -> list[Any]:
    """The failed requests of a run (the first SHOWN_PROBLEMS printed)."""
    failed = [r for r in outcome.collector.records if r.error_key is not None]
    for record in failed[:SHOWN_PROBLEMS]:
        console.print(
            f"[red]error[/red] {record.kind} {record.session_id} turn {record.turn}: "
            + escape(f"{record.error_key} {record.error}"),
            highlight=False,
        )
    return failed


def _ready(gateway: _Gateway, console: Console, what: str) -> bool:
    try:
        wait_http_ready(gateway.url + "/health", timeout=60.0, proc=gateway.proc)
    except RuntimeError as exc:
        console.print(
            f"[red]{what} did not start[/red]: {escape(str(exc))}\n" + escape(gateway.output())
        )
        return False
    return True


def run(args: argparse.Namespace) -> int:
    console = Console()
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    if args.sessions < 1 or args.turns < 1 or args.child_turns < 1 or args.concurrency < 1:
        console.print("--sessions, --turns, --child-turns and --concurrency must be >= 1")
        return 2
    if args.trees < 0:
        console.print("--trees must be >= 0")
        return 2
    gateway: _Gateway | None = None
    tree_gateway: _Gateway | None = None
    url = args.url
    trees = args.trees if url is None else 0
    if url is None:
        gateway = _Gateway(shlex.split(args.serve_args))
        url = gateway.url
    if trees:
        # Started now, so its start-up overlaps the linear run instead of adding to it.
        tree_gateway = _Gateway(TREE_GATEWAY_ARGS)
    verifier = RecordsVerifier()
    tree_verifier: TreeVerifier | None = None
    tree_outcome: BenchOutcome | None = None
    try:
        if gateway is not None and not _ready(gateway, console, "gateway"):
            return 1
        console.print(
            f"sessiongate demo: {args.sessions} sessions x {args.turns} turns, a "
            f"{args.child_turns}-turn sub-agent each, {args.concurrency} in flight"
        )
        console.print(f"gateway: {url}", highlight=False)
        outcome = _bench(url, args, verifier)
        tree_ready = True
        if tree_gateway is not None and not outcome.interrupted:
            # A tree gateway that does not start fails the demo after the linear report.
            tree_ready = _ready(tree_gateway, console, "tree-mode gateway")
        if tree_gateway is not None and tree_ready and not outcome.interrupted:
            from sessiongate.demo.verify_trees import TreeVerifier

            tree_verifier = TreeVerifier(DEFAULT_TOOLS)
            tree_outcome = _tree_bench(tree_gateway.url, args, tree_verifier)
    finally:
        for started in (gateway, tree_gateway):
            if started is not None:
                started.stop()
    print_summary(outcome.summary, console, title="sessiongate demo")
    expected = args.sessions * 2
    console.print(
        f"sessions verified token-exact: {verifier.exact}/{expected} ({verifier.checked} fetched)"
    )
    problems = list(verifier.problems)
    if verifier.checked != expected:
        problems.append(f"fetched the records of {verifier.checked} sessions, expected {expected}")
    errors = outcome.summary["errors"]["total"]
    _print_failed(console, outcome)
    for problem in problems[:SHOWN_PROBLEMS]:
        console.print(f"[red]not token-exact[/red] {escape(problem)}", highlight=False)
    if outcome.interrupted or (tree_outcome is not None and tree_outcome.interrupted):
        return 130
    tree_failed = not tree_ready
    if tree_outcome is not None and tree_verifier is not None:
        assert tree_gateway is not None
        console.print(f"tree sessions: {trees} ({_shapes(trees)})")
        console.print(f"tree gateway (--session-mode tree): {tree_gateway.url}", highlight=False)
        tree_failed = _report_trees(console, trees, tree_outcome, tree_verifier)
    elif args.trees and args.url is not None:
        console.print("tree sessions: skipped (--url: the demo starts its own tree gateway)")
    return 1 if errors or problems or tree_failed else 0


def _shapes(count: int) -> str:
    names = [shape_of(i).name for i in range(count)]
    return ", ".join(f"{names.count(s.name)} {s.name}" for s in SHAPES if s.name in names)


def _report_trees(
    console: Console, trees: int, outcome: BenchOutcome, verifier: TreeVerifier
) -> bool:
    """Print the tree part's summary and verdicts; True when something failed."""
    print_summary(outcome.summary, console, title="sessiongate demo: tree sessions")
    expected_leaves = sum(shape_of(i).leaves for i in range(trees))
    expected_samples = sum(shape_of(i).samples for i in range(trees))
    v = verifier
    # Each line fits 80 columns: rich wraps longer ones when stdout is not a terminal.
    console.print(
        f"tree sessions verified: {v.exact_sessions}/{trees} "
        f"({v.leaves} leaves, {v.samples} samples)"
    )
    console.print(f"leaf samples verified token-exact: {v.exact_samples}/{expected_samples}")
    console.print("  (tokens = a fresh render of the leaf's conversation,")
    console.print("   each completion = the ids the engine sampled)")
    console.print(f"active paths verified token-exact: {v.active_paths}/{trees}")
    console.print(f"abandoned retries dropped by the picker: {v.abandoned_dropped}/{v.abandoned}")
    problems = list(v.problems)
    if v.sessions != trees:
        problems.append(f"checked {v.sessions} tree sessions, expected {trees}")
    if (v.leaves, v.samples) != (expected_leaves, expected_samples):
        problems.append(
            f"{v.leaves} leaves and {v.samples} samples, expected {expected_leaves} and "
            f"{expected_samples}"
        )
    failed = _print_failed(console, outcome)
    for problem in problems[:SHOWN_PROBLEMS]:
        console.print(f"[red]tree not token-exact[/red] {escape(problem)}", highlight=False)
    return bool(failed or problems or v.abandoned_dropped != v.abandoned)
