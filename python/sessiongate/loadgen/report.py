"""Outputs of a run: the summary table, `--json` (summary), `--raw` (one line per request)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from sessiongate.loadgen.stats import RequestRecord


def _ms(dist: dict[str, Any] | None, key: str) -> str:
    if not dist:
        return "-"
    return f"{dist[key]:.1f} ms"


def _num(value: float | int | None, fmt: str = "{:,.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def summary_table(summary: dict[str, Any], title: str = "sessiongate bench") -> Table:
    interrupted = " (interrupted: partial)" if summary.get("interrupted") else ""
    table = Table(title=title + interrupted)
    table.add_column("metric")
    table.add_column("value", justify="right")
    run = summary.get("run", {})
    if run:
        table.add_row("target", f"{run.get('target')} {run.get('url')}")
        if run.get("session_routing"):
            table.add_row("session routing", str(run["session_routing"]))
    s = summary["sessions"]
    table.add_row("sessions completed / failed", f"{s['completed']:,} / {s['failed']:,}")
    table.add_row("measured time", f"{summary['measured_s']:.2f} s")
    t = summary["turns"]
    table.add_row("turns ok / sent", f"{t['ok']:,} / {t['sent']:,}")
    table.add_row("turns/s", _num(t["per_s"]))
    k = summary["tokens"]
    table.add_row("completion tokens/s", _num(k["completion_per_s"]))
    table.add_row("total tokens/s (prompt + completion)", _num(k["total_per_s"]))
    lat = summary["latency_ms"]
    for q in ("p50", "p90", "p99"):
        table.add_row(f"request latency {q}", _ms(lat, q))
    ttft = summary["ttft_ms"]
    if ttft:
        for q in ("p50", "p90", "p99"):
            table.add_row(f"TTFT {q}", _ms(ttft, q))
    get = summary["records_get"]
    if get:
        table.add_row(
            "records GET p50 / p99",
            f"{_ms(get['latency_ms'], 'p50')} / {_ms(get['latency_ms'], 'p99')}",
        )
        table.add_row(
            "records GET bytes total / mean", f"{get['bytes_total']:,} / {get['bytes_mean']:,.0f}"
        )
    if summary.get("tree") is not None:
        _tree_rows(table, summary["tree"])
    e = summary["errors"]
    by_status = ", ".join(f"{key}: {n}" for key, n in e["by_status"].items())
    table.add_row("errors", f"{e['total']:,}" + (f" ({by_status})" if by_status else ""))
    if summary.get("warmup_requests"):
        table.add_row("warm-up requests (excluded)", f"{summary['warmup_requests']:,}")
    return table


def _tree_rows(table: Table, tree: dict[str, Any]) -> None:
    expected = tree["expected"]
    samples = expected["samples"]
    table.add_row(
        "tree nodes / leaves / samples",
        f"{tree['nodes']:,} / {tree['leaves']:,} / {tree['samples']:,}",
    )
    table.add_row(
        "  expected from the driver",
        f"{expected['nodes']:,} / {expected['leaves']:,} / "
        + ("-" if samples is None else f"{samples:,}"),
    )
    cut = f" ({tree['cut']:,} cut at max_tokens)" if tree["cut"] else ""
    table.add_row(
        "tree retries / forks / resumes",
        f"{tree['retries']:,} / {tree['forks']:,} / {tree['resumes']:,}{cut}",
    )
    unchecked = tree["sessions"] - tree["fetched"]
    # Without reply ids (an upstream that sends none) only the counts could be compared.
    counts_only = tree["fetched"] - tree["matched_by_reply_id"]
    verdict = "match" if not tree["mismatched_sessions"] else "[red]MISMATCH[/red]"
    table.add_row(
        "tree check (sessions)",
        f"{verdict}: {tree['fetched'] - tree['mismatched_sessions']:,} ok, "
        f"{tree['mismatched_sessions']:,} mismatched"
        + (f", {unchecked:,} not fetched" if unchecked else "")
        + (f", {counts_only:,} by counts only" if counts_only else ""),
    )


def print_summary(
    summary: dict[str, Any], console: Console | None = None, title: str = "sessiongate bench"
) -> None:
    (console or Console()).print(summary_table(summary, title))


def write_json(path: Path, summary: dict[str, Any]) -> None:
    path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")


def write_raw(path: Path, records: Iterable[RequestRecord]) -> int:
    """One JSON object per request, in completion order; returns the line count."""
    count = 0
    with path.open("w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record.to_json(), ensure_ascii=False, separators=(",", ":")))
            out.write("\n")
            count += 1
    return count
