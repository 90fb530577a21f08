"""Long-run fuzzing of the wire primitives (the bounded run is tests/test_fuzz.py).

    python benches/fuzz.py                         # 1M frame streams, 1M envelopes, 200k replies
    python benches/fuzz.py --cases 10000           # every target, 10k cases each
    python benches/fuzz.py --only reply --seed 7

Each case runs the Rust core and its Python twin on one generated input (tests/fuzz_cases.py)
and fails on any exception other than the documented one, or on any disagreement; the
failure names the target, seed and case index, so `--only T --seed S --start I --cases 1`
replays it. Figures go to docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fuzz_cases import TARGETS, FuzzFailure, run

DEFAULT_CASES = {"frames": 1_000_000, "envelope": 1_000_000, "reply": 200_000}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=sorted(TARGETS), action="append")
    parser.add_argument("--cases", type=int, help="cases per target (default: per target)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--start", type=int, default=0, help="first case index (to replay one)")
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
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
