"""`sessiongate plugins`: list the session routing modes, their options and defaults."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

from sessiongate.session_routing.mode_registry import ENTRY_POINT_GROUP, ModeInfo, list_modes


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `plugins` subcommand on the top-level CLI."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "plugins",
        help="list session routing modes (built-in and plugins) with their options",
        description="List the modes accepted by --session-routing, with the options "
        f"--session-routing-opt accepts and their defaults. Third-party modes register in the "
        f"entry-point group {ENTRY_POINT_GROUP!r}. Exits 1 when a plugin is broken. "
        "See docs/routing.md.",
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    modes = list_modes()
    if args.json:
        doc = {"entry_point_group": ENTRY_POINT_GROUP, "modes": [asdict(m) for m in modes]}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        _print_table(modes)
    return 1 if any(m.error for m in modes) else 0


def _format_default(option_default: Any, required: bool) -> str:
    if required:
        return "(required)"
    if isinstance(option_default, list):
        return ",".join(str(x) for x in option_default) or "(none)"
    return str(option_default)


def _print_table(modes: list[ModeInfo]) -> None:
    # Imported here so `--json` and other subcommands never pay for rich.
    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.padding import Padding
    from rich.table import Table

    console = Console()
    console.print(
        "[bold]Session routing modes[/bold]  "
        "(sessiongate serve --session-routing MODE --session-routing-opt key=value ...)"
    )
    for mode in modes:
        console.print()
        if mode.error:
            console.print(f"[bold red]{escape(mode.name)}[/bold red]  [red]broken plugin[/red]")
            console.print(Padding(escape(mode.error), (0, 0, 0, 2)), style="red")
            continue
        tags = " [dim](rewrites the request body)[/dim]" if mode.mutates_body else ""
        console.print(f"[bold cyan]{escape(mode.name)}[/bold cyan]{tags}")
        console.print(Padding(escape(mode.description), (0, 0, 0, 2)))
        if mode.source != "built-in":
            console.print(Padding(f"plugin: {escape(mode.source)}", (0, 0, 0, 2)), style="dim")
        if not mode.options:
            console.print(Padding("no options", (0, 0, 0, 2)), style="dim")
            continue
        table = Table(box=box.SIMPLE, padding=(0, 1), pad_edge=False, show_edge=False)
        table.add_column("option", no_wrap=True)
        table.add_column("type", no_wrap=True)
        table.add_column("default", no_wrap=True)
        table.add_column("description")
        for opt in mode.options:
            table.add_row(
                escape(opt.name),
                escape(opt.type),
                escape(_format_default(opt.default, opt.required)),
                escape(opt.description),
            )
        console.print(Padding(table, (0, 0, 0, 2)))
