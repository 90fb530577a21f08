"""The records store's settings from the records options (docs/deployment.md, "Durable
records"): checked once, each supervised worker given its shard. The options are declared
in config/records.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import cast

from sessiongate.config.fields import flag_of
from sessiongate.config.records import AUTO, RecordsConfig
from sessiongate.session.limit_options import memory_option
from sessiongate.session.store.records_store import MANIFEST, Durability, StoreSettings


def memory_budget(records: RecordsConfig, workers: int = 1) -> int:
    return memory_option(records.memory or AUTO, flag_of(RecordsConfig, "memory"), workers)


def check_store_options(records: RecordsConfig) -> None:
    """The store's options mean nothing without a directory: say so instead of ignoring."""
    if records.dir:
        return
    given = [
        flag
        for flag, value in (
            (flag_of(RecordsConfig, "durability"), records.durability),
            (flag_of(RecordsConfig, "memory"), records.memory),
        )
        if value is not None
    ]
    if given:
        raise SystemExit(f"{' and '.join(given)} apply with --records-dir only")


def store_settings(records: RecordsConfig, index: int | None) -> StoreSettings | None:
    """The worker's store: `index` is its shard under a supervisor (DIR/worker-N), None for
    a standalone `sessiongate worker`, which owns DIR itself."""
    check_store_options(records)
    if not records.dir:
        return None
    directory = Path(records.dir)
    shard = None
    if index is not None:
        directory = directory / f"worker-{index}"
        shard = f"{index}/{max(1, records.shards)}"
    return StoreSettings(
        directory=directory,
        durability=cast(Durability, records.durability or "flush"),
        memory_budget=memory_budget(records),
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


def records_for_workers(records: RecordsConfig, local_workers: int) -> RecordsConfig:
    """The records options `serve` hands its workers: the directory absolute and checked
    (SystemExit when another worker count wrote it), `auto` memory split over the local
    workers, the shard count."""
    if not records.dir:
        return records
    check_layout(Path(records.dir), local_workers)
    return dataclasses.replace(
        records,
        dir=str(Path(records.dir).resolve()),
        durability=records.durability or "flush",
        memory=str(memory_budget(records, local_workers)),
        shards=local_workers,
    )
