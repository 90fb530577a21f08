"""Faults under load: inject one fault at a time into a gateway serving a rollout-like load
and measure what clients see and how fast the gateway recovers.

    python benches/stress/chaos.py                  # every case, full length (~2 minutes)
    python benches/stress/chaos.py --quick          # short phases (a smoke run)
    python benches/stress/chaos.py --only kill_worker,stop_worker

Loopback only, bounded in time, stops by itself. The load: `--sessions` concurrent sessions,
each a tool loop of R3 turns (mock engine `--r3-layers 48 --r3-topk 8`, gateway `--r3`), a
records GET every third turn and at the end (checking that exactly the answered turns are
recorded and token ids only ever extend), then a DELETE and a new session. A thread polls
`/health` every 50 ms throughout. Each case runs a steady phase, the fault, a steady phase.

Cases (figures go to docs/reliability.md, "Faults under load"):
  kill_worker    SIGKILL of worker 1: its in-flight requests fail fast (503), its sessions are
                 gone (404), it serves again (recovery = kill until a new session on it gets a
                 200 turn); worker 0's sessions see no error.
  engine_restart the mock engine SIGKILLed and restarted on the same port after `--down` s:
                 turns get 502 meanwhile, sessions stay usable (recovery = restart until the
                 first 200 turn).
  stop_worker    SIGSTOP of worker 1 for `--stop` s, then SIGCONT: /health keeps answering and
                 names worker 1 "stalled"; worker 0 is unaffected; worker 1's requests wait
                 and complete after SIGCONT.
  reset, truncate, stall, http500
                 a second gateway (`--timeout 2`) behind a fault-injecting proxy
                 (tests/support/fault_proxy.py) switched to that mode for `--fault` s: each turn
                 gets
                 502 (reset, truncate, stall: "timed out") or the engine's 500 passed through;
                 sessions stay usable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from sessiongate.primitives import shard_index, shard_key
from support.fault_proxy import FaultProxy
from support.procs import ServerProcess, free_port

ENGINE_ARGS = (
    "--r3-layers 48 --r3-topk 8 --completion-tokens 16 --completion-tokens-jitter 4 "
    # A few ms of generation so requests are really in flight when a fault lands.
    "--ttft-ms 10 --token-delay-ms 0.5"
).split()
WORKERS = 2
VICTIM = 1  # the worker the worker faults hit; worker 0 is the control shard
CLIENT_TIMEOUT = 60.0  # far above any documented outcome: a request reaching it hung
RETRY_PAUSE = 0.1  # an agent's pause after a failed turn before it retries


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def shard_of(session_id: str) -> int:
    return shard_index(shard_key(session_id), WORKERS)


# -- processes ----------------------------------------------------------------------------


class Rig:
    """A mock engine on a fixed port (restartable in place), optionally a FaultProxy in front
    of it, and `serve --workers 2` pointing at one or the other."""

    def __init__(self, *, proxy: bool = False, timeout: float = 30.0) -> None:
        self.engine_port = free_port()
        self.engine: ServerProcess | None = None
        self.proxy = FaultProxy(self.engine_port) if proxy else None
        self.timeout = timeout
        self.gateway: ServerProcess | None = None

    @property
    def url(self) -> str:
        assert self.gateway is not None
        return self.gateway.url

    def start_engine(self) -> None:
        self.engine = ServerProcess(
            ["mock-engine", "--port", str(self.engine_port), *ENGINE_ARGS], self.engine_port
        ).start()

    def kill_engine(self) -> None:
        """SIGKILL, as an OOM kill or a crash would: no graceful close of its connections."""
        assert self.engine is not None and self.engine.proc is not None
        os.killpg(self.engine.proc.pid, signal.SIGKILL)
        self.engine.proc.wait(10)
        self.engine.stop()

    def start(self) -> Rig:
        self.start_engine()
        backend = f"http://127.0.0.1:{self.engine_port}"
        if self.proxy is not None:
            backend = self.proxy.start().url
        port = free_port()
        args = ["serve", "--port", str(port), "--workers", str(WORKERS), "--backend", backend]
        args += ["--r3", "--r3-topk", "8", "--timeout", str(self.timeout)]
        args += ["--health-interval", "0.5"]
        self.gateway = ServerProcess(args, port, timeout=60).start()
        return self

    def worker_pids(self) -> list[int]:
        workers = httpx.get(self.url + "/health", timeout=10).json()["workers"]
        return [int(w["pid"]) for w in sorted(workers, key=lambda w: w["index"])]

    def stop(self) -> None:
        if self.gateway is not None:
            # A stopped worker cannot act on SIGTERM: resume every child first.
            for pid in _children(self.gateway):
                signal_quietly(pid, signal.SIGCONT)
            self.gateway.stop()
        if self.proxy is not None:
            self.proxy.stop()
        if self.engine is not None:
            self.engine.stop()

    def __enter__(self) -> Rig:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _children(proc: ServerProcess) -> list[int]:
    if proc.proc is None:
        return []
    try:
        path = Path(f"/proc/{proc.proc.pid}/task/{proc.proc.pid}/children")
        return [int(pid) for pid in path.read_text().split()]
    except OSError:
        return []


def signal_quietly(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


# -- /health poller -----------------------------------------------------------------------


# The poller's own process: a thread of the load's process would measure the load
# generator's GIL contention, not the gateway. One JSON line per poll; stops at stdin EOF.
_POLLER = """
import http.client, json, sys, threading, time, urllib.parse
url, interval = urllib.parse.urlsplit(sys.argv[1]), float(sys.argv[2])
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
while not done.is_set():
    started = time.monotonic()
    try:
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
        conn.request("GET", url.path)
        reply = conn.getresponse()
        document = json.loads(reply.read())
        conn.close()
        sample = [started, time.monotonic() - started, reply.status, document]
    except (OSError, http.client.HTTPException, ValueError) as exc:
        sample = [started, time.monotonic() - started, 0, {"error": str(exc)}]
    print(json.dumps(sample), flush=True)
    done.wait(interval)
"""
# http.client, not httpx: httpx.get builds a client (and an SSL context) per call, ~50 ms of
# the poller's own CPU that earlier runs reported as /health latency.


class HealthPoller:
    """Polls `/health` from its own process every `interval` s, on a new connection each
    time (what an orchestrator's probe does): latency, status and worker states. Monotonic
    clocks are system-wide, so its timestamps compare with the load's."""

    def __init__(self, url: str, interval: float = 0.05) -> None:
        self.args = [sys.executable, "-c", _POLLER, url + "/health", str(interval)]
        self.samples: list[tuple[float, float, int, dict[str, Any]]] = []
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> HealthPoller:
        self._proc = subprocess.Popen(
            self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        # Drained as it comes: a full pipe would block the poller and hide the samples of
        # the very window a fault is in.
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        return self

    def _drain(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.append(line)

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=15)
        self.samples = [tuple(json.loads(line)) for line in self._lines if line.strip()]  # type: ignore[misc]

    def window(self, start: float, end: float) -> list[tuple[float, float, int, dict[str, Any]]]:
        return [s for s in self.samples if start <= s[0] <= end]


# -- load ---------------------------------------------------------------------------------


@dataclass
class Outcome:
    started: float
    seconds: float
    shard: int
    op: str  # create, turn, get, delete
    status: int  # 0: no HTTP answer (transport error or client timeout)
    error: str = ""


@dataclass
class Load:
    """Concurrent rollout sessions against `url` until `stop()`; every request's outcome."""

    url: str
    sessions: int = 24
    turns: int = 8
    outcomes: list[Outcome] = field(default_factory=list)
    # Broken promises found by the records checks: (session, what).
    violations: list[tuple[str, str]] = field(default_factory=list)
    sessions_checked: int = 0
    _stopping: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self) -> None:
        self.client = httpx.AsyncClient(
            base_url=self.url,
            timeout=CLIENT_TIMEOUT,
            limits=httpx.Limits(max_connections=self.sessions * 2),
        )
        self._tasks = [asyncio.create_task(self._agent(n)) for n in range(self.sessions)]

    async def stop(self) -> None:
        self._stopping.set()
        await asyncio.gather(*self._tasks)
        await self.client.aclose()

    async def _call(
        self, op: str, shard: int, method: str, path: str, body: Any = None
    ) -> httpx.Response | None:
        started = time.monotonic()
        try:
            reply = await self.client.request(method, path, json=body)
        except httpx.HTTPError as exc:
            self.outcomes.append(
                Outcome(started, time.monotonic() - started, shard, op, 0, repr(exc))
            )
            return None
        error = "" if reply.status_code < 400 else reply.text[:300]
        self.outcomes.append(
            Outcome(started, time.monotonic() - started, shard, op, reply.status_code, error)
        )
        return reply

    async def _agent(self, n: int) -> None:
        while not self._stopping.is_set():
            created = await self._call("create", -1, "POST", "/sessions")
            if created is not None and created.status_code != 200:
                # The router minted the id: the error names the worker it landed on.
                named = re.search(r"worker (\d+)", created.text)
                self.outcomes[-1].shard = int(named.group(1)) if named else -1
            if created is None or created.status_code != 200:
                await asyncio.sleep(RETRY_PAUSE)
                continue
            sid = created.json()["session_id"]
            self.outcomes[-1].shard = shard_of(sid)
            await self._session(sid, n)

    async def _session(self, sid: str, n: int) -> None:
        """One episode; returns when it ends or its session is lost (worker killed)."""
        shard = shard_of(sid)
        path = f"/sessions/{sid}"
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": f"agent {n}: solve task {sid[:8]} with tools"}
        ]
        answered = 0
        while answered < self.turns and not self._stopping.is_set():
            reply = await self._call(
                "turn", shard, "POST", path + "/v1/chat/completions", {"messages": messages}
            )
            if reply is None or reply.status_code != 200:
                if reply is not None and reply.status_code in (404, 503):
                    return  # the session was lost with its worker: start a new episode
                # A failed turn must leave the session as it was: retry the same turn.
                await asyncio.sleep(RETRY_PAUSE)
                continue
            answered += 1
            messages.append(reply.json()["choices"][0]["message"])
            messages.append({"role": "tool", "content": f"observation {answered}"})
            if answered % 3 == 0 and not await self._check(sid, shard, answered):
                return
        if await self._check(sid, shard, answered):
            await self._call("delete", shard, "DELETE", path)

    async def _check(self, sid: str, shard: int, answered: int) -> bool:
        """The records hold exactly the answered turns, TITO-consistent, each turn's token
        ids extending the previous turn's. False when the session is gone."""
        reply = await self._call("get", shard, "GET", f"/sessions/{sid}")
        if reply is None or reply.status_code != 200:
            return False
        document = reply.json()
        records = document["records"]
        self.sessions_checked += 1
        if len(records) != answered or document["metadata"]["num_turns"] != answered:
            self.violations.append((sid, f"{len(records)} records for {answered} turns"))
        if document["metadata"].get("tito_session_mismatch_detail"):
            self.violations.append((sid, "tito mismatch"))
        ids = [r["request"].get("input_ids", []) for r in records]
        for turn in range(1, len(ids)):
            if ids[turn][: len(ids[turn - 1])] != ids[turn - 1]:
                self.violations.append((sid, f"turn {turn} does not extend turn {turn - 1}"))
        return True


# -- reporting ----------------------------------------------------------------------------


def summarize(
    load: Load,
    health: HealthPoller,
    start: float,
    end: float,
    *,
    affected: int | None,
) -> dict[str, Any]:
    """Figures of one case: everything between the start of its first steady phase and the
    end of its last. `affected`: the shard the fault hit (None: every shard)."""
    window = [o for o in load.outcomes if start <= o.started <= end]
    statuses: dict[str, Counter[int]] = {}
    for o in window:
        label = "all" if affected is None else ("affected" if o.shard == affected else "other")
        statuses.setdefault(label, Counter())[o.status] += 1
    control = [o for o in window if affected is None or o.shard != affected]
    failed = [o for o in window if o.status == 0 or o.status >= 500]
    polls = health.window(start, end)
    return {
        "requests": len(window),
        "statuses": {k: dict(sorted(v.items())) for k, v in sorted(statuses.items())},
        "errors_other_shard": None
        if affected is None
        else sum(1 for o in control if o.status == 0 or o.status >= 400),
        "p50_ms": ms(pct([o.seconds for o in control], 0.5)),
        "p99_ms": ms(pct([o.seconds for o in control], 0.99)),
        "failed_max_ms": ms(max((o.seconds for o in failed), default=0.0)),
        "slowest_ms": ms(max((o.seconds for o in window), default=0.0)),
        "error_samples": sorted({o.error[:160] for o in failed})[:4],
        "health_polls": len(polls),
        "health_p50_ms": ms(pct([p[1] for p in polls], 0.5)),
        "health_p99_ms": ms(pct([p[1] for p in polls], 0.99)),
        "health_max_ms": ms(max((p[1] for p in polls), default=0.0)),
        "health_statuses": dict(Counter(p[2] for p in polls)),
        "violations": load.violations[:5],
        "sessions_checked": load.sessions_checked,
    }


# -- cases --------------------------------------------------------------------------------


async def first_ok_turn(url: str, shard: int | None, deadline: float) -> float | None:
    """Monotonic time at which a new session (on `shard`, if given) got a 200 turn."""
    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT) as client:
        while time.monotonic() < deadline:
            try:
                created = await client.post("/sessions")
                if created.status_code == 200:
                    sid = created.json()["session_id"]
                    if shard is None or shard_of(sid) == shard:
                        turn = await client.post(
                            f"/sessions/{sid}/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": "are you back?"}]},
                        )
                        await client.delete(f"/sessions/{sid}")
                        if turn.status_code == 200:
                            return time.monotonic()
                    else:
                        await client.delete(f"/sessions/{sid}")
                        continue
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.02)
    return None


async def run_case(
    rig: Rig,
    fault: Any,
    *,
    steady: float,
    sessions: int,
    turns: int,
    affected: int | None,
    finish: Callable[[HealthPoller, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Steady load, `await fault(extra)` (it fills `extra` with its own figures), steady
    load; then the load drains, `finish(health, extra)` adds what needs the /health
    samples, and the figures are taken."""
    extra: dict[str, Any] = {}
    load = Load(rig.url, sessions=sessions, turns=turns)
    with HealthPoller(rig.url) as health:
        start = time.monotonic()
        load.start()
        try:
            await asyncio.sleep(steady)
            await fault(extra)
            await asyncio.sleep(steady)
        finally:
            await load.stop()
        end = time.monotonic()
    if finish is not None:
        finish(health, extra)
    return {**summarize(load, health, start, end, affected=affected), **extra}


def kill_worker(rig: Rig, settle: float) -> Any:
    async def fault(extra: dict[str, Any]) -> None:
        pid = rig.worker_pids()[VICTIM]
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        back = await first_ok_turn(rig.url, VICTIM, killed + 60)
        extra["recovery_s"] = None if back is None else round(back - killed, 3)
        await asyncio.sleep(settle)

    return fault


def engine_restart(rig: Rig, down: float) -> Any:
    async def fault(extra: dict[str, Any]) -> None:
        await asyncio.to_thread(rig.kill_engine)
        await asyncio.sleep(down)
        restarting = time.monotonic()
        await asyncio.to_thread(rig.start_engine)
        extra["engine_start_s"] = round(time.monotonic() - restarting, 3)
        back = await first_ok_turn(rig.url, None, restarting + 60)
        extra["recovery_s"] = None if back is None else round(back - restarting, 3)

    return fault


def stop_worker(rig: Rig, stopped_for: float) -> Any:
    async def fault(extra: dict[str, Any]) -> None:
        pid = rig.worker_pids()[VICTIM]
        stopped = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(stopped_for)
            # What a scraper sees just before the worker resumes.
            async with httpx.AsyncClient(timeout=10) as client:
                metrics = (await client.get(rig.url + "/metrics")).text
            gauge = "sessiongate_worker_stalled"
            extra["metrics_stalled"] = [ln for ln in metrics.splitlines() if ln.startswith(gauge)]
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed = time.monotonic()
        back = await first_ok_turn(rig.url, VICTIM, resumed + 60)
        extra["stopped_s"] = round(resumed - stopped, 3)
        extra["recovery_s"] = None if back is None else round(back - resumed, 3)
        extra["_stopped_at"] = stopped
        extra["_resumed_at"] = resumed

    return fault


def proxy_fault(rig: Rig, mode: str, duration: float) -> Any:
    async def fault(extra: dict[str, Any]) -> None:
        assert rig.proxy is not None
        rig.proxy.set_mode(mode)
        try:
            await asyncio.sleep(duration)
        finally:
            rig.proxy.set_mode("pass")
        restored = time.monotonic()
        back = await first_ok_turn(rig.url, None, restored + 60)
        extra["faulted_requests"] = rig.proxy.counts[mode]
        extra["recovery_s"] = None if back is None else round(back - restored, 3)

    return fault


def stalled_seen(health: list[tuple[float, float, int, dict[str, Any]]], stopped: float) -> Any:
    """Seconds from SIGSTOP until /health first named the victim stalled."""
    for started, _, _, document in health:
        if started < stopped:
            continue
        for worker in document.get("workers", []):
            if worker.get("index") == VICTIM and worker.get("state") == "stalled":
                return round(started - stopped, 3)
    return None


async def stop_worker_case(
    rig: Rig, *, steady: float, sessions: int, turns: int, stopped_for: float
) -> dict[str, Any]:
    """The stop_worker case, with /health's verdict while the worker was stopped."""

    def verdict(health: HealthPoller, extra: dict[str, Any]) -> None:
        stopped, resumed = extra.pop("_stopped_at"), extra.pop("_resumed_at")
        during = health.window(stopped, resumed)
        extra["stalled_named_after_s"] = stalled_seen(during, stopped)
        extra["health_during_stop"] = dict(Counter(p[2] for p in during))
        reasons = [p[3].get("reason", "") for p in during if p[3].get("status") == "degraded"]
        extra["health_reason"] = reasons[-1][:200] if reasons else None

    return await run_case(
        rig,
        stop_worker(rig, stopped_for),
        steady=steady,
        sessions=sessions,
        turns=turns,
        affected=VICTIM,
        finish=verdict,
    )


async def run_all(args: argparse.Namespace, only: set[str]) -> dict[str, Any]:
    common = {"steady": args.steady, "sessions": args.sessions, "turns": args.turns}
    results: dict[str, Any] = {}
    if only & {"kill_worker", "engine_restart", "stop_worker"}:
        with Rig(timeout=30) as rig:
            if "kill_worker" in only:
                results["kill_worker"] = await run_case(
                    rig, kill_worker(rig, args.fault), affected=VICTIM, **common
                )
            if "engine_restart" in only:
                results["engine_restart"] = await run_case(
                    rig, engine_restart(rig, args.down), affected=None, **common
                )
            if "stop_worker" in only:
                results["stop_worker"] = await stop_worker_case(
                    rig, stopped_for=args.stop, **common
                )
    modes = [m for m in ("reset", "truncate", "stall", "http500") if m in only]
    if modes:
        # --timeout 2: the stall mode must outlast it within a short phase.
        with Rig(proxy=True, timeout=2) as rig:
            for mode in modes:
                results[mode] = await run_case(
                    rig, proxy_fault(rig, mode, args.fault), affected=None, **common
                )
    return results


CASES = ("kill_worker", "engine_restart", "stop_worker", "reset", "truncate", "stall", "http500")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short phases (a smoke run)")
    parser.add_argument("--only", default=",".join(CASES), help=f"comma-separated: {CASES}")
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--turns", type=int, default=8, help="turns per episode")
    parser.add_argument("--steady", type=float, default=5.0, help="seconds before/after")
    parser.add_argument("--fault", type=float, default=3.0, help="seconds of a proxy fault")
    parser.add_argument("--down", type=float, default=3.0, help="seconds the engine is down")
    parser.add_argument("--stop", type=float, default=10.0, help="seconds of SIGSTOP")
    args = parser.parse_args()
    if args.quick:
        args.sessions, args.steady, args.fault, args.down, args.stop = 8, 1.5, 2.5, 1.5, 3.0
    only = set(args.only.split(","))
    unknown = only - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}")
    started = time.monotonic()
    results = asyncio.run(run_all(args, only))
    results["_run"] = {
        "seconds": round(time.monotonic() - started, 1),
        "sessions": args.sessions,
        "turns_per_episode": args.turns,
        "cpus": os.cpu_count(),
    }
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
