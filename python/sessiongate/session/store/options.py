"""Command-line options of the records store, shared by `serve`, the supervised workers and
`sessiongate worker`: declared once, forwarded to workers as argv (docs/deployment.md)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sessiongate.session.limit_options import AUTO, memory_option
from sessiongate.session.store.records_store import DURABILITIES, MANIFEST, StoreSettings


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("durable records (docs/deployment.md)")
    group.add_argument(
        "--records-dir",
        default=None,
        metavar="DIR",
        help="persist every session and turn record under DIR and recover them when a "
        "worker restarts (serve: one DIR/worker-N per worker); default: in memory only",
    )
    group.add_argument(
        "--records-durability",
        choices=DURABILITIES,
        default=None,
        help="when a turn is acknowledged: none (queued for writing; a worker crash may lose "
        "the last turns), flush (written to the OS before the reply: survives a worker "
        "crash; default), fsync (on the disk before the reply: survives a host crash)",
    )
    group.add_argument(
        "--records-memory",
        default=None,
        metavar="BYTES",
        help="with --records-dir, record bytes a worker keeps in RAM; older records are read "
        "from their files (auto: as --max-records-bytes auto; K/M/G suffixes)",
    )
    group.add_argument(
        "--records-shards", type=int, default=0, help=argparse.SUPPRESS
    )  # serve -> its workers: how many shards the directory is split into


def memory_budget(args: argparse.Namespace, workers: int = 1) -> int:
    return memory_option(args.records_memory or AUTO, "--records-memory", workers)


def check_store_options(args: argparse.Namespace) -> None:
    """The store's options mean nothing without a directory: say so instead of ignoring."""
    if args.records_dir:
        return
    given = [
        flag
        for flag, value in (
            ("--records-durability", args.records_durability),
            ("--records-memory", args.records_memory),
        )
        if value is not None
    ]
    if given:
        raise SystemExit(f"{' and '.join(given)} apply with --records-dir only")


def store_settings(args: argparse.Namespace, index: int | None) -> StoreSettings | None:
    """The worker's store: `index` is its shard under a supervisor (DIR/worker-N), None for
    a standalone `sessiongate worker`, which owns DIR itself."""
    check_store_options(args)
    if not args.records_dir:
        return None
    directory = Path(args.records_dir)
    shard = None
    if index is not None:
        directory = directory / f"worker-{index}"
        shard = f"{index}/{max(1, args.records_shards)}"
    return StoreSettings(
        directory=directory,
        durability=args.records_durability or "flush",
        memory_budget=memory_budget(args),
        shard=shard,
    )


def check_layout(records_dir: Path, workers: int) -> None:
    """Refuse a records directory written by a different number of workers: sessions are
    placed by the worker count, so its shards would be served by the wrong workers."""
    try:  # before any worker starts: a bad directory is one clear message, not N crashes
        records_dir.mkdir(parents=True, exist_ok=True)
        probe = records_dir / ".write-check"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise SystemExit(f"--records-dir {records_dir}: {exc}") from None
    found = sorted(p.name for p in records_dir.glob("worker-*") if p.is_dir())
    wanted = {f"worker-{index}" for index in range(workers)}
    extra = [name for name in found if name not in wanted]
    mismatched = []
    for name in found:
        manifest = records_dir / name / MANIFEST
        if name in wanted and manifest.exists():
            try:
                shard = json.loads(manifest.read_text()).get("shard")
            except (OSError, ValueError, AttributeError) as exc:
                raise SystemExit(f"--records-dir {records_dir}: {manifest}: {exc}") from None
            if shard not in (None, f"{name.removeprefix('worker-')}/{workers}"):
                mismatched.append(f"{name} is shard {shard}")
    if extra or mismatched:
        detail = "; ".join([*(f"{name} is not a worker now" for name in extra), *mismatched])
        raise SystemExit(
            f"--records-dir {records_dir} was written by a different number of workers "
            f"({detail}): sessions are placed by the worker count, so restart with the same "
            "--workers (or use a new directory)"
        )


def store_argv(args: argparse.Namespace, local_workers: int) -> list[str]:
    """These options for `serve`'s workers (`auto` split over the local workers)."""
    if not args.records_dir:
        return []
    check_layout(Path(args.records_dir), local_workers)
    return [
        "--records-dir",
        str(Path(args.records_dir).resolve()),
        "--records-durability",
        args.records_durability or "flush",
        "--records-memory",
        str(memory_budget(args, local_workers)),
        "--records-shards",
        str(local_workers),
    ]
