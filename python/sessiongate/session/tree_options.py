"""The session mode's settings from the sessions options: the tree hooks loaded once, so a
bad one stops the start with one clear message (docs/trajectory-trees.md). The options are
declared in config/sessions.py."""

from __future__ import annotations

from typing import Any

from sessiongate.config.sessions import SessionsConfig


def session_mode_settings(sessions: SessionsConfig) -> dict[str, Any]:
    """The SessionSettings fields of the session mode (SystemExit on a bad hook)."""
    from sessiongate.session.tree_hooks import HookKind, load_hook

    hooks: tuple[tuple[HookKind, str], ...] = (
        ("pick", sessions.tree_pick_hook),
        ("postprocess", sessions.tree_postprocess_hook),
    )
    for kind, name in hooks:
        try:
            load_hook(kind, name)
        except ValueError as exc:
            raise SystemExit(f"--tree-{kind}-hook: {exc}") from None
    return {
        "session_mode": sessions.session_mode,
        "tree_pick_hook": sessions.tree_pick_hook,
        "tree_postprocess_hook": sessions.tree_postprocess_hook,
    }
