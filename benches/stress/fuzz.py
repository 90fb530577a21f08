"""Long-run fuzzing of the wire primitives (the bounded run is tests/primitives/test_fuzz.py).

    python benches/stress/fuzz.py                # 1M frame streams, 1M envelopes, 200k replies
    python benches/stress/fuzz.py --cases 10000  # every target, 10k cases each
    python benches/stress/fuzz.py --only reply --seed 7
    python benches/stress/fuzz.py --http 10000   # also 10k hostile HTTP requests to a gateway

Each case runs the Rust core and its Python twin on one generated input
(tests/support/fuzz_cases.py) and fails on any exception other than the documented one, or
on any disagreement; the failure names the target, seed and case index, so
`--only T --seed S --start I --cases 1` replays it. Figures go to docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import random

import httpx

from support.fuzz_cases import TARGETS, FuzzFailure, http_case, run
from support.procs import ServerProcess, free_port

DEFAULT_CASES = {"frames": 1_000_000, "envelope": 1_000_000, "reply": 200_000}


def http_run(cases: int, seed: int) -> dict[str, object]:
    """`cases` hostile requests to a fresh `serve --workers 2` (mock engine), /health polled
    every 100 requests: counts, failures, /health max latency."""
    port = free_port()
    argv = ["serve", "--port", str(port), "--workers", "2"]
    argv += ["--header-timeout", "2", "--body-timeout", "1"]
    counts = {"ok": 0, "err": 0}
    failures: list[str] = []
    health_max = 0.0
    with ServerProcess(argv, port, timeout=60) as gateway:
        for index in range(cases):
            try:
                _, kind = http_case(random.Random(f"http:{seed}:{index}"), port, timeout=20)
                counts[kind] += 1
            except FuzzFailure as exc:
                failures.append(f"case {index}: {exc}")
            if index % 100 == 0:
                started = time.perf_counter()
                status = httpx.get(gateway.url + "/health", timeout=5).status_code
                health_max = max(health_max, time.perf_counter() - started)
                if status != 200:
                    failures.append(f"case {index}: /health answered {status}")
    return {
        "target": "http",
        "cases": cases,
        **counts,
        "failures": len(failures),
        "first_failures": failures[:5],
        "health_max_ms": round(1000 * health_max, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=sorted(TARGETS), action="append")
    parser.add_argument("--cases", type=int, help="cases per target (default: per target)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--start", type=int, default=0, help="first case index (to replay one)")
    parser.add_argument("--http", type=int, default=0, help="hostile HTTP requests (0: none)")
    args = parser.parse_args()
    failed = False
    for target in args.only or sorted(TARGETS):
        cases = args.cases or DEFAULT_CASES[target]
        started = time.perf_counter()
        try:
            counts = run(target, args.seed, cases, args.start)
        except FuzzFailure as exc:
            print(f"FAIL {exc}", flush=True)
            failed = True
            continue
        elapsed = time.perf_counter() - started
        report = {"target": target, "cases": cases, **counts, "crashes": 0}
        report["seconds"] = round(elapsed, 1)
        print(json.dumps(report), flush=True)
    if args.http:
        started = time.perf_counter()
        report = http_run(args.http, args.seed)
        report["seconds"] = round(time.perf_counter() - started, 1)
        print(json.dumps(report), flush=True)
        failed = failed or bool(report["failures"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
