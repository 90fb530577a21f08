"""Long-run schemathesis fuzzing of a gateway against its own OpenAPI document (the bounded
run is tests/front/test_schema.py; the shared machinery is tests/support/schema_cases.py).

    python benches/stress/schema_fuzz.py  # serve --workers 1, 1000 per operation
    python benches/stress/schema_fuzz.py --examples 200 --workers 0 --seed 7
    python benches/stress/schema_fuzz.py --url http://127.0.0.1:8000  # a gateway already running

Positive (schema-valid) and negative (schema-breaking) requests to every operation; fails on
any undocumented status, content type, body or header, or on a server error other than the
upstream failures 502/503/504. Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from support.procs import ServerProcess, free_port
from support.schema_cases import fuzz_all


def run(url: str, examples: int, seed: int | None) -> list[str]:
    failures: list[str] = []
    for negative in (False, True):
        started = time.monotonic()
        found = fuzz_all(url, examples, seed, negative=negative)
        mode = "negative" if negative else "positive"
        print(f"{mode}: {len(found)} failing operations in {time.monotonic() - started:.1f} s")
        failures += found
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=1000, help="per operation and mode")
    parser.add_argument("--seed", type=int, default=None, help="deterministic generation")
    parser.add_argument("--workers", type=int, default=1, help="for the gateway started here")
    parser.add_argument("--url", default=None, help="fuzz a running gateway instead")
    args = parser.parse_args()
    if args.url:
        failures = run(args.url.rstrip("/"), args.examples, args.seed)
    else:
        port = free_port()
        argv = ["serve", "--port", str(port), "--workers", str(args.workers)]
        with ServerProcess(argv, port) as gateway:
            failures = run(gateway.url, args.examples, args.seed)
    for failure in failures:
        print(f"\n{failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
