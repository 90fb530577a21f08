"""Options of the engine registry: the management routes' key, and (router only) whether
its start-up engine is the embedded mock that the first registration replaces. Declared
here once; `serve` adds `--admin-key`, the router process gets the key by environment (never
argv, so it does not show in `ps`) and the mock marker by argv."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

ADMIN_KEY_ENV = "SESSIONGATE_ADMIN_KEY"
# How serve hands the admin key to its router process.
ROUTER_ADMIN_KEY_ENV = "SESSIONGATE_ROUTER_ADMIN_KEY"


@dataclass(frozen=True)
class EngineSettings:
    admin_key: str | None
    # The static engine is the embedded mock: the first registration replaces it.
    placeholder: bool


def add_engine_arguments(parser: argparse.ArgumentParser, *, router: bool = False) -> None:
    if router:
        parser.add_argument("--engines-placeholder", action="store_true", help=argparse.SUPPRESS)
        return
    parser.add_argument(
        "--admin-key",
        default=os.environ.get(ADMIN_KEY_ENV),
        help="require 'Authorization: Bearer KEY' on the engine management routes "
        "(/workers, /add_worker, ...) instead of --api-key (default: $SESSIONGATE_ADMIN_KEY; "
        "without either, they are open like the rest of the gateway)",
    )


def engine_argv(*, placeholder: bool) -> list[str]:
    """The router's engine options (`placeholder`: its --backend is the embedded mock)."""
    return ["--engines-placeholder"] if placeholder else []


def engine_env(args: argparse.Namespace) -> dict[str, str]:
    """The router's environment for these options (the key)."""
    return {ROUTER_ADMIN_KEY_ENV: args.admin_key} if args.admin_key else {}


def engine_settings(args: argparse.Namespace, *, router: bool = False) -> EngineSettings:
    if router:
        return EngineSettings(
            admin_key=os.environ.get(ROUTER_ADMIN_KEY_ENV) or None,
            placeholder=bool(args.engines_placeholder),
        )
    if args.admin_key is not None and not args.admin_key.strip():
        raise SystemExit("--admin-key must not be empty")
    return EngineSettings(admin_key=args.admin_key or None, placeholder=False)
