"""The command lines of `serve` and `worker`, generated from the configuration schema, and
the configuration they yield: built-in defaults (environment defaults included), then the
`--config` TOML file, then the flags given on the command line, each layer winning over the
one before (docs/deployment.md, "Configuration file")."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Collection, Sequence
from typing import Any

from sessiongate.config.engines import DEFAULT_POLICY, POLICY_TUNABLES
from sessiongate.config.fields import ConfigError, Leaf
from sessiongate.config.gateway import SCHEMA_LEAVES, GatewayConfig, build

# Where the flags given on the command line are noted on the namespace.
_GIVEN = "_given_options"
CONFIG_DEST = "config_file"


# Given a command's arguments and the option strings its parser declares, the message for
# the first argument it refuses by name, or None (serve: smg's flags, config/smg_flags.py).
Refusal = Callable[[Sequence[str], Collection[str]], "str | None"]


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser (sessiongate/cli.py builds them all with this class). With a
    `refuse` check, the arguments are read by it before argparse reads them: a flag another
    gateway declares exits with status 2 and one line naming it and what to write instead,
    rather than argparse's "unrecognized arguments" (or a silent prefix match)."""

    refuse: Refusal | None = None

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if self.refuse is not None:
            message = self.refuse(
                sys.argv[1:] if args is None else list(args), self._option_string_actions
            )
            if message is not None:
                self.exit(2, f"{self.prog}: error: {message}\n")
        return super().parse_known_args(args, namespace)


def refuse_flags(parser: argparse.ArgumentParser, refuse: Refusal) -> None:
    """Gives `parser` (a CommandParser) its `refuse` check."""
    if not isinstance(parser, CommandParser):
        raise TypeError(
            "the subcommands' parsers must be CommandParser (add_subparsers(parser_class=...))"
        )
    parser.refuse = refuse


class _Noted(argparse.Action):
    """Notes that its flag was given (so a --config file does not override it)."""

    def note(self, namespace: argparse.Namespace) -> None:
        given = getattr(namespace, _GIVEN, None)
        if given is None:
            given = set()
            setattr(namespace, _GIVEN, given)
        given.add(self.dest)


class _Store(_Noted):
    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        self.note(namespace)
        setattr(namespace, self.dest, values)


class _Append(_Noted):
    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        self.note(namespace)
        # Every append option defaults to nothing, so the first use starts the list.
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), values])


class _Extend(_Noted):
    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        given = self.dest in getattr(namespace, _GIVEN, ())
        self.note(namespace)
        # The first use replaces the default; later ones add to it.
        before = getattr(namespace, self.dest, None) if given else None
        setattr(namespace, self.dest, [*(before or []), *values])


class _Const(_Noted):
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs["nargs"] = 0
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        self.note(namespace)
        setattr(namespace, self.dest, self.const)


def command_leaves(command: str) -> list[Leaf]:
    return [leaf for leaf in SCHEMA_LEAVES if command in leaf.option.commands]


def add_options(parser: argparse.ArgumentParser, command: str) -> None:
    """Every option of `command` ("serve" or "worker"), grouped by section, plus --config
    and --print-config."""
    groups: dict[str, Any] = {}
    exclusive: dict[str, Any] = {}
    for leaf in command_leaves(command):
        title = _title(leaf)
        if title not in groups:
            groups[title] = parser if title == "general" else parser.add_argument_group(title)
        target = groups[title]
        meta = leaf.option
        if meta.exclusive is not None:
            if meta.exclusive not in exclusive:
                required = any(
                    command in other.option.required_in
                    for other in command_leaves(command)
                    if other.option.exclusive == meta.exclusive
                )
                exclusive[meta.exclusive] = target.add_mutually_exclusive_group(required=required)
            target = exclusive[meta.exclusive]
        target.add_argument(*meta.flags, **_argument(leaf, command))
        if meta.off_flags:
            target.add_argument(
                *meta.off_flags,
                dest=leaf.dest,
                action=_Const,
                const=False,
                default=argparse.SUPPRESS,
                help=f"switch {meta.flag} off",
            )
    files = parser.add_argument_group("configuration file (docs/deployment.md)")
    files.add_argument(
        "--config",
        dest=CONFIG_DEST,
        default=None,
        metavar="FILE",
        help="read options from this TOML file (its tables are the configuration's "
        "sections); flags given on the command line win over it",
    )
    files.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective configuration as TOML (secrets shown as set or not) and exit",
    )


def _title(leaf: Leaf) -> str:
    from sessiongate.config.gateway import GatewayConfig as _Top

    cls: Any = _Top
    for part in leaf.path[:-1]:
        cls = _section_class(cls, part)
    return str(cls.SECTION_TITLE)


def _section_class(cls: Any, name: str) -> Any:
    from sessiongate.config.fields import section_types

    for field_name, _, kind in section_types(cls):
        if field_name == name:
            return kind
    raise KeyError(name)


def _argument(leaf: Leaf, command: str) -> dict[str, Any]:
    meta = leaf.option
    default = leaf.field.default
    if meta.env is not None:
        default = os.environ.get(meta.env)
    if isinstance(default, tuple):
        default = list(default)
    kwargs: dict[str, Any] = {
        "dest": leaf.dest,
        "default": default,
        "help": argparse.SUPPRESS if meta.hidden else meta.help,
    }
    if meta.kind == "switch":
        kwargs["action"], kwargs["const"] = _Const, True
    elif meta.kind == "negated":
        kwargs["action"], kwargs["const"] = _Const, False
    else:
        kwargs["action"] = {"append": _Append, "list": _Extend}.get(meta.kind, _Store)
        if meta.kind == "list":
            kwargs["nargs"] = "+"
        kwargs["type"] = meta.parse
        # As argparse names a value after its flag (the dest is the configuration key).
        kwargs["metavar"] = meta.metavar or meta.flag.lstrip("-").upper().replace("-", "_")
        if meta.choices is not None:
            kwargs["choices"] = meta.choices
        if command in meta.required_in:
            kwargs["required"] = True
    return kwargs


def config_from_args(args: argparse.Namespace, command: str) -> GatewayConfig:
    """The effective configuration: defaults, then the --config file, then the given flags.
    SystemExit naming the key or flag when a value cannot be used."""
    from sessiongate.config.files import read_config_file

    given: set[str] = getattr(args, _GIVEN, set())
    values: dict[str, Any] = {}
    path = getattr(args, CONFIG_DEST, None)
    try:
        if path:
            _merge(values, read_config_file(path), command, path)
        for leaf in command_leaves(command):
            if leaf.dest in given or not _has(values, leaf.path):
                _put(values, leaf.path, getattr(args, leaf.dest))
        return build(GatewayConfig, values, (), path or "command line")
    except ConfigError as exc:
        raise SystemExit(f"sessiongate {command}: {exc}") from None


def _merge(values: dict[str, Any], data: dict[str, Any], command: str, where: str) -> None:
    """The file's values (only options `command` takes; ConfigError on any other key)."""
    known = {leaf.path: leaf for leaf in SCHEMA_LEAVES}

    def walk(node: dict[str, Any], path: tuple[str, ...]) -> None:
        for key, value in node.items():
            here = (*path, key)
            if isinstance(value, dict):
                walk(value, here)
                continue
            leaf = known.get(here)
            if leaf is None:
                continue  # build() names unknown keys
            if command not in leaf.option.commands:
                raise ConfigError(
                    f"{where}: {'.'.join(here)} ({leaf.option.flag}) is not an option of "
                    f"`sessiongate {command}`"
                )
            _put(values, here, value)
        if not node and path:
            _put_table(values, path)

    walk(data, ())
    # Unknown keys and tables: build() reports them with the file's name.
    build(GatewayConfig, data, (), where)
    _check_policy_variant(data, values, where)


def _check_policy_variant(data: dict[str, Any], values: dict[str, Any], where: str) -> None:
    """A file's [engines.routing] table holds the policy and only the tunables it reads."""
    table = data.get("engines", {}).get("routing", {})
    policy = values.get("engines", {}).get("routing", {}).get("policy", DEFAULT_POLICY)
    reads = POLICY_TUNABLES.get(policy, ())
    for key in table:
        if key != "policy" and key not in reads:
            raise ConfigError(
                f"{where}: engines.routing.{key} does not apply to policy {policy!r} "
                f"(it reads: {', '.join(reads) or 'nothing'})"
            )


def _put(values: dict[str, Any], path: Sequence[str], value: Any) -> None:
    node = values
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value


def _put_table(values: dict[str, Any], path: Sequence[str]) -> None:
    node = values
    for part in path:
        node = node.setdefault(part, {})


def _has(values: dict[str, Any], path: Sequence[str]) -> bool:
    node: Any = values
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True
