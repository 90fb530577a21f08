"""The whole gateway's configuration: one typed object, its sections nested as the TOML file
nests them, built from defaults, a `--config` file and the command line (config/cli.py),
and handed whole to the processes `serve` starts (config/launch.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from sessiongate.config.engines import EnginesConfig
from sessiongate.config.fields import ConfigError, Leaf, leaves, option, section, section_types
from sessiongate.config.front import FrontConfig, ListenConfig
from sessiongate.config.records import LimitsConfig, RecordsConfig
from sessiongate.config.rl import RlConfig
from sessiongate.config.sessions import SessionRoutingConfig, SessionsConfig
from sessiongate.config.workers import WorkersConfig

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@section(title="general", key="")
@dataclass(frozen=True)
class GatewayConfig:
    log_level: str = option("--log-level", default="warning", help="log level (warning)")
    listen: ListenConfig = field(default_factory=ListenConfig)
    front: FrontConfig = field(default_factory=FrontConfig)
    engines: EnginesConfig = field(default_factory=EnginesConfig)
    sessions: SessionsConfig = field(default_factory=SessionsConfig)
    session_routing: SessionRoutingConfig = field(default_factory=SessionRoutingConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    records: RecordsConfig = field(default_factory=RecordsConfig)
    rl: RlConfig = field(default_factory=RlConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)

    def to_dict(self) -> dict[str, Any]:
        """Every value, nested by section (tuples as lists): JSON for the child processes."""
        return _plain(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "configuration") -> GatewayConfig:
        """A configuration from nested values (a TOML file, or JSON from the parent
        process); missing keys keep their defaults. ConfigError names a key that is not an
        option, or a value of the wrong type or out of range."""
        return build(cls, data, (), where)

    def replace(self, **changes: Any) -> GatewayConfig:
        """A copy with `section=..., ...` changed (each a section object or a value)."""
        return dataclasses.replace(self, **changes)


SCHEMA_LEAVES: tuple[Leaf, ...] = tuple(leaves(GatewayConfig))


def _check_unique_dests() -> None:
    flags: dict[str, str] = {}
    for leaf in SCHEMA_LEAVES:
        for flag in leaf.option.every_flag:
            if flag in flags:
                raise AssertionError(f"{flag} declared by {flags[flag]} and {leaf.key}")
            flags[flag] = leaf.key


_check_unique_dests()


def leaf_by_flag(flag: str) -> Leaf:
    for leaf in SCHEMA_LEAVES:
        if flag in leaf.option.flags:
            return leaf
    raise KeyError(flag)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def build(cls: type, data: Mapping[str, Any], path: tuple[str, ...], where: str) -> Any:
    """Section `cls` from `data`, recursively (ConfigError naming the bad key)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: [{'.'.join(path)}] must be a table")
    nested = {name: kind for name, _, kind in section_types(cls)}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        dotted = ".".join((*path, key))
        if key not in fields:
            raise ConfigError(f"{where}: unknown key {dotted!r}" + _did_you_mean(cls, key))
        if key in nested:
            values[key] = build(nested[key], value, (*path, key), where)
        else:
            values[key] = coerce(dotted, fields[key], value, where)
    try:
        return cls(**values)
    except ValueError as exc:
        label = ".".join(path) or "top level"
        raise ConfigError(f"{where}: [{label}] {exc}") from None


def _did_you_mean(cls: type, key: str) -> str:
    import difflib

    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(key, names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(names)})"


def coerce(key: str, field_: dataclasses.Field[Any], value: Any, where: str) -> Any:
    """`value` as field `field_` holds it, or ConfigError naming `key`."""
    from sessiongate.config.fields import option_of

    meta = option_of(field_)
    if meta is None or value is None:
        return value
    flag = f" ({meta.flag})"
    if meta.kind in ("switch", "negated"):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {key}{flag} must be true or false, got {value!r}")
        return value
    if meta.kind in ("append", "list"):
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: {key}{flag} must be a list of strings, got {value!r}")
        if not all(isinstance(item, str) for item in value):
            raise ConfigError(f"{where}: {key}{flag} must be a list of strings, got {value!r}")
        return tuple(value)
    if meta.parse is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: {key}{flag} must be an integer, got {value!r}")
    elif meta.parse is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: {key}{flag} must be a number, got {value!r}")
        value = float(value)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)  # a byte count written as a number, e.g. max_records_bytes = 0
    elif not isinstance(value, str):
        raise ConfigError(f"{where}: {key}{flag} must be a string, got {value!r}")
    if meta.choices is not None and value not in meta.choices:
        raise ConfigError(
            f"{where}: {key}{flag} must be one of {', '.join(meta.choices)}, got {value!r}"
        )
    return value


def sections(config: object) -> Iterator[tuple[str, object]]:
    """(dotted key, section object) of `config` and its subsections."""
    for name, _, _ in section_types(type(config)):
        value = getattr(config, name)
        yield name, value
        for sub, subvalue in sections(value):
            yield f"{name}.{sub}", subvalue


def value_at(config: GatewayConfig, leaf: Leaf) -> Any:
    value: Any = config
    for part in leaf.path:
        value = getattr(value, part)
    return value
