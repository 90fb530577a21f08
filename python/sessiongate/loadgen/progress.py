"""Live progress: a rich bar on a terminal, a plain line every few seconds otherwise.

Both read the collector's counters; neither touches the request path. Everything goes to
stderr so stdout keeps only the summary (pipe-friendly).
"""

from __future__ import annotations

import asyncio
import sys
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from sessiongate.loadgen.stats import Collector

RICH_REFRESH_S = 0.25
PLAIN_INTERVAL_S = 5.0


def _line(c: Collector, total_trees: int | None) -> str:
    trees = f"{c.trees_done}/{total_trees}" if total_trees is not None else f"{c.trees_done}"
    failed = f" ({c.sessions_failed} failed)" if c.sessions_failed else ""
    return (
        f"{trees} trees, {c.sessions_done} sessions{failed}, {c.turns_done} turns, "
        f"{c.errors} errors, {c.current_rate():.1f} turns/s"
    )


class ProgressDisplay:
    """`mode`: "auto" (rich on a TTY, plain otherwise), "rich", "plain" or "off"."""

    def __init__(
        self,
        collector: Collector,
        *,
        mode: str = "auto",
        total_trees: int | None = None,
        duration_s: float | None = None,
        out: TextIO | None = None,
        interval_s: float = PLAIN_INTERVAL_S,
    ) -> None:
        self.collector = collector
        self.out = out if out is not None else sys.stderr
        if mode == "auto":
            mode = "rich" if self.out.isatty() else "plain"
        self.mode = mode
        self.total_trees = total_trees
        self.duration_s = duration_s
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._progress: Progress | None = None
        self._bar: TaskID | None = None

    def start(self) -> None:
        if self.mode == "off":
            return
        if self.mode == "rich":
            self._progress = Progress(
                TextColumn("[bold]bench[/bold]"),
                BarColumn(bar_width=12),
                TextColumn("{task.fields[line]}"),
                TimeElapsedColumn(),
                console=Console(file=self.out),
                transient=False,
            )
            # Without a known tree count (a --duration run) the bar shows elapsed time.
            total = self.total_trees if self.total_trees is not None else self.duration_s
            self._bar = self._progress.add_task("bench", total=total, line="starting")
            self._progress.start()
        self._task = asyncio.create_task(self._loop())

    def _refresh(self) -> None:
        c = self.collector
        if self._progress is not None and self._bar is not None:
            done = c.trees_done if self.total_trees is not None else c.elapsed()
            self._progress.update(self._bar, completed=done, line=_line(c, self.total_trees))
        else:
            print(f"bench {c.elapsed():7.1f}s: {_line(c, self.total_trees)}", file=self.out)
            self.out.flush()

    async def _loop(self) -> None:
        delay = RICH_REFRESH_S if self.mode == "rich" else self.interval_s
        while True:
            await asyncio.sleep(delay)
            self._refresh()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self.mode == "off":
            return
        self._refresh()  # the final state, on both kinds of display
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
