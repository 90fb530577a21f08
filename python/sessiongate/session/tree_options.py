"""Command-line options of the session mode (linear or tree) and the tree's sample hooks,
shared by `serve`, the worker processes and `sessiongate worker`: declared once, validated
once, forwarded to workers as argv (docs/trajectory-trees.md).
"""

from __future__ import annotations

import argparse
from typing import Any

SESSION_MODES = ("linear", "tree")
DEFAULT_PICK_HOOK = "drop_retries"
DEFAULT_POSTPROCESS_HOOK = "default_postprocess"


def add_session_mode_option(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("session mode (docs/trajectory-trees.md)")
    group.add_argument(
        "--session-mode",
        choices=SESSION_MODES,
        default="linear",
        help="linear (default): a session is one line of turns with a one-step rollback; "
        "tree: each turn attaches at the deepest earlier turn its messages extend, so a "
        "session branches at any depth (retries, forks, resumes) and /samples gives one "
        "sample per leaf",
    )
    group.add_argument(
        "--tree-pick-hook",
        default=DEFAULT_PICK_HOOK,
        metavar="HOOK",
        help="tree mode: which leaves become samples, in which order: drop_retries "
        "(default: drop leaves superseded by a later sibling), keep_all, an import path "
        "(package.module:function) or an entry point of group sessiongate.tree_hooks",
    )
    group.add_argument(
        "--tree-postprocess-hook",
        default=DEFAULT_POSTPROCESS_HOOK,
        metavar="HOOK",
        help="tree mode: finalises the picked samples: default_postprocess (a shared "
        "completion is trained in the earliest kept leaf only; the agent's reward), none, "
        "an import path or an entry point",
    )


def session_mode_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The SessionSettings fields of these options; the hooks are loaded once here so a bad
    one stops the start with one clear message (SystemExit)."""
    from sessiongate.session.tree_hooks import HookKind, load_hook

    hooks: tuple[tuple[HookKind, str], ...] = (
        ("pick", args.tree_pick_hook),
        ("postprocess", args.tree_postprocess_hook),
    )
    for kind, name in hooks:
        try:
            load_hook(kind, name)
        except ValueError as exc:
            raise SystemExit(f"--tree-{kind}-hook: {exc}") from None
    return {
        "session_mode": args.session_mode,
        "tree_pick_hook": args.tree_pick_hook,
        "tree_postprocess_hook": args.tree_postprocess_hook,
    }


def session_mode_argv(args: argparse.Namespace) -> list[str]:
    """These options as the argv a worker process is started with."""
    return [
        "--session-mode",
        args.session_mode,
        "--tree-pick-hook",
        args.tree_pick_hook,
        "--tree-postprocess-hook",
        args.tree_postprocess_hook,
    ]
