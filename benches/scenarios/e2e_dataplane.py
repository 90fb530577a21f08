"""End-to-end data-plane scenarios, each comparing configurations in one run.

    python benches/scenarios/e2e_dataplane.py                 # all scenarios, full size
    python benches/scenarios/e2e_dataplane.py --quick         # small sizes (a smoke run)
    python benches/scenarios/e2e_dataplane.py --only r3       # one scenario (names below)
    python benches/scenarios/e2e_dataplane.py --only r3cpu --ref-python ../ref/.venv/bin/python

Scenarios (figures go to docs/performance.md):
  r3       8 concurrent sessions x 20 turns with 16 MiB of R3 per turn: --workers 1 vs 2.
  get      small-chat p99 alone vs while 4 clients GET 512 MiB sessions (rounds of GETs until
           200 chats ran during them), records on lent connections vs shared-memory files vs
           frames; router RSS.
  latency  1 KiB chat straight to the mock engine vs through sessiongate with 2 workers and
           in-process (--workers 0), stateless and as a session turn, at concurrency 1 and 64.
  cpu      gateway CPU (router + workers) per small turn, per ~20 MiB-R3 turn (a fresh
           gateway's first session, then a second one on warm memory) and per records GET,
           Rust core vs SESSIONGATE_IMPL=python, rounds in both orders.
  impl     the r3 scenario (--workers 2) with the Rust core vs SESSIONGATE_IMPL=python, side by
           side in alternating rounds: turns/s and CPU per turn of each process role.
  r3cpu    worker CPU per R3 turn (4 sessions x 5 turns, 2,000-word prompts, 64 new tokens,
           R3 64 layers x top-32: ~22-25 MiB of base64 per turn, --workers 1) of the Rust core
           beside SESSIONGATE_IMPL=python and, with --ref-python, beside another checkout's
           interpreter (a venv of a reference commit), one gateway each, in alternating
           rounds on warm gateways; medians and spreads, page faults and turns/s.
  transport  the r3 scenario with 2 workers on each transport: local UNIX-socket workers vs
           2 `sessiongate worker` processes over loopback TCP vs 2 Ray-placed workers (a
           private local Ray instance; skipped without `ray`), plus gateway CPU per turn
           and the p50 of small sequential turns; 3 alternating rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from sessiongate.http.client import HttpClient
from support.procs import ServerProcess, free_port

# 512 layers x 8 experts x 4 bytes = 16 KiB of R3 per token; ~1000-token turns carry 16 MiB.
R3_MOCK = "--r3-layers 512 --r3-topk 8 --completion-tokens 24 --completion-tokens-jitter 0"


async def curl_get(url: str, nice: bool = False) -> tuple[int, int]:
    """A GET read by curl into /dev/null: (status, bytes received). curl, not Python, reads
    large dumps: a trainer reads them from another process, and a Python reader would
    compete with the gateway for the 2 cores. `nice`: curl at nice 19."""
    proc = await asyncio.create_subprocess_exec(
        *(["nice", "-n", "19"] if nice else []),
        "curl",
        "-sS",
        "--max-time",
        "300",  # a stalled GET ends the bench, not a loop of small chats for ever
        "-o",
        "/dev/null",
        "-w",
        "%{http_code} %{size_download}",
        url,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    code, _, size = out.decode().partition(" ")
    return int(code or 0), int(float(size or 0))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def process_roles(gw: ServerProcess) -> dict[str, list[int]]:
    """PIDs of the gateway's router, its workers and its embedded mock engine: the
    supervisor's children; the router is the one running `_router`."""
    assert gw.proc is not None
    workers = [w["pid"] for w in httpx.get(gw.url + "/health").json()["workers"]]
    children = Path(f"/proc/{gw.proc.pid}/task/{gw.proc.pid}/children").read_text().split()
    others = [pid for pid in map(int, children) if pid not in workers]
    router = [pid for pid in others if b"_router" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    if not router:
        raise RuntimeError("router process not found")
    engine = [pid for pid in others if pid not in router]
    return {"router": router, "workers": workers, "mock_engine": engine}


def router_pid(gw: ServerProcess) -> int:
    return process_roles(gw)["router"][0]


# `--front` of the gateways `gateway()` starts (the command line's `--front`; default: auto).
FRONT: list[str] = []


@contextmanager
def gateway(*args: str) -> Iterator[ServerProcess]:
    port = free_port()
    with ServerProcess(["serve", "--port", str(port), *FRONT, *args], port, timeout=60) as proc:
        yield proc


async def session_turns(
    client: httpx.AsyncClient,
    turns: int,
    prompt: str,
    latencies: list[float],
    *,
    delete: bool = True,
) -> str:
    """One session of `turns` tool-loop turns; its id (deleted at the end unless not
    `delete`, for a records GET afterwards)."""
    sid: str = (await client.post("/sessions")).json()["session_id"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    for turn in range(turns):
        started = time.perf_counter()
        reply = await client.post(
            f"/sessions/{sid}/v1/chat/completions", json={"messages": messages}
        )
        latencies.append(time.perf_counter() - started)
        reply.raise_for_status()
        messages.append(reply.json()["choices"][0]["message"])
        messages.append({"role": "tool", "content": f"observation {turn}"})
    if delete:
        # Free the records (GiBs with R3): gateways outlive one load in some scenarios.
        await client.delete(f"/sessions/{sid}")
    return sid


def r3_load(url: str, quick: bool) -> dict[str, Any]:
    """The r3 scenario's load: concurrent sessions of 16 MiB-R3 turns; turns/s and latency."""
    sessions, turns = (4, 3) if quick else (8, 20)
    prompt = " ".join(["word"] * (200 if quick else 1000))
    latencies: list[float] = []

    async def run() -> float:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            started = time.perf_counter()
            await asyncio.gather(
                *(session_turns(client, turns, prompt, latencies) for _ in range(sessions))
            )
            return time.perf_counter() - started

    elapsed = asyncio.run(run())
    return {
        "turns": len(latencies),
        "turns_per_s": round(len(latencies) / elapsed, 2),
        "p50_ms": round(pct(latencies, 0.5) * 1000, 1),
        "p99_ms": round(pct(latencies, 0.99) * 1000, 1),
    }


def scenario_r3(quick: bool) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for workers in (1, 2):
        with gateway("--workers", str(workers), "--r3", "--mock-args", R3_MOCK) as gw:
            results[f"workers={workers}"] = r3_load(gw.url, quick)
    results["speedup_2_vs_1"] = round(
        results["workers=2"]["turns_per_s"] / results["workers=1"]["turns_per_s"], 2
    )
    return results


async def small_chats(url: str, count: int, latencies: list[float]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for n in range(count):
            sid = (await client.post("/sessions")).json()["session_id"]
            started = time.perf_counter()
            reply = await client.post(
                f"/sessions/{sid}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": f"hi {n}"}], "max_tokens": 8},
            )
            latencies.append(time.perf_counter() - started)
            reply.raise_for_status()
            await client.delete(f"/sessions/{sid}")


def scenario_get(quick: bool) -> dict[str, Any]:
    """Three gateways in turn: records GETs written by the workers on lent connections (the
    default), as shared-memory files (--no-lent-replies), and as frames through the router
    (--no-shared-memory-replies)."""
    arms = {
        "lent": ([], False),
        "files": (["--no-lent-replies"], False),
        "frames": (["--no-shared-memory-replies"], False),
    }
    results: dict[str, Any] = {name: get_arm(quick, *arm) for name, arm in arms.items()}
    for name in ("lent", "files"):
        arm, frames = results[name], results["frames"]
        results[f"{name}_vs_frames"] = {
            "get_wall": round(arm["gets_elapsed_s"] / frames["gets_elapsed_s"], 2),
            "small_chat_p50_during_gets": round(
                arm["small_chat_p50_ms_during_gets"] / frames["small_chat_p50_ms_during_gets"], 2
            ),
            "small_chat_p99_during_gets": round(
                arm["small_chat_p99_ms_during_gets"] / frames["small_chat_p99_ms_during_gets"], 2
            ),
        }
    return results


def get_arm(quick: bool, extra: list[str], nice_readers: bool) -> dict[str, Any]:
    target_mib = 24 if quick else 512
    min_loaded = 40 if quick else 200
    readers = 4
    prompt = " ".join(["word"] * 1000)
    with gateway("--workers", "2", "--r3", "--mock-args", R3_MOCK, *extra) as gw:
        router = router_pid(gw)

        async def build() -> list[str]:
            async with httpx.AsyncClient(base_url=gw.url, timeout=600) as client:
                sids = []
                for _ in range(readers):
                    sid = (await client.post("/sessions")).json()["session_id"]
                    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
                    size = 0
                    while size < target_mib * 2**20:
                        reply = await client.post(
                            f"/sessions/{sid}/v1/chat/completions", json={"messages": messages}
                        )
                        reply.raise_for_status()
                        messages.append(reply.json()["choices"][0]["message"])
                        messages.append({"role": "tool", "content": "ok"})
                        size += 22 * 2**20  # ~16 MiB of R3 as base64 per turn
                    sids.append(sid)
                return sids

        sids = asyncio.run(build())
        baseline: list[float] = []
        asyncio.run(small_chats(gw.url, 200, baseline))
        loaded: list[float] = []
        peak_rss = rss_mib(router)
        get_bytes: list[int] = []

        async def with_gets() -> float:
            """One round: the four GETs at once, small chats for as long as they run."""
            nonlocal peak_rss

            async def reader(sid: str) -> None:
                status, size = await curl_get(f"{gw.url}/sessions/{sid}", nice_readers)
                if status != 200:
                    raise RuntimeError(f"GET /sessions/{sid}: {status} after {size} bytes")
                get_bytes.append(size)

            async def sample_rss(stop: asyncio.Event) -> None:
                nonlocal peak_rss
                while not stop.is_set():
                    peak_rss = max(peak_rss, rss_mib(router))
                    await asyncio.sleep(0.05)

            stop = asyncio.Event()
            sampler = asyncio.create_task(sample_rss(stop))
            started = time.perf_counter()
            gets = asyncio.gather(*(reader(s) for s in sids))
            # Small chats for as long as the dumps are being read.
            while not gets.done():
                await small_chats(gw.url, 10, loaded)
            await gets
            elapsed = time.perf_counter() - started
            stop.set()
            await sampler
            return elapsed

        # Rounds until enough chats ran during GETs for a p99 that is not just their maximum.
        rounds: list[float] = []
        while len(loaded) < min_loaded or not rounds:
            rounds.append(asyncio.run(with_gets()))
    elapsed = statistics.median(rounds)
    return {
        "session_mib": round(statistics.mean(get_bytes) / 2**20, 1),
        "get_rounds": len(rounds),
        "gets_elapsed_s": round(elapsed, 2),
        "get_mib_per_s": round(readers * statistics.mean(get_bytes) / 2**20 / elapsed),
        "small_chats_during_gets": len(loaded),
        "small_chat_p50_ms_alone": round(pct(baseline, 0.5) * 1000, 1),
        "small_chat_p50_ms_during_gets": round(pct(loaded, 0.5) * 1000, 1),
        "small_chat_p99_ms_alone": round(pct(baseline, 0.99) * 1000, 1),
        "small_chat_p99_ms_during_gets": round(pct(loaded, 0.99) * 1000, 1),
        "p99_ratio": round(pct(loaded, 0.99) / pct(baseline, 0.99), 2),
        "router_peak_rss_mib": round(peak_rss, 1),
    }


async def hammer(url: str, concurrency: int, total: int, session: bool) -> list[float]:
    """`total` 1 KiB chats at `concurrency`, on the gateway's own lean client (httpx costs
    ~1-2 ms of CPU per request, which would swamp what is measured); a session turn when
    `session` (a new X-Session-ID each time: a first TITO turn, recorded)."""
    body = json.dumps(
        {"messages": [{"role": "user", "content": "x" * 900}], "max_tokens": 4}
    ).encode()
    latencies: list[float] = []
    client = HttpClient()
    counter = iter(range(total))

    async def loop() -> None:
        for n in counter:
            headers = {"content-type": "application/json"}
            if session:
                headers["X-Session-ID"] = f"lat-{os.getpid()}-{time.monotonic_ns()}-{n}"
            started = time.perf_counter()
            async with client.request(
                "POST", url + "/v1/chat/completions", headers=headers, body=body
            ) as reply:
                await reply.read()
            latencies.append(time.perf_counter() - started)
            if reply.status != 200:
                raise RuntimeError(f"{url}: status {reply.status}")

    try:
        await asyncio.gather(*(loop() for _ in range(concurrency)))
    finally:
        await client.aclose()
    return latencies


def scenario_latency(quick: bool) -> dict[str, Any]:
    """Added latency of a 1 KiB chat: direct to the mock engine vs through the gateway with
    2 workers and in-process (`--workers 0`), stateless and as a session turn. All targets
    take turns in each of 3 rounds (1 in --quick); medians of the per-round figures."""
    total = 200 if quick else 1000
    rounds = 1 if quick else 3
    per_round: dict[str, list[dict[str, float]]] = {}
    engine_port = free_port()
    mock = ["mock-engine", "--port", str(engine_port)]
    with ExitStack() as stack:
        engine = stack.enter_context(ServerProcess(mock, engine_port))
        gateways = {
            layout: stack.enter_context(gateway("--workers", workers, "--backend", engine.url)).url
            for layout, workers in (("workers2", "2"), ("inproc", "0"))
        }
        targets = {"direct": (engine.url, False)}
        for layout, url in gateways.items():
            targets[f"{layout}_stateless"] = (url, False)
            targets[f"{layout}_session"] = (url, True)
        for url, session in targets.values():  # warm-up: connections, first-use imports
            asyncio.run(hammer(url, 1, 50, session))
        for _ in range(rounds):
            for concurrency in (1, 64):
                figures: dict[str, float] = {}
                for name, (url, session) in targets.items():
                    latencies = asyncio.run(hammer(url, concurrency, total, session))
                    figures[f"{name}_p50_ms"] = pct(latencies, 0.5) * 1000
                    figures[f"{name}_p99_ms"] = pct(latencies, 0.99) * 1000
                for name in targets:
                    if name != "direct":
                        figures[f"{name}_added_p50_ms"] = (
                            figures[f"{name}_p50_ms"] - figures["direct_p50_ms"]
                        )
                per_round.setdefault(f"c={concurrency}", []).append(figures)
    return {
        level: {
            key: round(statistics.median(figures[key] for figures in runs), 3) for key in runs[0]
        }
        for level, runs in per_round.items()
    }


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def gateway_cpu(gw: ServerProcess) -> float:
    """CPU seconds used so far by the router and the workers (not the mock engine)."""
    roles = process_roles(gw)
    return sum(cpu_seconds(pid) for pid in [*roles["router"], *roles["workers"]])


def scenario_impl(quick: bool) -> dict[str, Any]:
    """The Rust core's end-to-end figure: the r3 load with the Rust core and with the twins
    (same --workers 2), alternating round by round so background noise hits both alike.
    Five rounds: single rounds swing 2x on this VM (first-touch memory, docs/performance.md)."""
    rounds = 1 if quick else 5
    impls = ("rust", "python")
    per_round: dict[str, list[dict[str, Any]]] = {impl: [] for impl in impls}
    with ExitStack() as stack:
        gateways = {}
        for impl in impls:
            port = free_port()
            args = ["serve", "--port", str(port), "--workers", "2", "--r3", "--mock-args", R3_MOCK]
            gw = ServerProcess(args, port, timeout=60, env={"SESSIONGATE_IMPL": impl})
            gateways[impl] = stack.enter_context(gw)
        for round_index in range(rounds):
            for impl in impls if round_index % 2 == 0 else impls[::-1]:
                roles = process_roles(gateways[impl])
                before = {role: sum(map(cpu_seconds, pids)) for role, pids in roles.items()}
                driver_before = time.process_time()
                load = r3_load(gateways[impl].url, quick)
                load["driver"] = time.process_time() - driver_before
                for role, pids in roles.items():
                    load[role] = sum(map(cpu_seconds, pids)) - before[role]
                per_round[impl].append(load)
    results: dict[str, Any] = {}
    for impl, loads in per_round.items():
        cpu = {
            role: round(statistics.median(load[role] / load["turns"] for load in loads) * 1000, 1)
            for role in ("router", "workers", "mock_engine", "driver")
        }
        results[impl] = {
            "turns_per_s_median": statistics.median(load["turns_per_s"] for load in loads),
            "turns_per_s_rounds": [load["turns_per_s"] for load in loads],
            "p50_ms_median": statistics.median(load["p50_ms"] for load in loads),
            "p99_ms_median": statistics.median(load["p99_ms"] for load in loads),
            "cpu_ms_per_turn_median": cpu,
        }
    rust, python = results["rust"], results["python"]
    results["rust_over_python"] = {
        "turns_per_s": round(rust["turns_per_s_median"] / python["turns_per_s_median"], 2),
        "turns_per_s_rounds": [
            round(r["turns_per_s"] / p["turns_per_s"], 2)
            for r, p in zip(per_round["rust"], per_round["python"], strict=True)
        ],
        "worker_cpu_per_turn": round(
            python["cpu_ms_per_turn_median"]["workers"] / rust["cpu_ms_per_turn_median"]["workers"],
            2,
        ),
    }
    return results


def scenario_cpu(quick: bool) -> dict[str, Any]:
    """Gateway CPU per small turn, per R3 turn (~20 MiB raw R3) and per records GET, with
    the Rust core and with SESSIONGATE_IMPL=python, in one run: rounds in both orders (the
    second configuration of a round finds memory the first one warmed, docs/performance.md),
    medians reported."""
    orders = [("rust", "python")] if quick else [("rust", "python"), ("python", "rust")]
    rounds: dict[str, list[dict[str, Any]]] = {"rust": [], "python": []}
    for order in orders:
        for impl in order:
            rounds[impl].append(_cpu_round(impl, quick))
    results: dict[str, Any] = {}
    for impl, runs in rounds.items():
        results[impl] = {
            key: statistics.median(run[key] for run in runs) for key in runs[0] if key != "impl"
        }
        results[impl]["r3_turn_cpu_ms_rounds"] = [run["r3_turn_cpu_ms"] for run in runs]
    rust, python = results["rust"], results["python"]
    results["python_over_rust"] = {
        "small_turn_cpu": round(python["small_turn_cpu_ms"] / rust["small_turn_cpu_ms"], 2),
        "r3_turn_cpu": round(python["r3_turn_cpu_ms"] / rust["r3_turn_cpu_ms"], 2),
        "r3_turns_per_s": round(rust["r3_turns_per_s"] / python["r3_turns_per_s"], 2),
        "r3_turn_cpu_warm": round(python["r3_turn_cpu_ms_warm"] / rust["r3_turn_cpu_ms_warm"], 2),
        "r3_turns_per_s_warm": round(
            rust["r3_turns_per_s_warm"] / python["r3_turns_per_s_warm"], 2
        ),
        "get_cpu": round(python["get_cpu_ms"] / max(rust["get_cpu_ms"], 0.1), 2),
    }
    return results


def _cpu_round(impl: str, quick: bool) -> dict[str, Any]:
    small_turns = 60 if quick else 300
    r3_turns = 4 if quick else 24
    # 48 layers x 8 experts x 4 bytes = 1.5 KiB per token; ~13.5k-token turns ~ 20 MiB.
    r3_mock = "--r3-layers 48 --r3-topk 8 --completion-tokens 24 --completion-tokens-jitter 0"
    prompt = " ".join(["word"] * (3000 if quick else 13500))
    port = free_port()
    env = {"SESSIONGATE_IMPL": impl}
    args = ["serve", "--port", str(port), "--workers", "1", "--r3", "--mock-args", r3_mock]
    with ServerProcess(args, port, timeout=60, env=env) as gw:

        async def small() -> float:
            latencies: list[float] = []
            started = time.perf_counter()
            await small_chats(gw.url, small_turns, latencies)
            return time.perf_counter() - started

        before = gateway_cpu(gw)
        small_elapsed = asyncio.run(small())
        small_cpu = gateway_cpu(gw) - before

        latencies: list[float] = []

        async def big(latencies: list[float]) -> tuple[str, float]:
            async with httpx.AsyncClient(base_url=gw.url, timeout=600) as client:
                started = time.perf_counter()
                sid = await session_turns(client, r3_turns, prompt, latencies, delete=False)
                return sid, time.perf_counter() - started

        worker = httpx.get(gw.url + "/health").json()["workers"][0]["pid"]
        rss_before = rss_mib(worker)
        before = gateway_cpu(gw)
        sid, r3_elapsed = asyncio.run(big(latencies))
        r3_cpu = gateway_cpu(gw) - before
        rss_growth = rss_mib(worker) - rss_before
        before = gateway_cpu(gw)
        worker_before = cpu_seconds(worker)
        started = time.perf_counter()
        size = len(httpx.get(f"{gw.url}/sessions/{sid}", timeout=600).content)
        get_elapsed = time.perf_counter() - started
        get_cpu = gateway_cpu(gw) - before
        get_worker_cpu = cpu_seconds(worker) - worker_before
        # The same R3 session again once the first is deleted: its memory is then warm (this
        # VM's first touch of fresh memory dominates the first session, docs/performance.md).
        httpx.delete(f"{gw.url}/sessions/{sid}", timeout=600)
        warm_latencies: list[float] = []
        before = gateway_cpu(gw)
        _, warm_elapsed = asyncio.run(big(warm_latencies))
        warm_cpu = gateway_cpu(gw) - before
    return {
        "small_turn_cpu_ms": round(small_cpu / small_turns * 1000, 2),
        "small_turns_per_s": round(small_turns / small_elapsed, 1),
        "r3_turn_cpu_ms": round(r3_cpu / r3_turns * 1000, 1),
        "r3_turns_per_s": round(r3_turns / r3_elapsed, 2),
        "r3_turn_p50_ms": round(pct(latencies, 0.5) * 1000, 1),
        "r3_turn_cpu_ms_warm": round(warm_cpu / r3_turns * 1000, 1),
        "r3_turns_per_s_warm": round(r3_turns / warm_elapsed, 2),
        "get_mib": round(size / 2**20, 1),
        "get_cpu_ms": round(get_cpu * 1000, 1),
        "get_worker_cpu_ms": round(get_worker_cpu * 1000, 1),
        "get_render_mb_per_worker_cpu_s": round(size / 1e6 / max(get_worker_cpu, 0.01)),
        "get_s": round(get_elapsed, 3),
        # Worker RSS growth over the R3 turns vs the records' bytes (~ the GET size).
        "rss_growth_mib": round(rss_growth, 1),
        "rss_per_stored_byte": round(rss_growth / (size / 2**20), 2),
    }


@contextmanager
def tcp_gateway() -> Iterator[ServerProcess]:
    """A mock engine, 2 `sessiongate worker` processes on loopback TCP, a router over them."""
    from support.tcp_workers import SECRET, WorkerProcess, router

    with tempfile.TemporaryDirectory() as tmp:
        secret = Path(tmp) / "secret"
        secret.write_text(SECRET)
        secret.chmod(0o600)
        port = free_port()
        mock = ["mock-engine", "--port", str(port), *R3_MOCK.split()]
        with (
            ServerProcess(mock, port) as engine,
            WorkerProcess(free_port(), secret, engine.url, "--r3", "--r3-topk", "8") as w0,
            WorkerProcess(free_port(), secret, engine.url, "--r3", "--r3-topk", "8") as w1,
            router(secret, w0.endpoint, w1.endpoint) as gw,
        ):
            deadline = time.monotonic() + 60
            while httpx.get(gw.url + "/health").status_code != 200:
                if time.monotonic() > deadline:
                    raise RuntimeError("TCP workers not up")
                time.sleep(0.1)
            yield gw


def minor_faults(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


# --ref-python: the interpreter of a reference checkout for the r3cpu scenario.
REF_PYTHON: list[str] = []
R3CPU_MOCK = "--r3-layers 64 --r3-topk 32 --completion-tokens 64 --completion-tokens-jitter 0"


def scenario_r3cpu(quick: bool) -> dict[str, Any]:
    """Worker CPU per R3 turn, sessions coming and going on long-lived gateways (the way a
    rollout uses one): every round runs 4 sessions x 5 turns on each gateway, then deletes
    them; the gateways take turns in alternating order so background noise and the VM's
    memory state hit all alike. A first round per gateway warms it and is not counted."""
    rounds = 2 if quick else 12
    configs = {
        "rust": ({}, sys.executable),
        "python": ({"SESSIONGATE_IMPL": "python"}, sys.executable),
    }
    if REF_PYTHON:
        configs["ref"] = ({}, REF_PYTHON[0])
    prompt = " ".join(["word"] * 2000)

    async def load(url: str) -> tuple[int, float]:
        latencies: list[float] = []
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            started = time.perf_counter()
            await asyncio.gather(*(session_turns(client, 5, prompt, latencies) for _ in range(4)))
            return len(latencies), time.perf_counter() - started

    per_round: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    with ExitStack() as stack:
        gateways: dict[str, ServerProcess] = {}
        for name, (env, python) in configs.items():
            port = free_port()
            args = ["serve", "--port", str(port), *FRONT, "--workers", "1", "--r3"]
            gw = ServerProcess(
                [*args, "--mock-args", R3CPU_MOCK], port, timeout=60, env=env, python=python
            )
            gateways[name] = stack.enter_context(gw)
        roles = {name: process_roles(gw) for name, gw in gateways.items()}
        for gw in gateways.values():
            asyncio.run(load(gw.url))  # warm-up round
        order = list(configs)
        for round_index in range(rounds):
            for name in order if round_index % 2 == 0 else order[::-1]:
                worker = roles[name]["workers"][0]
                router = roles[name]["router"][0]
                cpu0, router0, faults0 = (
                    cpu_seconds(worker),
                    cpu_seconds(router),
                    minor_faults(worker),
                )
                turns, elapsed = asyncio.run(load(gateways[name].url))
                per_round[name].append(
                    {
                        "worker_ms": (cpu_seconds(worker) - cpu0) * 1000 / turns,
                        "router_ms": (cpu_seconds(router) - router0) * 1000 / turns,
                        "faults": (minor_faults(worker) - faults0) / turns,
                        "turns_per_s": turns / elapsed,
                    }
                )
    results: dict[str, Any] = {}
    for name, runs in per_round.items():
        worker = [run["worker_ms"] for run in runs]
        results[name] = {
            "worker_cpu_ms_per_turn_median": round(statistics.median(worker), 1),
            "worker_cpu_ms_per_turn_min_max": [round(min(worker), 1), round(max(worker), 1)],
            "worker_cpu_ms_per_turn_rounds": [round(w, 1) for w in worker],
            "router_cpu_ms_per_turn_median": round(
                statistics.median(run["router_ms"] for run in runs), 1
            ),
            "worker_page_faults_per_turn_median": round(
                statistics.median(run["faults"] for run in runs)
            ),
            "turns_per_s_median": round(statistics.median(run["turns_per_s"] for run in runs), 1),
        }
    rust = results["rust"]["worker_cpu_ms_per_turn_median"]
    results["worker_cpu_over_rust"] = {
        name: round(results[name]["worker_cpu_ms_per_turn_median"] / rust, 2)
        for name in configs
        if name != "rust"
    }
    return results


def scenario_transport(quick: bool) -> dict[str, Any]:
    """The r3 load over 2 workers on each transport. All three gateways run side by side and
    the loads alternate in order round by round, so background noise hits them alike."""
    rounds = 1 if quick else 3
    results: dict[str, Any] = {}
    with ExitStack() as stack:
        gateways = {
            "unix_socket": stack.enter_context(
                gateway("--workers", "2", "--r3", "--mock-args", R3_MOCK)
            ),
            "loopback_tcp": stack.enter_context(tcp_gateway()),
        }
        try:
            import ray  # noqa: F401
        except ImportError:
            results["ray"] = "skipped: ray is not installed"
        else:
            ray_args = ["--ray", "--ray-address", "local", "--workers", "2"]
            gateways["ray"] = stack.enter_context(
                gateway(*ray_args, "--r3", "--mock-args", R3_MOCK)
            )
        per_round: dict[str, list[dict[str, Any]]] = {name: [] for name in gateways}
        order = list(gateways)
        for round_index in range(rounds):
            for name in order if round_index % 2 == 0 else order[::-1]:
                gw = gateways[name]
                before = gateway_cpu(gw)
                load = r3_load(gw.url, quick)
                load["cpu_ms_per_turn"] = (gateway_cpu(gw) - before) * 1000 / load["turns"]
                # Small sequential turns: where the transport's per-request cost shows.
                small: list[float] = []
                asyncio.run(small_chats(gw.url, 40 if quick else 200, small))
                load["small_p50_ms"] = pct(small, 0.5) * 1000
                per_round[name].append(load)
    for name, loads in per_round.items():
        results[name] = {
            "turns_per_s_median": statistics.median(load["turns_per_s"] for load in loads),
            "turns_per_s_rounds": [load["turns_per_s"] for load in loads],
            # Router + workers (not the mock engine, not Ray's own processes).
            "gateway_cpu_ms_per_turn_median": round(
                statistics.median(load["cpu_ms_per_turn"] for load in loads), 1
            ),
            "p50_ms_median": statistics.median(load["p50_ms"] for load in loads),
            "p99_ms_median": statistics.median(load["p99_ms"] for load in loads),
            "small_turn_p50_ms_median": round(
                statistics.median(load["small_p50_ms"] for load in loads), 2
            ),
        }
    base = results["unix_socket"]["turns_per_s_median"]
    results["turns_per_s_vs_unix"] = {
        name: round(results[name]["turns_per_s_median"] / base, 2) for name in per_round
    }
    return results


SCENARIOS = {
    "r3": scenario_r3,
    "get": scenario_get,
    "latency": scenario_latency,
    "cpu": scenario_cpu,
    "impl": scenario_impl,
    "transport": scenario_transport,
    "r3cpu": scenario_r3cpu,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=sorted(SCENARIOS), action="append")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--front",
        choices=("auto", "compiled", "python"),
        help="the front door of the gateways the get and r3 scenarios start (serve --front)",
    )
    parser.add_argument(
        "--ref-python",
        help="r3cpu: also measure the gateway run by this interpreter (another checkout's venv)",
    )
    args = parser.parse_args()
    if args.ref_python:
        REF_PYTHON[:] = [args.ref_python]
    if args.front:
        FRONT[:] = ["--front", args.front]
    figures: dict[str, Any] = {"machine": {"cores": os.cpu_count()}}
    for name in args.only or list(SCENARIOS):
        started = time.perf_counter()
        figures[name] = SCENARIOS[name](args.quick)
        figures[name]["scenario_s"] = round(time.perf_counter() - started, 1)
        print(json.dumps({name: figures[name]}, indent=2), flush=True)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
