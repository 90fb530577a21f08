"""`--plot FILE.png`: latency distribution and throughput over time (optional extra).

matplotlib is imported only here and only when a plot is asked for; `require_matplotlib`
runs before the load starts so a missing extra fails in a second, not after the run.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from sessiongate.loadgen.stats import RequestRecord

INSTALL_HINT = "--plot needs matplotlib: pip install 'sessiongate[plot]'"


class PlotUnavailable(RuntimeError):
    pass


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise PlotUnavailable(INSTALL_HINT) from exc


def write_plot(path: Path, records: list[RequestRecord], summary: dict[str, Any]) -> None:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    chats = [r for r in records if r.kind == "chat" and not r.warmup]
    ok = [r for r in chats if r.error_key is None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))

    latencies = [r.latency_s * 1000 for r in ok]
    if latencies:
        bins = min(60, max(10, int(math.sqrt(len(latencies)))))
        left.hist(latencies, bins=bins, alpha=0.75, label="request latency")
        ttfts = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
        if ttfts:
            left.hist(ttfts, bins=bins, alpha=0.6, label="TTFT")
        dist = summary.get("latency_ms") or {}
        for q, style in (("p50", "-"), ("p99", "--")):
            if q in dist:
                left.axvline(
                    dist[q], color="black", linestyle=style, linewidth=1, label=f"latency {q}"
                )
        left.legend()
    left.set_title("Chat request latency")
    left.set_xlabel("ms")
    left.set_ylabel("requests")

    if chats:
        end = max(r.start_s + r.latency_s for r in chats)
        width = max(end / 60, 0.01)  # about 60 bins whatever the run's length
        n = int(end / width) + 1
        turns = [0] * n
        errors = [0] * n
        for r in chats:
            slot = min(n - 1, int((r.start_s + r.latency_s) / width))
            if r.error_key is None:
                turns[slot] += 1
            else:
                errors[slot] += 1
        xs = [i * width for i in range(n)]
        right.plot(xs, [v / width for v in turns], label="turns/s")
        if any(errors):
            right.plot(xs, [v / width for v in errors], label="errors/s", color="tab:red")
        right.legend()
    right.set_title("Throughput over time")
    right.set_xlabel("s since start")
    right.set_ylabel("per second")
    run = summary.get("run", {})
    fig.suptitle(f"sessiongate bench: {run.get('target', '')} {run.get('url', '')}".strip())
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
