"""`sessiongate bench`: options, workload choice, outputs, exit codes (docs/bench.md)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from sessiongate.loadgen.pacing import Pacing
from sessiongate.loadgen.plot import PlotUnavailable, require_matplotlib, write_plot
from sessiongate.loadgen.report import print_summary, write_json, write_raw
from sessiongate.loadgen.runner import TARGETS, BenchConfig, BenchOutcome, run_bench
from sessiongate.loadgen.trace import TraceError, TraceHeader, read_trace_file, write_trace_file
from sessiongate.loadgen.tree_log import PICKERS
from sessiongate.loadgen.tree_workload import TreeOptions, TreeSessionSpec, TreeWorkload
from sessiongate.loadgen.workload import (
    DEFAULT_TOOLS,
    SessionSpec,
    SyntheticOptions,
    SyntheticWorkload,
)
from sessiongate.session_routing import RoutingConfigError

DEFAULT_SESSIONS = 16
DEFAULT_CONCURRENCY = 8
EXIT_ERRORS = 1  # --fail-on-errors and some request failed
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "bench",
        help="drive multi-turn, sub-agent session families against sessiongate or any "
        "OpenAI endpoint and report throughput, latency and errors",
        description="Load driver: replay synthetic or recorded (JSONL trace) session families "
        "against the sessiongate session API or a plain OpenAI-compatible endpoint, with "
        "live progress and a summary (docs/bench.md).",
    )
    add_bench_arguments(parser)
    parser.set_defaults(run=run)


def _warmup(value: str) -> tuple[int, float]:
    """`--warmup 10` (sessions) or `--warmup 5s` (seconds)."""
    text = value.strip().lower()
    try:
        if text.endswith("s"):
            seconds = float(text[:-1])
            if seconds < 0:
                raise ValueError
            return 0, seconds
        count = int(text)
        if count < 0:
            raise ValueError
        return count, 0.0
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--warmup {value!r}: give a session count (10) or seconds (5s)"
        ) from None


def _header(value: str) -> tuple[str, str]:
    name, sep, content = value.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"--header {value!r}: expected 'Name: value'")
    return name.strip(), content.strip()


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    # Group order is the order of --help.
    add_target_arguments(parser)
    add_workload_arguments(parser)
    add_tree_arguments(parser)
    add_pacing_arguments(parser)
    add_output_arguments(parser)


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    t = parser.add_argument_group("target")
    t.add_argument(
        "--url", default="http://127.0.0.1:8000", help="base URL (http://127.0.0.1:8000)"
    )
    t.add_argument(
        "--target",
        choices=TARGETS,
        default="sessiongate",
        help="sessiongate: the session API (create, chat, records GET, DELETE); openai: plain "
        "POST /v1/chat/completions with the full history (default: sessiongate)",
    )
    t.add_argument(
        "--session-routing",
        metavar="MODE",
        default=None,
        help="--target openai: stamp session identity with this routing mode "
        "(`sessiongate plugins` lists them)",
    )
    t.add_argument(
        "--session-routing-opt",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="option of the routing mode (repeatable)",
    )
    t.add_argument("--chat-path", default="/v1/chat/completions", help="--target openai: chat path")
    t.add_argument(
        "--model", default=None, help="model field (default: first id of GET /v1/models)"
    )
    t.add_argument(
        "--api-key",
        default=os.environ.get("SESSIONGATE_API_KEY"),
        help="send 'Authorization: Bearer KEY' (default: $SESSIONGATE_API_KEY); never recorded",
    )
    t.add_argument(
        "--header",
        type=_header,
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="extra header on every request (repeatable; shown in --raw)",
    )
    t.add_argument(
        "--insecure", action="store_true", help="https: do not verify the server certificate"
    )
    t.add_argument("--stream", action="store_true", help="stream replies (SSE) and measure TTFT")
    t.add_argument("--timeout", type=float, default=600.0, help="seconds per request (600)")
    t.add_argument(
        "--no-records",
        dest="records",
        action="store_false",
        help="--target sessiongate: skip the records GET before DELETE",
    )


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    w = parser.add_argument_group("workload (synthetic unless --trace)")
    w.add_argument("--trace", type=Path, default=None, help="replay this JSONL trace")
    w.add_argument(
        "--write-trace",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the synthetic workload (--warmup + --sessions roots) as a trace and exit",
    )
    w.add_argument("--seed", type=int, default=0, help="workload and arrival seed (0)")
    w.add_argument("--turns", type=float, default=4.0, help="turns per session, mean (4)")
    w.add_argument("--turns-stddev", type=float, default=0.0, help="turns stddev (0)")
    w.add_argument(
        "--system-tokens", type=int, default=32, help="system prompt words, 0 = none (32)"
    )
    w.add_argument("--prompt-tokens", type=int, default=64, help="first user message words (64)")
    w.add_argument(
        "--append-messages", type=int, default=1, help="messages appended per later turn (1)"
    )
    w.add_argument("--append-tokens", type=int, default=32, help="words per appended message (32)")
    w.add_argument(
        "--tool-ratio",
        type=float,
        default=0.5,
        help="share of appended messages that are tool results, else user (0.5)",
    )
    w.add_argument("--max-tokens", type=int, default=32, help="max_tokens per turn, mean (32)")
    w.add_argument("--max-tokens-stddev", type=float, default=0.0, help="max_tokens stddev (0)")
    w.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos: true (replies of exactly max_tokens on SGLang/vLLM)",
    )
    w.add_argument(
        "--think-time",
        type=float,
        default=0.0,
        help="seconds between a reply and the next turn, mean (0)",
    )
    w.add_argument("--think-time-stddev", type=float, default=0.0, help="think time stddev (0)")
    w.add_argument(
        "--child-prob",
        type=float,
        default=0.0,
        help="probability that a turn spawns sub-agent sessions (0)",
    )
    w.add_argument("--fanout", type=int, default=1, help="children per spawning turn (1)")
    w.add_argument("--depth", type=int, default=1, help="deepest child level, root = 0 (1)")
    w.add_argument(
        "--max-spawns", type=int, default=0, help="spawning turns per session, 0 = no limit (0)"
    )
    w.add_argument(
        "--child-turns",
        type=float,
        default=None,
        help="turns per child session, mean (default: --turns)",
    )
    w.add_argument(
        "--child-turns-stddev",
        type=float,
        default=None,
        help="child turns stddev (default: --turns-stddev)",
    )
    w.add_argument(
        "--no-wait-children",
        dest="wait_children",
        action="store_false",
        help="a parent's next turn does not wait for the children its previous turn spawned",
    )
    w.add_argument("--tools", action="store_true", help="send a tool definition with every request")
    w.add_argument(
        "--r3", action="store_true", help="ask for routed experts (return_routed_experts: true)"
    )


def add_pacing_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser.add_argument_group("pacing")
    p.add_argument(
        "--sessions",
        type=int,
        default=None,
        help=f"root sessions to run ({DEFAULT_SESSIONS}; a trace: all of it)",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="start sessions for this many seconds instead of a count",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help=f"session families in flight ({DEFAULT_CONCURRENCY}; unlimited with --request-rate)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="Poisson arrivals of session families per second",
    )
    p.add_argument(
        "--warmup",
        type=_warmup,
        default=(0, 0.0),
        metavar="N|Ns",
        help="exclude the first N sessions (a separate phase) or Ns seconds from the figures",
    )


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    o = parser.add_argument_group("output")
    o.add_argument(
        "--json", type=Path, default=None, metavar="FILE", help="write the summary as JSON"
    )
    o.add_argument(
        "--raw", type=Path, default=None, metavar="FILE", help="write one JSON line per request"
    )
    o.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE.png",
        help="latency distribution and throughput over time (needs sessiongate[plot])",
    )
    o.add_argument(
        "--progress",
        choices=("auto", "rich", "plain", "off"),
        default="auto",
        help="live progress on stderr (auto: a bar on a terminal, lines otherwise)",
    )
    o.add_argument(
        "--progress-interval",
        type=float,
        default=5.0,
        help="seconds between plain progress lines (5)",
    )
    o.add_argument("--fail-on-errors", action="store_true", help="exit 1 when any request failed")


def add_tree_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        'tree sessions (a gateway in --session-mode tree; docs/bench.md "Tree sessions")',
        "Any --tree-*-rate above 0, or --tree, makes every root a tree session: the "
        "synthetic main line plus retries, forks and a resume; each session ends with its "
        "records GET and POST /samples, and the gateway's tree is checked against what the "
        "driver did.",
    )
    g.add_argument("--tree", action="store_true", help="tree sessions even with every rate at 0")
    g.add_argument(
        "--tree-retry-rate",
        type=float,
        default=0.0,
        metavar="P",
        help="per turn, probability that it is sent twice, the first reply abandoned (0)",
    )
    g.add_argument(
        "--tree-fork-rate",
        type=float,
        default=0.0,
        metavar="P",
        help="per main-line turn but the last, probability that a second branch forks off "
        "after its reply and runs alongside (0)",
    )
    g.add_argument(
        "--tree-fork-turns", type=int, default=2, metavar="N", help="turns of a fork (2)"
    )
    g.add_argument(
        "--tree-resume-rate",
        type=float,
        default=0.0,
        metavar="P",
        help="per session, probability that it finally resumes from an earlier main-line turn (0)",
    )
    g.add_argument(
        "--tree-resume-turns", type=int, default=2, metavar="N", help="turns of a resume (2)"
    )
    g.add_argument(
        "--tree-expect-pick",
        choices=PICKERS,
        default="drop_retries",
        help="the gateway's --tree-pick-hook, to expect the sample count (off: only count "
        "them; default drop_retries)",
    )


def tree_options(args: argparse.Namespace) -> TreeOptions | None:
    """The tree workload's options, or None for a linear run."""
    options = TreeOptions(
        retry_rate=args.tree_retry_rate,
        fork_rate=args.tree_fork_rate,
        fork_turns=args.tree_fork_turns,
        resume_rate=args.tree_resume_rate,
        resume_turns=args.tree_resume_turns,
    )
    rates = (options.retry_rate, options.fork_rate, options.resume_rate)
    if not args.tree and not any(rates):
        return None
    return options


def synthetic_options(args: argparse.Namespace) -> SyntheticOptions:
    return SyntheticOptions(
        seed=args.seed,
        turns=args.turns,
        turns_stddev=args.turns_stddev,
        system_tokens=args.system_tokens,
        prompt_tokens=args.prompt_tokens,
        append_messages=args.append_messages,
        append_tokens=args.append_tokens,
        tool_ratio=args.tool_ratio,
        max_tokens=args.max_tokens,
        max_tokens_stddev=args.max_tokens_stddev,
        think_time=args.think_time,
        think_time_stddev=args.think_time_stddev,
        child_prob=args.child_prob,
        fanout=args.fanout,
        depth=args.depth,
        max_spawns=args.max_spawns,
        child_turns=args.child_turns,
        child_turns_stddev=args.child_turns_stddev,
        wait_children=args.wait_children,
    )


@dataclasses.dataclass(slots=True)
class Workload:
    roots: Iterable[SessionSpec] | Iterable[TreeSessionSpec]
    sessions: int | None
    tools: list[dict[str, object]] | None
    r3: bool
    label: str
    tree: bool = False


def choose_workload(args: argparse.Namespace, warmup_sessions: int) -> Workload:
    tools = DEFAULT_TOOLS if args.tools else None
    tree = tree_options(args)
    if tree is not None and args.trace is not None:
        raise ValueError("--trace replays linear sessions; tree sessions are synthetic")
    if args.trace is not None:
        header, roots = read_trace_file(args.trace, default_max_tokens=args.max_tokens)
        if not roots:
            raise TraceError(f"{args.trace}: no sessions")
        sessions = args.sessions
        if sessions is None and args.duration is None:
            sessions = len(roots)
        # The trace repeats when the run asks for more roots than it has (or a duration).
        return Workload(
            itertools.cycle(roots),
            sessions,
            header.tools if header.tools is not None else tools,
            args.r3 or header.r3,
            f"trace {args.trace}",
        )
    sessions = args.sessions
    if sessions is None and args.duration is None:
        sessions = DEFAULT_SESSIONS
    if tree is not None:
        label = (
            f"synthetic tree (retry {tree.retry_rate:g}, fork {tree.fork_rate:g} x "
            f"{tree.fork_turns}, resume {tree.resume_rate:g} x {tree.resume_turns})"
        )
        tree_roots = TreeWorkload(synthetic_options(args), tree)
        return Workload(tree_roots, sessions, tools, args.r3, label, tree=True)
    return Workload(
        SyntheticWorkload(synthetic_options(args)), sessions, tools, args.r3, "synthetic"
    )


def _write_trace(args: argparse.Namespace, warmup_sessions: int) -> int:
    if args.trace is not None:
        raise ValueError("--write-trace writes the synthetic workload; drop --trace")
    if tree_options(args) is not None:
        raise ValueError("--write-trace writes linear sessions; drop the --tree options")
    if args.sessions is None and args.duration is not None:
        raise ValueError("--write-trace needs --sessions (a duration has no fixed length)")
    options = synthetic_options(args)
    generator = SyntheticWorkload(options)
    count = warmup_sessions + (args.sessions or DEFAULT_SESSIONS)
    roots = [generator.root(i) for i in range(count)]
    header = TraceHeader(
        tools=DEFAULT_TOOLS if args.tools else None,
        r3=args.r3,
        generator={"synthetic": dataclasses.asdict(options), "roots": count},
    )
    written = write_trace_file(args.write_trace, roots, header)
    print(f"wrote {count} root sessions ({written} sessions) to {args.write_trace}")
    return 0


def outputs(args: argparse.Namespace, outcome: BenchOutcome, console: Console) -> None:
    print_summary(outcome.summary, console)
    if args.json is not None:
        write_json(args.json, outcome.summary)
    if args.raw is not None:
        write_raw(args.raw, outcome.collector.records)
    if args.plot is not None:
        write_plot(args.plot, outcome.collector.records, outcome.summary)


def check_outputs(args: argparse.Namespace) -> None:
    """Fail before the run, not after it, when an output file cannot be created."""
    for flag in ("json", "raw", "plot", "write_trace"):
        path: Path | None = getattr(args, flag)
        if path is not None and not path.resolve().parent.is_dir():
            raise ValueError(f"--{flag.replace('_', '-')} {path}: directory does not exist")


def run(args: argparse.Namespace) -> int:
    err = Console(stderr=True)
    warmup_sessions, warmup_s = args.warmup
    try:
        check_outputs(args)
        if args.write_trace is not None:
            return _write_trace(args, warmup_sessions)
        if args.plot is not None:
            require_matplotlib()  # before the run, not after it
        workload = choose_workload(args, warmup_sessions)
        concurrency = args.concurrency
        if concurrency is None and args.request_rate is None:
            concurrency = DEFAULT_CONCURRENCY
        pacing = Pacing(
            sessions=workload.sessions,
            concurrency=concurrency,
            request_rate=args.request_rate,
            duration_s=args.duration,
            warmup_sessions=warmup_sessions,
            warmup_s=warmup_s,
            seed=args.seed,
        )
        config = BenchConfig(
            url=args.url,
            pacing=pacing,
            target=args.target,
            model=args.model,
            stream=args.stream,
            timeout=args.timeout,
            tools=workload.tools,
            r3=workload.r3,
            ignore_eos=args.ignore_eos,
            records=args.records,
            api_key=args.api_key,
            headers=dict(args.header),
            session_routing=args.session_routing,
            session_routing_opts=args.session_routing_opt,
            chat_path=args.chat_path,
            progress=args.progress,
            progress_interval_s=args.progress_interval,
            workload_label=workload.label,
            verify_tls=not args.insecure,
            tree=workload.tree,
            tree_pick=args.tree_expect_pick,
        )
        config.check()
        total = None if pacing.sessions is None else warmup_sessions + pacing.sessions
        outcome = asyncio.run(run_bench(config, workload.roots, total_trees=total))
    except (ValueError, TraceError, RoutingConfigError, PlotUnavailable, OSError) as exc:
        err.print(f"[red]sessiongate bench:[/red] {escape(str(exc))}", highlight=False)
        return EXIT_USAGE
    except KeyboardInterrupt:
        err.print("sessiongate bench: interrupted twice, no summary")
        return EXIT_INTERRUPTED
    console = Console()
    try:
        outputs(args, outcome, console)
    except (OSError, PlotUnavailable) as exc:
        err.print(
            f"[red]sessiongate bench:[/red] cannot write output: {escape(str(exc))}",
            highlight=False,
        )
        return EXIT_USAGE
    if outcome.interrupted:
        return EXIT_INTERRUPTED
    if args.fail_on_errors and outcome.summary["errors"]["total"]:
        return EXIT_ERRORS
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m sessiongate.loadgen.cli ...` until the lead wires `bench` into the CLI."""
    parser = argparse.ArgumentParser(prog="sessiongate")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(argv)
    result: int = args.run(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
