"""The `sessiongate` command line: one subcommand per process kind."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


class _PrintVersion(argparse.Action):
    """`--version`: the package and the Rust core's build, on one unwrapped line."""

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        from sessiongate.build import version_text

        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sessiongate",
        description="Session-aware gateway for multi-turn and agentic LLM traffic.",
    )
    parser.add_argument(
        "--version",
        nargs=0,
        action=_PrintVersion,
        help="print the version and the Rust core's build (target, profile, rustc), then exit",
    )
    from sessiongate.config.cli import CommandParser

    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=CommandParser
    )

    from sessiongate.dataplane import router_main
    from sessiongate.dataplane.worker import main as worker_main
    from sessiongate.dataplane.worker import server as worker_server
    from sessiongate.demo import run as demo
    from sessiongate.loadgen import cli as bench_cli
    from sessiongate.mock_engine import cli as mock_engine_cli
    from sessiongate.server import serve
    from sessiongate.session_routing import cli as routing_cli

    serve.add_parser(sub)
    worker_server.add_parser(sub)
    demo.add_parser(sub)
    bench_cli.add_parser(sub)
    router_main.add_parser(sub)
    worker_main.add_parser(sub)
    mock_engine_cli.add_parser(sub)
    routing_cli.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    result: int = args.run(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
