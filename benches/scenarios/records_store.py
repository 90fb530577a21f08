"""Durable records (`serve --records-dir`): what they cost and what they buy, each scenario
comparing configurations side by side in one run.

    python benches/scenarios/records_store.py  # all scenarios, full size (~4 min)
    python benches/scenarios/records_store.py --quick  # small sizes (a smoke run, ~1 min)
    python benches/scenarios/records_store.py --only get,recovery  # some scenarios (names below)

stdout carries one JSON document (also written to --json PATH if given); progress and a
short human table go to stderr. Every gateway is `serve --workers 2` with its embedded mock
engine (deterministic per request `seed`); records directories are temporary ones under /tmp,
removed at the end, like every process started here. Each scenario records the 1-minute load
average around it: other jobs on a shared machine move these figures.

Scenarios:
  cpu       8 concurrent sessions x 12 R3 turns (R3_MOCK, 500-word prompt: ~11-18 MiB of
            base64 R3 per record) on four gateways side by side: in memory (no --records-dir)
            and --records-durability none / flush / fsync (records resident: default
            --records-memory). A full-size warm-up load each, then 5 rounds in alternating
            order: gateway CPU (router + workers, utime + stime from /proc/PID/stat; the
            workers' stime apart) per turn, turns/s, latency, MiB written; medians.
  get       the same sessions (same seeds) on two gateways: records resident (default
            --records-memory) vs --records-memory 0 (every body read from its file), the
            latter also with the files evicted from the page cache first (fsync +
            POSIX_FADV_DONTNEED on those files only). Big R3 sessions (~110 MiB): MiB/s and
            GETs/s one at a time and all 4 at once (curl readers); small sessions (no R3, 2
            turns): GETs/s at concurrency 8 and gateway CPU per GET. The workers' read bytes
            (/proc/PID/io rchar) confirm where the bodies came from. 5 passes, medians.
  recovery  ~1 GiB of R3 records in 4 sessions of worker 0, and 1000 small sessions x 2 turns
            (no R3) on a second gateway: SIGKILL worker 0 (warm page cache, then cold) and
            time kill -> ready on /health against a worker with nothing to recover; the
            worker's own "recovered ... in X s" line gives the recovery time (s per GiB, s per
            1000 sessions). Then whole-gateway restarts on the same directories, one at a
            time, vs the start of a gateway on an empty one (--quick: the small one only).
  memory    --records-memory 64MiB with ~1 GiB of records in worker 0's shard: worker VmRSS
            at the start, after writing everything, during and after a full GET of every
            session (bound: start + 64 MiB + 100 MiB), and every GET body's SHA-256 compared
            with a GET of the same session taken right after it was written, while its
            records were still resident (rchar: ~0 bytes read from the files then).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_dataplane import (
    R3_MOCK,
    cpu_seconds,
    curl_get,
    gateway,
    pct,
    process_roles,
    rss_mib,
)

from sessiongate.http.client import HttpClient
from sessiongate.primitives import shard_index, shard_key
from support.procs import ServerProcess, free_port

T = TypeVar("T")
MIB = 2**20
GIB = 2**30
WORKERS = 2
# R3_MOCK: 512 layers x top-8 x 4 bytes = 16 KiB of R3 per token. A 500-word prompt is ~500
# tokens: ~8 MiB of R3 per turn, ~10.7 MiB as the base64 the record keeps, growing a little
# each turn as the conversation does.
R3_ARGS = ("--r3", "--mock-args", R3_MOCK)
RECOVERED = re.compile(
    r"(?P<label>[\w -]+): recovered (?P<sessions>\d+) sessions, (?P<turns>\d+) turns, "
    r"(?P<mib>[\d.]+) MiB from (?P<path>\S+) in (?P<seconds>[\d.]+) s "
    r"\((?P<torn>\d+) torn tails dropped\)"
)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def prompt_of(words: int) -> str:
    return " ".join(["word"] * words)


# -- records directories and the page cache --------------------------------------------------


@contextmanager
def records_dir(tag: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix=f"sg-records-bench-{tag}-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def record_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.rec"))


def dir_bytes(root: Path) -> int:
    total = 0
    for path in record_files(root):
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_size
    return total


def evict(root: Path) -> None:
    """Drop these files (only) from the page cache: the next read comes from the disk.
    Dirty pages cannot be dropped, so each file is fsynced first."""
    for path in record_files(root):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_mib(root: Path) -> float | None:
    """MiB of the files still in the page cache (util-linux fincore), None without it."""
    files = [str(path) for path in record_files(root)]
    if not files or shutil.which("fincore") is None:
        return None
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", *files],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return round(sum(int(line) for line in out.split() if line.isdigit()) / MIB, 1)


def wait_written(root: Path, timeout: float = 30.0) -> None:
    """Until the directory's size stops growing (--records-durability none writes after the
    reply; its writer's CPU belongs to the turns)."""
    deadline = time.monotonic() + timeout
    size = dir_bytes(root)
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = dir_bytes(root)
        if now == size:
            return
        size = now


# -- the gateway's processes -------------------------------------------------------------------


def health(gw: ServerProcess) -> dict[str, Any]:
    document: dict[str, Any] = httpx.get(gw.url + "/health", timeout=10).json()
    return document


def worker_pid(gw: ServerProcess, index: int) -> int:
    return int(health(gw)["workers"][index]["pid"])


def role_cpu(gw: ServerProcess) -> dict[str, float]:
    """CPU seconds so far of the router and of the workers (not the mock engine)."""
    roles = process_roles(gw)
    return {
        "router": sum(map(cpu_seconds, roles["router"])),
        "workers": sum(map(cpu_seconds, roles["workers"])),
    }


def system_seconds(gw: ServerProcess) -> float:
    """The workers' kernel-mode CPU seconds (stime: writes into the page cache, fsync)."""
    total = 0
    for pid in process_roles(gw)["workers"]:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def file_reads(pids: list[int]) -> int:
    """Bytes these processes have read with read/pread so far (/proc/PID/io rchar): during
    a GET, a worker reads nothing else of size (its requests are a few hundred bytes), so the
    delta says whether the records came from their files or from memory."""
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("rchar:"):
                total += int(line.split()[1])
    return total


def recovered_lines(gw: ServerProcess) -> list[dict[str, Any]]:
    return [
        {
            "label": match["label"].strip(),
            "sessions": int(match["sessions"]),
            "turns": int(match["turns"]),
            "mib": float(match["mib"]),
            "seconds": float(match["seconds"]),
            "torn_tails": int(match["torn"]),
        }
        for match in RECOVERED.finditer(gw.output())
    ]


def wait_line(gw: ServerProcess, seen: int, timeout: float = 10.0) -> dict[str, Any] | None:
    """The first `recovered` line after the first `seen` ones."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = recovered_lines(gw)
        if len(lines) > seen:
            return lines[seen]
        time.sleep(0.05)
    return None


def kill_worker(gw: ServerProcess, index: int, timeout: float = 300.0) -> dict[str, Any]:
    """SIGKILL worker `index`; seconds until /health is 200 with its replacement up, and the
    replacement's `recovered` line (None when it had nothing to recover)."""
    old = worker_pid(gw, index)
    seen = len(recovered_lines(gw))
    started = time.perf_counter()
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while True:
        if time.monotonic() > deadline:
            raise RuntimeError(f"worker {index} not back after {timeout} s:\n{gw.output()[-3000:]}")
        try:
            reply = httpx.get(gw.url + "/health", timeout=2)
        except httpx.HTTPError:
            reply = None
        if reply is not None and reply.status_code == 200:
            state = reply.json()["workers"][index]
            if state.get("pid") not in (None, old) and state.get("state") == "up":
                break
        time.sleep(0.01)
    ready = time.perf_counter() - started
    line = wait_line(gw, seen, timeout=2.0)
    return {"kill_to_ready_s": round(ready, 3), "line": line}


@contextmanager
def timed_gateway(*args: str) -> Iterator[tuple[ServerProcess, float]]:
    """A gateway and the seconds from spawning `serve` to /health answering 200."""
    port = free_port()
    started = time.perf_counter()
    with ServerProcess(["serve", "--port", str(port), *args], port, timeout=600) as proc:
        yield proc, time.perf_counter() - started


def start_gateways(stack: ExitStack, specs: dict[str, list[str]]) -> dict[str, ServerProcess]:
    """`serve` gateways started at the same time (each start mostly waits on its children:
    side by side they take little more than one), stopped when `stack` closes."""
    procs: dict[str, ServerProcess] = {}
    for name, args in specs.items():
        port = free_port()
        procs[name] = ServerProcess(["serve", "--port", str(port), *args], port, timeout=600)
        stack.push(procs[name])  # its __exit__: stop (a no-op before start) and close the log
    with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:
        for future in [pool.submit(proc.start) for proc in procs.values()]:
            future.result()
    return procs


class RssSampler:
    """VmRSS of some processes every 20 ms on a thread, tagged with the current phase."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.phase = "start"
        self.peaks: dict[str, dict[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, pid in self.pids.items():
                with contextlib.suppress(OSError):
                    value = rss_mib(pid)
                    peaks = self.peaks.setdefault(self.phase, {})
                    peaks[name] = max(peaks.get(name, 0.0), value)
            self._stop.wait(0.02)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# -- HTTP driving --------------------------------------------------------------------------------


class Api:
    """JSON calls on the gateway's own lean client (httpx costs ~1-2 ms of CPU per request,
    which would compete with the gateway on 2 cores)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = HttpClient()

    async def call(self, method: str, path: str, document: object = None) -> tuple[int, bytes]:
        body = None if document is None else json.dumps(document).encode()
        headers = {"content-type": "application/json"}
        async with self.client.request(method, self.url + path, headers=headers, body=body) as r:
            return r.status, await r.read()

    async def create(self, worker: int | None = None) -> str:
        """A new session id (on worker `worker` when given: others are deleted)."""
        while True:
            status, body = await self.call("POST", "/sessions")
            if status != 200:
                raise RuntimeError(f"POST /sessions: {status} {body[:200]!r}")
            sid: str = json.loads(body)["session_id"]
            if worker is None or shard_index(shard_key(sid), WORKERS) == worker:
                return sid
            await self.call("DELETE", f"/sessions/{sid}")

    async def turns(
        self,
        sid: str,
        count: int,
        prompt: str,
        seed: int,
        latencies: list[float] | None = None,
        messages: list[dict[str, Any]] | None = None,
    ) -> list[dict[str, Any]]:
        """`count` tool-loop turns of session `sid`; the messages so far (to go on)."""
        if messages is None:
            messages = [{"role": "user", "content": prompt}]
        for _ in range(count):
            started = time.perf_counter()
            status, body = await self.call(
                "POST",
                f"/sessions/{sid}/v1/chat/completions",
                {"messages": messages, "seed": seed, "max_tokens": 24},
            )
            if latencies is not None:
                latencies.append(time.perf_counter() - started)
            if status != 200:
                raise RuntimeError(f"turn of {sid}: {status} {body[:300]!r}")
            message = json.loads(body)["choices"][0]["message"]
            messages.append({k: v for k, v in message.items() if v is not None})
            messages.append({"role": "tool", "content": f"observation {len(messages)}"})
        return messages

    async def digest(self, sid: str) -> tuple[int, str]:
        """GET /sessions/{sid}: its size and SHA-256, read as it streams."""
        sha = hashlib.sha256()
        size = 0
        async with self.client.request("GET", f"{self.url}/sessions/{sid}") as reply:
            if reply.status != 200:
                raise RuntimeError(f"GET {sid}: {reply.status}")
            async for chunk in reply.iter_raw():
                sha.update(chunk)
                size += len(chunk)
        return size, sha.hexdigest()

    async def get_size(self, sid: str) -> int:
        size = 0
        async with self.client.request("GET", f"{self.url}/sessions/{sid}") as reply:
            if reply.status != 200:
                raise RuntimeError(f"GET {sid}: {reply.status}")
            async for chunk in reply.iter_raw():
                size += len(chunk)
        return size

    async def delete_all(self, sids: list[str]) -> None:
        for sid in sids:
            await self.call("DELETE", f"/sessions/{sid}")

    async def aclose(self) -> None:
        await self.client.aclose()


async def with_api(url: str, work: Callable[[Api], Awaitable[T]]) -> T:
    """Run `work(api)` on a fresh Api and close it."""
    api = Api(url)
    try:
        return await work(api)
    finally:
        await api.aclose()


async def curl_size(url: str) -> int:
    """A GET read by curl (e2e_dataplane.curl_get); the bytes received."""
    code, size = await curl_get(url)
    if code != 200:
        raise RuntimeError(f"GET {url}: {code}")
    return size


async def curl_gets(base: str, sids: list[str], concurrent: bool) -> tuple[int, float]:
    """GET every session (one at a time, or all at once): total bytes and seconds."""
    started = time.perf_counter()
    if concurrent:
        sizes = await asyncio.gather(*(curl_size(f"{base}/sessions/{sid}") for sid in sids))
    else:
        sizes = [await curl_size(f"{base}/sessions/{sid}") for sid in sids]
    return sum(sizes), time.perf_counter() - started


def build_parallel(
    url: str, sessions: int, turns: int, prompt: str, worker: int | None = None
) -> tuple[list[str], list[float], float]:
    """`sessions` concurrent sessions (seeds 0..) of `turns` turns: ids, turn latencies and
    the seconds of the turns (creates excluded)."""
    latencies: list[float] = []

    async def work(api: Api) -> tuple[list[str], float]:
        sids = [await api.create(worker) for _ in range(sessions)]
        started = time.perf_counter()
        await asyncio.gather(
            *(api.turns(sid, turns, prompt, seed, latencies) for seed, sid in enumerate(sids))
        )
        return sids, time.perf_counter() - started

    sids, elapsed = asyncio.run(with_api(url, work))
    return sids, latencies, elapsed


def delete_all(url: str, sids: list[str]) -> None:
    asyncio.run(with_api(url, lambda api: api.delete_all(sids)))


# -- scenario: cpu ----------------------------------------------------------------------------


def scenario_cpu(quick: bool) -> dict[str, Any]:
    sessions = 8
    turns = 2 if quick else 12
    prompt = prompt_of(200 if quick else 500)
    rounds = 1 if quick else 5  # 5: single rounds swing ~2x on a shared 2-core VM
    configs = ("memory", "none", "flush", "fsync")
    per_round: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    with ExitStack() as stack:
        specs: dict[str, list[str]] = {}
        dirs: dict[str, Path] = {}
        for name in configs:
            specs[name] = ["--workers", "2", *R3_ARGS]
            if name != "memory":
                dirs[name] = stack.enter_context(records_dir(f"cpu-{name}"))
                specs[name] += ["--records-dir", str(dirs[name]), "--records-durability", name]
        gateways = start_gateways(stack, specs)
        # Warm-up at full size, not measured: imports, connections, and the first touch of
        # the memory the records take (docs/performance.md: it dominates a fresh gateway's
        # first R3 session), which later rounds reuse.
        for gw in gateways.values():
            sids, _, _ = build_parallel(gw.url, sessions, 1 if quick else turns, prompt)
            delete_all(gw.url, sids)
        for round_index in range(rounds):
            order = configs if round_index % 2 == 0 else configs[::-1]
            for name in order:
                gw = gateways[name]
                written_before = dir_bytes(dirs[name]) if name in dirs else 0
                before = role_cpu(gw)
                system_before = system_seconds(gw)
                sids, latencies, elapsed = build_parallel(gw.url, sessions, turns, prompt)
                if name in dirs:
                    wait_written(dirs[name])
                after = role_cpu(gw)
                system = system_seconds(gw) - system_before
                written = dir_bytes(dirs[name]) - written_before if name in dirs else 0
                count = len(latencies)
                per_round[name].append(
                    {
                        "turns": count,
                        "turns_per_s": count / elapsed,
                        "cpu_ms_per_turn": 1000 * sum(after[r] - before[r] for r in after) / count,
                        "router_cpu_ms_per_turn": 1000
                        * (after["router"] - before["router"])
                        / count,
                        "worker_cpu_ms_per_turn": 1000
                        * (after["workers"] - before["workers"])
                        / count,
                        "worker_system_cpu_ms_per_turn": 1000 * system / count,
                        "p50_ms": pct(latencies, 0.5) * 1000,
                        "p99_ms": pct(latencies, 0.99) * 1000,
                        "written_mib_per_turn": written / MIB / count,
                        "write_mib_per_s": written / MIB / elapsed,
                    }
                )
                delete_all(gw.url, sids)
                log(
                    f"cpu round {round_index}: {name}: {count / elapsed:.1f} turns/s, "
                    f"{per_round[name][-1]['cpu_ms_per_turn']:.1f} ms CPU/turn"
                )
    results: dict[str, Any] = {
        "workload": f"{sessions} concurrent sessions x {turns} turns, R3 mock '{R3_MOCK}', "
        f"{len(prompt.split())}-word prompt; a warm-up load, then {rounds} round(s) in "
        "alternating order, medians",
    }
    for name, runs in per_round.items():
        results[name] = {
            key: round(statistics.median(run[key] for run in runs), 2) for key in runs[0]
        }
        results[name]["turns_per_s_rounds"] = [round(run["turns_per_s"], 1) for run in runs]
        results[name]["cpu_ms_per_turn_rounds"] = [round(run["cpu_ms_per_turn"], 1) for run in runs]
    base = results["memory"]
    results["vs_memory"] = {
        name: {
            "cpu_per_turn": round(results[name]["cpu_ms_per_turn"] / base["cpu_ms_per_turn"], 2),
            "turns_per_s": round(results[name]["turns_per_s"] / base["turns_per_s"], 2),
        }
        for name in configs
        if name != "memory"
    }
    return results


# -- scenario: get ----------------------------------------------------------------------------


def scenario_get(quick: bool) -> dict[str, Any]:
    big_sessions = 4
    big_turns = 2 if quick else 8
    prompt = prompt_of(200 if quick else 500)
    small_sessions = 50 if quick else 400
    passes = 1 if quick else 5
    layouts = {"resident": [], "disk": ["--records-memory", "0"]}
    samples: dict[str, list[dict[str, float]]] = {}
    with ExitStack() as stack:
        specs: dict[str, list[str]] = {}
        dirs: dict[str, Path] = {}
        for layout, extra in layouts.items():
            for kind in ("big", "small"):
                name = f"{kind}-{layout}"
                dirs[name] = stack.enter_context(records_dir(f"get-{name}"))
                specs[name] = ["--workers", "2", "--records-dir", str(dirs[name]), *extra]
                if kind == "big":
                    specs[name] += R3_ARGS
        gateways = start_gateways(stack, specs)
        big: dict[str, tuple[ServerProcess, Path, list[str]]] = {}
        small: dict[str, tuple[ServerProcess, Path, list[str]]] = {}
        for layout in layouts:
            gw = gateways[f"big-{layout}"]
            sids, _, _ = build_parallel(gw.url, big_sessions, big_turns, prompt)
            big[layout] = (gw, dirs[f"big-{layout}"], sids)
            gw = gateways[f"small-{layout}"]
            sids = build_small(gw.url, small_sessions, concurrency=8)
            small[layout] = (gw, dirs[f"small-{layout}"], sids)
            log(f"get: built the {layout} sessions")
        variants = [("resident", False), ("disk", False), ("disk", True)]
        for pass_index in range(passes):
            order = variants if pass_index % 2 == 0 else variants[::-1]
            for layout, cold in order:
                name = f"{layout}_cold" if cold else layout
                figures: dict[str, float] = {}
                gw, directory, sids = big[layout]
                for concurrent in (False, True):
                    if cold:
                        evict(directory)
                        figures["cached_mib_after_evict"] = cached_mib(directory) or 0.0
                    workers = process_roles(gw)["workers"]
                    read_before = file_reads(workers)
                    size, elapsed = asyncio.run(curl_gets(gw.url, sids, concurrent))
                    label = "all_at_once" if concurrent else "one_at_a_time"
                    figures[f"big_{label}_read_from_files_share"] = (
                        file_reads(workers) - read_before
                    ) / size
                    figures[f"big_{label}_mib_per_s"] = size / MIB / elapsed
                    figures[f"big_{label}_gets_per_s"] = len(sids) / elapsed
                    figures["big_session_mib"] = size / MIB / len(sids)
                gw, directory, sids = small[layout]
                if cold:
                    evict(directory)
                before = role_cpu(gw)
                count, elapsed, size = asyncio.run(small_gets(gw.url, sids, concurrency=8))
                after = role_cpu(gw)
                figures["small_gets_per_s"] = count / elapsed
                figures["small_get_cpu_ms"] = (
                    1000 * sum(after[r] - before[r] for r in after) / count
                )
                figures["small_session_kib"] = size / 1024 / count
                samples.setdefault(name, []).append(figures)
                log(
                    f"get pass {pass_index}: {name}: "
                    f"{figures['big_one_at_a_time_mib_per_s']:.0f} MiB/s one at a time, "
                    f"{figures['small_gets_per_s']:.0f} small GETs/s"
                )
    results: dict[str, Any] = {
        "workload": f"big: {big_sessions} R3 sessions x {big_turns} turns "
        f"({len(prompt.split())}-word prompt, '{R3_MOCK}'); small: {small_sessions} "
        f"sessions x 2 turns without R3 (GETs at concurrency 8); {passes} pass(es), medians",
    }
    for name, runs in samples.items():
        results[name] = {
            key: round(statistics.median(run[key] for run in runs), 2) for key in runs[0]
        }
    for name in ("disk", "disk_cold"):
        results[f"{name}_vs_resident"] = {
            key: round(results[name][key] / results["resident"][key], 2)
            for key in (
                "big_one_at_a_time_mib_per_s",
                "big_all_at_once_mib_per_s",
                "small_gets_per_s",
            )
        }
    return results


def build_small(url: str, sessions: int, concurrency: int) -> list[str]:
    """`sessions` sessions of 2 small turns each (the default mock: no R3 unless --r3)."""
    sids: list[str] = []

    async def work(api: Api) -> None:
        counter = iter(range(sessions))

        async def loop() -> None:
            for n in counter:
                sid = await api.create()
                await api.turns(sid, 2, f"task {n}: say something", n)
                sids.append(sid)

        await asyncio.gather(*(loop() for _ in range(concurrency)))

    asyncio.run(with_api(url, work))
    return sids


async def small_gets(url: str, sids: list[str], concurrency: int) -> tuple[int, float, int]:
    """GET every session at `concurrency`: count, seconds, bytes."""
    api = Api(url)
    counter = iter(sids)
    sizes: list[int] = []

    async def loop() -> None:
        for sid in counter:
            sizes.append(await api.get_size(sid))

    try:
        started = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    finally:
        await api.aclose()
    return len(sizes), elapsed, sum(sizes)


# -- scenario: recovery ------------------------------------------------------------------------


def build_to_size(
    url: str, shard: Path, target: int, sessions: int, prompt: str, worker: int
) -> tuple[list[str], int]:
    """`sessions` concurrent sessions on `worker`, turns until `shard` holds `target` bytes:
    the ids and the number of turns."""
    turns = 0

    async def work(api: Api) -> list[str]:
        nonlocal turns
        sids = [await api.create(worker) for _ in range(sessions)]

        async def grow(sid: str, seed: int) -> None:
            nonlocal turns
            messages = None
            while dir_bytes(shard) < target:
                messages = await api.turns(sid, 1, prompt, seed, messages=messages)
                turns += 1

        await asyncio.gather(*(grow(sid, seed) for seed, sid in enumerate(sids)))
        return sids

    sids = asyncio.run(with_api(url, work))
    return sids, turns


def recovery_figures(
    kill: dict[str, Any], baseline: dict[str, Any], shard_bytes: int, sessions: int, turns: int
) -> dict[str, Any]:
    """One worker's restart: its `recovered` line, per GiB and per 1000 sessions, and kill ->
    ready against the same for a worker with nothing to recover."""
    line = kill["line"] or {}
    seconds = line.get("seconds")
    figures: dict[str, Any] = {
        "kill_to_ready_s": kill["kill_to_ready_s"],
        "kill_to_ready_over_empty_worker_s": round(
            kill["kill_to_ready_s"] - baseline["kill_to_ready_s"], 3
        ),
        "recovery_s": seconds,
        "shard_mib": round(shard_bytes / MIB, 1),
        "recovered": line or None,
        "recovered_all": line.get("sessions") == sessions and line.get("turns") == turns,
    }
    if seconds is not None:
        figures["recovery_s_per_gib"] = round(seconds * GIB / max(shard_bytes, 1), 3)
        figures["recovery_s_per_1000_sessions"] = round(seconds * 1000 / max(sessions, 1), 3)
    return figures


def scenario_recovery(quick: bool) -> dict[str, Any]:
    """Big R3 shard and many small sessions on two gateways side by side (no load on the one
    while the other's worker restarts); whole-gateway restarts one at a time at the end."""
    target = (64 if quick else 1024) * MIB
    prompt = prompt_of(500)
    small_sessions = 100 if quick else 1000
    results: dict[str, Any] = {}
    with ExitStack() as stack:
        dirs = {
            kind: stack.enter_context(records_dir(f"recovery-{kind}")) for kind in ("big", "small")
        }
        specs = {
            "big": ["--workers", "2", *R3_ARGS, "--records-dir", str(dirs["big"])],
            "small": ["--workers", "2", "--records-dir", str(dirs["small"])],
        }
        with ExitStack() as running:
            gateways = start_gateways(running, specs)
            # A worker with nothing to recover: process start, imports, handshake.
            baseline = {kind: kill_worker(gw, 0) for kind, gw in gateways.items()}

            gw, shard = gateways["big"], dirs["big"] / "worker-0"
            sids, turns = build_to_size(gw.url, shard, target, 4, prompt, worker=0)
            size = dir_bytes(shard)
            log(f"recovery: {len(sids)} sessions, {turns} turns, {size / MIB:.0f} MiB on worker 0")
            before = asyncio.run(with_api(gw.url, lambda api: api.digest(sids[0])))
            warm = kill_worker(gw, 0)
            evict(dirs["big"])
            cached = cached_mib(shard)
            cold = kill_worker(gw, 0)
            after = asyncio.run(with_api(gw.url, lambda api: api.digest(sids[0])))
            figures = {
                cache: recovery_figures(kill, baseline["big"], size, len(sids), turns)
                for cache, kill in (("warm_cache", warm), ("cold_cache", cold))
            }
            for item in figures.values():
                item.pop("recovery_s_per_1000_sessions", None)  # a few big sessions: per GiB
            figures["cold_cache"]["cached_mib_after_evict"] = cached
            results["big"] = {
                "sessions": len(sids),
                "turns": turns,
                "empty_worker_kill_to_ready_s": baseline["big"]["kill_to_ready_s"],
                **figures,
                # Resident before the kills, read from the file after them: the same bytes?
                "get_after_recovery_identical": after == before,
            }

            gw, shard = gateways["small"], dirs["small"] / "worker-0"
            started = time.perf_counter()
            sids = build_small(gw.url, small_sessions, concurrency=16)
            build_s = time.perf_counter() - started
            on_zero = sum(1 for sid in sids if shard_index(shard_key(sid), WORKERS) == 0)
            size = dir_bytes(shard)
            log(f"recovery: {small_sessions} small sessions in {build_s:.1f} s, {on_zero} on 0")
            warm = kill_worker(gw, 0)
            evict(dirs["small"])
            cold = kill_worker(gw, 0)
            figures = {
                cache: recovery_figures(kill, baseline["small"], size, on_zero, 2 * on_zero)
                for cache, kill in (("warm_cache", warm), ("cold_cache", cold))
            }
            for item in figures.values():
                item.pop("recovery_s_per_gib", None)  # ~10 KiB sessions: per 1000 sessions
            results["small"] = {
                "sessions": small_sessions,
                "turns_per_session": 2,
                "sessions_on_worker_0": on_zero,
                "empty_worker_kill_to_ready_s": baseline["small"]["kill_to_ready_s"],
                **figures,
            }
        # Whole-gateway restarts on the same directories (SIGTERM above keeps the files), one
        # at a time; --quick restarts the small one only.
        restarts = ["small"] if quick else ["empty", "big", "small"]
        if "empty" in restarts:
            dirs["empty"] = stack.enter_context(records_dir("recovery-empty"))
            specs["empty"] = ["--workers", "2", *R3_ARGS, "--records-dir", str(dirs["empty"])]
        for kind in restarts:
            with timed_gateway(*specs[kind]) as (gw, start_s):
                restart = {
                    "start_to_ready_s": round(start_s, 2),
                    "lines": recovered_lines(gw),
                    "sessions": health(gw)["sessions"],
                }
            if kind == "empty":
                results["gateway_start_empty_dir_s"] = restart["start_to_ready_s"]
            else:
                results[kind]["gateway_restart"] = restart
            log(f"recovery: gateway restart ({kind}) in {start_s:.1f} s")
    return results


# -- scenario: memory ---------------------------------------------------------------------------


def scenario_memory(quick: bool) -> dict[str, Any]:
    budget_mib = 64
    slack_mib = 100
    target = (192 if quick else 1024) * MIB
    turns_per_session = 3  # ~33 MiB per session: it fits the budget right after it is written
    prompt = prompt_of(500)
    with records_dir("memory") as directory:
        shard = directory / "worker-0"
        args = ["--workers", "2", *R3_ARGS, "--records-dir", str(directory)]
        args += ["--records-memory", f"{budget_mib}MiB"]
        with gateway(*args) as gw:
            worker = worker_pid(gw, 0)
            pids = {"worker0": worker, "router": process_roles(gw)["router"][0]}
            start = {name: rss_mib(pid) for name, pid in pids.items()}
            reference: dict[str, tuple[int, str]] = {}
            with RssSampler(pids) as sampler:
                sampler.phase = "write"

                reference_reads = 0

                async def write(api: Api) -> None:
                    nonlocal reference_reads
                    seed = 0
                    while dir_bytes(shard) < target:
                        sid = await api.create(worker=0)
                        await api.turns(sid, turns_per_session, prompt, seed)
                        # Its records are still resident: the budget spilled older ones first
                        # (file_reads checks that the worker reads ~nothing from its files).
                        read_before = file_reads([worker])
                        reference[sid] = await api.digest(sid)
                        reference_reads += file_reads([worker]) - read_before
                        seed += 1

                started = time.perf_counter()
                asyncio.run(with_api(gw.url, write))
                write_s = time.perf_counter() - started
                time.sleep(1.0)
                after_write = rss_mib(worker)
                log(f"memory: wrote {dir_bytes(shard) / MIB:.0f} MiB in {write_s:.1f} s")
                sampler.phase = "get"

                async def get_all(api: Api) -> dict[str, tuple[int, str]]:
                    return {sid: await api.digest(sid) for sid in reference}

                started = time.perf_counter()
                read_before = file_reads([worker])
                fetched = asyncio.run(with_api(gw.url, get_all))
                get_reads = file_reads([worker]) - read_before
                get_s = time.perf_counter() - started
                sampler.phase = "get_concurrent"

                async def get_concurrent(api: Api) -> dict[str, tuple[int, str]]:
                    sids = list(reference)
                    found: dict[str, tuple[int, str]] = {}
                    for at in range(0, len(sids), 4):
                        batch = sids[at : at + 4]
                        for sid, result in zip(
                            batch,
                            await asyncio.gather(*(api.digest(s) for s in batch)),
                            strict=True,
                        ):
                            found[sid] = result
                    return found

                fetched_concurrent = asyncio.run(with_api(gw.url, get_concurrent))
                time.sleep(1.0)
                sampler.phase = "after_get"
                time.sleep(0.2)
            after_get = rss_mib(worker)
            same_worker = worker_pid(gw, 0) == worker
        total = sum(size for size, _ in reference.values())
        bound = start["worker0"] + budget_mib + slack_mib
        peaks = sampler.peaks
        worker_peaks = {phase: round(p.get("worker0", 0.0), 1) for phase, p in peaks.items()}
        mismatched = [sid for sid in reference if fetched.get(sid) != reference[sid]]
        mismatched_concurrent = [
            sid for sid in reference if fetched_concurrent.get(sid) != reference[sid]
        ]
        return {
            "budget_mib": budget_mib,
            "sessions": len(reference),
            "turns": len(reference) * turns_per_session,
            "records_on_disk_mib": round(dir_bytes(shard) / MIB, 1),
            "get_total_mib": round(total / MIB, 1),
            "write_s": round(write_s, 1),
            "full_get_s": round(get_s, 1),
            "full_get_mib_per_s": round(total / MIB / get_s, 1),
            # Bytes the worker read from its files / bytes of the GET bodies.
            "reference_gets_read_from_files_share": round(reference_reads / total, 3),
            "full_get_read_from_files_share": round(get_reads / total, 3),
            "worker_rss_mib": {
                "start": round(start["worker0"], 1),
                "after_write": round(after_write, 1),
                "peak_during_write": worker_peaks.get("write"),
                "peak_during_get": worker_peaks.get("get"),
                "peak_during_get_4_at_once": worker_peaks.get("get_concurrent"),
                "after_get": round(after_get, 1),
            },
            "router_rss_mib": {
                "start": round(start["router"], 1),
                "peak": round(max(p.get("router", 0.0) for p in peaks.values()), 1),
            },
            "worker_rss_bound_mib": round(bound, 1),
            "worker_rss_within_bound": max(
                after_write, after_get, *(p.get("worker0", 0.0) for p in peaks.values())
            )
            <= bound,
            "worker_rss_within_bound_after_write_and_get": max(after_write, after_get) <= bound,
            "all_bytes_match": not mismatched and not mismatched_concurrent,
            "mismatched_sessions": len(mismatched) + len(mismatched_concurrent),
            "worker_never_restarted": same_worker,
        }


# -- main ---------------------------------------------------------------------------------------


SCENARIOS = {
    "cpu": scenario_cpu,
    "get": scenario_get,
    "recovery": scenario_recovery,
    "memory": scenario_memory,
}


def table(figures: dict[str, Any]) -> str:
    """A short human summary of the headline figures."""
    rows: list[str] = []
    if "cpu" in figures:
        rows.append(
            "cpu: config   turns/s  CPU ms/turn  worker ms/turn (sys)  p50 ms  MiB written/turn"
        )
        for name in ("memory", "none", "flush", "fsync"):
            c = figures["cpu"][name]
            rows.append(
                f"     {name:<7} {c['turns_per_s']:>8.1f} {c['cpu_ms_per_turn']:>12.1f} "
                f"{c['worker_cpu_ms_per_turn']:>15.1f} ({c['worker_system_cpu_ms_per_turn']:>4.1f})"
                f" {c['p50_ms']:>7.0f} {c['written_mib_per_turn']:>17.1f}"
            )
    if "get" in figures:
        rows.append("get: layout       big MiB/s (1 / all)  big GETs/s (1 / all)  small GETs/s")
        for name in ("resident", "disk", "disk_cold"):
            g = figures["get"][name]
            rows.append(
                f"     {name:<11} {g['big_one_at_a_time_mib_per_s']:>9.0f} / "
                f"{g['big_all_at_once_mib_per_s']:<9.0f} {g['big_one_at_a_time_gets_per_s']:>9.2f}"
                f" / {g['big_all_at_once_gets_per_s']:<9.2f} {g['small_gets_per_s']:>12.0f}"
            )
    if "recovery" in figures:
        recovery = figures["recovery"]
        for kind, unit, key in (
            ("big", "s/GiB", "recovery_s_per_gib"),
            ("small", "s/1000 sessions", "recovery_s_per_1000_sessions"),
        ):
            r = recovery[kind]
            for cache in ("warm_cache", "cold_cache"):
                c = r[cache]
                rows.append(
                    f"recovery {kind:<5} {cache:<10}: {c['shard_mib']:>7.1f} MiB, "
                    f"{c['recovery_s']} s ({c.get(key)} {unit}), kill->ready "
                    f"{c['kill_to_ready_s']} s (empty worker {r['empty_worker_kill_to_ready_s']} s)"
                )
            if "gateway_restart" in r:
                restart_s = r["gateway_restart"]["start_to_ready_s"]
                rows.append(
                    f"recovery {kind:<5} gateway restart: {restart_s} s "
                    f"(empty dir: {recovery.get('gateway_start_empty_dir_s', '-')} s)"
                )
    if "memory" in figures:
        m = figures["memory"]
        w = m["worker_rss_mib"]
        rows.append(
            f"memory: {m['records_on_disk_mib']} MiB on disk, worker RSS start {w['start']} / "
            f"after write {w['after_write']} / peak GET {w['peak_during_get']} / after GET "
            f"{w['after_get']} MiB (bound {m['worker_rss_bound_mib']}): "
            f"within={m['worker_rss_within_bound']}, bytes match={m['all_bytes_match']}"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument(
        "--only",
        type=lambda text: [name.strip() for name in text.split(",") if name.strip()],
        action="extend",
        help=f"comma-separated scenarios of {', '.join(SCENARIOS)}",
    )
    parser.add_argument("--json", type=Path, help="also write the JSON document here")
    args = parser.parse_args()
    names = args.only or list(SCENARIOS)
    unknown = [name for name in names if name not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    figures: dict[str, Any] = {
        "machine": {"cores": os.cpu_count()},
        "quick": args.quick,
    }
    started = time.perf_counter()
    for name in names:
        begun = time.perf_counter()
        log(f"scenario {name}")
        # Other jobs may share the machine: the load around a scenario says how noisy it was.
        load_before = os.getloadavg()[0]
        figures[name] = SCENARIOS[name](args.quick)
        figures[name]["scenario_s"] = round(time.perf_counter() - begun, 1)
        figures[name]["loadavg_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    figures["total_s"] = round(time.perf_counter() - started, 1)
    document = json.dumps(figures, indent=2)
    print(table(figures), file=sys.stderr, flush=True)
    print(document, flush=True)
    if args.json:
        args.json.write_text(document + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
