"""`sessiongate demo`: start the gateway (and its mock engine), run agents, verify, report."""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx
from rich.console import Console
from rich.table import Table

from sessiongate.demo.agent import AgentStats, run_session
from sessiongate.demo.verify import trajectory_problems
from sessiongate.process import ChildProcess, free_port, wait_http_ready


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = sub.add_parser(
        "demo",
        help="start the mock engine and gateway, run a short agent workload, verify it",
        description="Start `sessiongate serve` with the built-in mock engine, drive concurrent "
        "multi-turn sessions with tool turns and one sub-agent child each, fetch and delete "
        "every session, check that every trajectory is token-exact, and report.",
    )
    parser.add_argument("--sessions", type=int, default=40)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--child-turns", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--url", default=None, help="use a running gateway instead of starting one")
    parser.add_argument("--serve-args", default="", help="extra arguments for `sessiongate serve`")
    parser.set_defaults(run=run)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _workload(
    url: str, args: argparse.Namespace
) -> tuple[AgentStats, tuple[int, int], int, float]:
    stats = AgentStats()
    gate = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as client:

        async def one(index: int) -> list[str]:
            async with gate:
                return await run_session(
                    client,
                    turns=args.turns,
                    index=index,
                    stats=stats,
                    child_turns=args.child_turns,
                )

        started = time.perf_counter()
        created = await asyncio.gather(*(one(i) for i in range(args.sessions)))
        elapsed = time.perf_counter() - started
        recorded_bytes = 0
        checked = 0
        exact = 0
        for session_id in (s for group in created for s in group):
            response = await client.get(f"/sessions/{session_id}")
            recorded_bytes += len(response.content)
            problems = trajectory_problems(response.json())
            stats.errors += [f"{session_id}: {p}" for p in problems]
            checked += 1
            exact += not problems
            deleted = await client.delete(f"/sessions/{session_id}")
            if deleted.status_code != 204:
                stats.errors.append(f"{session_id}: DELETE answered {deleted.status_code}")
    return stats, (exact, checked), recorded_bytes, elapsed


def run(args: argparse.Namespace) -> int:
    console = Console()
    child: ChildProcess | None = None
    url = args.url
    if url is None:
        port = free_port()
        child = ChildProcess("serve", ["serve", "--port", str(port), *args.serve_args.split()])
        child.start()
        url = f"http://127.0.0.1:{port}"
        wait_http_ready(url + "/health", timeout=60.0, proc=child.proc)
    try:
        console.print(
            f"sessiongate demo: {args.sessions} sessions x {args.turns} turns "
            f"(+{args.child_turns}-turn sub-agent each) against {url}"
        )
        stats, verified, recorded_bytes, elapsed = asyncio.run(_workload(url, args))
    finally:
        if child is not None:
            child.stop()
    turns = len(stats.turn_latencies)
    table = Table(title="sessiongate demo")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("turns", str(turns))
    table.add_row("turns/s", f"{turns / elapsed:.1f}")
    table.add_row("latency p50", f"{_percentile(stats.turn_latencies, 0.5) * 1000:.1f} ms")
    table.add_row("latency p99", f"{_percentile(stats.turn_latencies, 0.99) * 1000:.1f} ms")
    exact, checked = verified
    table.add_row("sessions verified token-exact", f"{exact}/{checked}")
    table.add_row("bytes recorded (GET bodies)", f"{recorded_bytes:,}")
    table.add_row("errors", str(len(stats.errors)))
    console.print(table)
    for error in stats.errors[:20]:
        console.print(f"[red]error[/red] {error}")
    return 1 if stats.errors else 0
