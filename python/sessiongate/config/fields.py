"""How a configuration field declares its command-line option: flag, default, help and the
commands that take it, in the field's own metadata.

Every tunable of the gateway is one dataclass field of a section (`config/*.py`); its
`option(...)` metadata is all the command line, the TOML file and `--print-config` know of
it, so adding a tunable is adding one field (docs/development.md, "Adding an option"). The
argparse parsers are generated from these fields (config/cli.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

# The commands whose options come from the schema.
SERVE = "serve"
WORKER = "worker"
BOTH = frozenset({SERVE, WORKER})
ONLY_SERVE = frozenset({SERVE})
ONLY_WORKER = frozenset({WORKER})

# value: `--flag VALUE`; switch: `--flag` sets True; negated: `--flag` sets False;
# append: `--flag VALUE` repeatable, a list; list: `--flag VALUE...` (one or more values,
# repeatable), a list that replaces the default.
Kind = Literal["value", "switch", "negated", "append", "list"]


class ConfigError(ValueError):
    """A configuration value or key that cannot be used; the message names it."""


@dataclass(frozen=True)
class Option:
    flags: tuple[str, ...]
    help: str
    commands: frozenset[str]
    kind: Kind = "value"
    # How a command-line string becomes the value (`value`, `append` and `list` kinds).
    parse: Callable[[str], Any] = str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    # Commands on which the flag must be given.
    required_in: frozenset[str] = frozenset()
    # An environment variable whose value is the default (read when the parser is built).
    env: str | None = None
    # Not listed in --help (set by serve for its own workers).
    hidden: bool = False
    # Flags of one mutually exclusive group of a command (the group's name).
    exclusive: str | None = None
    # Secrets: --print-config shows whether they are set, never their value.
    secret: bool = False
    # `switch` kind: flags that set it False again (smg's --disable-X beside its --X).
    off_flags: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        """The flag messages name."""
        return self.flags[0]

    @property
    def every_flag(self) -> tuple[str, ...]:
        return self.flags + self.off_flags


def option(
    *flags: str,
    default: Any = None,
    help: str,
    commands: frozenset[str] = BOTH,
    kind: Kind = "value",
    parse: Callable[[str], Any] = str,
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
    required_in: frozenset[str] = frozenset(),
    env: str | None = None,
    hidden: bool = False,
    exclusive: str | None = None,
    secret: bool = False,
    off_flags: tuple[str, ...] = (),
) -> Any:
    """A dataclass field with its command-line option."""
    meta = Option(
        flags=flags,
        help=help,
        commands=commands,
        kind=kind,
        parse=parse,
        metavar=metavar,
        choices=choices,
        required_in=required_in,
        env=env,
        hidden=hidden,
        exclusive=exclusive,
        secret=secret,
        off_flags=off_flags,
    )
    if isinstance(default, (list, dict, set)):
        frozen = tuple(default)
        return dataclasses.field(default=frozen, metadata={"option": meta})
    return dataclasses.field(default=default, metadata={"option": meta})


def section(*, title: str, key: str) -> Callable[[type], type]:
    """Marks a dataclass as a section: `key` in the TOML file, `title` of its --help group."""

    def mark(cls: type) -> type:
        cls.SECTION_KEY = key  # type: ignore[attr-defined]
        cls.SECTION_TITLE = title  # type: ignore[attr-defined]
        return cls

    return mark


def option_of(field: dataclasses.Field[Any]) -> Option | None:
    found = field.metadata.get("option")
    return found if isinstance(found, Option) else None


def is_section(value: object) -> bool:
    return dataclasses.is_dataclass(value) and hasattr(value, "SECTION_KEY")


@dataclass(frozen=True)
class Leaf:
    """One option field, where it sits in the configuration."""

    path: tuple[str, ...]  # section keys, then the field name
    field: dataclasses.Field[Any]
    option: Option

    @property
    def key(self) -> str:
        return ".".join(self.path)

    @property
    def dest(self) -> str:
        """The argparse destination: unique over the whole schema (checked)."""
        return "__".join(self.path)


def section_types(cls: type) -> Iterator[tuple[str, dataclasses.Field[Any], type]]:
    """The fields of `cls` that are nested sections, with their classes."""
    hints = _hints(cls)
    for field in dataclasses.fields(cls):
        kind = hints.get(field.name)
        if isinstance(kind, type) and hasattr(kind, "SECTION_KEY"):
            yield field.name, field, kind


def leaves(cls: type, path: tuple[str, ...] = ()) -> Iterator[Leaf]:
    """Every option field of section class `cls` and its subsections, in declaration order."""
    nested = {name for name, _, _ in section_types(cls)}
    hints = _hints(cls)
    for field in dataclasses.fields(cls):
        if field.name in nested:
            yield from leaves(hints[field.name], (*path, field.name))
            continue
        meta = option_of(field)
        if meta is not None:
            yield Leaf((*path, field.name), field, meta)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    import typing

    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def field_type(cls: type, name: str) -> Any:
    return _hints(cls)[name]


def flag_of(cls: type, name: str) -> str:
    """The flag of option field `name` of section `cls`, for the messages that name it (so
    the flag is written once, where it is declared)."""
    for field in dataclasses.fields(cls):
        if field.name == name:
            meta = option_of(field)
            if meta is not None:
                return meta.flag
    raise KeyError(f"{cls.__name__} has no option {name!r}")
